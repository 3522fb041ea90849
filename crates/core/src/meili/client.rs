//! A blocking client for the Meilisearch endpoints the sync uses.
//!
//! One `ureq` agent per client keeps connections alive between requests.
//! The API key only ever goes into the `Authorization` header: no error
//! message, `Debug` output or log line built here contains it.

use std::fmt;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use std::net::ToSocketAddrs;

use serde_json::{json, Value};
use ureq::config::AutoHeaderValue;
use ureq::http::{Method, Request, Uri};
use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{
    ConnectProxyConnector, Connector, DefaultConnector, NextTimeout, RustlsConnector,
};
use ureq::Agent;

use super::waiting_tcp::{SocketWait, WaitingTcpConnector};
use crate::meili::request::Operation;

/// Responses larger than this are refused (a page of documents is the
/// largest thing the sync reads).
const MAX_RESPONSE_BYTES: u64 = 256 << 20;

/// How long one request of ours may take, from connecting to the end of the answer: a batch sent,
/// a page of documents read, a task looked up. (A backend's search has its own GUC.)
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a caller waits for one Meilisearch task of ours to finish (an index made, swapped or
/// deleted, settings, a repair's documents): Meilisearch queues it behind the indexing of
/// everything enqueued before it.
pub const TASK_WAIT: Duration = Duration::from_secs(300);

/// Connections idle longer than this are not reused: Meilisearch closes
/// idle connections after 5 s, and a request on a closed one fails.
const MAX_IDLE_AGE: Duration = Duration::from_secs(4);

/// Why a request did not succeed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MeiliError {
    /// The client was given an unusable URL or key.
    Config(String),
    /// No HTTP answer: connection refused or dropped, timeout, TLS failure.
    Transport(String),
    /// Meilisearch answered with a non-success status.
    Http {
        status: u16,
        body: Option<MeiliErrorBody>,
    },
    /// A success answer that is not what the API documents.
    Protocol(String),
}

impl MeiliError {
    /// Worth sending the same request again later: the server was
    /// unreachable, overloaded or failing, not refusing the request.
    pub fn is_retryable(&self) -> bool {
        match self {
            MeiliError::Transport(_) => true,
            MeiliError::Http { status, .. } => *status >= 500 || *status == 408 || *status == 429,
            MeiliError::Config(_) | MeiliError::Protocol(_) => false,
        }
    }

    /// The API key is missing, wrong, or lacks a permission.
    pub fn is_auth(&self) -> bool {
        matches!(
            self,
            MeiliError::Http {
                status: 401 | 403,
                ..
            }
        )
    }
}

impl fmt::Display for MeiliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MeiliError::Config(message) => {
                write!(f, "invalid Meilisearch client setting: {message}")
            }
            MeiliError::Transport(message) => write!(f, "cannot reach Meilisearch: {message}"),
            MeiliError::Http {
                status,
                body: Some(body),
            } => write!(
                f,
                "Meilisearch answered HTTP {status}: {} ({})",
                body.message, body.code
            ),
            MeiliError::Http { status, body: None } => {
                write!(f, "Meilisearch answered HTTP {status}")
            }
            MeiliError::Protocol(message) => {
                write!(f, "unexpected answer from Meilisearch: {message}")
            }
        }
    }
}

impl std::error::Error for MeiliError {}

/// Meilisearch's error object, as in responses and in failed tasks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeiliErrorBody {
    pub message: String,
    pub code: String,
    /// The `type` field: `invalid_request`, `internal`, `auth`, `system`.
    pub kind: String,
    pub link: String,
}

impl MeiliErrorBody {
    fn from_json(value: &Value) -> Option<Self> {
        let field = |name: &str| value.get(name).and_then(Value::as_str).map(str::to_string);
        Some(MeiliErrorBody {
            message: field("message")?,
            code: field("code").unwrap_or_default(),
            kind: field("type").unwrap_or_default(),
            link: field("link").unwrap_or_default(),
        })
    }
}

impl fmt::Display for MeiliErrorBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, self.code)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MeiliTaskStatus {
    Enqueued,
    Processing,
    Succeeded,
    Failed,
    Canceled,
}

impl MeiliTaskStatus {
    /// The task will not change any more.
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            MeiliTaskStatus::Succeeded | MeiliTaskStatus::Failed | MeiliTaskStatus::Canceled
        )
    }
}

/// What the sync needs to know of an index (`GET /indexes/{uid}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexInfo {
    pub primary_key: Option<String>,
    /// Changes when the index is deleted and created again, and when a swap moves another
    /// index's content under this uid: how workers notice that the index is not the one they
    /// filled.
    pub created_at: Option<String>,
}

impl IndexInfo {
    fn from_json(index: &Value) -> IndexInfo {
        let text = |name: &str| index.get(name).and_then(Value::as_str).map(str::to_owned);
        IndexInfo {
            primary_key: text("primaryKey"),
            created_at: text("createdAt"),
        }
    }
}

/// What the sync needs to know of a Meilisearch task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeiliTask {
    pub uid: u64,
    pub status: MeiliTaskStatus,
    /// Set for failed tasks.
    pub error: Option<MeiliErrorBody>,
}

impl MeiliTask {
    fn from_json(value: &Value) -> Result<Self, MeiliError> {
        let uid = value
            .get("uid")
            .and_then(Value::as_u64)
            .ok_or_else(|| MeiliError::Protocol(format!("task without a uid: {value}")))?;
        let status = match value.get("status").and_then(Value::as_str) {
            Some("enqueued") => MeiliTaskStatus::Enqueued,
            Some("processing") => MeiliTaskStatus::Processing,
            Some("succeeded") => MeiliTaskStatus::Succeeded,
            Some("failed") => MeiliTaskStatus::Failed,
            Some("canceled") => MeiliTaskStatus::Canceled,
            _ => {
                return Err(MeiliError::Protocol(format!(
                    "task {uid} has no known status: {value}"
                )))
            }
        };
        let error = value.get("error").and_then(MeiliErrorBody::from_json);
        Ok(MeiliTask { uid, status, error })
    }

    /// Why the task did not succeed, in words (None when it did): Meilisearch's error and its
    /// code, that it was canceled, or that it had not finished when the wait ended.
    /// A deletion that failed because the index was not there: the index is gone, as the
    /// deletion asked. A second deletion enqueued before the first ran ends so (a worker that
    /// restarted while its first one waited in Meilisearch's queue enqueues another).
    pub fn found_no_index(&self) -> bool {
        self.status == MeiliTaskStatus::Failed
            && self
                .error
                .as_ref()
                .is_some_and(|error| error.code == "index_not_found")
    }

    pub fn failure(&self) -> Option<String> {
        let uid = self.uid;
        match self.status {
            MeiliTaskStatus::Succeeded => None,
            MeiliTaskStatus::Failed => Some(match &self.error {
                Some(error) => format!(
                    "Meilisearch task {uid} failed: {} ({})",
                    error.message, error.code
                ),
                None => format!("Meilisearch task {uid} failed"),
            }),
            MeiliTaskStatus::Canceled => Some(format!("Meilisearch task {uid} was canceled")),
            MeiliTaskStatus::Enqueued | MeiliTaskStatus::Processing => Some(format!(
                "Meilisearch task {uid} had not finished after {} s",
                TASK_WAIT.as_secs()
            )),
        }
    }
}

/// The documents and the total of a `/documents` answer.
fn document_page(answer: &Value) -> Result<(Vec<Value>, u64), MeiliError> {
    let results = answer.get("results").and_then(Value::as_array);
    let total = answer.get("total").and_then(Value::as_u64);
    match (results, total) {
        (Some(results), Some(total)) => Ok((results.clone(), total)),
        _ => Err(MeiliError::Protocol(format!(
            "document page without results or total: {answer}"
        ))),
    }
}

/// A request body and how to label it.
enum Payload<'a> {
    Empty,
    Json(Vec<u8>),
    Raw {
        bytes: &'a [u8],
        content_type: &'static str,
        gzip: bool,
    },
}

/// A Meilisearch server at one URL, with one API key.
#[derive(Clone)]
pub struct Client {
    agent: Agent,
    /// Scheme, host, port and optional path prefix, without a trailing `/`.
    base_url: String,
    /// `Bearer <key>`.
    authorization: Option<String>,
    timeout: Duration,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("base_url", &self.base_url)
            .field("api_key", &self.authorization.as_ref().map(|_| "<hidden>"))
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Client {
    /// `url` is `http(s)://host[:port][/prefix]`; `timeout` bounds each
    /// whole request, connecting included.
    pub fn new(url: &str, api_key: Option<&str>, timeout: Duration) -> Result<Client, MeiliError> {
        let uri: Uri = url
            .parse()
            .map_err(|_| MeiliError::Config(format!("\"{url}\" is not a URL")))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) {
            return Err(MeiliError::Config(format!(
                "\"{url}\" must start with http:// or https://"
            )));
        }
        let Some(authority) = uri.authority() else {
            return Err(MeiliError::Config(format!("\"{url}\" has no host")));
        };
        // Credentials in the URL would end up in error messages.
        if authority.as_str().contains('@') {
            return Err(MeiliError::Config(
                "the URL must not contain credentials: pass the API key separately".to_string(),
            ));
        }
        if authority.host().is_empty() {
            return Err(MeiliError::Config(format!("\"{url}\" has no host")));
        }
        if uri.query().is_some() || url.contains('#') {
            return Err(MeiliError::Config(format!(
                "\"{url}\" must not have a query or fragment"
            )));
        }
        let authorization = match api_key {
            Some(key) if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) => {
                return Err(MeiliError::Config(
                    "the API key must be non-empty printable ASCII without spaces".to_string(),
                ))
            }
            Some(key) => Some(format!("Bearer {key}")),
            None => None,
        };
        Ok(Client {
            agent: new_agent(timeout),
            base_url: url.trim_end_matches('/').to_string(),
            authorization,
            timeout,
        })
    }

    /// A client whose requests wait for their socket through `wait`, on the thread that makes
    /// them (see [`waiting_tcp`](super::waiting_tcp)): a backend's searches, which a cancel must
    /// be able to end. Its connections are its own.
    pub fn with_socket_wait(
        url: &str,
        api_key: Option<&str>,
        timeout: Duration,
        wait: Arc<dyn SocketWait>,
    ) -> Result<Client, MeiliError> {
        let client = Client::new(url, api_key, timeout)?;
        let connector =
            ().chain(ConnectProxyConnector::default())
                .chain(WaitingTcpConnector::new(wait))
                .chain(RustlsConnector::default());
        Ok(Client {
            agent: Agent::with_parts(agent_config(timeout), connector, CallingThreadResolver),
            ..client
        })
    }

    /// The same server and key with a connection pool of its own, so that
    /// [`Client::close_connections`] on one does not affect the other.
    pub fn with_own_connections(&self) -> Client {
        Client {
            agent: new_agent(self.timeout),
            ..self.clone()
        }
    }

    /// Interrupts requests in flight and makes every later request of this
    /// client (and of its clones that share its connections) fail at once.
    pub fn close_connections(&self) {
        self.agent.clone().shutdown();
    }

    #[cfg(test)]
    pub fn url(&self) -> &str {
        &self.base_url
    }

    /// `GET /health`: the server is up and answering.
    #[cfg(test)]
    pub fn health(&self) -> Result<(), MeiliError> {
        let answer = self.request(Method::GET, "/health", &[], Payload::Empty)?;
        match answer.get("status").and_then(Value::as_str) {
            Some("available") => Ok(()),
            _ => Err(MeiliError::Protocol(format!("health is {answer}"))),
        }
    }

    /// `GET /version`: the server's version, e.g. `1.50.0`.
    pub fn version(&self) -> Result<String, MeiliError> {
        let answer = self.request(Method::GET, "/version", &[], Payload::Empty)?;
        answer
            .get("pkgVersion")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| MeiliError::Protocol(format!("version without pkgVersion: {answer}")))
    }

    /// `GET /indexes/{uid}`: the index object, or `None` if it does not exist.
    pub fn get_index(&self, uid: &str) -> Result<Option<IndexInfo>, MeiliError> {
        match self.request(Method::GET, &index_path(uid, ""), &[], Payload::Empty) {
            Ok(index) => Ok(Some(IndexInfo::from_json(&index))),
            Err(MeiliError::Http { status: 404, .. }) => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// `POST /indexes`; returns the task uid.
    pub fn create_index(&self, uid: &str, primary_key: &str) -> Result<u64, MeiliError> {
        let body = json!({ "uid": uid, "primaryKey": primary_key });
        let answer = self.request(
            Method::POST,
            "/indexes",
            &[],
            Payload::Json(body.to_string().into_bytes()),
        )?;
        task_uid(&answer)
    }

    /// `PATCH /indexes/{uid}/settings`; returns the task uid.
    pub fn update_settings(&self, uid: &str, settings: &Value) -> Result<u64, MeiliError> {
        let payload = Payload::Json(settings.to_string().into_bytes());
        let answer = self.request(Method::PATCH, &index_path(uid, "/settings"), &[], payload)?;
        task_uid(&answer)
    }

    /// `GET /indexes/{uid}/settings`: every setting of the index.
    pub fn get_settings(&self, uid: &str) -> Result<Value, MeiliError> {
        self.request(
            Method::GET,
            &index_path(uid, "/settings"),
            &[],
            Payload::Empty,
        )
    }

    /// `POST /swap-indexes` for one pair; returns the task uid.
    pub fn swap_indexes(&self, first: &str, second: &str) -> Result<u64, MeiliError> {
        let body = json!([{ "indexes": [first, second] }]);
        let answer = self.request(
            Method::POST,
            "/swap-indexes",
            &[],
            Payload::Json(body.to_string().into_bytes()),
        )?;
        task_uid(&answer)
    }

    /// Whether any task matching the filters (`GET /tasks` parameters such as `indexUids` or
    /// `types`) is still enqueued or processing.
    pub fn has_unfinished_tasks(&self, filters: &[(&str, &str)]) -> Result<bool, MeiliError> {
        let mut query = vec![("statuses", "enqueued,processing"), ("limit", "1")];
        query.extend_from_slice(filters);
        let answer = self.request(Method::GET, "/tasks", &query, Payload::Empty)?;
        answer
            .get("results")
            .and_then(Value::as_array)
            .map(|results| !results.is_empty())
            .ok_or_else(|| MeiliError::Protocol(format!("task list without results: {answer}")))
    }

    /// `PATCH /experimental-features` with `{"network": true}`: the distributed features (remotes,
    /// federated search across them) are experimental in Meilisearch 1.50.
    pub fn enable_network(&self) -> Result<(), MeiliError> {
        let body = json!({ "network": true });
        self.request(
            Method::PATCH,
            "/experimental-features",
            &[],
            Payload::Json(body.to_string().into_bytes()),
        )?;
        Ok(())
    }

    /// `GET /network`: the server's name (`self`), its remotes and, in a sharded enterprise
    /// network, its `leader`.
    pub fn network(&self) -> Result<Value, MeiliError> {
        self.request(Method::GET, "/network", &[], Payload::Empty)
    }

    /// `PATCH /network`; the answer is the network, or a task (`taskUid`) to wait for.
    pub fn update_network(&self, body: &Value) -> Result<Value, MeiliError> {
        self.request(
            Method::PATCH,
            "/network",
            &[],
            Payload::Json(body.to_string().into_bytes()),
        )
    }

    /// `DELETE /indexes/{uid}`; returns the task uid.
    pub fn delete_index(&self, uid: &str) -> Result<u64, MeiliError> {
        let answer = self.request(Method::DELETE, &index_path(uid, ""), &[], Payload::Empty)?;
        task_uid(&answer)
    }

    /// Enqueues one batch; returns the task uid. `body` is NDJSON for
    /// `Replace`/`Update` (gzip-compressed if `gzip`), a JSON array of ids
    /// for `Delete`, and ignored for `DeleteAll`.
    pub fn send_batch(
        &self,
        uid: &str,
        primary_key: &str,
        op: Operation,
        body: &[u8],
        gzip: bool,
    ) -> Result<u64, MeiliError> {
        let ndjson = |bytes| Payload::Raw {
            bytes,
            content_type: "application/x-ndjson",
            gzip,
        };
        let primary_key = [("primaryKey", primary_key)];
        let answer = match op {
            Operation::Replace => self.request(
                Method::POST,
                &index_path(uid, "/documents"),
                &primary_key,
                ndjson(body),
            ),
            Operation::Update => self.request(
                Method::PUT,
                &index_path(uid, "/documents"),
                &primary_key,
                ndjson(body),
            ),
            Operation::Delete => self.request(
                Method::POST,
                &index_path(uid, "/documents/delete-batch"),
                &[],
                Payload::Raw {
                    bytes: body,
                    content_type: "application/json",
                    gzip,
                },
            ),
            Operation::DeleteAll => self.request(
                Method::DELETE,
                &index_path(uid, "/documents"),
                &[],
                Payload::Empty,
            ),
        }?;
        task_uid(&answer)
    }

    /// `GET /tasks/{uid}`.
    pub fn get_task(&self, uid: u64) -> Result<MeiliTask, MeiliError> {
        let answer = self.request(Method::GET, &format!("/tasks/{uid}"), &[], Payload::Empty)?;
        MeiliTask::from_json(&answer)
    }

    /// The states of many tasks in one `GET /tasks?uids=…`. Tasks that
    /// Meilisearch does not know are absent from the result.
    pub fn get_tasks(&self, uids: &[u64]) -> Result<Vec<MeiliTask>, MeiliError> {
        if uids.is_empty() {
            return Ok(Vec::new());
        }
        let list = uids
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let limit = uids.len().to_string();
        let answer = self.request(
            Method::GET,
            "/tasks",
            &[("uids", &list), ("limit", &limit)],
            Payload::Empty,
        )?;
        answer
            .get("results")
            .and_then(Value::as_array)
            .ok_or_else(|| MeiliError::Protocol(format!("task list without results: {answer}")))?
            .iter()
            .map(MeiliTask::from_json)
            .collect()
    }

    /// Polls task `uid` until it is finished or `timeout` has passed, and
    /// returns its last state (unfinished only on timeout); [`MeiliTask::failure`] says whether
    /// it succeeded.
    pub fn wait_task(&self, uid: u64, timeout: Duration) -> Result<MeiliTask, MeiliError> {
        self.wait_task_between(uid, timeout, &mut || {})
    }

    /// [`Client::wait_task`], calling `between` before each pause (a backend checks for a
    /// cancel there).
    pub fn wait_task_between(
        &self,
        uid: u64,
        timeout: Duration,
        between: &mut dyn FnMut(),
    ) -> Result<MeiliTask, MeiliError> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(10);
        loop {
            let state = self.get_task(uid)?;
            let now = Instant::now();
            if state.status.is_finished() || now >= deadline {
                return Ok(state);
            }
            between();
            thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// `POST /indexes/{uid}/documents/fetch` by ids: the documents that exist, in no set order.
    pub fn fetch_by_ids(
        &self,
        uid: &str,
        ids: &[Value],
        retrieve_vectors: bool,
    ) -> Result<Vec<Value>, MeiliError> {
        let mut query = json!({ "ids": ids, "limit": ids.len().max(1) });
        if retrieve_vectors {
            // Meilisearch leaves `_vectors` out of documents unless asked.
            query["retrieveVectors"] = json!(true);
        }
        Ok(self.fetch(uid, &query)?.0)
    }

    /// One page of the index's documents with only the `field` attribute, and the total.
    pub fn browse_field(
        &self,
        uid: &str,
        field: &str,
        offset: u64,
        limit: u64,
    ) -> Result<(Vec<Value>, u64), MeiliError> {
        self.fetch(
            uid,
            &json!({ "offset": offset, "limit": limit, "fields": [field] }),
        )
    }

    /// `POST /indexes/{uid}/documents/fetch`: the page of documents and the total.
    fn fetch(&self, uid: &str, query: &Value) -> Result<(Vec<Value>, u64), MeiliError> {
        let answer = self.request(
            Method::POST,
            &index_path(uid, "/documents/fetch"),
            &[],
            Payload::Json(query.to_string().into_bytes()),
        )?;
        document_page(&answer)
    }

    /// `POST /indexes/{uid}/search` with `body` (Meilisearch's search parameters as they are);
    /// the answer as Meilisearch wrote it.
    pub fn search(&self, uid: &str, body: &Value) -> Result<Value, MeiliError> {
        let text = self.search_text(uid, body)?;
        let url = format!("{}{}", self.base_url, index_path(uid, "/search"));
        parse_answer(&Method::POST, &url, text)
    }

    /// The same search, its answer's JSON text as Meilisearch wrote it (for a reader that builds
    /// its rows straight from the text).
    pub fn search_text(&self, uid: &str, body: &Value) -> Result<Vec<u8>, MeiliError> {
        let payload = Payload::Json(body.to_string().into_bytes());
        self.request_text(Method::POST, &index_path(uid, "/search"), &[], payload)
    }

    /// `POST /multi-search` with `body` (a federated search over remotes, say); the answer's JSON
    /// text as Meilisearch wrote it.
    pub fn multi_search_text(&self, body: &Value) -> Result<Vec<u8>, MeiliError> {
        let payload = Payload::Json(body.to_string().into_bytes());
        self.request_text(Method::POST, "/multi-search", &[], payload)
    }

    /// `GET /indexes/{uid}/documents`: one page of documents and the total.
    #[cfg(test)]
    pub fn fetch_documents(
        &self,
        uid: &str,
        offset: u64,
        limit: u64,
    ) -> Result<(Vec<Value>, u64), MeiliError> {
        let (offset, limit) = (offset.to_string(), limit.to_string());
        let answer = self.request(
            Method::GET,
            &index_path(uid, "/documents"),
            &[("offset", &offset), ("limit", &limit)],
            Payload::Empty,
        )?;
        document_page(&answer)
    }

    /// Sends one request; a 2xx answer's JSON body (`null` if empty), or
    /// the error.
    fn request(
        &self,
        method: Method,
        path: &str,
        query: &[(&str, &str)],
        payload: Payload,
    ) -> Result<Value, MeiliError> {
        let text = self.request_text(method.clone(), path, query, payload)?;
        parse_answer(&method, &format!("{}{path}", self.base_url), text)
    }

    /// Sends one request; a 2xx answer's body as it came, or the error (a refusal's body read as
    /// Meilisearch's error).
    fn request_text(
        &self,
        method: Method,
        path: &str,
        query: &[(&str, &str)],
        payload: Payload,
    ) -> Result<Vec<u8>, MeiliError> {
        let mut url = format!("{}{path}", self.base_url);
        for (position, (name, value)) in query.iter().enumerate() {
            url.push(if position == 0 { '?' } else { '&' });
            push_percent_encoded(&mut url, name);
            url.push('=');
            push_percent_encoded(&mut url, value);
        }
        let transport =
            |error: ureq::Error| MeiliError::Transport(format!("{method} {url}: {error}"));

        let mut request = Request::builder().method(method.clone()).uri(&url);
        if let Some(authorization) = &self.authorization {
            request = request.header("Authorization", authorization);
        }
        let sent = match payload {
            Payload::Empty => request.body(()).map(|r| self.agent.run(r)),
            Payload::Json(bytes) => request
                .header("Content-Type", "application/json")
                .body(bytes)
                .map(|r| self.agent.run(r)),
            Payload::Raw {
                bytes,
                content_type,
                gzip,
            } => {
                request = request.header("Content-Type", content_type);
                if gzip {
                    request = request.header("Content-Encoding", "gzip");
                }
                request.body(bytes).map(|r| self.agent.run(r))
            }
        };
        let mut response = sent
            .map_err(|error| {
                MeiliError::Config(format!("cannot build request {method} {url}: {error}"))
            })?
            .map_err(transport)?;
        let status = response.status().as_u16();
        let bytes = response
            .body_mut()
            .with_config()
            .limit(MAX_RESPONSE_BYTES)
            .read_to_vec()
            .map_err(transport)?;
        if (200..300).contains(&status) {
            Ok(bytes)
        } else {
            let body = serde_json::from_slice::<Value>(&bytes).ok();
            Err(MeiliError::Http {
                status,
                body: body.as_ref().and_then(MeiliErrorBody::from_json),
            })
        }
    }
}

/// A 2xx answer's JSON (`null` if empty).
fn parse_answer(method: &Method, url: &str, text: Vec<u8>) -> Result<Value, MeiliError> {
    if text.is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_slice::<Value>(&text).map_err(|error| {
        MeiliError::Protocol(format!(
            "{method} {url} answered with invalid JSON: {error}"
        ))
    })
}

/// No `Accept-Encoding`: Meilisearch answers a request that offers gzip with a compressed,
/// chunked body written in pieces, and with Nagle's algorithm on its socket the last piece waits
/// for the client's delayed ACK: 40 ms on every kept-alive request whose answer is compressed.
fn agent_config(timeout: Duration) -> ureq::config::Config {
    Agent::config_builder()
        .accept_encoding(AutoHeaderValue::None)
        .http_status_as_error(false)
        .timeout_global(Some(timeout))
        .max_idle_age(MAX_IDLE_AGE)
        .build()
}

fn new_agent(timeout: Duration) -> Agent {
    Agent::with_parts(
        agent_config(timeout),
        DefaultConnector::default(),
        CallingThreadResolver,
    )
}

/// Resolves host names on the thread that makes the request. ureq's default resolver starts a
/// thread per lookup when a timeout is set, and a thread started from a Postgres process's main
/// thread has signals unblocked: a SIGTERM delivered to it runs Postgres's handler off the main
/// thread, which aborts the process and restarts the whole server. The lookup's own time is
/// bounded by the system resolver (resolv.conf's timeout and attempts).
#[derive(Debug)]
struct CallingThreadResolver;

impl Resolver for CallingThreadResolver {
    fn resolve(
        &self,
        uri: &Uri,
        _config: &ureq::config::Config,
        _timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        let (Some(scheme), Some(authority)) = (uri.scheme(), uri.authority()) else {
            return Err(ureq::Error::HostNotFound);
        };
        let address =
            DefaultResolver::host_and_port(scheme, authority).ok_or(ureq::Error::HostNotFound)?;
        let mut resolved = self.empty();
        for socket_address in address.to_socket_addrs()? {
            if resolved.try_push(socket_address).is_err() {
                break;
            }
        }
        if resolved.is_empty() {
            Err(ureq::Error::HostNotFound)
        } else {
            Ok(resolved)
        }
    }
}

/// `/indexes/{uid}{rest}`, with the uid percent-encoded: Meilisearch only
/// allows `[A-Za-z0-9_-]`, but a bad uid must give its error, not a
/// request to another path.
fn index_path(uid: &str, rest: &str) -> String {
    let mut path = String::from("/indexes/");
    push_percent_encoded(&mut path, uid);
    path.push_str(rest);
    path
}

/// Keeps RFC 3986 unreserved characters and `,` (which separates list
/// values such as `uids=1,2`); encodes every other byte.
fn push_percent_encoded(out: &mut String, text: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~' | b',') {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
    }
}

/// The `taskUid` of a 202 answer.
fn task_uid(answer: &Value) -> Result<u64, MeiliError> {
    answer
        .get("taskUid")
        .and_then(Value::as_u64)
        .ok_or_else(|| MeiliError::Protocol(format!("no taskUid in {answer}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "s3cret-Key_123";

    fn client(url: &str) -> Result<Client, MeiliError> {
        Client::new(url, Some(KEY), Duration::from_secs(5))
    }

    /// The head of the one request a local listener receives, after answering it.
    fn request_head_of(call: impl FnOnce(&str)) -> String {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let server = thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("accept");
            let mut request = Vec::new();
            let mut buffer = [0u8; 4096];
            while !request.windows(4).any(|window| window == b"\r\n\r\n") {
                let read = stream.read(&mut buffer).expect("read");
                if read == 0 {
                    break;
                }
                request.extend_from_slice(&buffer[..read]);
            }
            let body = r#"{"hits":[],"query":"","processingTimeMs":0}"#;
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            String::from_utf8_lossy(&request).to_lowercase()
        });
        call(&url);
        server.join().expect("listener")
    }

    #[test]
    fn requests_ask_for_uncompressed_answers() {
        let head = request_head_of(|url| {
            client(url)
                .expect("client")
                .search("books", &json!({"q": "kettle"}))
                .expect("answer");
        });
        assert!(head.starts_with("post /indexes/books/search"), "{head}");
        assert!(!head.contains("accept-encoding"), "{head}");
    }

    #[test]
    fn accepts_http_and_https_urls() {
        assert_eq!(
            client("http://127.0.0.1:7700/").map(|c| c.url().to_string()),
            Ok("http://127.0.0.1:7700".to_string())
        );
        assert_eq!(
            client("https://search.example.com/meili/").map(|c| c.url().to_string()),
            Ok("https://search.example.com/meili".to_string())
        );
        assert!(Client::new("http://localhost:7700", None, Duration::from_secs(1)).is_ok());
    }

    #[test]
    fn refuses_unusable_urls_and_keys() {
        for url in [
            "localhost:7700",
            "ftp://localhost",
            "http://",
            "http://:7700",
            "http://localhost:7700/?x=1",
            "http://localhost:7700/#top",
            "not a url",
            "",
        ] {
            assert!(
                matches!(client(url), Err(MeiliError::Config(_))),
                "{url} was accepted"
            );
        }
        let credentials = client("http://admin:hunter2@localhost:7700").expect_err("refused");
        assert!(!credentials.to_string().contains("hunter2"));
        for key in ["", "two words", "line\nbreak", "é"] {
            let error = Client::new("http://localhost", Some(key), Duration::from_secs(1))
                .expect_err("refused");
            assert!(matches!(error, MeiliError::Config(_)));
            assert!(key.is_empty() || !error.to_string().contains(key));
        }
    }

    #[test]
    fn debug_output_hides_the_key() {
        let debug = format!("{:?}", client("http://localhost:7700").expect("valid"));
        assert!(!debug.contains(KEY), "{debug}");
        assert!(debug.contains("<hidden>"));
    }

    #[test]
    fn transport_errors_are_retryable_and_keyless() {
        // Port 1 on loopback: nothing listens there, the connection is refused.
        let client = client("http://127.0.0.1:1").expect("valid");
        let error = client.health().expect_err("nothing listens");
        assert!(matches!(error, MeiliError::Transport(_)), "{error:?}");
        assert!(error.is_retryable());
        assert!(!error.is_auth());
        let message = error.to_string();
        assert!(message.contains("http://127.0.0.1:1/health"), "{message}");
        assert!(!message.contains(KEY));
        assert!(!format!("{error:?}").contains(KEY));
    }

    #[test]
    fn classification_of_http_errors() {
        let http = |status| MeiliError::Http { status, body: None };
        for status in [500, 502, 503, 504, 408, 429] {
            assert!(http(status).is_retryable(), "{status}");
        }
        for status in [400, 401, 403, 404, 413, 415] {
            assert!(!http(status).is_retryable(), "{status}");
        }
        assert!(http(401).is_auth() && http(403).is_auth() && !http(400).is_auth());
        assert!(!MeiliError::Protocol("x".into()).is_retryable());
        assert!(!MeiliError::Config("x".into()).is_retryable());
    }

    #[test]
    fn error_bodies_are_read_and_shown() {
        // 33-invalid-api-key.json
        let body = MeiliErrorBody::from_json(&json!({
            "message": "The provided API key is invalid.",
            "code": "invalid_api_key",
            "type": "auth",
            "link": "https://docs.meilisearch.com/errors#invalid_api_key"
        }))
        .expect("an error object");
        assert_eq!(body.kind, "auth");
        let error = MeiliError::Http {
            status: 403,
            body: Some(body),
        };
        assert_eq!(
            error.to_string(),
            "Meilisearch answered HTTP 403: The provided API key is invalid. (invalid_api_key)"
        );
        assert_eq!(MeiliErrorBody::from_json(&json!({"code": "x"})), None);
        assert_eq!(MeiliErrorBody::from_json(&Value::Null), None);
    }

    #[test]
    fn task_states_are_read() {
        // 25-invalid-id-batch-task.json, shortened.
        let failed = MeiliTask::from_json(&json!({
            "uid": 7, "batchUid": 7, "indexUid": "products", "status": "failed",
            "type": "documentAdditionOrUpdate", "canceledBy": null,
            "details": {"receivedDocuments": 3, "indexedDocuments": 0},
            "error": {"message": "Document identifier `\"bad id with spaces!\"` is invalid.",
                      "code": "invalid_document_id", "type": "invalid_request",
                      "link": "https://docs.meilisearch.com/errors#invalid_document_id"},
            "duration": "PT0.001800576S", "enqueuedAt": "2026-11-30T00:00:32.513387071Z",
            "startedAt": "2026-11-30T00:00:32.514065479Z", "finishedAt": "2026-11-30T00:00:32.515866055Z"
        }))
        .expect("a task");
        assert_eq!(failed.uid, 7);
        assert_eq!(failed.status, MeiliTaskStatus::Failed);
        assert_eq!(
            failed.error.map(|e| e.code),
            Some("invalid_document_id".into())
        );
        for (status, expected, finished) in [
            ("enqueued", MeiliTaskStatus::Enqueued, false),
            ("processing", MeiliTaskStatus::Processing, false),
            ("succeeded", MeiliTaskStatus::Succeeded, true),
            ("canceled", MeiliTaskStatus::Canceled, true),
        ] {
            let state = MeiliTask::from_json(&json!({"uid": 1, "status": status, "error": null}))
                .expect("a task");
            assert_eq!(
                (state.status, state.status.is_finished()),
                (expected, finished)
            );
            assert_eq!(state.error, None);
        }
        assert!(matches!(
            MeiliTask::from_json(&json!({"uid": 1, "status": "exploded"})),
            Err(MeiliError::Protocol(_))
        ));
        assert!(matches!(
            MeiliTask::from_json(&json!({"status": "succeeded"})),
            Err(MeiliError::Protocol(_))
        ));
    }

    #[test]
    fn task_uids_are_read_from_enqueue_answers() {
        // 03-add-docs-ndjson.json
        let answer = json!({"taskUid": 1, "indexUid": "products", "status": "enqueued",
                            "type": "documentAdditionOrUpdate",
                            "enqueuedAt": "2026-11-30T00:00:18.429086222Z"});
        assert_eq!(task_uid(&answer), Ok(1));
        assert!(matches!(task_uid(&json!({})), Err(MeiliError::Protocol(_))));
    }

    #[test]
    fn paths_and_queries_are_percent_encoded() {
        assert_eq!(
            index_path("products", "/documents"),
            "/indexes/products/documents"
        );
        assert_eq!(index_path("a/b c", ""), "/indexes/a%2Fb%20c");
        let mut query = String::new();
        push_percent_encoded(&mut query, "1,2,3 &é");
        assert_eq!(query, "1,2,3%20%26%C3%A9");
    }

    mod against_test_server {
        use super::*;
        use meili_test_server::TestServer;
        use std::io::Write;

        const WAIT: Duration = Duration::from_secs(10);

        fn start() -> (TestServer, Client) {
            let server = TestServer::start(Some(KEY)).expect("test server starts");
            let client = Client::new(&server.url(), Some(KEY), WAIT).expect("valid URL");
            (server, client)
        }

        fn succeeded(client: &Client, task: Result<u64, MeiliError>) {
            let uid = task.expect("enqueued");
            let state = client.wait_task(uid, WAIT).expect("task state");
            assert_eq!(state.status, MeiliTaskStatus::Succeeded, "{state:?}");
        }

        #[test]
        fn health_version_and_index_lifecycle() {
            let (_server, client) = start();
            client.health().expect("healthy");
            assert!(!client.version().expect("a version").is_empty());
            assert_eq!(client.get_index("books"), Ok(None));
            succeeded(&client, client.create_index("books", "id"));
            let index = client.get_index("books").expect("answer").expect("exists");
            assert_eq!(index.primary_key.as_deref(), Some("id"));
            assert!(
                index.created_at.as_ref().is_some_and(|at| at.contains('T')),
                "{index:?}"
            );
            let settings = json!({"filterableAttributes": ["genre"]});
            succeeded(&client, client.update_settings("books", &settings));
            succeeded(&client, client.delete_index("books"));
            assert_eq!(client.get_index("books"), Ok(None));
        }

        #[test]
        fn a_second_deletion_of_an_index_finds_no_index() {
            let (_server, client) = start();
            succeeded(&client, client.create_index("books", "id"));
            let first = client.delete_index("books").expect("enqueued");
            let second = client.delete_index("books").expect("enqueued");
            let first = client.wait_task(first, WAIT).expect("task state");
            let second = client.wait_task(second, WAIT).expect("task state");
            assert_eq!(first.status, MeiliTaskStatus::Succeeded, "{first:?}");
            assert!(!first.found_no_index(), "{first:?}");
            assert_eq!(second.status, MeiliTaskStatus::Failed, "{second:?}");
            assert!(second.found_no_index(), "{second:?}");
            assert_eq!(client.get_index("books"), Ok(None));
        }

        #[test]
        fn search_finds_hits_and_meilisearch_refuses_bad_parameters() {
            let (_server, client) = start();
            succeeded(&client, client.create_index("books", "id"));
            let body =
                b"{\"id\": 1, \"title\": \"copper kettle\"}\n{\"id\": 2, \"title\": \"tea pot\"}\n";
            succeeded(
                &client,
                client.send_batch("books", "id", Operation::Replace, body, false),
            );
            let answer = client
                .search("books", &json!({"q": "kettle"}))
                .expect("an answer");
            let ids: Vec<&Value> = answer["hits"]
                .as_array()
                .expect("hits")
                .iter()
                .map(|hit| &hit["id"])
                .collect();
            assert_eq!(ids, vec![&json!(1)]);
            match client.search("books", &json!({"q": "x", "limit": "ten"})) {
                Err(MeiliError::Http {
                    status: 400,
                    body: Some(body),
                }) => assert_eq!(body.code, "invalid_search_limit"),
                other => panic!("{other:?}"),
            }
            assert!(matches!(
                client.search("missing", &json!({})),
                Err(MeiliError::Http { status: 404, .. })
            ));
        }

        #[test]
        fn every_batch_operation() {
            let (server, client) = start();
            let ndjson =
                b"{\"id\":1,\"t\":\"a\"}\n{\"id\":2,\"t\":\"b\"}\n{\"id\":\"x-3\",\"t\":\"c\"}\n";
            let tasks = [
                client.send_batch("books", "id", Operation::Replace, ndjson, false),
                client.send_batch(
                    "books",
                    "id",
                    Operation::Update,
                    b"{\"id\":1,\"n\":5}\n",
                    false,
                ),
                client.send_batch("books", "id", Operation::Delete, b"[2]", false),
            ]
            .map(|task| task.expect("enqueued"));
            assert!(tasks[0] < tasks[1] && tasks[1] < tasks[2]);
            assert!(server.wait_idle(WAIT));
            let states = client.get_tasks(&tasks).expect("task states");
            assert_eq!(states.len(), 3);
            assert!(
                states
                    .iter()
                    .all(|s| s.status == MeiliTaskStatus::Succeeded),
                "{states:?}"
            );
            assert_eq!(
                server.documents("books"),
                [
                    json!({"id": 1, "t": "a", "n": 5}),
                    json!({"id": "x-3", "t": "c"})
                ]
            );
            let (page, total) = client.fetch_documents("books", 1, 5).expect("a page");
            assert_eq!((page.len(), total), (1, 2));
            succeeded(
                &client,
                client.send_batch("books", "id", Operation::DeleteAll, b"", false),
            );
            assert!(server.documents("books").is_empty());
            let log = server.request_log();
            let paths: Vec<(&str, &str)> = log
                .iter()
                .filter(|r| r.path.contains("/documents"))
                .map(|r| (r.method.as_str(), r.path.as_str()))
                .collect();
            assert_eq!(
                paths[..4],
                [
                    ("POST", "/indexes/books/documents?primaryKey=id"),
                    ("PUT", "/indexes/books/documents?primaryKey=id"),
                    ("POST", "/indexes/books/documents/delete-batch"),
                    ("GET", "/indexes/books/documents?offset=1&limit=5"),
                ]
            );
        }

        #[test]
        fn gzip_bodies_are_accepted() {
            let (server, client) = start();
            let body = b"{\"id\":1}\n{\"id\":2}\n";
            let mut encoder =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            encoder.write_all(body).expect("in memory");
            let compressed = encoder.finish().expect("in memory");
            succeeded(
                &client,
                client.send_batch("books", "id", Operation::Replace, &compressed, true),
            );
            assert_eq!(server.documents("books").len(), 2);
            let log = server.request_log();
            let post = log.iter().find(|r| r.method == "POST").expect("logged");
            assert_eq!(post.content_encoding.as_deref(), Some("gzip"));
            assert_eq!(post.body, body);
        }

        #[test]
        fn failed_tasks_carry_their_error() {
            let (server, client) = start();
            server.faults().fail_next_tasks(1, "invalid_document_id");
            let uid = client
                .send_batch("books", "id", Operation::Replace, b"{\"id\":1}\n", false)
                .expect("enqueued");
            let state = client.wait_task(uid, WAIT).expect("task state");
            assert_eq!(state.status, MeiliTaskStatus::Failed);
            assert_eq!(state.error.expect("an error").code, "invalid_document_id");
        }

        #[test]
        fn wait_task_returns_the_unfinished_state_on_timeout() {
            let (server, client) = start();
            server.faults().set_task_delay(Duration::from_secs(5));
            let uid = client
                .send_batch("books", "id", Operation::Replace, b"{\"id\":1}\n", false)
                .expect("enqueued");
            let started = Instant::now();
            let state = client
                .wait_task(uid, Duration::from_millis(200))
                .expect("task state");
            assert!(!state.status.is_finished());
            assert!(started.elapsed() < Duration::from_secs(2));
            server.faults().clear();
        }

        #[test]
        fn auth_errors_do_not_show_the_key() {
            let server = TestServer::start(Some(KEY)).expect("test server starts");
            let wrong = Client::new(&server.url(), Some("wrong-Secret"), WAIT).expect("valid");
            let error = wrong.version().expect_err("refused");
            assert!(error.is_auth() && !error.is_retryable(), "{error:?}");
            assert!(matches!(error, MeiliError::Http { status: 403, .. }));
            assert!(!error.to_string().contains("wrong-Secret"), "{error}");
            let anonymous = Client::new(&server.url(), None, WAIT).expect("valid");
            let error = anonymous.version().expect_err("refused");
            assert!(
                matches!(error, MeiliError::Http { status: 401, .. }),
                "{error:?}"
            );
            assert!(error.is_auth());
        }

        #[test]
        fn server_errors_are_retryable() {
            let (server, client) = start();
            server.faults().fail_next_requests(1, 503);
            let error = client.version().expect_err("injected");
            assert!(error.is_retryable(), "{error:?}");
            let MeiliError::Http {
                status: 503,
                body: Some(body),
            } = &error
            else {
                panic!("{error:?}");
            };
            assert_eq!(body.code, "service_unavailable");
            server.faults().drop_next_connections(1);
            let error = client.version().expect_err("dropped");
            assert!(matches!(error, MeiliError::Transport(_)), "{error:?}");
            assert!(error.is_retryable());
            assert!(client.version().is_ok());
        }

        #[test]
        fn get_tasks_asks_once_for_many() {
            let (server, client) = start();
            let uids: Vec<u64> = (0..5)
                .map(|id| {
                    let doc = format!("{{\"id\":{id}}}\n");
                    client
                        .send_batch("books", "id", Operation::Replace, doc.as_bytes(), false)
                        .expect("enqueued")
                })
                .collect();
            assert!(server.wait_idle(WAIT));
            let states = client.get_tasks(&uids).expect("task states");
            let mut seen: Vec<u64> = states.iter().map(|s| s.uid).collect();
            seen.sort_unstable();
            assert_eq!(seen, uids);
            let log = server.request_log();
            let task_requests: Vec<&str> = log
                .iter()
                .filter(|r| r.path.starts_with("/tasks"))
                .map(|r| r.path.as_str())
                .collect();
            let list = uids
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(",");
            assert_eq!(task_requests, [format!("/tasks?uids={list}&limit=5")]);
            assert_eq!(client.get_tasks(&[]), Ok(Vec::new()));
        }
    }
}
