//! Searching from SQL, in a backend: one kept-alive client per URL and key, whose requests the
//! backend makes on its own thread and whose socket waits are latch waits, so that a cancel or a
//! `statement_timeout` ends a search at once (as postgres_fdw waits for its server). Meilisearch's
//! refusals become ERRORs with its message and code.
//!
//! The folder holds what a backend's search needs besides its SQL entry points (`src/api/search.rs`)
//! and the SPI that lists a task's servers (`src/catalog/search_targets.rs`): the client here, the
//! hits built into `jsonb` in place (`jsonb`), and the rows handed to Postgres in one call
//! (`materialized`).

pub mod jsonb;
pub mod materialized;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use pgrx::prelude::*;
use serde_json::Value;

use pg_meili_sync_core::document::encode::COMPOSITE_KEY_ATTRIBUTE;
use pg_meili_sync_core::meili::client::{Client, MeiliError};
use pg_meili_sync_core::meili::network::federated_search_body;
use pg_meili_sync_core::meili::waiting_tcp::{Interest, SocketWait, Waited};

use crate::error::{ErrorKind, SyncError};
use crate::gucs;

/// What a client is made for: its URL, key and timeout.
type ClientKey = (String, Option<String>, Duration);

thread_local! {
    /// Clients by URL, key and timeout: each keeps its connections alive between searches.
    static CLIENTS: RefCell<HashMap<ClientKey, Client>> = RefCell::new(HashMap::new());
    /// Read-your-writes: for each task this session waited for, the highest position a
    /// `meili_sync_wait` returned true for. A search through the task asks only replicas that
    /// have confirmed it.
    static WAITED: RefCell<HashMap<i64, u64>> = RefCell::new(HashMap::new());
}

/// `meili_sync_wait` saw the task (one of its replicas at least) confirm `lsn`.
pub fn note_waited(task_id: i64, lsn: u64) {
    WAITED.with(|waited| {
        let mut waited = waited.borrow_mut();
        let position = waited.entry(task_id).or_insert(lsn);
        *position = (*position).max(lsn);
    });
}

/// The position this session last waited for on the task, if any.
pub fn waited_for(task_id: i64) -> Option<u64> {
    WAITED.with(|waited| waited.borrow().get(&task_id).copied())
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
/// With `shards` (a sharded task's), one federated search through this server reaches every shard
/// (its network's remotes), and Meilisearch merges their hits; `shards_failed` says whether an
/// answer that lacks a shard's hits is an ERROR or is returned with its `remoteErrors`.
pub fn run(
    client: &Client,
    index_uid: &str,
    shards: &[String],
    body: Value,
    shards_failed: ShardsFailed,
) -> Result<Value, SyncError> {
    if shards.is_empty() {
        return answered(client.search(index_uid, &body));
    }
    let text = federated_or_not(client, index_uid, shards, body, shards_failed)?;
    serde_json::from_slice(&text).map_err(|error| {
        SyncError::new(
            ErrorKind::Meilisearch,
            format!("Meilisearch answered the search with invalid JSON: {error}"),
        )
    })
}

/// What a sharded search does when some shards did not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardsFailed {
    Refuse,
    Return,
}

/// Runs one search as [`run`] does (a partial answer refused), and returns the answer's JSON text.
pub fn run_for_text(
    client: &Client,
    index_uid: &str,
    shards: &[String],
    body: Value,
) -> Result<Vec<u8>, SyncError> {
    federated_or_not(client, index_uid, shards, body, ShardsFailed::Refuse)
}

fn federated_or_not(
    client: &Client,
    index_uid: &str,
    shards: &[String],
    body: Value,
    shards_failed: ShardsFailed,
) -> Result<Vec<u8>, SyncError> {
    if shards.is_empty() {
        return answered(client.search_text(index_uid, &body));
    }
    let names: Vec<&str> = shards.iter().map(String::as_str).collect();
    let federated = federated_search_body(index_uid, &body, &names).map_err(|refused| {
        SyncError::new(ErrorKind::InvalidParameter, refused.0).hint(
            "A sharded task's search is one federated search over its shards: pagination and facets apply to the merged hits.",
        )
    })?;
    let text = answered(client.multi_search_text(&federated))?;
    if shards_failed == ShardsFailed::Refuse {
        refuse_remote_errors(&text)?;
    }
    Ok(text)
}

/// A federated search whose remotes did not all answer would miss their documents without a
/// word: an ERROR names each shard that failed.
fn refuse_remote_errors(text: &[u8]) -> Result<(), SyncError> {
    // Most answers say `"remoteErrors":{}`: found without reading the hits into a value.
    if text
        .windows(17)
        .any(|window| window == b"\"remoteErrors\":{}")
    {
        return Ok(());
    }
    let Ok(answer) = serde_json::from_slice::<Value>(text) else {
        return Ok(());
    };
    let Some(remote_errors) = answer
        .get("remoteErrors")
        .and_then(Value::as_object)
        .filter(|errors| !errors.is_empty())
    else {
        return Ok(());
    };
    let failures: Vec<String> = remote_errors
        .iter()
        .map(|(shard, error)| {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| error.to_string(), str::to_owned);
            format!("{shard}: {message}")
        })
        .collect();
    Err(SyncError::new(
        ErrorKind::Meilisearch,
        format!(
            "the search did not reach every shard: {}",
            failures.join("; ")
        ),
    )
    .hint("Check that each shard's Meilisearch is up (meili_sync_status shows them); meili_search_raw returns the shards that answered, with remoteErrors."))
}

/// A search's answer, once a cancel that ended it is raised.
fn answered<T>(answer: Result<T, MeiliError>) -> Result<T, SyncError> {
    pgrx::check_for_interrupts!();
    answer.map_err(meili_refusal)
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

/// The wait set of the socket the backend last waited for: latch, postmaster death and that
/// socket, kept from one wait to the next instead of made for each (an epoll set made and closed
/// is five system calls a wait). Freed when its socket is about to close, or when another socket
/// is waited for. Plain data with no destructor: a thread-local destructor would run inside
/// `exit()`, after Postgres has shut down, and a live set at exit is closed by the exit itself.
#[derive(Clone, Copy)]
struct SocketWaitSet {
    set: *mut pg_sys::WaitEventSet,
    fd: RawFd,
    socket_events: u32,
}

/// The position of the socket in a [`SocketWaitSet`] (after the latch and postmaster death).
const SOCKET_POSITION: i32 = 2;

thread_local! {
    static WAIT_SET: Cell<Option<SocketWaitSet>> = const { Cell::new(None) };
}

impl SocketWaitSet {
    fn new(fd: RawFd, socket_events: u32) -> SocketWaitSet {
        // SAFETY: a set of three events in TopMemoryContext (it outlives transactions; freed by
        // `free`), on the backend's main thread, with the backend's own latch and an open socket.
        // PostgreSQL 17 made the first argument a resource owner and always allocates the set in
        // TopMemoryContext: with none, no resource owner frees it, so it lives until `free` too.
        let set = unsafe {
            #[cfg(any(feature = "pg15", feature = "pg16"))]
            let set = pg_sys::CreateWaitEventSet(pg_sys::TopMemoryContext, 3);
            #[cfg(not(any(feature = "pg15", feature = "pg16")))]
            let set = pg_sys::CreateWaitEventSet(std::ptr::null_mut(), 3);
            pg_sys::AddWaitEventToSet(
                set,
                pg_sys::WL_LATCH_SET,
                pg_sys::PGINVALID_SOCKET,
                pg_sys::MyLatch,
                std::ptr::null_mut(),
            );
            pg_sys::AddWaitEventToSet(
                set,
                pg_sys::WL_EXIT_ON_PM_DEATH,
                pg_sys::PGINVALID_SOCKET,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            pg_sys::AddWaitEventToSet(
                set,
                socket_events,
                fd,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            set
        };
        SocketWaitSet {
            set,
            fd,
            socket_events,
        }
    }

    /// The set, waiting for these socket events from now on.
    fn for_events(mut self, socket_events: u32) -> SocketWaitSet {
        if socket_events != self.socket_events {
            // SAFETY: the socket's position in this live set, with events of a socket.
            unsafe {
                pg_sys::ModifyWaitEvent(
                    self.set,
                    SOCKET_POSITION,
                    socket_events,
                    std::ptr::null_mut(),
                )
            };
            self.socket_events = socket_events;
        }
        self
    }

    /// Waits for the socket, the latch or the timeout (-1: none); returns the events that
    /// happened (none: the timeout).
    fn wait(self, timeout_ms: std::ffi::c_long) -> u32 {
        // SAFETY: an all-zero WaitEvent array is plain data for WaitEventSetWait to fill.
        let mut happened: [pg_sys::WaitEvent; 3] = unsafe { std::mem::zeroed() };
        // SAFETY: waits on this live set, filling at most three events; WL_EXIT_ON_PM_DEATH ends
        // the process if the postmaster dies.
        let count = unsafe {
            pg_sys::WaitEventSetWait(
                self.set,
                timeout_ms,
                happened.as_mut_ptr(),
                happened.len() as i32,
                pg_sys::PG_WAIT_EXTENSION,
            )
        };
        happened
            .iter()
            .take(count.max(0) as usize)
            .fold(0, |events, event| events | event.events)
    }

    fn free(self) {
        // SAFETY: frees a set `new` made, once: it was taken out of WAIT_SET first.
        unsafe { pg_sys::FreeWaitEventSet(self.set) };
    }
}

impl SocketWait for LatchWait {
    fn wait(&self, fd: RawFd, interest: Interest, timeout: Option<Duration>) -> Waited {
        if cancel_pending() {
            return Waited::Interrupted;
        }
        let socket = match interest {
            Interest::Read => pg_sys::WL_SOCKET_READABLE,
            Interest::Write => pg_sys::WL_SOCKET_WRITEABLE,
        };
        let timeout_ms = match timeout {
            // At least a millisecond: a wait of 0 would spin until the deadline.
            Some(left) => {
                left.as_millis().clamp(1, i64::from(i32::MAX) as u128) as std::ffi::c_long
            }
            None => -1,
        };
        let set = match WAIT_SET.take() {
            Some(set) if set.fd == fd => set,
            other => {
                if let Some(old) = other {
                    old.free();
                }
                SocketWaitSet::new(fd, socket)
            }
        }
        .for_events(socket);
        // Kept before the wait, so that a wait that unwinds leaves it for `forget`.
        WAIT_SET.set(Some(set));
        let happened = set.wait(timeout_ms);
        if happened & pg_sys::WL_LATCH_SET != 0 {
            // SAFETY: resets this backend's own latch before the interrupts it announced are
            // looked at, as every latch loop does.
            unsafe { pg_sys::ResetLatch(pg_sys::MyLatch) };
            if cancel_pending() {
                return Waited::Interrupted;
            }
        }
        if happened == 0 {
            Waited::TimedOut
        } else {
            Waited::Ready
        }
    }

    fn forget(&self, fd: RawFd) {
        match WAIT_SET.take() {
            // The backend's clients go with its thread-local destructors, inside exit(): Postgres
            // is done by then, and the exit closes the set's descriptor.
            // SAFETY: reads a flag of this process.
            Some(_) if unsafe { pg_sys::proc_exit_inprogress } => {}
            Some(set) if set.fd == fd => set.free(),
            other => WAIT_SET.set(other),
        }
    }
}

/// Meilisearch's refusal as an ERROR with its message and code (see `SyncError`'s
/// `From<MeiliError>` for the SQLSTATEs), with the hints that fit a search.
fn meili_refusal(error: MeiliError) -> SyncError {
    let transport = matches!(error, MeiliError::Transport(_));
    let error = SyncError::from(error);
    let hint = match error.kind {
        ErrorKind::Privilege => {
            "Check the task's search_api_key (or api_key): it must be allowed to search this index."
        }
        ErrorKind::InvalidParameter => {
            "Options are Meilisearch's search parameters, as its search API documents them."
        }
        ErrorKind::Meilisearch if transport => {
            "Check that Meilisearch is up; meili_sync.search_timeout bounds the wait."
        }
        _ => return error,
    };
    error.hint(hint)
}
