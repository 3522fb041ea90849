//! Batching of encoded documents into Meilisearch requests, and the
//! watermark of confirmed checkpoints.
//!
//! The [`Batcher`] groups consecutive items of one [`Operation`] into one
//! request body and closes the batch when the operation changes, so that
//! Meilisearch applies operations in commit order, or when a count, size or
//! age limit is reached. Checkpoints (commit LSNs, snapshot pages) ride on
//! the batch that holds the last item before them. The [`Watermark`] then
//! tells which checkpoint is safe: the newest one such that every batch
//! sent before it is confirmed by Meilisearch.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::document::shard::ShardFilter;
use crate::meili::request::{Batch, Operation};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Items per batch (at least 1).
    pub max_docs: usize,
    /// Body bytes per batch; a single larger item forms a batch alone.
    pub max_bytes: usize,
    /// How long a batch may stay open before [`Batcher::flush_due`] closes it.
    pub max_age: Duration,
}

struct OpenBatch {
    op: Operation,
    body: Vec<u8>,
    docs: usize,
    opened_at: Instant,
    checkpoint: Option<u64>,
}

impl OpenBatch {
    /// Body length once closed if `item_len` more bytes were added.
    fn len_with(&self, item_len: usize) -> usize {
        match self.op {
            // Item and its newline.
            Operation::Replace | Operation::Update => self.body.len() + item_len + 1,
            // Item, its separator ('[' for the first, holds already), and ']'.
            Operation::Delete => self.body.len() + usize::from(self.docs > 0) + item_len + 1,
            Operation::DeleteAll => 0,
        }
    }

    fn closed_len(&self) -> usize {
        match self.op {
            Operation::Delete => self.body.len() + 1,
            _ => self.body.len(),
        }
    }

    fn add(&mut self, item: &[u8]) {
        match self.op {
            Operation::Replace | Operation::Update => {
                self.body.extend_from_slice(item);
                self.body.push(b'\n');
            }
            Operation::Delete => {
                if self.docs > 0 {
                    self.body.push(b',');
                }
                self.body.extend_from_slice(item);
            }
            Operation::DeleteAll => {}
        }
        self.docs += 1;
    }
}

/// Groups items into batches; see the module doc.
pub struct Batcher {
    limits: BatchLimits,
    open: Option<OpenBatch>,
    next_seq: u64,
    pending_checkpoint: Option<u64>,
    /// Body length of the last closed document batch, plus some slack: the next one starts with
    /// that capacity instead of growing by doubling (and copying) up to it.
    body_hint: usize,
}

impl Batcher {
    pub fn new(limits: BatchLimits) -> Self {
        Batcher {
            limits: BatchLimits {
                max_docs: limits.max_docs.max(1),
                max_bytes: limits.max_bytes.max(1),
                max_age: limits.max_age,
            },
            open: None,
            next_seq: 1,
            pending_checkpoint: None,
            body_hint: 0,
        }
    }

    /// Adds one item: an encoded document for `Replace`/`Update`, an encoded
    /// id for `Delete`, nothing for `DeleteAll`. Returns the batch this push
    /// closed, if any.
    ///
    /// The open batch is closed *before* adding when the operation changes,
    /// when it is already full, or when the item would overflow `max_bytes`;
    /// otherwise it is closed *after* adding if that filled it. So a push
    /// closes at most one batch. The one case where a full batch stays open
    /// (an operation change whose first item fills the new batch) is closed
    /// by the next `push`, `flush_due` or `flush`.
    pub fn push(&mut self, op: Operation, item: &[u8], now: Instant) -> Option<Batch> {
        self.push_with(op, item, &|| now)
    }

    /// [`Batcher::push`], reading the clock only when the item opens a batch.
    pub fn push_with(
        &mut self,
        op: Operation,
        item: &[u8],
        now: &dyn Fn() -> Instant,
    ) -> Option<Batch> {
        let closed = match &self.open {
            Some(open)
                if open.op != op
                    || self.is_full(open)
                    || open.len_with(item.len()) > self.limits.max_bytes =>
            {
                self.flush()
            }
            _ => None,
        };
        let body_capacity = self.body_hint.min(self.limits.max_bytes);
        let open = self.open.get_or_insert_with(|| OpenBatch {
            op,
            body: match op {
                Operation::Delete => vec![b'['],
                Operation::Replace | Operation::Update => Vec::with_capacity(body_capacity),
                Operation::DeleteAll => Vec::new(),
            },
            docs: 0,
            opened_at: now(),
            // A checkpoint marked while no batch was open is completed by
            // this batch too, in case the caller did not take it.
            checkpoint: self.pending_checkpoint.take(),
        });
        open.add(item);
        match closed {
            Some(batch) => Some(batch),
            None if self.open.as_ref().is_some_and(|open| self.is_full(open)) => self.flush(),
            None => None,
        }
    }

    /// Everything pushed so far is covered by `checkpoint`.
    pub fn mark_checkpoint(&mut self, checkpoint: u64) {
        match &mut self.open {
            Some(open) => open.checkpoint = Some(checkpoint),
            None => self.pending_checkpoint = Some(checkpoint),
        }
    }

    /// A checkpoint marked after the last closed batch with no item after
    /// it (e.g. a commit with nothing to send): safe once every batch sent
    /// so far is confirmed (see [`Watermark::standalone`]).
    pub fn take_pending_checkpoint(&mut self) -> Option<u64> {
        self.pending_checkpoint.take()
    }

    /// Closes the open batch if it is older than `max_age` (or full).
    pub fn flush_due(&mut self, now: Instant) -> Option<Batch> {
        let open = self.open.as_ref()?;
        if now.saturating_duration_since(open.opened_at) >= self.limits.max_age
            || self.is_full(open)
        {
            self.flush()
        } else {
            None
        }
    }

    /// Closes the open batch, if any.
    pub fn flush(&mut self) -> Option<Batch> {
        let mut open = self.open.take()?;
        match open.op {
            Operation::Delete => open.body.push(b']'),
            Operation::Replace | Operation::Update => {
                self.body_hint = open.body.len() + open.body.len() / 16;
                // A batch closed early (by age, or by an operation change) keeps no big buffer.
                if open.body.capacity() > 2 * open.body.len() {
                    open.body.shrink_to_fit();
                }
            }
            Operation::DeleteAll => {}
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        Some(Batch {
            seq,
            op: open.op,
            body: Arc::new(open.body),
            docs: open.docs,
            checkpoint: open.checkpoint,
        })
    }

    /// No batch is open.
    pub fn is_empty(&self) -> bool {
        self.open.is_none()
    }

    /// How long the open batch has been open.
    #[cfg(test)]
    pub fn open_age(&self, now: Instant) -> Option<Duration> {
        self.open
            .as_ref()
            .map(|open| now.saturating_duration_since(open.opened_at))
    }

    fn is_full(&self, open: &OpenBatch) -> bool {
        open.docs >= self.limits.max_docs || open.closed_len() >= self.limits.max_bytes
    }
}

/// Batches a change stream, where one transaction mixes inserts, updates and deletes.
///
/// Unlike [`Batcher`], a change of operation does not close the batch: a window holds one part
/// per operation, and operations on *different* documents commute, so the parts can be sent as
/// separate requests (deletes, then replacements, then partial updates) in any order. Only a
/// second operation of another kind on a document the window already holds closes it first,
/// which keeps every document's operations in commit order. A delete-all is a window of its own.
/// Closed requests wait in a queue for [`ChangeBatcher::next_closed`]; a window's checkpoint
/// rides on its last request.
///
/// Why: with one request per run of one kind, a stream of small transactions that each insert
/// and delete sends two requests per transaction, and a real Meilisearch (about a second per
/// auto-batch, at most `max_inflight` tasks in each) then falls behind any steady write load.
pub struct ChangeBatcher {
    limits: BatchLimits,
    /// Parts of the open window, in the order they are sent: Delete, Replace, Update.
    parts: [Option<OpenBatch>; 3],
    /// The open window is one delete-all (counting merged repeats).
    delete_all: usize,
    /// Each document of the open window (by [`id_hash`]): the operation its part holds, and where
    /// its id and its newest item are.
    ids: HashMap<u64, HeldItem, BuildHasherDefault<PreHashed>>,
    /// The ids of the open window, back to back (`HeldItem::id` points here): a hash match alone
    /// never merges two documents.
    id_bytes: Vec<u8>,
    /// Byte ranges of the replace part that a newer version of the same document superseded:
    /// left out when the window closes.
    superseded: Vec<Range<usize>>,
    items: usize,
    bytes: usize,
    opened_at: Option<Instant>,
    checkpoint: Option<u64>,
    pending_checkpoint: Option<u64>,
    next_seq: u64,
    closed: VecDeque<Batch>,
    /// When the task spreads its index over shards, this pipeline's shard: other shards' documents
    /// are dropped at the door, as their own pipelines send them.
    shard: Option<ShardFilter>,
}

impl ChangeBatcher {
    pub fn new(limits: BatchLimits) -> Self {
        ChangeBatcher {
            limits: BatchLimits {
                max_docs: limits.max_docs.max(1),
                max_bytes: limits.max_bytes.max(1),
                max_age: limits.max_age,
            },
            parts: [None, None, None],
            delete_all: 0,
            ids: HashMap::default(),
            id_bytes: Vec::new(),
            superseded: Vec::new(),
            items: 0,
            bytes: 0,
            opened_at: None,
            checkpoint: None,
            pending_checkpoint: None,
            next_seq: 1,
            closed: VecDeque::new(),
            shard: None,
        }
    }

    /// Keeps only the documents of `filter`'s shard (all of them when None).
    pub fn with_shard(mut self, filter: Option<ShardFilter>) -> Self {
        self.shard = filter;
        self
    }

    /// Like [`ChangeBatcher::with_shard`], in place: for an owner that holds the batcher.
    pub fn set_shard(&mut self, filter: Option<ShardFilter>) {
        self.shard = filter;
    }

    pub fn shard(&self) -> Option<&ShardFilter> {
        self.shard.as_ref()
    }

    fn part_index(op: Operation) -> usize {
        match op {
            Operation::Delete | Operation::DeleteAll => 0,
            Operation::Replace => 1,
            Operation::Update => 2,
        }
    }

    /// Adds one operation on the document `id` (its JSON): `item` is the encoded document for
    /// `Replace`/`Update`, the id again for `Delete`, and nothing (with any `id`) for `DeleteAll`.
    /// `now` is read only when the item opens a window. With a shard filter, an operation on
    /// another shard's document is dropped; a delete-all concerns every shard and always passes.
    pub fn push(&mut self, op: Operation, id: &[u8], item: &[u8], now: &dyn Fn() -> Instant) {
        if op != Operation::DeleteAll
            && self
                .shard
                .as_ref()
                .is_some_and(|shard| !shard.keeps_encoded(id))
        {
            return;
        }
        if op == Operation::DeleteAll {
            if self.delete_all == 0 {
                self.close();
            }
            self.open_window(now);
            self.delete_all += 1;
            return;
        }
        let hash = id_hash(id);
        let conflict = self.delete_all > 0
            || self.ids.get(&hash).is_some_and(|held| held.op != op)
            || self.items >= self.limits.max_docs
            || self.window_len_with(op, item.len()) > self.limits.max_bytes;
        if conflict && !self.is_empty() {
            self.close();
        }
        // The same document again, with the same kind of operation: the window needs only the
        // newest replacement, and one delete.
        let repeat = self
            .ids
            .get(&hash)
            .filter(|held| held.op == op && &self.id_bytes[held.id.clone()] == id)
            .map(|held| held.item.clone());
        let supersedes = match (op, repeat) {
            (Operation::Delete, Some(_)) => return,
            (Operation::Replace, Some(older)) => {
                self.superseded.push(older);
                true
            }
            _ => false,
        };
        self.open_window(now);
        let part = self.parts[Self::part_index(op)].get_or_insert_with(|| OpenBatch {
            op,
            body: match op {
                Operation::Delete => vec![b'['],
                _ => Vec::new(),
            },
            docs: 0,
            opened_at: self.opened_at.unwrap_or_else(now),
            checkpoint: None,
        });
        let before = part.closed_len();
        let start = part.body.len();
        part.add(item);
        let added = start..part.body.len();
        // The bytes of a superseded version stay until the window closes; the document counts once.
        self.bytes = self.bytes + part.closed_len() - before;
        if !supersedes {
            self.items += 1;
        }
        match self.ids.entry(hash) {
            Entry::Occupied(mut held) => {
                // The same document (or, rarely, another whose id hashes alike: then it only
                // stays unmerged) of the same kind: its newest item.
                if &self.id_bytes[held.get().id.clone()] == id {
                    held.get_mut().item = added;
                }
            }
            Entry::Vacant(vacant) => {
                let id_start = self.id_bytes.len();
                self.id_bytes.extend_from_slice(id);
                vacant.insert(HeldItem {
                    op,
                    id: id_start..self.id_bytes.len(),
                    item: added,
                });
            }
        }
        if self.items >= self.limits.max_docs || self.bytes >= self.limits.max_bytes {
            self.close();
        }
    }

    fn open_window(&mut self, now: &dyn Fn() -> Instant) {
        if self.opened_at.is_none() {
            self.opened_at = Some(now());
            // A checkpoint marked while no window was open is completed by this one too.
            self.checkpoint = self.pending_checkpoint.take();
        }
    }

    /// The window's body bytes if `item_len` more bytes went into the part of `op`.
    fn window_len_with(&self, op: Operation, item_len: usize) -> usize {
        let grows = match &self.parts[Self::part_index(op)] {
            Some(part) => part.len_with(item_len) - part.closed_len(),
            // A new delete part brings its brackets.
            None if op == Operation::Delete => item_len + 2,
            None => item_len + 1,
        };
        self.bytes + grows
    }

    /// Everything pushed so far is covered by `checkpoint`.
    pub fn mark_checkpoint(&mut self, checkpoint: u64) {
        if self.is_empty() {
            self.pending_checkpoint = Some(checkpoint);
        } else {
            self.checkpoint = Some(checkpoint);
        }
    }

    /// A checkpoint marked with nothing pushed after the last window: safe once every request
    /// sent so far is confirmed (see [`Watermark::standalone`]).
    pub fn take_pending_checkpoint(&mut self) -> Option<u64> {
        self.pending_checkpoint.take()
    }

    /// Closes the open window if it is older than `max_age`.
    pub fn flush_due(&mut self, now: Instant) {
        if self
            .opened_at
            .is_some_and(|opened| now.saturating_duration_since(opened) >= self.limits.max_age)
        {
            self.close();
        }
    }

    /// Closes the open window, if any: its requests go to the queue of closed ones.
    pub fn close(&mut self) {
        if self.opened_at.take().is_none() {
            return;
        }
        let first = self.closed.len();
        if self.delete_all > 0 {
            self.closed.push_back(Batch {
                seq: self.next_seq,
                op: Operation::DeleteAll,
                body: Arc::new(Vec::new()),
                docs: self.delete_all,
                checkpoint: None,
            });
            self.next_seq += 1;
        }
        for part in self.parts.iter_mut() {
            if let Some(mut part) = part.take() {
                if part.op == Operation::Delete {
                    part.body.push(b']');
                }
                if part.op == Operation::Replace && !self.superseded.is_empty() {
                    part.docs -= self.superseded.len();
                    part.body = without_ranges(&part.body, &mut self.superseded);
                }
                self.closed.push_back(Batch {
                    seq: self.next_seq,
                    op: part.op,
                    body: Arc::new(part.body),
                    docs: part.docs,
                    checkpoint: None,
                });
                self.next_seq += 1;
            }
        }
        let checkpoint = self.checkpoint.take();
        let emitted = self.closed.len() > first;
        match self.closed.back_mut() {
            Some(last) if emitted => last.checkpoint = checkpoint,
            // An empty window cannot be open; keep its checkpoint rather than drop it.
            _ => self.pending_checkpoint = checkpoint.or(self.pending_checkpoint),
        }
        self.delete_all = 0;
        self.ids.clear();
        self.id_bytes.clear();
        self.superseded.clear();
        self.items = 0;
        self.bytes = 0;
    }

    /// The next closed request, in send order.
    pub fn next_closed(&mut self) -> Option<Batch> {
        self.closed.pop_front()
    }

    /// Closed requests are waiting for [`ChangeBatcher::next_closed`].
    pub fn has_closed(&self) -> bool {
        !self.closed.is_empty()
    }

    /// Body bytes of the open window and of the closed requests not yet taken.
    pub fn held_bytes(&self) -> usize {
        self.bytes
            + self
                .closed
                .iter()
                .map(|batch| batch.body.len())
                .sum::<usize>()
    }

    /// No window is open.
    pub fn is_empty(&self) -> bool {
        self.opened_at.is_none()
    }
}

/// One document of an open change window.
struct HeldItem {
    op: Operation,
    /// Its id, in `ChangeBatcher::id_bytes`.
    id: Range<usize>,
    /// Its newest item (with its newline) in its part's body.
    item: Range<usize>,
}

/// `body` without the byte `ranges` (disjoint; sorted here).
fn without_ranges(body: &[u8], ranges: &mut [Range<usize>]) -> Vec<u8> {
    ranges.sort_unstable_by_key(|range| range.start);
    let left_out: usize = ranges.iter().map(|range| range.len()).sum();
    let mut kept = Vec::with_capacity(body.len() - left_out);
    let mut from = 0;
    for range in ranges.iter() {
        kept.extend_from_slice(&body[from..range.start]);
        from = range.end;
    }
    kept.extend_from_slice(&body[from..]);
    kept
}

/// A 64-bit hash of a document id (FxHash's mixing, 8 bytes at a time): cheap, and computed for
/// every change. Two ids that collide only close a window early; an id never escapes its own
/// conflicts, so order is kept either way.
fn id_hash(id: &[u8]) -> u64 {
    const SEED: u64 = 0x517c_c1b7_2722_0a95;
    let mix = |hash: u64, word: u64| (hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    let mut chunks = id.chunks_exact(8);
    let mut hash = id.len() as u64;
    for chunk in &mut chunks {
        let mut word = [0_u8; 8];
        word.copy_from_slice(chunk);
        hash = mix(hash, u64::from_le_bytes(word));
    }
    chunks
        .remainder()
        .iter()
        .fold(hash, |hash, &byte| mix(hash, u64::from(byte)))
}

/// The hasher of a map keyed by [`id_hash`]: the key is a hash already.
#[derive(Default)]
struct PreHashed(u64);

impl Hasher for PreHashed {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = bytes
            .iter()
            .fold(self.0, |hash, &byte| hash.rotate_left(8) ^ u64::from(byte));
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

struct Sent {
    /// `None` for a standalone checkpoint.
    seq: Option<u64>,
    checkpoint: Option<u64>,
    confirmed: bool,
}

/// The newest checkpoint such that every batch sent up to it is confirmed.
///
/// A batch that failed for good counts once the caller has dealt with its
/// documents (e.g. dead-lettered them): it then calls [`Watermark::confirmed`].
#[derive(Default)]
pub struct Watermark {
    /// In send order; the front is the oldest not-yet-released entry.
    queue: VecDeque<Sent>,
    unconfirmed: usize,
}

impl Watermark {
    pub fn new() -> Self {
        Self::default()
    }

    /// A batch was handed to the writer, in seq order.
    pub fn sent(&mut self, seq: u64, checkpoint: Option<u64>) {
        self.queue.push_back(Sent {
            seq: Some(seq),
            checkpoint,
            confirmed: false,
        });
        self.unconfirmed += 1;
    }

    /// Meilisearch confirmed batch `seq`. Returns the newest checkpoint that
    /// became safe, or `None` if the watermark did not move.
    pub fn confirmed(&mut self, seq: u64) -> Option<u64> {
        let entry = self
            .queue
            .iter_mut()
            .find(|entry| entry.seq == Some(seq) && !entry.confirmed)?;
        entry.confirmed = true;
        self.unconfirmed -= 1;
        self.release()
    }

    /// A checkpoint with no batch of its own: safe once everything sent
    /// before it is confirmed. Returns it at once if that is already so.
    pub fn standalone(&mut self, checkpoint: u64) -> Option<u64> {
        self.queue.push_back(Sent {
            seq: None,
            checkpoint: Some(checkpoint),
            confirmed: true,
        });
        self.release()
    }

    /// Batches sent and not yet confirmed.
    pub fn inflight(&self) -> usize {
        self.unconfirmed
    }

    /// The oldest batch sent and not yet confirmed.
    pub fn oldest_pending(&self) -> Option<u64> {
        self.queue
            .iter()
            .find(|entry| !entry.confirmed)
            .and_then(|entry| entry.seq)
    }

    fn release(&mut self) -> Option<u64> {
        let mut newest = None;
        while self.queue.front().is_some_and(|entry| entry.confirmed) {
            if let Some(entry) = self.queue.pop_front() {
                newest = entry.checkpoint.or(newest);
            }
        }
        newest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_docs: usize, max_bytes: usize) -> BatchLimits {
        BatchLimits {
            max_docs,
            max_bytes,
            max_age: Duration::from_secs(1),
        }
    }

    use crate::test_support::Prng;

    #[test]
    fn bodies_are_ndjson_or_id_arrays() {
        let now = Instant::now();
        let mut batcher = Batcher::new(limits(100, 1 << 20));
        assert!(batcher
            .push(Operation::Replace, b"{\"id\":1}", now)
            .is_none());
        assert!(batcher
            .push(Operation::Replace, b"{\"id\":2}", now)
            .is_none());
        let replace = batcher
            .push(Operation::Delete, b"3", now)
            .expect("op change closes");
        assert_eq!(replace.seq, 1);
        assert_eq!(replace.op, Operation::Replace);
        assert_eq!(*replace.body, b"{\"id\":1}\n{\"id\":2}\n");
        assert_eq!(replace.docs, 2);
        batcher.push(Operation::Delete, b"\"a\"", now);
        let delete = batcher
            .push(Operation::DeleteAll, b"", now)
            .expect("op change");
        assert_eq!((delete.seq, delete.op), (2, Operation::Delete));
        assert_eq!(*delete.body, b"[3,\"a\"]");
        assert_eq!(delete.docs, 2);
        batcher.push(Operation::DeleteAll, b"", now);
        let update = batcher
            .push(Operation::Update, b"{\"id\":4}", now)
            .expect("op change");
        assert_eq!(
            (update.seq, update.op, update.docs),
            (3, Operation::DeleteAll, 2)
        );
        assert!(update.body.is_empty());
        let last = batcher.flush().expect("open batch");
        assert_eq!((last.seq, last.op), (4, Operation::Update));
        assert_eq!(*last.body, b"{\"id\":4}\n");
        assert!(batcher.flush().is_none());
        assert!(batcher.is_empty());
    }

    #[test]
    fn count_limit_closes_after_the_last_item() {
        let now = Instant::now();
        let mut batcher = Batcher::new(limits(2, 1 << 20));
        assert!(batcher.push(Operation::Replace, b"{}", now).is_none());
        let batch = batcher.push(Operation::Replace, b"{}", now).expect("full");
        assert_eq!(batch.docs, 2);
        assert!(batcher.is_empty());
    }

    #[test]
    fn byte_limit_closes_before_overflowing() {
        let now = Instant::now();
        // Each item takes 4 bytes with its newline.
        let mut batcher = Batcher::new(limits(100, 10));
        assert!(batcher.push(Operation::Replace, b"aaa", now).is_none());
        assert!(batcher.push(Operation::Replace, b"bbb", now).is_none());
        let batch = batcher
            .push(Operation::Replace, b"ccc", now)
            .expect("would overflow");
        assert_eq!(*batch.body, b"aaa\nbbb\n");
        // Exactly max_bytes closes after adding.
        let mut batcher = Batcher::new(limits(100, 8));
        batcher.push(Operation::Replace, b"aaa", now);
        let batch = batcher
            .push(Operation::Replace, b"bbb", now)
            .expect("exactly full");
        assert_eq!(batch.body.len(), 8);
        // A delete body counts its brackets and commas: `[1,2]` is 5 bytes.
        let mut batcher = Batcher::new(limits(100, 5));
        batcher.push(Operation::Delete, b"1", now);
        let batch = batcher
            .push(Operation::Delete, b"2", now)
            .expect("exactly full");
        assert_eq!(*batch.body, b"[1,2]");
        let mut batcher = Batcher::new(limits(100, 4));
        batcher.push(Operation::Delete, b"1", now);
        let batch = batcher
            .push(Operation::Delete, b"2", now)
            .expect("would overflow");
        assert_eq!(*batch.body, b"[1]");
    }

    #[test]
    fn oversized_item_forms_a_batch_alone() {
        let now = Instant::now();
        let mut batcher = Batcher::new(limits(100, 10));
        batcher.push(Operation::Replace, b"a", now);
        let first = batcher
            .push(Operation::Replace, b"0123456789abc", now)
            .expect("closes a");
        assert_eq!(*first.body, b"a\n");
        let big = batcher.flush_due(now).expect("oversized batch is full");
        assert_eq!(*big.body, b"0123456789abc\n");
        let big = batcher
            .push(Operation::Replace, b"0123456789abc", now)
            .expect("alone and full at once");
        assert_eq!(big.docs, 1);
    }

    #[test]
    fn op_change_into_a_full_batch_closes_it_on_the_next_push() {
        let now = Instant::now();
        let mut batcher = Batcher::new(limits(1, 1 << 20));
        let mut batches = Vec::new();
        for (op, item) in [
            (Operation::Replace, &b"{\"id\":1}"[..]),
            (Operation::Delete, b"1"),
            (Operation::Replace, b"{\"id\":1}"),
        ] {
            batches.extend(batcher.push(op, item, now));
        }
        batches.extend(batcher.flush());
        let ops: Vec<(u64, Operation)> = batches.iter().map(|b| (b.seq, b.op)).collect();
        assert_eq!(
            ops,
            [
                (1, Operation::Replace),
                (2, Operation::Delete),
                (3, Operation::Replace)
            ]
        );
    }

    #[test]
    fn a_document_batch_starts_with_the_size_of_the_last_one() {
        let now = Instant::now();
        let mut batcher = Batcher::new(limits(4, 1 << 20));
        let item = [b'x'; 99];
        let mut closed = Vec::new();
        for _ in 0..4 {
            closed.extend(batcher.push(Operation::Replace, &item, now));
        }
        assert_eq!(closed[0].body.len(), 400);
        batcher.push(Operation::Update, &item, now);
        batcher.push(Operation::Update, &item, now);
        // Closed early: its buffer is cut to size, and the next batch starts from its length.
        let early = batcher.flush().expect("open batch");
        assert_eq!(*early.body, [&item[..], b"\n", &item, b"\n"].concat());
        assert!(early.body.capacity() <= 2 * early.body.len());
        for _ in 0..4 {
            closed.extend(batcher.push(Operation::Replace, &item, now));
        }
        assert_eq!(closed[1].body.len(), 400);
    }

    #[test]
    fn age_limit() {
        let start = Instant::now();
        let mut batcher = Batcher::new(limits(100, 1 << 20));
        assert!(batcher.flush_due(start).is_none());
        assert_eq!(batcher.open_age(start), None);
        batcher.push(Operation::Replace, b"{}", start);
        batcher.push(
            Operation::Replace,
            b"{}",
            start + Duration::from_millis(900),
        );
        assert_eq!(
            batcher.open_age(start + Duration::from_millis(500)),
            Some(Duration::from_millis(500))
        );
        assert!(batcher
            .flush_due(start + Duration::from_millis(999))
            .is_none());
        let batch = batcher
            .flush_due(start + Duration::from_secs(1))
            .expect("old");
        assert_eq!(batch.docs, 2);
    }

    #[test]
    fn checkpoints_ride_on_batches() {
        let now = Instant::now();
        let mut batcher = Batcher::new(limits(100, 1 << 20));
        batcher.push(Operation::Replace, b"{}", now);
        batcher.mark_checkpoint(10);
        batcher.push(Operation::Replace, b"{}", now);
        batcher.mark_checkpoint(20);
        assert_eq!(batcher.take_pending_checkpoint(), None);
        let batch = batcher
            .push(Operation::Delete, b"1", now)
            .expect("op change");
        assert_eq!(batch.checkpoint, Some(20));
        let batch = batcher.flush().expect("open");
        assert_eq!(batch.checkpoint, None);
        batcher.mark_checkpoint(30);
        batcher.mark_checkpoint(40);
        assert_eq!(batcher.take_pending_checkpoint(), Some(40));
        assert_eq!(batcher.take_pending_checkpoint(), None);
    }

    #[test]
    fn an_untaken_pending_checkpoint_joins_the_next_batch() {
        let now = Instant::now();
        let mut batcher = Batcher::new(limits(100, 1 << 20));
        batcher.mark_checkpoint(5);
        batcher.push(Operation::Replace, b"{}", now);
        assert_eq!(batcher.take_pending_checkpoint(), None);
        assert_eq!(batcher.flush().expect("open").checkpoint, Some(5));
    }

    #[test]
    fn watermark_moves_over_a_contiguous_confirmed_prefix() {
        let mut watermark = Watermark::new();
        watermark.sent(1, Some(100));
        watermark.sent(2, None);
        watermark.sent(3, Some(300));
        watermark.sent(4, Some(400));
        assert_eq!(watermark.inflight(), 4);
        assert_eq!(watermark.confirmed(2), None);
        assert_eq!(watermark.confirmed(4), None);
        assert_eq!(watermark.confirmed(1), Some(100));
        assert_eq!(watermark.inflight(), 1);
        assert_eq!(watermark.confirmed(3), Some(400));
        assert_eq!(watermark.inflight(), 0);
        assert_eq!(watermark.confirmed(3), None);
        assert_eq!(watermark.confirmed(99), None);
    }

    #[test]
    fn standalone_checkpoints_wait_for_earlier_batches() {
        let mut watermark = Watermark::new();
        assert_eq!(watermark.standalone(5), Some(5));
        watermark.sent(1, Some(10));
        assert_eq!(watermark.standalone(15), None);
        watermark.sent(2, None);
        assert_eq!(watermark.standalone(25), None);
        assert_eq!(watermark.confirmed(2), None);
        assert_eq!(watermark.confirmed(1), Some(25));
        assert_eq!(watermark.inflight(), 0);
    }

    /// Random pushes, checkpoints and confirmation orders: every item comes
    /// out once, in order, and a checkpoint is released only when all batches
    /// holding items pushed before it are confirmed.
    fn change_batches(batcher: &mut ChangeBatcher) -> Vec<Batch> {
        std::iter::from_fn(|| batcher.next_closed()).collect()
    }

    #[test]
    fn a_change_batcher_counts_the_bytes_it_holds_until_they_are_taken() {
        let now = Instant::now();
        let clock = || now;
        let mut batcher = ChangeBatcher::new(limits(100, 1 << 20));
        assert_eq!(batcher.held_bytes(), 0);
        batcher.push(Operation::Replace, b"1", b"{\"id\":1}", &clock);
        batcher.push(Operation::Delete, b"2", b"2", &clock);
        let open = batcher.held_bytes();
        assert!(open >= 9, "the open window holds its items: {open}");
        batcher.close();
        let closed: usize = change_batches(&mut batcher)
            .iter()
            .map(|batch| batch.body.len())
            .sum();
        assert!(closed >= open - 2, "{closed} bytes closed of {open}");
        assert_eq!(batcher.held_bytes(), 0, "everything was taken");
        batcher.push(Operation::Replace, b"3", b"{\"id\":3}", &clock);
        batcher.close();
        assert_eq!(batcher.held_bytes(), b"{\"id\":3}".len() + 1);
    }

    #[test]
    fn a_hot_document_costs_one_item_per_window() {
        let now = Instant::now();
        let clock = || now;
        let mut batcher = ChangeBatcher::new(limits(100, 1 << 20));
        for version in 1..=500 {
            batcher.push(
                Operation::Replace,
                b"7",
                format!("{{\"id\":7,\"v\":{version}}}").as_bytes(),
                &clock,
            );
            batcher.push(Operation::Replace, b"17", b"{\"id\":17}", &clock);
            batcher.push(Operation::Delete, b"8", b"8", &clock);
        }
        // Another document whose id is a prefix of the hot one's is its own document.
        batcher.push(Operation::Replace, b"1", b"{\"id\":1}", &clock);
        batcher.close();
        let batches: Vec<(Operation, String, usize)> = change_batches(&mut batcher)
            .into_iter()
            .map(|b| (b.op, String::from_utf8_lossy(&b.body).into_owned(), b.docs))
            .collect();
        assert_eq!(
            batches,
            vec![
                (Operation::Delete, "[8]".into(), 1),
                (
                    Operation::Replace,
                    "{\"id\":7,\"v\":500}\n{\"id\":17}\n{\"id\":1}\n".into(),
                    3
                ),
            ]
        );
    }

    /// Two shards' batchers fed the same stream: each keeps its own documents, both the delete-all.
    #[test]
    fn a_shard_batcher_keeps_only_its_documents() {
        use crate::document::shard::ShardFilter;
        let now = Instant::now();
        let clock = || now;
        let names = vec!["ms-0".to_owned(), "ms-1".to_owned()];
        let mut shards: Vec<ChangeBatcher> = names
            .iter()
            .map(|mine| {
                ChangeBatcher::new(limits(1000, 1 << 20))
                    .with_shard(ShardFilter::new(names.clone(), mine))
            })
            .collect();
        assert_eq!(shards[1].shard().map(ShardFilter::mine), Some("ms-1"));
        let ids: Vec<String> = (0..40)
            .map(|n| {
                if n % 2 == 0 {
                    n.to_string()
                } else {
                    format!("\"k-{n}\"")
                }
            })
            .collect();
        for batcher in &mut shards {
            for id in &ids {
                let document = format!("{{\"id\":{id}}}");
                batcher.push(
                    Operation::Replace,
                    id.as_bytes(),
                    document.as_bytes(),
                    &clock,
                );
                batcher.push(Operation::Delete, id.as_bytes(), id.as_bytes(), &clock);
            }
            batcher.push(Operation::DeleteAll, b"", b"", &clock);
            batcher.mark_checkpoint(7);
            batcher.close();
        }
        let mut kept_by_shard = Vec::new();
        for (index, batcher) in shards.iter_mut().enumerate() {
            let batches = change_batches(batcher);
            let filter = batcher.shard().cloned().expect("a shard");
            let mut kept = Vec::new();
            for batch in &batches {
                if batch.op == Operation::Replace {
                    for line in String::from_utf8_lossy(&batch.body).lines() {
                        let id = line
                            .strip_prefix("{\"id\":")
                            .and_then(|rest| rest.strip_suffix('}'))
                            .expect("a document");
                        assert!(filter.keeps_encoded(id.as_bytes()), "shard {index}: {id}");
                        kept.push(id.to_owned());
                    }
                }
            }
            let last = batches.last().expect("batches");
            assert_eq!((last.op, last.checkpoint), (Operation::DeleteAll, Some(7)));
            kept_by_shard.push(kept);
        }
        // Every document went to exactly one shard, and both got some.
        assert!(kept_by_shard.iter().all(|kept| !kept.is_empty()));
        let mut all: Vec<String> = kept_by_shard.concat();
        all.sort();
        let mut expected = ids.clone();
        expected.sort();
        assert_eq!(all, expected);
    }

    #[test]
    fn a_transaction_of_other_shards_documents_still_moves_the_checkpoint() {
        use crate::document::shard::ShardFilter;
        let now = Instant::now();
        let clock = || now;
        let names = vec!["ms-0".to_owned(), "ms-1".to_owned()];
        let mut batcher = ChangeBatcher::new(limits(1000, 1 << 20))
            .with_shard(ShardFilter::new(names.clone(), "ms-0"));
        let other = ShardFilter::new(names, "ms-1").expect("a shard");
        let theirs = (0..100)
            .map(|n| n.to_string())
            .find(|id| other.keeps_id(id))
            .expect("an id of ms-1");
        batcher.push(Operation::Replace, theirs.as_bytes(), b"{}", &clock);
        assert!(batcher.is_empty());
        batcher.mark_checkpoint(5);
        assert_eq!(batcher.take_pending_checkpoint(), Some(5));
        batcher.set_shard(None);
        batcher.push(Operation::Replace, theirs.as_bytes(), b"{}", &clock);
        assert!(!batcher.is_empty());
    }

    #[test]
    fn a_change_window_mixes_kinds_until_one_document_changes_kind() {
        let now = Instant::now();
        let clock = || now;
        let mut batcher = ChangeBatcher::new(limits(100, 1 << 20));
        batcher.push(Operation::Replace, b"1", b"{\"id\":1}", &clock);
        batcher.push(Operation::Delete, b"2", b"2", &clock);
        batcher.push(Operation::Update, b"3", b"{\"id\":3}", &clock);
        batcher.push(Operation::Replace, b"4", b"{\"id\":4}", &clock);
        batcher.mark_checkpoint(10);
        batcher.push(Operation::Delete, b"5", b"5", &clock);
        batcher.push(Operation::Replace, b"1", b"{\"id\":1,\"v\":2}", &clock);
        assert!(
            !batcher.has_closed(),
            "a second replacement of 1 is no change of kind"
        );
        batcher.mark_checkpoint(20);
        // Document 2 was deleted in this window: its new version must come after the delete.
        batcher.push(Operation::Replace, b"2", b"{\"id\":2}", &clock);
        let first: Vec<(u64, Operation, String, Option<u64>)> = change_batches(&mut batcher)
            .into_iter()
            .map(|b| {
                let body = String::from_utf8_lossy(&b.body).into_owned();
                (b.seq, b.op, body, b.checkpoint)
            })
            .collect();
        assert_eq!(
            first,
            vec![
                (1, Operation::Delete, "[2,5]".into(), None),
                (
                    2,
                    Operation::Replace,
                    // Only the newest version of 1: the window sends one request per kind.
                    "{\"id\":4}\n{\"id\":1,\"v\":2}\n".into(),
                    None
                ),
                (3, Operation::Update, "{\"id\":3}\n".into(), Some(20)),
            ]
        );
        batcher.push(Operation::DeleteAll, b"", b"", &clock);
        batcher.push(Operation::DeleteAll, b"", b"", &clock);
        batcher.mark_checkpoint(30);
        batcher.push(Operation::Delete, b"6", b"6", &clock);
        batcher.close();
        let rest: Vec<(u64, Operation, usize, Option<u64>)> = change_batches(&mut batcher)
            .into_iter()
            .map(|b| (b.seq, b.op, b.docs, b.checkpoint))
            .collect();
        assert_eq!(
            rest,
            vec![
                (4, Operation::Replace, 1, None),
                (5, Operation::DeleteAll, 2, Some(30)),
                (6, Operation::Delete, 1, None),
            ]
        );
        assert!(batcher.is_empty() && batcher.take_pending_checkpoint().is_none());
    }

    /// Applies a batch the way Meilisearch does to a model index: id → fields.
    fn apply_to_model(
        index: &mut HashMap<String, HashMap<String, String>>,
        op: Operation,
        items: &[Vec<u8>],
    ) {
        for item in items {
            let text = String::from_utf8_lossy(item).into_owned();
            let (id, fields) = text.split_once(':').unwrap_or((&text, ""));
            let fields = fields
                .split(',')
                .filter(|field| !field.is_empty())
                .filter_map(|field| field.split_once('='))
                .map(|(name, value)| (name.to_owned(), value.to_owned()));
            match op {
                Operation::Replace => {
                    index.insert(id.to_owned(), fields.collect());
                }
                Operation::Update => index.entry(id.to_owned()).or_default().extend(fields),
                Operation::Delete => {
                    index.remove(id);
                }
                Operation::DeleteAll => index.clear(),
            }
        }
    }

    fn items_of(batch: &Batch) -> Vec<Vec<u8>> {
        match batch.op {
            Operation::Replace | Operation::Update => batch
                .body
                .split(|&b| b == b'\n')
                .filter(|line| !line.is_empty())
                .map(<[u8]>::to_vec)
                .collect(),
            Operation::Delete => batch.body[1..batch.body.len() - 1]
                .split(|&b| b == b',')
                .map(<[u8]>::to_vec)
                .collect(),
            Operation::DeleteAll => vec![Vec::new(); batch.docs],
        }
    }

    /// Random streams of replacements, partial updates and deletes of a few documents: applying
    /// the closed requests in order gives the index that applying every change in order gives;
    /// where a request carries a checkpoint, the index is that of the changes up to at least the
    /// checkpoint; no request exceeds the limits.
    #[test]
    fn change_windows_give_the_index_of_commit_order_at_every_checkpoint() {
        let ops = [
            Operation::Replace,
            Operation::Update,
            Operation::Delete,
            Operation::DeleteAll,
        ];
        let mut prng = Prng(0x9e37_79b9_7f4a_7c15);
        for round in 0..500 {
            let start = Instant::now();
            let max_docs = 1 + prng.below(8);
            let max_bytes = 8 + prng.below(60);
            let mut batcher = ChangeBatcher::new(BatchLimits {
                max_docs,
                max_bytes,
                max_age: Duration::from_millis(prng.below(30) as u64),
            });
            let mut expected = HashMap::new();
            // The model index after each change, and the changes before each checkpoint.
            let mut states = vec![expected.clone()];
            let mut at_checkpoint = HashMap::new();
            let mut standalone = Vec::new();
            for step in 0..80_u64 {
                let now = start + Duration::from_millis(step);
                match prng.below(6) {
                    0 => {
                        batcher.mark_checkpoint(step);
                        at_checkpoint.insert(step, states.len() - 1);
                        standalone.extend(
                            batcher
                                .take_pending_checkpoint()
                                .filter(|_| prng.below(2) == 0),
                        );
                    }
                    1 => batcher.flush_due(now),
                    _ => {
                        let op = ops[prng.below(ops.len())];
                        let id = prng.below(5).to_string();
                        let item = match op {
                            Operation::DeleteAll => String::new(),
                            Operation::Delete => id.clone(),
                            _ => format!("{id}:f{}={step}", prng.below(3)),
                        };
                        apply_to_model(&mut expected, op, &[item.clone().into_bytes()]);
                        states.push(expected.clone());
                        batcher.push(op, id.as_bytes(), item.as_bytes(), &|| now);
                    }
                }
            }
            batcher.close();
            let mut index = HashMap::new();
            for (position, batch) in change_batches(&mut batcher).into_iter().enumerate() {
                assert_eq!(batch.seq, position as u64 + 1, "round {round}");
                let items = items_of(&batch);
                assert_eq!(items.len(), batch.docs, "round {round}");
                // Repeated delete-alls merge into one request without a body.
                assert!(
                    batch.op == Operation::DeleteAll
                        || batch.docs <= max_docs
                            && (batch.docs == 1 || batch.body.len() <= max_bytes),
                    "round {round}: {} items, {} bytes",
                    batch.docs,
                    batch.body.len()
                );
                apply_to_model(&mut index, batch.op, &items);
                if let Some(checkpoint) = batch.checkpoint {
                    let before = at_checkpoint[&checkpoint];
                    assert!(
                        states[before..].contains(&index),
                        "round {round}: checkpoint {checkpoint}"
                    );
                }
            }
            assert_eq!(index, expected, "round {round}");
        }
    }

    #[test]
    fn random_streams_keep_order_and_safety() {
        enum Event {
            Sent(Batch),
            Standalone(u64),
        }
        let ops = [
            Operation::Replace,
            Operation::Update,
            Operation::Delete,
            Operation::DeleteAll,
        ];
        let max_bytes = 40;
        let mut prng = Prng(0x2545_f491_4f6c_dd1d);
        for round in 0..300 {
            let start = Instant::now();
            let mut batcher = Batcher::new(BatchLimits {
                max_docs: 1 + prng.below(5),
                max_bytes: 1 + prng.below(max_bytes),
                max_age: Duration::from_millis(prng.below(50) as u64),
            });
            let mut events = Vec::new();
            let mut pushed: Vec<(Operation, Vec<u8>)> = Vec::new();
            // (items pushed before it, checkpoint), in marking order.
            let mut checkpoints: Vec<(usize, u64)> = Vec::new();
            for step in 0..60 {
                let now = start + Duration::from_millis(step);
                match prng.below(4) {
                    0 => {
                        let checkpoint = checkpoints.len() as u64 + 1;
                        checkpoints.push((pushed.len(), checkpoint));
                        batcher.mark_checkpoint(checkpoint);
                        events.extend(batcher.take_pending_checkpoint().map(Event::Standalone));
                    }
                    1 => events.extend(batcher.flush_due(now).map(Event::Sent)),
                    _ => {
                        let op = ops[prng.below(ops.len())];
                        let item = match op {
                            Operation::DeleteAll => Vec::new(),
                            _ => pushed
                                .len()
                                .to_string()
                                .repeat(1 + prng.below(8))
                                .into_bytes(),
                        };
                        events.extend(batcher.push(op, &item, now).map(Event::Sent));
                        pushed.push((op, item));
                    }
                }
            }
            events.extend(batcher.flush().map(Event::Sent));

            let mut watermark = Watermark::new();
            let mut batches = Vec::new();
            let mut safe = 0;
            for event in events {
                match event {
                    Event::Sent(batch) => {
                        watermark.sent(batch.seq, batch.checkpoint);
                        batches.push(batch);
                    }
                    Event::Standalone(checkpoint) => {
                        // Only with nothing in flight is it released at once.
                        let released = watermark.standalone(checkpoint);
                        assert_eq!(released.is_some(), batches.is_empty(), "round {round}");
                        safe = released.unwrap_or(safe);
                    }
                }
            }

            // Order and content: the batches give back the pushes.
            let seqs: Vec<u64> = batches.iter().map(|b| b.seq).collect();
            assert_eq!(seqs, (1..=batches.len() as u64).collect::<Vec<_>>());
            let mut rebuilt: Vec<(Operation, Vec<u8>)> = Vec::new();
            for batch in &batches {
                let items = items_of(batch);
                assert_eq!(items.len(), batch.docs, "round {round}");
                assert!(
                    batch.docs == 1 || batch.body.len() <= max_bytes,
                    "round {round}"
                );
                rebuilt.extend(items.into_iter().map(|item| (batch.op, item)));
            }
            assert_eq!(rebuilt, pushed, "round {round}");

            // Safety under a random confirmation order.
            let mut first_item = Vec::new();
            let mut count = 0;
            for batch in &batches {
                first_item.push(count);
                count += batch.docs;
            }
            let mut order: Vec<usize> = (0..batches.len()).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, prng.below(i + 1));
            }
            let mut confirmed = vec![false; batches.len()];
            for index in order {
                confirmed[index] = true;
                if let Some(checkpoint) = watermark.confirmed(batches[index].seq) {
                    assert!(checkpoint > safe, "round {round}: watermark went back");
                    safe = checkpoint;
                }
                let covered_items = checkpoints
                    .iter()
                    .filter(|(_, checkpoint)| *checkpoint <= safe)
                    .map(|(items, _)| *items)
                    .max()
                    .unwrap_or(0);
                for (batch_index, first) in first_item.iter().enumerate() {
                    if *first < covered_items {
                        assert!(confirmed[batch_index], "round {round}: released too early");
                    }
                }
            }
            assert_eq!(watermark.inflight(), 0);
            let last = checkpoints.last().map_or(0, |(_, checkpoint)| *checkpoint);
            assert_eq!(
                safe, last,
                "round {round}: every checkpoint released at the end"
            );
        }
    }
}
