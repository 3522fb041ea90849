//! What a search through a task needs (its URL, key, index and key columns), kept per backend so
//! that a search runs no SPI: reading the task took most of a cheap search's time.
//!
//! An entry is good until the catalog says otherwise. Triggers on `meili_sync.tasks` (the
//! columns a search uses) and on `meili_sync.task_secrets` send a relcache invalidation for the
//! table at commit (`invalidate_search_targets`); every backend's callback then moves an epoch,
//! and entries of an older epoch are read again. The privilege check is not cached: it is made on
//! every call, against the current role.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use pgrx::prelude::*;

use super::{as_catalog_owner, select_one, CatalogResult};
use crate::error::SyncError;

/// A task as a search sees it.
#[derive(Debug)]
pub struct SearchTarget {
    pub task_id: i64,
    /// The table or view whose SELECT privilege a search needs.
    pub relid: pg_sys::Oid,
    pub url: String,
    pub index_uid: String,
    /// The task's `search_api_key` when it has one, else its `api_key`.
    pub api_key: Option<String>,
    pub primary_key: Vec<String>,
    /// The task's other replicas (option `replicas`): a search fails over to them.
    pub replicas: Vec<ReplicaServer>,
    /// A sharded task's shards, by name: its searches are federated over them.
    pub shards: Vec<String>,
    /// Why the task may not be searched at all: its view's rows depend on who reads it (made
    /// `security_invoker`, or replaced, after the task started).
    pub refusal: Option<SyncError>,
}

/// One more server holding the task's index.
#[derive(Debug)]
pub struct ReplicaServer {
    /// The replica's own task row (its live state says whether it is in step).
    pub task_id: i64,
    pub url: String,
    /// Its `search_api_key` when it has one, else its `api_key`.
    pub api_key: Option<String>,
}

thread_local! {
    /// Moved by every invalidation of a watched table (or of the whole relcache).
    static EPOCH: Cell<u64> = const { Cell::new(0) };
    /// `meili_sync.tasks` and `meili_sync.task_secrets`, as of epoch `WATCHED_AT`; 0 before.
    static WATCHED: Cell<[u32; 2]> = const { Cell::new([0, 0]) };
    static WATCHED_AT: Cell<Option<u64>> = const { Cell::new(None) };
    static REGISTERED: Cell<bool> = const { Cell::new(false) };
    static TARGETS: RefCell<(u64, HashMap<i64, Rc<SearchTarget>>)> =
        RefCell::new((0, HashMap::new()));
    /// The tables and views of the cached targets: an invalidation of one (`ALTER VIEW … SET
    /// (security_invoker)`, `CREATE OR REPLACE VIEW`) moves the epoch too.
    static TARGET_RELIDS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// The task `task_id` for a search, from the backend's cache or read as the catalog owner;
/// `None` if there is no such task.
pub fn search_target(task_id: i64) -> CatalogResult<Option<Rc<SearchTarget>>> {
    // SAFETY: processes the invalidations other backends committed, so that a task altered
    // before this statement began is read again (the callback below only moves the epoch).
    unsafe { pg_sys::AcceptInvalidationMessages() };
    watch_catalog()?;
    let epoch = EPOCH.with(Cell::get);
    let cached = TARGETS.with(|targets| {
        let mut targets = targets.borrow_mut();
        if targets.0 != epoch {
            *targets = (epoch, HashMap::new());
            TARGET_RELIDS.with(|relids| relids.borrow_mut().clear());
        }
        targets.1.get(&task_id).cloned()
    });
    if cached.is_some() {
        return Ok(cached);
    }
    let Some(record) = super::tasks::load_task_for_search(task_id)? else {
        return Ok(None);
    };
    let replicas = as_catalog_owner(|| super::tasks::replicas_of(record.id))?
        .into_iter()
        .map(|replica| ReplicaServer {
            task_id: replica.id,
            url: replica.url,
            api_key: replica.search_api_key.or(replica.api_key),
        })
        .collect();
    let declared_by = record
        .options
        .get("reader_independent")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false)
        .then_some(record.owner);
    let refusal = super::reader_dependence::refuse_rows_by_who_asks(
        record.relid,
        &record.relation,
        declared_by,
    )
    .err()
    .map(|error| {
        let mut refused = SyncError::new(
            error.kind,
            format!("task {} cannot be searched: {}", record.id, error.message),
        );
        refused.hint = error.hint;
        refused
    });
    let target = Rc::new(SearchTarget {
        refusal,
        task_id: record.id,
        relid: record.relid,
        url: record.url,
        index_uid: record.index_uid,
        api_key: record.search_api_key.or(record.api_key),
        primary_key: record.primary_key,
        shards: record.shard_names.unwrap_or_default(),
        replicas,
    });
    // Kept under the epoch read before the task was: an invalidation that arrived while it was
    // read (locks process them) leaves this entry stale, to be read again next time.
    TARGETS.with(|targets| {
        let mut targets = targets.borrow_mut();
        if targets.0 == epoch {
            targets.1.insert(task_id, Rc::clone(&target));
            TARGET_RELIDS.with(|relids| relids.borrow_mut().push(target.relid.to_u32()));
        }
    });
    Ok(Some(target))
}

/// Registers the backend's relcache callback the first time, and learns the two tables' OIDs
/// again after every invalidation: a DROP and CREATE EXTENSION makes new tables, whose
/// invalidations the old OIDs would miss.
fn watch_catalog() -> CatalogResult<()> {
    let epoch = EPOCH.with(Cell::get);
    if WATCHED_AT.with(Cell::get) == Some(epoch) {
        return Ok(());
    }
    let tables = as_catalog_owner(|| {
        Ok((
            super::install_id()?,
            select_one::<pg_sys::Oid>(
                "SELECT 'meili_sync.task_secrets'::pg_catalog.regclass::pg_catalog.oid",
                &[],
            )?,
        ))
    })?;
    let (Some(tasks), Some(secrets)) = tables else {
        return Ok(());
    };
    WATCHED.with(|watched| watched.set([tasks.to_u32(), secrets.to_u32()]));
    // An invalidation of the new tables taken while the old OIDs were watched went unseen:
    // everything cached is read again.
    let epoch = epoch.wrapping_add(1);
    EPOCH.with(|current| current.set(epoch));
    WATCHED_AT.with(|at| at.set(Some(epoch)));
    if !REGISTERED.with(Cell::get) {
        // SAFETY: registers a callback that only moves a counter (it cannot fail or raise); the
        // backend keeps it for its life, and REGISTERED makes this happen once of the ten the
        // relcache allows.
        unsafe {
            pg_sys::CacheRegisterRelcacheCallback(
                Some(on_relcache_invalidation),
                pg_sys::Datum::from(0),
            )
        };
        REGISTERED.with(|registered| registered.set(true));
    }
    Ok(())
}

// SAFETY: called by Postgres's invalidation machinery on this backend's main thread, with the
// arguments CacheRegisterRelcacheCallback documents; #[pg_guard] keeps a panic from unwinding
// into C. It only reads and sets this thread's own flags.
#[pg_guard]
unsafe extern "C-unwind" fn on_relcache_invalidation(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    let watched = WATCHED.with(Cell::get);
    // A list in use right now (the callback runs inside a lock or an invalidation) counts as
    // holding the relation: a needless re-read, never a stale entry.
    let targeted = TARGET_RELIDS.with(|relids| {
        relids
            .try_borrow()
            .map_or(true, |relids| relids.contains(&relid.to_u32()))
    });
    if relid == pg_sys::InvalidOid || watched.contains(&relid.to_u32()) || targeted {
        EPOCH.with(|epoch| epoch.set(epoch.get().wrapping_add(1)));
    }
}

/// Sends, at commit, an invalidation of `relid` (a watched table) to every backend: the body of
/// the triggers that keep the cache true.
pub fn invalidate_search_targets(relid: pg_sys::Oid) {
    // SAFETY: queues a relcache invalidation of an existing relation (the trigger's own table)
    // in the current transaction; Postgres sends it at commit and drops it on abort.
    unsafe { pg_sys::CacheInvalidateRelcacheByRelid(relid) };
}

/// Whether the current role may SELECT from `relid` (false if it is gone), without SPI.
pub fn current_role_may_select(relid: pg_sys::Oid) -> bool {
    let mut missing = false;
    // SAFETY: a privilege check through the syscache for the current user; with `is_missing`
    // given, a relation that is gone sets it instead of raising an ERROR.
    let result = unsafe {
        pg_sys::pg_class_aclcheck_ext(
            relid,
            pg_sys::GetUserId(),
            pg_sys::ACL_SELECT as pg_sys::AclMode,
            &mut missing,
        )
    };
    !missing && result == pg_sys::AclResult::ACLCHECK_OK
}
