//! A database's launcher: one worker per database with tasks (started by the cluster launcher,
//! `worker::cluster`) that starts a task worker per active task, restarts crashed ones after a
//! growing backoff, stops the ones whose task was stopped or dropped, and drops the slots of
//! dropped tasks. It also logs a WARNING when a task's slot holds too much WAL or its changes wait
//! too long for Meilisearch. It exits when its database has no task and nothing to clean up, and
//! the cluster launcher starts it again when a SQL function asks for it.
//!
//! A round (at least every `GUARD_INTERVAL`, at once when a SQL function or a commit wakes it): read the
//! catalog, reap exited workers, start and stop task workers (`start_worker`: the task id as
//! argument, the database OID in `bgw_extra`), the shared decoder while any shared task exists and
//! a rebalance worker while a shard is being added, drop the slots and publications of tasks that
//! no longer exist (or of a dropped extension), release tasks held by an abandoned resync, fail the
//! tasks whose source was dropped, and warn about retained WAL and lag. A worker whose generation is
//! stale is terminated; a restarted launcher adopts the workers still running
//! (`shmem::live::attached_workers`) instead of starting second ones.
//!
//! Crashes: `reap` counts a crash and restarts the task after `meili_sync.restart_backoff` × 2ⁿ (at
//! most `MAX_BACKOFF`); `CRASH_LOOP` crashes in a row, each within `HEALTHY_RUN` of its start, set
//! state `error` (`stop_crash_loop`). A round that fails is caught by `survive`, which logs a
//! WARNING, aborts the transaction and goes on with the next round. The launcher owns every
//! restart: workers never restart themselves.
//!
//! Before it registers, a launcher checks that the database has work for it
//! (`has_work_for_a_launcher`); when `meili_sync.max_databases` databases hold an entry it waits for
//! a place (`wait_for_a_place`), showing it on its active tasks. A database copied with `CREATE
//! DATABASE … TEMPLATE` holds the original's install row: its launcher runs no task and says why.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BackgroundWorkerStatus, DynamicBackgroundWorker,
    SignalWakeFlags,
};
use pgrx::prelude::*;

use pg_meili_sync_core::pipeline::pacing::Throttle;
use pg_meili_sync_core::task::pg_catalog::SlotStatus;

use crate::catalog::{self, tasks::TaskSummary};
use crate::shmem::live::WorkerId;
use crate::worker::control::{database_of_worker, reload_config_if_asked};
use crate::{gucs, resync_request, shmem};

const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// A worker that ran this long before exiting is not counted as a crash loop.
const HEALTHY_RUN: Duration = Duration::from_secs(60);
/// Consecutive crashes after which a task is put in state `error`.
const CRASH_LOOP: u32 = 10;
/// How often the WAL guard looks at the slots, and how often it repeats a standing warning.
const GUARD_INTERVAL: Duration = Duration::from_secs(5);
const WARNING_REPEAT: Duration = Duration::from_secs(300);

/// Starts the launcher of `database` (a dynamic worker that the postmaster never restarts: the
/// cluster launcher, which it notifies when it exits, decides).
pub(super) fn start_database_launcher(
    database: pg_sys::Oid,
) -> Result<DynamicBackgroundWorker, ()> {
    // SAFETY: reading this process's own pid.
    let cluster_launcher_pid = unsafe { pg_sys::MyProcPid };
    BackgroundWorkerBuilder::new(&format!(
        "pg_meili_sync launcher of database {}",
        database.to_u32()
    ))
    .set_type("pg_meili_sync launcher")
    .set_library("pg_meili_sync")
    .set_function("meili_sync_database_launcher_main")
    .set_argument(Some(pg_sys::Datum::from(database.to_u32())))
    .set_extra(&database.to_u32().to_string())
    .enable_spi_access()
    .set_notify_pid(cluster_launcher_pid)
    .load_dynamic()
    .map_err(|_| ())
}

/// A worker a launcher follows: one it started, or one that was already running when it
/// (re)started (a launcher that exited leaves its workers running).
pub(super) enum Worker {
    Started(DynamicBackgroundWorker),
    Adopted(i32),
}

impl Worker {
    /// The worker's pid while it runs.
    pub(super) fn pid(&self) -> Option<i32> {
        match self {
            Worker::Started(handle) => handle.pid().ok(),
            Worker::Adopted(pid) => shmem::backend_alive(*pid).then_some(*pid),
        }
    }

    pub(super) fn has_exited(&self) -> bool {
        match self {
            Worker::Started(handle) => {
                matches!(handle.pid(), Err(BackgroundWorkerStatus::Stopped))
            }
            Worker::Adopted(pid) => !shmem::backend_alive(*pid),
        }
    }
}

struct Running {
    handle: Worker,
    generation: i32,
    started: Instant,
    terminating: bool,
}

/// Restarts of a worker (or, in the cluster launcher, of a database's launcher) that keeps
/// exiting: each exit doubles the wait before the next start, from `meili_sync.restart_backoff`
/// up to `MAX_BACKOFF`, and a run of `HEALTHY_RUN` starts the count again.
#[derive(Default)]
pub(super) struct Backoff {
    pub(super) crashes: u32,
    pub(super) not_before: Option<Instant>,
}

impl Backoff {
    /// Counts an exit after a run of `ran`; returns the wait before the next start.
    pub(super) fn count_exit(&mut self, ran: Duration) -> Duration {
        if ran >= HEALTHY_RUN {
            self.crashes = 0;
        }
        let delay = gucs::restart_backoff()
            .saturating_mul(1 << self.crashes.min(16))
            .min(MAX_BACKOFF);
        self.crashes += 1;
        self.not_before = Some(Instant::now() + delay);
        delay
    }
}

/// A worker that should run, with the catalog generation it must run with.
struct Wanted {
    worker: WorkerId,
    generation: i32,
}

/// What a round found.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Round {
    /// The catalog could not be read.
    Failed,
    /// Workers run, or tasks exist.
    Busy,
    /// No task, no worker, nothing to clean up: the launcher may exit.
    Idle,
}

struct Launcher {
    running: HashMap<WorkerId, Running>,
    backoff: HashMap<WorkerId, Backoff>,
    database: pg_sys::Oid,
    /// The install whose tasks the workers run. Task ids start again at 1 in a new one, so after
    /// a DROP and CREATE EXTENSION within one round every worker of the old install is stopped.
    install: Option<pg_sys::Oid>,
}

impl Launcher {
    /// Reaps exited workers; an exit while the task should still run counts as a crash.
    fn reap(&mut self, wanted: &[Wanted]) {
        let exited: Vec<(WorkerId, Running)> = self
            .running
            .extract_if(|_, running| running.handle.has_exited())
            .collect();
        for (id, running) in exited {
            let still_wanted = wanted
                .iter()
                .any(|want| want.worker == id && want.generation == running.generation);
            if still_wanted && !running.terminating {
                let backoff = self.backoff.entry(id).or_default();
                let delay = backoff.count_exit(running.started.elapsed());
                // The shared decoder has no task row to stop: the tasks it streams stop instead,
                // and it is restarted after the longest backoff for as long as tasks share it.
                if backoff.crashes >= CRASH_LOOP {
                    match id {
                        WorkerId::SharedDecoder => stop_shared_crash_loop(backoff.crashes),
                        WorkerId::Task(task_id) | WorkerId::Rebalance(task_id) => {
                            stop_crash_loop(task_id, id, backoff.crashes);
                            continue;
                        }
                    }
                }
                log!(
                    "pg_meili_sync: worker of {id} exited; restarting in {} ms",
                    delay.as_millis()
                );
            }
        }
    }

    fn reconcile(&mut self, wanted: &[Wanted]) {
        let stale: Vec<WorkerId> = self
            .running
            .iter()
            .filter(|(id, running)| {
                !running.terminating
                    && !wanted
                        .iter()
                        .any(|want| want.worker == **id && want.generation == running.generation)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            if let Some(running) = self.running.get_mut(&id) {
                terminate(&running.handle);
                running.terminating = true;
            }
        }
        for want in wanted {
            if self.running.contains_key(&want.worker) {
                continue;
            }
            let backoff = self.backoff.entry(want.worker).or_default();
            if backoff.not_before.is_some_and(|at| Instant::now() < at) {
                continue;
            }
            match start_worker(want.worker, self.database) {
                Ok(handle) => {
                    self.running.insert(
                        want.worker,
                        Running {
                            handle: Worker::Started(handle),
                            generation: want.generation,
                            started: Instant::now(),
                            terminating: false,
                        },
                    );
                }
                Err(()) => {
                    warning!("pg_meili_sync: could not start the worker of {}: no background worker slot free", want.worker);
                    backoff.not_before = Some(Instant::now() + gucs::restart_backoff());
                }
            }
        }
        self.backoff
            .retain(|id, _| wanted.iter().any(|want| want.worker == *id));
    }

    /// Follows the workers that run already: a launcher that exited (an ERROR, a kill) left them
    /// running, and starting a second worker for their task would fight over its slot.
    fn adopt_running_workers(&mut self) {
        for (worker, pid, generation) in shmem::live::attached_workers() {
            if !shmem::backend_alive(pid) {
                continue;
            }
            log!("pg_meili_sync launcher: the worker of {worker} (pid {pid}) still runs; following it");
            self.running.insert(
                worker,
                Running {
                    handle: Worker::Adopted(pid),
                    generation,
                    started: Instant::now(),
                    terminating: false,
                },
            );
        }
    }

    /// One round: read the catalog, reap, start and stop workers, drop orphans, check the slots.
    fn round(&mut self, guard: &mut WalGuard) -> Round {
        shmem::launchers::launcher_round_begins();
        let Some(CatalogRead {
            tasks,
            orphans,
            installed,
            install,
            waits_for_update,
        }) = read_catalog()
        else {
            return Round::Failed;
        };
        if install.is_some() && self.install.is_some() && install != self.install {
            log!("pg_meili_sync: the extension was created again; stopping the workers of its earlier install");
            self.reconcile(&[]);
            self.backoff.clear();
        }
        if install.is_some() {
            self.install = install;
        }
        let mut wanted: Vec<Wanted> = tasks
            .iter()
            .filter(|task| task.active)
            .map(|task| Wanted {
                worker: WorkerId::Task(task.id),
                generation: task.generation,
            })
            .collect();
        // A sharded task with a shard added: its rebalance worker (beside the task's stream).
        wanted.extend(
            tasks
                .iter()
                .filter(|task| task.rebalancing)
                .map(|task| Wanted {
                    worker: WorkerId::Rebalance(task.id),
                    generation: 0,
                }),
        );
        // Entries of inactive tasks stay too: they show the task's last error.
        let mut existing: Vec<WorkerId> =
            tasks.iter().map(|task| WorkerId::Task(task.id)).collect();
        existing.extend(
            tasks
                .iter()
                .filter(|task| task.rebalancing)
                .map(|task| WorkerId::Rebalance(task.id)),
        );
        if tasks.iter().any(|task| task.shared) {
            // The shared decoder runs while any task shares the decoding pass: it gives new tasks
            // their position, streams the streaming ones, and holds the slot for the others.
            wanted.push(Wanted {
                worker: WorkerId::SharedDecoder,
                generation: 0,
            });
            existing.push(WorkerId::SharedDecoder);
        }
        self.reap(&wanted);
        self.reconcile(&wanted);
        shmem::live::release_missing(&existing);
        let idle =
            tasks.is_empty() && orphans.is_empty() && self.running.is_empty() && !waits_for_update;
        for (kind, name) in orphans {
            let dropped = BackgroundWorker::transaction(|| match kind.as_str() {
                "slot" => catalog::replication::drop_slot(&name),
                _ => catalog::replication::drop_publication(&name),
            });
            match dropped {
                Ok(()) => {
                    log!("pg_meili_sync: dropped {kind} \"{name}\" of a task that no longer exists")
                }
                // An active slot, say, whose worker is still exiting.
                Err(error) => warn_once_a_minute(format!(
                    "could not drop {kind} \"{name}\" of a task that no longer exists: {}",
                    error.message
                )),
            }
        }
        // The WAL guard reads the catalog, which exists only with the extension.
        if installed {
            guard.check();
        }
        // Not while the catalog is another version's or a copy's (no task of it runs then).
        if installed && !waits_for_update && !tasks.is_empty() {
            resync_tasks_out_of_shape();
        }
        if idle {
            Round::Idle
        } else {
            Round::Busy
        }
    }

    /// The soonest moment a delayed restart is due, so the wait does not oversleep it.
    fn next_wake(&self, naptime: Duration) -> Duration {
        let now = Instant::now();
        self.backoff
            .values()
            .filter_map(|backoff| backoff.not_before)
            .map(|at| at.saturating_duration_since(now))
            .fold(naptime, Duration::min)
            .max(Duration::from_millis(10))
    }
}

/// Warns in the server log about slots that retain more WAL than `meili_sync.max_retained_wal`
/// and changes older than `meili_sync.lag_warning` (the status view shows the same as flags).
struct WalGuard {
    checks: Throttle,
    warned: HashMap<(i64, &'static str), Instant>,
}

impl WalGuard {
    fn new() -> Self {
        WalGuard {
            checks: Throttle::new(GUARD_INTERVAL),
            warned: HashMap::new(),
        }
    }

    fn check(&mut self) {
        if !self.checks.due(Instant::now()) {
            return;
        }
        let health = match BackgroundWorker::transaction(catalog::replication::slot_health) {
            Ok(health) => health,
            Err(error) => {
                warning!(
                    "pg_meili_sync launcher: could not read the replication slots' health: {}",
                    error.message
                );
                return;
            }
        };
        let mut standing = Vec::new();
        if let Some(limit) = gucs::max_retained_wal_bytes() {
            for slot in &health {
                let Some(retained) = slot.retained_bytes.filter(|bytes| *bytes > limit) else {
                    continue;
                };
                self.warn(&mut standing, (slot.task_id, "wal"), || format!(
                    "pg_meili_sync task {}: replication slot \"{}\" retains {} MB of WAL, more than meili_sync.max_retained_wal ({} MB)",
                    slot.task_id, slot.slot_name, retained >> 20, limit >> 20
                ), "Meilisearch has not confirmed the task's changes (see last_error in meili_sync_status), or the task is paused or stopped. Resume it, fix Meilisearch, or drop the task. max_slot_wal_keep_size caps the WAL a slot may keep, at the price of a new snapshot.");
            }
        }
        for slot in health
            .iter()
            .filter(|slot| slot.wal_status == SlotStatus::Unreserved)
        {
            self.warn(&mut standing, (slot.task_id, "unreserved"), || format!(
                "pg_meili_sync task {}: replication slot \"{}\" is past max_slot_wal_keep_size and will be invalidated at the next checkpoint",
                slot.task_id, slot.slot_name
            ), "An invalidated slot loses changes and the task then needs meili_sync_snapshot. Let the task catch up, or raise max_slot_wal_keep_size.");
        }
        if let Some(limit) = gucs::lag_warning() {
            // SAFETY: reads the transaction-independent wall clock.
            let now = unsafe { pg_sys::GetCurrentTimestamp() };
            for live in shmem::live::live_tasks() {
                let Some(oldest) = live.oldest_unconfirmed_at.filter(|_| live.pid.is_some()) else {
                    continue;
                };
                let lag = Duration::from_micros(now.saturating_sub(oldest).max(0) as u64);
                if lag <= limit {
                    continue;
                }
                self.warn(&mut standing, (live.task_id, "lag"), || format!(
                    "pg_meili_sync task {}: its oldest change not yet confirmed by Meilisearch committed {} s ago, more than meili_sync.lag_warning ({} s)",
                    live.task_id,
                    lag.as_secs(),
                    limit.as_secs()
                ), "See state, last_error and retries in meili_sync_status; the slot keeps every change until Meilisearch confirms it.");
            }
        }
        // A condition that cleared warns again at once if it comes back.
        self.warned.retain(|key, _| standing.contains(key));
    }

    /// Notes that condition `key` (a task and what is wrong) stands, and warns of it unless it
    /// did so less than `WARNING_REPEAT` ago.
    fn warn(
        &mut self,
        standing: &mut Vec<(i64, &'static str)>,
        key: (i64, &'static str),
        message: impl FnOnce() -> String,
        hint: &str,
    ) {
        standing.push(key);
        let now = Instant::now();
        if self
            .warned
            .get(&key)
            .is_some_and(|at| now.duration_since(*at) < WARNING_REPEAT)
        {
            return;
        }
        self.warned.insert(key, now);
        warn_with_hint(message(), hint);
    }
}

/// Runs one launcher round; an ERROR in it (a lock timeout, a catalog that changed under it) is
/// logged, its transaction is rolled back, and the launcher goes on with the next round instead
/// of exiting (its workers would run on unfollowed until it was started again). `failed` is what
/// a failed round returns.
pub(super) fn survive<R: Copy + std::panic::UnwindSafe + std::panic::RefUnwindSafe>(
    round: impl FnOnce() -> R + std::panic::UnwindSafe,
    failed: R,
) -> R {
    PgTryBuilder::new(round)
        .catch_others(|error| {
            let message = crate::error::caught_message(&error);
            // SAFETY: in the launcher's main thread, after pgrx copied and flushed the error: rolls
            // back the round's transaction (a no-op outside one), as a backend's error recovery does.
            unsafe { pg_sys::AbortCurrentTransaction() };
            warning!("pg_meili_sync launcher: a round failed and is tried again: {message}");
            failed
        })
        .execute()
}

fn warn_with_hint(message: String, hint: &str) {
    pgrx::pg_sys::panic::ErrorReport::new(
        PgSqlErrorCode::ERRCODE_WARNING,
        message,
        "pg_meili_sync",
    )
    .set_hint(hint)
    .report(PgLogLevel::WARNING);
}

/// Puts a task whose worker keeps crashing in state `error`, with its last error, instead of
/// restarting it forever; `meili_sync_resume` tries again.
fn stop_crash_loop(task_id: i64, worker: WorkerId, crashes: u32) {
    let last_error = last_error_of(worker);
    let who = match worker {
        WorkerId::Rebalance(_) => "the worker moving documents to an added shard",
        _ => "worker",
    };
    let message = format!(
        "{who} crashed {crashes} times in a row; last error: {last_error}; fix the cause, then run SELECT meili_sync_resume({task_id})"
    );
    warning!("pg_meili_sync task {task_id} stopped: {message}");
    if let Err(error) =
        BackgroundWorker::transaction(|| catalog::tasks::set_error_state(task_id, &message))
    {
        warning!(
            "pg_meili_sync task {task_id}: could not set state error: {}",
            error.message
        );
    }
}

/// The shared decoder keeps crashing: every task it streams stops in state `error` with the
/// decoder's last error, so that the tasks show why their changes do not arrive.
fn stop_shared_crash_loop(crashes: u32) {
    let last_error = last_error_of(WorkerId::SharedDecoder);
    let stopped = BackgroundWorker::transaction(|| -> Result<Vec<i64>, crate::error::SyncError> {
        let mut stopped = Vec::new();
        for task in catalog::shared::shared_tasks()?
            .into_iter()
            .filter(|task| task.streaming)
        {
            let message = format!(
                "the shared decoder crashed {crashes} times in a row; last error: {last_error}; fix the cause, then run SELECT meili_sync_resume({})",
                task.id
            );
            catalog::tasks::set_error_state(task.id, &message)?;
            stopped.push(task.id);
        }
        Ok(stopped)
    });
    match stopped {
        Ok(stopped) if !stopped.is_empty() => warning!(
            "pg_meili_sync: the shared decoder crashed {crashes} times in a row (last error: {last_error}); stopped tasks {stopped:?}"
        ),
        Ok(_) => {}
        Err(error) => warning!(
            "pg_meili_sync: could not stop the tasks of the crashing shared decoder: {}",
            error.message
        ),
    }
}

fn last_error_of(worker: WorkerId) -> String {
    shmem::live::last_error(worker).unwrap_or_else(|| "unknown error".to_owned())
}

/// Sends SIGTERM to a task worker (its handler only sets a flag that the worker checks).
fn terminate(handle: &Worker) {
    if let Some(pid) = handle.pid() {
        if let Err(error) =
            BackgroundWorker::transaction(|| catalog::replication::terminate_backend(pid))
        {
            warning!(
                "pg_meili_sync: could not signal the worker with pid {pid}: {}",
                error.message
            );
        }
    }
}

fn start_worker(worker: WorkerId, database: pg_sys::Oid) -> Result<DynamicBackgroundWorker, ()> {
    // SAFETY: reading this process's own pid.
    let launcher_pid = unsafe { pg_sys::MyProcPid };
    let (kind, function, argument) = match worker {
        WorkerId::SharedDecoder => (
            "pg_meili_sync shared decoder",
            "meili_sync_shared_decoder_main",
            0,
        ),
        WorkerId::Task(task_id) => ("pg_meili_sync task", "meili_sync_task_main", task_id),
        WorkerId::Rebalance(task_id) => (
            "pg_meili_sync rebalance",
            "meili_sync_rebalance_main",
            task_id,
        ),
    };
    BackgroundWorkerBuilder::new(&format!("pg_meili_sync {worker}"))
        .set_type(kind)
        .set_library("pg_meili_sync")
        .set_function(function)
        .set_argument(Some(pg_sys::Datum::from(argument)))
        .set_extra(&database.to_u32().to_string())
        .enable_spi_access()
        .set_notify_pid(launcher_pid)
        .load_dynamic()
        .map_err(|_| ())
}

/// A slot or publication of a task that no longer exists: ("slot" | "publication", name).
type Orphan = (String, String);

/// What one round reads: the tasks, the slots and publications to drop, and whether the
/// extension (its catalog) exists.
struct CatalogRead {
    tasks: Vec<TaskSummary>,
    orphans: Vec<Orphan>,
    installed: bool,
    install: Option<pg_sys::Oid>,
    /// Tasks wait for `ALTER EXTENSION … UPDATE`, which wakes nobody: the launcher must stay to
    /// see it.
    waits_for_update: bool,
}

fn read_catalog() -> Option<CatalogRead> {
    BackgroundWorker::transaction(|| {
        if !read(
            "whether the extension exists",
            catalog::extension_installed(),
        )? {
            // Not created yet, or dropped: no task runs (reconcile stops any worker still
            // running), and no slot keeps retaining WAL for tasks that are gone.
            return Some(CatalogRead {
                tasks: Vec::new(),
                orphans: read(
                    "the slots left by a dropped extension",
                    catalog::replication::leftovers_without_extension(),
                )?,
                installed: false,
                install: None,
                waits_for_update: false,
            });
        }
        // Another version's SQL objects (the library was replaced, and ALTER EXTENSION … UPDATE
        // has not run yet): no task runs, each shows why, and their slots keep their WAL.
        if let Some(mismatch) = read(
            "the extension's version",
            catalog::install::sql_version_mismatch(),
        )? {
            read(
                "the tasks waiting for the update",
                catalog::install::hold_tasks_for_update(&mismatch),
            );
            warn_once_a_minute(format!(
                "no task runs: {mismatch}; run ALTER EXTENSION pg_meili_sync UPDATE in this database"
            ));
            // The WAL guard goes on: it reads only what every version's catalog has.
            return Some(CatalogRead {
                tasks: Vec::new(),
                orphans: Vec::new(),
                installed: true,
                install: None,
                waits_for_update: true,
            });
        }
        read(
            "the tasks that waited for the update",
            catalog::install::release_tasks_held_for_update(),
        );
        // A copy of another database (CREATE DATABASE … TEMPLATE): its tasks are the original's,
        // slot names included, so none runs here, and nothing is dropped as an orphan.
        if let Some(original) = read(
            "whether this database is a copy",
            catalog::install::copied_from(),
        )? {
            read(
                "the tasks of the copied database",
                catalog::install::hold_tasks_of_copy(original),
            );
            warn_once_a_minute(catalog::install::copy_message(original));
            return Some(CatalogRead {
                tasks: Vec::new(),
                orphans: Vec::new(),
                installed: true,
                install: None,
                waits_for_update: false,
            });
        }
        // Before any worker starts: a task restored from another install's dump.
        let restored = read(
            "the tasks restored from a dump",
            catalog::install::stop_restored_tasks(),
        )?;
        for task_id in restored {
            warn_with_hint(
                format!("pg_meili_sync task {task_id} stopped: it was restored from a dump, and its positions belong to the database it was dumped from"),
                &format!("Check the task's index, then run SELECT meili_sync_resume({task_id}) to copy the table into it again."),
            );
        }
        // A task held for the swap of a resync whose helper was dropped, stopped or failed
        // streams on (it re-sends from its own slot whatever the abandoned swap may have skipped).
        let released = read(
            "the tasks held for an abandoned swap",
            catalog::tasks::release_held_tasks(),
        );
        for task_id in released.unwrap_or_default() {
            log!(
                "pg_meili_sync task {task_id}: its resync ended without a swap; streaming resumes"
            );
        }
        let failed = read(
            "the tasks whose table was dropped",
            catalog::tasks::fail_tasks_of_dropped_sources(),
        );
        for task_id in failed.unwrap_or_default() {
            warning!("pg_meili_sync task {task_id} stopped: its table or view was dropped");
        }
        let out_of_shape = read(
            "the shape of the tasks' sources",
            catalog::tasks::show_tasks_out_of_shape(),
        );
        for task_id in out_of_shape.unwrap_or_default() {
            warn_with_hint(
                format!("pg_meili_sync task {task_id}: the columns of its table or view changed since its documents were copied; documents of rows that have not changed since keep their old fields"),
                "meili_sync_status.last_error says which call rebuilds the index in the new shape (meili_sync_resync).",
            );
        }
        Some(CatalogRead {
            tasks: read("the tasks", catalog::tasks::list_tasks())?,
            orphans: read(
                "the slots of dropped tasks",
                catalog::replication::orphans(),
            )?,
            installed: true,
            install: read("the extension's install", catalog::install_id())?,
            waits_for_update: false,
        })
    })
}

/// Resyncs each task that a DDL put out of shape (`catalog::tasks::show_tasks_out_of_shape`),
/// unless its option `"schema_changes"` is `"report"`, each in a transaction of its own: a task
/// that cannot be resynced now (a shard being added, no room for its helpers) is told once a minute
/// and asked again next round, and never holds up another.
fn resync_tasks_out_of_shape() {
    let Some(tasks) = read(
        "the tasks to resync for their shape",
        BackgroundWorker::transaction(catalog::tasks::tasks_to_resync_for_their_shape),
    ) else {
        return;
    };
    for task_id in tasks {
        survive(
            move || BackgroundWorker::transaction(|| resync_for_shape(task_id)),
            (),
        );
    }
}

fn resync_for_shape(task_id: i64) {
    let helpers = catalog::tasks::load_task(task_id).and_then(|record| match record {
        Some(record) => resync_request::begin_resync(&record),
        None => Ok(Vec::new()),
    });
    match helpers {
        Ok(helpers) => {
            if let Some(helper) = helpers.first() {
                log!("pg_meili_sync task {task_id}: a DDL changed what its documents look like; helper task {helper} resyncs it into a new index, in the new shape, while it streams on");
            }
        }
        Err(error) => warn_once_a_minute(format!(
            "task {task_id} is out of shape and cannot be resynced now: {}",
            error.message
        )),
    }
}

/// How often the launcher logs the same failure of a round (reading the catalog, dropping an
/// orphan), at most.
const ROUND_FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(60);

thread_local! {
    /// The failure last logged, and when.
    static LAST_ROUND_FAILURE: std::cell::RefCell<Option<(String, Instant)>> =
        const { std::cell::RefCell::new(None) };
}

/// The value read, or none with a WARNING that says what could not be read: the launcher skips
/// the round and reads again in the next one. The same failure is logged once a minute at most.
fn read<T>(what: &str, result: catalog::CatalogResult<T>) -> Option<T> {
    let error = match result {
        Ok(value) => return Some(value),
        Err(error) => error,
    };
    warn_once_a_minute(format!("could not read {what}: {error}"));
    None
}

/// Warns of a failure of a round, which the next round tries again; the same failure is logged
/// once a minute at most.
fn warn_once_a_minute(message: String) {
    let repeated = LAST_ROUND_FAILURE.with(|last| {
        let mut last = last.borrow_mut();
        let repeated = last.as_ref().is_some_and(|(logged, at)| {
            *logged == message && at.elapsed() < ROUND_FAILURE_LOG_INTERVAL
        });
        if !repeated {
            *last = Some((message.clone(), Instant::now()));
        }
        repeated
    });
    if !repeated {
        warning!("pg_meili_sync launcher: {message}; it tries again in its next round");
    }
}

/// Whether this database has anything for a launcher to do: the extension, or the slots and
/// publications a dropped extension left. When it cannot tell, it assumes so.
fn has_work_for_a_launcher() -> bool {
    match catalog::extension_installed() {
        Ok(true) => true,
        Ok(false) => catalog::replication::leftovers_without_extension()
            .map(|leftovers| !leftovers.is_empty())
            .unwrap_or(true),
        Err(_) => true,
    }
}

/// How often a launcher whose database has no place yet looks for one.
const PLACE_LOOK_INTERVAL: Duration = Duration::from_secs(1);

/// Waits until the table of databases has a place for this one, saying why in the log (once a
/// minute) and on the waiting tasks. False when the launcher must stop instead (SIGTERM, another
/// launcher took over, a DDL command waits for the database).
fn wait_for_a_place(name: &str) -> bool {
    let mut warned: Option<Instant> = None;
    loop {
        match shmem::launchers::register_launcher() {
            shmem::launchers::Registration::Registered => {
                BackgroundWorker::transaction(|| {
                    read(
                        "the tasks that waited for a place",
                        catalog::install::release_tasks_waiting_for_a_place(),
                    )
                });
                log!(
                    "pg_meili_sync: database \"{name}\" has a place among the databases served now"
                );
                return true;
            }
            shmem::launchers::Registration::Refused => return false,
            shmem::launchers::Registration::TableFull => {}
        }
        if warned.is_none_or(|at| at.elapsed() >= ROUND_FAILURE_LOG_INTERVAL) {
            let (taken, usable) = shmem::launchers::databases_served();
            let detail = format!(
                "{taken} other databases run tasks, and meili_sync.max_databases is {usable}; this database's tasks start once one of them has no task left, or after meili_sync.max_databases is raised (it needs a restart)"
            );
            warn_with_hint(
                format!("pg_meili_sync: the tasks of database \"{name}\" wait: {detail}"),
                "Raise meili_sync.max_databases in postgresql.conf and restart the server, or drop the tasks of a database that no longer needs them.",
            );
            BackgroundWorker::transaction(|| {
                read(
                    "the tasks that wait for a place",
                    catalog::install::show_waiting_for_a_place(&detail),
                )
            });
            warned = Some(Instant::now());
        }
        if !BackgroundWorker::wait_latch(Some(PLACE_LOOK_INTERVAL)) {
            return false;
        }
        reload_config_if_asked();
    }
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn meili_sync_database_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let Some(database) = database_of_worker() else {
        warning!("pg_meili_sync: a database launcher was started without a database");
        return;
    };
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(database), None);
    crate::security::pin_worker_settings();
    // A database with nothing for us takes no place in the table of databases: empty databases,
    // which any role with CREATEDB can make, must not use it up.
    if !BackgroundWorker::transaction(has_work_for_a_launcher) {
        shmem::launchers::release_unneeded_entry();
        return;
    }
    let name = BackgroundWorker::transaction(catalog::current_database)
        .unwrap_or_else(|_| database.to_u32().to_string());
    match shmem::launchers::register_launcher() {
        shmem::launchers::Registration::Registered => {}
        // Another launcher of this database runs still, or a DDL command waits for the database.
        shmem::launchers::Registration::Refused => return,
        shmem::launchers::Registration::TableFull => {
            if !wait_for_a_place(&name) {
                return;
            }
        }
    }
    log!("pg_meili_sync launcher started in database \"{name}\"");

    let mut launcher = Launcher {
        running: HashMap::new(),
        backoff: HashMap::new(),
        database,
        install: None,
    };
    launcher.adopt_running_workers();
    let mut guard = WalGuard::new();
    let mut wait = Duration::ZERO;
    let mut idle = false;
    while BackgroundWorker::wait_latch(Some(wait)) {
        reload_config_if_asked();
        let round = std::panic::AssertUnwindSafe(|| launcher.round(&mut guard));
        match survive(round, Round::Failed) {
            Round::Failed => wait = gucs::naptime(),
            Round::Busy => wait = launcher.next_wake(gucs::naptime()).min(GUARD_INTERVAL),
            Round::Idle => {
                idle = true;
                break;
            }
        }
    }
    // The task workers stream on: the next launcher follows them (adopt_running_workers), and
    // at shutdown the postmaster stops them itself.
    shmem::launchers::unregister_launcher(idle);
    if idle {
        log!("pg_meili_sync launcher of database \"{name}\" exits: no task to run");
    }
}
