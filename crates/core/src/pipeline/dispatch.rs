//! Hands batches to the writer in order, follows their confirmations to the checkpoint watermark,
//! and repairs batches that Meilisearch failed (pure: no pgrx).
//!
//! What a failed batch needs depends on Meilisearch's error `type` and `code`, not only on the
//! HTTP status (see [`Remedy`]). A batch refused for its documents is split in halves and resent
//! until the documents that make it fail are isolated; only those become dead letters. A batch
//! the server failed for its own reasons (`internal`, `system`, a canceled or vanished task) is
//! resent whole after a backoff. Either way, documents that a batch sent after it already
//! replaced or deleted are left out of the resend, so an older version never overwrites a newer
//! one, and the watermark does not pass a failed batch until all of its parts are confirmed or
//! dead-lettered.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::meili::client::{MeiliError, MeiliErrorBody};
use crate::meili::request::{Batch, Operation};
use crate::meili::retry::Backoff;
use crate::meili::writer::{WriteError, Writer, WriterEvent};
use crate::pipeline::batch::{ChangeBatcher, Watermark};

/// How many times a batch is sent again whole because a document of another task failed
/// Meilisearch's batch, before it is split like one refused for its own documents.
const MAX_COLLATERAL_RESENDS: u32 = 32;

/// Seqs of repair batches start here, far above any batcher's seqs.
const REPAIR_SEQ_BASE: u64 = 1 << 62;

/// A document Meilisearch refused on its own, with the reason.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    /// The document id as JSON (`42` or `"abc"`), or null when it could not be read.
    pub id: Value,
    pub op: Operation,
    /// The document (or, for a delete, the id) as sent.
    pub document: Vec<u8>,
    pub code: String,
    pub message: String,
    pub task_uid: Option<u64>,
    /// The checkpoint (commit LSN or snapshot page) of the batch it came from.
    pub checkpoint: Option<u64>,
}

struct SentBatch {
    /// Position in send order (seqs of repair parts do not follow it).
    order: u64,
    op: Operation,
    /// Emptied once Meilisearch enqueued a batch the owner can read again (see
    /// [`Dispatcher::push_rereadable`]).
    body: Arc<Vec<u8>>,
    /// The body was let go: a failure waits for [`Dispatcher::reread`].
    released: bool,
    checkpoint: Option<u64>,
    /// For a repair part: the original batch it belongs to.
    parent: Option<u64>,
}

/// What happened while handling writer events.
#[derive(Debug, Default)]
pub struct Progress {
    /// The newest checkpoint that became safe (every batch up to it confirmed or dead-lettered).
    pub checkpoint: Option<u64>,
    /// Errors of requests the writer is retrying.
    pub retries: Vec<String>,
    /// Meilisearch answered a request of the task (took a batch, or finished one): its requests
    /// go through again after retries, even before a checkpoint is safe.
    pub answered: bool,
    /// Things the task learned that belong in the server log once (a server's payload limit).
    pub notices: Vec<String>,
}

impl Progress {
    /// Nothing to store or report.
    pub fn is_empty(&self) -> bool {
        self.checkpoint.is_none()
            && self.retries.is_empty()
            && self.notices.is_empty()
            && !self.answered
    }

    /// Adds what a later `pump` reported: its checkpoint is the newer one.
    pub fn absorb(&mut self, later: Progress) {
        if later.checkpoint.is_some() {
            self.checkpoint = later.checkpoint;
        }
        self.retries.extend(later.retries);
        self.notices.extend(later.notices);
        self.answered |= later.answered;
    }
}

pub struct Dispatcher {
    writer: Writer,
    primary_key: String,
    /// Batches held in memory (queued, or sent and not let go) at most.
    max_inflight: usize,
    /// Batches queued or sent and unresolved at most; above `max_inflight` only through batches
    /// whose bodies are let go once enqueued (see [`Dispatcher::push_rereadable`]).
    depth: usize,
    /// Original batches the owner can read again from their source.
    rereadable: HashSet<u64>,
    /// Closed batches are pushed with [`Dispatcher::push_rewindable`] (a stream with a deep
    /// queue, see [`Dispatcher::set_stream_depth`]).
    rewinds: bool,
    /// Bodies held may number more than `max_inflight` while they weigh no more than
    /// `max_inflight` full requests (see [`Dispatcher::set_held_depth`]).
    holds_by_weight: bool,
    /// Original batches the owner can decode again from its confirmed position.
    rewindable: HashSet<u64>,
    /// After a rewind: batches are held until the one whose checkpoint reaches this position
    /// (everything read before the rewind) is pushed.
    careful_until: Option<u64>,
    /// Meilisearch failed a batch whose body was let go: the owner must rewind.
    rewind_needed: bool,
    /// Failed batches whose bodies were let go, waiting for the owner to read them again:
    /// seq → (task uid, error, asked for already).
    rereads: BTreeMap<u64, (Option<u64>, WriteError, bool)>,
    /// A document alone over this many bytes is a dead letter: Meilisearch would refuse it.
    max_payload: usize,
    /// A checkpoint that became safe outside an event (a document too large to send).
    ready_checkpoint: Option<u64>,
    watermark: Watermark,
    sent: HashMap<u64, SentBatch>,
    /// Batches confirmed while a batch sent before them was not: should that one fail, its
    /// resend must know what they wrote (kept until no earlier batch is unresolved).
    landed: Vec<SentBatch>,
    next_order: u64,
    /// Repair parts not yet sent, with their parent.
    parents: HashMap<u64, u64>,
    /// Original failed batch → parts not yet resolved.
    open_repairs: HashMap<u64, usize>,
    queue: VecDeque<Batch>,
    /// Resends of batches the server failed, each due after its backoff.
    delayed: Vec<(Instant, Batch)>,
    /// Original batch → resends so far, for the backoff.
    resends: HashMap<u64, u32>,
    /// Original batch → times it was failed by another task's document (see
    /// [`Dispatcher::failed_by_another_task`]).
    collateral: HashMap<u64, u32>,
    backoff: Backoff,
    next_repair_seq: u64,
    dead_letters: Vec<DeadLetter>,
    failure: Option<String>,
    /// The owner's memory budget (shared by many dispatchers) is spent: no room while anything
    /// is unresolved (see [`Dispatcher::set_squeezed`]).
    squeezed: bool,
}

impl Dispatcher {
    pub fn new(writer: Writer, primary_key: &str, max_inflight: usize, max_payload: usize) -> Self {
        Dispatcher {
            writer,
            primary_key: primary_key.to_owned(),
            max_inflight: max_inflight.max(1),
            depth: max_inflight.max(1),
            rereadable: HashSet::new(),
            rewinds: false,
            holds_by_weight: false,
            rewindable: HashSet::new(),
            careful_until: None,
            rewind_needed: false,
            rereads: BTreeMap::new(),
            max_payload,
            ready_checkpoint: None,
            watermark: Watermark::new(),
            sent: HashMap::new(),
            landed: Vec::new(),
            next_order: 0,
            parents: HashMap::new(),
            open_repairs: HashMap::new(),
            queue: VecDeque::new(),
            delayed: Vec::new(),
            resends: HashMap::new(),
            collateral: HashMap::new(),
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(30)),
            next_repair_seq: REPAIR_SEQ_BASE,
            dead_letters: Vec::new(),
            failure: None,
            squeezed: false,
        }
    }

    /// The attribute Meilisearch uses as the documents' primary key.
    pub fn primary_key(&self) -> &str {
        &self.primary_key
    }

    pub fn writer(&self) -> &Writer {
        &self.writer
    }

    pub fn shutdown(self) {
        self.writer.shutdown();
    }

    /// Queues a closed batch; `pump` sends it, in order.
    pub fn push(&mut self, batch: Batch) {
        self.watermark.sent(batch.seq, batch.checkpoint);
        self.queue.push_back(batch);
    }

    /// Lets up to `depth` batches be enqueued in Meilisearch and unconfirmed at once, of which
    /// at most `max_inflight` held in memory: Meilisearch indexes the tasks of an index that are
    /// enqueued together as one auto-batch, each with a large fixed cost, so a deep queue makes
    /// fewer, larger batches. Only batches pushed with [`Dispatcher::push_rereadable`] go past
    /// `max_inflight`. A depth up to `max_inflight` (0, say) turns the deep queue off.
    pub fn set_depth(&mut self, depth: usize) {
        self.depth = depth.max(self.max_inflight);
        if self.depth == self.max_inflight && self.is_idle() {
            // Seqs start over with the next batcher: none of its batches may be taken for one
            // of these.
            self.rereadable.clear();
        }
    }

    /// A stream's deep queue: up to `depth` batches enqueued in Meilisearch and unconfirmed, of
    /// which at most `max_inflight` held in memory. Closed batches are pushed with
    /// [`Dispatcher::push_rewindable`]. A depth up to `max_inflight` turns it off.
    pub fn set_stream_depth(&mut self, depth: usize) {
        self.set_depth(depth);
        if self.is_idle() {
            // Seqs start over with the stream's batcher.
            self.rereadable.clear();
        }
        self.rewinds = self.depth > self.max_inflight;
    }

    /// A deep queue whose bodies are all held until confirmed (a view's, whose rendered
    /// documents cannot be decoded again): up to `depth` batches enqueued and unconfirmed, as long
    /// as the bodies held weigh no more than `max_inflight` requests of the largest size
    /// (`max_payload`), the bound a queue of `max_inflight` has. Small documents then reach
    /// Meilisearch together, and it indexes them in fewer, larger batches.
    pub fn set_held_depth(&mut self, depth: usize) {
        self.set_depth(depth);
        self.holds_by_weight = self.depth > self.max_inflight;
    }

    /// [`Dispatcher::push`] for a batch of a stream, which the owner can decode again from the
    /// position its index is complete up to (the slot has not moved past it): its body is let go
    /// once Meilisearch has enqueued it, unless a batch before it is held (a resend of that one
    /// must know what this one wrote). Should a batch whose body was let go fail, nothing more
    /// is sent and [`Dispatcher::needs_rewind`] asks the owner to read again from there
    /// ([`Dispatcher::rewind`]). After a rewind, batches are held until the stream is past where
    /// it was, so that the failed one is repaired as usual this time.
    pub fn push_rewindable(&mut self, batch: Batch) {
        match self.careful_until {
            Some(until) => {
                if batch
                    .checkpoint
                    .is_some_and(|checkpoint| checkpoint >= until)
                {
                    self.careful_until = None;
                }
            }
            None => {
                self.rewindable.insert(batch.seq);
            }
        }
        self.push(batch);
    }

    /// Meilisearch failed a batch whose body was let go (see [`Dispatcher::push_rewindable`]):
    /// nothing more is sent or taken until the owner calls [`Dispatcher::rewind`].
    pub fn needs_rewind(&self) -> bool {
        self.rewind_needed
    }

    /// Forgets every batch not yet confirmed, with the writer threads that were sending them
    /// (started again, with signals as the caller set them), for a stream that reads again from
    /// the position its index is complete up to. The batches of the changes read up to
    /// `careful_until` are held until confirmed. Dead letters not yet taken stay.
    pub fn rewind(&mut self, careful_until: u64) {
        self.writer.start_again();
        self.rewindable.clear();
        self.rereadable.clear();
        self.rereads.clear();
        self.careful_until = Some(careful_until);
        self.rewind_needed = false;
        self.watermark = Watermark::new();
        self.sent.clear();
        self.landed.clear();
        self.next_order = 0;
        self.parents.clear();
        self.open_repairs.clear();
        self.queue.clear();
        self.delayed.clear();
        self.resends.clear();
        self.collateral.clear();
        self.next_repair_seq = REPAIR_SEQ_BASE;
    }

    /// Whether a batch (or repair part) of an original batch before `seq` is unresolved with
    /// its body held: it may be sent again, and must then know what `seq` wrote.
    fn holds_older_than(&self, seq: u64) -> bool {
        let original = |part: u64| self.parents.get(&part).copied().unwrap_or(part);
        self.open_repairs.keys().any(|&parent| parent < seq)
            || self.rereads.keys().any(|&failed| failed < seq)
            || self
                .delayed
                .iter()
                .any(|(_, batch)| original(batch.seq) < seq)
            || self.queue.iter().any(|batch| original(batch.seq) < seq)
            || self
                .sent
                .iter()
                .any(|(&sent, batch)| !batch.released && batch.parent.unwrap_or(sent) < seq)
    }

    /// The seq of the oldest batch not yet confirmed or dead-lettered (None when all are).
    pub fn oldest_unresolved(&self) -> Option<u64> {
        self.watermark.oldest_pending()
    }

    /// [`Dispatcher::push`] for a batch the owner can build again from its source (a copy's key
    /// range), and whose documents no other batch writes: its body is let go once Meilisearch
    /// has enqueued it (so a resend of another batch, which leaves out what later batches wrote,
    /// need not read it). Should it fail, its seq comes
    /// out of [`Dispatcher::take_rereads`], and its repair waits for [`Dispatcher::reread`].
    pub fn push_rereadable(&mut self, batch: Batch) {
        self.rereadable.insert(batch.seq);
        self.push(batch);
    }

    /// Failed batches whose bodies were let go: the owner reads each again and hands it to
    /// [`Dispatcher::reread`]. Each seq is returned once.
    pub fn take_rereads(&mut self) -> Vec<u64> {
        self.rereads
            .iter_mut()
            .filter(|(_, (_, _, asked))| !*asked)
            .map(|(seq, (_, _, asked))| {
                *asked = true;
                *seq
            })
            .collect()
    }

    /// The body of failed batch `seq` read again (the documents its source holds now: rows
    /// deleted since are left out, rows inserted since come along), so that its repair goes on.
    pub fn reread(&mut self, seq: u64, body: Vec<u8>) -> Progress {
        let mut progress = Progress::default();
        let Some((task_uid, error, _)) = self.rereads.remove(&seq) else {
            return progress;
        };
        if let Some(batch) = self.sent.get_mut(&seq) {
            batch.body = Arc::new(body);
            batch.released = false;
        }
        self.repair(seq, task_uid, &error, &mut progress);
        self.send_queued();
        progress
    }

    /// Bytes of batch bodies this dispatcher holds (queued, sent and not let go, or kept for a
    /// resend's rules).
    pub fn held_bytes(&self) -> usize {
        self.queue
            .iter()
            .map(|batch| batch.body.len())
            .sum::<usize>()
            + self
                .delayed
                .iter()
                .map(|(_, batch)| batch.body.len())
                .sum::<usize>()
            + self
                .sent
                .values()
                .map(|batch| batch.body.len())
                .sum::<usize>()
            + self
                .landed
                .iter()
                .map(|batch| batch.body.len())
                .sum::<usize>()
    }

    /// A checkpoint with no batch (a commit that sent nothing): safe once everything before it is.
    pub fn standalone(&mut self, checkpoint: u64) -> Option<u64> {
        self.watermark.standalone(checkpoint)
    }

    /// Queues `batcher`'s closed batches, in order, while there is room. True once every one is
    /// queued: only then, behind every batch before it, does a commit that sent nothing count,
    /// and `progress` gets the checkpoint that made safe.
    pub fn take_closed(&mut self, batcher: &mut ChangeBatcher, progress: &mut Progress) -> bool {
        while self.has_room() {
            match batcher.next_closed() {
                Some(batch) if self.rewinds => self.push_rewindable(batch),
                Some(batch) => self.push(batch),
                None => break,
            }
        }
        if batcher.has_closed() {
            return false;
        }
        if let Some(checkpoint) = batcher.take_pending_checkpoint() {
            if let Some(lsn) = self.standalone(checkpoint) {
                progress.checkpoint = Some(lsn);
            }
        }
        true
    }

    /// Batches queued or sent and not yet resolved. The owner produces no more while this is at
    /// `max_inflight`: that bounds memory and is the back pressure on reading the source.
    pub fn backlog(&self) -> usize {
        self.queue.len() + self.sent.len() + self.landed.len()
    }

    /// Room for another batch: fewer than `max_inflight` held in memory, and fewer than `depth`
    /// unresolved; when squeezed, nothing unresolved at all.
    pub fn has_room(&self) -> bool {
        if self.rewind_needed {
            return false;
        }
        if self.squeezed {
            return self.backlog() == 0;
        }
        if self.backlog() >= self.depth {
            return false;
        }
        let released = self.sent.values().filter(|batch| batch.released).count()
            + self.landed.iter().filter(|batch| batch.released).count();
        self.backlog() - released < self.max_inflight
            || (self.holds_by_weight
                && self.held_bytes() + self.max_payload
                    <= self.max_inflight.saturating_mul(self.max_payload))
    }

    /// Set while the batches of all the dispatchers that share a memory budget (the tasks of
    /// one shared decoder) hold more than it: this one then takes a new batch only once all it
    /// sent is resolved. One batch each is always allowed, so no task waits on another's
    /// Meilisearch.
    pub fn set_squeezed(&mut self, squeezed: bool) {
        self.squeezed = squeezed;
    }

    /// Nothing queued, in flight, or being repaired.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty()
            && self.delayed.is_empty()
            && self.sent.is_empty()
            && self.watermark.inflight() == 0
            && !self.rewind_needed
    }

    /// Idle, and nothing for `pump`, `take_dead_letters` or `take_failure` to hand over: a caller
    /// with many dispatchers may skip this one until it is given a batch.
    pub fn is_quiet(&self) -> bool {
        self.is_idle()
            && self.ready_checkpoint.is_none()
            && self.dead_letters.is_empty()
            && self.failure.is_none()
    }

    /// A failure that splitting cannot help (e.g. a refused delete-all, or a server that rejects
    /// every request): the task must stop.
    pub fn take_failure(&mut self) -> Option<String> {
        self.failure.take()
    }

    /// A document refused before sending (e.g. an invalid id or `_geo`), stored with the others.
    pub fn add_dead_letter(&mut self, dead_letter: DeadLetter) {
        self.dead_letters.push(dead_letter);
    }

    pub fn take_dead_letters(&mut self) -> Vec<DeadLetter> {
        std::mem::take(&mut self.dead_letters)
    }

    /// Handles the writer events that are ready (waiting up to `wait` for the first), then sends
    /// what the writer takes.
    pub fn pump(&mut self, wait: Option<Duration>) -> Progress {
        let mut progress = Progress {
            checkpoint: self.ready_checkpoint.take(),
            ..Progress::default()
        };
        self.send_queued();
        if let Some(timeout) = wait {
            if let Ok(event) = self.writer.events().recv_timeout(timeout) {
                self.handle(event, &mut progress);
            }
        }
        while let Ok(event) = self.writer.events().try_recv() {
            self.handle(event, &mut progress);
        }
        self.send_queued();
        progress.checkpoint = progress.checkpoint.max(self.ready_checkpoint.take());
        progress
    }

    fn send_queued(&mut self) {
        if self.rewind_needed {
            // Everything unconfirmed is read again.
            return;
        }
        // Due resends go first: nothing sent after them may be older.
        let now = Instant::now();
        let mut index = self.delayed.len();
        let mut due = 0;
        while index > 0 {
            index -= 1;
            if self.delayed[index].0 <= now {
                let (_, batch) = self.delayed.swap_remove(index);
                self.queue.push_front(batch);
                due += 1;
            }
        }
        while let Some(batch) = self.queue.pop_front() {
            // While a resend waits out its backoff nothing newer goes: it could touch the same
            // documents, and the resend would then overwrite it.
            if due == 0 && !self.delayed.is_empty() {
                self.queue.push_front(batch);
                return;
            }
            due = usize::saturating_sub(due, 1);
            if batch.seq < REPAIR_SEQ_BASE && batch.docs == 1 && batch.body.len() > self.max_payload
            {
                self.refuse_oversized(batch);
                continue;
            }
            let (seq, op, body, checkpoint) = (
                batch.seq,
                batch.op,
                Arc::clone(&batch.body),
                batch.checkpoint,
            );
            if let Err(refused) = self.writer.try_send(batch) {
                self.queue.push_front(refused);
                return;
            }
            let parent = self.parents.remove(&seq);
            self.sent.insert(
                seq,
                SentBatch {
                    order: self.next_order,
                    op,
                    body,
                    released: false,
                    checkpoint,
                    parent,
                },
            );
            self.next_order += 1;
        }
    }

    fn handle(&mut self, event: WriterEvent, progress: &mut Progress) {
        match event {
            WriterEvent::Confirmed { seq, .. } => {
                progress.answered = true;
                self.resolve(seq, progress);
            }
            WriterEvent::Retrying { error, .. } => progress.retries.push(error),
            WriterEvent::Enqueued { seq, .. } => {
                progress.answered = true;
                let releasable = self.rereadable.contains(&seq)
                    || (self.rewindable.contains(&seq) && !self.holds_older_than(seq));
                if releasable {
                    if let Some(batch) = self.sent.get_mut(&seq) {
                        batch.body = Arc::new(Vec::new());
                        batch.released = true;
                    }
                }
            }
            WriterEvent::Failed {
                seq,
                task_uid,
                error,
            } => {
                let released = self.sent.get(&seq).is_some_and(|batch| batch.released);
                // An error that stops the task needs no body.
                if released && self.rewindable.contains(&seq) && remedy(&error) != Remedy::Stop {
                    if !self.rewind_needed {
                        progress.retries.push(format!(
                            "{}; its body was let go once Meilisearch enqueued it, so the stream reads everything unconfirmed again",
                            error_parts(&error).1
                        ));
                    }
                    self.rewind_needed = true;
                } else if released && !self.rewindable.contains(&seq) {
                    self.rereads.insert(seq, (task_uid, error, false));
                } else {
                    self.repair(seq, task_uid, &error, progress);
                }
            }
        }
    }

    /// Batch or repair part `seq` needs nothing more; the watermark moves when its original does.
    fn resolve(&mut self, seq: u64, progress: &mut Progress) {
        let Some(batch) = self.sent.remove(&seq) else {
            return;
        };
        let parent = batch.parent;
        self.keep_if_landed_early(batch);
        let original = match parent {
            Some(parent) => match self.open_repairs.get_mut(&parent) {
                Some(left) if *left > 1 => {
                    *left -= 1;
                    return;
                }
                _ => {
                    self.open_repairs.remove(&parent);
                    parent
                }
            },
            None => seq,
        };
        self.resends.remove(&original);
        self.collateral.remove(&original);
        self.rereadable.remove(&original);
        self.rewindable.remove(&original);
        if let Some(checkpoint) = self.watermark.confirmed(original) {
            progress.checkpoint = Some(checkpoint);
        }
    }

    /// Keeps a confirmed batch while a batch sent before it is unresolved (say, a task that
    /// vanished from Meilisearch and is known to be lost only later), and lets go of those no
    /// earlier batch can fail behind any more.
    fn keep_if_landed_early(&mut self, batch: SentBatch) {
        let earliest_open = self.sent.values().map(|sent| sent.order).min();
        if earliest_open.is_some_and(|earliest| earliest < batch.order) {
            self.landed.push(batch);
        }
        self.landed
            .retain(|landed| earliest_open.is_some_and(|earliest| earliest < landed.order));
    }

    /// A batch of one document larger than any request Meilisearch accepts: the document is a
    /// dead letter, and the batch counts as done. (The batcher keeps batches of several
    /// documents under `batch_bytes`, which is at most the payload limit.)
    fn refuse_oversized(&mut self, batch: Batch) {
        let item = split_items(batch.op, &batch.body).pop().unwrap_or_default();
        self.dead_letters.push(DeadLetter {
            id: item_id(batch.op, &item, &self.primary_key).unwrap_or(Value::Null),
            op: batch.op,
            message: format!(
                "the document is {} bytes, more than max_payload_bytes ({}), the largest request body Meilisearch accepts",
                item.len(),
                self.max_payload
            ),
            document: item,
            code: "payload_too_large".into(),
            task_uid: None,
            checkpoint: batch.checkpoint,
        });
        self.rereadable.remove(&batch.seq);
        self.rewindable.remove(&batch.seq);
        if let Some(checkpoint) = self.watermark.confirmed(batch.seq) {
            self.ready_checkpoint = Some(checkpoint);
        }
    }

    /// Repairs a failed batch as its error asks (see [`Remedy`]): split until the refused
    /// documents are isolated as dead letters, resend whole after a backoff, or stop the task.
    /// Documents later batches replaced are left out of what is sent again.
    fn repair(
        &mut self,
        seq: u64,
        task_uid: Option<u64>,
        error: &WriteError,
        progress: &mut Progress,
    ) {
        let Some(batch) = self.sent.get(&seq) else {
            return;
        };
        let (code, message) = error_parts(error);
        if let Some(limit) = payload_limit(&message).filter(|limit| *limit < self.max_payload) {
            progress.notices.push(format!(
                "Meilisearch refuses request bodies over {limit} bytes; max_payload_bytes is {limit} for this server until the worker restarts (a document alone over it is a dead letter)"
            ));
            self.max_payload = limit;
        }
        // A delete-all has no documents to isolate.
        let remedy = match (batch.op, remedy(error)) {
            (Operation::DeleteAll, Remedy::Split) => Remedy::Stop,
            (_, remedy) => remedy,
        };
        if remedy == Remedy::Stop {
            self.failure = Some(format!("Meilisearch refused a batch: {message}"));
            return;
        }
        let (op, checkpoint, order) = (batch.op, batch.checkpoint, batch.order);
        let original_body = Arc::clone(&batch.body);
        let parent = batch.parent.unwrap_or(seq);
        let later = self.later_writes(order);
        let items: Vec<(Operation, Vec<u8>)> = if op == Operation::DeleteAll {
            // A delete-all has no items; nothing later can make it unnecessary but another one.
            if later.all {
                Vec::new()
            } else {
                vec![(op, Vec::new())]
            }
        } else if later.all {
            Vec::new()
        } else {
            split_items(op, &batch.body)
                .into_iter()
                .filter_map(|item| {
                    let id = item_id(op, &item, &self.primary_key);
                    match id.and_then(|id| later.ids.get(&id.to_string())) {
                        Some(Later::Replaced) => None,
                        Some(Later::Updated(partials)) => {
                            Some(with_later_updates(op, item, partials))
                        }
                        None => Some((op, item)),
                    }
                })
                .collect()
        };
        // A delete that later partial updates followed became a replacement: each kind goes as
        // a part of its own.
        let mut kinds: Vec<(Operation, Vec<Vec<u8>>)> = Vec::new();
        for (kind, item) in items {
            match kinds.iter_mut().find(|(held, _)| *held == kind) {
                Some((_, held)) => held.push(item),
                None => kinds.push((kind, vec![item])),
            }
        }
        if kinds.len() > 1 {
            self.sent.remove(&seq);
            *self.open_repairs.entry(parent).or_insert(1) += kinds.len() - 1;
            let due = Instant::now() + self.backoff.delay(0);
            for (kind, items) in kinds.into_iter().rev() {
                let part = Batch {
                    seq: self.next_part(parent),
                    op: kind,
                    body: Arc::new(join_items(kind, &items)),
                    docs: items.len(),
                    checkpoint,
                };
                match remedy {
                    Remedy::Resend => self.delayed.push((due, part)),
                    _ => self.queue.push_front(part),
                }
            }
            return;
        }
        let (op, items) = kinds.pop().unwrap_or((op, Vec::new()));
        if remedy == Remedy::Split
            && !items.is_empty()
            && self.failed_by_another_task(parent, &message, op, &items)
        {
            // Only the batch that holds the document is split; this one goes again, at once.
            self.sent.remove(&seq);
            progress.retries.push(format!(
                "{message}; that document is not in this batch but in another task Meilisearch indexed with it, so the batch is sent again"
            ));
            let part = self.next_part(parent);
            self.queue.push_front(Batch {
                seq: part,
                op,
                body: Arc::new(join_items(op, &items)),
                docs: items.len(),
                checkpoint,
            });
            return;
        }
        if remedy == Remedy::Resend && !items.is_empty() {
            self.sent.remove(&seq);
            let attempt = self.resends.entry(parent).or_insert(0);
            let delay = self.backoff.delay(*attempt);
            *attempt += 1;
            progress.retries.push(format!(
                "{message}; the batch is sent again in {} ms",
                delay.as_millis()
            ));
            let part = self.next_part(parent);
            let body = if op == Operation::DeleteAll {
                original_body
            } else {
                Arc::new(join_items(op, &items))
            };
            self.delayed.push((
                Instant::now() + delay,
                Batch {
                    seq: part,
                    op,
                    body,
                    docs: items.len(),
                    checkpoint,
                },
            ));
            return;
        }
        if items.len() > 1 {
            self.sent.remove(&seq);
            let left = self.open_repairs.entry(parent).or_insert(1);
            *left += 1;
            let middle = items.len() / 2;
            for half in [&items[middle..], &items[..middle]] {
                let body = Arc::new(join_items(op, half));
                let part = self.next_part(parent);
                self.queue.push_front(Batch {
                    seq: part,
                    op,
                    body,
                    docs: half.len(),
                    checkpoint,
                });
            }
            return;
        }
        if let Some(item) = items.first() {
            self.dead_letters.push(DeadLetter {
                id: item_id(op, item, &self.primary_key).unwrap_or(Value::Null),
                op,
                document: item.clone(),
                code,
                message,
                task_uid,
                checkpoint,
            });
        }
        self.resolve(seq, progress);
    }

    /// Meilisearch indexes the tasks of an index that are enqueued together as one batch, and a
    /// document error found while indexing it (a bad `_geo`, `_geojson` or `_vectors`) fails
    /// every task of that batch, deletions included. The error names the document: when it is
    /// not one of `items`, this batch failed for another's document. (Bounded, in case a message
    /// names documents some other way: after that many it is split like any other.)
    fn failed_by_another_task(
        &mut self,
        parent: u64,
        message: &str,
        op: Operation,
        items: &[Vec<u8>],
    ) -> bool {
        let Some(blamed) = blamed_document(message) else {
            return false;
        };
        let ours = items.iter().any(|item| {
            item_id(op, item, &self.primary_key).is_some_and(|id| id_text(&id) == blamed)
        });
        let times = self.collateral.entry(parent).or_insert(0);
        *times += 1;
        !ours && *times <= MAX_COLLATERAL_RESENDS
    }

    /// A new repair part of batch `parent` (its seq; the part is resolved with the parent).
    fn next_part(&mut self, parent: u64) -> u64 {
        let part = self.next_repair_seq;
        self.next_repair_seq += 1;
        self.parents.insert(part, parent);
        part
    }

    /// What the batches sent after position `order` (in flight, or landed early) wrote, in
    /// send order, for a resend of a batch sent at `order`.
    fn later_writes(&self, order: u64) -> LaterWrites {
        let mut later: Vec<&SentBatch> = self
            .sent
            .values()
            .chain(&self.landed)
            .filter(|batch| batch.order > order)
            .collect();
        later.sort_by_key(|batch| batch.order);
        let mut writes = LaterWrites {
            all: false,
            ids: HashMap::new(),
        };
        for batch in later {
            if batch.op == Operation::DeleteAll {
                writes.all = true;
                break;
            }
            for item in split_items(batch.op, &batch.body) {
                let Some(id) = item_id(batch.op, &item, &self.primary_key) else {
                    continue;
                };
                match (
                    batch.op,
                    writes
                        .ids
                        .entry(id.to_string())
                        .or_insert(Later::Updated(Vec::new())),
                ) {
                    (Operation::Update, Later::Updated(partials)) => partials.push(item),
                    (Operation::Update, Later::Replaced) => {}
                    (_, later) => *later = Later::Replaced,
                }
            }
        }
        writes
    }
}

/// What batches sent after a failed one wrote.
struct LaterWrites {
    /// A delete-all: nothing of the failed batch matters any more.
    all: bool,
    /// By document id (its JSON text).
    ids: HashMap<String, Later>,
}

enum Later {
    /// Replaced or deleted: the failed batch's version is out of date; it is not sent again.
    Replaced,
    /// Only partial updates, in order: they changed some fields and kept the others, which the
    /// failed batch must still bring. Resending it as it was would undo them.
    Updated(Vec<Vec<u8>>),
}

/// A failed batch's item with the later partial updates of its document laid over it, which
/// is what the index holds once everything sent lands: a replacement or update carries their
/// fields; a delete followed by partial updates leaves a document of those fields alone.
fn with_later_updates(op: Operation, item: Vec<u8>, partials: &[Vec<u8>]) -> (Operation, Vec<u8>) {
    let (op, mut document) = match op {
        Operation::Delete => (Operation::Replace, serde_json::Map::new()),
        _ => match serde_json::from_slice::<serde_json::Map<String, Value>>(&item) {
            Ok(document) => (op, document),
            // Not an object: Meilisearch refuses it anyway, and the split isolates it.
            Err(_) => return (op, item),
        },
    };
    for partial in partials {
        if let Ok(fields) = serde_json::from_slice::<serde_json::Map<String, Value>>(partial) {
            document.extend(fields);
        }
    }
    match serde_json::to_vec(&document) {
        Ok(merged) => (op, merged),
        Err(_) => (op, item),
    }
}

/// What a failed batch needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Remedy {
    /// Meilisearch refused documents (`invalid_request` codes about documents, 413): split
    /// until the refused ones are isolated as dead letters.
    Split,
    /// The server failed for a reason of its own (`internal`, `system`, `auth`, a task canceled
    /// by someone or no longer known, 422): the same documents again after a backoff, without
    /// end; the watermark waits for them.
    Resend,
    /// Nothing the documents or a retry can fix (the index is gone, the primary key is refused,
    /// the client is broken): the task stops with the error.
    Stop,
}

/// The document a Meilisearch error names: "… in the document with the id: `\"4\"` …" (the id
/// as Meilisearch prints it, a JSON string even for numeric keys), unquoted.
fn blamed_document(message: &str) -> Option<String> {
    const MARK: &str = "document with the id: `";
    let start = message.find(MARK)? + MARK.len();
    let rest = message.get(start..)?;
    let id = rest.get(..rest.find('`')?)?;
    Some(id.trim_matches('"').to_owned())
}

/// The limit a refusal for size names: "… is larger than allowed (limit: 1000000 bytes)".
fn payload_limit(message: &str) -> Option<usize> {
    const MARK: &str = "(limit: ";
    let start = message.find(MARK)? + MARK.len();
    let digits: String = message[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// A document id as Meilisearch prints it in messages, unquoted.
fn id_text(id: &Value) -> String {
    match id {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// An `invalid_request` code that blames documents of the batch, not the index or the request.
fn blames_documents(code: &str) -> bool {
    code.starts_with("invalid_document_")
        || code.starts_with("missing_document_")
        || code.starts_with("invalid_vector")
        || matches!(
            code,
            // An embedding Meilisearch could not take for one document (e.g. a `_vectors` entry
            // that is not a list of numbers).
            "vector_embedding_error"
                | "malformed_payload"
                | "payload_too_large"
                | "document_fields_limit_reached"
                | "max_fields_limit_exceeded"
        )
}

fn remedy_for_body(body: &MeiliErrorBody) -> Remedy {
    match body.kind.as_str() {
        "invalid_request" if blames_documents(&body.code) => Remedy::Split,
        "invalid_request" => Remedy::Stop,
        // internal, system, auth, and types Meilisearch may add: never the documents' fault.
        _ => Remedy::Resend,
    }
}

fn remedy(error: &WriteError) -> Remedy {
    match error {
        WriteError::TaskFailed(Some(body)) => remedy_for_body(body),
        WriteError::TaskFailed(None)
        | WriteError::TaskCanceled
        | WriteError::TaskVanished { .. } => Remedy::Resend,
        WriteError::Rejected(MeiliError::Http { status: 413, .. }) => Remedy::Split,
        WriteError::Rejected(MeiliError::Http { status: 422, .. }) => Remedy::Resend,
        WriteError::Rejected(MeiliError::Http {
            body: Some(body), ..
        }) => remedy_for_body(body),
        // A 4xx without an error object: the request was refused, so its content is suspect.
        WriteError::Rejected(MeiliError::Http { status, .. }) if (400..500).contains(status) => {
            Remedy::Split
        }
        WriteError::Rejected(_) => Remedy::Stop,
    }
}

fn error_parts(error: &WriteError) -> (String, String) {
    match error {
        WriteError::TaskFailed(Some(body)) => (body.code.clone(), body.message.clone()),
        WriteError::Rejected(MeiliError::Http {
            body: Some(body), ..
        }) => (body.code.clone(), body.message.clone()),
        WriteError::TaskCanceled => ("task_canceled".into(), error.to_string()),
        other => ("unknown".into(), other.to_string()),
    }
}

/// The documents (NDJSON lines) or ids (array elements) of a batch body.
fn split_items(op: Operation, body: &[u8]) -> Vec<Vec<u8>> {
    match op {
        Operation::Replace | Operation::Update => body
            .split(|&byte| byte == b'\n')
            .filter(|line| !line.is_empty())
            .map(<[u8]>::to_vec)
            .collect(),
        Operation::Delete => match serde_json::from_slice::<Vec<Value>>(body) {
            Ok(ids) => ids.iter().map(|id| id.to_string().into_bytes()).collect(),
            Err(_) => Vec::new(),
        },
        Operation::DeleteAll => Vec::new(),
    }
}

fn join_items(op: Operation, items: &[Vec<u8>]) -> Vec<u8> {
    let mut body = Vec::new();
    match op {
        Operation::Delete => {
            body.push(b'[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    body.push(b',');
                }
                body.extend_from_slice(item);
            }
            body.push(b']');
        }
        _ => {
            for item in items {
                body.extend_from_slice(item);
                body.push(b'\n');
            }
        }
    }
    body
}

/// The id of an item: the primary key field of a document, or the id itself for a delete.
/// Numbers and their string form name the same document in Meilisearch, so ids compare as text.
pub fn item_id(op: Operation, item: &[u8], primary_key: &str) -> Option<Value> {
    let value: Value = serde_json::from_slice(item).ok()?;
    let id = match op {
        Operation::Delete => value,
        _ => value.get(primary_key)?.clone(),
    };
    Some(match id {
        Value::Number(number) => Value::String(number.to_string()),
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use meili_test_server::TestServer;
    use serde_json::json;

    use super::*;
    use crate::meili::client::Client;
    use crate::meili::writer::WriterConfig;

    const KEY: &str = "masterKey";

    #[test]
    fn progress_is_empty_until_it_has_a_checkpoint_a_retry_a_notice_or_an_answer() {
        assert!(Progress::default().is_empty());
        for progress in [
            Progress {
                checkpoint: Some(1),
                ..Progress::default()
            },
            Progress {
                retries: vec!["503".into()],
                ..Progress::default()
            },
            Progress {
                notices: vec!["limit".into()],
                ..Progress::default()
            },
            Progress {
                answered: true,
                ..Progress::default()
            },
        ] {
            assert!(!progress.is_empty(), "{:?}", progress.checkpoint);
        }
    }

    fn dispatcher(server: &TestServer) -> Dispatcher {
        Dispatcher::new(writer(server, 4), "id", 4, 1024)
    }

    /// A writer into index "books" of `server` with quick polls and retries.
    fn writer(server: &TestServer, max_inflight: usize) -> Writer {
        Writer::start(WriterConfig {
            client: Client::new(&server.url(), Some(KEY), Duration::from_secs(5))
                .expect("valid URL"),
            index_uid: "books".into(),
            primary_key: "id".into(),
            gzip: false,
            gzip_level: 1,
            max_inflight,
            poll_interval: Duration::from_millis(10),
            retry_base: Duration::from_millis(5),
            retry_cap: Duration::from_millis(50),
            vanished_after: Duration::from_millis(300),
        })
    }

    fn batch(seq: u64, documents: &[Value]) -> Batch {
        let items: Vec<Vec<u8>> = documents
            .iter()
            .map(|d| d.to_string().into_bytes())
            .collect();
        Batch {
            seq,
            op: Operation::Replace,
            body: Arc::new(join_items(Operation::Replace, &items)),
            docs: items.len(),
            checkpoint: Some(seq * 100),
        }
    }

    /// Pumps until the dispatcher is idle; returns the newest checkpoint seen.
    fn settle(dispatcher: &mut Dispatcher) -> Option<u64> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut newest = None;
        while !dispatcher.is_idle() {
            assert!(Instant::now() < deadline, "dispatcher did not settle");
            let progress = dispatcher.pump(Some(Duration::from_millis(20)));
            newest = progress.checkpoint.or(newest);
        }
        newest
    }

    fn ids(server: &TestServer) -> Vec<Value> {
        server
            .documents("books")
            .iter()
            .map(|d| d["id"].clone())
            .collect()
    }

    /// A task whose requests go through again shows it even before a checkpoint is safe (a
    /// view's window may span many batches): `answered` is what ends its `retrying`.
    #[test]
    fn an_answer_is_reported_without_a_checkpoint() {
        let server = TestServer::start(Some(KEY)).expect("server");
        let mut dispatcher = dispatcher(&server);
        let mut without_checkpoint = batch(1, &[json!({"id": 1, "title": "a"})]);
        without_checkpoint.checkpoint = None;
        dispatcher.push(without_checkpoint);
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut progress = Progress::default();
        while !dispatcher.is_idle() {
            assert!(Instant::now() < deadline, "dispatcher did not settle");
            progress.absorb(dispatcher.pump(Some(Duration::from_millis(20))));
        }
        assert!(progress.answered);
        assert_eq!(progress.checkpoint, None);
        assert!(!progress.is_empty());
    }

    #[test]
    fn a_poison_document_is_isolated_and_the_rest_lands() {
        let server = TestServer::start(Some(KEY)).expect("server");
        let mut dispatcher = dispatcher(&server);
        let mut documents: Vec<Value> =
            (1..=9).map(|id| json!({"id": id, "title": "ok"})).collect();
        documents.insert(4, json!({"id": "not a valid id", "title": "poison"}));
        dispatcher.push(batch(1, &documents));
        assert_eq!(settle(&mut dispatcher), Some(100));
        assert_eq!(
            ids(&server),
            (1..=9).map(|id| json!(id)).collect::<Vec<_>>()
        );
        let dead = dispatcher.take_dead_letters();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].id, json!("not a valid id"));
        assert_eq!(dead[0].code, "invalid_document_id");
        assert!(String::from_utf8_lossy(&dead[0].document).contains("poison"));
        assert!(dispatcher.take_failure().is_none());
        dispatcher.shutdown();
    }

    #[test]
    fn a_resend_never_overwrites_a_newer_version_sent_later() {
        let server = TestServer::start(Some(KEY)).expect("server");
        let mut dispatcher = dispatcher(&server);
        dispatcher.push(batch(
            1,
            &[
                json!({"id": 1, "v": "old"}),
                json!({"id": 2, "v": "old"}),
                json!({"id": "bad id"}),
            ],
        ));
        dispatcher.push(batch(2, &[json!({"id": 1, "v": "new"})]));
        assert_eq!(settle(&mut dispatcher), Some(200));
        let documents = server.documents("books");
        assert_eq!(
            documents,
            vec![json!({"id": 1, "v": "new"}), json!({"id": 2, "v": "old"})]
        );
        assert_eq!(dispatcher.take_dead_letters().len(), 1);
        dispatcher.shutdown();
    }

    /// Pumps until idle; returns the newest checkpoint and every retry message.
    fn settle_with_retries(dispatcher: &mut Dispatcher) -> (Option<u64>, Vec<String>) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let (mut newest, mut retries) = (None, Vec::new());
        while !dispatcher.is_idle() {
            assert!(Instant::now() < deadline, "dispatcher did not settle");
            let progress = dispatcher.pump(Some(Duration::from_millis(20)));
            newest = progress.checkpoint.or(newest);
            retries.extend(progress.retries);
        }
        (newest, retries)
    }

    /// Bodies of the document additions the server received.
    fn posted_bodies(server: &TestServer) -> Vec<String> {
        server
            .request_log()
            .into_iter()
            .filter(|r| r.method == "POST" && r.path.starts_with("/indexes/books/documents"))
            .map(|r| String::from_utf8_lossy(&r.body).into_owned())
            .collect()
    }

    #[test]
    fn a_task_the_server_failed_is_sent_again_whole_never_dead_lettered() {
        for (code, kind) in [
            ("internal", "internal"),
            ("no_space_left_on_device", "system"),
            ("database_size_limit_reached", "internal"),
            ("a_code_from_the_future", "a_type_from_the_future"),
        ] {
            let server = TestServer::start(Some(KEY)).expect("server");
            server.faults().fail_next_tasks_as(1, code, kind);
            let mut dispatcher = dispatcher(&server);
            let documents: Vec<Value> = (1..=6).map(|id| json!({"id": id})).collect();
            dispatcher.push(batch(1, &documents));
            dispatcher.push(batch(2, &[json!({"id": 7})]));
            let (checkpoint, retries) = settle_with_retries(&mut dispatcher);
            assert_eq!(checkpoint, Some(200), "{code}");
            assert_eq!(
                ids(&server),
                (1..=7).map(|id| json!(id)).collect::<Vec<_>>()
            );
            assert!(dispatcher.take_dead_letters().is_empty(), "{code}");
            assert!(dispatcher.take_failure().is_none(), "{code}");
            assert!(
                retries
                    .iter()
                    .any(|retry| retry.contains(code) && retry.contains("sent again")),
                "{code}: {retries:?}"
            );
            // The same six documents went twice, never in halves.
            let bodies = posted_bodies(&server);
            let first = bodies.first().cloned().unwrap_or_default();
            assert_eq!(first.lines().count(), 6, "{code}");
            assert_eq!(
                bodies.iter().filter(|body| **body == first).count(),
                2,
                "{code}"
            );
            dispatcher.shutdown();
        }
    }

    fn batch_of(seq: u64, op: Operation, items: &[Value]) -> Batch {
        let items: Vec<Vec<u8>> = items.iter().map(|d| d.to_string().into_bytes()).collect();
        Batch {
            seq,
            op,
            body: Arc::new(join_items(op, &items)),
            docs: items.len(),
            checkpoint: Some(seq * 100),
        }
    }

    /// Pumps until a failure has been handled (a resend is waiting out its backoff).
    fn until_a_resend_waits(dispatcher: &mut Dispatcher) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while dispatcher
            .pump(Some(Duration::from_millis(20)))
            .retries
            .is_empty()
        {
            assert!(Instant::now() < deadline, "no failure came");
        }
    }

    #[test]
    fn a_resend_keeps_the_fields_a_later_partial_update_did_not_carry() {
        let server = TestServer::start(Some(KEY)).expect("server");
        let mut dispatcher = dispatcher(&server);
        dispatcher.push(batch_of(
            1,
            Operation::Replace,
            &[
                json!({"id": 1, "a": "first", "b": "old"}),
                json!({"id": 2, "a": "first"}),
            ],
        ));
        settle(&mut dispatcher);
        // A new version of 1 and a delete of 2 fail for the server's own reasons; partial
        // updates of both land meanwhile.
        server
            .faults()
            .fail_next_tasks_as(2, "internal", "internal");
        dispatcher.push(batch_of(
            2,
            Operation::Replace,
            &[json!({"id": 1, "a": "second", "b": "new"})],
        ));
        dispatcher.push(batch_of(3, Operation::Delete, &[json!(2)]));
        dispatcher.push(batch_of(
            4,
            Operation::Update,
            &[
                json!({"id": 1, "a": "third"}),
                json!({"id": 2, "c": "third"}),
            ],
        ));
        let (checkpoint, _) = settle_with_retries(&mut dispatcher);
        assert_eq!(checkpoint, Some(400));
        assert_eq!(
            server.documents("books"),
            vec![
                json!({"id": 1, "a": "third", "b": "new"}),
                json!({"id": 2, "c": "third"})
            ]
        );
        assert!(dispatcher.take_dead_letters().is_empty());
        dispatcher.shutdown();
    }

    #[test]
    fn tasks_failed_with_a_document_of_another_task_in_their_batch_are_sent_again() {
        let server = TestServer::start(Some(KEY)).expect("server");
        let client =
            Client::new(&server.url(), Some(KEY), Duration::from_secs(5)).expect("valid URL");
        for uid in [
            client.create_index("books", "id"),
            client.update_settings("books", &json!({"filterableAttributes": ["_geo"]})),
        ] {
            client
                .wait_task(uid.expect("enqueued"), Duration::from_secs(5))
                .expect("done");
        }
        // While the first task is processed the next three are enqueued: Meilisearch indexes
        // them as one batch, and the bad `_geo` of one document fails all three tasks.
        server.faults().set_task_delay(Duration::from_millis(300));
        let mut dispatcher = dispatcher(&server);
        dispatcher.push(batch_of(
            1,
            Operation::Replace,
            &[json!({"id": 1}), json!({"id": 2})],
        ));
        dispatcher.push(batch_of(
            2,
            Operation::Replace,
            &[
                json!({"id": 3}),
                json!({"id": 4, "_geo": {"lat": "north", "lng": 0}}),
                json!({"id": 5}),
            ],
        ));
        dispatcher.push(batch_of(3, Operation::Delete, &[json!(1)]));
        dispatcher.push(batch_of(4, Operation::Replace, &[json!({"id": 6})]));
        assert_eq!(settle(&mut dispatcher), Some(400));
        let dead = dispatcher.take_dead_letters();
        assert_eq!(
            dead.iter().map(|d| d.id.clone()).collect::<Vec<_>>(),
            vec![json!("4")],
            "{dead:?}"
        );
        assert_eq!(ids(&server), vec![json!(2), json!(3), json!(5), json!(6)]);
        assert!(dead[0].message.contains("the id: `\"4\"`"), "{dead:?}");
        assert!(
            dispatcher.collateral.is_empty(),
            "the counts go with their batches"
        );
        dispatcher.shutdown();
    }

    #[test]
    fn nothing_newer_is_sent_while_a_resend_waits_out_its_backoff() {
        let server = TestServer::start(Some(KEY)).expect("server");
        server
            .faults()
            .fail_next_tasks_as(1, "internal", "internal");
        let mut dispatcher = dispatcher(&server);
        dispatcher.push(batch_of(
            1,
            Operation::Replace,
            &[json!({"id": 1, "v": "old"})],
        ));
        until_a_resend_waits(&mut dispatcher);
        dispatcher.push(batch_of(
            2,
            Operation::Replace,
            &[json!({"id": 1, "v": "new"})],
        ));
        assert_eq!(settle(&mut dispatcher), Some(200));
        assert_eq!(
            server.documents("books"),
            vec![json!({"id": 1, "v": "new"})]
        );
        dispatcher.shutdown();
    }

    #[test]
    fn a_document_over_the_payload_limit_is_a_dead_letter_never_sent() {
        let server = TestServer::start(Some(KEY)).expect("server");
        let mut dispatcher = dispatcher(&server);
        let huge = json!({"id": 1, "text": "x".repeat(2000)});
        dispatcher.push(batch(1, &[huge]));
        dispatcher.push(batch(2, &[json!({"id": 2})]));
        assert_eq!(settle(&mut dispatcher), Some(200));
        assert_eq!(ids(&server), vec![json!(2)]);
        let dead = dispatcher.take_dead_letters();
        assert_eq!(dead.len(), 1);
        assert_eq!(
            (dead[0].id.clone(), dead[0].code.as_str()),
            (json!("1"), "payload_too_large")
        );
        assert!(
            dead[0].message.contains("max_payload_bytes (1024)"),
            "{}",
            dead[0].message
        );
        assert_eq!(
            posted_bodies(&server).len(),
            1,
            "only the second batch was sent"
        );
        dispatcher.shutdown();
    }

    #[test]
    fn a_body_over_the_servers_limit_is_split_not_resent_forever() {
        // A server whose payload limit is lower than the task believes: it answers 413 and
        // closes the connection mid-upload, as Meilisearch does, so the client may only see a
        // broken pipe.
        let server = TestServer::start_with(meili_test_server::Config {
            master_key: Some(KEY.to_owned()),
            max_payload_bytes: 200_000,
            ..meili_test_server::Config::default()
        })
        .expect("server");
        let mut dispatcher = dispatcher(&server);
        dispatcher.max_payload = 100_000_000;
        let documents: Vec<Value> = (1..=20)
            .map(|id| json!({"id": id, "text": "y".repeat(50_000)}))
            .collect();
        dispatcher.push(batch(1, &documents));
        assert_eq!(settle(&mut dispatcher), Some(100));
        assert_eq!(
            ids(&server),
            (1..=20).map(|id| json!(id)).collect::<Vec<_>>()
        );
        assert!(dispatcher.take_dead_letters().is_empty());
        dispatcher.shutdown();
    }

    #[test]
    fn a_delete_batch_over_the_servers_limit_is_split_and_the_limit_learned() {
        // Meilisearch answers a JSON body over its limit with 500 `internal` "JSON payload (N
        // bytes) is larger than allowed (limit: M bytes)", which is no server failure: the batch
        // is split in halves until each fits, never retried unchanged.
        let server = TestServer::start_with(meili_test_server::Config {
            master_key: Some(KEY.to_owned()),
            max_payload_bytes: 5_000,
            ..meili_test_server::Config::default()
        })
        .expect("server");
        let mut dispatcher = dispatcher(&server);
        dispatcher.max_payload = 100_000_000;
        let key = |n: usize| format!("{n:03}{}", "k".repeat(447));
        let documents: Vec<Value> = (0..30).map(|n| json!({"id": key(n)})).collect();
        for (seq, chunk) in documents.chunks(5).enumerate() {
            dispatcher.push(batch(seq as u64 + 1, chunk));
        }
        settle(&mut dispatcher);
        assert_eq!(ids(&server).len(), 30);
        let items: Vec<Vec<u8>> = (0..28)
            .map(|n| json!(key(n)).to_string().into_bytes())
            .collect();
        dispatcher.push(Batch {
            seq: 10,
            op: Operation::Delete,
            body: Arc::new(join_items(Operation::Delete, &items)),
            docs: items.len(),
            checkpoint: Some(1000),
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut notices = Vec::new();
        let mut retries = Vec::new();
        let mut newest = None;
        while !dispatcher.is_idle() {
            assert!(Instant::now() < deadline, "did not settle: {retries:?}");
            let progress = dispatcher.pump(Some(Duration::from_millis(20)));
            newest = progress.checkpoint.or(newest);
            notices.extend(progress.notices);
            retries.extend(progress.retries);
        }
        assert_eq!(newest, Some(1000));
        assert_eq!(ids(&server), vec![json!(key(28)), json!(key(29))]);
        assert!(
            retries.is_empty(),
            "nothing was retried unchanged: {retries:?}"
        );
        assert_eq!(notices.len(), 1, "{notices:?}");
        assert!(notices[0].contains("over 5000 bytes"), "{notices:?}");
        assert_eq!(dispatcher.max_payload, 5_000);
        assert!(dispatcher.take_dead_letters().is_empty());
        dispatcher.shutdown();
    }

    #[test]
    fn an_error_about_the_index_stops_instead_of_dead_lettering() {
        for code in ["index_not_found", "index_primary_key_no_candidate_found"] {
            let server = TestServer::start(Some(KEY)).expect("server");
            server.faults().fail_next_tasks(1, code);
            let mut dispatcher = dispatcher(&server);
            dispatcher.push(batch(1, &[json!({"id": 1}), json!({"id": 2})]));
            let deadline = Instant::now() + Duration::from_secs(30);
            let failure = loop {
                assert!(Instant::now() < deadline, "{code}: no failure");
                dispatcher.pump(Some(Duration::from_millis(20)));
                if let Some(failure) = dispatcher.take_failure() {
                    break failure;
                }
            };
            assert!(failure.contains(code), "{failure}");
            assert!(dispatcher.take_dead_letters().is_empty(), "{code}");
            dispatcher.shutdown();
        }
    }

    /// Pumps until Meilisearch has enqueued the first batch.
    fn until_enqueued(dispatcher: &mut Dispatcher) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while dispatcher
            .writer()
            .stats()
            .batches_enqueued
            .load(std::sync::atomic::Ordering::SeqCst)
            == 0
        {
            assert!(Instant::now() < deadline, "never enqueued");
            dispatcher.pump(Some(Duration::from_millis(10)));
        }
    }

    #[test]
    fn a_task_meilisearch_no_longer_knows_is_sent_again() {
        let server = TestServer::start(Some(KEY)).expect("server");
        server.faults().set_task_delay(Duration::from_millis(500));
        let mut dispatcher = dispatcher(&server);
        dispatcher.push(batch(1, &[json!({"id": 1}), json!({"id": 2})]));
        until_enqueued(&mut dispatcher);
        server.forget_tasks();
        let (checkpoint, retries) = settle_with_retries(&mut dispatcher);
        assert_eq!(checkpoint, Some(100));
        assert!(
            retries
                .iter()
                .any(|retry| retry.contains("no longer knows task 0")),
            "{retries:?}"
        );
        assert_eq!(ids(&server), vec![json!(1), json!(2)]);
        assert_eq!(posted_bodies(&server).len(), 2, "sent once more");
        assert!(dispatcher.take_dead_letters().is_empty());
        assert!(
            dispatcher.resends.is_empty(),
            "the resend count goes with its batch"
        );
        dispatcher.shutdown();
    }

    #[test]
    fn a_vanished_task_sent_again_never_overwrites_what_landed_after_it() {
        let server = TestServer::start(Some(KEY)).expect("server");
        // Each task takes 50 ms, well within the 300 ms the writer waits for a vanished task.
        server.faults().set_task_delay(Duration::from_millis(50));
        let mut dispatcher = dispatcher(&server);
        dispatcher.push(batch(1, &[json!({"id": 1, "v": "old"}), json!({"id": 2})]));
        until_enqueued(&mut dispatcher);
        server.forget_tasks();
        // Confirmed long before the first is known to be lost.
        dispatcher.push(batch(2, &[json!({"id": 1, "v": "new"})]));
        assert_eq!(settle(&mut dispatcher), Some(200));
        assert_eq!(
            server.documents("books"),
            vec![json!({"id": 1, "v": "new"}), json!({"id": 2})]
        );
        dispatcher.shutdown();
    }

    /// A dispatcher for a copy: `max_inflight` batches held in memory, `depth` enqueued.
    fn deep_dispatcher(server: &TestServer, max_inflight: usize, depth: usize) -> Dispatcher {
        let mut dispatcher = Dispatcher::new(writer(server, depth), "id", max_inflight, 1 << 20);
        dispatcher.set_depth(depth);
        dispatcher
    }

    #[test]
    fn a_deep_copy_queue_holds_in_memory_only_what_is_not_yet_enqueued() {
        let server = TestServer::start(Some(KEY)).expect("server");
        // Slow tasks stay enqueued and unconfirmed, as behind a real Meilisearch's indexing.
        server.faults().set_task_delay(Duration::from_millis(100));
        let mut dispatcher = deep_dispatcher(&server, 2, 12);
        let filler = "x".repeat(1000);
        let body_len = batch(1, &[json!({"id": 1, "v": filler})]).body.len();
        let (mut pushed, mut deepest, mut most_held) = (0u64, 0, 0);
        let deadline = Instant::now() + Duration::from_secs(30);
        while pushed < 30 {
            assert!(
                Instant::now() < deadline,
                "the copy never got its batches out"
            );
            if dispatcher.has_room() {
                pushed += 1;
                dispatcher.push_rereadable(batch(pushed, &[json!({"id": pushed, "v": filler})]));
            }
            dispatcher.pump(Some(Duration::from_millis(5)));
            deepest = deepest.max(dispatcher.backlog());
            most_held = most_held.max(dispatcher.held_bytes());
        }
        assert_eq!(settle(&mut dispatcher), Some(3000));
        assert!(
            deepest > 2,
            "never more than max_inflight in flight: {deepest}"
        );
        assert!(deepest <= 12, "deeper than depth: {deepest}");
        assert!(
            most_held <= 2 * body_len,
            "held {most_held} bytes, more than the 2 bodies not yet enqueued ({body_len} each)"
        );
        assert_eq!(
            ids(&server),
            (1..=30).map(|id| json!(id)).collect::<Vec<_>>()
        );
        dispatcher.shutdown();
    }

    #[test]
    fn a_held_deep_queue_goes_past_max_inflight_only_within_its_weight() {
        let server = TestServer::start(Some(KEY)).expect("server");
        // Nothing is confirmed while the test looks: every batch stays held.
        server.faults().set_task_delay(Duration::from_secs(30));
        let filler = "x".repeat(1000);
        let body_len = batch(1, &[json!({"id": 1, "v": filler})]).body.len();
        // The weight of 2 full requests of 4 bodies each is 8 bodies; a next body must fit with
        // a full request's weight to spare: 5 are taken, within a depth of 12.
        let max_payload = 4 * body_len;
        let mut dispatcher = Dispatcher::new(writer(&server, 12), "id", 2, max_payload);
        dispatcher.set_held_depth(12);
        let mut pushed = 0u64;
        while dispatcher.has_room() && pushed < 100 {
            pushed += 1;
            dispatcher.push(batch(pushed, &[json!({"id": pushed, "v": filler})]));
            dispatcher.pump(None);
        }
        assert_eq!(pushed, 5, "held {} bytes", dispatcher.held_bytes());
        assert!(dispatcher.held_bytes() <= 2 * max_payload);
        // A shallow queue of the same settings holds max_inflight.
        let mut shallow = Dispatcher::new(writer(&server, 12), "id", 2, max_payload);
        let mut held = 0u64;
        while shallow.has_room() && held < 100 {
            held += 1;
            shallow.push(batch(held, &[json!({"id": 1000 + held, "v": filler})]));
            shallow.pump(None);
        }
        assert_eq!(held, 2);
        dispatcher.shutdown();
        shallow.shutdown();
    }

    #[test]
    fn a_squeezed_dispatcher_holds_one_batch_at_a_time_and_loses_none() {
        let server = TestServer::start(Some(KEY)).expect("server");
        server.faults().set_task_delay(Duration::from_millis(30));
        let mut dispatcher = Dispatcher::new(writer(&server, 8), "id", 8, 1 << 20);
        dispatcher.push(batch(1, &[json!({"id": 1})]));
        assert!(dispatcher.has_room(), "unsqueezed: room up to max_inflight");
        dispatcher.set_squeezed(true);
        assert!(!dispatcher.has_room(), "squeezed with a batch unresolved");
        let (mut pushed, mut most) = (1u64, 0);
        let deadline = Instant::now() + Duration::from_secs(30);
        while pushed < 6 || !dispatcher.is_idle() {
            assert!(Instant::now() < deadline, "a squeezed dispatcher got stuck");
            if pushed < 6 && dispatcher.has_room() {
                pushed += 1;
                dispatcher.push(batch(pushed, &[json!({"id": pushed})]));
            }
            most = most.max(dispatcher.backlog());
            dispatcher.pump(Some(Duration::from_millis(5)));
        }
        assert_eq!(most, 1, "more than one batch at a time while squeezed");
        dispatcher.set_squeezed(false);
        assert!(dispatcher.has_room());
        assert_eq!(
            ids(&server),
            (1..=6).map(|id| json!(id)).collect::<Vec<_>>()
        );
        dispatcher.shutdown();
    }

    #[test]
    fn a_failed_batch_whose_body_was_let_go_is_read_again_then_repaired() {
        let server = TestServer::start(Some(KEY)).expect("server");
        server.faults().set_task_delay(Duration::from_millis(50));
        let mut dispatcher = deep_dispatcher(&server, 1, 8);
        let documents = vec![
            json!({"id": 1}),
            json!({"id": "not a valid id"}),
            json!({"id": 3}),
        ];
        dispatcher.push_rereadable(batch(1, &documents));
        dispatcher.push_rereadable(batch(2, &[json!({"id": 4})]));
        // The source changed meanwhile: row 3 is gone, row 5 is new in that key range.
        let read_again = batch(
            1,
            &[
                json!({"id": 1}),
                json!({"id": "not a valid id"}),
                json!({"id": 5}),
            ],
        );
        let (mut asked, mut newest) = (Vec::new(), None);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !dispatcher.is_idle() {
            assert!(Instant::now() < deadline, "dispatcher did not settle");
            newest = dispatcher
                .pump(Some(Duration::from_millis(10)))
                .checkpoint
                .or(newest);
            for seq in dispatcher.take_rereads() {
                asked.push(seq);
                newest = dispatcher
                    .reread(seq, read_again.body.to_vec())
                    .checkpoint
                    .or(newest);
            }
        }
        assert_eq!(
            asked,
            vec![1],
            "the failed batch's body was kept, or asked for twice"
        );
        assert_eq!(newest, Some(200));
        let dead = dispatcher.take_dead_letters();
        assert_eq!(
            dead.iter().map(|d| d.id.clone()).collect::<Vec<_>>(),
            vec![json!("not a valid id")]
        );
        assert_eq!(ids(&server), vec![json!(1), json!(4), json!(5)]);
        assert_eq!(dispatcher.held_bytes(), 0);
        dispatcher.shutdown();
    }

    fn stream_dispatcher(server: &TestServer, max_inflight: usize, depth: usize) -> Dispatcher {
        let mut dispatcher = Dispatcher::new(writer(server, depth), "id", max_inflight, 1 << 20);
        dispatcher.set_stream_depth(depth);
        dispatcher
    }

    fn enqueued(dispatcher: &Dispatcher) -> u64 {
        dispatcher
            .writer()
            .stats()
            .batches_enqueued
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Two committed transactions of a stream, as decoded from the slot.
    fn two_commits(dispatcher: &mut Dispatcher) {
        dispatcher.push_rewindable(batch(
            1,
            &[
                json!({"id": 1}),
                json!({"id": "not a valid id"}),
                json!({"id": 3}),
            ],
        ));
        dispatcher.push_rewindable(batch(2, &[json!({"id": 4})]));
    }

    #[test]
    fn a_failed_stream_batch_whose_body_was_let_go_is_decoded_again_then_repaired() {
        let server = TestServer::start(Some(KEY)).expect("server");
        server.faults().set_task_delay(Duration::from_millis(50));
        let mut dispatcher = stream_dispatcher(&server, 1, 8);
        two_commits(&mut dispatcher);
        let mut retries = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !dispatcher.needs_rewind() {
            assert!(Instant::now() < deadline, "no rewind was asked for");
            let progress = dispatcher.pump(Some(Duration::from_millis(10)));
            assert_eq!(progress.checkpoint, None, "confirmed past a failed batch");
            retries.extend(progress.retries);
        }
        assert!(
            retries
                .iter()
                .any(|retry| retry.contains("reads everything unconfirmed again")),
            "{retries:?}"
        );
        assert_eq!(dispatcher.held_bytes(), 0, "bodies were kept past Enqueued");
        assert!(
            !dispatcher.has_room(),
            "took more after asking for a rewind"
        );
        assert!(!dispatcher.is_idle());
        // The stream reads both commits again from the position its index is complete up to.
        dispatcher.rewind(200);
        assert!(dispatcher.is_idle());
        two_commits(&mut dispatcher);
        assert_eq!(settle(&mut dispatcher), Some(200));
        assert!(!dispatcher.needs_rewind(), "asked for a second rewind");
        let dead = dispatcher.take_dead_letters();
        assert_eq!(
            dead.iter().map(|d| d.id.clone()).collect::<Vec<_>>(),
            vec![json!("not a valid id")]
        );
        assert_eq!(ids(&server), vec![json!(1), json!(3), json!(4)]);
        dispatcher.shutdown();
    }

    #[test]
    fn an_error_about_the_index_stops_a_stream_whose_body_was_let_go_rather_than_rewinding() {
        let server = TestServer::start(Some(KEY)).expect("server");
        server.faults().set_task_delay(Duration::from_millis(50));
        server.faults().fail_next_tasks(1, "index_not_found");
        let mut dispatcher = stream_dispatcher(&server, 1, 8);
        dispatcher.push_rewindable(batch(1, &[json!({"id": 1})]));
        let deadline = Instant::now() + Duration::from_secs(30);
        let failure = loop {
            assert!(Instant::now() < deadline, "the task never stopped");
            dispatcher.pump(Some(Duration::from_millis(10)));
            if let Some(failure) = dispatcher.take_failure() {
                break failure;
            }
        };
        assert!(failure.contains("index_not_found"), "{failure}");
        assert!(!dispatcher.needs_rewind());
        dispatcher.shutdown();
    }

    #[test]
    fn a_stream_batch_keeps_its_body_while_one_before_it_may_be_sent_again() {
        let server = TestServer::start(Some(KEY)).expect("server");
        server.faults().set_task_delay(Duration::from_millis(300));
        let mut dispatcher = stream_dispatcher(&server, 4, 8);
        // After a rewind to 100, the batch that reaches it is held until confirmed.
        dispatcher.rewind(100);
        dispatcher.push_rewindable(batch(1, &[json!({"id": 1, "v": "old"})]));
        dispatcher.push_rewindable(batch(2, &[json!({"id": 1, "v": "new"})]));
        dispatcher.push_rewindable(batch(3, &[json!({"id": 2})]));
        let deadline = Instant::now() + Duration::from_secs(30);
        while enqueued(&dispatcher) < 3 {
            assert!(Instant::now() < deadline, "the batches were never enqueued");
            dispatcher.pump(Some(Duration::from_millis(5)));
        }
        // Their Enqueued events follow the count.
        for _ in 0..5 {
            dispatcher.pump(Some(Duration::from_millis(10)));
        }
        assert!(
            dispatcher.sent.values().all(|batch| !batch.released),
            "a body was let go while batch 1, which a resend would compare with it, was unresolved"
        );
        assert_eq!(settle(&mut dispatcher), Some(300));
        // Past the rewind's position and with nothing held, bodies go once enqueued again.
        dispatcher.push_rewindable(batch(4, &[json!({"id": 3})]));
        while enqueued(&dispatcher) < 4 {
            assert!(Instant::now() < deadline, "batch 4 was never enqueued");
            dispatcher.pump(Some(Duration::from_millis(5)));
        }
        // Their Enqueued events follow the count.
        for _ in 0..5 {
            dispatcher.pump(Some(Duration::from_millis(10)));
        }
        assert_eq!(dispatcher.held_bytes(), 0);
        assert_eq!(settle(&mut dispatcher), Some(400));
        assert_eq!(ids(&server), vec![json!(1), json!(2), json!(3)]);
        dispatcher.shutdown();
    }

    #[test]
    fn no_batch_of_a_copy_is_still_taken_for_rereadable_once_it_is_resolved() {
        let server = TestServer::start(Some(KEY)).expect("server");
        let mut dispatcher = deep_dispatcher(&server, 2, 8);
        // One document over the payload limit (a dead letter never sent), then a good batch.
        dispatcher.push_rereadable(batch(1, &[json!({"id": 1, "v": "x".repeat(1 << 20)})]));
        dispatcher.push_rereadable(batch(2, &[json!({"id": 2})]));
        assert_eq!(settle(&mut dispatcher), Some(200));
        assert_eq!(dispatcher.take_dead_letters()[0].code, "payload_too_large");
        // The stream's batcher numbers its batches from 1 again: none may lose its body.
        assert!(
            dispatcher.rereadable.is_empty(),
            "{:?}",
            dispatcher.rereadable
        );
        dispatcher.shutdown();
    }

    #[test]
    fn the_watermark_waits_for_every_part_of_a_repaired_batch() {
        let server = TestServer::start(Some(KEY)).expect("server");
        let mut dispatcher = dispatcher(&server);
        let poisoned: Vec<Value> = vec![
            json!({"id": "x y"}),
            json!({"id": 1}),
            json!({"id": "z w"}),
            json!({"id": 2}),
        ];
        dispatcher.push(batch(1, &poisoned));
        dispatcher.push(batch(2, &[json!({"id": 3})]));
        let mut seen = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !dispatcher.is_idle() {
            assert!(Instant::now() < deadline);
            if let Some(checkpoint) = dispatcher.pump(Some(Duration::from_millis(20))).checkpoint {
                seen.push(checkpoint);
            }
        }
        // Checkpoint 100 is never reported on its own before batch 1's parts are all resolved,
        // and the watermark only moves forward.
        assert_eq!(seen.last(), Some(&200));
        assert!(seen.windows(2).all(|pair| pair[0] < pair[1]));
        let mut dead: Vec<Value> = dispatcher
            .take_dead_letters()
            .into_iter()
            .map(|d| d.id)
            .collect();
        dead.sort_by_key(|id| id.to_string());
        assert_eq!(dead, vec![json!("x y"), json!("z w")]);
        assert_eq!(ids(&server), vec![json!(1), json!(2), json!(3)]);
        dispatcher.shutdown();
    }
}
