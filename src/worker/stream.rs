//! A table task's stream (`Streamer`, driven by `drive::drive` from the task's own slot, or by the
//! shared decoder): maps each committed change to a Meilisearch operation, and gives the position
//! of the newest commit whose batches Meilisearch has all confirmed, which the slot may be
//! confirmed to.

use std::borrow::BorrowMut;
use std::time::{Duration, Instant};

use pgrx::prelude::*;

use pg_meili_sync_core::document::shard::ShardFilter;
use pg_meili_sync_core::pipeline::batch::BatchLimits;
use pg_meili_sync_core::pipeline::dispatch::{DeadLetter, Dispatcher};
use pg_meili_sync_core::pipeline::meter::CommitAges;
use pg_meili_sync_core::task::options::{TaskOptions, WriteMode};
use pg_meili_sync_core::wal::changes::ChangeMapper;
use pg_meili_sync_core::wal::pgoutput;
use pg_meili_sync_core::wal::state_change;

use crate::catalog;
use crate::plan::ColumnRules;
use crate::shmem::live::LiveStatus;
use crate::worker::columns_added::ColumnsAddedWatch;
use crate::worker::control::{rewind_dispatcher, should_stop, Stop};
use crate::worker::drive::{DueWork, ParsedSink, PassStream, Settlement, TaskStream};
use crate::worker::partitions::PartitionWatch;

/// How long a task of the shared pass may hold up the shared reader while its Meilisearch
/// answers none of its requests, before it leaves the pass (see `Streamer::send_ready`): the
/// other tasks, and its healthy replicas and shards, wait at most this long for a server that
/// stopped or died.
pub const UNANSWERED_LIMIT: Duration = Duration::from_millis(1500);

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
    /// On a shard's row: the documents it keeps (every other change is another shard's).
    shard: Option<ShardFilter>,
    /// In the shared decoder: how long the task may hold up the shared reader while Meilisearch
    /// confirms none of its batches, before it leaves the stream. None: a task's own slot waits.
    stall_limit: Option<Duration>,
    /// Left the stream (a limit passed): later changes are ignored until mapping restarts. Why,
    /// for the log.
    left: Option<Leaving>,
    /// `batches_finished` when `finished_more` last looked.
    finished_seen: u64,
    /// The partitions of the task's table when it is partitioned.
    partitioned: Option<PartitionWatch>,
    /// Columns added to the table, sent to every document.
    columns_added: ColumnsAddedWatch,
    /// The commit position of the transaction being read (from its Begin).
    transaction_commit: u64,
}

impl<D: BorrowMut<Dispatcher>> Streamer<D> {
    pub fn new(
        task: &catalog::tasks::TaskRecord,
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
        let shard = task.shard_filter();
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
            mapper: ChangeMapper::new(limits, options.write_mode == WriteMode::Upsert)
                .with_shard(shard.clone()),
            settlement: Settlement::default(),
            limits,
            upsert: options.write_mode == WriteMode::Upsert,
            shard,
            stall_limit: None,
            left: None,
            finished_seen: 0,
            partitioned: None,
            columns_added: ColumnsAddedWatch::new(task),
            transaction_commit: 0,
        }
    }

    /// Follows the partitions of the task's table when it is partitioned (see `PartitionWatch`).
    pub fn with_partitions(mut self, watch: Option<PartitionWatch>) -> Self {
        self.partitioned = watch;
        self
    }

    /// Gives up waiting for room after `limit` without any batch confirmed, instead of holding
    /// up the decoding of other tasks' changes (see `is_stalled`).
    pub fn with_stall_limit(mut self, limit: Duration) -> Self {
        self.stall_limit = Some(limit);
        self
    }

    /// Requests Meilisearch answered: a server that answers nothing has stopped or died.
    fn answers(&self) -> u64 {
        self.dispatcher
            .borrow()
            .writer()
            .stats()
            .answers
            .load(std::sync::atomic::Ordering::Relaxed)
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
        let mut answers = None;
        let mut answered_at = Instant::now();
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
                }
                let now_answers = self.answers();
                if answers != Some(now_answers) {
                    answers = Some(now_answers);
                    answered_at = Instant::now();
                }
                // A server that answers is slow at worst: the other tasks wait for it up to the
                // limit, since a transaction larger than the task's queue can only get through
                // while the reader waits for it. One that answers nothing (stopped, dead,
                // unreachable) holds them up for a moment only.
                if answered_at.elapsed() >= UNANSWERED_LIMIT {
                    self.left = Some(Leaving::Unanswered);
                    return;
                }
                if progress_at.elapsed() >= limit {
                    self.left = Some(Leaving::Unconfirmed(limit));
                    return;
                }
            }
            self.pump(Some(Duration::from_millis(20)));
        }
    }

    /// Forgets everything mapped and not yet handed to the dispatcher (it is read again from the
    /// slot), and takes changes again.
    fn forget_read(&mut self) {
        self.mapper = ChangeMapper::new(self.limits, self.upsert).with_shard(self.shard.clone());
        self.left = None;
        if let Some(partitioned) = self.partitioned.as_mut() {
            partitioned.due().forget_read();
        }
        self.columns_added.due().forget_read();
    }

    /// A prune, a repair or columns added wait, or a look is due: the stream is not quiet.
    fn watches_pending(&self) -> bool {
        self.partitioned
            .as_ref()
            .is_some_and(PartitionWatch::pending)
            || self.columns_added.pending()
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
        let settled = match self.partitioned.as_mut() {
            Some(partitioned) => partitioned.when_due(self.live, settled)?,
            None => settled,
        };
        self.columns_added.when_due(self.live, settled)
    }

    fn confirm_idle(&mut self, read_position: u64) -> Option<u64> {
        let idle = self.is_idle() && !self.ended;
        if let Some(partitioned) = self.partitioned.as_mut() {
            // Not past a partial TRUNCATE or a change of partitions before the index is in line.
            if partitioned.due().holds(idle, read_position) {
                return None;
            }
        }
        // Nor past columns added before every document has them.
        if self.columns_added.due().holds(idle, read_position) {
            return None;
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
        if let Some(partitioned) = self.partitioned.as_mut() {
            partitioned.look(self.live)?;
        }
        self.columns_added.look(self.live)
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
            && !self.watches_pending()
    }

    fn is_stalled(&self) -> bool {
        self.left.is_some()
    }

    fn why_it_left(&self) -> String {
        match self.left {
            Some(Leaving::Unconfirmed(limit)) => format!(
                "Meilisearch confirmed none of its batches for {} s",
                limit.as_secs()
            ),
            _ => format!(
                "Meilisearch answered none of its requests for {} s",
                UNANSWERED_LIMIT.as_secs_f64()
            ),
        }
    }

    fn restart(&mut self) {
        self.forget_read();
    }

    fn unsent_bytes(&self) -> usize {
        self.mapper.held_bytes()
    }
}

/// Why a task left the shared pass.
#[derive(Clone, Copy)]
enum Leaving {
    /// Its server answered none of its requests: stopped, dead or unreachable.
    Unanswered,
    /// Its server answers but finished none of the task's batches for this long.
    Unconfirmed(Duration),
}

/// Notes a commit's time, for `lag_seconds`.
pub fn note_commit(message: &pgoutput::Message<'_>, ages: &mut CommitAges) {
    if let pgoutput::Message::Commit {
        end_lsn,
        commit_time,
        ..
    } = message
    {
        ages.committed(*end_lsn, *commit_time);
    }
}

impl<D: BorrowMut<Dispatcher>> ParsedSink for Streamer<D> {
    fn message(&mut self, _lsn: u64, message: &pgoutput::Message<'_>) {
        if self.settlement.has_failed()
            || self.left.is_some()
            || self.ended
            || self.dispatcher.borrow().needs_rewind()
        {
            return;
        }
        note_commit(message, self.settlement.ages());
        if state_change::ends_stream(message, self.task_id, self.generation) {
            self.ended = true;
            return;
        }
        match (message, self.partitioned.as_mut()) {
            (pgoutput::Message::Begin { final_lsn, .. }, _) => self.transaction_commit = *final_lsn,
            (pgoutput::Message::Truncate { relations, .. }, Some(partitioned))
                if partitioned.is_partial_truncate(relations) =>
            {
                partitioned.truncated(self.task_id, self.transaction_commit);
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
