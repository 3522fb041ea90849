//! The streaming phase of a task worker: decodes the slot in process, maps each committed change
//! to a Meilisearch operation, and confirms the slot only up to the newest commit whose batches
//! Meilisearch has all confirmed.

use std::borrow::BorrowMut;
use std::time::{Duration, Instant};

use pgrx::bgworkers::BackgroundWorker;
use pgrx::prelude::*;

use crate::batch::BatchLimits;
use crate::catalog;
use crate::changes::ChangeMapper;
use crate::decode::session::{DecodingSession, MessageSink};
use crate::dispatch::{DeadLetter, Dispatcher, Progress};
use crate::gucs;
use crate::meili::client::Client;
use crate::meter::CommitAges;
use crate::options::{TaskOptions, WriteMode};
use crate::pacing::BusyNap;
use crate::pgoutput;
use crate::plan::ColumnRules;
use crate::shmem::{LiveStatus, Phase};
use crate::state_change;
use crate::worker::control::{permanent, report_progress, should_stop, Stop};

/// WAL records decoded between two looks at confirmations and signals.
pub const RECORDS_PER_ROUND: usize = 2000;

/// The nap between rounds while Meilisearch has requests of ours: 5 ms right after a round that
/// moved something, doubling to 40 ms while none does (for a task's own loop and the shared
/// decoder's alike).
pub fn busy_nap() -> BusyNap {
    BusyNap::new(Duration::from_millis(5), Duration::from_millis(40))
}

/// One task's stream: maps its decoded changes to batches and hands them to its dispatcher
/// (borrowed in a task worker, which used it for the copy first; owned in the shared decoder).
pub struct Streamer<D: BorrowMut<Dispatcher>> {
    task_id: i64,
    /// The task's generation this stream serves: a state change announcing a newer one ends it.
    generation: i64,
    /// Read a state change of the task (`state_change`): nothing after it is taken.
    ended: bool,
    live: LiveStatus,
    dispatcher: D,
    rules: ColumnRules,
    primary_key: String,
    mapper: ChangeMapper,
    /// Collected inside decoding callbacks, acted on by the main loop (dead letters first).
    progress: Progress,
    failure: Option<String>,
    /// For the lag in seconds: commits decoded and not yet confirmed.
    ages: CommitAges,
    limits: BatchLimits,
    upsert: bool,
    /// In the shared decoder: how long the task may hold up the shared reader while Meilisearch
    /// confirms none of its batches, before it leaves the stream. None: a task's own slot waits.
    stall_limit: Option<Duration>,
    /// Left the stream (stall_limit passed): later changes are ignored until mapping restarts.
    stalled: bool,
    /// `batches_finished` when `finished_more` last looked.
    finished_seen: u64,
}

impl<D: BorrowMut<Dispatcher>> Streamer<D> {
    pub fn new(
        task_id: i64,
        generation: i32,
        live: LiveStatus,
        dispatcher: D,
        rules: ColumnRules,
        limits: BatchLimits,
        options: &TaskOptions,
    ) -> Self {
        let primary_key = dispatcher.borrow().primary_key().to_owned();
        Streamer {
            task_id,
            generation: i64::from(generation),
            ended: false,
            live,
            dispatcher,
            primary_key,
            rules,
            mapper: ChangeMapper::new(limits, options.write_mode == WriteMode::Upsert),
            progress: Progress::default(),
            failure: None,
            ages: CommitAges::default(),
            limits,
            upsert: options.write_mode == WriteMode::Upsert,
            stall_limit: None,
            stalled: false,
            finished_seen: 0,
        }
    }

    /// Gives up waiting for room after `limit` without any batch confirmed, instead of holding
    /// up the decoding of other tasks' changes (see `is_stalled`).
    pub fn with_stall_limit(mut self, limit: Duration) -> Self {
        self.stall_limit = Some(limit);
        self
    }

    /// The stream read a state change of its task (pause, stop, alter, re-copy, drop): it must
    /// end there, never confirming past it.
    pub fn has_ended(&self) -> bool {
        self.ended
    }

    /// The task could not take more changes for the stall limit: it must leave the stream, and
    /// join again (reading from its confirmed position) once its dispatcher is idle.
    pub fn is_stalled(&self) -> bool {
        self.stalled
    }

    /// Forgets every change mapped and not yet handed to the dispatcher (they are read again
    /// from the slot when the task joins again) and takes changes again.
    pub fn restart_mapping(&mut self) {
        self.mapper = ChangeMapper::new(self.limits, self.upsert);
        self.stalled = false;
    }

    /// Batches Meilisearch finished (confirmed or failed): progress, for the stall limit.
    fn batches_finished(&mut self) -> u64 {
        let stats = self.dispatcher().writer().stats();
        stats
            .batches_confirmed
            .load(std::sync::atomic::Ordering::Relaxed)
            + stats
                .batches_failed
                .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Meilisearch finished a request since the last call: the main loop naps short again.
    pub fn finished_more(&mut self) -> bool {
        let finished = self.batches_finished();
        let more = finished != self.finished_seen;
        self.finished_seen = finished;
        more
    }

    /// Bytes of documents this stream holds: mapped and not yet sent, or sent and unconfirmed.
    pub fn held_bytes(&self) -> usize {
        self.mapper.held_bytes() + self.dispatcher.borrow().held_bytes()
    }

    pub fn dispatcher(&mut self) -> &mut Dispatcher {
        self.dispatcher.borrow_mut()
    }

    pub fn into_dispatcher(self) -> D {
        self.dispatcher
    }

    fn pump(&mut self, wait: Option<Duration>) {
        let progress = self.dispatcher().pump(wait);
        self.progress.absorb(progress);
        if let Some(failure) = self.dispatcher().take_failure() {
            self.failure.get_or_insert(failure);
        }
    }

    /// Takes in what Meilisearch finished, stores dead letters and progress, and returns the
    /// position the task's index is now complete up to (None if it did not move). A failure of
    /// the task is permanent.
    pub fn settle(&mut self) -> Result<Option<u64>, Stop> {
        self.pump(None);
        // Dead letters are stored before the slot moves past them.
        let progress = std::mem::take(&mut self.progress);
        report_progress(
            self.task_id,
            self.live,
            self.dispatcher.borrow_mut(),
            &progress,
            Phase::Streaming,
        )?;
        if let Some(failure) = self.failure.take() {
            return Err(permanent(failure));
        }
        if let Some(lsn) = progress.checkpoint {
            self.ages.confirmed(lsn);
        }
        Ok(progress.checkpoint)
    }

    /// After a read: closes the open window, then sends whatever closed batches the dispatcher
    /// has room for. The window closes at once when nothing else is coming to fill it
    /// (`caught_up`) and Meilisearch has nothing of ours to do. While it is busy with earlier
    /// requests, the window closes only when due or full, and not at all while every request slot
    /// is taken: a request enqueued now would wait for the running batch anyway, and Meilisearch's
    /// auto-batcher turns a few large queued requests into fewer batches than many small ones
    /// (each batch has a large fixed cost).
    pub fn end_read(&mut self, caught_up: bool) {
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

    /// Caught up with nothing unconfirmed: the index is complete up to `position`.
    pub fn confirm_idle(&mut self, position: u64) -> Option<u64> {
        (self.is_idle() && !self.ended).then(|| {
            self.ages.confirmed(position);
            position
        })
    }

    /// What the status view shows of the stream.
    pub fn publish(&mut self, rows_copied: i64, read_position: u64, confirmed: u64) {
        let (backlog, stats) = {
            let dispatcher = self.dispatcher.borrow_mut();
            (dispatcher.backlog(), dispatcher.writer().stats())
        };
        self.live.set_progress(rows_copied, backlog, stats);
        self.live
            .set_stream_position(read_position, confirmed, self.ages.oldest());
    }

    /// Moves closed batches to the dispatcher, in order. With `block`, waits (handling
    /// confirmations) until all are taken: that wait is the back pressure that stops reading the
    /// slot, and it keeps memory bounded inside one huge transaction.
    fn send_ready(&mut self, block: bool) {
        let mut finished = None;
        let mut progress_at = Instant::now();
        loop {
            self.pump(None);
            while self.dispatcher().has_room() {
                match self.mapper.next_ready() {
                    Some(batch) => self.dispatcher.borrow_mut().push(batch),
                    None => break,
                }
            }
            if !self.mapper.has_ready() {
                // Only now, behind every batch before it, may a commit that sent nothing count.
                if let Some(checkpoint) = self.mapper.take_pending_checkpoint() {
                    if let Some(lsn) = self.dispatcher().standalone(checkpoint) {
                        self.progress.checkpoint = Some(lsn);
                    }
                }
                return;
            }
            if !block || self.failure.is_some() {
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

    fn is_idle(&self) -> bool {
        self.mapper.is_idle() && self.dispatcher.borrow().is_idle()
    }

    /// Nothing mapped, sent or to report: `settle`, `end_read` and `publish` would change
    /// nothing but the shown read position (the shared decoder skips such tasks).
    pub fn is_quiet(&self) -> bool {
        self.mapper.is_idle()
            && self.dispatcher.borrow().is_quiet()
            && self.progress.checkpoint.is_none()
            && self.progress.retries.is_empty()
            && self.progress.notices.is_empty()
            && self.failure.is_none()
    }

    fn dispatcher_is_idle(&self) -> bool {
        self.dispatcher.borrow().is_idle()
    }
}

/// Parses a pgoutput message and notes a commit's time (for `lag_seconds`); a message that does
/// not parse is a permanent failure of the task.
pub fn parse_noting_commits<'a>(
    data: &'a [u8],
    ages: &mut CommitAges,
) -> Result<pgoutput::Message<'a>, String> {
    let message = pgoutput::parse(data)
        .map_err(|error| format!("cannot parse a pgoutput message: {error}"))?;
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
        if self.failure.is_some() || self.stalled || self.ended {
            return;
        }
        let message = match parse_noting_commits(data, &mut self.ages) {
            Ok(message) => message,
            Err(error) => {
                self.failure = Some(error);
                return;
            }
        };
        if state_change::ends_stream(&message, self.task_id, self.generation) {
            self.ended = true;
            return;
        }
        let rules = &self.rules;
        if let Err(error) = self.mapper.apply(message, &Instant::now, &mut |relation| {
            rules.relation_shape(relation)
        }) {
            self.failure = Some(error);
            return;
        }
        self.report_skipped();
        self.send_ready(true);
    }
}

/// Notices when someone else deletes (or deletes and re-creates) the task's index: Meilisearch
/// would re-create it on the next write without the documents sent before, so the task stops with
/// an error asking for a new snapshot rather than going on with an incomplete index.
pub struct IndexWatch {
    client: Client,
    uid: String,
    created_at: Option<String>,
    last_check: Instant,
}

impl IndexWatch {
    pub fn new(client: Client, uid: &str, created_at: Option<String>) -> Self {
        IndexWatch {
            client,
            uid: uid.to_owned(),
            created_at,
            last_check: Instant::now(),
        }
    }

    /// Checks at most once per `meili_sync.index_check_interval`; unreachable servers are the
    /// writer's business, not a verdict here.
    pub fn check(&mut self, task_id: i64) -> Result<(), String> {
        if self.created_at.is_none() || self.last_check.elapsed() < gucs::index_check_interval() {
            return Ok(());
        }
        self.last_check = Instant::now();
        let created_at = match self.client.get_index(&self.uid) {
            Ok(None) => None,
            Ok(Some(index)) => index.created_at,
            Err(_) => return Ok(()),
        };
        if created_at == self.created_at {
            return Ok(());
        }
        Err(format!(
            "index \"{}\" was deleted{} outside pg_meili_sync, so it no longer holds every row; run meili_sync_snapshot({task_id}) to copy the table again",
            self.uid,
            if created_at.is_some() { " and re-created" } else { "" }
        ))
    }
}

/// A stream read its task's state change (pause, stop, alter, re-copy or drop) in the WAL.
pub fn log_state_change(task_id: i64) {
    log!("pg_meili_sync task {task_id}: read its state change in the WAL; it sends nothing that committed after it");
}

/// Decides when a resync helper stops streaming so that its index can be swapped in.
pub trait SwapGate {
    /// Called with the position read so far, and whether the last read found the end of the WAL;
    /// true to stop reading, drain, and end the stream at that position.
    fn ready_to_drain(&mut self, read_position: u64, caught_up: bool) -> Result<bool, Stop>;
}

/// Streams until SIGTERM (`Stop::Terminated`) or a permanent failure. With a `gate`, also until it
/// asks to drain: then reading stops, everything read is confirmed, and the position where the
/// stream ended is returned.
pub fn run(
    streamer: &mut Streamer<&mut Dispatcher>,
    task: &catalog::TaskRecord,
    watch: &mut IndexWatch,
    mut gate: Option<&mut dyn SwapGate>,
) -> Result<Option<u64>, Stop> {
    let mut session =
        DecodingSession::open(&task.slot_name, &task.publication_name).map_err(permanent)?;
    streamer.live.set_phase(Phase::Streaming);
    let mut caught_up = false;
    let mut draining = false;
    let mut busy_nap = busy_nap();
    let result = loop {
        if should_stop() {
            break Ok(None);
        }
        match streamer.settle() {
            Ok(Some(lsn)) => session.confirm(lsn),
            Ok(None) => {}
            Err(error) => break Err(error),
        }
        if caught_up {
            // Nothing unconfirmed (and dead letters stored): let the slot release WAL that other
            // tables wrote meanwhile.
            if let Some(position) = streamer.confirm_idle(session.read_position()) {
                session.confirm(position);
            }
        }
        if let Some(gate) = gate.as_deref_mut() {
            if draining && streamer.is_idle() {
                // Every record read is applied and confirmed: the stream ends exactly here.
                session.confirm(session.read_position());
                break Ok(Some(session.read_position()));
            }
            if !draining {
                match gate.ready_to_drain(session.read_position(), caught_up) {
                    Ok(ready) => draining = ready,
                    Err(error) => break Err(error),
                }
            }
        }
        if draining {
            streamer.end_read(true);
            if !BackgroundWorker::wait_latch(Some(Duration::from_millis(5))) {
                break Ok(None);
            }
            continue;
        }
        let records = match session.read(streamer, RECORDS_PER_ROUND) {
            Ok(records) => records,
            Err(error) => break Err(permanent(error)),
        };
        if streamer.has_ended() {
            // The task's state changed at this position: the slot keeps everything from the
            // last confirmed commit on, and the next worker (if any) goes on from there.
            log_state_change(task.id);
            break Ok(None);
        }
        caught_up = records == 0;
        if caught_up {
            if let Err(error) = watch.check(task.id) {
                break Err(permanent(error));
            }
        }
        streamer.end_read(caught_up);
        // Published before any nap, so that the status view shows a confirmation at once.
        streamer.publish(
            task.rows_copied,
            session.read_position(),
            session.confirmed(),
        );
        if caught_up {
            let moved = records > 0 || streamer.finished_more();
            let nap = if streamer.dispatcher_is_idle() {
                Duration::from_secs(1)
            } else {
                busy_nap.after_round(moved)
            };
            if !BackgroundWorker::wait_latch(Some(nap)) {
                break Ok(None);
            }
        }
    };
    session.close();
    result
}
