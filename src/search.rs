//! Searching from SQL, in a backend: one kept-alive client per URL and key, and one search thread
//! per backend that makes the requests, so that the backend's own thread keeps checking for a
//! cancel or a `statement_timeout` while Meilisearch answers. Meilisearch's refusals become
//! ERRORs with its message and code.

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::Duration;

use pgrx::prelude::*;
use serde_json::Value;

use crate::encode::COMPOSITE_KEY_ATTRIBUTE;
use crate::error::{ErrorKind, SyncError};
use crate::gucs;
use crate::meili::client::{Client, MeiliError};
use crate::meili::search::{SearchThread, Waited};

/// What a client is made for: its URL, key and timeout.
type ClientKey = (String, Option<String>, Duration);

thread_local! {
    /// Clients by URL, key and timeout: each keeps its connections alive between searches.
    static CLIENTS: RefCell<HashMap<ClientKey, Client>> = RefCell::new(HashMap::new());
    static THREAD: RefCell<Option<SearchThread>> = const { RefCell::new(None) };
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
        let client = Client::new(url, api_key, timeout).map_err(|error| {
            SyncError::new(ErrorKind::InvalidParameter, error.to_string())
                .hint("Pass a Meilisearch URL such as http://127.0.0.1:7700.")
        })?;
        clients.borrow_mut().insert(cache_key, client.clone());
        Ok(client)
    })
}

/// Runs one search on the backend's search thread, starting it the first time. While it waits,
/// the backend checks for interrupts: a cancel or `statement_timeout` raises its ERROR here.
pub fn run(client: &Client, index_uid: &str, body: Value) -> Result<Value, SyncError> {
    THREAD.with(|thread| {
        let mut thread = thread.borrow_mut();
        if thread.is_none() {
            *thread = Some(start_thread()?);
        }
        let Some(searcher) = thread.as_mut() else {
            return Err(SyncError::new(ErrorKind::Internal, "no search thread"));
        };
        let waited = searcher.search(client, index_uid, body, || {
            pgrx::check_for_interrupts!();
            false
        });
        match waited {
            Ok(Waited::Answer(answer)) => answer.map_err(|error| meili_refusal(&error)),
            Ok(Waited::Interrupted) => Err(SyncError::new(
                ErrorKind::Internal,
                "the search was interrupted",
            )),
            Err(message) => {
                *thread = None;
                Err(SyncError::new(ErrorKind::Internal, message))
            }
        }
    })
}

fn start_thread() -> Result<SearchThread, SyncError> {
    // SAFETY: blocks every signal on this (the backend's) thread for the moment of the spawn, so
    // that the new thread inherits a mask with all of them blocked and no Postgres signal handler
    // ever runs on it; signals arriving meanwhile stay pending.
    unsafe { pg_sys::BackgroundWorkerBlockSignals() };
    let started = SearchThread::start();
    // SAFETY: restores the mask a backend runs with (UnBlockSig, as PostgresMain sets it).
    unsafe { pg_sys::BackgroundWorkerUnblockSignals() };
    started.map_err(|error| {
        SyncError::new(
            ErrorKind::Internal,
            format!("cannot start the search thread: {error}"),
        )
    })
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
