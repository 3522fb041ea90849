//! A table task's stream (`Streamer`, driven by `drive::drive` from the task's own slot, or by the
//! shared decoder): maps each committed change to a Meilisearch operation, and gives the position
//! of the newest commit whose batches Meilisearch has all confirmed, which the slot may be
//! confirmed to.

use std::borrow::BorrowMut;
use std::time::{Duration, Instant};

use pgrx::bgworkers::BackgroundWorker;
use pgrx::prelude::*;

use crate::batch::BatchLimits;
use crate::catalog::{self, TaskRecord};
use crate::changes::ChangeMapper;
use crate::decode::session::MessageSink;
use crate::dispatch::{DeadLetter, Dispatcher};
use crate::error::{ErrorKind, SyncError};
use crate::failure::{Advice, Failure, FailureKind};
use crate::meter::CommitAges;
use crate::options::{TaskOptions, WriteMode};
use crate::pgoutput;
use crate::plan::{check_task_source, ColumnRules};
use crate::shmem::LiveStatus;
use crate::state_change;
use crate::worker::control::{
    in_transaction, retry_transient, rewind_dispatcher, should_stop, Stop,
};
use crate::worker::drive::{PassStream, Settlement, TaskStream};

/// One task's stream: maps its decoded changes to batches and hands them to its dispatcher
/// (borrowed in a task worker, which used it for the copy first; owned in the shared decoder).
pub struct Streamer<D: BorrowMut<Dispatcher>> {
    task_id: i64,
    /// The task's generation this stream serves: a state change announcing a newer one ends it.
    generation: i64,
    /// Rows the task's copy sent, for the status view.
    rows_copied: i64,
    /// Read a state change of the task (`state_change`): nothing after it is taken.
    ended: bool,
    live: LiveStatus,
    dispatcher: D,
    rules: ColumnRules,
    primary_key: String,
    mapper: ChangeMapper,
    /// Collected inside decoding callbacks, acted on by the main loop.
    settlement: Settlement,
    limits: BatchLimits,
    upsert: bool,
    /// In the shared decoder: how long the task may hold up the shared reader while Meilisearch
    /// confirms none of its batches, before it leaves the stream. None: a task's own slot waits.
    stall_limit: Option<Duration>,
    /// Left the stream (stall_limit passed): later changes are ignored until mapping restarts.
    stalled: bool,
    /// `batches_finished` when `finished_more` last looked.
    finished_seen: u64,
    /// The task's table when it is partitioned: a TRUNCATE of only some of its partitions
    /// cannot be mapped to documents (see `is_partial_truncate`), so their documents are pruned.
    partitioned: Option<Partitioned>,
    /// The commit position of the transaction being read (from its Begin).
    transaction_commit: u64,
}

/// What a task on a partitioned table keeps to prune after a TRUNCATE of some partitions, or a
/// partition detached or dropped, and to bring in the rows of a partition attached.
struct Partitioned {
    root: u32,
    task: TaskRecord,
    options: TaskOptions,
    /// The commit of the last partial TRUNCATE read, or where a partition was found attached,
    /// detached or dropped: once Meilisearch has confirmed everything up to it, the documents
    /// whose rows are gone are deleted (and, after an ATTACH, the rows missing from the index
    /// sent), and only then is the slot confirmed past it (a worker that dies before reads it
    /// again and prunes again).
    prune_at: Option<u64>,
    /// What is due at `prune_at` is a repair (`verify::repair`), not only a prune: a partition
    /// was attached with rows that were never changes.
    repair: bool,
    /// Everything up to `prune_at` is confirmed, at this read position.
    prune_due: Option<u64>,
    /// The leaf partitions when last looked at (see `look_at_partitions`).
    leaves: Vec<u32>,
    /// The leaf partitions the catalog says the index is in line with (`catalog::save_partitions`).
    stored: Option<Vec<u32>>,
    next_look: Instant,
}

/// How often a task on a partitioned table looks for partitions detached, dropped or attached.
const PARTITION_LOOK_INTERVAL: Duration = Duration::from_secs(2);

impl<D: BorrowMut<Dispatcher>> Streamer<D> {
    pub fn new(
        task: &catalog::TaskRecord,
        live: LiveStatus,
        dispatcher: D,
        rules: ColumnRules,
        limits: BatchLimits,
        options: &TaskOptions,
    ) -> Self {
        let mut dispatcher = dispatcher;
        dispatcher
            .borrow_mut()
            .set_stream_depth(options.stream_depth);
        let primary_key = dispatcher.borrow().primary_key().to_owned();
        Streamer {
            task_id: task.id,
            generation: i64::from(task.generation),
            rows_copied: task.rows_copied,
            ended: false,
            live,
            dispatcher,
            primary_key,
            rules,
            mapper: ChangeMapper::new(limits, options.write_mode == WriteMode::Upsert),
            settlement: Settlement::default(),
            limits,
            upsert: options.write_mode == WriteMode::Upsert,
            stall_limit: None,
            stalled: false,
            finished_seen: 0,
            partitioned: None,
            transaction_commit: 0,
        }
    }

    /// The task's table is this partitioned table (`plan::SnapshotPlan::partitioned_root`).
    /// `leaves`: its leaf partitions when the worker checked the table, taken as the index's
    /// unless the catalog has those (`TaskRecord::partitions`): then the first look, at once,
    /// brings in or prunes what changed while no worker looked (see `look_at_partitions`).
    pub fn with_partitioned_root(
        mut self,
        root: Option<u32>,
        leaves: Vec<u32>,
        task: &TaskRecord,
        options: &TaskOptions,
    ) -> Self {
        self.partitioned = root.map(|root| Partitioned {
            root,
            task: task.clone(),
            options: options.clone(),
            prune_at: None,
            repair: false,
            prune_due: None,
            leaves: task.partitions.clone().unwrap_or(leaves),
            stored: task.partitions.clone(),
            next_look: Instant::now(),
        });
        self
    }

    /// A partition detached or dropped takes no row change into the WAL, and one attached brings
    /// rows that were never changes: the worker looks at the partitions every few seconds. The
    /// documents of a partition that is gone are pruned (as after a partial TRUNCATE, once
    /// everything up to now is in the index). A new partition that has rows is checked as
    /// `meili_sync_start` checks every partition (logged, a replica identity that carries the
    /// key), then its rows are brought in by a repair at the same point, which sends what the
    /// index lacks. A new partition without pages (created ahead) streams like the others.
    fn look_at_partitions(&mut self) -> Result<(), Stop> {
        let Some(partitioned) = self.partitioned.as_mut() else {
            return Ok(());
        };
        if Instant::now() < partitioned.next_look {
            return Ok(());
        }
        partitioned.next_look = Instant::now() + PARTITION_LOOK_INTERVAL;
        let root = pg_sys::Oid::from(partitioned.root);
        let (leaves, now) = in_transaction(self.live, "looking at the partitions", || {
            Ok((
                catalog::partition_leaves_now(root)?,
                catalog::wal_insert_position()?,
            ))
        })?;
        let attached = leaves
            .iter()
            .any(|(leaf, has_pages)| *has_pages && !partitioned.leaves.contains(leaf));
        // In OID order, as `partition_leaves_now` gives them and as they were stored.
        let current: Vec<u32> = leaves.iter().map(|(leaf, _)| *leaf).collect();
        let gone = partitioned
            .leaves
            .iter()
            .any(|leaf| !current.contains(leaf));
        if attached {
            // Refused as meili_sync_start refuses it. The way back is a new copy: a task of 0.2.0
            // that had not recorded its partitions yet would not know the partition as new.
            let checked = in_transaction(self.live, "checking a partition attached", || {
                Ok(check_task_source(&partitioned.task, &partitioned.options))
            })?;
            if let Err(error) = checked {
                let fix = error.hint.as_deref().map_or_else(
                    || "fix the partition".to_owned(),
                    |hint| hint.trim_end_matches('.').to_owned(),
                );
                return Err(Stop::Failed(
                    Failure::new(FailureKind::Source, error.message)
                        .advice(Advice::FixThenSnapshot(fix)),
                ));
            }
            log!(
                "pg_meili_sync task {}: a partition was attached to {} with rows; they are sent once everything before it is in the index",
                self.task_id,
                self.rules.relation_name
            );
            partitioned.repair = true;
        } else if gone {
            log!(
                "pg_meili_sync task {}: a partition of {} was detached or dropped; its documents are deleted once everything before it is in the index",
                self.task_id,
                self.rules.relation_name
            );
        }
        if attached || gone {
            partitioned.prune_at = Some(partitioned.prune_at.map_or(now, |at| at.max(now)));
        }
        partitioned.leaves = current;
        self.store_partitions()
    }

    /// Records the leaf partitions in the catalog once the index is in line with them: no prune
    /// or repair is pending.
    fn store_partitions(&mut self) -> Result<(), Stop> {
        let Some(partitioned) = self.partitioned.as_mut() else {
            return Ok(());
        };
        if partitioned.prune_at.is_some()
            || partitioned.stored.as_ref() == Some(&partitioned.leaves)
        {
            return Ok(());
        }
        in_transaction(self.live, "recording the partitions", || {
            catalog::save_partitions(partitioned.task.id, &partitioned.leaves)
        })?;
        partitioned.stored = Some(partitioned.leaves.clone());
        Ok(())
    }

    /// Prunes once everything up to a partial TRUNCATE is confirmed (`settled`: the position
    /// the slot may be confirmed to), before the slot is confirmed past it.
    fn prune_when_due(&mut self, settled: Option<u64>) -> Result<Option<u64>, Stop> {
        let Some(partitioned) = self.partitioned.as_mut() else {
            return Ok(settled);
        };
        let Some(prune_at) = partitioned.prune_at else {
            return Ok(settled);
        };
        let due = settled
            .filter(|&position| position >= prune_at)
            .or(partitioned.prune_due.take());
        let Some(position) = due else {
            return Ok(settled);
        };
        if partitioned.repair {
            repair_index(&partitioned.task, self.live)?;
        } else {
            prune_index(&partitioned.task, self.live)?;
        }
        partitioned.prune_at = None;
        partitioned.repair = false;
        self.store_partitions()?;
        Ok(Some(position))
    }

    /// Gives up waiting for room after `limit` without any batch confirmed, instead of holding
    /// up the decoding of other tasks' changes (see `is_stalled`).
    pub fn with_stall_limit(mut self, limit: Duration) -> Self {
        self.stall_limit = Some(limit);
        self
    }

    /// Batches Meilisearch finished (confirmed or failed): progress, for the stall limit.
    fn batches_finished(&self) -> u64 {
        let stats = self.dispatcher.borrow().writer().stats();
        stats
            .batches_confirmed
            .load(std::sync::atomic::Ordering::Relaxed)
            + stats
                .batches_failed
                .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn pump(&mut self, wait: Option<Duration>) {
        self.settlement.pump(self.dispatcher.borrow_mut(), wait);
    }

    /// After a read: closes the open window, then sends whatever closed batches the dispatcher
    /// has room for. The window closes at once when nothing else is coming to fill it
    /// (`caught_up`) and Meilisearch has nothing of ours to do. While it is busy with earlier
    /// requests, the window closes only when due or full, and not at all while every request slot
    /// is taken: a request enqueued now would wait for the running batch anyway, and Meilisearch's
    /// auto-batcher turns a few large queued requests into fewer batches than many small ones
    /// (each batch has a large fixed cost).
    fn end_read(&mut self, caught_up: bool) {
        self.pump(None);
        let dispatcher = self.dispatcher.borrow();
        if dispatcher.has_room() {
            if caught_up && dispatcher.is_idle() {
                self.mapper.flush();
            } else {
                self.mapper.flush_due(Instant::now());
            }
        }
        self.send_ready(false);
    }

    /// Moves closed batches to the dispatcher, in order. With `block`, waits (handling
    /// confirmations) until all are taken: that wait is the back pressure that stops reading the
    /// slot, and it keeps memory bounded inside one huge transaction.
    fn send_ready(&mut self, block: bool) {
        let mut finished = None;
        let mut progress_at = Instant::now();
        loop {
            self.pump(None);
            if self
                .settlement
                .hand_over(self.dispatcher.borrow_mut(), self.mapper.ready())
            {
                return;
            }
            if !block || self.settlement.has_failed() || self.dispatcher.borrow().needs_rewind() {
                return;
            }
            if should_stop() {
                // Inside a replay an ERROR is the only way out; the slot has not moved past
                // anything unconfirmed, so the restarted worker decodes it again.
                error!(
                    "pg_meili_sync task {}: stopping during a transaction replay",
                    self.task_id
                );
            }
            if let Some(limit) = self.stall_limit {
                let now_finished = self.batches_finished();
                if finished != Some(now_finished) {
                    finished = Some(now_finished);
                    progress_at = Instant::now();
                } else if progress_at.elapsed() >= limit {
                    self.stalled = true;
                    return;
                }
            }
            self.pump(Some(Duration::from_millis(20)));
        }
    }

    /// Forgets everything mapped and not yet handed to the dispatcher (it is read again from the
    /// slot), and takes changes again.
    fn forget_read(&mut self) {
        self.mapper = ChangeMapper::new(self.limits, self.upsert);
        self.stalled = false;
        // What was read is read again; a prune still due stays due.
        if let Some(partitioned) = self.partitioned.as_mut() {
            partitioned.prune_due = None;
        }
    }

    /// A prune waits, or a look at the partitions is due: the stream is not quiet.
    fn prune_pending(&self) -> bool {
        self.partitioned.as_ref().is_some_and(|partitioned| {
            partitioned.prune_at.is_some() || Instant::now() >= partitioned.next_look
        })
    }

    /// Rows that could not become documents go to the dead letters (stored by the main loop
    /// before the slot moves past them).
    fn report_skipped(&mut self) {
        for skipped in self.mapper.take_skipped() {
            self.dispatcher
                .borrow_mut()
                .add_dead_letter(DeadLetter::unsent_row(
                    skipped.document,
                    skipped.code,
                    skipped.reason,
                    &self.primary_key,
                ));
        }
    }
}

impl<D: BorrowMut<Dispatcher>> TaskStream for Streamer<D> {
    fn live(&self) -> LiveStatus {
        self.live
    }

    fn settle(&mut self) -> Result<Option<u64>, Stop> {
        self.pump(None);
        let settled =
            self.settlement
                .settle(self.task_id, self.live, self.dispatcher.borrow_mut())?;
        self.prune_when_due(settled)
    }

    fn confirm_idle(&mut self, read_position: u64) -> Option<u64> {
        let idle = self.is_idle() && !self.ended;
        if let Some(partitioned) = self.partitioned.as_mut() {
            if let Some(prune_at) = partitioned.prune_at {
                // Not past the partial TRUNCATE before its prune: the next settle prunes.
                if idle && read_position >= prune_at {
                    partitioned.prune_due = Some(read_position);
                }
                return None;
            }
        }
        self.settlement.confirm_idle(idle, read_position)
    }

    fn is_idle(&self) -> bool {
        self.mapper.is_idle() && self.dispatcher.borrow().is_idle()
    }

    fn has_ended(&self) -> bool {
        self.ended
    }

    fn after_read(&mut self, nothing_coming: bool) -> Result<(), Stop> {
        self.end_read(nothing_coming);
        self.look_at_partitions()
    }

    fn publish(&mut self, read_position: u64, confirmed: u64) {
        self.settlement.publish(
            self.live,
            self.rows_copied,
            self.dispatcher.borrow(),
            (read_position, confirmed),
        );
    }

    fn waits_on_meilisearch(&self) -> bool {
        !self.dispatcher.borrow().is_idle()
    }

    fn finished_more(&mut self) -> bool {
        let finished = self.batches_finished();
        let more = finished != self.finished_seen;
        self.finished_seen = finished;
        more
    }

    fn needs_rewind(&self) -> bool {
        self.dispatcher.borrow().needs_rewind()
    }

    fn rewind(&mut self, careful_until: u64) {
        self.forget_read();
        rewind_dispatcher(self.dispatcher.borrow_mut(), careful_until);
    }
}

impl PassStream for Streamer<Dispatcher> {
    fn dispatcher(&mut self) -> &mut Dispatcher {
        &mut self.dispatcher
    }

    fn is_quiet(&self) -> bool {
        self.mapper.is_idle()
            && self.dispatcher.is_quiet()
            && self.settlement.is_empty()
            && !self.prune_pending()
    }

    fn is_stalled(&self) -> bool {
        self.stalled
    }

    fn restart(&mut self) {
        self.forget_read();
    }

    fn unsent_bytes(&self) -> usize {
        self.mapper.held_bytes()
    }
}

/// Parses a pgoutput message and notes a commit's time (for `lag_seconds`); a message that does
/// not parse is a permanent failure of the task.
pub fn parse_noting_commits<'a>(
    data: &'a [u8],
    ages: &mut CommitAges,
) -> Result<pgoutput::Message<'a>, Failure> {
    let message = pgoutput::parse(data).map_err(|error| {
        Failure::new(
            FailureKind::Decoding,
            format!("cannot parse a pgoutput message: {error}"),
        )
    })?;
    if let pgoutput::Message::Commit {
        end_lsn,
        commit_time,
        ..
    } = &message
    {
        ages.committed(*end_lsn, *commit_time);
    }
    Ok(message)
}

impl<D: BorrowMut<Dispatcher>> MessageSink for Streamer<D> {
    fn message(&mut self, _lsn: u64, data: &[u8]) {
        if self.settlement.has_failed()
            || self.stalled
            || self.ended
            || self.dispatcher.borrow().needs_rewind()
        {
            return;
        }
        let message = match parse_noting_commits(data, self.settlement.ages()) {
            Ok(message) => message,
            Err(error) => {
                self.settlement.fail(error);
                return;
            }
        };
        if state_change::ends_stream(&message, self.task_id, self.generation) {
            self.ended = true;
            return;
        }
        match (&message, self.partitioned.as_mut()) {
            (pgoutput::Message::Begin { final_lsn, .. }, _) => self.transaction_commit = *final_lsn,
            (pgoutput::Message::Truncate { relations, .. }, Some(partitioned))
                if is_partial_truncate(partitioned.root, relations) =>
            {
                log!(
                    "pg_meili_sync task {}: a TRUNCATE emptied some partitions of {}; their documents are deleted once everything before it is in the index",
                    self.task_id,
                    self.rules.relation_name
                );
                partitioned.prune_at = Some(self.transaction_commit);
                return;
            }
            _ => {}
        }
        let rules = &self.rules;
        if let Err(error) = self.mapper.apply(message, &Instant::now, &mut |relation| {
            rules.relation_shape(relation)
        }) {
            self.settlement.fail(error);
            return;
        }
        self.report_skipped();
        self.send_ready(true);
    }
}

/// Whether a TRUNCATE empties some partitions of the partitioned table `root` but not all of
/// them. Their documents cannot be told from the others' by their ids, so instead of deleting the
/// whole index (or nothing), the stream prunes: once Meilisearch has everything before it, the
/// documents whose rows are gone are deleted (`verify::prune`), which is exact whenever it runs
/// after the TRUNCATE, since every later change is streamed after the prune's deletes. Looked up
/// inside the decoding callback, so the partitions are those of the truncating transaction.
fn is_partial_truncate(root: u32, truncated: &[u32]) -> bool {
    let leaves = catalog::partition_leaves(root);
    let emptied = leaves
        .iter()
        .filter(|leaf| truncated.contains(leaf))
        .count();
    emptied > 0 && emptied < leaves.len()
}

/// Sends the rows the index lacks or holds in another version, and deletes the documents of rows
/// that no longer exist (see `verify::repair`), retrying while Meilisearch is unreachable.
fn repair_index(task: &TaskRecord, live: LiveStatus) -> Result<(), Stop> {
    let repairs = retry_transient(
        live,
        "sending the rows of a partition attached",
        |error: &SyncError| error.kind == ErrorKind::Meilisearch,
        || BackgroundWorker::transaction(|| crate::verify::repair(task.clone())),
        Stop::from,
    )?;
    if repairs.resent > 0 || repairs.deleted > 0 {
        log!(
            "pg_meili_sync task {}: sent {} rows the index lacked, deleted {} documents whose rows no longer exist",
            task.id,
            repairs.resent,
            repairs.deleted
        );
    }
    Ok(())
}

/// Deletes the documents of rows that no longer exist (see `verify::prune`), retrying while
/// Meilisearch is unreachable.
pub fn prune_index(task: &TaskRecord, live: LiveStatus) -> Result<(), Stop> {
    let deleted = retry_transient(
        live,
        "deleting the documents whose rows no longer exist",
        |error: &SyncError| error.kind == ErrorKind::Meilisearch,
        || BackgroundWorker::transaction(|| crate::verify::prune(task.clone())),
        Stop::from,
    )?;
    if deleted > 0 {
        log!(
            "pg_meili_sync task {}: deleted {deleted} documents whose rows no longer exist",
            task.id
        );
    }
    Ok(())
}
