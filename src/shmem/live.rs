//! The task workers' live entries: one per worker (a task's, the shared decoder's, a
//! rebalance's), keyed by `WorkerId`, holding what the status views show that the catalog does
//! not: its phase, progress, positions, counters and last error. A worker attaches to its entry
//! and updates it through `LiveStatus`; the views and the launcher read them.

use pg_meili_sync_core::meili::writer::WriterStats;
use pg_meili_sync_core::pipeline::meter::RateWindow;
use pgrx::prelude::*;

use super::{my_database, my_latch, waiters, STATE};

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
    pub(super) database: pg_sys::Oid,
    pub(super) task_id: i64,
    pub(super) pid: i32,
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

    pub(super) const EMPTY: LiveEntry = LiveEntry {
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

pub(super) fn wake_task_workers() {
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

/// Whether a worker has published a confirmation of the task at or past `lsn`.
pub fn confirmed_past(task_id: i64, lsn: u64) -> bool {
    let database = my_database();
    STATE.share().entries.iter().any(|entry| {
        entry.task_id == task_id && entry.database == database && entry.confirmed_lsn >= lsn
    })
}

/// Why a worker got no live-state entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoEntry {
    /// All `meili_sync.max_tasks` entries are taken.
    Full,
    /// Its database is about to be dropped, renamed or copied (`ddl_guard`).
    DatabasePaused,
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
            waiters::wake_confirmed(&state, database, task_id, confirmed);
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
