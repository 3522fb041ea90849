//! A task worker: sets up the slot and the index, runs the snapshot copy, then streams changes.
//! Its main thread is the only one that calls Postgres; HTTP runs on the writer's threads.
//!
//! The order of setup: `ensure_slot` creates the slot first, in its own transaction, so that
//! streaming later starts exactly at the slot's creation point; then the index and its settings,
//! then the plan, the copy and the stream. A streaming task whose slot is missing or `lost` never
//! starts afresh: it stops in state `error` and asks for `meili_sync_snapshot`; a copy in progress
//! starts over on a new slot (`copy_over`). The publication is checked at each start
//! (`check_own_publication`). A shared task's worker waits for its position, copies, and exits (the
//! shared decoder streams it); a moving task's worker streams from its own slot until it hands over
//! (`worker::handover`).

use std::time::Duration;

use pgrx::bgworkers::BackgroundWorker;
use pgrx::prelude::*;

use pg_meili_sync_core::meili::client::Client;
use pg_meili_sync_core::meili::client::HTTP_TIMEOUT;
use pg_meili_sync_core::pipeline::dispatch::Dispatcher;
use pg_meili_sync_core::task::failure::{Failure, FailureKind};
use pg_meili_sync_core::task::options::TaskOptions;
use pg_meili_sync_core::task::pg_catalog::SlotStatus;

use crate::catalog::{
    self,
    tasks::{TaskRecord, TaskState},
};
use crate::error::SyncError;
use crate::plan::{build_plan, recheck_source, ColumnRules, SnapshotPlan, ViewPlan};
use crate::shmem::{
    self,
    live::{LiveStatus, Phase, WorkerId},
};
use crate::worker::control::{
    await_meili_task, fail, in_transaction, open_dispatcher, with_retry, worker_main, Stop,
};
use crate::worker::drive::{drive, IndexWatch, SwapGate};
use crate::worker::handover::{self, MoveGate};
use crate::worker::partitions::{prune_index, PartitionWatch};
use crate::worker::rebalance;
use crate::worker::render::ViewStream;
use crate::worker::resync::{self, ResyncGate};
use crate::worker::snapshot::{self, SnapshotOutcome};
use crate::worker::stream::Streamer;

/// Creates the index with the task's key attribute, or checks an existing one; applies settings.
fn prepare_index(
    live: LiveStatus,
    client: &Client,
    task: &TaskRecord,
    options: &TaskOptions,
    key_attribute: &str,
) -> Result<PreparedIndex, Stop> {
    let uid = &task.index_uid;
    let version = with_retry(live, "connecting to Meilisearch", || client.version())?;
    log!(
        "pg_meili_sync task {}: Meilisearch {version} at {}",
        task.id,
        task.url
    );
    let existing = with_retry(live, "reading the index", || client.get_index(uid))?;
    let created = existing.is_none();
    match existing {
        None => {
            let task_uid = with_retry(live, "creating the index", || client.create_index(uid, key_attribute))?;
            // Someone else may have created it meanwhile; the check below covers that case.
            let _ = await_meili_task(live, client, task_uid, "creating the index");
            if with_retry(live, "reading the index", || client.get_index(uid))?.is_none() {
                return Err(fail(
                    FailureKind::Meilisearch,
                    format!("index \"{uid}\" could not be created"),
                ));
            }
        }
        Some(index) => match index.primary_key.as_deref() {
            Some(existing) if existing != key_attribute => {
                return Err(Failure::new(
                    FailureKind::Index,
                    format!(
                        "index \"{uid}\" has primary key \"{existing}\" but this task sends \"{key_attribute}\""
                    ),
                )
                .hint("drop the index, or drop the task and start it with another index uid")
                .into())
            }
            _ => {}
        },
    }
    if let Some(settings) = &options.settings {
        let settings = serde_json::Value::Object(settings.clone());
        let task_uid = with_retry(live, "updating index settings", || {
            client.update_settings(uid, &settings)
        })?;
        await_meili_task(live, client, task_uid, "updating index settings")?;
    }
    if options.geo.is_some() {
        // Geo filters and sorting need the fields filterable (sortable); added to what the
        // index has, before the copy, so that Meilisearch checks every document as it arrives.
        let current = with_retry(live, "reading index settings", || client.get_settings(uid))?;
        if let Some(missing) = pg_meili_sync_core::document::geo::missing_geo_settings(&current) {
            let task_uid = with_retry(live, "updating index settings", || {
                client.update_settings(uid, &missing)
            })?;
            await_meili_task(live, client, task_uid, "updating index settings")?;
        }
    }
    if !options.vectors.is_empty() {
        prepare_embedders(live, client, task, options)?;
    }
    let index = with_retry(live, "reading the index", || client.get_index(uid))?;
    Ok(PreparedIndex {
        created_at: index.and_then(|index| index.created_at),
        created,
    })
}

/// Sets up each embedder of the `vectors` option as `userProvided` with its column's dimensions,
/// or checks the one the index has: an embedder of that name with another source or other
/// dimensions would refuse every document, so the task stops, saying which.
fn prepare_embedders(
    live: LiveStatus,
    client: &Client,
    task: &TaskRecord,
    options: &TaskOptions,
) -> Result<(), Stop> {
    let uid = &task.index_uid;
    let info = in_transaction(live, "reading the table's columns", || {
        catalog::source::relation_info(task.relid)
    })?;
    let mut wanted = Vec::new();
    for (embedder, column) in &options.vectors {
        let declared = info.type_name_of(column);
        let dimensions = pg_meili_sync_core::document::vectors::declared_dimensions(&declared).ok_or_else(|| {
            fail(
                FailureKind::Source,
                format!(
                    "column \"{column}\" of {} (embedder \"{embedder}\") has type {declared}, without dimensions",
                    info.qualified_name
                ),
            )
        })?;
        wanted.push((embedder.clone(), dimensions));
    }
    let current = with_retry(live, "reading index settings", || client.get_settings(uid))?;
    let missing = pg_meili_sync_core::document::vectors::missing_embedders(&current, &wanted).map_err(|problem| {
        Stop::from(
            Failure::new(
                FailureKind::Index,
                format!("index \"{uid}\": {problem}"),
            )
            .hint("change or delete that embedder in the index settings, or drop the task and start it with another embedder name"),
        )
    })?;
    if let Some(missing) = missing {
        let task_uid = with_retry(live, "setting up embedders", || {
            client.update_settings(uid, &missing)
        })?;
        await_meili_task(live, client, task_uid, "setting up embedders")?;
    }
    Ok(())
}

struct PreparedIndex {
    /// The index's `createdAt`, to notice when someone deletes or re-creates it.
    created_at: Option<String>,
    /// This worker created it, so it held no documents before the copy.
    created: bool,
}

/// Creates the task's slot before its copy. A slot that `max_slot_wal_keep_size` invalidated, or
/// one that is gone, lost changes: a copy starts over on a new slot; a stream stops with an error
/// asking for a new copy.
fn ensure_slot(task: &mut TaskRecord, live: LiveStatus) -> Result<(), Stop> {
    match in_transaction(live, "reading the replication slot", || {
        catalog::replication::slot_wal_status(&task.slot_name)
    })? {
        Some(SlotStatus::Lost) => {
            if task.state != TaskState::Snapshot {
                return Err(fail(
                    FailureKind::Slot,
                    format!(
                        "replication slot \"{}\" was invalidated because it retained more WAL than max_slot_wal_keep_size allows, so changes were lost",
                        task.slot_name
                    ),
                ));
            }
            in_transaction(live, "dropping the invalidated slot", || {
                catalog::replication::drop_slot(&task.slot_name)
            })?;
            copy_over(task, live, "was invalidated")?;
        }
        Some(_) => return Ok(()),
        // A failover to a standby, a restore, pg_upgrade or a manual drop: the changes the slot
        // kept since Meilisearch last confirmed are gone, and a new slot would silently skip them.
        None if task.state != TaskState::Snapshot => {
            return Err(fail(
                FailureKind::Slot,
                format!(
                    "replication slot \"{}\" is missing (dropped, or lost in a failover, restore or upgrade), so the changes it kept since the last confirmation are lost",
                    task.slot_name
                ),
            ));
        }
        // Mid-copy, the pages already copied may have changed since: the copy starts over.
        None if task.snapshot_key.is_some() => copy_over(task, live, "is missing")?,
        None => {}
    }
    // Slot creation must come first in its transaction; changes after its LSN will be streamed.
    in_transaction(live, "creating the replication slot", || {
        catalog::replication::create_slot(&task.slot_name)
    })?;
    log!(
        "pg_meili_sync task {}: created replication slot \"{}\"",
        task.id,
        task.slot_name
    );
    Ok(())
}

/// A view task's publication must hold every table its view reads now. One that lacks a table
/// (the view was replaced) is brought up to date. Before a copy, the copy then holds what the
/// publication missed; a task past its copy is out of shape from then on, so that its documents
/// are brought in line as after any change of shape (`catalog::tasks::note_unfollowed_changes`).
fn follow_every_table(task: &TaskRecord, view: &ViewPlan, live: LiveStatus) -> Result<(), Stop> {
    let published = in_transaction(live, "reading the task's publication", || {
        catalog::shared::published_tables(&task.publication_name)
    })?;
    let missing: Vec<String> = view
        .tables
        .iter()
        .filter(|(relid, _)| !published.contains(relid))
        .map(|(_, routes)| routes.table.clone())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let copied = task.state != TaskState::Snapshot;
    in_transaction(live, "publishing the tables of the view", || {
        catalog::shared::set_published_tables(&task.publication_name, &view.published_tables())?;
        if copied {
            catalog::tasks::note_unfollowed_changes(task.id)?;
        }
        Ok(())
    })?;
    log!(
        "pg_meili_sync task {}: its publication now holds {}, which view {} reads",
        task.id,
        missing.join(", "),
        view.view
    );
    Ok(())
}

/// The task's own publication must be as this install left it before its slot decodes with it
/// (`catalog::replication::check_publication`). One that someone else dropped, made again or
/// changed is mended; what the slot decoded with it may have gone out wrongly or not at all, so the
/// slot is dropped and the task copies its table again, on a new worker (the generation changed).
fn check_own_publication(
    task: &TaskRecord,
    view: Option<&ViewPlan>,
    live: LiveStatus,
) -> Result<(), Stop> {
    let (create_with, must_hold) = match view {
        // A replaced view's new tables are `follow_every_table`'s.
        Some(view) => (
            view.tables.iter().map(|(relid, _)| *relid).collect(),
            Vec::new(),
        ),
        None => (vec![task.relid], vec![task.relid]),
    };
    let checked = in_transaction(live, "checking the task's publication", || {
        // A publication made again for a task dropped meanwhile would be left behind.
        if !catalog::tasks::hold_task_at(task.id, task.generation)? {
            return Ok(None);
        }
        let slot_exists = catalog::replication::slot_wal_status(&task.slot_name)?.is_some();
        let check = catalog::replication::check_publication(
            &task.publication_name,
            &create_with,
            &must_hold,
            true,
        )?;
        Ok(Some((check, slot_exists)))
    })?;
    let Some((check, slot_exists)) = checked else {
        return Err(Stop::Terminated);
    };
    let what = match check {
        catalog::replication::PublicationCheck::Mended(what) => what,
        // Made while its slot exists: dropped before this install recorded it.
        catalog::replication::PublicationCheck::Made if slot_exists => "was missing".to_owned(),
        _ => return Ok(()),
    };
    let message = format!(
        "publication \"{}\" {what}, so the changes decoded with it may have gone to Meilisearch wrongly or not at all; it was made again, with a new replication slot, and the task copies its table again: every row is sent again, and the documents of rows that are gone are deleted",
        task.publication_name
    );
    in_transaction(live, "copying the table again", || {
        catalog::tasks::copy_again(task.id, &task.slot_name, &message)
    })?;
    // The next worker keeps this entry's error until it has one of its own.
    live.set_error(&message);
    crate::worker::shared::warn_publication_mended(&task.publication_name, &what, &[task.id]);
    Err(Stop::Terminated)
}

/// A task of the shared decoding pass copies only once the shared decoder has given it its
/// position (every transaction that commits after it is streamed to the task).
fn await_position(task: &mut TaskRecord, live: LiveStatus) -> Result<(), Stop> {
    live.set_phase(Phase::Starting);
    while task.stream_position.is_none() {
        if !BackgroundWorker::wait_latch(Some(Duration::from_millis(100))) {
            return Err(Stop::Terminated);
        }
        let reloaded = in_transaction(live, "reading the task", || {
            catalog::tasks::load_task(task.id)
        })?;
        let Some(reloaded) = reloaded else {
            return Err(Stop::Terminated);
        };
        task.stream_position = reloaded.stream_position;
    }
    Ok(())
}

/// The slot the copy relied on is gone: the copy starts over (on the new slot ensure_slot makes).
fn copy_over(task: &mut TaskRecord, live: LiveStatus, what_happened: &str) -> Result<(), Stop> {
    in_transaction(live, "starting the copy over", || {
        catalog::tasks::restart_copy(task.id)
    })?;
    task.snapshot_key = None;
    task.rows_copied = 0;
    warning!(
        "pg_meili_sync task {}: replication slot \"{}\" {what_happened}; the copy starts over on a new slot",
        task.id,
        task.slot_name
    );
    Ok(())
}

fn run(task_id: i64, live: LiveStatus) -> Result<(), Stop> {
    let task = in_transaction(live, "reading the task", || {
        catalog::source::set_output_formats(false)?;
        catalog::tasks::load_task(task_id)
    })?;
    let Some(mut task) = task else {
        return Err(Stop::Terminated);
    };
    live.set_generation(task.generation);
    let options = TaskOptions::parse(&task.options).map_err(SyncError::from)?;
    // What meili_sync_start checked may have changed since: the table or view, what the view
    // reads, or the owner's grants.
    let view = in_transaction(live, "checking the table", || {
        recheck_source(&task, &options)
    })?;
    // A task of the shared pass (not moving) has no publication of its own: the shared
    // decoder publishes what its view reads.
    if !task.shared || task.moving {
        check_own_publication(&task, view.as_ref(), live)?;
    }
    if let (Some(view), false) = (&view, task.shared && !task.moving) {
        follow_every_table(&task, view, live)?;
    }
    let client = Client::new(&task.url, task.api_key.as_deref(), HTTP_TIMEOUT)
        .map_err(|error| fail(FailureKind::Source, error.to_string()))?;
    let held = match task.resync_of {
        Some(held_id) => {
            let held = in_transaction(live, "reading the task to rebuild", || {
                catalog::tasks::load_task(held_id)
            })?
            .ok_or(Stop::Terminated)?;
            let swap = resync::Swap {
                helper: &task,
                held: &held,
                client: &client,
                live,
            };
            if swap.recover()? {
                return Err(Stop::Terminated);
            }
            // Not swapped: it streams on, and records its next swap afresh.
            task.resync_phase = None;
            Some(held)
        }
        None => None,
    };
    let plan = in_transaction(live, "planning the documents", || {
        build_plan(&task, &options)
    })?;
    if task.shared && !task.moving {
        await_position(&mut task, live)?;
    } else {
        ensure_slot(&mut task, live)?;
    }

    let key_attribute = plan.shape.primary_key_attribute().to_owned();
    let mut fresh_index = false;
    if let Some(held) = &held {
        if task.state == TaskState::Snapshot && task.snapshot_key.is_none() {
            resync::prepare_fresh_index(
                task.id,
                live,
                &client,
                &held.index_uid,
                &task.index_uid,
                &key_attribute,
            )?;
            fresh_index = true;
        }
    }
    let index = prepare_index(live, &client, &task, &options, &key_attribute)?;
    // A resync helper writes to its shard's server, whose network the shard's own worker sets.
    if task.shard.is_some() && task.resync_of.is_none() {
        let shards = in_transaction(live, "reading the task's shards", || {
            catalog::tasks::shard_servers(task.replica_of.unwrap_or(task.id))
        })?;
        rebalance::set_network(live, &client, &task, &shards)?;
    }
    let watch = IndexWatch::new(&task, index.created_at)?;

    let mut dispatcher = open_dispatcher(&client, &task, &options, &key_attribute);
    // A stream ends at a position for a resync's swap, or for the hand-over of a moving task.
    let mut resync_gate = held.as_ref().map(|held| ResyncGate(held.id));
    let mut move_gate = task.moving.then_some(MoveGate(task.id));
    let gate = match (&mut resync_gate, &mut move_gate) {
        (Some(gate), _) => Some(gate as &mut dyn SwapGate),
        (None, Some(gate)) => Some(gate as &mut dyn SwapGate),
        (None, None) => None,
    };
    let result = copy_then_stream(
        &task,
        &plan,
        view,
        &options,
        &mut dispatcher,
        live,
        watch,
        !index.created && !fresh_index,
        gate,
    );
    dispatcher.shutdown();
    match (result?, &held) {
        (Some(position), Some(held)) => resync::Swap {
            helper: &task,
            held,
            client: &client,
            live,
        }
        .run(position),
        (Some(position), None) if task.moving => handover::hand_over(&task, live, position),
        _ => Err(Stop::Terminated),
    }
}

/// Copies the table unless that is done, then streams; returns where a resync helper's stream
/// ended for its swap (None for every other end).
#[allow(clippy::too_many_arguments)]
fn copy_then_stream(
    task: &TaskRecord,
    plan: &SnapshotPlan,
    view: Option<ViewPlan>,
    options: &TaskOptions,
    dispatcher: &mut Dispatcher,
    live: LiveStatus,
    mut watch: IndexWatch,
    index_had_documents: bool,
    gate: Option<&mut dyn SwapGate>,
) -> Result<Option<u64>, Stop> {
    if task.state == TaskState::Snapshot {
        match snapshot::run(task, plan, dispatcher, live)? {
            SnapshotOutcome::Done { rows } => {
                if index_had_documents {
                    prune_index(task, live)?;
                }
                in_transaction(live, "finishing the copy", || {
                    catalog::tasks::finish_snapshot(task.id, rows)
                })?;
                log!(
                    "pg_meili_sync task {}: snapshot of {} finished, {rows} rows",
                    task.id,
                    task.relation
                );
            }
            SnapshotOutcome::Interrupted => return Err(Stop::Terminated),
            SnapshotOutcome::Failed(message) => {
                return Err(fail(FailureKind::Meilisearch, message))
            }
        }
    }
    if task.shared && !task.moving {
        // The shared decoder streams it from here on.
        shmem::launchers::wake_launcher();
        return Err(Stop::Terminated);
    }
    if let Some(view) = view {
        let mut stream = ViewStream::new(task, live, dispatcher, view, plan.limits, options)
            .with_partitions(PartitionWatch::of_plan(plan, task, options, true));
        return drive(&mut stream, task, &mut watch, gate);
    }
    let rules = ColumnRules::new(&task.relation, &task.primary_key, options);
    let mut streamer = Streamer::new(task, live, dispatcher, rules, plan.limits, options)
        .with_partitions(PartitionWatch::of_plan(plan, task, options, false));
    drive(&mut streamer, task, &mut watch, gate)
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn meili_sync_task_main(arg: pg_sys::Datum) {
    let task_id = arg.value() as i64;
    worker_main(WorkerId::Task(task_id), |live, _| run(task_id, live));
}
