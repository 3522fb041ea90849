//! What every phase of a task worker shares: stop checks, the stop reasons, retries of
//! Meilisearch calls and of catalog transactions with backoff, and reporting the dispatcher's
//! progress to the status view and the dead letters; also a task's dispatcher, and the life of a
//! worker process around its work. The phases (snapshot, stream, resync) and the workers (`task`,
//! `shared`) import it; it imports none of them.
//!
//! Threads: `start_writer` blocks every signal (`BackgroundWorkerBlockSignals`) before
//! `Writer::start` and unblocks them after, so the writer threads inherit the mask; a SIGTERM or
//! SIGHUP handled on an HTTP thread would call Postgres there, panic, abort the process, and make the
//! postmaster restart the whole cluster. Any new thread in a Postgres process must start the same
//! way (the core's client resolves host names on the calling thread for the same reason).
//!
//! ERRORs: an ERROR raised inside SPI or FFI unwinds as a panic to the nearest `PgTryBuilder`.
//! `in_transaction`, through which every catalog transaction of a task worker's phases runs, catches
//! only the ERRORs that pass by themselves (`55P03`, `40001`, `40P01`, `57014`): it aborts the
//! transaction, shows the error (phase `retrying`), waits with backoff and runs it again; the slot
//! stays acquired (Postgres releases slots only at top-level error recovery). An ERROR of
//! `PERMANENT_CLASSES` fails the same way on every try, so it stops the task (`Stop::Failed`) instead
//! of a crash loop; every other ERROR, and every panic, propagates, and `worker_main` records it
//! and rethrows so that the launcher restarts the worker. `in_user_transaction` (the user's SQL:
//! renders, mapping queries) stops the task on any other ERROR too. None of them runs inside a
//! decoding callback, whose transaction is the decoding's own. An `Err(SyncError)` from the catalog
//! is permanent: `Stop: From<SyncError>` keeps its message and hint as the task's `last_error`.
//!
//! `report_progress` stores the dead letters (in their own transaction) and updates shared memory
//! before the checkpoint they pass is confirmed.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use pgrx::bgworkers::BackgroundWorker;
use pgrx::pg_sys::panic::CaughtError;
use pgrx::prelude::*;

use pgrx::bgworkers::SignalWakeFlags;

use pg_meili_sync_core::meili::client::{Client, MeiliError, MeiliTask, TASK_WAIT};
use pg_meili_sync_core::meili::retry::{Backoff, RETRY_BASE, RETRY_CAP};
use pg_meili_sync_core::meili::writer::{Writer, WriterConfig};
use pg_meili_sync_core::pipeline::dispatch::{Dispatcher, Progress};
use pg_meili_sync_core::task::failure::{Advice, Failure, FailureKind};
use pg_meili_sync_core::task::options::TaskOptions;

use crate::catalog::{self, tasks::TaskRecord};
use crate::decode::session;
use crate::error::SyncError;
use crate::shmem::{
    self,
    live::{LiveStatus, NoEntry, Phase, WorkerId},
};

/// How long an enqueued Meilisearch task may be missing from its task list before its batch is
/// sent again (at least once: it may have been applied before it vanished).
const VANISHED_TASK_GRACE: Duration = Duration::from_secs(30);

/// True once SIGTERM arrived or the postmaster died; checked between units of work.
pub fn should_stop() -> bool {
    // SAFETY: reads a flag that this process's SIGTERM handler sets.
    let terminated = unsafe { (&raw const pg_sys::ShutdownRequestPending).read_volatile() != 0 };
    // A zero-timeout latch wait reports postmaster death (and SIGTERM) without sleeping.
    terminated || !BackgroundWorker::wait_latch(Some(Duration::ZERO))
}

/// Reloads the configuration files after a SIGHUP (`pg_reload_conf()`), so that a changed
/// setting, `synchronized_standby_slots` say, reaches a running worker. Call it outside a
/// transaction.
pub fn reload_config_if_asked() {
    if BackgroundWorker::sighup_received() {
        // SAFETY: in the worker's main thread, outside a transaction, as the launcher does.
        unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
    }
}

/// Why the worker ended without finishing: a failure stops the task, anything else is retried.
pub enum Stop {
    Terminated,
    Failed(Failure),
}

/// A permanent failure of `kind`, with its kind's advice.
pub fn fail(kind: FailureKind, message: impl Into<String>) -> Stop {
    Stop::Failed(Failure::new(kind, message))
}

impl From<Failure> for Stop {
    fn from(failure: Failure) -> Self {
        Stop::Failed(failure)
    }
}

impl From<SyncError> for Stop {
    fn from(error: SyncError) -> Self {
        Stop::Failed(Failure::from(error))
    }
}

/// SQLSTATEs of ERRORs in our own catalog work that pass by themselves: another session held a
/// lock past `lock_timeout`, a serialization failure or a deadlock victim, a statement cancelled
/// (`statement_timeout`, `pg_cancel_backend`). An ERROR of [`PERMANENT_CLASSES`] stops the task;
/// every other ERROR ends the worker, and the launcher restarts it.
const PASSING_ERRORS: [PgSqlErrorCode; 4] = [
    PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE,
    PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
    PgSqlErrorCode::ERRCODE_T_R_DEADLOCK_DETECTED,
    PgSqlErrorCode::ERRCODE_QUERY_CANCELED,
];

/// Runs `work` in a transaction whose queries see the catalog of now, never one that a decoded
/// transaction was replayed under (`session::forget_historic_catalog`): every transaction of a
/// worker starts here.
pub fn worker_transaction<R>(
    work: impl FnOnce() -> R + std::panic::UnwindSafe + std::panic::RefUnwindSafe,
) -> R {
    BackgroundWorker::transaction(|| {
        session::forget_historic_catalog();
        work()
    })
}

/// Runs `work` in a transaction of its own. An ERROR of [`PASSING_ERRORS`] rolls the transaction
/// back, shows itself in the status view, and `work` runs again after a backoff (100 ms doubling
/// to 30 s) until it succeeds or the worker is told to stop; any other ERROR propagates. An `Err`
/// that `work` returns stops the task. Only from the main loop of a phase, never inside a decoding
/// callback: aborting a transaction there would abort the decoding's own.
pub fn in_transaction<T>(
    live: LiveStatus,
    what: &str,
    work: impl FnMut() -> Result<T, SyncError>,
) -> Result<T, Stop> {
    run_transaction(live, what, None, work)
}

/// Like [`in_transaction`], for work that runs the user's SQL (a view's query, a mapping query):
/// any other ERROR is the user's to fix, so it rolls the transaction back and stops the task with
/// the message and `advice`, instead of ending the worker for the launcher to restart in a loop.
pub fn in_user_transaction<T>(
    live: LiveStatus,
    what: &str,
    advice: Advice,
    work: impl FnMut() -> Result<T, SyncError>,
) -> Result<T, Stop> {
    run_transaction(live, what, Some(advice), work)
}

/// Like [`in_user_transaction`], for work that also calls Meilisearch: an `Err` of `work` that
/// `is_transient` rolls its transaction back and runs it again after the retry policy's delay,
/// as [`retry_transient`] does; any other `Err` stops the task.
pub fn in_user_transaction_retrying<T>(
    live: LiveStatus,
    what: &str,
    advice: Advice,
    is_transient: impl Fn(&SyncError) -> bool,
    mut work: impl FnMut() -> Result<T, SyncError>,
) -> Result<T, Stop> {
    let mut backoff = Backoff::policy();
    let mut attempt = 0;
    loop {
        // The transaction commits either way: `work` wrote nothing it would keep.
        match in_user_transaction(live, what, advice.clone(), || Ok(work()))? {
            Ok(value) => return Ok(value),
            Err(error) if is_transient(&error) => {
                retry_pause(live, &format!("{what}: {error}"), backoff.delay(attempt))?;
                attempt += 1;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// How a transaction's ERROR was caught.
enum Caught {
    /// Of [`PASSING_ERRORS`]: retried.
    Passing(String),
    /// Any other, where the caller stops the task for it.
    Permanent(String),
}

fn run_transaction<T>(
    live: LiveStatus,
    what: &str,
    user_advice: Option<Advice>,
    mut work: impl FnMut() -> Result<T, SyncError>,
) -> Result<T, Stop> {
    let mut backoff = Backoff::policy();
    let mut attempt = 0;
    // Shown again once the work went through after retries (unless it was retrying already).
    let phase_before = live.phase().filter(|phase| *phase != Phase::Retrying);
    loop {
        let mut guarded = PgTryBuilder::new(AssertUnwindSafe(|| {
            Ok(worker_transaction(AssertUnwindSafe(&mut work)))
        }));
        for code in PASSING_ERRORS {
            guarded = guarded.catch_when(code, |error| Err(Caught::Passing(roll_back(error))));
        }
        guarded = if user_advice.is_some() {
            guarded.catch_others(|error| Err(Caught::Permanent(roll_back(error))))
        } else {
            guarded.catch_others(|error| {
                if fails_every_time(&error) {
                    Err(Caught::Permanent(roll_back(error)))
                } else {
                    // The worker ends, and the launcher restarts it.
                    error.rethrow()
                }
            })
        };
        match guarded.execute() {
            Ok(result) => {
                if let Some(phase) = phase_before.filter(|_| attempt > 0) {
                    live.set_phase(phase);
                }
                return Ok(result?);
            }
            Err(Caught::Permanent(message)) => {
                let failure = Failure::new(FailureKind::Source, message).context(what);
                return Err(Stop::Failed(match user_advice {
                    Some(advice) => failure.advice(advice),
                    None => failure,
                }));
            }
            Err(Caught::Passing(message)) => {
                let delay = backoff.delay(attempt);
                let error = format!(
                    "{what}: {message}; rolled back, tried again in {} ms",
                    delay.as_millis()
                );
                warning!("pg_meili_sync: {error}");
                retry_pause(live, &error, delay)?;
                attempt += 1;
            }
        }
    }
}

/// SQLSTATE classes of ERRORs that come back the same on every try: a feature not supported
/// (0A), bad data (22, a division by zero in a row-security policy say), an integrity violation
/// (23), an invalid transaction or schema name (2B, 3D, 3F), a syntax error or missing
/// privilege, object or operator (42), a violated check option (44). The task stops with the
/// message at once instead of crashing its worker into the launcher's restart loop.
const PERMANENT_CLASSES: [&str; 8] = ["0A", "22", "23", "2B", "3D", "3F", "42", "44"];

/// An ERROR raised by Postgres (not a panic of ours) whose SQLSTATE class is in
/// [`PERMANENT_CLASSES`].
fn fails_every_time(error: &CaughtError) -> bool {
    let (CaughtError::PostgresError(report) | CaughtError::ErrorReport(report)) = error else {
        return false;
    };
    let class = sqlstate(report.sql_error_code() as i32);
    PERMANENT_CLASSES.contains(&&class[..2])
}

/// The five characters of a packed SQLSTATE (Postgres's `MAKE_SQLSTATE`: six bits a character).
fn sqlstate(code: i32) -> String {
    (0..5)
        .map(|position| char::from(b'0' + ((code >> (6 * position)) & 0x3F) as u8))
        .collect()
}

/// Rolls back the transaction a passing ERROR interrupted; returns the ERROR's message.
fn roll_back(error: CaughtError) -> String {
    let message = crate::error::caught_message(&error);
    // SAFETY: in the worker's main thread, after pgrx copied and flushed the error, outside any
    // decoding callback: rolls back the transaction as a backend's error recovery does. It leaves
    // the replication slot acquired (Postgres releases slots only at top-level error recovery).
    unsafe { pg_sys::AbortCurrentTransaction() };
    message
}

/// Shows a transient failure in the status view and waits `delay` before the next attempt,
/// unless the worker is asked to stop.
fn retry_pause(live: LiveStatus, error: &str, delay: Duration) -> Result<(), Stop> {
    live.add_retry();
    live.set_error(error);
    live.set_phase(Phase::Retrying);
    let deadline = std::time::Instant::now() + delay;
    while std::time::Instant::now() < deadline {
        if should_stop() {
            return Err(Stop::Terminated);
        }
        std::thread::sleep(Duration::from_millis(20).min(delay));
    }
    Ok(())
}

/// Runs a Meilisearch call, retrying transient failures with backoff until it succeeds, fails
/// for good, or the worker is asked to stop.
pub fn with_retry<T>(
    live: LiveStatus,
    what: &str,
    call: impl FnMut() -> Result<T, MeiliError>,
) -> Result<T, Stop> {
    retry_transient(
        live,
        what,
        |error: &MeiliError| error.is_retryable() || error.is_auth(),
        call,
        |error| fail(FailureKind::Meilisearch, format!("{what}: {error}")),
    )
}

/// Runs `call` until it succeeds: after each failure that `is_transient`, the task shows
/// `retrying` with the error and waits the retry policy's delay (unless asked to stop); any other
/// failure becomes `stop`'s.
fn retry_transient<T, E: std::fmt::Display>(
    live: LiveStatus,
    what: &str,
    is_transient: impl Fn(&E) -> bool,
    mut call: impl FnMut() -> Result<T, E>,
    stop: impl FnOnce(E) -> Stop,
) -> Result<T, Stop> {
    let mut backoff = Backoff::policy();
    let mut attempt = 0;
    loop {
        match call() {
            Ok(value) => return Ok(value),
            Err(error) if is_transient(&error) => {
                retry_pause(live, &format!("{what}: {error}"), backoff.delay(attempt))?;
                attempt += 1;
            }
            Err(error) => return Err(stop(error)),
        }
    }
}

/// Waits for a Meilisearch task and turns its failure into a permanent error.
pub fn await_meili_task(
    live: LiveStatus,
    client: &Client,
    uid: u64,
    what: &str,
) -> Result<(), Stop> {
    await_meili_task_unless(live, client, uid, what, |_| false)
}

/// Waits for the deletion of an index (Meilisearch task `uid`): one that found no index counts as
/// done, since the index is gone as asked; any other failure stops the worker.
pub fn await_index_deletion(
    live: LiveStatus,
    client: &Client,
    uid: u64,
    what: &str,
) -> Result<(), Stop> {
    await_meili_task_unless(live, client, uid, what, MeiliTask::found_no_index)
}

/// Waits for a Meilisearch task; a failure is a permanent error unless `as_asked` says the
/// failed task left things as the caller wanted them.
fn await_meili_task_unless(
    live: LiveStatus,
    client: &Client,
    uid: u64,
    what: &str,
    as_asked: fn(&MeiliTask) -> bool,
) -> Result<(), Stop> {
    let state = with_retry(live, what, || client.wait_task(uid, TASK_WAIT))?;
    if as_asked(&state) {
        return Ok(());
    }
    meili_task_succeeded(&state, what)
}

/// A Meilisearch task that did not succeed (or finish) stops the worker, naming the task's error.
pub fn meili_task_succeeded(state: &MeiliTask, what: &str) -> Result<(), Stop> {
    match state.failure() {
        None => Ok(()),
        Some(failure) => Err(fail(FailureKind::Meilisearch, format!("{what}: {failure}"))),
    }
}

/// Acts on what the dispatcher reported: stores dead letters (before any checkpoint that covers
/// them is saved or confirmed) and shows retries in the status view.
pub fn report_progress(
    task_id: i64,
    live: LiveStatus,
    dispatcher: &mut Dispatcher,
    progress: &Progress,
    phase: Phase,
) -> Result<(), Stop> {
    for notice in &progress.notices {
        log!("pg_meili_sync task {task_id}: {notice}");
    }
    for error in &progress.retries {
        live.add_retry();
        live.set_error(error);
        live.set_phase(Phase::Retrying);
    }
    if progress.checkpoint.is_some() {
        live.confirmed_now();
    }
    // `retrying` only while requests fail: once Meilisearch answers again, the task is back in
    // its phase (the error stays shown, with its time).
    if (progress.checkpoint.is_some() || progress.answered) && progress.retries.is_empty() {
        live.set_phase(phase);
    }
    let dead_letters = dispatcher.take_dead_letters();
    if !dead_letters.is_empty() {
        in_transaction(live, "storing dead letters", || {
            catalog::dead_letters::insert_dead_letters(
                task_id,
                &dead_letters,
                phase == Phase::Streaming,
            )
        })?;
        live.add_dead_letters(dead_letters.len());
        let message = format!(
            "{} document(s) refused by Meilisearch went to meili_sync_dead_letters: {}",
            dead_letters.len(),
            dead_letters[0].message
        );
        warning!("pg_meili_sync task {task_id}: {message}");
        live.set_error(&message);
    }
    Ok(())
}

/// The task's dispatcher, with its writer's HTTP threads started.
pub fn open_dispatcher(
    client: &Client,
    task: &TaskRecord,
    options: &TaskOptions,
    key_attribute: &str,
) -> Dispatcher {
    let writer = start_writer(WriterConfig {
        client: client.clone(),
        index_uid: task.index_uid.clone(),
        primary_key: key_attribute.to_owned(),
        gzip: options.gzip,
        gzip_level: 1,
        // The copy keeps up to `snapshot_depth` batches enqueued, the stream `stream_depth` (the
        // dispatcher bounds what is held in memory by `max_inflight`).
        max_inflight: options
            .max_inflight
            .max(options.snapshot_depth)
            .max(options.stream_depth),
        poll_interval: Duration::from_millis(10),
        retry_base: RETRY_BASE,
        retry_cap: RETRY_CAP,
        vanished_after: VANISHED_TASK_GRACE,
    });
    Dispatcher::new(
        writer,
        key_attribute,
        options.max_inflight,
        options.max_payload_bytes,
    )
}

/// Forgets what `dispatcher` has not had confirmed, for a stream that decodes it again (see
/// `Dispatcher::rewind`): its writer's threads start again, with every signal blocked as in
/// `start_writer`.
pub fn rewind_dispatcher(dispatcher: &mut Dispatcher, careful_until: u64) {
    // SAFETY: as in `start_writer`: blocks signals on this (the main) thread while the new
    // threads start, so that they inherit the mask; pending signals arrive at the restore.
    unsafe { pg_sys::BackgroundWorkerBlockSignals() };
    dispatcher.rewind(careful_until);
    // SAFETY: restores the background worker's mask, as in `start_writer`.
    unsafe { pg_sys::BackgroundWorkerUnblockSignals() };
}

/// Starts the writer's HTTP threads with every signal blocked, so that the kernel delivers
/// SIGTERM and SIGHUP to the main thread: pgrx's handlers call Postgres (SetLatch), which from
/// another thread is a panic, and a panic in a signal handler aborts the process, which makes the
/// postmaster restart the whole server. The threads inherit the mask at creation.
fn start_writer(config: WriterConfig) -> Writer {
    // SAFETY: sets this (the main) thread's signal mask to Postgres's BlockSig; signals that
    // arrive meanwhile stay pending until the mask is restored just below.
    unsafe { pg_sys::BackgroundWorkerBlockSignals() };
    let writer = Writer::start(config);
    // SAFETY: restores the mask a background worker runs with (UnBlockSig), as pgrx set it in
    // attach_signal_handlers.
    unsafe { pg_sys::BackgroundWorkerUnblockSignals() };
    writer
}

/// The database a worker was started for: every worker the launchers start carries its
/// database's OID as its extra text.
pub fn database_of_worker() -> Option<pg_sys::Oid> {
    BackgroundWorker::get_extra()
        .parse::<u32>()
        .ok()
        .filter(|oid| *oid != 0)
        .map(pg_sys::Oid::from)
}

/// A worker process's life around `work(live, pid)`: signal handlers, the connection, the pinned
/// search path, its shared-memory entry, and how it ends. A permanent failure of a task sets the
/// task's state `error`; an ERROR is logged and ends the process (the launcher restarts it).
pub fn worker_main(worker: WorkerId, work: impl FnOnce(LiveStatus, i32) -> Result<(), Stop>) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let Some(database) = database_of_worker() else {
        warning!("pg_meili_sync {worker}: started without a database");
        return;
    };
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(database), None);
    crate::security::pin_worker_settings();
    // SAFETY: reading this process's own pid.
    let pid = unsafe { pg_sys::MyProcPid };
    let index = match shmem::live::attach(worker, pid) {
        Ok(index) => index,
        Err(NoEntry::Full) => {
            warning!(
                "pg_meili_sync: no free shared-memory entry for the {worker} (meili_sync.max_tasks is {})",
                crate::gucs::max_tasks()
            );
            return;
        }
        // DROP DATABASE (or a rename, or a copy) waits for our processes to leave the database.
        Err(NoEntry::DatabasePaused) => return,
    };
    let live = LiveStatus::new(index);
    // After an ERROR nothing of `work` is used again: the process exits.
    let work = AssertUnwindSafe(work);
    let outcome = PgTryBuilder::new(move || {
        let work = work;
        (work.0)(live, pid)
    })
        .catch_others(|error| {
            if should_stop() {
                // Told to stop inside a transaction replay, where an ERROR is the only way out:
                // a stop, not a failure of the task.
                log!("pg_meili_sync {worker}: stopped inside a transaction replay; the slot has not moved past it, so the next worker decodes it again");
                live.detach(Phase::Exited);
                error.rethrow()
            }
            let message = crate::error::caught_message(&error);
            // An ERROR escaping a background worker's main function ends the process without
            // reaching the server log: say it here, before it does.
            warning!("pg_meili_sync {worker}: {message}");
            live.set_error(&message);
            live.detach(Phase::Error);
            error.rethrow()
        })
        .execute();
    match outcome {
        Ok(()) | Err(Stop::Terminated) => live.detach(Phase::Exited),
        Err(Stop::Failed(failure)) => {
            let message = failure.last_error(worker.task());
            warning!(
                "pg_meili_sync {worker} stopped ({}): {message}",
                failure.kind.as_str()
            );
            live.set_error(&message);
            live.detach(Phase::Error);
            // The shared decoder has no task row.
            let Some(task_id) = worker.task() else {
                return;
            };
            if let Err(error) =
                worker_transaction(|| catalog::tasks::set_error_state(task_id, &message))
            {
                // The launcher then restarts the worker, which meets the same failure again.
                warning!(
                    "pg_meili_sync {worker}: could not set state error: {}",
                    error.message
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_sqlstates_read_back_as_their_five_characters() {
        assert_eq!(
            sqlstate(PgSqlErrorCode::ERRCODE_DIVISION_BY_ZERO as i32),
            "22012"
        );
        assert_eq!(
            sqlstate(PgSqlErrorCode::ERRCODE_UNDEFINED_FUNCTION as i32),
            "42883"
        );
        assert_eq!(
            sqlstate(PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE as i32),
            "55P03"
        );
    }
}
