//! Shared memory: one `SharedState` under one lock, which every process of the cluster maps at
//! the same address. Its tables each have a module: the launchers' table (`launchers`), the
//! task workers' live entries (`live`), the backends waiting in `meili_sync_wait` (`waiters`);
//! `commits` holds what a commit sets off in them. Every entry belongs to one database: a backend
//! or worker sees and changes only its own database's (task ids start at 1 in each database). An
//! *entry* is a place in these tables, so that "slot" only ever means a replication slot.

pub mod commits;
pub mod launchers;
pub mod live;
pub mod waiters;

use pgrx::lwlock::PgLwLock;
use pgrx::pg_shmem_init;
use pgrx::prelude::*;
use pgrx::shmem::PGRXSharedMemory;

use launchers::DatabaseLauncher;
use live::LiveEntry;
use waiters::{Waiter, WAITERS};

/// The database this process is connected to (invalid in the cluster launcher).
fn my_database() -> pg_sys::Oid {
    // SAFETY: set once when the process connects, read on its main thread.
    unsafe { pg_sys::MyDatabaseId }
}

#[derive(Clone, Copy)]
pub struct SharedState {
    /// The cluster launcher's latch: it starts the databases' launchers.
    cluster_latch: usize,
    /// Commits that may have changed a task's source without changing rows: attached, detached
    /// or dropped a table, altered one, or replaced a view (`note_sources_changed_at_commit`).
    sources_changed: u64,
    /// Commits that created, changed or dropped a task, or changed its state
    /// (`wake_launcher_at_commit`): a shared decoder then reads its tasks again at once.
    tasks_changed: u64,
    /// One entry per database that runs tasks (or cleans up after them), or is paused by a DDL
    /// command: a database with nothing for us holds none, so that empty databases cannot use the
    /// table up. The first `meili_sync.max_databases` are used.
    databases: [DatabaseLauncher; crate::gucs::DATABASE_ENTRIES],
    entries: [LiveEntry; crate::gucs::TASK_ENTRIES],
    waiters: [Waiter; WAITERS],
}

impl Default for SharedState {
    fn default() -> Self {
        SharedState {
            cluster_latch: 0,
            sources_changed: 0,
            tasks_changed: 0,
            databases: [DatabaseLauncher::FREE; crate::gucs::DATABASE_ENTRIES],
            entries: [LiveEntry::EMPTY; crate::gucs::TASK_ENTRIES],
            waiters: [Waiter::FREE; WAITERS],
        }
    }
}

// SAFETY: plain old data; the addresses it holds (the launcher's and waiting backends' latches)
// point into shared memory, which is mapped at the same address in every backend.
unsafe impl PGRXSharedMemory for SharedState {}

// SAFETY: the name is unique to this extension.
static STATE: PgLwLock<SharedState> = unsafe { PgLwLock::new(c"pg_meili_sync_state") };

pub fn init() {
    pg_shmem_init!(STATE);
    // SAFETY: registering a transaction callback from _PG_init of a preloaded library: every
    // backend inherits it.
    unsafe {
        pg_sys::RegisterXactCallback(Some(commits::wake_workers_at_commit), std::ptr::null_mut())
    };
}

/// This process's PGPROC latch, as an address that is the same in every process.
fn my_latch() -> usize {
    // SAFETY: MyProc is this process's PGPROC, in shared memory at the same address in every backend.
    (unsafe { &raw mut (*pg_sys::MyProc).procLatch }) as usize
}

/// Whether a backend (a worker) with this pid runs.
pub fn backend_alive(pid: i32) -> bool {
    // SAFETY: looks the pid up in the proc array under its lock; only the pointer's nullness is used.
    !unsafe { pg_sys::BackendPidGetProc(pid) }.is_null()
}
