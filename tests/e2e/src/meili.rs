//! The Meilisearch the tests sync into: the server at `MEILI_URL` (key `MEILI_MASTER_KEY`) when
//! given; with `E2E_MEILI=real`, a real Meilisearch started for each test from the binary at
//! `MEILI_BIN` (`.ci/run` sets it when the CI machine has a Meilisearch binary); otherwise the
//! project's test server, started in this process.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use meili_test_server::TestServer;
use serde_json::{json, Value};
pub use ureq::http::Method;
use ureq::http::Request;

pub struct Meili {
    pub url: String,
    pub key: Option<String>,
    server: Option<TestServer>,
    /// A real server of this test's own: stopped on drop, and killed, restarted or frozen by
    /// the fault tests.
    real: Option<Mutex<RealServer>>,
    agent: ureq::Agent,
}

const TEST_KEY: &str = "e2e-master-key";
/// A real server insists on a master key of 16 bytes or more.
const REAL_KEY: &str = "e2e-master-key-for-a-real-meilisearch";

/// The tests' own HTTP client: statuses are answers, not errors.
fn test_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

/// A real Meilisearch process of one test, with its own data directory; killed and removed on
/// drop.
struct RealServer {
    /// None while it is down (see [`Meili::go_down`]).
    child: Option<Child>,
    binary: String,
    port: u16,
    dir: PathBuf,
    /// Flags beyond the ones every test server gets.
    extra: Vec<String>,
}

impl RealServer {
    fn start(binary: &str, extra: &[&str]) -> (RealServer, String) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map(|address| address.port())
            .expect("a free port");
        let dir = std::env::temp_dir().join(format!(
            "pg_meili_sync_real_meili_{}_{port}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("the server's directory");
        let mut server = RealServer {
            child: None,
            binary: binary.to_owned(),
            port,
            dir,
            extra: extra.iter().map(|flag| (*flag).to_owned()).collect(),
        };
        server.spawn();
        (server, format!("http://127.0.0.1:{port}"))
    }

    /// Starts the process on the server's port and data directory (again, after a kill).
    fn spawn(&mut self) {
        let (binary, dir, port) = (&self.binary, &self.dir, self.port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("meilisearch.log"))
            .expect("the server's log");
        let child = Command::new(binary)
            .arg("--db-path")
            .arg(dir.join("data"))
            .arg("--dump-dir")
            .arg(dir.join("dumps"))
            .arg("--snapshot-dir")
            .arg(dir.join("snapshots"))
            .args(["--http-addr", &format!("127.0.0.1:{port}")])
            .args([
                "--master-key",
                REAL_KEY,
                "--no-analytics",
                "--env",
                "development",
            ])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| panic!("cannot start {binary}: {error}"));
        self.child = Some(child);
    }

    /// SIGKILL, as a crash or an OOM kill would: nothing is flushed.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn signal(&self, signal: &str) {
        if let Some(child) = &self.child {
            let status = Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status()
                .expect("kill");
            assert!(status.success(), "kill {signal} failed");
        }
    }
}

impl Drop for RealServer {
    fn drop(&mut self) {
        // A stopped process takes SIGKILL too.
        self.kill();
        if std::env::var_os("E2E_KEEP_CLUSTER").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl Meili {
    /// A server of the test's own that refuses request bodies over 1,000,000 bytes, as
    /// `--http-payload-size-limit 1MB` makes a real one; None with `MEILI_URL` (a shared server).
    pub fn with_one_megabyte_limit() -> Option<Meili> {
        const LIMIT: usize = 1_000_000;
        if std::env::var("MEILI_URL").is_ok_and(|url| !url.is_empty()) {
            return None;
        }
        if std::env::var("E2E_MEILI").as_deref() == Ok("real") {
            return Some(Meili::start_real(&["--http-payload-size-limit", "1MB"]));
        }
        let server = TestServer::start_with(meili_test_server::Config {
            master_key: Some(TEST_KEY.to_owned()),
            max_payload_bytes: LIMIT,
            ..meili_test_server::Config::default()
        })
        .expect("start the Meilisearch test server");
        Some(Meili {
            url: server.url(),
            key: Some(TEST_KEY.to_owned()),
            server: Some(server),
            real: None,
            agent: test_agent(),
        })
    }

    /// A server of the test's own (the test server, or a real one with `E2E_MEILI=real`); None
    /// with `MEILI_URL`, whose one shared server cannot be several replicas.
    pub fn own() -> Option<Meili> {
        if std::env::var("MEILI_URL").is_ok_and(|url| !url.is_empty()) {
            return None;
        }
        Some(Meili::from_env())
    }

    /// A server of the test's own that may be a remote of other servers on this machine: a real
    /// one blocks internal addresses (such as 127.0.0.1) as remotes unless allowed. None with
    /// `MEILI_URL`.
    pub fn own_shard() -> Option<Meili> {
        if std::env::var("MEILI_URL").is_ok_and(|url| !url.is_empty()) {
            return None;
        }
        if std::env::var("E2E_MEILI").as_deref() == Ok("real") {
            return Some(Meili::start_real(&[
                "--experimental-allowed-ip-networks",
                "127.0.0.0/8",
            ]));
        }
        Some(Meili::from_env())
    }

    /// A real server of the test's own (`MEILI_BIN`), started with `args`.
    fn start_real(args: &[&str]) -> Meili {
        let binary = std::env::var("MEILI_BIN")
            .expect("E2E_MEILI=real needs MEILI_BIN, the path of a meilisearch binary");
        let (real, url) = RealServer::start(&binary, args);
        let meili = Meili {
            url,
            key: Some(REAL_KEY.to_owned()),
            server: None,
            real: Some(Mutex::new(real)),
            agent: test_agent(),
        };
        meili.wait_healthy();
        meili
    }

    /// `{"name", "url", "api_key"}` of this server, as an entry of a task's `shards`.
    pub fn shard(&self, name: &str) -> Value {
        let mut shard = self.replica();
        shard["name"] = json!(name);
        shard
    }

    /// `{"url", "api_key"}` of this server, as an entry of a task's `replicas`.
    pub fn replica(&self) -> Value {
        let mut replica = json!({ "url": self.url });
        if let Some(key) = &self.key {
            replica["api_key"] = json!(key);
        }
        replica
    }

    pub fn from_env() -> Meili {
        let agent = test_agent();
        match std::env::var("MEILI_URL")
            .ok()
            .filter(|url| !url.is_empty())
        {
            Some(url) => Meili {
                url: url.trim_end_matches('/').to_owned(),
                key: std::env::var("MEILI_MASTER_KEY")
                    .ok()
                    .filter(|key| !key.is_empty()),
                server: None,
                real: None,
                agent,
            },
            None if std::env::var("E2E_MEILI").as_deref() == Ok("real") => Meili::start_real(&[]),
            None => {
                let server =
                    TestServer::start(Some(TEST_KEY)).expect("start the Meilisearch test server");
                Meili {
                    url: server.url(),
                    key: Some(TEST_KEY.to_owned()),
                    server: Some(server),
                    real: None,
                    agent,
                }
            }
        }
    }

    fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while self
            .request_once(Method::GET, "/health", None)
            .map(|(status, _)| status)
            != Ok(200)
        {
            assert!(
                Instant::now() < deadline,
                "the real Meilisearch did not start"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn real(&self) -> Option<std::sync::MutexGuard<'_, RealServer>> {
        self.real
            .as_ref()
            .map(|real| real.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    /// Whether the outage faults below can be played: the test server, or a real server of this
    /// test's own (not one at `MEILI_URL`).
    pub fn can_go_down(&self) -> bool {
        self.server.is_some() || self.real.is_some()
    }

    /// Meilisearch becomes unreachable: the test server refuses connections; a real server is
    /// killed with SIGKILL (what it had enqueued but not applied is in its task store).
    pub fn go_down(&self) {
        if let Some(server) = &self.server {
            server.faults().set_unavailable(true);
        }
        if let Some(mut real) = self.real() {
            real.kill();
        }
    }

    /// After [`Meili::go_down`]: reachable again; a real server restarts on its data directory.
    pub fn come_back(&self) {
        if let Some(server) = &self.server {
            server.faults().set_unavailable(false);
        }
        if let Some(mut real) = self.real() {
            real.spawn();
        }
        if self.real.is_some() {
            self.wait_healthy();
        }
    }

    /// Meilisearch stops answering without closing anything: a real server gets SIGSTOP (its
    /// connections hang), the test server refuses connections.
    pub fn freeze(&self) {
        if let Some(server) = &self.server {
            server.faults().set_unavailable(true);
        }
        if let Some(real) = self.real() {
            real.signal("-STOP");
        }
    }

    /// Meilisearch stops answering and stops working, taking connections all the same: a real
    /// server gets SIGSTOP, the test server reads requests and answers none until
    /// [`Meili::unhang`] (as the kernel does for a stopped process).
    pub fn hang(&self) {
        if let Some(server) = &self.server {
            server.faults().set_hung(true);
        }
        if let Some(real) = self.real() {
            real.signal("-STOP");
        }
    }

    /// After [`Meili::hang`].
    pub fn unhang(&self) {
        if let Some(server) = &self.server {
            server.faults().set_hung(false);
        }
        if let Some(real) = self.real() {
            real.signal("-CONT");
        }
    }

    /// After [`Meili::freeze`].
    pub fn thaw(&self) {
        if let Some(server) = &self.server {
            server.faults().set_unavailable(false);
        }
        if let Some(real) = self.real() {
            real.signal("-CONT");
        }
    }

    /// The in-process test server, when no real Meilisearch was given (for fault knobs and request logs).
    pub fn test_server(&self) -> Option<&TestServer> {
        self.server.as_ref()
    }

    /// The key the tests use (the master key), if the server has one.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    pub fn has_key(&self) -> bool {
        self.key.is_some()
    }

    /// A fresh index uid, so runs against a shared real server do not collide.
    pub fn unique_index(&self, prefix: &str) -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        format!("{prefix}_{}_{nanos}", std::process::id())
    }

    /// The task options naming this server, merged with `extra` (a JSON object).
    pub fn options(&self, extra: Value) -> String {
        let mut options = json!({ "url": self.url });
        if let Some(key) = &self.key {
            options["api_key"] = json!(key);
        }
        if let (Some(target), Some(source)) = (options.as_object_mut(), extra.as_object()) {
            for (name, value) in source {
                target.insert(name.clone(), value.clone());
            }
        }
        options.to_string().replace('\'', "''")
    }

    /// Sends a request, retrying what the test server's fault knobs (or a busy real server) may
    /// throw at the test's own requests: connection errors, 5xx and 429.
    pub fn request(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut attempt = 0;
        loop {
            match self.request_once(method.clone(), path, body.clone()) {
                Ok((status, answer)) if status < 500 && status != 429 => return (status, answer),
                outcome if attempt >= 200 => {
                    panic!("{method} {path}: giving up after {attempt} attempts: {outcome:?}")
                }
                _ => {
                    attempt += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    fn request_once(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value), String> {
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url));
        if let Some(key) = &self.key {
            builder = builder.header("Authorization", format!("Bearer {key}"));
        }
        let response = match body {
            Some(body) => self.agent.run(
                builder
                    .header("Content-Type", "application/json")
                    .body(body.to_string().into_bytes())
                    .expect("request"),
            ),
            None => self.agent.run(builder.body(()).expect("request")),
        };
        let mut response = response.map_err(|error| error.to_string())?;
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .with_config()
            .limit(1 << 30)
            .read_to_string()
            .map_err(|error| error.to_string())?;
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    }

    /// Posts an NDJSON body of documents to the index (as the extension does); the task uid.
    pub fn post_ndjson(&self, index: &str, body: Vec<u8>) -> Result<u64, String> {
        let mut builder = Request::builder()
            .method(Method::POST)
            .uri(format!(
                "{}/indexes/{index}/documents?primaryKey=id",
                self.url
            ))
            .header("Content-Type", "application/x-ndjson");
        if let Some(key) = &self.key {
            builder = builder.header("Authorization", format!("Bearer {key}"));
        }
        let request = builder.body(body).map_err(|error| error.to_string())?;
        let mut response = self.agent.run(request).map_err(|error| error.to_string())?;
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|error| error.to_string())?;
        let answer: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        answer["taskUid"]
            .as_u64()
            .ok_or_else(|| format!("no task uid in {text}"))
    }

    /// Waits until a task has finished; its final status.
    pub fn wait_task(&self, uid: u64, timeout: Duration) -> String {
        crate::wait_for("a Meilisearch task", timeout, || {
            let (_, task) = self.request(Method::GET, &format!("/tasks/{uid}"), None);
            let status = task["status"].as_str().unwrap_or_default().to_owned();
            matches!(status.as_str(), "succeeded" | "failed" | "canceled").then_some(status)
        })
    }

    /// Every document of the index, fetched page by page.
    pub fn all_documents(&self, index: &str) -> Vec<Value> {
        let mut documents = Vec::new();
        let page = 10_000;
        loop {
            let (status, answer) = self.request(
                Method::POST,
                &format!("/indexes/{index}/documents/fetch"),
                Some(json!({ "offset": documents.len(), "limit": page })),
            );
            if status == 404 {
                return documents;
            }
            assert_eq!(status, 200, "fetching documents of {index}: {answer}");
            let results = answer["results"].as_array().cloned().unwrap_or_default();
            let done = results.len() < page;
            documents.extend(results);
            if done {
                return documents;
            }
        }
    }

    /// Waits until Meilisearch has no enqueued or processing task for the index.
    pub fn wait_idle(&self, index: &str, timeout: Duration) {
        crate::wait_for("Meilisearch to finish its tasks", timeout, || {
            let (_, answer) = self.request(
                Method::GET,
                &format!("/tasks?indexUids={index}&statuses=enqueued,processing&limit=1"),
                None,
            );
            (answer["total"].as_u64() == Some(0)
                || answer["results"].as_array().is_some_and(|r| r.is_empty()))
            .then_some(())
        });
    }

    /// numberOfDocuments of the index's stats.
    pub fn document_count(&self, index: &str) -> Option<u64> {
        let (status, answer) = self.request(Method::GET, &format!("/indexes/{index}/stats"), None);
        (status == 200)
            .then(|| answer["numberOfDocuments"].as_u64())
            .flatten()
    }

    pub fn index(&self, index: &str) -> Option<Value> {
        let (status, answer) = self.request(Method::GET, &format!("/indexes/{index}"), None);
        (status == 200).then_some(answer)
    }

    pub fn delete_index(&self, index: &str) {
        let _ = self.request(Method::DELETE, &format!("/indexes/{index}"), None);
    }
}
