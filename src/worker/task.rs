//! A task worker: sets up the slot and the index, runs the snapshot copy, then streams changes.
//! Its main thread is the only one that calls Postgres; HTTP runs on the writer's threads.

use std::time::Duration;

use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::prelude::*;

use crate::batch::BatchLimits;
use crate::catalog::{self, TaskRecord};
use crate::dispatch::{Dispatcher, Progress};
use crate::encode::{Column, DocumentShape};
use crate::error::{ErrorKind, SyncError};
use crate::meili::client::{Client, MeiliError, TaskStatus};
use crate::meili::retry::Backoff;
use crate::meili::writer::{Writer, WriterConfig};
use crate::options::TaskOptions;
use crate::shmem::{self, Phase, SlotHandle};
use crate::snapshot::{self, SnapshotOutcome, SnapshotPlan};
use crate::worker::resync::{self, ResyncGate};
use crate::worker::stream::{self, ColumnRules, IndexWatch, Streamer, SwapGate};

const HTTP_TIMEOUT: Duration = Duration::from_secs(30);
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(300);
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

/// Why the worker ended without finishing: a permanent error stops the task, anything else is retried.
pub enum Stop {
    Terminated,
    Permanent(String),
}

pub fn permanent(message: impl Into<String>) -> Stop {
    Stop::Permanent(message.into())
}

/// Shows a transient failure in the status view and waits `delay` before the next attempt,
/// unless the worker is asked to stop.
pub fn retry_pause(slot: SlotHandle, error: &str, delay: Duration) -> Result<(), Stop> {
    slot.add_retry();
    slot.set_error(error);
    slot.set_phase(Phase::Retrying);
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
    slot: SlotHandle,
    what: &str,
    mut call: impl FnMut() -> Result<T, MeiliError>,
) -> Result<T, Stop> {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(30));
    let mut attempt = 0;
    loop {
        match call() {
            Ok(value) => return Ok(value),
            Err(error) if error.is_retryable() || error.is_auth() => {
                retry_pause(slot, &format!("{what}: {error}"), backoff.delay(attempt))?;
                attempt += 1;
            }
            Err(error) => return Err(permanent(format!("{what}: {error}"))),
        }
    }
}

/// Waits for a Meilisearch task and turns its failure into a permanent error.
pub fn await_meili_task(
    slot: SlotHandle,
    client: &Client,
    uid: u64,
    what: &str,
) -> Result<(), Stop> {
    let state = with_retry(slot, what, || client.wait_task(uid, SETUP_TIMEOUT))?;
    match state.status {
        TaskStatus::Succeeded => Ok(()),
        _ => Err(permanent(format!(
            "{what}: Meilisearch task {uid} {}",
            state
                .error
                .map(|error| format!("failed: {} ({})", error.message, error.code))
                .unwrap_or_else(|| "did not succeed".into())
        ))),
    }
}

/// Creates the index with the task's key attribute, or checks an existing one; applies settings.
fn prepare_index(
    slot: SlotHandle,
    client: &Client,
    task: &TaskRecord,
    options: &TaskOptions,
    key_attribute: &str,
) -> Result<PreparedIndex, Stop> {
    let uid = &task.index_uid;
    let version = with_retry(slot, "connecting to Meilisearch", || client.version())?;
    log!(
        "pg_meili_sync task {}: Meilisearch {version} at {}",
        task.id,
        task.url
    );
    let existing = with_retry(slot, "reading the index", || client.get_index(uid))?;
    let created = existing.is_none();
    match existing {
        None => {
            let task_uid = with_retry(slot, "creating the index", || client.create_index(uid, key_attribute))?;
            // Someone else may have created it meanwhile; the check below covers that case.
            let _ = await_meili_task(slot, client, task_uid, "creating the index");
            if with_retry(slot, "reading the index", || client.get_index(uid))?.is_none() {
                return Err(permanent(format!("index \"{uid}\" could not be created")));
            }
        }
        Some(index) => match index.get("primaryKey").and_then(|key| key.as_str()) {
            Some(existing) if existing != key_attribute => {
                return Err(permanent(format!(
                    "index \"{uid}\" has primary key \"{existing}\" but this task sends \"{key_attribute}\"; drop the index or use another index uid"
                )))
            }
            _ => {}
        },
    }
    if let Some(settings) = &options.settings {
        let settings = serde_json::Value::Object(settings.clone());
        let task_uid = with_retry(slot, "updating index settings", || {
            client.update_settings(uid, &settings)
        })?;
        await_meili_task(slot, client, task_uid, "updating index settings")?;
    }
    let index = with_retry(slot, "reading the index", || client.get_index(uid))?;
    Ok(PreparedIndex {
        created_at: index.and_then(|index| {
            index
                .get("createdAt")
                .and_then(|at| at.as_str())
                .map(str::to_owned)
        }),
        created,
    })
}

struct PreparedIndex {
    /// The index's `createdAt`, to notice when someone deletes or re-creates it.
    created_at: Option<String>,
    /// This worker created it, so it held no documents before the copy.
    created: bool,
}

pub fn build_plan(task: &TaskRecord, options: &TaskOptions) -> Result<SnapshotPlan, SyncError> {
    let info = catalog::relation_info(task.relid)?;
    let mut columns = Vec::new();
    let mut column_names = Vec::new();
    let mut key_types = Vec::new();
    let rules = ColumnRules::new(&task.relation, &task.primary_key, options);
    for column in info.columns.iter().filter(|column| !column.generated) {
        if rules.includes(&column.name) {
            columns.push(Column {
                name: column.name.clone(),
                kind: catalog::value_kind(column.type_oid)?,
            });
            column_names.push(column.name.clone());
        }
    }
    let mut key_columns = Vec::new();
    for name in &task.primary_key {
        let Some(position) = column_names.iter().position(|column| column == name) else {
            return Err(SyncError::new(
                ErrorKind::UndefinedColumn,
                format!(
                    "key column \"{name}\" is no longer in table {}",
                    task.relation
                ),
            ));
        };
        key_columns.push(position);
        key_types.push((name.clone(), info.type_name_of(name)));
    }
    let shape = DocumentShape::new(columns, key_columns).map_err(|error| {
        SyncError::new(
            ErrorKind::InvalidParameter,
            format!("cannot build documents of table {}: {error}", task.relation),
        )
    })?;
    let page_rows = options.batch_size.clamp(100, 10_000);
    let (first_page_query, next_page_query) =
        catalog::page_queries(&info.qualified_name, &column_names, &key_types);
    Ok(SnapshotPlan {
        first_page_query,
        next_page_query,
        page_rows,
        shape,
        limits: BatchLimits {
            max_docs: options.batch_size,
            max_bytes: options.batch_bytes,
            max_age: Duration::from_millis(options.flush_interval_ms),
        },
        table_owner: info.owner,
    })
}

/// Creates the task's slot before its copy. A slot that `max_slot_wal_keep_size` invalidated, or
/// one that is gone, lost changes: a copy starts over on a new slot; a stream stops with an error
/// asking for a new copy.
fn ensure_slot(task: &mut TaskRecord) -> Result<(), Stop> {
    let fail = |error: SyncError| permanent(error.message);
    match BackgroundWorker::transaction(|| catalog::slot_wal_status(&task.slot_name))
        .map_err(fail)?
    {
        Some(status) if status == "lost" => {
            if task.state != "snapshot" {
                return Err(permanent(format!(
                    "replication slot \"{}\" was invalidated because it retained more WAL than max_slot_wal_keep_size allows, so changes were lost; run SELECT meili_sync_snapshot({}) to copy the table again",
                    task.slot_name, task.id
                )));
            }
            BackgroundWorker::transaction(|| catalog::drop_slot(&task.slot_name)).map_err(fail)?;
            copy_over(task, "was invalidated")?;
        }
        Some(_) => return Ok(()),
        // A failover to a standby, a restore, pg_upgrade or a manual drop: the changes the slot
        // kept since Meilisearch last confirmed are gone, and a new slot would silently skip them.
        None if task.state != "snapshot" => {
            return Err(permanent(format!(
                "replication slot \"{}\" is missing (dropped, or lost in a failover, restore or upgrade), so the changes it kept since the last confirmation are lost; run SELECT meili_sync_snapshot({}) to copy the table again",
                task.slot_name, task.id
            )));
        }
        // Mid-copy, the pages already copied may have changed since: the copy starts over.
        None if task.snapshot_key.is_some() => copy_over(task, "is missing")?,
        None => {}
    }
    // Slot creation must come first in its transaction; changes after its LSN will be streamed.
    BackgroundWorker::transaction(|| catalog::create_slot(&task.slot_name)).map_err(fail)?;
    log!(
        "pg_meili_sync task {}: created replication slot \"{}\"",
        task.id,
        task.slot_name
    );
    Ok(())
}

/// The slot the copy relied on is gone: the copy starts over (on the new slot ensure_slot makes).
fn copy_over(task: &mut TaskRecord, what_happened: &str) -> Result<(), Stop> {
    BackgroundWorker::transaction(|| catalog::restart_copy(task.id))
        .map_err(|error| permanent(error.message))?;
    task.snapshot_key = None;
    task.rows_copied = 0;
    warning!(
        "pg_meili_sync task {}: replication slot \"{}\" {what_happened}; the copy starts over on a new slot",
        task.id,
        task.slot_name
    );
    Ok(())
}

fn run(task_id: i64, slot: SlotHandle) -> Result<(), Stop> {
    let task = BackgroundWorker::transaction(|| {
        catalog::set_output_formats(false)?;
        catalog::load_task(task_id)
    })
    .map_err(|error| permanent(error.message))?;
    let Some(mut task) = task else {
        return Err(Stop::Terminated);
    };
    slot.set_generation(task.generation);
    // What meili_sync_start checked may have changed since: the table, or its owner's grants.
    BackgroundWorker::transaction(|| catalog::syncable_source(task.relid, task.owner)).map_err(
        |error| match error.hint {
            Some(hint) => permanent(format!(
                "{}; {hint} Then run SELECT meili_sync_resume({task_id}).",
                error.message
            )),
            None => permanent(error.message),
        },
    )?;
    let options = TaskOptions::parse(&task.options).map_err(|error| permanent(error.message))?;
    let client = Client::new(&task.url, task.api_key.as_deref(), HTTP_TIMEOUT)
        .map_err(|error| permanent(error.to_string()))?;
    let held = match task.resync_of {
        Some(held_id) => {
            let held = BackgroundWorker::transaction(|| catalog::load_task(held_id))
                .map_err(|error| permanent(error.message))?
                .ok_or(Stop::Terminated)?;
            if resync::recover(&mut task, &held, &client, slot)? {
                return Err(Stop::Terminated);
            }
            Some(held)
        }
        None => None,
    };
    let plan = BackgroundWorker::transaction(|| build_plan(&task, &options))
        .map_err(|error| permanent(error.message))?;
    ensure_slot(&mut task)?;

    let key_attribute = plan.shape.primary_key_attribute().to_owned();
    let mut fresh_index = false;
    if let Some(held) = &held {
        if task.state == "snapshot" && task.snapshot_key.is_none() {
            resync::prepare_fresh_index(
                task.id,
                slot,
                &client,
                &held.index_uid,
                &task.index_uid,
                &key_attribute,
            )?;
            fresh_index = true;
        }
    }
    let index = prepare_index(slot, &client, &task, &options, &key_attribute)?;
    let watch = IndexWatch::new(client.clone(), &task.index_uid, index.created_at);

    let writer = start_writer(WriterConfig {
        client: client.clone(),
        index_uid: task.index_uid.clone(),
        primary_key: key_attribute.clone(),
        gzip: options.gzip,
        gzip_level: 1,
        max_inflight: options.max_inflight,
        poll_interval: Duration::from_millis(20),
        retry_base: Duration::from_millis(100),
        retry_cap: Duration::from_secs(30),
        vanished_after: VANISHED_TASK_GRACE,
    });
    let mut dispatcher = Dispatcher::new(
        writer,
        &key_attribute,
        options.max_inflight,
        options.max_payload_bytes,
    );
    let mut gate = held.as_ref().map(|held| ResyncGate::new(held.id));
    let result = copy_then_stream(
        &task,
        &plan,
        &options,
        &mut dispatcher,
        slot,
        watch,
        !index.created && !fresh_index,
        gate.as_mut().map(|gate| gate as &mut dyn SwapGate),
    );
    dispatcher.shutdown();
    match (result?, &held) {
        (Some(position), Some(held)) => resync::swap(&task, held, &client, slot, position),
        _ => Err(Stop::Terminated),
    }
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

/// Copies the table unless that is done, then streams; returns where a resync helper's stream
/// ended for its swap (None for every other end).
#[allow(clippy::too_many_arguments)]
fn copy_then_stream(
    task: &TaskRecord,
    plan: &SnapshotPlan,
    options: &TaskOptions,
    dispatcher: &mut Dispatcher,
    slot: SlotHandle,
    mut watch: IndexWatch,
    index_had_documents: bool,
    gate: Option<&mut dyn SwapGate>,
) -> Result<Option<u64>, Stop> {
    if task.state == "snapshot" {
        match snapshot::run(task, plan, dispatcher, slot)
            .map_err(|error| permanent(error.message))?
        {
            SnapshotOutcome::Done { rows } => {
                if index_had_documents {
                    prune_index(task, slot)?;
                }
                BackgroundWorker::transaction(|| catalog::finish_snapshot(task.id, rows))
                    .map_err(|error| permanent(error.message))?;
                log!(
                    "pg_meili_sync task {}: snapshot of {} finished, {rows} rows",
                    task.id,
                    task.relation
                );
            }
            SnapshotOutcome::Interrupted => return Err(Stop::Terminated),
            SnapshotOutcome::Failed(message) => return Err(permanent(message)),
        }
    }
    let rules = ColumnRules::new(&task.relation, &task.primary_key, options);
    let mut streamer = Streamer::new(task.id, slot, dispatcher, rules, plan.limits, options);
    stream::run(&mut streamer, task, &mut watch, gate).map_err(permanent)
}

/// Deletes the documents of rows that no longer exist (see `verify::prune`), retrying while
/// Meilisearch is unreachable.
fn prune_index(task: &TaskRecord, slot: SlotHandle) -> Result<(), Stop> {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(30));
    let mut attempt = 0;
    loop {
        match BackgroundWorker::transaction(|| crate::verify::prune(task.clone())) {
            Ok(deleted) => {
                if deleted > 0 {
                    log!(
                        "pg_meili_sync task {}: deleted {deleted} documents whose rows no longer exist",
                        task.id
                    );
                }
                return Ok(());
            }
            Err(error) if error.kind == ErrorKind::Meilisearch => {
                retry_pause(slot, &error.message, backoff.delay(attempt))?;
                attempt += 1;
            }
            Err(error) => return Err(permanent(error.message)),
        }
    }
}

/// Acts on what the dispatcher reported: stores dead letters (before any checkpoint that covers
/// them is saved or confirmed) and shows retries in the status view.
pub fn report_progress(
    task_id: i64,
    slot: SlotHandle,
    dispatcher: &mut Dispatcher,
    progress: &Progress,
    phase: Phase,
) -> Result<(), SyncError> {
    for error in &progress.retries {
        slot.add_retry();
        slot.set_error(error);
        slot.set_phase(Phase::Retrying);
    }
    if progress.checkpoint.is_some() {
        slot.confirmed_now();
        if progress.retries.is_empty() {
            slot.set_phase(phase);
        }
    }
    let dead_letters = dispatcher.take_dead_letters();
    if !dead_letters.is_empty() {
        BackgroundWorker::transaction(|| {
            catalog::insert_dead_letters(task_id, &dead_letters, phase == Phase::Streaming)
        })?;
        slot.add_dead_letters(dead_letters.len());
        let message = format!(
            "{} document(s) refused by Meilisearch went to meili_sync_dead_letters: {}",
            dead_letters.len(),
            dead_letters[0].message
        );
        warning!("pg_meili_sync task {task_id}: {message}");
        slot.set_error(&message);
    }
    Ok(())
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn meili_sync_task_main(arg: pg_sys::Datum) {
    let task_id = arg.value() as i64;
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    BackgroundWorker::connect_worker_to_spi(Some(BackgroundWorker::get_extra()), None);
    crate::security::pin_search_path();
    // SAFETY: reading this process's own pid.
    let pid = unsafe { pg_sys::MyProcPid };
    let Some(index) = shmem::attach(task_id, pid) else {
        warning!(
            "pg_meili_sync: no free task slot for task {task_id} (meili_sync.max_tasks is {})",
            crate::gucs::max_tasks()
        );
        return;
    };
    let slot = SlotHandle::new(index);
    let outcome = PgTryBuilder::new(|| run(task_id, slot))
        .catch_others(|error| {
            if should_stop() {
                // Told to stop inside a transaction replay, where an ERROR is the only way out:
                // a stop, not a failure of the task.
                log!("pg_meili_sync task {task_id}: stopped inside a transaction replay; the slot has not moved past it, so the next worker decodes it again");
                slot.detach(Phase::Exited);
                error.rethrow()
            }
            let message = crate::error::caught_message(&error);
            // An ERROR escaping a background worker's main function ends the process without
            // reaching the server log: say it here, before it does.
            warning!("pg_meili_sync task {task_id}: {message}");
            slot.set_error(&message);
            slot.detach(Phase::Error);
            error.rethrow()
        })
        .execute();
    match outcome {
        Ok(()) | Err(Stop::Terminated) => slot.detach(Phase::Exited),
        Err(Stop::Permanent(message)) => {
            warning!("pg_meili_sync task {task_id} stopped: {message}");
            slot.set_error(&message);
            slot.detach(Phase::Error);
            let _ = BackgroundWorker::transaction(|| catalog::set_error_state(task_id, &message));
        }
    }
}
