//! Searching from SQL, in a backend: one kept-alive client per URL and key, whose requests the
//! backend makes on its own thread and whose socket waits are latch waits, so that a cancel or a
//! `statement_timeout` ends a search at once (as postgres_fdw waits for its server). Meilisearch's
//! refusals become ERRORs with its message and code.

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use pgrx::prelude::*;
use serde_json::Value;

use crate::encode::COMPOSITE_KEY_ATTRIBUTE;
use crate::error::{ErrorKind, SyncError};
use crate::gucs;
use crate::meili::client::{Client, MeiliError};
use crate::meili::waiting_tcp::{Interest, SocketWait, Waited};

/// What a client is made for: its URL, key and timeout.
type ClientKey = (String, Option<String>, Duration);

thread_local! {
    /// Clients by URL, key and timeout: each keeps its connections alive between searches.
    static CLIENTS: RefCell<HashMap<ClientKey, Client>> = RefCell::new(HashMap::new());
}

/// The attribute an index's documents carry their id in, for a task's key columns.
pub fn id_attribute(key: &[String]) -> &str {
    match key {
        [one] => one,
        _ => COMPOSITE_KEY_ATTRIBUTE,
    }
}

/// The backend's client for this URL and key (made once, then reused with its connections).
pub fn client(url: &str, api_key: Option<&str>) -> Result<Client, SyncError> {
    let timeout = gucs::search_timeout();
    let cache_key = (url.to_owned(), api_key.map(str::to_owned), timeout);
    CLIENTS.with(|clients| {
        if let Some(client) = clients.borrow().get(&cache_key) {
            return Ok(client.clone());
        }
        let client = Client::with_socket_wait(url, api_key, timeout, Arc::new(LatchWait)).map_err(
            |error| {
                SyncError::new(ErrorKind::InvalidParameter, error.to_string())
                    .hint("Pass a Meilisearch URL such as http://127.0.0.1:7700.")
            },
        )?;
        clients.borrow_mut().insert(cache_key, client.clone());
        Ok(client)
    })
}

/// Runs one search. A cancel or `statement_timeout` ends the wait, the request ends with the
/// connection dropped, and the cancel's own ERROR is raised here, outside the HTTP client, so no
/// error unwinds through it.
pub fn run(client: &Client, index_uid: &str, body: Value) -> Result<Value, SyncError> {
    let answer = client.search(index_uid, &body);
    pgrx::check_for_interrupts!();
    answer.map_err(|error| meili_refusal(&error))
}

/// Whether a cancel, `statement_timeout` or termination waits to be raised: the wait then ends
/// the request instead of raising inside the HTTP client.
fn cancel_pending() -> bool {
    // SAFETY: reads flags the signal handlers set, on the backend's main thread.
    unsafe {
        pg_sys::InterruptPending != 0
            && (pg_sys::QueryCancelPending != 0 || pg_sys::ProcDiePending != 0)
    }
}

/// The backend's socket wait: its latch, which the cancel and timeout signal handlers set, and
/// the socket. Only the backend's main thread makes requests (the clients are thread-local).
struct LatchWait;

impl SocketWait for LatchWait {
    fn wait(&self, fd: RawFd, interest: Interest, timeout: Option<Duration>) -> Waited {
        if cancel_pending() {
            return Waited::Interrupted;
        }
        let socket = match interest {
            Interest::Read => pg_sys::WL_SOCKET_READABLE,
            Interest::Write => pg_sys::WL_SOCKET_WRITEABLE,
        };
        let mut events = pg_sys::WL_LATCH_SET | pg_sys::WL_EXIT_ON_PM_DEATH | socket;
        let timeout_ms = match timeout {
            Some(left) => {
                events |= pg_sys::WL_TIMEOUT;
                // At least a millisecond: a wait of 0 would spin until the deadline.
                left.as_millis().clamp(1, i64::from(i32::MAX) as u128) as std::ffi::c_long
            }
            None => -1,
        };
        // SAFETY: waits on this backend's own latch and an open socket of this thread's client;
        // WL_EXIT_ON_PM_DEATH ends the process if the postmaster dies.
        let happened = unsafe {
            pg_sys::WaitLatchOrSocket(
                pg_sys::MyLatch,
                events as i32,
                fd,
                timeout_ms,
                pg_sys::PG_WAIT_EXTENSION,
            )
        };
        if happened & pg_sys::WL_LATCH_SET as i32 != 0 {
            // SAFETY: resets this backend's own latch before the interrupts it announced are
            // looked at, as every latch loop does.
            unsafe { pg_sys::ResetLatch(pg_sys::MyLatch) };
            if cancel_pending() {
                return Waited::Interrupted;
            }
        }
        if happened & pg_sys::WL_TIMEOUT as i32 != 0 && happened & socket as i32 == 0 {
            Waited::TimedOut
        } else {
            Waited::Ready
        }
    }
}

/// Meilisearch's refusal as an ERROR with its message and code, and a SQLSTATE that fits:
/// a bad parameter `22023`, a missing index `42704`, a refused key `42501`, an unreachable or
/// failing server `08006`.
fn meili_refusal(error: &MeiliError) -> SyncError {
    match error {
        MeiliError::Http {
            status,
            body: Some(body),
        } => {
            let kind = if error.is_auth() {
                ErrorKind::Privilege
            } else if *status == 404 {
                ErrorKind::UndefinedTask
            } else if *status >= 500 {
                ErrorKind::Meilisearch
            } else {
                ErrorKind::InvalidParameter
            };
            let hint = match kind {
                ErrorKind::Privilege => "Check the task's search_api_key (or api_key): it must be allowed to search this index.",
                ErrorKind::UndefinedTask => "The index does not exist (yet): a task creates it when it starts.",
                ErrorKind::Meilisearch => "Meilisearch failed; try again.",
                _ => "Options are Meilisearch's search parameters, as its search API documents them.",
            };
            SyncError::new(
                kind,
                format!("Meilisearch: {} ({})", body.message, body.code),
            )
            .detail(format!(
                "HTTP {status}, error type {}, {}",
                body.kind, body.link
            ))
            .hint(hint)
        }
        MeiliError::Transport(message) => SyncError::new(
            ErrorKind::Meilisearch,
            format!("cannot reach Meilisearch: {message}"),
        )
        .hint("Check that Meilisearch is up; meili_sync.search_timeout bounds the wait."),
        other => SyncError::new(ErrorKind::Meilisearch, other.to_string()),
    }
}
