//! A Meilisearch-compatible HTTP server for tests, modelled on transcripts recorded from a
//! real Meilisearch 1.50: same routes, status codes, error objects and response shapes,
//! an asynchronous task queue, and knobs to inject faults.
//!
//! ```no_run
//! let server = meili_test_server::TestServer::start(Some("MASTER_KEY")).unwrap();
//! let url = server.url(); // http://127.0.0.1:PORT
//! # let _ = url;
//! server.faults().fail_next_requests(1, 503);
//! ```

mod docs;
mod error;
mod facets;
mod filter;
mod http;
mod index;
mod json;
mod network;
mod routes;
mod search;
mod settings;
mod tasks;
mod time;

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufReader};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::error::ApiError;
use crate::http::Response;
use crate::index::Index;
use crate::tasks::Queue;

/// How to start a [`TestServer`].
#[derive(Clone, Debug)]
pub struct Config {
    /// When set, every route but `/health` needs `Authorization: Bearer <key>`.
    pub master_key: Option<String>,
    /// 0 picks a free port.
    pub port: u16,
    /// Extra processing time per batch of tasks (see [`Faults::set_task_delay`]).
    pub task_delay: Duration,
    /// Request bodies above this (raw or decompressed) are refused as Meilisearch refuses them:
    /// 413 `payload_too_large` for documents, 500 or 413 for JSON. The default is Meilisearch's,
    /// "100 MB" (decimal: 100,000,000 bytes).
    pub max_payload_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            master_key: None,
            port: 0,
            task_delay: Duration::ZERO,
            max_payload_bytes: 100_000_000,
        }
    }
}

/// One request as the server saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestRecord {
    pub method: String,
    /// Path and query string as sent.
    pub path: String,
    /// Status answered; 0 when the connection was dropped without an answer.
    pub status: u16,
    /// Body after gzip/deflate decoding (empty if it was over the payload limit).
    pub body: Vec<u8>,
    /// The `Content-Encoding` header, if any.
    pub content_encoding: Option<String>,
}

/// Fault injection knobs; all take effect immediately and are safe to use from any thread.
pub struct Faults {
    fail_requests: Mutex<(usize, RequestFault)>,
    drop_connections: AtomicUsize,
    /// Requests left whose answer is lost, and the method and path (with its query) they must have.
    lose_answers: Mutex<(usize, String, String)>,
    task_delay: Mutex<Duration>,
    fail_tasks: Mutex<(usize, String, Option<&'static str>)>,
    unavailable: AtomicBool,
    hung: AtomicBool,
    disk_full: AtomicBool,
}

/// The answer injected by [`Faults::fail_next_requests`] or [`Faults::fail_next_requests_as`].
#[derive(Clone)]
struct RequestFault {
    status: u16,
    /// Error code and type; `None` picks them from the status.
    error: Option<(String, &'static str)>,
}

impl Faults {
    fn new(task_delay: Duration) -> Self {
        Faults {
            fail_requests: Mutex::new((
                0,
                RequestFault {
                    status: 500,
                    error: None,
                },
            )),
            drop_connections: AtomicUsize::new(0),
            lose_answers: Mutex::new((0, String::new(), String::new())),
            task_delay: Mutex::new(task_delay),
            fail_tasks: Mutex::new((0, String::new(), None)),
            unavailable: AtomicBool::new(false),
            hung: AtomicBool::new(false),
            disk_full: AtomicBool::new(false),
        }
    }

    /// The next `n` requests (any route) are answered with `status` and a Meilisearch-like
    /// error body instead of being handled: 500 `internal`, 503 `service_unavailable`,
    /// 429 `too_many_requests` (both with `Retry-After: 1`), 502/504, other 4xx `bad_request`.
    pub fn fail_next_requests(&self, n: usize, status: u16) {
        *lock(&self.fail_requests) = (
            n,
            RequestFault {
                status,
                error: None,
            },
        );
    }

    /// Like [`Faults::fail_next_requests`], with the error's `code` and `type` given. The
    /// message is the real one for the codes a real server sends this way, e.g. `(n, 422,
    /// "no_space_left_on_device", "system")` answers as Meilisearch 1.50 with a full disk answers
    /// a write: `No space left on device (os error 28)` (see also [`Faults::set_disk_full`]).
    pub fn fail_next_requests_as(&self, n: usize, status: u16, code: &str, kind: &'static str) {
        *lock(&self.fail_requests) = (
            n,
            RequestFault {
                status,
                error: Some((code.to_string(), kind)),
            },
        );
    }

    /// While on, requests that write (all that would enqueue a task) fail as they do on a
    /// Meilisearch 1.50 whose disk is full, after the key check; reads are served. Observed with
    /// the data directory on a full 30 MB tmpfs: `POST /indexes`, `PATCH .../settings` and
    /// `POST .../documents/delete-batch` got 422 `no_space_left_on_device` (type `system`) "No
    /// space left on device (os error 28)"; a document payload (`POST .../documents`) got 500
    /// `internal` "Error while receiving the playload. `No space left on device (os error
    /// 28)`."; `GET /tasks` 200.
    pub fn set_disk_full(&self, on: bool) {
        self.disk_full.store(on, Ordering::SeqCst);
    }

    /// The next `n` requests are read, then their connection is closed without an answer.
    /// The next `n` requests with `method` and `path` (with its query) are handled (a write
    /// enqueues its task), then their connection is closed without the answer: as when a
    /// connection drops, or a server restarts, after it took a request.
    pub fn lose_next_answers(&self, n: usize, method: &str, path: &str) {
        *lock(&self.lose_answers) = (n, method.to_owned(), path.to_owned());
    }

    pub fn drop_next_connections(&self, n: usize) {
        self.drop_connections.store(n, Ordering::SeqCst);
    }

    /// Extra processing time per batch of tasks (slow indexing). Lowering it also shortens
    /// the wait of the batch being processed.
    pub fn set_task_delay(&self, d: Duration) {
        *lock(&self.task_delay) = d;
    }

    /// The next `n` document tasks (additions, updates, deletions) and index deletions end `failed`
    /// with the error code `code` (e.g. `"internal"`) without touching the index.
    pub fn fail_next_tasks(&self, n: usize, code: &str) {
        *lock(&self.fail_tasks) = (n, code.to_string(), None);
    }

    /// Like [`Faults::fail_next_tasks`], with the error's `type` given (`internal`, `system`,
    /// `invalid_request`, `auth`) instead of the one Meilisearch gives `code`.
    pub fn fail_next_tasks_as(&self, n: usize, code: &str, kind: &'static str) {
        *lock(&self.fail_tasks) = (n, code.to_string(), Some(kind));
    }

    /// While on, new connections are closed as soon as they are accepted and requests on
    /// already open connections are answered by closing the connection.
    pub fn set_unavailable(&self, on: bool) {
        self.unavailable.store(on, Ordering::SeqCst);
    }

    /// While on, the server answers nothing, as a real one stopped with SIGSTOP: connections are
    /// accepted (the kernel's backlog) and requests read, but their answers, and the processing
    /// of tasks, wait until it is off again.
    pub fn set_hung(&self, on: bool) {
        self.hung.store(on, Ordering::SeqCst);
    }

    /// Waits while the server is hung (see [`Faults::set_hung`]), or until it stops.
    pub(crate) fn wait_while_hung(&self, stopping: impl Fn() -> bool) {
        while self.hung.load(Ordering::SeqCst) && !stopping() {
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Turns every fault off and the task delay back to zero.
    pub fn clear(&self) {
        self.fail_next_requests(0, 500);
        self.drop_next_connections(0);
        self.lose_next_answers(0, "", "");
        self.set_task_delay(Duration::ZERO);
        self.fail_next_tasks(0, "");
        self.set_unavailable(false);
        self.set_hung(false);
        self.set_disk_full(false);
    }

    pub(crate) fn task_delay(&self) -> Duration {
        *lock(&self.task_delay)
    }

    fn unavailable(&self) -> bool {
        self.unavailable.load(Ordering::SeqCst)
    }

    pub(crate) fn disk_full(&self) -> bool {
        self.disk_full.load(Ordering::SeqCst)
    }

    fn take_drop(&self) -> bool {
        self.drop_connections
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    fn take_lost_answer(&self, method: &str, path: &str) -> bool {
        let mut lose = lock(&self.lose_answers);
        let taken = lose.0 > 0 && lose.1 == method && lose.2 == path;
        if taken {
            lose.0 -= 1;
        }
        taken
    }

    fn take_request_failure(&self) -> Option<RequestFault> {
        let mut f = lock(&self.fail_requests);
        (f.0 > 0).then(|| {
            f.0 -= 1;
            f.1.clone()
        })
    }

    /// The code and, when overridden, the type of the next injected task failure.
    pub(crate) fn take_task_failure(&self) -> Option<(String, Option<&'static str>)> {
        let mut f = lock(&self.fail_tasks);
        (f.0 > 0).then(|| {
            f.0 -= 1;
            (f.1.clone(), f.2)
        })
    }
}

/// Locks a mutex; a poisoned lock only means a handler panicked, the data is still usable.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Default)]
struct Connections {
    next_id: u64,
    open: HashMap<u64, TcpStream>,
    threads: Vec<JoinHandle<()>>,
}

pub(crate) struct Shared {
    pub(crate) master_key: Option<String>,
    pub(crate) max_payload: usize,
    pub(crate) faults: Faults,
    pub(crate) queue: Mutex<Queue>,
    /// Signals new tasks to the processor and finished batches to waiters.
    pub(crate) cond: Condvar,
    pub(crate) indexes: Mutex<BTreeMap<String, Arc<RwLock<Index>>>>,
    /// Experimental features and `/network`; never held across a remote call.
    pub(crate) experimental: Mutex<network::State>,
    log: Mutex<Vec<RequestRecord>>,
    stop: AtomicBool,
    connections: Mutex<Connections>,
}

impl Shared {
    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
}

/// A running server on 127.0.0.1. Dropping it stops every thread and closes the listener.
pub struct TestServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    acceptor: Option<JoinHandle<()>>,
    processor: Option<JoinHandle<()>>,
}

impl TestServer {
    /// Starts on a free port with the given master key and default settings.
    pub fn start(master_key: Option<&str>) -> io::Result<TestServer> {
        Self::start_with(Config {
            master_key: master_key.map(String::from),
            ..Config::default()
        })
    }

    pub fn start_with(config: Config) -> io::Result<TestServer> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, config.port))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            master_key: config.master_key,
            max_payload: config.max_payload_bytes,
            faults: Faults::new(config.task_delay),
            queue: Mutex::new(Queue::default()),
            cond: Condvar::new(),
            indexes: Mutex::new(BTreeMap::new()),
            experimental: Mutex::new(network::State::default()),
            log: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            connections: Mutex::new(Connections::default()),
        });
        let processor = {
            let shared = shared.clone();
            thread::Builder::new()
                .name("meili-tasks".into())
                .spawn(move || tasks::run(shared))?
        };
        let acceptor = {
            let shared = shared.clone();
            thread::Builder::new()
                .name("meili-accept".into())
                .spawn(move || accept(shared, listener))?
        };
        Ok(TestServer {
            shared,
            addr,
            acceptor: Some(acceptor),
            processor: Some(processor),
        })
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn faults(&self) -> &Faults {
        &self.shared.faults
    }

    /// All documents of an index sorted by primary key (numbers numerically, before strings);
    /// empty when the index does not exist.
    pub fn documents(&self, index: &str) -> Vec<Value> {
        let Some(index) = lock(&self.shared.indexes).get(index).cloned() else {
            return Vec::new();
        };
        let idx = tasks::read(&index);
        let pk = idx.primary_key.clone().unwrap_or_default();
        let mut docs: Vec<Value> = idx.iter().map(|d| Value::Object(d.parse())).collect();
        docs.sort_by(|a, b| pk_order(&a[&pk], &b[&pk]));
        docs
    }

    /// The full settings object of an index, as `GET /indexes/{uid}/settings` returns it.
    pub fn index_settings(&self, index: &str) -> Option<Value> {
        let index = lock(&self.shared.indexes).get(index).cloned()?;
        let json = settings::to_json(&tasks::read(&index).settings);
        serde_json::from_str(&json).ok()
    }

    pub fn request_log(&self) -> Vec<RequestRecord> {
        lock(&self.shared.log).clone()
    }

    /// Drops every task so far from the task list (`GET /tasks`, `GET /tasks/{uid}`), as
    /// `DELETE /tasks`, a restore from an older snapshot or a wiped instance would; the work of
    /// tasks still enqueued goes on.
    pub fn forget_tasks(&self) {
        for task in lock(&self.shared.queue).tasks.iter_mut() {
            task.forgotten = true;
        }
    }

    /// Waits until no task is enqueued or processing; false on timeout.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut queue = lock(&self.shared.queue);
        while queue.pending > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            queue = self
                .shared
                .cond
                .wait_timeout(queue, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.cond.notify_all();
        // Wake the blocking accept() so the acceptor sees the stop flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
        let threads = {
            let mut conns = lock(&self.shared.connections);
            for stream in conns.open.values() {
                let _ = stream.shutdown(Shutdown::Both);
            }
            std::mem::take(&mut conns.threads)
        };
        for t in threads {
            let _ = t.join();
        }
        if let Some(t) = self.processor.take() {
            let _ = t.join();
        }
    }
}

/// Numbers (numerically) before strings, for [`TestServer::documents`].
fn pk_order(a: &Value, b: &Value) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            match (x.as_i64(), y.as_i64(), x.as_u64(), y.as_u64()) {
                (Some(x), Some(y), _, _) => x.cmp(&y),
                (_, _, Some(x), Some(y)) => x.cmp(&y),
                _ => x
                    .as_f64()
                    .partial_cmp(&y.as_f64())
                    .unwrap_or(Ordering::Equal),
            }
        }
        (Value::Number(_), _) => Ordering::Less,
        (_, Value::Number(_)) => Ordering::Greater,
        (Value::String(x), Value::String(y)) => x.cmp(y),
        _ => Ordering::Equal,
    }
}

fn accept(shared: Arc<Shared>, listener: TcpListener) {
    for stream in listener.incoming() {
        if shared.stopping() {
            return;
        }
        let Ok(stream) = stream else { continue };
        if shared.faults.unavailable() {
            let _ = stream.shutdown(Shutdown::Both);
            continue;
        }
        let mut conns = lock(&shared.connections);
        let id = conns.next_id;
        conns.next_id += 1;
        if let Ok(clone) = stream.try_clone() {
            conns.open.insert(id, clone);
        }
        conns.threads.retain(|t| !t.is_finished());
        let worker = shared.clone();
        let spawned = thread::Builder::new()
            .name("meili-conn".into())
            .spawn(move || {
                serve(&worker, stream);
                lock(&worker.connections).open.remove(&id);
            });
        match spawned {
            Ok(t) => conns.threads.push(t),
            Err(_) => {
                conns.open.remove(&id);
            }
        }
    }
}

/// Serves requests on one keep-alive connection, in order (so pipelining works).
fn serve(shared: &Shared, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::with_capacity(256 * 1024, read_half);
    let mut writer = stream;
    loop {
        let read = http::read_request(
            &mut reader,
            &mut writer,
            shared.max_payload,
            routes::body_kind,
        );
        let req = match read {
            Ok(Some(req)) => req,
            Ok(None) | Err(http::ReadError::Closed) => break,
            Err(http::ReadError::Bad(status)) => {
                let _ = Response::empty(status).write_to(&mut writer, false);
                break;
            }
        };
        shared.faults.wait_while_hung(|| shared.stopping());
        if shared.stopping() || shared.faults.unavailable() {
            break;
        }
        let record = |status: u16, req: http::Request| RequestRecord {
            content_encoding: req.content_encoding(),
            method: req.method,
            path: req.target,
            status,
            body: req.body,
        };
        if shared.faults.take_drop() {
            lock(&shared.log).push(record(0, req));
            break;
        }
        let resp = match shared.faults.take_request_failure() {
            Some(fault) => fault_response(fault),
            None => routes::handle(shared, &req),
        };
        let keep_alive = req.keep_alive;
        if shared.faults.take_lost_answer(&req.method, &req.target) {
            lock(&shared.log).push(record(0, req));
            break;
        }
        lock(&shared.log).push(record(resp.status, req));
        if resp.write_to(&mut writer, keep_alive).is_err() || !keep_alive {
            break;
        }
    }
    let _ = writer.shutdown(Shutdown::Both);
}

fn fault_response(fault: RequestFault) -> Response {
    let status = fault.status;
    let (code, kind, retry) = match status {
        429 => ("too_many_requests", "system", true),
        503 => ("service_unavailable", "system", true),
        502 => ("bad_gateway", "system", false),
        504 => ("gateway_timeout", "system", false),
        400..=499 => ("bad_request", "invalid_request", false),
        _ => ("internal", "internal", false),
    };
    let (code, kind) = match &fault.error {
        Some((code, kind)) => (code.as_str(), *kind),
        None => (code, kind),
    };
    let message = match code {
        "no_space_left_on_device" => error::NO_SPACE.to_string(),
        _ => format!("Injected fault: {} {}.", status, http::reason(status)),
    };
    let mut error = ApiError::new(code, message).with_status(status);
    error.kind = kind;
    let mut resp = Response::json(status, error.to_json());
    if retry {
        resp.headers.push(("Retry-After", "1".into()));
    }
    resp
}
