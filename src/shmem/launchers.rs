//! The launchers' table: one entry per database that runs tasks (its launcher's pid and latch,
//! whether SQL asked for one, whether it left idle, whether a DDL command pauses the database),
//! and the cluster launcher's latch. SQL wakes a database's launcher through it, the cluster
//! launcher reads it to know which launchers to start, and `ddl_guard` pauses a database in it.

use pgrx::prelude::*;

use super::live::LiveEntry;
use super::{backend_alive, my_database, my_latch, SharedState, STATE};

/// One database's launcher, as the cluster launcher, the SQL functions and the DDL guard see it.
#[derive(Clone, Copy)]
pub(super) struct DatabaseLauncher {
    /// Invalid for a free entry.
    pub(super) database: pg_sys::Oid,
    /// The running launcher's pid and latch address (0: none runs).
    pid: i32,
    latch: usize,
    /// A SQL function asked for the launcher since the launcher last read the catalog: one must
    /// run (again), even if the last one found nothing to do.
    wanted: bool,
    /// The last launcher exited because the database had no task and nothing left to clean up.
    idle: bool,
    /// A backend about to drop, rename or copy the database (`ddl_guard`): no worker of ours may
    /// start in it meanwhile (0: none).
    paused_by: i32,
}

impl DatabaseLauncher {
    pub(super) const FREE: DatabaseLauncher = DatabaseLauncher {
        database: pg_sys::Oid::INVALID,
        pid: 0,
        latch: 0,
        wanted: false,
        idle: false,
        paused_by: 0,
    };

    pub(super) fn paused(&self) -> bool {
        self.paused_by != 0 && backend_alive(self.paused_by)
    }
}

/// The entry of `database` in the launchers' table, claimed when it has none; None when the
/// table is full (`meili_sync.max_databases` entries taken).
fn launcher_entry(state: &mut SharedState, database: pg_sys::Oid) -> Option<&mut DatabaseLauncher> {
    let usable = crate::gucs::max_databases();
    let index = state.databases[..usable]
        .iter()
        .position(|entry| entry.database == database)
        .or_else(|| {
            state.databases[..usable]
                .iter()
                .position(|entry| entry.database == pg_sys::Oid::INVALID)
        })?;
    let entry = &mut state.databases[index];
    if entry.database != database {
        *entry = DatabaseLauncher {
            database,
            ..DatabaseLauncher::FREE
        };
    }
    Some(entry)
}

/// Whether a database launcher may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registration {
    Registered,
    /// Another launcher of its database runs, or the database is paused for a DDL command.
    Refused,
    /// `meili_sync.max_databases` other databases hold an entry.
    TableFull,
}

/// Publishes the calling database launcher's latch so SQL functions can wake it, taking its
/// database's entry.
pub fn register_launcher() -> Registration {
    let database = my_database();
    // SAFETY: this process's own pid.
    let pid = unsafe { pg_sys::MyProcPid };
    let mut state = STATE.exclusive();
    let Some(entry) = launcher_entry(&mut state, database) else {
        return Registration::TableFull;
    };
    if entry.paused() || (entry.pid != 0 && entry.pid != pid && backend_alive(entry.pid)) {
        return Registration::Refused;
    }
    entry.pid = pid;
    entry.latch = my_latch();
    entry.idle = false;
    Registration::Registered
}

/// Frees the calling launcher's database's entry: the database has nothing for us (no
/// extension, nothing to clean up), so it must not take a place in the table. Kept while a DDL
/// command pauses it, SQL asked for a launcher, or another launcher runs there.
pub fn release_unneeded_entry() {
    let database = my_database();
    // SAFETY: this process's own pid.
    let pid = unsafe { pg_sys::MyProcPid };
    let mut state = STATE.exclusive();
    if let Some(entry) = state.databases.iter_mut().find(|entry| {
        entry.database == database
            && !entry.paused()
            && !entry.wanted
            && (entry.pid == 0 || entry.pid == pid || !backend_alive(entry.pid))
    }) {
        *entry = DatabaseLauncher::FREE;
    }
}

/// How many entries of the launchers' table are taken, and how many may be.
pub fn databases_served() -> (usize, usize) {
    let usable = crate::gucs::max_databases();
    let state = STATE.share();
    let taken = state.databases[..usable]
        .iter()
        .filter(|entry| entry.database != pg_sys::Oid::INVALID)
        .count();
    (taken, usable)
}

/// The database launcher begins a round: what SQL asked for until now, it reads.
pub fn launcher_round_begins() {
    let database = my_database();
    let mut state = STATE.exclusive();
    if let Some(entry) = state
        .databases
        .iter_mut()
        .find(|entry| entry.database == database)
    {
        entry.wanted = false;
    }
}

/// The database launcher exits; `idle` when it found nothing to do, so that the cluster launcher
/// starts it again only when SQL asks for it. An idle database gives its entry back (a database
/// without an entry counts as idle), unless SQL asked for a launcher meanwhile or a DDL command
/// pauses it.
pub fn unregister_launcher(idle: bool) {
    let database = my_database();
    // SAFETY: this process's own pid.
    let pid = unsafe { pg_sys::MyProcPid };
    let mut state = STATE.exclusive();
    if let Some(entry) = state
        .databases
        .iter_mut()
        .find(|entry| entry.database == database && entry.pid == pid)
    {
        if idle && !entry.wanted && !entry.paused() {
            *entry = DatabaseLauncher::FREE;
        } else {
            entry.pid = 0;
            entry.latch = 0;
            entry.idle = idle;
        }
    }
}

/// Sets this database's launcher's latch so it rereads the catalog now rather than after its
/// naptime; when none runs, asks the cluster launcher to start one.
pub fn wake_launcher() {
    let database = my_database();
    let (latch, cluster_latch) = {
        let mut state = STATE.exclusive();
        let cluster_latch = state.cluster_latch;
        match launcher_entry(&mut state, database) {
            Some(entry) => {
                entry.wanted = true;
                (entry.latch, cluster_latch)
            }
            None => (0, cluster_latch),
        }
    };
    for latch in [latch, cluster_latch] {
        if latch != 0 {
            // SAFETY: the address is a launcher's PGPROC latch, which lives in shared memory for
            // the life of the cluster; setting a latch of a process that has exited is harmless.
            unsafe { pg_sys::SetLatch(latch as *mut pg_sys::Latch) };
        }
    }
}

/// Publishes the cluster launcher's latch.
pub fn register_cluster_launcher() {
    STATE.exclusive().cluster_latch = my_latch();
}

pub fn unregister_cluster_launcher() {
    STATE.exclusive().cluster_latch = 0;
}

/// A database's launcher as the cluster launcher sees it.
#[derive(Clone, Copy, Debug)]
pub struct LauncherState {
    /// The pid of its launcher while one runs.
    pub pid: Option<i32>,
    /// SQL asked for it since it last read the catalog.
    pub wanted: bool,
    /// It last exited with nothing to do.
    pub idle: bool,
    /// A DDL command on the database waits for our processes to leave it.
    pub paused: bool,
}

/// The launcher state of `database`; a database without an entry has nothing for us (idle).
pub fn launcher_state(database: pg_sys::Oid) -> LauncherState {
    let state = STATE.share();
    match state
        .databases
        .iter()
        .find(|entry| entry.database == database)
    {
        Some(entry) => LauncherState {
            pid: (entry.pid != 0 && backend_alive(entry.pid)).then_some(entry.pid),
            wanted: entry.wanted,
            idle: entry.idle,
            paused: entry.paused(),
        },
        None => LauncherState {
            pid: None,
            wanted: false,
            idle: true,
            paused: false,
        },
    }
}

/// Forgets the launchers, live entries and waiters of databases not in `existing` (dropped).
pub fn forget_databases_except(existing: &[pg_sys::Oid]) {
    let mut state = STATE.exclusive();
    for entry in state
        .databases
        .iter_mut()
        .filter(|entry| !existing.contains(&entry.database))
    {
        *entry = DatabaseLauncher::FREE;
    }
    for entry in state
        .entries
        .iter_mut()
        .filter(|entry| entry.task_id != 0 && !existing.contains(&entry.database))
    {
        *entry = LiveEntry::EMPTY;
    }
}

/// Marks `database` paused by the calling backend (`ddl_guard`): no launcher or worker of ours
/// starts in it until [`resume_database`] or the backend's exit. False when the table of
/// launchers is full.
pub fn pause_database(database: pg_sys::Oid) -> bool {
    // SAFETY: this process's own pid.
    let pid = unsafe { pg_sys::MyProcPid };
    let mut state = STATE.exclusive();
    match launcher_entry(&mut state, database) {
        Some(entry) => {
            entry.paused_by = pid;
            true
        }
        None => false,
    }
}

/// Ends the calling backend's pause of `database`, and wakes the cluster launcher to start its
/// launcher again (when the database still exists).
pub fn resume_database(database: pg_sys::Oid) {
    // SAFETY: this process's own pid.
    let pid = unsafe { pg_sys::MyProcPid };
    let cluster_latch = {
        let mut state = STATE.exclusive();
        if let Some(entry) = state
            .databases
            .iter_mut()
            .find(|entry| entry.database == database && entry.paused_by == pid)
        {
            entry.paused_by = 0;
        }
        state.cluster_latch
    };
    if cluster_latch != 0 {
        // SAFETY: the cluster launcher's PGPROC latch, in shared memory for the cluster's life.
        unsafe { pg_sys::SetLatch(cluster_latch as *mut pg_sys::Latch) };
    }
}

/// The pids of our processes connected to `database`: its launcher and its workers.
pub fn processes_in(database: pg_sys::Oid) -> Vec<i32> {
    let state = STATE.share();
    let mut pids: Vec<i32> = state
        .databases
        .iter()
        .filter(|entry| entry.database == database && entry.pid != 0)
        .map(|entry| entry.pid)
        .chain(
            state
                .entries
                .iter()
                .filter(|entry| entry.database == database && entry.pid > 0)
                .map(|entry| entry.pid),
        )
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}
