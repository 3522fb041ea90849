//! Shared memory: the launchers' latches (so SQL can wake them), one launcher entry per database,
//! and one live-state entry per task worker (an *entry*, so that "slot" only ever means a
//! replication slot). Every entry belongs to one database: a backend or worker sees and changes
//! only its own database's (task ids start at 1 in each database).

use pgrx::lwlock::PgLwLock;
use pgrx::pg_shmem_init;

use pg_meili_sync_core::meili::writer::WriterStats;
use pg_meili_sync_core::pipeline::meter::RateWindow;
use pgrx::prelude::*;
use pgrx::shmem::PGRXSharedMemory;

const ERROR_BYTES: usize = 512;

/// What a task worker is doing right now, as shown in `meili_sync_status.state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Starting = 1,
    Snapshot = 2,
    Streaming = 3,
    Retrying = 4,
    Error = 5,
    Exited = 6,
    Swapping = 7,
}

impl Phase {
    fn from_u8(value: u8) -> Option<Phase> {
        Some(match value {
            1 => Phase::Starting,
            2 => Phase::Snapshot,
            3 => Phase::Streaming,
            4 => Phase::Retrying,
            5 => Phase::Error,
            6 => Phase::Exited,
            7 => Phase::Swapping,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Snapshot => "snapshot",
            Phase::Streaming => "streaming",
            Phase::Retrying => "retrying",
            Phase::Error => "error",
            Phase::Exited => "exited",
            Phase::Swapping => "swapping",
        }
    }
}

/// Cumulative counters of a task, as `pg_stat_meili_sync` shows them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub documents: i64,
    /// Of `documents`, ids deleted.
    pub deletes: i64,
    /// Of `documents`, partial updates.
    pub updates: i64,
    /// Delete-all tasks (TRUNCATE).
    pub truncates: i64,
    pub batches: i64,
    pub bytes_before_gzip: i64,
    pub bytes_sent: i64,
    pub retries: i64,
    pub dead_letters: i64,
}

impl Counters {
    const ZERO: Counters = Counters {
        documents: 0,
        deletes: 0,
        updates: 0,
        truncates: 0,
        batches: 0,
        bytes_before_gzip: 0,
        bytes_sent: 0,
        retries: 0,
        dead_letters: 0,
    };

    fn plus(self, other: Counters) -> Counters {
        Counters {
            documents: self.documents + other.documents,
            deletes: self.deletes + other.deletes,
            updates: self.updates + other.updates,
            truncates: self.truncates + other.truncates,
            batches: self.batches + other.batches,
            bytes_before_gzip: self.bytes_before_gzip + other.bytes_before_gzip,
            bytes_sent: self.bytes_sent + other.bytes_sent,
            retries: self.retries + other.retries,
            dead_letters: self.dead_letters + other.dead_letters,
        }
    }

    fn minus(self, other: Counters) -> Counters {
        self.plus(Counters {
            documents: -other.documents,
            deletes: -other.deletes,
            updates: -other.updates,
            truncates: -other.truncates,
            batches: -other.batches,
            bytes_before_gzip: -other.bytes_before_gzip,
            bytes_sent: -other.bytes_sent,
            retries: -other.retries,
            dead_letters: -other.dead_letters,
        })
    }
}

/// Whose process a worker is: a task's own, the database's shared decoder, which has no task
/// row, or the worker that moves documents between the shards of a task after a shard was added
/// (not the task's own worker: the task streams on meanwhile). Shared-memory entries are keyed by
/// it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorkerId {
    Task(i64),
    SharedDecoder,
    Rebalance(i64),
}

impl WorkerId {
    /// An entry's key: the task's id, for the shared decoder a key no task has (task ids start
    /// at 1; 0 marks a free entry), and for a task's rebalance the negative keys below it.
    fn key(self) -> i64 {
        match self {
            WorkerId::Task(id) => id,
            WorkerId::SharedDecoder => -1,
            WorkerId::Rebalance(id) => -1 - id,
        }
    }

    fn from_key(key: i64) -> Self {
        match key {
            1.. => WorkerId::Task(key),
            ..-1 => WorkerId::Rebalance(-1 - key),
            _ => WorkerId::SharedDecoder,
        }
    }

    /// The task whose own worker this is; None for the shared decoder and a rebalance (whose
    /// entry the task's status does not show).
    pub fn task(self) -> Option<i64> {
        match self {
            WorkerId::Task(id) => Some(id),
            WorkerId::SharedDecoder | WorkerId::Rebalance(_) => None,
        }
    }
}

impl std::fmt::Display for WorkerId {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerId::Task(id) => write!(formatter, "task {id}"),
            WorkerId::SharedDecoder => formatter.write_str("shared decoder"),
            WorkerId::Rebalance(id) => write!(formatter, "rebalance of task {id}"),
        }
    }
}

#[derive(Clone, Copy)]
pub struct LiveEntry {
    /// The database of the task (free entries: invalid).
    database: pg_sys::Oid,
    task_id: i64,
    pid: i32,
    /// The entry of a task that the shared decoder streams: its pid is the decoder's, so it is
    /// no worker of its own for the launcher to follow.
    served_by_shared_decoder: bool,
    /// The task's catalog generation the worker runs with, so that a restarted launcher can
    /// tell whether a worker it did not start is still the right one.
    generation: i32,
    /// Address of the worker's PGPROC latch, so committing backends can wake it.
    latch: usize,
    phase: u8,
    rows_copied: i64,
    docs_confirmed: i64,
    deletes_confirmed: i64,
    updates_confirmed: i64,
    truncates_confirmed: i64,
    batches_inflight: i32,
    retries: i64,
    bytes_uncompressed: i64,
    bytes_sent: i64,
    batches_confirmed: i64,
    dead_letters: i64,
    last_confirmed_at: pg_sys::TimestampTz,
    /// When the worker last handed Meilisearch a batch (0: never).
    last_sent_at: pg_sys::TimestampTz,
    /// When the task's position last moved, or it last had nothing unconfirmed (0: never): a task
    /// that is behind and whose position stands still is stuck, not slow.
    progressed_at: pg_sys::TimestampTz,
    docs_sent: i64,
    failed_tasks: i64,
    /// Documents confirmed per second over the last minute.
    docs_per_second: f64,
    /// WAL position decoded so far, and the replication slot's confirmed position (0: not streaming yet).
    received_lsn: u64,
    confirmed_lsn: u64,
    /// Commit time of the oldest change Meilisearch has not confirmed (0: none).
    oldest_unconfirmed_at: pg_sys::TimestampTz,
    /// Counters of earlier workers of this task (and minus those at the last reset): the
    /// cumulative figure is `base` plus this worker's own.
    base: Counters,
    stats_reset: pg_sys::TimestampTz,
    error_len: u16,
    error: [u8; ERROR_BYTES],
    error_at: pg_sys::TimestampTz,
}

impl LiveEntry {
    /// This worker's own counters.
    fn worker_counters(&self) -> Counters {
        Counters {
            documents: self.docs_confirmed,
            deletes: self.deletes_confirmed,
            updates: self.updates_confirmed,
            truncates: self.truncates_confirmed,
            batches: self.batches_confirmed,
            bytes_before_gzip: self.bytes_uncompressed,
            bytes_sent: self.bytes_sent,
            retries: self.retries,
            dead_letters: self.dead_letters,
        }
    }

    const EMPTY: LiveEntry = LiveEntry {
        database: pg_sys::Oid::INVALID,
        task_id: 0,
        pid: 0,
        served_by_shared_decoder: false,
        generation: 0,
        latch: 0,
        phase: 0,
        rows_copied: 0,
        docs_confirmed: 0,
        deletes_confirmed: 0,
        updates_confirmed: 0,
        truncates_confirmed: 0,
        batches_inflight: 0,
        retries: 0,
        bytes_uncompressed: 0,
        bytes_sent: 0,
        batches_confirmed: 0,
        dead_letters: 0,
        last_confirmed_at: 0,
        last_sent_at: 0,
        progressed_at: 0,
        docs_sent: 0,
        failed_tasks: 0,
        docs_per_second: 0.0,
        received_lsn: 0,
        confirmed_lsn: 0,
        oldest_unconfirmed_at: 0,
        base: Counters::ZERO,
        stats_reset: 0,
        error_len: 0,
        error: [0; ERROR_BYTES],
        error_at: 0,
    };
}

/// A backend in `meili_sync_wait`: which task's confirmation, up to where, and its latch.
#[derive(Clone, Copy)]
struct Waiter {
    database: pg_sys::Oid,
    task_id: i64,
    lsn: u64,
    /// Address of the backend's PGPROC latch; 0 for a free place.
    latch: usize,
    pid: i32,
}

impl Waiter {
    const FREE: Waiter = Waiter {
        database: pg_sys::Oid::INVALID,
        task_id: 0,
        lsn: 0,
        latch: 0,
        pid: 0,
    };
}

/// The database this process is connected to (invalid in the cluster launcher).
fn my_database() -> pg_sys::Oid {
    // SAFETY: set once when the process connects, read on its main thread.
    unsafe { pg_sys::MyDatabaseId }
}

/// The backends of this database waiting in `meili_sync_wait` with a place: (pid, task,
/// position waited for).
pub fn waiting_backends() -> Vec<(i32, i64, u64)> {
    let database = my_database();
    STATE
        .share()
        .waiters
        .iter()
        .filter(|waiter| waiter.latch != 0 && waiter.database == database)
        .map(|waiter| (waiter.pid, waiter.task_id, waiter.lsn))
        .collect()
}

/// Backends that may wait in `meili_sync_wait` at once with a latch the workers set; more wait
/// by looking every 10 ms.
const WAITERS: usize = 128;

/// One database's launcher, as the cluster launcher, the SQL functions and the DDL guard see it.
#[derive(Clone, Copy)]
struct DatabaseLauncher {
    /// Invalid for a free entry.
    database: pg_sys::Oid,
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
    const FREE: DatabaseLauncher = DatabaseLauncher {
        database: pg_sys::Oid::INVALID,
        pid: 0,
        latch: 0,
        wanted: false,
        idle: false,
        paused_by: 0,
    };

    fn paused(&self) -> bool {
        self.paused_by != 0 && backend_alive(self.paused_by)
    }
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
    unsafe { pg_sys::RegisterXactCallback(Some(wake_workers_at_commit), std::ptr::null_mut()) };
}

static WROTE_WAL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Wakes the task workers when a transaction that wrote something commits, so they decode it at
/// once instead of after their nap. Runs in every backend; costs a shared lock per writing commit.
// SAFETY: called by Postgres's transaction machinery on this backend's main thread only, with the
// arguments RegisterXactCallback documents; #[pg_guard] keeps a panic from unwinding into C.
#[pg_guard]
unsafe extern "C-unwind" fn wake_workers_at_commit(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    use std::sync::atomic::Ordering;
    match event {
        pg_sys::XactEvent::XACT_EVENT_PRE_COMMIT => {
            // SAFETY: reads this backend's transaction state during its own commit.
            let has_xid =
                unsafe { pg_sys::GetTopTransactionIdIfAny() } != pg_sys::InvalidTransactionId;
            WROTE_WAL.store(has_xid, Ordering::Relaxed);
        }
        pg_sys::XactEvent::XACT_EVENT_COMMIT if WROTE_WAL.swap(false, Ordering::Relaxed) => {
            wake_task_workers();
        }
        pg_sys::XactEvent::XACT_EVENT_ABORT => WROTE_WAL.store(false, Ordering::Relaxed),
        _ => {}
    }
}

fn wake_task_workers() {
    let database = my_database();
    let state = STATE.share();
    for entry in state
        .entries
        .iter()
        .filter(|entry| entry.latch != 0 && entry.database == database)
    {
        // SAFETY: the address is a worker's PGPROC latch in shared memory (valid for the cluster's
        // life); setting the latch of a process that just exited is harmless.
        unsafe { pg_sys::SetLatch(entry.latch as *mut pg_sys::Latch) };
    }
}

/// A snapshot of one task's live state, copied out of shared memory.
#[derive(Clone, Debug)]
pub struct TaskLive {
    pub task_id: i64,
    pub pid: Option<i32>,
    pub phase: Option<Phase>,
    pub rows_copied: i64,
    pub docs_confirmed: i64,
    pub deletes_confirmed: i64,
    pub batches_inflight: i32,
    pub retries: i64,
    pub bytes_uncompressed: i64,
    pub bytes_sent: i64,
    pub docs_sent: i64,
    pub failed_tasks: i64,
    pub docs_per_second: f64,
    pub received_lsn: Option<u64>,
    pub confirmed_lsn: Option<u64>,
    pub oldest_unconfirmed_at: Option<pg_sys::TimestampTz>,
    pub last_sent_at: Option<pg_sys::TimestampTz>,
    pub last_confirmed_at: Option<pg_sys::TimestampTz>,
    pub progressed_at: Option<pg_sys::TimestampTz>,
    pub last_error: Option<String>,
    pub last_error_at: Option<pg_sys::TimestampTz>,
}

/// Whether a backend waits in `meili_sync_wait` for the task (so that its position is worth
/// publishing at once).
pub fn has_waiters(task_id: i64) -> bool {
    let database = my_database();
    STATE
        .share()
        .waiters
        .iter()
        .any(|waiter| waiter.latch != 0 && waiter.task_id == task_id && waiter.database == database)
}

/// Whether a worker has published a confirmation of the task at or past `lsn`.
pub fn confirmed_past(task_id: i64, lsn: u64) -> bool {
    let database = my_database();
    STATE.share().entries.iter().any(|entry| {
        entry.task_id == task_id && entry.database == database && entry.confirmed_lsn >= lsn
    })
}

/// Frees a waiter's places when the wait ends, also when a cancel's ERROR unwinds through it.
struct WaiterPlaces(Vec<usize>);

impl Drop for WaiterPlaces {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        let mut state = STATE.exclusive();
        for index in &self.0 {
            state.waiters[*index] = Waiter::FREE;
        }
    }
}

/// Frees every place this backend holds when it exits. `pg_terminate_backend` ends a backend
/// with a FATAL that does not unwind Rust frames, so `WaiterPlace` alone would leave its place
/// taken for good.
// SAFETY: called by Postgres's exit machinery (before_shmem_exit) on this backend's main thread,
// with the arguments it documents; #[pg_guard] keeps a panic from unwinding into C.
#[pg_guard]
unsafe extern "C-unwind" fn free_waiter_places_at_exit(_code: i32, _arg: pg_sys::Datum) {
    // SAFETY: MyProc stays valid through before_shmem_exit callbacks.
    let latch = unsafe { &raw mut (*pg_sys::MyProc).procLatch } as usize;
    let mut state = STATE.exclusive();
    for waiter in state
        .waiters
        .iter_mut()
        .filter(|waiter| waiter.latch == latch)
    {
        *waiter = Waiter::FREE;
    }
}

/// Registers [`free_waiter_places_at_exit`] once per backend, before its first wait.
fn free_waiter_places_at_exit_once() {
    thread_local! {
        static REGISTERED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if REGISTERED.get() {
        return;
    }
    // SAFETY: main thread of a backend; the callback runs at process exit, before shared
    // memory detaches, and only takes the extension's own lock (held nowhere a FATAL can come).
    unsafe { pg_sys::before_shmem_exit(Some(free_waiter_places_at_exit), pg_sys::Datum::from(0)) };
    REGISTERED.set(true);
}

/// Sleeps on this backend's latch until workers confirm each of `tasks` (a task and its
/// replicas; with `any`, one of them) at or past `lsn` (true) or `timeout` passes (false). The
/// worker that publishes a confirmation sets the latch; a cancel or `statement_timeout` ends the
/// wait with its ERROR.
pub fn wait_confirmed(tasks: &[i64], lsn: u64, timeout: std::time::Duration, any: bool) -> bool {
    // SAFETY: MyProc is this backend's PGPROC, in shared memory at the same address everywhere.
    let latch = unsafe { &raw mut (*pg_sys::MyProc).procLatch } as usize;
    free_waiter_places_at_exit_once();
    let places = {
        let mut state = STATE.exclusive();
        let mut places = WaiterPlaces(Vec::with_capacity(tasks.len()));
        for &task_id in tasks {
            let Some(index) = state.waiters.iter().position(|waiter| waiter.latch == 0) else {
                break;
            };
            state.waiters[index] = Waiter {
                database: my_database(),
                task_id,
                lsn,
                latch,
                // SAFETY: this backend's own pid.
                pid: unsafe { pg_sys::MyProcPid },
            };
            places.0.push(index);
        }
        places
    };
    // Without a place for each task, a confirmation may set no latch: look every 10 ms.
    let look_every = if places.0.len() == tasks.len() {
        timeout
    } else {
        std::time::Duration::from_millis(10)
    };
    let deadline = std::time::Instant::now() + timeout;
    loop {
        // SAFETY: resets this backend's own latch before looking, so that a confirmation
        // published after the look sets it again and the wait below returns at once.
        unsafe { pg_sys::ResetLatch(latch as *mut pg_sys::Latch) };
        let confirmed = |task_id: &i64| confirmed_past(*task_id, lsn);
        if (any && tasks.iter().any(confirmed)) || (!any && tasks.iter().all(confirmed)) {
            return true;
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        let nap = left.min(look_every).as_millis().clamp(1, i32::MAX as u128) as i64;
        // SAFETY: waits on this backend's own latch with a timeout; WL_EXIT_ON_PM_DEATH ends the
        // backend if the postmaster dies.
        unsafe {
            pg_sys::WaitLatch(
                latch as *mut pg_sys::Latch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                nap,
                pg_sys::PG_WAIT_EXTENSION,
            )
        };
        pgrx::check_for_interrupts!();
    }
}

/// Why a worker got no live-state entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoEntry {
    /// All `meili_sync.max_tasks` entries are taken.
    Full,
    /// Its database is about to be dropped, renamed or copied (`ddl_guard`).
    DatabasePaused,
}

/// This process's PGPROC latch, as an address that is the same in every process.
fn my_latch() -> usize {
    // SAFETY: MyProc is this process's PGPROC, in shared memory at the same address in every backend.
    (unsafe { &raw mut (*pg_sys::MyProc).procLatch }) as usize
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

static WAKE_PENDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Wakes this database's launcher and task workers when the transaction commits, so a new or
/// changed task takes effect at once (a shared decoder sees `tasks_changed` move); an aborted
/// transaction wakes nobody.
pub fn wake_launcher_at_commit() {
    use pgrx::{register_xact_callback, PgXactCallbackEvent};
    use std::sync::atomic::Ordering;
    if !WAKE_PENDING.swap(true, Ordering::Relaxed) {
        register_xact_callback(PgXactCallbackEvent::Commit, || {
            WAKE_PENDING.store(false, Ordering::Relaxed);
            {
                let mut state = STATE.exclusive();
                state.tasks_changed = state.tasks_changed.wrapping_add(1);
            }
            wake_launcher();
            wake_task_workers();
        });
        register_xact_callback(PgXactCallbackEvent::Abort, || {
            WAKE_PENDING.store(false, Ordering::Relaxed);
        });
    }
}

static SOURCES_PENDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// When the transaction commits, counts a change that may have changed a task's source without
/// changing rows (`sources_changed`: a partition attached, detached or dropped, a view replaced)
/// and wakes this database's workers: a task on a partitioned table then looks at its partitions,
/// and a view task at the tables its view reads, at once rather than at its next look.
pub fn note_sources_changed_at_commit() {
    use pgrx::{register_xact_callback, PgXactCallbackEvent};
    use std::sync::atomic::Ordering;
    if !SOURCES_PENDING.swap(true, Ordering::Relaxed) {
        register_xact_callback(PgXactCallbackEvent::Commit, || {
            SOURCES_PENDING.store(false, Ordering::Relaxed);
            {
                let mut state = STATE.exclusive();
                state.sources_changed = state.sources_changed.wrapping_add(1);
            }
            wake_task_workers();
        });
        register_xact_callback(PgXactCallbackEvent::Abort, || {
            SOURCES_PENDING.store(false, Ordering::Relaxed);
        });
    }
}

/// How many commits changed a task or its state since the server started.
pub fn tasks_changed() -> u64 {
    STATE.share().tasks_changed
}

/// How many commits may have changed a task's source without changing rows since the server
/// started.
pub fn sources_changed() -> u64 {
    STATE.share().sources_changed
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

/// Claims the task's entry (or a free one) for the calling worker.
pub fn attach(worker: WorkerId, pid: i32) -> Result<usize, NoEntry> {
    let task_id = worker.key();
    let database = my_database();
    let mut state = STATE.exclusive();
    if state
        .databases
        .iter()
        .any(|entry| entry.database == database && entry.paused())
    {
        return Err(NoEntry::DatabasePaused);
    }
    let usable = &state.entries[..crate::gucs::max_tasks()];
    let index = usable
        .iter()
        .position(|entry| entry.task_id == task_id && entry.database == database)
        .or_else(|| usable.iter().position(|entry| entry.task_id == 0))
        .ok_or(NoEntry::Full)?;
    let entry = &mut state.entries[index];
    let keep_error = entry.task_id == task_id && entry.database == database;
    let (error_len, error, error_at) = (entry.error_len, entry.error, entry.error_at);
    let (base, stats_reset, last_confirmed_at, last_sent_at, progressed_at) = if keep_error {
        (
            entry.base.plus(entry.worker_counters()),
            entry.stats_reset,
            entry.last_confirmed_at,
            entry.last_sent_at,
            entry.progressed_at,
        )
    } else {
        // SAFETY: reads the transaction-independent wall clock.
        (
            Counters::ZERO,
            unsafe { pg_sys::GetCurrentTimestamp() },
            0,
            0,
            0,
        )
    };
    *entry = LiveEntry::EMPTY;
    entry.database = database;
    entry.base = base;
    entry.stats_reset = stats_reset;
    entry.last_confirmed_at = last_confirmed_at;
    entry.last_sent_at = last_sent_at;
    entry.progressed_at = progressed_at;
    entry.task_id = task_id;
    entry.pid = pid;
    entry.latch = my_latch();
    entry.phase = Phase::Starting as u8;
    if keep_error {
        entry.error_len = error_len;
        entry.error = error;
        entry.error_at = error_at;
    }
    Ok(index)
}

/// Frees the entries of workers no longer wanted: of tasks that no longer exist, and of the shared
/// decoder once no task shares the decoding pass.
pub fn release_missing(existing: &[WorkerId]) {
    let database = my_database();
    let mut state = STATE.exclusive();
    for entry in state
        .entries
        .iter_mut()
        .filter(|entry| entry.database == database)
    {
        if entry.task_id != 0 && !existing.contains(&WorkerId::from_key(entry.task_id)) {
            *entry = LiveEntry::EMPTY;
        }
    }
}

thread_local! {
    /// Only the worker's main thread publishes progress, so the rate's samples live there.
    static CONFIRMED_RATE: std::cell::RefCell<RateWindow> = std::cell::RefCell::new(RateWindow::default());
}

/// A handle on the worker's own entry; every update is a short exclusive lock.
#[derive(Clone, Copy)]
pub struct LiveStatus {
    index: usize,
}

impl LiveStatus {
    pub fn new(index: usize) -> Self {
        LiveStatus { index }
    }

    fn update(&self, f: impl FnOnce(&mut LiveEntry)) {
        let mut state = STATE.exclusive();
        f(&mut state.entries[self.index]);
    }

    /// What the status view shows the worker doing.
    pub fn phase(&self) -> Option<Phase> {
        Phase::from_u8(STATE.share().entries[self.index].phase)
    }

    /// Also the worker's `pg_stat_activity.query`, so a DBA sees what it is doing.
    pub fn set_phase(&self, phase: Phase) {
        self.update(|entry| entry.phase = phase as u8);
        self.report_step(phase.as_str());
    }

    /// Sets the worker's `pg_stat_activity.query`: its phase, or a step its phase does not tell
    /// (a rebalance's).
    pub fn report_step(&self, step: &str) {
        let activity = std::ffi::CString::new(step.replace('\0', " ")).unwrap_or_default();
        // SAFETY: called from the worker's main thread; Postgres copies the text.
        unsafe {
            pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_RUNNING, activity.as_ptr())
        };
    }

    /// Publishes the copy's progress and the writer's counters (cumulative for this worker).
    pub fn set_progress(&self, rows_copied: i64, batches_inflight: usize, writer: &WriterStats) {
        let counter = |value: &std::sync::atomic::AtomicU64| {
            i64::try_from(value.load(std::sync::atomic::Ordering::Relaxed)).unwrap_or(i64::MAX)
        };
        let confirmed = writer
            .docs_confirmed
            .load(std::sync::atomic::Ordering::Relaxed);
        let docs_per_second = CONFIRMED_RATE.with(|rate| {
            let mut rate = rate.borrow_mut();
            rate.sample(std::time::Instant::now(), confirmed);
            rate.per_second()
        });
        self.update(|entry| {
            let docs_sent = counter(&writer.docs_enqueued);
            if docs_sent > entry.docs_sent {
                // SAFETY: reads the transaction-independent wall clock.
                entry.last_sent_at = unsafe { pg_sys::GetCurrentTimestamp() };
            }
            entry.docs_sent = docs_sent;
            entry.failed_tasks = counter(&writer.batches_failed);
            entry.docs_per_second = docs_per_second;
            entry.rows_copied = rows_copied;
            entry.docs_confirmed = counter(&writer.docs_confirmed);
            entry.deletes_confirmed = counter(&writer.deletes_confirmed);
            entry.updates_confirmed = counter(&writer.updates_confirmed);
            entry.truncates_confirmed = counter(&writer.clears_confirmed);
            entry.bytes_uncompressed = counter(&writer.bytes_uncompressed);
            entry.bytes_sent = counter(&writer.bytes_sent);
            entry.batches_confirmed = counter(&writer.batches_confirmed);
            entry.batches_inflight = batches_inflight.try_into().unwrap_or(i32::MAX);
        });
    }

    /// Where the stream stands: decoded up to `received`, replication slot confirmed up to `confirmed`, and
    /// the commit time of the oldest change still waiting for Meilisearch.
    pub fn set_stream_position(
        &self,
        received: u64,
        confirmed: u64,
        oldest_unconfirmed: Option<i64>,
    ) {
        let mut state = STATE.exclusive();
        let entry = &mut state.entries[self.index];
        let advanced = confirmed > entry.confirmed_lsn;
        // Nothing unconfirmed: the task holds up nothing, even while its position waits for the
        // shared pass to read to the end of a backlog that is another task's.
        if advanced || oldest_unconfirmed.is_none() {
            // SAFETY: reads the transaction-independent wall clock.
            entry.progressed_at = unsafe { pg_sys::GetCurrentTimestamp() };
        }
        entry.received_lsn = received;
        entry.confirmed_lsn = confirmed;
        entry.oldest_unconfirmed_at = oldest_unconfirmed.unwrap_or(0);
        let (task_id, database) = (entry.task_id, entry.database);
        if advanced {
            for waiter in state.waiters.iter().filter(|waiter| {
                waiter.latch != 0
                    && waiter.task_id == task_id
                    && waiter.database == database
                    && waiter.lsn <= confirmed
            }) {
                // SAFETY: the address is a waiting backend's PGPROC latch in shared memory, valid
                // for the cluster's life; setting the latch of a backend that stopped waiting
                // is harmless.
                unsafe { pg_sys::SetLatch(waiter.latch as *mut pg_sys::Latch) };
            }
        }
    }

    /// The checkpoint moved: Meilisearch confirmed everything up to it.
    pub fn confirmed_now(&self) {
        // SAFETY: reads the transaction-independent wall clock.
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        self.update(|entry| entry.last_confirmed_at = now);
    }

    pub fn add_dead_letters(&self, count: usize) {
        self.update(|entry| entry.dead_letters += count as i64);
    }

    pub fn add_retry(&self) {
        self.update(|entry| entry.retries += 1);
    }

    pub fn set_error(&self, message: &str) {
        // SAFETY: reads the transaction-independent wall clock.
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        self.update(|entry| {
            let mut end = message.len().min(ERROR_BYTES);
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            entry.error[..end].copy_from_slice(&message.as_bytes()[..end]);
            entry.error_len = end as u16;
            entry.error_at = now;
        });
    }

    /// The catalog generation this worker loaded.
    pub fn set_generation(&self, generation: i32) {
        self.update(|entry| entry.generation = generation);
    }

    /// The shared decoder streams this task (see `attached_workers`).
    pub fn set_served_by_shared_decoder(&self) {
        self.update(|entry| entry.served_by_shared_decoder = true);
    }

    pub fn detach(&self, phase: Phase) {
        self.update(|entry| {
            entry.pid = 0;
            entry.latch = 0;
            entry.phase = phase as u8;
            entry.batches_inflight = 0;
        });
    }
}

/// Whether a backend (a worker) with this pid runs.
pub fn backend_alive(pid: i32) -> bool {
    // SAFETY: looks the pid up in the proc array under its lock; only the pointer's nullness is used.
    !unsafe { pg_sys::BackendPidGetProc(pid) }.is_null()
}

/// The pid of the worker attached to a task's entry, if any.
pub fn attached_pid(task_id: i64) -> Option<i32> {
    let database = my_database();
    let state = STATE.share();
    state
        .entries
        .iter()
        .find(|entry| entry.task_id == task_id && entry.database == database && entry.pid > 0)
        .map(|entry| entry.pid)
}

/// A worker running now: (whose, pid, the catalog generation it runs with).
pub fn attached_workers() -> Vec<(WorkerId, i32, i32)> {
    let database = my_database();
    let state = STATE.share();
    state
        .entries
        .iter()
        .filter(|entry| {
            entry.task_id != 0
                && entry.database == database
                && entry.pid > 0
                && !entry.served_by_shared_decoder
        })
        .map(|entry| {
            (
                WorkerId::from_key(entry.task_id),
                entry.pid,
                entry.generation,
            )
        })
        .collect()
}

/// The last error a worker reported.
pub fn last_error(worker: WorkerId) -> Option<String> {
    live_tasks()
        .into_iter()
        .find(|live| live.task_id == worker.key())
        .and_then(|live| live.last_error)
}

/// The phase of the task's live entry, if it has one: a search goes first to a replica that
/// streams, and never to one that copies.
pub fn phase_of(task_id: i64) -> Option<Phase> {
    let database = my_database();
    STATE
        .share()
        .entries
        .iter()
        .find(|entry| entry.task_id == task_id && entry.database == database)
        .and_then(|entry| Phase::from_u8(entry.phase))
}

/// Live-state entries that tasks of other databases hold: `meili_sync.max_tasks` counts the
/// tasks of every database.
pub fn entries_of_other_databases() -> usize {
    let database = my_database();
    STATE
        .share()
        .entries
        .iter()
        .filter(|entry| entry.task_id != 0 && entry.database != database)
        .count()
}

/// Every entry of this database in use, for the status view.
pub fn live_tasks() -> Vec<TaskLive> {
    let database = my_database();
    let state = STATE.share();
    state
        .entries
        .iter()
        .filter(|entry| entry.task_id != 0 && entry.database == database)
        .map(|entry| TaskLive {
            task_id: entry.task_id,
            pid: (entry.pid > 0).then_some(entry.pid),
            phase: Phase::from_u8(entry.phase),
            rows_copied: entry.rows_copied,
            docs_confirmed: entry.docs_confirmed,
            deletes_confirmed: entry.deletes_confirmed,
            batches_inflight: entry.batches_inflight,
            retries: entry.retries,
            bytes_uncompressed: entry.bytes_uncompressed,
            bytes_sent: entry.bytes_sent,
            docs_sent: entry.docs_sent,
            failed_tasks: entry.failed_tasks,
            docs_per_second: entry.docs_per_second,
            received_lsn: (entry.received_lsn != 0).then_some(entry.received_lsn),
            confirmed_lsn: (entry.confirmed_lsn != 0).then_some(entry.confirmed_lsn),
            oldest_unconfirmed_at: (entry.oldest_unconfirmed_at != 0)
                .then_some(entry.oldest_unconfirmed_at),
            last_sent_at: (entry.last_sent_at != 0).then_some(entry.last_sent_at),
            last_confirmed_at: (entry.last_confirmed_at != 0).then_some(entry.last_confirmed_at),
            progressed_at: (entry.progressed_at != 0).then_some(entry.progressed_at),
            last_error: (entry.error_len > 0).then(|| {
                String::from_utf8_lossy(&entry.error[..entry.error_len as usize]).into_owned()
            }),
            last_error_at: (entry.error_len > 0).then_some(entry.error_at),
        })
        .collect()
}

/// Cumulative counters of every task of this database that had a worker since the server started.
pub fn task_counters() -> Vec<(
    i64,
    Counters,
    Option<pg_sys::TimestampTz>,
    pg_sys::TimestampTz,
)> {
    let database = my_database();
    let state = STATE.share();
    state
        .entries
        .iter()
        .filter(|entry| entry.task_id != 0 && entry.database == database)
        .map(|entry| {
            let confirmed = (entry.last_confirmed_at != 0).then_some(entry.last_confirmed_at);
            (
                entry.task_id,
                entry.base.plus(entry.worker_counters()),
                confirmed,
                entry.stats_reset,
            )
        })
        .collect()
}

/// Zeroes the cumulative counters of one task, or of all.
pub fn reset_counters(task_id: Option<i64>) {
    // SAFETY: reads the transaction-independent wall clock.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let database = my_database();
    let mut state = STATE.exclusive();
    for entry in state.entries.iter_mut().filter(|entry| {
        entry.task_id != 0
            && entry.database == database
            && task_id.is_none_or(|id| id == entry.task_id)
    }) {
        entry.base = Counters::ZERO.minus(entry.worker_counters());
        entry.stats_reset = now;
    }
}
