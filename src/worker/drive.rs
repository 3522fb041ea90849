//! The drive loop: the one loop that reads a slot, for a task's own slot and for the shared
//! decoder alike. A round stops on SIGTERM, gives its `Pass` the turn before the read (take in what
//! Meilisearch finished and confirm the slot that far, let a resync's gate decide whether to
//! drain, let tasks join or leave the shared pass), reads a round of WAL into it, gives it the turn
//! after the read (watch the index, hand on what was read, publish), and naps when nothing was
//! read. A new decoding context reads from the slot's confirmed position whenever the pass asks.
//!
//! What differs between a task's own slot (`OwnSlot`) and the shared decoder
//! (`shared::SharedDecoder`) is the `Pass` they implement; what differs between a table task's
//! stream (`stream::Streamer`) and a view task's (`render::ViewStream`) is the `TaskStream` they
//! implement, in either pass.
//!
//! Rewinds: a table task's stream lets a batch's body go once Meilisearch enqueued it. When
//! Meilisearch then fails such a batch, the dispatcher asks for a rewind (`needs_rewind`): the loop
//! logs it (`log_rewind`), gives the stream a fresh mapper and a rewound dispatcher (every
//! unconfirmed batch dropped), and reads again from the slot's confirmed position, holding the
//! batches of what it had read so that they are repaired as usual. `IndexWatch` compares the index's
//! `createdAt` every `meili_sync.index_check_interval` (a deleted or re-created index is a permanent
//! error); its client waits `LOOK_TIMEOUT` at most, since it runs on the main thread.

use std::time::{Duration, Instant};

use pgrx::bgworkers::BackgroundWorker;
use pgrx::prelude::*;

use pg_meili_sync_core::meili::client::Client;
use pg_meili_sync_core::pipeline::batch::ChangeBatcher;
use pg_meili_sync_core::pipeline::dispatch::{Dispatcher, Progress};
use pg_meili_sync_core::pipeline::due::Due;
use pg_meili_sync_core::pipeline::meter::CommitAges;
use pg_meili_sync_core::pipeline::pacing::{BusyNap, Throttle};
use pg_meili_sync_core::task::failure::{Failure, FailureKind};
use pg_meili_sync_core::wal::pgoutput::{self, Message};

use crate::catalog::{self, tasks::TaskRecord};
use crate::decode::session::{DecodingSession, MessageSink};
use crate::gucs;
use crate::shmem::live::{LiveStatus, Phase};
use crate::worker::control::{
    fail, in_transaction, reload_config_if_asked, report_progress, should_stop, Stop,
};

/// WAL records decoded between two looks at confirmations and signals.
pub const RECORDS_PER_ROUND: usize = 2000;

/// The nap of a round that read nothing while Meilisearch has nothing of the task's to do.
const IDLE_NAP: Duration = Duration::from_secs(1);

/// How often the drive loop asks a `SwapGate` at most: each look reads the catalog.
const GATE_CHECK_INTERVAL: Duration = Duration::from_millis(200);
/// How often a stream on its own slot checks that its publication is still as it was made: one
/// changed or dropped meanwhile (PostgreSQL 18 decodes on without a missing one) ends the
/// worker, whose next start mends it and copies the table again (`task::check_own_publication`).
const PUBLICATION_CHECK_INTERVAL: Duration = Duration::from_millis(500);

/// The nap of a round while a resync drains: the swap waits on it.
const DRAIN_NAP: Duration = Duration::from_millis(5);

/// The nap between rounds while Meilisearch has requests of ours: 5 ms right after a round that
/// moved something, doubling to 10 ms while none does (for a task's own loop and the shared
/// decoder's alike). The writer's threads cannot wake the main thread, so this nap is how late a
/// confirmation is taken in (and `meili_sync_wait` returns) at most; a round that finds nothing
/// costs a few channel reads per task.
pub fn busy_nap() -> BusyNap {
    BusyNap::new(Duration::from_millis(5), Duration::from_millis(10))
}

/// A watch of a task's stream (`PartitionWatch`, `ColumnsAddedWatch`) whose work on the index
/// waits until Meilisearch has everything the stream read up to a position (`Due`); the stream
/// holds the slot's confirmation before it meanwhile (`Due::holds`).
pub trait DueWork {
    fn due(&mut self) -> &mut Due;

    /// The work, once everything up to what is due is confirmed; what is due is then cleared.
    fn work(&mut self, live: LiveStatus) -> Result<(), Stop>;

    /// Does the work once everything up to what is due is confirmed (`settled`: the position the
    /// slot may be confirmed to), before the slot is confirmed past it. Returns the position the
    /// slot may then be confirmed to.
    fn when_due(&mut self, live: LiveStatus, settled: Option<u64>) -> Result<Option<u64>, Stop> {
        let Some(position) = self.due().reached(settled) else {
            return Ok(settled);
        };
        self.work(live)?;
        self.due().clear();
        Ok(Some(position))
    }
}

/// Takes each decoded message, parsed once by the pass that read it (the task's own slot, or the
/// shared pass, whose router hands the same parsed message to every task it concerns).
pub trait ParsedSink {
    fn message(&mut self, lsn: u64, message: &Message<'_>);
}

/// Parses one message of a read, for the pass's sink. A message that does not parse is a
/// permanent failure of the pass that read it, kept in `failure`; nothing after it is parsed or
/// handed on.
pub fn parse_in_read<'a>(data: &'a [u8], failure: &mut Option<Failure>) -> Option<Message<'a>> {
    if failure.is_some() {
        return None;
    }
    match pgoutput::parse(data) {
        Ok(message) => Some(message),
        Err(error) => {
            *failure = Some(Failure::new(
                FailureKind::Decoding,
                format!("cannot parse a pgoutput message: {error}"),
            ));
            None
        }
    }
}

/// What the drive loop asks of a task's stream. It is also the decoding callback's sink: reading
/// hands it each message, and everything it must do outside a callback happens in the other calls.
pub trait TaskStream: ParsedSink {
    /// The task's shared-memory status.
    fn live(&self) -> LiveStatus;

    /// Takes in what Meilisearch finished, stores dead letters and progress, and returns the
    /// position the index is now complete up to (None if it did not move). A failure of the task
    /// is permanent.
    fn settle(&mut self) -> Result<Option<u64>, Stop>;

    /// Caught up with nothing unconfirmed: the index is complete up to `read_position`, which is
    /// returned. None while anything is held.
    fn confirm_idle(&mut self, read_position: u64) -> Option<u64>;

    /// Everything read is applied and confirmed.
    fn is_idle(&self) -> bool;

    /// The stream's work between reads, before the next one; `nothing_coming`: the last read found
    /// the end of the WAL, or no read follows (a drain).
    fn before_read(&mut self, _nothing_coming: bool) -> Result<(), Stop> {
        Ok(())
    }

    /// Whether the next round may read (false while what was read waits for room).
    fn may_read(&self) -> bool {
        true
    }

    /// The stream read a state change of its task (pause, stop, alter, re-copy, drop): it must
    /// end there, never confirming past it.
    fn has_ended(&self) -> bool;

    /// The stream's work after a read; `nothing_coming` as for `before_read`.
    fn after_read(&mut self, nothing_coming: bool) -> Result<(), Stop>;

    /// What the status view shows of the stream.
    fn publish(&mut self, read_position: u64, confirmed: u64);

    /// Meilisearch has requests of the task's: the loop naps short.
    fn waits_on_meilisearch(&self) -> bool;

    /// Meilisearch finished a request since the last call: the nap starts short again.
    fn finished_more(&mut self) -> bool {
        false
    }

    /// Meilisearch failed a batch whose body was let go once enqueued (see
    /// `Dispatcher::push_rewindable`): the stream must read again from the position its index
    /// is complete up to.
    fn needs_rewind(&self) -> bool {
        false
    }

    /// Forgets everything read and not confirmed, for a read from the position the index is
    /// complete up to; the batches of what was read up to `careful_until` are held until
    /// confirmed this time, so that the failed one is repaired as usual.
    fn rewind(&mut self, _careful_until: u64) {}
}

/// A task's stream in the shared decoding pass (`worker::shared`), where one read serves many
/// tasks: the decoder never waits for one task, so a task that cannot keep up leaves the pass and
/// joins again, and a quiet task costs nothing in a round.
pub trait PassStream: TaskStream {
    fn dispatcher(&mut self) -> &mut Dispatcher;

    /// Nothing collected, sent or to report: `settle`, `before_read`, `after_read` and `publish`
    /// would change nothing but the shown read position, so the decoder's round skips it.
    fn is_quiet(&self) -> bool;

    /// The task cannot take more changes without holding up the others: it must leave the pass,
    /// and join again (reading from its confirmed position) once it is idle.
    fn is_stalled(&self) -> bool;

    /// Why the task left the pass, for the log.
    fn why_it_left(&self) -> String;

    /// Forgets what was read and must be read again when the task joins again (its confirmed
    /// position is where that starts), and takes changes again. What it keeps is sent while it
    /// is out of the pass (`hand_over_held`), so that what Meilisearch confirms moves that
    /// position on.
    fn restart(&mut self);

    /// Out of the pass: hands what it kept to the dispatcher as room comes. A failure stops the
    /// task.
    fn hand_over_held(&mut self) -> Result<(), Stop> {
        Ok(())
    }

    /// Bytes of documents read and not yet handed to the dispatcher (which counts its own).
    fn unsent_bytes(&self) -> usize;
}

/// What a task's stream keeps for the loop between reads, since decoding callbacks cannot act on
/// it: the progress Meilisearch reported (dead letters first), the failure that stops the task,
/// and the times of the commits read and not yet confirmed (for the lag in seconds).
#[derive(Default)]
pub struct Settlement {
    progress: Progress,
    failure: Option<Failure>,
    ages: CommitAges,
}

impl Settlement {
    /// Takes in what Meilisearch finished, waiting up to `wait`, and the dispatcher's failure.
    pub fn pump(&mut self, dispatcher: &mut Dispatcher, wait: Option<Duration>) {
        let progress = dispatcher.pump(wait);
        self.progress.absorb(progress);
        if let Some(failure) = dispatcher.take_failure() {
            self.fail(Failure::new(FailureKind::Meilisearch, failure));
        }
    }

    /// Hands `closed` batches to the dispatcher while it has room (see
    /// `Dispatcher::take_closed`); true when none is left.
    pub fn hand_over(&mut self, dispatcher: &mut Dispatcher, closed: &mut ChangeBatcher) -> bool {
        dispatcher.take_closed(closed, &mut self.progress)
    }

    /// The task fails with `failure` (the first failure is the one reported).
    pub fn fail(&mut self, failure: Failure) {
        self.failure.get_or_insert(failure);
    }

    pub fn has_failed(&self) -> bool {
        self.failure.is_some()
    }

    /// The failure, once: a read that failed the task ends the stream with it.
    pub fn take_failure(&mut self) -> Option<Failure> {
        self.failure.take()
    }

    /// Nothing to store and no failure.
    pub fn is_empty(&self) -> bool {
        self.progress.is_empty() && self.failure.is_none()
    }

    /// The commit times, noted while parsing.
    pub fn ages(&mut self) -> &mut CommitAges {
        &mut self.ages
    }

    /// `TaskStream::settle` for any stream: stores the dead letters and progress taken in (before
    /// the slot may move past them), then fails with the task's failure if it has one, and
    /// returns the position its index is now complete up to.
    pub fn settle(
        &mut self,
        task_id: i64,
        live: LiveStatus,
        dispatcher: &mut Dispatcher,
    ) -> Result<Option<u64>, Stop> {
        let progress = std::mem::take(&mut self.progress);
        report_progress(task_id, live, dispatcher, &progress, Phase::Streaming)?;
        if let Some(failure) = self.failure.take() {
            return Err(Stop::Failed(failure));
        }
        if let Some(lsn) = progress.checkpoint {
            self.ages.confirmed(lsn);
        }
        Ok(progress.checkpoint)
    }

    /// `TaskStream::confirm_idle` for any stream, given whether it holds nothing unconfirmed.
    pub fn confirm_idle(&mut self, idle: bool, read_position: u64) -> Option<u64> {
        idle.then(|| {
            self.ages.confirmed(read_position);
            read_position
        })
    }

    /// `TaskStream::publish` for any stream.
    pub fn publish(
        &self,
        live: LiveStatus,
        rows_copied: i64,
        dispatcher: &Dispatcher,
        positions: (u64, u64),
    ) {
        let (read_position, confirmed) = positions;
        live.set_progress(
            rows_copied,
            dispatcher.backlog(),
            dispatcher.writer().stats(),
        );
        live.set_stream_position(read_position, confirmed, self.ages.oldest());
    }
}

/// Where a stream's reading is, for its `SwapGate`.
pub struct Reading {
    /// The stream's shared-memory status.
    pub live: LiveStatus,
    /// The position read so far.
    pub position: u64,
    /// The last read found the end of the WAL.
    pub caught_up: bool,
}

/// Decides when a resync helper stops streaming so that its index can be swapped in, or a task
/// moving to the shared pass stops reading its own slot.
pub trait SwapGate {
    /// Called with where the stream's reading is, at most once per `GATE_CHECK_INTERVAL`; true to
    /// stop reading, drain, and end the stream at that position.
    fn ready_to_drain(&mut self, reading: &Reading) -> Result<bool, Stop>;
}

/// Logs a stream's rewind (see `TaskStream::needs_rewind`).
pub fn log_rewind(task_id: i64, confirmed: u64, read_position: u64) {
    log!(
        "pg_meili_sync task {task_id}: Meilisearch failed a batch the worker no longer held; it reads again from {} (it had read up to {})",
        catalog::format_lsn(confirmed),
        catalog::format_lsn(read_position)
    );
}

/// A stream read its task's state change (pause, stop, alter, re-copy or drop) in the WAL.
pub fn log_state_change(task_id: i64) {
    log!("pg_meili_sync task {task_id}: read its state change in the WAL; it sends nothing that committed after it");
}

/// Streams `task` from its own slot until SIGTERM (`Ok(None)`), its state change in the WAL
/// (`Ok(None)`), or a permanent failure. With a `gate`, also until it asks to drain: then reading
/// stops, everything read is applied and confirmed, and the position where the stream ended is
/// returned.
pub fn drive(
    stream: &mut impl TaskStream,
    task: &TaskRecord,
    watch: &mut IndexWatch,
    gate: Option<&mut dyn SwapGate>,
) -> Result<Option<u64>, Stop> {
    stream.live().set_phase(Phase::Streaming);
    let mut own_slot = OwnSlot {
        stream,
        task_id: task.id,
        publication: &task.publication_name,
        publication_checks: Throttle::new(PUBLICATION_CHECK_INTERVAL),
        watch,
        gate,
        draining: false,
        gate_checks: Throttle::new(GATE_CHECK_INTERVAL),
        parse_failure: None,
    };
    drive_pass(&mut own_slot, &task.slot_name, &task.publication_name)
}

/// What a round does after the pass's turn before the read.
pub enum Turn {
    /// Read a round of WAL.
    Read,
    /// Read nothing this round (a drain, or what was read waits for room).
    Hold,
    /// Read again from the slot's confirmed position, in a new decoding context.
    ReadAgain,
    /// The pass ends: stopped (None), or drained to this position.
    End(Option<u64>),
}

/// How long a round that read nothing naps.
pub enum Nap {
    /// Meilisearch has requests of the pass's: `busy_nap`, short again once it `finished_more`.
    Busy {
        finished_more: bool,
    },
    For(Duration),
}

/// What the drive loop reads one slot for: a task's stream on its own slot (`OwnSlot`), or the
/// shared decoder with the streams of every task attached to it (`worker::shared`).
pub trait Pass {
    /// The round's work before its read: take in what Meilisearch finished, confirm the slot,
    /// let tasks join or leave, and decide whether to read.
    fn before_read(&mut self, session: &mut DecodingSession, caught_up: bool)
        -> Result<Turn, Stop>;

    /// What the read hands each decoded message to.
    fn sink(&mut self) -> &mut dyn MessageSink;

    /// The round's work after its read (`caught_up`: the last read found the end of the WAL):
    /// watch the index, hand on what was read, publish. True when the pass ends here, at a state
    /// change it read.
    fn after_read(&mut self, session: &DecodingSession, caught_up: bool) -> Result<bool, Stop>;

    /// The nap of a round that read nothing.
    fn nap(&mut self) -> Nap;
}

/// Reads the slot for `pass` until it ends (see `Turn::End`), SIGTERM (`Ok(None)`), or a
/// failure that stops it, in a new decoding context whenever it asks to read again.
pub fn drive_pass(
    pass: &mut impl Pass,
    slot: &str,
    publication: &str,
) -> Result<Option<u64>, Stop> {
    loop {
        // A new decoding context reads from the slot's confirmed position.
        let mut session = DecodingSession::open(slot, publication)
            .map_err(|error| fail(FailureKind::Decoding, error.to_string()))?;
        let result = rounds(&mut session, pass);
        session.close();
        match result? {
            Ended::ReadAgain => continue,
            Ended::At(position) => return Ok(position),
        }
    }
}

/// How the rounds of one decoding context ended.
enum Ended {
    /// Stopped, or drained to this position (see `Turn::End`).
    At(Option<u64>),
    /// The pass reads again from the slot's confirmed position.
    ReadAgain,
}

fn rounds(session: &mut DecodingSession, pass: &mut impl Pass) -> Result<Ended, Stop> {
    let mut caught_up = false;
    let mut busy_nap = busy_nap();
    loop {
        if should_stop() {
            return Ok(Ended::At(None));
        }
        reload_config_if_asked();
        let read = match pass.before_read(session, caught_up)? {
            Turn::Read => true,
            Turn::Hold => false,
            Turn::ReadAgain => return Ok(Ended::ReadAgain),
            Turn::End(position) => return Ok(Ended::At(position)),
        };
        let mut records = 0;
        if read {
            records = session
                .read(pass.sink(), RECORDS_PER_ROUND)
                .map_err(|error| fail(FailureKind::Decoding, error.to_string()))?;
            caught_up = records == 0;
        }
        if pass.after_read(session, caught_up)? {
            return Ok(Ended::At(None));
        }
        if records == 0 {
            let nap = match pass.nap() {
                Nap::Busy { finished_more } => busy_nap.after_round(finished_more),
                Nap::For(nap) => nap,
            };
            if !BackgroundWorker::wait_latch(Some(nap)) {
                return Ok(Ended::At(None));
            }
        }
    }
}

/// One task's stream on the task's own slot, with the gate of a resync helper or of a move to
/// the shared pass.
struct OwnSlot<'a, 'gate, S: TaskStream> {
    stream: &'a mut S,
    task_id: i64,
    publication: &'a str,
    publication_checks: Throttle,
    watch: &'a mut IndexWatch,
    gate: Option<&'a mut (dyn SwapGate + 'gate)>,
    /// The gate asked to drain: nothing more is read.
    draining: bool,
    gate_checks: Throttle,
    /// A message of the last read that could not be parsed: it stops the task.
    parse_failure: Option<Failure>,
}

/// The read's sink: each message is parsed here, once, and handed to the task's stream.
impl<S: TaskStream> MessageSink for OwnSlot<'_, '_, S> {
    fn message(&mut self, lsn: u64, data: &[u8]) {
        if let Some(message) = parse_in_read(data, &mut self.parse_failure) {
            self.stream.message(lsn, &message);
        }
    }
}

impl<S: TaskStream> Pass for OwnSlot<'_, '_, S> {
    fn before_read(
        &mut self,
        session: &mut DecodingSession,
        caught_up: bool,
    ) -> Result<Turn, Stop> {
        if !self.draining && self.publication_checks.due(Instant::now()) {
            let publication = self.publication;
            let check = in_transaction(
                self.stream.live(),
                "checking the task's publication",
                || catalog::replication::check_publication(publication, &[], &[], false),
            )?;
            if let catalog::replication::PublicationCheck::Mended(what) = check {
                warning!(
                    "pg_meili_sync task {}: publication \"{publication}\" {what}; the worker starts again to mend it",
                    self.task_id
                );
                return Err(Stop::Terminated);
            }
        }
        if let Some(lsn) = self.stream.settle()? {
            session.confirm(lsn);
        }
        if self.stream.needs_rewind() {
            log_rewind(self.task_id, session.confirmed(), session.read_position());
            self.stream.rewind(session.read_position());
            // What the gate saw is read again: it decides again.
            self.draining = false;
            return Ok(Turn::ReadAgain);
        }
        if caught_up {
            // Nothing unconfirmed (and dead letters stored): let the slot release WAL that other
            // tables wrote meanwhile.
            if let Some(position) = self.stream.confirm_idle(session.read_position()) {
                session.confirm(position);
            }
        }
        if let Some(gate) = self.gate.as_deref_mut() {
            if self.draining && self.stream.is_idle() {
                // Every record read is applied and confirmed: the stream ends exactly here.
                session.confirm(session.read_position());
                return Ok(Turn::End(Some(session.read_position())));
            }
            if !self.draining && self.gate_checks.due(Instant::now()) {
                let reading = Reading {
                    live: self.stream.live(),
                    position: session.read_position(),
                    caught_up,
                };
                self.draining = gate.ready_to_drain(&reading)?;
            }
        }
        self.stream.before_read(caught_up || self.draining)?;
        Ok(if !self.draining && self.stream.may_read() {
            Turn::Read
        } else {
            Turn::Hold
        })
    }

    fn sink(&mut self) -> &mut dyn MessageSink {
        self
    }

    fn after_read(&mut self, session: &DecodingSession, caught_up: bool) -> Result<bool, Stop> {
        if let Some(failure) = self.parse_failure.take() {
            return Err(Stop::Failed(failure));
        }
        if self.stream.has_ended() {
            // The task's state changed at this position: the slot keeps everything from the
            // last confirmed commit on, and the next worker (if any) goes on from there.
            log_state_change(self.task_id);
            return Ok(true);
        }
        if caught_up {
            self.watch.check()?;
        }
        self.stream.after_read(caught_up || self.draining)?;
        // Published before any nap, so that the status view shows a confirmation at once.
        self.stream
            .publish(session.read_position(), session.confirmed());
        Ok(false)
    }

    fn nap(&mut self) -> Nap {
        if self.draining {
            Nap::For(DRAIN_NAP)
        } else if self.stream.waits_on_meilisearch() {
            Nap::Busy {
                finished_more: self.stream.finished_more(),
            }
        } else {
            Nap::For(IDLE_NAP)
        }
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

/// How long a look at the task's index may wait for Meilisearch: it runs on the worker's own
/// thread, which a server that stopped answering must not hold up (the writer's threads wait for
/// it instead).
const LOOK_TIMEOUT: Duration = Duration::from_secs(1);

impl IndexWatch {
    /// A watch of the task's index, whose `createdAt` (None: not known) the task started with.
    pub fn new(task: &TaskRecord, created_at: Option<String>) -> Result<Self, Stop> {
        let client = Client::new(&task.url, task.api_key.as_deref(), LOOK_TIMEOUT)
            .map_err(|error| fail(FailureKind::Source, error.to_string()))?;
        Ok(IndexWatch {
            client,
            uid: task.index_uid.clone(),
            created_at,
            last_check: Instant::now(),
        })
    }

    /// A watch of the task's index as Meilisearch gives it now (unknown while it does not
    /// answer within `LOOK_TIMEOUT`).
    pub fn looking_now(task: &TaskRecord) -> Result<Self, Stop> {
        let mut watch = IndexWatch::new(task, None)?;
        watch.created_at = watch
            .client
            .get_index(&watch.uid)
            .ok()
            .flatten()
            .and_then(|index| index.created_at);
        Ok(watch)
    }

    /// Checks at most once per `meili_sync.index_check_interval`; unreachable servers are the
    /// writer's business, not a verdict here.
    pub fn check(&mut self) -> Result<(), Failure> {
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
        Err(Failure::new(
            FailureKind::Index,
            format!(
                "index \"{}\" was deleted{} outside pg_meili_sync, so it no longer holds every row",
                self.uid,
                if created_at.is_some() {
                    " and re-created"
                } else {
                    ""
                }
            ),
        ))
    }
}
