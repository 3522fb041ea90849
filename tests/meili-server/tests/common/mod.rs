//! A tiny blocking HTTP/1.1 client for the tests (one connection per request).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;

pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// The test server's API with the tests' master key; each test binary adds its own helpers.
pub struct Api {
    pub url: String,
}

// Not every test binary that includes this module uses every helper.
#[allow(dead_code)]
impl Api {
    /// A request with a JSON body (if any).
    pub fn json(&self, method: &str, path: &str, body: Option<Value>) -> Resp {
        let body = body.map(|b| b.to_string().into_bytes());
        send(
            &self.url,
            method,
            path,
            &[
                ("Authorization", "Bearer MASTER_KEY"),
                ("Content-Type", "application/json"),
            ],
            body.as_deref(),
        )
        .expect("request")
    }

    pub fn get(&self, path: &str) -> Value {
        self.json("GET", path, None).json()
    }

    /// Polls a task until it has succeeded or failed (at most a minute).
    pub fn wait_task(&self, uid: u64) -> Value {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let task = self.get(&format!("/tasks/{uid}"));
            if task["status"] == "succeeded" || task["status"] == "failed" {
                return task;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "task {uid} did not finish: {task}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// `base` is the server URL (`http://127.0.0.1:PORT`); `headers` are sent as given.
pub fn send(
    base: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> std::io::Result<Resp> {
    let host = base.trim_start_matches("http://");
    let mut stream = TcpStream::connect(host)?;
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    write_request(&mut stream, host, method, path, headers, body)?;
    read_response(&mut BufReader::new(stream))
}

pub fn write_request(
    w: &mut impl Write,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> std::io::Result<()> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(body) = body {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    w.write_all(head.as_bytes())?;
    if let Some(body) = body {
        w.write_all(body)?;
    }
    w.flush()
}

/// Reads one response framed by `Content-Length`.
pub fn read_response(r: &mut impl BufRead) -> std::io::Result<Resp> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "connection closed",
        ));
    }
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(&line))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').ok_or_else(|| bad(l))?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    let len = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0; len];
    r.read_exact(&mut body)?;
    Ok(Resp {
        status,
        headers,
        body,
    })
}
