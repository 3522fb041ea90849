//! `meili-test-server [--port N] [--master-key K] [--task-delay-ms N]`: runs the test server
//! until killed. The first stdout line is `listening on http://127.0.0.1:PORT`.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use meili_test_server::{Config, TestServer};

fn parse_args() -> Result<Config, String> {
    let mut config = Config {
        master_key: std::env::var("MEILI_MASTER_KEY").ok(),
        ..Config::default()
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--port" => config.port = value()?.parse().map_err(|e| format!("--port: {e}"))?,
            "--master-key" => config.master_key = Some(value()?),
            "--task-delay-ms" => {
                let ms = value()?
                    .parse()
                    .map_err(|e| format!("--task-delay-ms: {e}"))?;
                config.task_delay = Duration::from_millis(ms);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    config.master_key = config.master_key.filter(|k| !k.is_empty());
    Ok(config)
}

fn main() -> ExitCode {
    let config = match parse_args() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("meili-test-server: {e}\nusage: meili-test-server [--port N] [--master-key K] [--task-delay-ms N]");
            return ExitCode::from(2);
        }
    };
    let server = match TestServer::start_with(config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("meili-test-server: cannot listen: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut out = std::io::stdout();
    let _ = writeln!(out, "listening on {}", server.url());
    let _ = out.flush();
    loop {
        std::thread::park();
    }
}
