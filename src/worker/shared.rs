//! The shared decoder: one worker per database that decodes the shared slot once for every task
//! with `"decoding": "shared"`, and hands each change to the tasks of its table (`route`). Each
//! task keeps its own pipeline (mapper, dispatcher, writer threads) and its own position in
//! `meili_sync.tasks.stream_position`; the slot is confirmed to the lowest position stored.
//!
//! A task joins when it starts streaming (after its copy, or resumed): the decoder then frees its
//! decoding context and reads the slot again from its confirmed position, which never passes the
//! joining task's; the tasks already attached skip what they have. A task that stops streaming
//! (paused, dropped, failed, altered) leaves; its position holds the slot back until it returns or
//! is dropped. Task workers still do the copies: a shared task gets its position from the decoder
//! (the slot's confirmed position, before its copy starts) and hands over when the copy is done.
//!
//! Stalls: while a task's queue is full, `Streamer::send_ready` blocks the shared read. A task whose
//! server answered nothing for `stream::UNANSWERED_LIMIT`, or finished no batch for `STALL_LIMIT`,
//! leaves the pass (`check_stalls`, which logs why) and joins again, reading from its own position,
//! once what it sent is confirmed. A task never leaves sooner while its server works: a transaction
//! larger than its queue gets through only while the reader waits. While the tasks' held bytes
//! exceed `meili_sync.decoder_memory`, every dispatcher is squeezed (`share_memory`): it has room
//! only with nothing unresolved.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use pgrx::prelude::*;

use pg_meili_sync_core::meili::client::Client;
use pg_meili_sync_core::meili::client::HTTP_TIMEOUT;
use pg_meili_sync_core::task::failure::{Advice, Failure, FailureKind};
use pg_meili_sync_core::task::options::TaskOptions;
use pg_meili_sync_core::task::pg_catalog::SlotStatus;
use pg_meili_sync_core::wal::route::Router;

use crate::catalog::{self, shared::SharedTask, tasks::TaskRecord};
use crate::decode::session::{DecodingSession, MessageSink};
use crate::error::SyncError;
use crate::plan::{build_plan, recheck_source, ColumnRules, ViewPlan};
use crate::shmem::{
    self,
    live::{LiveStatus, Phase, WorkerId},
};
use crate::worker::control::{
    fail, in_transaction, in_user_transaction, open_dispatcher, worker_main, worker_transaction,
    Stop,
};
use crate::worker::drive::{
    drive_pass, log_rewind, log_state_change, parse_in_read, IndexWatch, Nap, Pass, PassStream,
    Turn,
};
use crate::worker::partitions::PartitionWatch;
use crate::worker::render::{follow_new_tables, ViewStream};
use crate::worker::stream::Streamer;

/// How often the decoder looks at the catalog for tasks that join or leave.
const REFRESH_INTERVAL: Duration = Duration::from_millis(500);

/// At most one LOG line this often about the decoder's memory budget being spent.
const SQUEEZE_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// How often positions are stored (and the slot confirmed) while changes flow.
const STORE_INTERVAL: Duration = Duration::from_secs(1);

/// How often an idle task's status is published while other tasks keep the decoder busy.
const QUIET_PUBLISH_INTERVAL: Duration = Duration::from_secs(1);

/// How long one task whose Meilisearch answers but confirms nothing may hold up the shared reader
/// before it leaves the stream. Long enough for a real Meilisearch's large auto-batch (all its
/// tasks finish together, after seconds), and for a transaction larger than the task's queue,
/// which gets through only while the reader waits for it (were the task to leave, it would read
/// that transaction again from its start, and again).
const STALL_LIMIT: Duration = Duration::from_secs(15);

/// One task's part of the shared stream.
struct Pipeline {
    task: TaskRecord,
    live: LiveStatus,
    /// A table task's `Streamer` or a view task's `ViewStream`.
    stream: Box<dyn PassStream>,
    /// The tables whose changes the task gets: its table, or the tables its view reads.
    relations: Vec<u32>,
    watch: IndexWatch,
    /// The task's index holds every transaction that committed before this position (also
    /// moved by reading past other tables' changes while the task has nothing unconfirmed).
    position: u64,
    /// The newest position a commit of the task's own moved it to, and the one stored. Only
    /// those are stored while the task streams: storing the positions that reading moved would
    /// write WAL that moves them again.
    checkpointed: u64,
    stored: u64,
    /// When the status view was last given this task's progress, and the position it was given.
    published: Instant,
    published_position: u64,
    /// The stream was quiet when last published: a stream that has just become quiet (its last
    /// batch confirmed) is published at once, then at most once a `QUIET_PUBLISH_INTERVAL`.
    published_quiet: bool,
    /// Receives changes. A task whose Meilisearch stalls leaves the stream (its pipeline stays to
    /// finish what it sent) and joins again once its dispatcher is idle.
    attached: bool,
}

impl Pipeline {
    fn leave(self, phase: Phase) {
        // Dropping the stream drops its dispatcher, whose writer threads stop and are joined.
        drop(self.stream);
        self.live.detach(phase);
    }
}

struct SharedDecoder {
    live: LiveStatus,
    pid: i32,
    /// The shared slot's and publication's name.
    name: String,
    router: Router,
    pipelines: HashMap<i64, Pipeline>,
    /// Tables the shared publication holds, as last made.
    published: Vec<pg_sys::Oid>,
    last_refresh: Option<Instant>,
    /// `shmem::commits::tasks_changed` at the last refresh: a task resumed or started joins at
    /// once.
    tasks_seen: Option<u64>,
    last_store: Instant,
    /// See `load_lowest_elsewhere`; read again whenever tasks join, leave or get a position.
    lowest_elsewhere: Option<u64>,
    /// Over `meili_sync.decoder_memory` at the last look (see `share_memory`).
    squeezed: bool,
    squeeze_logged: Option<Instant>,
    /// The tables each shared view task's view reads, with the task's generation they were
    /// planned for.
    view_tables: HashMap<i64, (i32, Vec<pg_sys::Oid>)>,
    /// View tasks (and generations) whose view could not be planned, to warn once.
    unplanned: HashSet<(i64, i32)>,
    /// A message of the last read that could not be parsed: it stops the decoder.
    parse_failure: Option<Failure>,
}

/// The decoder is the read's sink: it hands each message to the router, and the routed ones to
/// the tasks' streams.
impl MessageSink for SharedDecoder {
    fn message(&mut self, lsn: u64, data: &[u8]) {
        // Parsed once here: the router and every task it reaches share the parsed message.
        let Some(message) = parse_in_read(data, &mut self.parse_failure) else {
            return;
        };
        let pipelines = &mut self.pipelines;
        self.router.route(lsn, &message, &mut |task, lsn, message| {
            if let Some(pipeline) = pipelines.get_mut(&task) {
                pipeline.stream.message(lsn, message);
            }
        });
    }
}

impl SharedDecoder {
    /// Publishes exactly the shared tasks' tables, gives new tasks their position, and says
    /// which streaming tasks should join (and makes those that should not leave).
    /// The shared tasks. After a DROP and CREATE EXTENSION the catalog is another install's,
    /// whose task ids start again at 1: this decoder exits rather than serve them from its slot.
    fn read_tasks(&self) -> Result<Vec<SharedTask>, Stop> {
        let tasks = in_transaction(self.live, "reading the shared tasks", || {
            if catalog::shared::shared_name()? != self.name {
                return Ok(None);
            }
            // A task whose table was dropped fails alone; the others are published on.
            for task_id in catalog::tasks::fail_tasks_of_dropped_sources()? {
                warning!("pg_meili_sync task {task_id} stopped: its table or view was dropped");
            }
            catalog::shared::shared_tasks().map(Some)
        })?;
        tasks.ok_or_else(|| {
            log!(
                "pg_meili_sync: the extension was created again; the shared decoder of \"{}\" exits",
                self.name
            );
            Stop::Terminated
        })
    }

    fn refresh(&mut self, session: &DecodingSession) -> Result<Vec<SharedTask>, Stop> {
        self.last_refresh = Some(Instant::now());
        let tasks = self.read_tasks()?;
        // Someone else dropped or changed the publication while the slot decoded with it: the
        // decoder starts again, and mends it before it reads (`run`).
        let check = in_transaction(self.live, "checking the shared publication", || {
            catalog::replication::check_publication(&self.name, &[], &self.published, false)
        })?;
        if let catalog::replication::PublicationCheck::Mended(what) = check {
            warning!(
                "pg_meili_sync: the shared publication \"{}\" {what}; the shared decoder starts again to mend it",
                self.name
            );
            return Err(Stop::Terminated);
        }
        let relids = self.tables_to_publish(&tasks)?;
        if relids != self.published {
            in_transaction(self.live, "publishing the shared tables", || {
                catalog::shared::publish_exactly(&self.name, &relids)
            })?;
            self.published = relids;
        }
        if tasks.iter().any(|task| task.position.is_none()) {
            let confirmed = session.confirmed();
            for task_id in in_transaction(self.live, "giving new tasks their position", || {
                catalog::shared::assign_positions(confirmed)
            })? {
                log!("pg_meili_sync task {task_id}: has its position in the shared decoding pass");
            }
            self.stop_tasks_without_changes()?;
        }
        let leaving: Vec<i64> = self
            .pipelines
            .iter()
            .filter(|(id, pipeline)| {
                !tasks.iter().any(|task| {
                    task.id == **id && task.streaming && task.generation == pipeline.task.generation
                })
            })
            .map(|(id, _)| *id)
            .collect();
        for task_id in leaving {
            if let Some(pipeline) = self.remove(task_id) {
                log!("pg_meili_sync task {task_id}: left the shared decoding pass");
                pipeline.leave(Phase::Exited);
            }
        }
        self.load_lowest_elsewhere()?;
        let pid = self.pid;
        Ok(tasks
            .into_iter()
            .filter(|task| {
                task.streaming && task.position.is_some() && !self.pipelines.contains_key(&task.id)
            })
            // The task worker that did the copy may still be exiting: join once it is gone.
            .filter(|task| {
                shmem::live::attached_pid(task.id)
                    .is_none_or(|other| other == pid || !shmem::backend_alive(other))
            })
            .collect())
    }

    /// The tables the shared publication must hold for `tasks`, sorted.
    fn tables_to_publish(&mut self, tasks: &[SharedTask]) -> Result<Vec<pg_sys::Oid>, Stop> {
        self.view_tables
            .retain(|task_id, _| tasks.iter().any(|task| task.id == *task_id));
        let mut relids = Vec::new();
        for task in tasks {
            relids.extend(self.tables_of(task)?);
        }
        relids.sort_unstable_by_key(|relid| relid.to_u32());
        relids.dedup();
        Ok(relids)
    }

    /// The tables whose changes `task` needs published: its table, or the tables its view reads
    /// (planned once per generation of the task). A view that cannot be planned gets none; its
    /// task stops with that error where it copies or streams.
    fn tables_of(&mut self, task: &SharedTask) -> Result<Vec<pg_sys::Oid>, Stop> {
        if !task.is_view {
            return Ok(vec![task.relid]);
        }
        if let Some((generation, tables)) = self.view_tables.get(&task.id) {
            if *generation == task.generation {
                return Ok(tables.clone());
            }
        }
        let record = in_transaction(self.live, "reading the task", || {
            catalog::tasks::load_task(task.id)
        })?;
        let Some(record) = record else {
            return Ok(Vec::new());
        };
        let planned = TaskOptions::parse(&record.options)
            .map_err(|error| Stop::from(SyncError::from(error)))
            .and_then(|options| recheck(self.live, &record, &options));
        match planned {
            Ok(view) => {
                let tables: Vec<pg_sys::Oid> = view
                    .iter()
                    .flat_map(|view| view.tables.iter().map(|(relid, _)| *relid))
                    .collect();
                self.view_tables
                    .insert(task.id, (task.generation, tables.clone()));
                Ok(tables)
            }
            Err(Stop::Terminated) => Err(Stop::Terminated),
            Err(Stop::Failed(failure)) => {
                if self.unplanned.insert((task.id, task.generation)) {
                    warning!(
                        "pg_meili_sync task {}: the tables its view reads are not published: {}",
                        task.id,
                        failure.last_error(Some(task.id))
                    );
                }
                Ok(Vec::new())
            }
        }
    }

    /// A task whose copy is done but that has neither a position here nor a slot of its own lost
    /// the changes since its last confirmation (its own slot went before it moved here, or the
    /// shared slot was replaced): it stops with an error asking for a new copy, also after a
    /// resume (joining from the slot's position now would skip them silently).
    fn stop_tasks_without_changes(&self) -> Result<(), Stop> {
        let lost = in_transaction(self.live, "reading the tasks without a position", || {
            catalog::shared::tasks_without_changes()
        })?;
        for task_id in lost {
            let message = format!(
                "the changes of this task since its last confirmation are lost: the replication slot that kept them was dropped, invalidated, or lost in a failover, restore or upgrade; run SELECT meili_sync_snapshot({task_id}) to copy the table again"
            );
            warning!("pg_meili_sync task {task_id} stopped: {message}");
            in_transaction(self.live, "stopping a task whose changes were lost", || {
                catalog::tasks::set_error_state(task_id, &message)
            })?;
        }
        Ok(())
    }

    /// Builds the pipeline of a task that joins. A failure that is the task's own stops that
    /// task only.
    fn open_pipeline(&mut self, joining: &SharedTask) -> Result<Option<Pipeline>, Stop> {
        let Some(task) = in_transaction(self.live, "reading the task", || {
            catalog::tasks::load_task(joining.id)
        })?
        else {
            return Ok(None);
        };
        let index = match shmem::live::attach(WorkerId::Task(task.id), self.pid) {
            Ok(index) => index,
            Err(shmem::live::NoEntry::Full) => {
                warning!(
                    "pg_meili_sync: no free shared-memory entry for task {} (meili_sync.max_tasks is {})",
                    task.id,
                    crate::gucs::max_tasks()
                );
                return Ok(None);
            }
            // A DDL command waits for the database: this decoder is being stopped.
            Err(shmem::live::NoEntry::DatabasePaused) => return Err(Stop::Terminated),
        };
        let live = LiveStatus::new(index);
        live.set_served_by_shared_decoder();
        match self.prepare(&task, live) {
            Ok(Some(pipeline)) => Ok(Some(pipeline)),
            // It joins again with its next generation, once its new tables are published.
            Ok(None) => {
                live.detach(Phase::Exited);
                Ok(None)
            }
            Err(Stop::Terminated) => Err(Stop::Terminated),
            Err(Stop::Failed(failure)) => {
                fail_task(&task, live, &failure);
                Ok(None)
            }
        }
    }

    /// The pipeline of a task that joins, or None when its view reads tables the shared
    /// publication did not hold when the task's position was given (the view was replaced since
    /// the task's tables were planned): the task is then planned again (`follow_new_tables`).
    fn prepare(&mut self, task: &TaskRecord, live: LiveStatus) -> Result<Option<Pipeline>, Stop> {
        let options = TaskOptions::parse(&task.options).map_err(SyncError::from)?;
        // What meili_sync_start checked may have changed since: the table or view, what the view
        // reads, or the owner's grants.
        let view = recheck(live, task, &options)?;
        if let Some(view) = &view {
            // A table the view reads now that the shared publication did not hold when the task's
            // position was given: its changes since never reached the task.
            let missing: Vec<String> = view
                .tables
                .iter()
                .filter(|(relid, _)| !self.published.contains(relid))
                .map(|(_, routes)| routes.table.clone())
                .collect();
            if !missing.is_empty() {
                follow_new_tables(task, &view.view, &missing, live)?;
                return Ok(None);
            }
        }
        let plan = in_transaction(live, "planning the documents", || {
            build_plan(task, &options)
        })?;
        let client = Client::new(&task.url, task.api_key.as_deref(), HTTP_TIMEOUT)
            .map_err(|error| fail(FailureKind::Source, error.to_string()))?;
        // The index's createdAt, to notice when someone deletes it; unknown while Meilisearch is
        // unreachable (the writer retries the task's batches meanwhile). Asked on the decoder's
        // own thread, so briefly: a server that does not answer must not hold up the pass.
        let watch = IndexWatch::looking_now(task)?;
        let key_attribute = plan.shape.primary_key_attribute().to_owned();
        let dispatcher = open_dispatcher(&client, task, &options, &key_attribute);
        let (stream, relations): (Box<dyn PassStream>, Vec<u32>) = match view {
            Some(view) => {
                let relations = view
                    .tables
                    .iter()
                    .map(|(relid, _)| relid.to_u32())
                    .collect();
                let stream = ViewStream::new(task, live, dispatcher, view, plan.limits, &options)
                    .with_partitions(PartitionWatch::of_plan(&plan, task, &options, true));
                (Box::new(stream), relations)
            }
            None => {
                let rules = ColumnRules::new(&task.relation, &task.primary_key, &options);
                let stream = Streamer::new(task, live, dispatcher, rules, plan.limits, &options)
                    .with_stall_limit(STALL_LIMIT)
                    .with_partitions(PartitionWatch::of_plan(&plan, task, &options, false));
                (Box::new(stream), vec![task.relid.to_u32()])
            }
        };
        live.set_phase(Phase::Streaming);
        let position = task.stream_position.unwrap_or(0);
        Ok(Some(Pipeline {
            task: task.clone(),
            live,
            stream,
            relations,
            watch,
            position,
            checkpointed: position,
            stored: position,
            published: Instant::now(),
            published_position: position,
            published_quiet: false,
            attached: false,
        }))
    }

    /// Holds every task to one request at a time while all of them together hold more
    /// documents than `meili_sync.decoder_memory`, so that the decoder's memory is bounded by
    /// that setting (plus about one request per busy task), not by how many tasks stream.
    fn share_memory(&mut self) {
        let held: usize = self
            .pipelines
            .values_mut()
            .map(|pipeline| {
                pipeline.stream.unsent_bytes() + pipeline.stream.dispatcher().held_bytes()
            })
            .sum();
        let budget = crate::gucs::decoder_memory();
        let squeezed = held > budget;
        if squeezed
            && !self.squeezed
            && self
                .squeeze_logged
                .is_none_or(|at| at.elapsed() >= SQUEEZE_LOG_INTERVAL)
        {
            self.squeeze_logged = Some(Instant::now());
            log!(
                "pg_meili_sync shared decoder: its tasks hold {} kB of documents Meilisearch has not confirmed, more than meili_sync.decoder_memory ({} kB); each task sends one request at a time until they hold less",
                held / 1024,
                budget / 1024
            );
        }
        self.squeezed = squeezed;
        for pipeline in self.pipelines.values_mut() {
            pipeline.stream.dispatcher().set_squeezed(squeezed);
        }
    }

    /// Takes in each task's confirmations; a task that failed leaves with its error.
    fn settle(&mut self, caught_up: bool, read_position: u64) -> Result<(), Stop> {
        let mut failed = Vec::new();
        for (task_id, pipeline) in self.pipelines.iter_mut() {
            let settled = if pipeline.stream.is_quiet() {
                // Idle with nothing to report: many such tasks must not cost a round each.
                Ok(None)
            } else {
                pipeline.stream.settle()
            };
            match settled {
                Ok(Some(lsn)) => {
                    pipeline.position = pipeline.position.max(lsn);
                    pipeline.checkpointed = pipeline.checkpointed.max(lsn);
                }
                Ok(None) => {}
                Err(Stop::Terminated) => return Err(Stop::Terminated),
                Err(Stop::Failed(failure)) => {
                    failed.push((*task_id, failure));
                    continue;
                }
            }
            if caught_up && pipeline.attached {
                if let Some(position) = pipeline.stream.confirm_idle(read_position) {
                    pipeline.position = pipeline.position.max(position);
                }
            }
        }
        self.fail(failed);
        Ok(())
    }

    /// Each attached task's turn before the read (a view task renders its window when due); a
    /// task whose turn fails leaves with its error.
    fn tasks_before_read(&mut self, caught_up: bool) -> Result<(), Stop> {
        let mut failed = Vec::new();
        for (task_id, pipeline) in self.pipelines.iter_mut() {
            if !pipeline.attached || pipeline.stream.is_quiet() {
                continue;
            }
            match pipeline.stream.before_read(caught_up) {
                Ok(()) => {}
                Err(Stop::Terminated) => return Err(Stop::Terminated),
                Err(Stop::Failed(failure)) => failed.push((*task_id, failure)),
            }
        }
        self.fail(failed);
        Ok(())
    }

    /// Stops each task of `failed` with its message; the others stream on.
    fn fail(&mut self, failed: Vec<(i64, Failure)>) {
        for (task_id, failure) in failed {
            if let Some(pipeline) = self.remove(task_id) {
                fail_task(&pipeline.task, pipeline.live, &failure);
                pipeline.leave(Phase::Error);
            }
        }
    }

    /// Stores the positions the tasks' own commits moved (at most every `STORE_INTERVAL`), and
    /// confirms the slot to the lowest position of all shared tasks: the attached ones' as they
    /// stand (what Meilisearch confirmed), the others' as stored. A position stored behind the
    /// slot only means a restarted decoder offers the task changes its index already has.
    fn confirm(&mut self, session: &mut DecodingSession) -> Result<(), Stop> {
        if self.last_store.elapsed() >= STORE_INTERVAL {
            self.last_store = Instant::now();
            let moved: Vec<(i64, u64)> = self
                .pipelines
                .iter()
                .filter(|(_, pipeline)| pipeline.checkpointed > pipeline.stored)
                .map(|(id, pipeline)| (*id, pipeline.checkpointed))
                .collect();
            if !moved.is_empty() {
                in_transaction(self.live, "storing the tasks' positions", || {
                    catalog::shared::store_positions(&moved)
                })?;
            }
            for (task_id, position) in moved {
                if let Some(pipeline) = self.pipelines.get_mut(&task_id) {
                    pipeline.stored = position;
                }
            }
            self.load_lowest_elsewhere()?;
        }
        let lowest = self
            .pipelines
            .values()
            .map(|pipeline| pipeline.position)
            .chain(self.lowest_elsewhere)
            .min();
        if let Some(lowest) = lowest {
            session.confirm(lowest);
        }
        Ok(())
    }

    /// The lowest stored position of the shared tasks without a pipeline here (paused, stopped,
    /// failed, or copying).
    fn load_lowest_elsewhere(&mut self) -> Result<(), Stop> {
        let here: Vec<i64> = self.pipelines.keys().copied().collect();
        self.lowest_elsewhere = in_transaction(self.live, "reading the tasks' positions", || {
            catalog::shared::lowest_position_except(&here)
        })?;
        Ok(())
    }

    /// A task that leaves stores where it stands, which holds the slot back until it returns.
    fn remove(&mut self, task_id: i64) -> Option<Pipeline> {
        self.router.detach(task_id);
        let pipeline = self.pipelines.remove(&task_id)?;
        let mut held = pipeline.stored;
        if pipeline.position > pipeline.stored {
            let stored = in_transaction(self.live, "storing a leaving task's position", || {
                catalog::shared::store_positions(&[(task_id, pipeline.position)])
            });
            match stored {
                Ok(()) => held = pipeline.position,
                // Its older stored position holds: the task is offered again changes it has.
                Err(_) => warning!("pg_meili_sync task {task_id}: could not store its position"),
            }
        }
        // From now on its stored position holds the slot back.
        self.lowest_elsewhere = Some(
            self.lowest_elsewhere
                .map_or(held, |lowest| lowest.min(held)),
        );
        Some(pipeline)
    }

    /// Attaches `joining` and the tasks ready to join again, for a read of the slot from its
    /// confirmed position (`Turn::ReadAgain`, having read up to `read_position`), so that they
    /// get every change since theirs; the tasks already attached skip what they have.
    fn join(&mut self, read_position: u64, joining: Vec<Pipeline>) -> Turn {
        self.router.restart(read_position);
        for pipeline in joining {
            self.pipelines.insert(pipeline.task.id, pipeline);
        }
        for (task_id, pipeline) in self.pipelines.iter_mut() {
            if pipeline.attached {
                continue;
            }
            pipeline.attached = true;
            self.router
                .attach(*task_id, &pipeline.relations, pipeline.position);
            log!(
                "pg_meili_sync task {task_id}: joined the shared decoding pass at {}",
                catalog::format_lsn(pipeline.position)
            );
        }
        Turn::ReadAgain
    }

    /// Tasks that cannot take more without holding up the others leave the stream, and so do
    /// tasks that must read again from their position (`TaskStream::needs_rewind`, having read
    /// up to `read_position`); those out of it send what they kept, and are ready to join once
    /// it is all confirmed. True if any is.
    fn check_stalls(&mut self, read_position: u64) -> Result<bool, Stop> {
        let mut ready = false;
        let mut failed = Vec::new();
        for (task_id, pipeline) in self.pipelines.iter_mut() {
            if pipeline.attached && pipeline.stream.needs_rewind() {
                pipeline.attached = false;
                self.router.detach(*task_id);
                log_rewind(*task_id, pipeline.position, read_position);
                pipeline.stream.rewind(read_position);
                ready = true;
            } else if pipeline.attached && pipeline.stream.is_stalled() {
                pipeline.attached = false;
                self.router.detach(*task_id);
                let why = pipeline.stream.why_it_left();
                pipeline.stream.restart();
                log!(
                    "pg_meili_sync task {task_id}: {why}; it leaves the shared decoding pass so that the other tasks go on, and reads on from {} once what it sent is confirmed",
                    catalog::format_lsn(pipeline.position)
                );
            } else if !pipeline.attached {
                match pipeline.stream.hand_over_held() {
                    Ok(()) => ready |= pipeline.stream.is_idle(),
                    Err(Stop::Terminated) => return Err(Stop::Terminated),
                    Err(Stop::Failed(failure)) => failed.push((*task_id, failure)),
                }
            }
        }
        self.fail(failed);
        Ok(ready)
    }

    fn run(&mut self) -> Result<(), Stop> {
        in_transaction(self.live, "preparing the shared slot", || {
            catalog::source::set_output_formats(false)
        })?;
        let remake_slot = self.refresh_publication()?;
        self.ensure_slot(remake_slot)?;
        self.live.set_phase(Phase::Streaming);
        let name = self.name.clone();
        drive_pass(self, &name, &name).map(|_| ())
    }

    /// The publication exists before the slot, and holds the shared tables before any task gets
    /// a position: a slot must never decode WAL written before its publication existed.
    ///
    /// A publication that is not as this install left it (dropped, made again, changed, or made
    /// first by another role) is mended; the changes the slot decoded with it may have gone out
    /// wrongly or not at all, so every shared task with a position copies its table again, and
    /// the slot is made anew (true) so that no slot reads that WAL again.
    fn refresh_publication(&mut self) -> Result<bool, Stop> {
        let tasks = self.read_tasks()?;
        let relids = self.tables_to_publish(&tasks)?;
        let (slot_exists, positions_held) =
            in_transaction(self.live, "reading the shared slot", || {
                Ok((
                    catalog::replication::slot_wal_status(&self.name)?.is_some(),
                    catalog::shared::any_shared_position()?,
                ))
            })?;
        let check = in_transaction(self.live, "publishing the shared tables", || {
            catalog::shared::publish_exactly(&self.name, &relids)
        })?;
        self.published = relids;
        let what = match check {
            catalog::replication::PublicationCheck::Mended(what) => what,
            // Made while the slot holds positions: dropped before this install recorded it.
            catalog::replication::PublicationCheck::Made if slot_exists && positions_held => {
                "was missing".to_owned()
            }
            _ => return Ok(false),
        };
        let message = format!(
            "the shared publication \"{}\" {what}, so the changes decoded with it may have gone to Meilisearch wrongly or not at all; it was made again with a new shared slot, and this task copies its table again: every row is sent again, and the documents of rows that are gone are deleted",
            self.name
        );
        let copying = in_transaction(self.live, "copying the shared tasks again", || {
            catalog::shared::copy_shared_tasks_again(&message)
        })?;
        warn_publication_mended(&self.name, &what, &copying);
        Ok(slot_exists)
    }

    /// Creates the shared slot if it is missing. Tasks that had a position in a slot that is gone
    /// lost the changes it kept: they stop with an error asking for a new copy.
    fn ensure_slot(&mut self, remake: bool) -> Result<(), Stop> {
        let status = in_transaction(self.live, "reading the shared slot", || {
            catalog::replication::slot_wal_status(&self.name)
        })?;
        if remake && status.is_some() {
            // No task holds a position in it any more (`refresh_publication`).
            in_transaction(self.live, "dropping the shared slot", || {
                catalog::replication::drop_slot(&self.name)
            })?;
            return self.create_slot();
        }
        if status.is_some_and(|status| status != SlotStatus::Lost) {
            return Ok(());
        }
        // Their positions go too: a position in the old slot means nothing in the new one, and a
        // task resumed with it would skip what the old slot kept. Without one it stops again
        // (`stop_tasks_without_changes`) until a new copy.
        let what = if status.is_some() {
            "invalidated"
        } else {
            "missing"
        };
        for task_id in in_transaction(
            self.live,
            "stopping the tasks whose changes were lost",
            || catalog::shared::forget_positions(&self.name, what),
        )? {
            warning!("pg_meili_sync task {task_id} stopped: the shared replication slot \"{}\" is {what}, so the changes it kept for this task are lost", self.name);
        }
        if status.is_some() {
            in_transaction(self.live, "dropping the invalidated shared slot", || {
                catalog::replication::drop_slot(&self.name)
            })?;
        }
        self.create_slot()
    }

    fn create_slot(&mut self) -> Result<(), Stop> {
        in_transaction(self.live, "creating the shared slot", || {
            catalog::replication::create_slot(&self.name)
        })?;
        log!(
            "pg_meili_sync: created the shared replication slot \"{}\"",
            self.name
        );
        Ok(())
    }
}

/// Logs that a publication of ours was mended, and which tasks copy their tables again.
pub fn warn_publication_mended(name: &str, what: &str, copying: &[i64]) {
    let ids = copying
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let tasks = match copying.len() {
        0 => "no task had decoded with it".to_owned(),
        1 => format!("task {ids} copies its table again to re-send what may have been lost"),
        _ => format!("tasks {ids} copy their tables again to re-send what may have been lost"),
    };
    warning!("pg_meili_sync: publication \"{name}\" {what}; it was made again as this install's own, and {tasks}");
}

/// The shared decoder's rounds in the drive loop: one read serves every attached task.
impl Pass for SharedDecoder {
    fn before_read(
        &mut self,
        session: &mut DecodingSession,
        caught_up: bool,
    ) -> Result<Turn, Stop> {
        let tasks_changed = shmem::commits::tasks_changed();
        if self.tasks_seen != Some(tasks_changed)
            || self
                .last_refresh
                .is_none_or(|at| at.elapsed() >= REFRESH_INTERVAL)
        {
            self.tasks_seen = Some(tasks_changed);
            let joining = self.refresh(session)?;
            let mut pipelines = Vec::new();
            for task in &joining {
                pipelines.extend(self.open_pipeline(task)?);
            }
            if !pipelines.is_empty() {
                return Ok(self.join(session.read_position(), pipelines));
            }
        }
        if self.check_stalls(session.read_position())? {
            return Ok(self.join(session.read_position(), Vec::new()));
        }
        self.settle(caught_up, session.read_position())?;
        self.confirm(session)?;
        self.share_memory();
        self.tasks_before_read(caught_up)?;
        Ok(Turn::Read)
    }

    fn sink(&mut self) -> &mut dyn MessageSink {
        self
    }

    fn after_read(&mut self, session: &DecodingSession, caught_up: bool) -> Result<bool, Stop> {
        if let Some(failure) = self.parse_failure.take() {
            return Err(Stop::Failed(failure));
        }
        // Tasks whose state change this read reached leave before anything moves their
        // position past it.
        let ended: Vec<i64> = self
            .pipelines
            .iter()
            .filter(|(_, pipeline)| pipeline.stream.has_ended())
            .map(|(id, _)| *id)
            .collect();
        for task_id in ended {
            if let Some(pipeline) = self.remove(task_id) {
                log_state_change(task_id);
                pipeline.leave(Phase::Exited);
            }
        }
        let (read_position, confirmed) = (session.read_position(), session.confirmed());
        let mut gone = Vec::new();
        for (task_id, pipeline) in self.pipelines.iter_mut() {
            if caught_up {
                if let Err(failure) = pipeline.watch.check() {
                    gone.push((*task_id, failure));
                    continue;
                }
            }
            let quiet = pipeline.stream.is_quiet();
            if quiet {
                // Only the shown read position would move: at most once a second, unless a
                // backend waits in meili_sync_wait for the task's position to move, or the task
                // has just become quiet (what Meilisearch confirmed last shows at once).
                let awaited = pipeline.position != pipeline.published_position
                    && shmem::waiters::has_waiters(*task_id);
                if !awaited
                    && pipeline.published_quiet
                    && pipeline.published.elapsed() < QUIET_PUBLISH_INTERVAL
                {
                    continue;
                }
            } else {
                match pipeline.stream.after_read(caught_up) {
                    Ok(()) => {}
                    Err(Stop::Terminated) => return Err(Stop::Terminated),
                    Err(Stop::Failed(failure)) => {
                        gone.push((*task_id, failure));
                        continue;
                    }
                }
            }
            pipeline.stream.publish(read_position, pipeline.position);
            pipeline.published = Instant::now();
            pipeline.published_position = pipeline.position;
            pipeline.published_quiet = quiet;
        }
        self.fail(gone);
        self.live
            .set_stream_position(read_position, confirmed, None);
        Ok(false)
    }

    fn nap(&mut self) -> Nap {
        let mut busy = false;
        let mut finished_more = false;
        for pipeline in self.pipelines.values_mut() {
            if !pipeline.stream.is_quiet() {
                busy |= pipeline.stream.waits_on_meilisearch();
                finished_more |= pipeline.stream.finished_more();
            }
        }
        if busy {
            Nap::Busy { finished_more }
        } else {
            Nap::For(REFRESH_INTERVAL)
        }
    }
}

/// Checks again what `meili_sync_start` checked of the task's table or view (`recheck_source`);
/// an ERROR of it, say of a broken view, stops the task and never the decoder.
fn recheck(
    live: LiveStatus,
    task: &TaskRecord,
    options: &TaskOptions,
) -> Result<Option<ViewPlan>, Stop> {
    in_user_transaction(
        live,
        "checking the table or view",
        Advice::FixThenResume,
        || recheck_source(task, options),
    )
}

/// Stops one task of the shared pass with `message`; the others stream on.
fn fail_task(task: &TaskRecord, live: LiveStatus, failure: &Failure) {
    let message = failure.last_error(Some(task.id));
    warning!(
        "pg_meili_sync task {} stopped ({}): {message}",
        task.id,
        failure.kind.as_str()
    );
    live.set_error(&message);
    if let Err(error) = worker_transaction(|| catalog::tasks::set_error_state(task.id, &message)) {
        warning!(
            "pg_meili_sync task {}: could not set state error: {}",
            task.id,
            error.message
        );
    }
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn meili_sync_shared_decoder_main(_arg: pg_sys::Datum) {
    worker_main(WorkerId::SharedDecoder, run);
}

fn run(live: LiveStatus, pid: i32) -> Result<(), Stop> {
    let name = in_transaction(
        live,
        "reading the shared slot's name",
        catalog::shared::shared_name,
    )?;
    let mut decoder = SharedDecoder {
        live,
        pid,
        name,
        // Partitions' changes come under their own OIDs; the catalog says whose they are.
        router: Router::new(Box::new(catalog::source::partition_ancestors)),
        pipelines: HashMap::new(),
        published: Vec::new(),
        last_refresh: None,
        tasks_seen: None,
        last_store: Instant::now(),
        lowest_elsewhere: None,
        squeezed: false,
        squeeze_logged: None,
        view_tables: HashMap::new(),
        unplanned: HashSet::new(),
        parse_failure: None,
    };
    let result = decoder.run();
    let attached: Vec<i64> = decoder.pipelines.keys().copied().collect();
    for task_id in attached {
        if let Some(pipeline) = decoder.remove(task_id) {
            pipeline.leave(Phase::Exited);
        }
    }
    result
}
