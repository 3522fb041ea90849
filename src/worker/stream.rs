//! The streaming phase of a task worker: decodes the slot in process, maps each committed change
//! to a Meilisearch operation, and confirms the slot only up to the newest commit whose batches
//! Meilisearch has all confirmed.

use std::time::{Duration, Instant};

use pgrx::bgworkers::BackgroundWorker;
use pgrx::prelude::*;

use crate::batch::BatchLimits;
use crate::batch::Operation;
use crate::catalog;
use crate::changes::ChangeMapper;
use crate::decode::session::{DecodingSession, MessageSink};
use crate::dispatch::{item_id, DeadLetter, Dispatcher, Progress};
use crate::gucs;
use crate::meili::client::Client;
use crate::meter::CommitAges;
use crate::options::{TaskOptions, WriteMode};
use crate::pgoutput;
use crate::plan::ColumnRules;
use crate::shmem::{LiveStatus, Phase};
use crate::worker::control::{permanent, report_progress, should_stop, Stop};

/// WAL records decoded between two looks at confirmations and signals.
const RECORDS_PER_ROUND: usize = 2000;

pub struct Streamer<'d> {
    task_id: i64,
    live: LiveStatus,
    dispatcher: &'d mut Dispatcher,
    rules: ColumnRules,
    primary_key: String,
    mapper: ChangeMapper,
    /// Collected inside decoding callbacks, acted on by the main loop (dead letters first).
    progress: Progress,
    failure: Option<String>,
    /// For the lag in seconds: commits decoded and not yet confirmed.
    ages: CommitAges,
}

impl<'d> Streamer<'d> {
    pub fn new(
        task_id: i64,
        live: LiveStatus,
        dispatcher: &'d mut Dispatcher,
        rules: ColumnRules,
        limits: BatchLimits,
        options: &TaskOptions,
    ) -> Self {
        let primary_key = dispatcher.primary_key().to_owned();
        Streamer {
            task_id,
            live,
            dispatcher,
            primary_key,
            rules,
            mapper: ChangeMapper::new(limits, options.write_mode == WriteMode::Upsert),
            progress: Progress::default(),
            failure: None,
            ages: CommitAges::default(),
        }
    }

    fn pump(&mut self, wait: Option<Duration>) {
        let progress = self.dispatcher.pump(wait);
        if progress.checkpoint.is_some() {
            self.progress.checkpoint = progress.checkpoint;
        }
        self.progress.retries.extend(progress.retries);
        if let Some(failure) = self.dispatcher.take_failure() {
            self.failure.get_or_insert(failure);
        }
    }

    /// Moves closed batches to the dispatcher, in order. With `block`, waits (handling
    /// confirmations) until all are taken: that wait is the back pressure that stops reading the
    /// slot, and it keeps memory bounded inside one huge transaction.
    fn send_ready(&mut self, block: bool) {
        loop {
            self.pump(None);
            while self.dispatcher.has_room() {
                match self.mapper.next_ready() {
                    Some(batch) => self.dispatcher.push(batch),
                    None => break,
                }
            }
            if !self.mapper.has_ready() {
                // Only now, behind every batch before it, may a commit that sent nothing count.
                if let Some(checkpoint) = self.mapper.take_pending_checkpoint() {
                    if let Some(lsn) = self.dispatcher.standalone(checkpoint) {
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
            self.pump(Some(Duration::from_millis(20)));
        }
    }

    /// Rows that could not become documents go to the dead letters (stored by the main loop
    /// before the slot moves past them).
    fn report_skipped(&mut self) {
        for skipped in self.mapper.take_skipped() {
            self.dispatcher.add_dead_letter(DeadLetter {
                id: item_id(Operation::Replace, &skipped.document, &self.primary_key)
                    .unwrap_or(serde_json::Value::Null),
                op: Operation::Replace,
                document: skipped.document,
                code: skipped.code.to_owned(),
                message: skipped.reason,
                task_uid: None,
                checkpoint: None,
            });
        }
    }

    fn is_idle(&self) -> bool {
        self.mapper.is_idle() && self.dispatcher.is_idle()
    }
}

impl MessageSink for Streamer<'_> {
    fn message(&mut self, _lsn: u64, data: &[u8]) {
        if self.failure.is_some() {
            return;
        }
        let message = match pgoutput::parse(data) {
            Ok(message) => message,
            Err(error) => {
                self.failure = Some(format!("cannot parse a pgoutput message: {error}"));
                return;
            }
        };
        if let pgoutput::Message::Commit {
            end_lsn,
            commit_time,
            ..
        } = &message
        {
            self.ages.committed(*end_lsn, *commit_time);
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
    fn check(&mut self, task_id: i64) -> Result<(), String> {
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
    streamer: &mut Streamer<'_>,
    task: &catalog::TaskRecord,
    watch: &mut IndexWatch,
    mut gate: Option<&mut dyn SwapGate>,
) -> Result<Option<u64>, Stop> {
    let mut session =
        DecodingSession::open(&task.slot_name, &task.publication_name).map_err(permanent)?;
    streamer.live.set_phase(Phase::Streaming);
    let mut caught_up = false;
    let mut draining = false;
    let result = loop {
        if should_stop() {
            break Ok(None);
        }
        streamer.pump(None);
        // Dead letters are stored before the slot moves past them.
        let progress = std::mem::take(&mut streamer.progress);
        if let Err(error) = report_progress(
            streamer.task_id,
            streamer.live,
            streamer.dispatcher,
            &progress,
            Phase::Streaming,
        ) {
            break Err(error);
        }
        if let Some(failure) = streamer.failure.take() {
            break Err(permanent(failure));
        }
        if let Some(lsn) = progress.checkpoint {
            session.confirm(lsn);
            streamer.ages.confirmed(lsn);
        }
        if caught_up && streamer.is_idle() {
            // Nothing unconfirmed (and dead letters stored): let the slot release WAL that other
            // tables wrote meanwhile.
            session.confirm(session.read_position());
            streamer.ages.confirmed(session.read_position());
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
            streamer.mapper.flush();
            streamer.send_ready(false);
            if !BackgroundWorker::wait_latch(Some(Duration::from_millis(5))) {
                break Ok(None);
            }
            continue;
        }
        let records = match session.read(streamer, RECORDS_PER_ROUND) {
            Ok(records) => records,
            Err(error) => break Err(permanent(error)),
        };
        caught_up = records == 0;
        if caught_up {
            if let Err(error) = watch.check(task.id) {
                break Err(permanent(error));
            }
            // Nothing else is coming to fill the open batch, so send it now.
            streamer.mapper.flush();
        } else {
            streamer.mapper.flush_due(Instant::now());
        }
        streamer.send_ready(false);
        // Published before any nap, so that the status view shows a confirmation at once.
        streamer.live.set_progress(
            task.rows_copied,
            streamer.dispatcher.backlog(),
            streamer.dispatcher.writer().stats(),
        );
        streamer.live.set_stream_position(
            session.read_position(),
            session.confirmed(),
            streamer.ages.oldest(),
        );
        if caught_up {
            let nap = if streamer.dispatcher.is_idle() {
                Duration::from_secs(1)
            } else {
                Duration::from_millis(5)
            };
            if !BackgroundWorker::wait_latch(Some(nap)) {
                break Ok(None);
            }
        }
    };
    session.close();
    result
}
