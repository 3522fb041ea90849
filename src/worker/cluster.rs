//! The cluster launcher: the one static worker. It connects to no database, reads `pg_database`,
//! and runs a launcher (`worker::launcher`) in each database that has tasks, as TimescaleDB's
//! launcher runs a scheduler per database. After a start it looks into each database once (its
//! launcher exits at once when there is nothing to do); later a database's launcher is started
//! again when a SQL function there asks for it (`shmem::launchers::wake_launcher`). Template databases, and
//! databases that refuse connections, are not served: a launcher connected to a template would
//! block `CREATE DATABASE` from it.
//!
//! It is registered by `_PG_init` only when the library is in `shared_preload_libraries`, starts
//! after recovery, and is restarted 5 s after it exits; a new one adopts the launchers that kept
//! running. It starts a database's launcher again after that launcher exited with work left (with
//! a backoff) or when SQL asked for it; it keeps out of a database that `ddl_guard` paused, and
//! forgets the shared-memory entries of dropped databases. Only databases with the extension and
//! tasks (or leftovers to drop) hold an entry, so empty databases cannot fill the table.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags,
};
use pgrx::prelude::*;

use crate::gucs;
use crate::shmem;
use crate::worker::control::reload_config_if_asked;
use crate::worker::launcher::{start_database_launcher, survive, Backoff, Worker};

/// How often the cluster launcher reads `pg_database` when nothing wakes it.
const ROUND_INTERVAL: Duration = Duration::from_secs(5);
/// Databases looked into at once after a start, so that a cluster of many databases does not
/// take every background worker slot for a moment.
const LOOKS_AT_ONCE: usize = 2;
/// `pg_database.datconnlimit` of a database whose DROP DATABASE was interrupted.
const DATCONNLIMIT_INVALID_DB: i32 = -2;

pub fn register() {
    BackgroundWorkerBuilder::new("pg_meili_sync cluster launcher")
        .set_type("pg_meili_sync cluster launcher")
        .set_library("pg_meili_sync")
        .set_function("meili_sync_launcher_main")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(Some(Duration::from_secs(5)))
        .load();
}

/// A database as `pg_database` shows it.
struct Database {
    oid: pg_sys::Oid,
    name: String,
    /// Connections allowed, not a template, not half-dropped.
    servable: bool,
}

/// The cluster launcher's view of one database's launcher.
#[derive(Default)]
struct DatabaseRun {
    launcher: Option<Worker>,
    started: Option<Instant>,
    /// Its launcher ran at least once since this cluster launcher started.
    looked_into: bool,
    backoff: Backoff,
}

#[derive(Default)]
struct Cluster {
    runs: HashMap<pg_sys::Oid, DatabaseRun>,
}

impl Cluster {
    fn round(&mut self) {
        let databases = list_databases();
        let existing: Vec<pg_sys::Oid> = databases.iter().map(|database| database.oid).collect();
        shmem::launchers::forget_databases_except(&existing);
        let only = gucs::database();
        let served: Vec<&Database> = databases
            .iter()
            .filter(|database| {
                database.servable && only.as_ref().is_none_or(|name| *name == database.name)
            })
            .collect();
        self.runs
            .retain(|oid, _| served.iter().any(|database| database.oid == *oid));
        let mut looks = self
            .runs
            .values()
            .filter(|run| {
                run.launcher.is_some()
                    && run
                        .started
                        .is_some_and(|at| at.elapsed() < Duration::from_secs(10))
            })
            .count();
        let now = Instant::now();
        for database in served {
            let state = shmem::launchers::launcher_state(database.oid);
            let run = self.runs.entry(database.oid).or_default();
            if run.launcher.as_ref().is_some_and(Worker::has_exited) {
                run.launcher = None;
                // An exit with work left (an ERROR, a signal) is restarted after a backoff.
                if !state.idle {
                    let ran = run.started.map(|at| at.elapsed()).unwrap_or_default();
                    run.backoff.count_exit(ran);
                }
            }
            if run.launcher.is_none() {
                // A launcher this cluster launcher did not start (it was restarted itself).
                if let Some(pid) = state.pid {
                    run.launcher = Some(Worker::Adopted(pid));
                    run.looked_into = true;
                }
            }
            if run.launcher.is_some() || state.paused {
                continue;
            }
            let due = !run.looked_into || state.wanted || !state.idle;
            if !due || run.backoff.not_before.is_some_and(|at| now < at) {
                continue;
            }
            if !run.looked_into {
                if looks >= LOOKS_AT_ONCE {
                    continue;
                }
                looks += 1;
            }
            match start_database_launcher(database.oid) {
                Ok(handle) => {
                    run.launcher = Some(Worker::Started(handle));
                    run.started = Some(now);
                    run.looked_into = true;
                    run.backoff.not_before = None;
                }
                Err(()) => {
                    warning!(
                        "pg_meili_sync: could not start the launcher of database \"{}\": no background worker slot free",
                        database.name
                    );
                    run.backoff.not_before = Some(now + gucs::restart_backoff());
                }
            }
        }
    }

    /// The soonest moment a delayed start is due.
    fn next_wake(&self) -> Duration {
        let now = Instant::now();
        let waiting_to_look = self.runs.values().any(|run| !run.looked_into);
        let interval = if waiting_to_look {
            gucs::naptime()
        } else {
            ROUND_INTERVAL
        };
        self.runs
            .values()
            .filter_map(|run| run.backoff.not_before)
            .map(|at| at.saturating_duration_since(now))
            .fold(interval, Duration::min)
            .max(Duration::from_millis(10))
    }
}

/// Every database of the cluster, read from the shared catalog `pg_database` as autovacuum's
/// launcher reads it (this process is connected to no database, so SQL cannot run).
fn list_databases() -> Vec<Database> {
    BackgroundWorker::transaction(|| {
        let mut databases = Vec::new();
        // SAFETY: inside a transaction of a process that connected to no database: pg_database is
        // a shared catalog, opened and scanned under AccessShareLock and closed again before the
        // transaction ends; each tuple's fixed part is FormData_pg_database, and its name is a
        // NUL-terminated NameData.
        unsafe {
            let relation = pg_sys::table_open(
                pg_sys::DatabaseRelationId,
                pg_sys::AccessShareLock as pg_sys::LOCKMODE,
            );
            let scan = pg_sys::table_beginscan_catalog(relation, 0, std::ptr::null_mut());
            loop {
                let tuple = pg_sys::heap_getnext(scan, pg_sys::ScanDirection::ForwardScanDirection);
                if tuple.is_null() {
                    break;
                }
                let form = &*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tuple);
                let name = std::ffi::CStr::from_ptr(form.datname.data.as_ptr())
                    .to_string_lossy()
                    .into_owned();
                databases.push(Database {
                    oid: form.oid,
                    name,
                    servable: form.datallowconn
                        && !form.datistemplate
                        && form.datconnlimit != DATCONNLIMIT_INVALID_DB,
                });
            }
            pg_sys::table_endscan(scan);
            pg_sys::table_close(relation, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        }
        databases
    })
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn meili_sync_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // No database: pg_database is shared, and a connection would keep its database from being
    // dropped or copied.
    BackgroundWorker::connect_worker_to_spi_by_oid(None, None);
    shmem::launchers::register_cluster_launcher();
    match gucs::database() {
        Some(only) => log!("pg_meili_sync cluster launcher started; it serves database \"{only}\" only (meili_sync.database)"),
        None => log!("pg_meili_sync cluster launcher started; it serves every database that has tasks"),
    }
    let mut cluster = Cluster::default();
    let mut wait = Duration::ZERO;
    while BackgroundWorker::wait_latch(Some(wait)) {
        reload_config_if_asked();
        let round = std::panic::AssertUnwindSafe(|| cluster.round());
        survive(round, ());
        wait = cluster.next_wake();
    }
    // The databases' launchers run on: the next cluster launcher follows them.
    shmem::launchers::unregister_cluster_launcher();
    // Exit non-zero so that the postmaster starts the launcher again if someone terminated it.
    // SAFETY: ends this background worker process the way Postgres expects.
    unsafe { pg_sys::proc_exit(1) };
}
