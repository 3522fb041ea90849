//! Load command: measures pg_meili_sync against Meilisearch (the test server, or the real one at
//! MEILI_URL with MEILI_MASTER_KEY) and prints throughput, the task worker's CPU seconds and peak RSS.
//!
//!   cargo run --release -p pg_meili_sync_load -- backfill [rows] [batch_size] [max_inflight]
//!   cargo run --release -p pg_meili_sync_load -- stream [rows] [rows_per_transaction]
//!   cargo run --release -p pg_meili_sync_load -- latency [transactions] [per_second]
//!
//! Set LOAD_VERIFY=1 to also check that the index holds exactly the table's rows afterwards.

use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::{Meili, Method};
use pg_meili_sync_e2e::{products, wait_for};
use serde_json::json;

/// utime + stime of a process, in seconds (from /proc/PID/stat).
fn cpu_seconds(pid: i64) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    let per_second = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()?;
    let per_second: f64 = String::from_utf8_lossy(&per_second.stdout)
        .trim()
        .parse()
        .ok()?;
    Some(ticks / per_second)
}

/// A memory figure of /proc/PID/status in MiB: VmHWM is the peak resident set (it includes the
/// shared buffers the backend touched), RssAnon the process's own memory now.
fn memory_mib(pid: i64, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with(field))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

struct Setup {
    meili: Meili,
    cluster: Cluster,
    index: String,
    task: i64,
}

fn setup(rows: i64, options: serde_json::Value) -> Setup {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    if rows > 0 {
        cluster.psql(&products::insert_sql(1, rows));
    }
    cluster.psql("VACUUM ANALYZE products");
    let index = meili.unique_index("products_load");
    let options = meili.options(options);
    let task: i64 = cluster
        .psql(&format!(
            "SELECT meili_sync_start('products', '{index}', '{options}')"
        ))
        .parse()
        .expect("task id");
    Setup {
        meili,
        cluster,
        index,
        task,
    }
}

fn worker_pid(setup: &Setup) -> i64 {
    setup
        .cluster
        .status(setup.task)
        .get("worker_pid")
        .and_then(|pid| pid.parse().ok())
        .unwrap_or(0)
}

fn report(setup: &Setup, what: &str, rows: i64, seconds: f64, cpu_before: f64) {
    let pid = worker_pid(setup);
    let target = if setup.meili.test_server().is_some() {
        "test server".to_owned()
    } else {
        setup.meili.url.clone()
    };
    println!("{what} into {target}");
    println!("rows              {rows}");
    println!("seconds           {seconds:.2}");
    println!("docs/s            {:.0}", rows as f64 / seconds);
    match cpu_seconds(pid) {
        Some(cpu) => {
            let cpu = cpu - cpu_before;
            println!(
                "worker CPU s      {cpu:.2} ({:.2} per 100k docs)",
                cpu * 100_000.0 / rows as f64
            );
        }
        None => println!("worker CPU s      unknown (worker pid {pid} not readable)"),
    }
    match (memory_mib(pid, "VmHWM:"), memory_mib(pid, "RssAnon:")) {
        (Some(peak), Some(anon)) => {
            println!("worker peak RSS   {peak:.1} MiB (incl. shared buffers; private memory now {anon:.1} MiB)")
        }
        _ => println!("worker peak RSS   unknown"),
    }
    if std::env::var_os("LOAD_VERIFY").is_some() {
        setup
            .meili
            .wait_idle(&setup.index, Duration::from_secs(3600));
        match products::diff_index(&setup.meili.all_documents(&setup.index), rows, 1) {
            Ok(()) => println!("verified: the index holds exactly the table's rows"),
            Err(problem) => println!("MISMATCH: {problem}"),
        }
    }
    if setup.meili.test_server().is_none() {
        setup.meili.delete_index(&setup.index);
    }
}

fn backfill(rows: i64, batch_size: usize, max_inflight: usize) {
    let setup = setup(
        rows,
        json!({"batch_size": batch_size, "max_inflight": max_inflight}),
    );
    let started = Instant::now();
    setup
        .cluster
        .wait_snapshot_done(setup.task, Duration::from_secs(3600));
    let seconds = started.elapsed().as_secs_f64();
    report(
        &setup,
        &format!("backfill (batch_size {batch_size}, max_inflight {max_inflight})"),
        rows,
        seconds,
        0.0,
    );
}

fn stream(rows: i64, per_transaction: i64) {
    let setup = setup(0, json!({}));
    setup
        .cluster
        .wait_snapshot_done(setup.task, Duration::from_secs(600));
    let cpu_before = cpu_seconds(worker_pid(&setup)).unwrap_or(0.0);
    let script: String = (0..rows / per_transaction)
        .map(|n| {
            format!(
                "{};\n",
                products::insert_sql(n * per_transaction + 1, (n + 1) * per_transaction)
            )
        })
        .collect();
    let started = Instant::now();
    setup.cluster.psql(&script);
    let committed = started.elapsed().as_secs_f64();
    wait_for("every row in the index", Duration::from_secs(3600), || {
        (setup.meili.document_count(&setup.index) == Some(rows as u64)).then_some(())
    });
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "(the client committed its {} transactions in {committed:.2} s)",
        rows / per_transaction
    );
    report(
        &setup,
        &format!("stream ({per_transaction}-row transactions)"),
        rows,
        seconds,
        cpu_before,
    );
}

fn latency(transactions: usize, per_second: u64) {
    let setup = setup(0, json!({}));
    setup
        .cluster
        .wait_snapshot_done(setup.task, Duration::from_secs(600));
    let mut samples = Vec::with_capacity(transactions);
    let interval = Duration::from_millis(1000 / per_second.max(1));
    for n in 1..=transactions as i64 {
        let started = Instant::now();
        setup.cluster.psql(&products::insert_sql(n, n));
        loop {
            let (status, _) = setup.meili.request(
                Method::GET,
                &format!("/indexes/{}/documents/{n}", setup.index),
                None,
            );
            if status == 200 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let took = started.elapsed();
        samples.push(took);
        std::thread::sleep(interval.saturating_sub(took));
    }
    samples.sort();
    let at = |p: f64| {
        samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)].as_secs_f64() * 1000.0
    };
    println!(
        "commit → searchable latency over {transactions} one-row transactions at {per_second}/s"
    );
    println!("p50 ms            {:.1}", at(0.50));
    println!("p99 ms            {:.1}", at(0.99));
    println!("max ms            {:.1}", at(1.0));
    println!("(includes psql start-up of the committing client, about a few ms)");
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "backfill".to_owned());
    let numbers: Vec<i64> = args.filter_map(|arg| arg.parse().ok()).collect();
    let arg = |index: usize, default: i64| numbers.get(index).copied().unwrap_or(default);
    match mode.as_str() {
        "backfill" => backfill(arg(0, 200_000), arg(1, 10_000) as usize, arg(2, 8) as usize),
        "stream" => stream(arg(0, 50_000), arg(1, 500)),
        "latency" => latency(arg(0, 200) as usize, arg(1, 10) as u64),
        other => {
            eprintln!("unknown mode {other}: use backfill, stream or latency");
            std::process::exit(2);
        }
    }
}
