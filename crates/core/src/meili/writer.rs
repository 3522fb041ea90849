//! The writer threads of one sync task.
//!
//! * The **sender** takes batches from a bounded channel and enqueues them
//!   with Meilisearch strictly in order, without waiting for a task to
//!   finish before sending the next (Meilisearch applies the tasks of an
//!   index in enqueue order). Document bodies are gzip-compressed here, off
//!   the owner's thread. A retryable error (transport, 5xx, 408, 429) resends
//!   the same bytes after a backoff, forever, until shutdown; since nothing
//!   else is sent meanwhile, a batch that Meilisearch did receive before the
//!   connection broke is at worst applied twice in a row, which changes
//!   nothing. Any other error fails the batch; the sender goes on with the
//!   next one and the owner decides what to do.
//! * The **poller** confirms the enqueued tasks, many per request
//!   (`GET /tasks?uids=…`), every `poll_interval`. Its own request errors are
//!   retried with backoff: a task's outcome cannot be skipped.
//!
//! The owner (the task worker's main thread, which must keep reacting to
//! signals) never blocks on the writer: [`Writer::try_send`] refuses a batch
//! while `max_inflight` batches are unconfirmed, and outcomes arrive as
//! [`WriterEvent`]s on a channel it polls. The events of one batch come in
//! order (`Enqueued` before `Confirmed` or `Failed`); those of different
//! batches may interleave, e.g. a rejected batch's `Failed` before
//! an earlier batch's `Confirmed`, which [`crate::pipeline::batch::Watermark`] absorbs.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{after, bounded, select, unbounded, Receiver, RecvTimeoutError, Sender};
use flate2::write::GzEncoder;
use flate2::Compression;

use super::client::{Client, MeiliError, MeiliErrorBody, MeiliTaskStatus};
use super::retry::Backoff;
use crate::meili::request::{Batch, Operation};

/// Task uids asked about in one `GET /tasks` request, to keep URLs short.
const MAX_UIDS_PER_POLL: usize = 500;
/// The pause between task polls doubles after each poll that finished no task, at most this many
/// times (10 ms becomes 320 ms at most), and is back to `poll_interval` at the next that does.
const MAX_QUIET_POLL_DOUBLINGS: u32 = 5;

/// While the tasks waited for are few documents and the oldest is younger than this, polls come
/// every `poll_interval` however many finished nothing: a lone change is confirmed within a poll
/// of Meilisearch finishing it (its own latency is hundreds of milliseconds). A burst and a long
/// indexing run are asked less and less often, leaving Meilisearch its cores.
const EAGER_POLLING: Duration = Duration::from_secs(2);

/// At most this many documents waited for, for polls to be eager (see `EAGER_POLLING`).
const EAGER_POLLING_DOCS: usize = 1_000;

/// Meilisearch answers a body over its payload limit with 413 and closes the connection without
/// reading the rest, so a client still uploading sees a broken pipe or a reset instead. A large
/// body of several documents that breaks off this many times in a row is taken for too large
/// (and split by the owner) rather than sent again forever.
const BROKEN_UPLOADS_BEFORE_SPLIT: u32 = 3;
/// Smaller bodies fit in the socket's buffers: the server's 413 comes back readable.
const LARGE_BODY_BYTES: usize = 64 << 10;

/// A 413 for a body whose upload broke off again and again: the owner splits it.
fn taken_for_too_large(error: &MeiliError, times: u32, bytes: usize) -> MeiliError {
    MeiliError::Http {
        status: 413,
        body: Some(MeiliErrorBody {
            message: format!(
                "the connection broke {times} times in a row while sending {bytes} bytes ({error}); taken for a body over Meilisearch's payload limit"
            ),
            code: "payload_too_large".into(),
            kind: "invalid_request".into(),
            link: String::new(),
        }),
    }
}

/// Meilisearch answers a JSON body over its payload limit (a delete-batch; document additions are
/// NDJSON and get a 413) with HTTP 500 `internal`: "JSON payload (N bytes) is larger than allowed
/// (limit: M bytes)". The body's size is at fault, not the server, so it is a 413 for the owner
/// to split, never a failure to retry unchanged.
fn refused_for_size(error: &MeiliError) -> Option<MeiliError> {
    let MeiliError::Http {
        status,
        body: Some(body),
    } = error
    else {
        return None;
    };
    if *status == 413 || !body.message.contains("is larger than allowed (limit: ") {
        return None;
    }
    Some(MeiliError::Http {
        status: 413,
        body: Some(MeiliErrorBody {
            message: format!("{} (HTTP {status} {})", body.message, body.code),
            code: "payload_too_large".into(),
            kind: "invalid_request".into(),
            link: body.link.clone(),
        }),
    })
}

/// After this many failed attempts to send the same body, the retry's error says that it is
/// being sent unchanged again and again, so that `last_error` tells a loop from a blip.
const UNCHANGED_ATTEMPTS_NOTED: u32 = 5;

/// The connection broke while the body was being written (see [`BROKEN_UPLOADS_BEFORE_SPLIT`]).
fn upload_broke_off(error: &MeiliError) -> bool {
    match error {
        MeiliError::Transport(message) => {
            let message = message.to_ascii_lowercase();
            message.contains("broken pipe") || message.contains("connection reset")
        }
        _ => false,
    }
}

#[derive(Clone)]
pub struct WriterConfig {
    pub client: Client,
    pub index_uid: String,
    /// The primary-key attribute sent as `?primaryKey=`.
    pub primary_key: String,
    /// Compress `Replace` and `Update` bodies.
    pub gzip: bool,
    /// 0 (fastest) to 9 (smallest).
    pub gzip_level: u32,
    /// Batches sent and not yet confirmed, at most (at least 1).
    pub max_inflight: usize,
    /// Pause between two task polls.
    pub poll_interval: Duration,
    pub retry_base: Duration,
    pub retry_cap: Duration,
    /// How long an enqueued task may be missing from Meilisearch's task list (deleted with
    /// `DELETE /tasks`, or lost to a restore or a wiped instance) before its batch is given up
    /// as [`WriteError::TaskVanished`], for the owner to send again.
    pub vanished_after: Duration,
}

/// Why a batch failed for good.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteError {
    /// Meilisearch refused to enqueue it (a non-retryable HTTP error).
    Rejected(MeiliError),
    /// Its task failed; Meilisearch's error object, when it gave one.
    TaskFailed(Option<MeiliErrorBody>),
    /// Its task was canceled (by someone else: the sync never cancels).
    TaskCanceled,
    /// Meilisearch no longer knows its task: whether it was applied cannot be told.
    TaskVanished { uid: u64 },
}

impl fmt::Display for WriteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WriteError::Rejected(error) => write!(f, "{error}"),
            WriteError::TaskFailed(Some(body)) => write!(f, "Meilisearch task failed: {body}"),
            WriteError::TaskFailed(None) => write!(f, "Meilisearch task failed without an error"),
            WriteError::TaskCanceled => write!(f, "Meilisearch task was canceled"),
            WriteError::TaskVanished { uid } => write!(
                f,
                "Meilisearch no longer knows task {uid} (its task list was deleted, restored from a snapshot or wiped)"
            ),
        }
    }
}

/// What happened to the batches, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriterEvent {
    /// Meilisearch accepted batch `seq` as task `task_uid`.
    Enqueued { seq: u64, task_uid: u64 },
    /// The task of batch `seq` succeeded.
    Confirmed {
        seq: u64,
        task_uid: u64,
        docs: usize,
    },
    /// Batch `seq` failed for good: refused at enqueue (`task_uid` is
    /// `None`) or its task failed or was canceled.
    Failed {
        seq: u64,
        task_uid: Option<u64>,
        error: WriteError,
    },
    /// A request for batch `seq` failed and is retried after a backoff:
    /// sending the batch, or (by the poller) asking for its task's state,
    /// `seq` then being the oldest unconfirmed batch.
    Retrying {
        seq: u64,
        attempt: u32,
        error: String,
    },
}

/// Cumulative counters, updated by the writer threads.
#[derive(Debug, Default)]
pub struct WriterStats {
    pub batches_enqueued: AtomicU64,
    pub docs_enqueued: AtomicU64,
    /// Body bytes of enqueued batches before compression.
    pub bytes_uncompressed: AtomicU64,
    /// Body bytes of enqueued batches as sent (after gzip, when on).
    pub bytes_sent: AtomicU64,
    pub batches_confirmed: AtomicU64,
    pub docs_confirmed: AtomicU64,
    /// Of those, document ids deleted (DELETE, key changes).
    pub deletes_confirmed: AtomicU64,
    /// Of those, documents partially updated (`write_mode` upsert, unchanged TOAST columns).
    pub updates_confirmed: AtomicU64,
    /// Delete-all tasks (TRUNCATE) confirmed.
    pub clears_confirmed: AtomicU64,
    pub batches_failed: AtomicU64,
    /// Requests retried, by the sender or the poller.
    pub retries: AtomicU64,
    /// Requests Meilisearch answered, with any status: while it does, it is alive, however slow
    /// its indexing (a server that stopped or died answers nothing).
    pub answers: AtomicU64,
}

/// Whether Meilisearch answered the request (with any status), rather than not at all.
fn answered<T>(result: &Result<T, MeiliError>) -> bool {
    matches!(result, Ok(_) | Err(MeiliError::Http { .. }))
}

/// A batch Meilisearch accepted, waiting for its task to finish.
struct Enqueued {
    seq: u64,
    task_uid: u64,
    docs: usize,
    op: Operation,
    /// When Meilisearch took it.
    enqueued_at: Instant,
    /// Since when Meilisearch's task list has not had this task.
    missing_since: Option<Instant>,
}

/// What both threads share.
struct Shared {
    client: Client,
    events: Sender<WriterEvent>,
    stats: Arc<WriterStats>,
    inflight: Arc<AtomicUsize>,
    stopping: Arc<AtomicBool>,
    /// Never sent on; closed by shutdown, which wakes every wait.
    stop: Receiver<()>,
    retry_base: Duration,
    retry_cap: Duration,
}

impl Shared {
    fn emit(&self, event: WriterEvent) {
        // The owner dropped the receiver only while shutting us down.
        let _ = self.events.send(event);
    }

    /// A batch left the in-flight set. Counted down before the event is
    /// emitted, so an owner reacting to the event can send at once.
    fn finish(&self, event: WriterEvent) {
        self.inflight.fetch_sub(1, Ordering::SeqCst);
        self.emit(event);
    }

    fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Sleeps `duration` unless shutdown comes first; `false` on shutdown.
    fn pause(&self, duration: Duration) -> bool {
        match self.stop.recv_timeout(duration) {
            Err(RecvTimeoutError::Timeout) => !self.is_stopping(),
            Ok(()) | Err(RecvTimeoutError::Disconnected) => false,
        }
    }
}

/// Handle of the writer threads, owned by the task worker's main thread.
pub struct Writer {
    batches: Option<Sender<Batch>>,
    events: Receiver<WriterEvent>,
    stats: Arc<WriterStats>,
    inflight: Arc<AtomicUsize>,
    max_inflight: usize,
    stopping: Arc<AtomicBool>,
    stop: Option<Sender<()>>,
    client: Client,
    threads: Vec<JoinHandle<()>>,
    /// What it was started with, to start again (see [`Writer::start_again`]).
    config: WriterConfig,
}

impl Writer {
    /// Starts the sender and poller threads.
    pub fn start(config: WriterConfig) -> Writer {
        Writer::start_counting(config, Arc::new(WriterStats::default()))
    }

    /// Stops the threads, abandoning every batch not yet confirmed, and starts new ones with the
    /// same configuration, counting on in the same stats: no event of a batch handed to the old
    /// threads ever reaches the owner.
    pub fn start_again(&mut self) {
        let config = self.config.clone();
        let stats = Arc::clone(&self.stats);
        *self = Writer::start_counting(config, stats);
    }

    fn start_counting(config: WriterConfig, stats: Arc<WriterStats>) -> Writer {
        let kept = config.clone();
        let max_inflight = config.max_inflight.max(1);
        // Its own connections, so that shutdown interrupting them leaves the
        // owner's copy of the client usable.
        let client = config.client.with_own_connections();
        let (batch_tx, batch_rx) = bounded::<Batch>(max_inflight);
        let (event_tx, event_rx) = unbounded();
        let (enqueued_tx, enqueued_rx) = unbounded::<Enqueued>();
        let (stop_tx, stop_rx) = bounded::<()>(0);
        let inflight = Arc::new(AtomicUsize::new(0));
        let stopping = Arc::new(AtomicBool::new(false));
        let shared = || Shared {
            client: client.clone(),
            events: event_tx.clone(),
            stats: Arc::clone(&stats),
            inflight: Arc::clone(&inflight),
            stopping: Arc::clone(&stopping),
            stop: stop_rx.clone(),
            retry_base: config.retry_base,
            retry_cap: config.retry_cap,
        };
        let sender = SenderThread {
            shared: shared(),
            batches: batch_rx,
            enqueued: enqueued_tx,
            index_uid: config.index_uid,
            primary_key: config.primary_key,
            gzip: config
                .gzip
                .then(|| Compression::new(config.gzip_level.min(9))),
        };
        let poller = PollerThread {
            shared: shared(),
            enqueued: enqueued_rx,
            poll_interval: config.poll_interval,
            vanished_after: config.vanished_after,
        };
        let threads = vec![
            thread::Builder::new()
                .name("meili-sender".to_string())
                .spawn(move || sender.run())
                .expect("the OS can start a thread"),
            thread::Builder::new()
                .name("meili-poller".to_string())
                .spawn(move || poller.run())
                .expect("the OS can start a thread"),
        ];
        Writer {
            batches: Some(batch_tx),
            events: event_rx,
            stats,
            inflight,
            max_inflight,
            stopping,
            stop: Some(stop_tx),
            client,
            threads,
            config: kept,
        }
    }

    /// Hands a batch to the sender, or gives it back when `max_inflight`
    /// batches are unconfirmed (or the writer has stopped). Never blocks.
    pub fn try_send(&self, batch: Batch) -> Result<(), Batch> {
        let Some(batches) = &self.batches else {
            return Err(batch);
        };
        // Only this thread counts up, so the check cannot race.
        if self.inflight.load(Ordering::SeqCst) >= self.max_inflight {
            return Err(batch);
        }
        self.inflight.fetch_add(1, Ordering::SeqCst);
        batches.try_send(batch).map_err(|error| {
            self.inflight.fetch_sub(1, Ordering::SeqCst);
            error.into_inner()
        })
    }

    /// Batches handed over and not yet confirmed or failed.
    #[cfg(test)]
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }

    pub fn events(&self) -> &Receiver<WriterEvent> {
        &self.events
    }

    pub fn stats(&self) -> &Arc<WriterStats> {
        &self.stats
    }

    /// Stops both threads and waits for them; prompt even mid-request or
    /// mid-backoff. Unconfirmed batches are abandoned: the owner resends
    /// from its last confirmed checkpoint.
    pub fn shutdown(self) {
        drop(self);
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.batches = None;
        self.stop = None;
        self.client.close_connections();
        for handle in self.threads.drain(..) {
            // A panic in a writer thread has already been reported by the
            // panic hook; the owner learns of it by the channel closing.
            let _ = handle.join();
        }
    }
}

struct SenderThread {
    shared: Shared,
    batches: Receiver<Batch>,
    enqueued: Sender<Enqueued>,
    index_uid: String,
    primary_key: String,
    gzip: Option<Compression>,
}

impl SenderThread {
    fn run(self) {
        let mut backoff = Backoff::new(self.shared.retry_base, self.shared.retry_cap);
        loop {
            let batch = select! {
                recv(self.batches) -> batch => match batch {
                    Ok(batch) => batch,
                    Err(_) => return,
                },
                recv(self.shared.stop) -> _ => return,
            };
            if !self.send(batch, &mut backoff) {
                return;
            }
        }
    }

    /// Enqueues one batch, retrying as long as that may help; `false` on
    /// shutdown.
    fn send(&self, batch: Batch, backoff: &mut Backoff) -> bool {
        let compressed = match (self.gzip, batch.op) {
            (Some(level), Operation::Replace | Operation::Update) => Some(gzip(&batch.body, level)),
            _ => None,
        };
        let body = compressed.as_deref().unwrap_or(&batch.body[..]);
        let mut attempt = 0;
        let mut broken_uploads = 0;
        loop {
            if self.shared.is_stopping() {
                return false;
            }
            let sent = self.shared.client.send_batch(
                &self.index_uid,
                &self.primary_key,
                batch.op,
                body,
                compressed.is_some(),
            );
            if answered(&sent) {
                self.shared.stats.answers.fetch_add(1, Ordering::Relaxed);
            }
            let sent = sent.map_err(|error| {
                broken_uploads = if upload_broke_off(&error) {
                    broken_uploads + 1
                } else {
                    0
                };
                let large = batch.docs > 1 && body.len() >= LARGE_BODY_BYTES;
                if large && broken_uploads >= BROKEN_UPLOADS_BEFORE_SPLIT {
                    taken_for_too_large(&error, broken_uploads, body.len())
                } else {
                    refused_for_size(&error).unwrap_or(error)
                }
            });
            match sent {
                Ok(task_uid) => {
                    let stats = &self.shared.stats;
                    stats.batches_enqueued.fetch_add(1, Ordering::Relaxed);
                    stats
                        .docs_enqueued
                        .fetch_add(batch.docs as u64, Ordering::Relaxed);
                    stats
                        .bytes_uncompressed
                        .fetch_add(batch.body.len() as u64, Ordering::Relaxed);
                    stats
                        .bytes_sent
                        .fetch_add(body.len() as u64, Ordering::Relaxed);
                    self.shared.emit(WriterEvent::Enqueued {
                        seq: batch.seq,
                        task_uid,
                    });
                    // The poller only stops on shutdown.
                    let _ = self.enqueued.send(Enqueued {
                        seq: batch.seq,
                        task_uid,
                        docs: batch.docs,
                        op: batch.op,
                        enqueued_at: Instant::now(),
                        missing_since: None,
                    });
                    return true;
                }
                // A wrong key is retried too, with the same backoff, until someone fixes it.
                Err(error) if error.is_retryable() || error.is_auth() => {
                    if self.shared.is_stopping() {
                        return false;
                    }
                    self.shared.stats.retries.fetch_add(1, Ordering::Relaxed);
                    let error = if attempt + 1 >= UNCHANGED_ATTEMPTS_NOTED {
                        format!(
                            "{error}; the same request has now failed {} times in a row and is sent again unchanged (with a backoff of at most 30 s) until Meilisearch accepts it: check Meilisearch's log, its key and its limits",
                            attempt + 1
                        )
                    } else {
                        error.to_string()
                    };
                    self.shared.emit(WriterEvent::Retrying {
                        seq: batch.seq,
                        attempt: attempt + 1,
                        error,
                    });
                    if !self.shared.pause(backoff.delay(attempt)) {
                        return false;
                    }
                    attempt += 1;
                }
                Err(error) => {
                    if self.shared.is_stopping() {
                        return false;
                    }
                    self.shared
                        .stats
                        .batches_failed
                        .fetch_add(1, Ordering::Relaxed);
                    self.shared.finish(WriterEvent::Failed {
                        seq: batch.seq,
                        task_uid: None,
                        error: WriteError::Rejected(error),
                    });
                    return true;
                }
            }
        }
    }
}

/// A document batch's body as the sender compresses it (`Content-Encoding: gzip`).
pub fn gzip(body: &[u8], level: Compression) -> Vec<u8> {
    let mut encoder = GzEncoder::new(Vec::with_capacity(body.len() / 4), level);
    encoder
        .write_all(body)
        .expect("writing into a Vec cannot fail");
    encoder.finish().expect("writing into a Vec cannot fail")
}

struct PollerThread {
    shared: Shared,
    enqueued: Receiver<Enqueued>,
    poll_interval: Duration,
    vanished_after: Duration,
}

impl PollerThread {
    fn run(self) {
        let mut backoff = Backoff::new(self.shared.retry_base, self.shared.retry_cap);
        let mut pending: VecDeque<Enqueued> = VecDeque::new();
        let mut attempt = 0;
        // Polls in a row that finished nothing: each doubles the pause, up to
        // MAX_QUIET_POLL_DOUBLINGS, so that a long indexing run is not asked
        // about 50 times a second while it takes the server's cores.
        let mut quiet_polls: u32 = 0;
        loop {
            if pending.is_empty() {
                quiet_polls = 0;
                select! {
                    recv(self.enqueued) -> task => match task {
                        Ok(task) => pending.push_back(task),
                        Err(_) => return,
                    },
                    recv(self.shared.stop) -> _ => return,
                }
            }
            // Give Meilisearch time to process, taking in tasks enqueued
            // meanwhile so that one request confirms them all.
            let eager = pending
                .front()
                .is_some_and(|oldest| oldest.enqueued_at.elapsed() < EAGER_POLLING)
                && pending.iter().map(|task| task.docs).sum::<usize>() <= EAGER_POLLING_DOCS;
            let doublings = if eager {
                0
            } else {
                quiet_polls.min(MAX_QUIET_POLL_DOUBLINGS)
            };
            let next_poll = after(self.poll_interval * 2u32.pow(doublings));
            loop {
                select! {
                    recv(self.enqueued) -> task => match task {
                        Ok(task) => pending.push_back(task),
                        Err(_) => return,
                    },
                    recv(self.shared.stop) -> _ => return,
                    recv(next_poll) -> _ => break,
                }
            }
            match self.poll(&mut pending) {
                Ok(finished) => {
                    attempt = 0;
                    quiet_polls = if finished == 0 { quiet_polls + 1 } else { 0 };
                }
                Err(error) => {
                    if self.shared.is_stopping() {
                        return;
                    }
                    self.shared.stats.retries.fetch_add(1, Ordering::Relaxed);
                    if let Some(oldest) = pending.front() {
                        self.shared.emit(WriterEvent::Retrying {
                            seq: oldest.seq,
                            attempt: attempt + 1,
                            error: error.to_string(),
                        });
                    }
                    if !self.shared.pause(backoff.delay(attempt)) {
                        return;
                    }
                    attempt += 1;
                }
            }
        }
    }

    /// Asks for the pending tasks' states and reports, in send order, the
    /// ones that finished; returns how many did.
    fn poll(&self, pending: &mut VecDeque<Enqueued>) -> Result<usize, MeiliError> {
        let uids: Vec<u64> = pending
            .iter()
            .take(MAX_UIDS_PER_POLL)
            .map(|task| task.task_uid)
            .collect();
        let listed = self.shared.client.get_tasks(&uids);
        if answered(&listed) {
            self.shared.stats.answers.fetch_add(1, Ordering::Relaxed);
        }
        let states: HashMap<u64, _> = listed?
            .into_iter()
            .map(|state| (state.uid, state))
            .collect();
        let stats = &self.shared.stats;
        let asked = pending.len();
        let mut still_pending = VecDeque::with_capacity(pending.len());
        let now = Instant::now();
        for (position, mut task) in pending.drain(..).enumerate() {
            if position >= MAX_UIDS_PER_POLL {
                still_pending.push_back(task);
                continue;
            }
            let Some(state) = states.get(&task.task_uid) else {
                // Asked for and not listed: gone, unless it reappears within the grace period.
                let since = *task.missing_since.get_or_insert(now);
                if now.duration_since(since) < self.vanished_after {
                    still_pending.push_back(task);
                    continue;
                }
                stats.batches_failed.fetch_add(1, Ordering::Relaxed);
                self.shared.finish(WriterEvent::Failed {
                    seq: task.seq,
                    task_uid: Some(task.task_uid),
                    error: WriteError::TaskVanished { uid: task.task_uid },
                });
                continue;
            };
            task.missing_since = None;
            if !state.status.is_finished() {
                still_pending.push_back(task);
                continue;
            }
            let event = match state.status {
                MeiliTaskStatus::Succeeded => {
                    stats.batches_confirmed.fetch_add(1, Ordering::Relaxed);
                    stats
                        .docs_confirmed
                        .fetch_add(task.docs as u64, Ordering::Relaxed);
                    let by_operation = match task.op {
                        Operation::Delete => Some((&stats.deletes_confirmed, task.docs)),
                        Operation::Update => Some((&stats.updates_confirmed, task.docs)),
                        Operation::DeleteAll => Some((&stats.clears_confirmed, 1)),
                        Operation::Replace => None,
                    };
                    if let Some((counter, count)) = by_operation {
                        counter.fetch_add(count as u64, Ordering::Relaxed);
                    }
                    WriterEvent::Confirmed {
                        seq: task.seq,
                        task_uid: task.task_uid,
                        docs: task.docs,
                    }
                }
                status => {
                    stats.batches_failed.fetch_add(1, Ordering::Relaxed);
                    WriterEvent::Failed {
                        seq: task.seq,
                        task_uid: Some(task.task_uid),
                        error: if status == MeiliTaskStatus::Canceled {
                            WriteError::TaskCanceled
                        } else {
                            WriteError::TaskFailed(state.error.clone())
                        },
                    }
                }
            };
            self.shared.finish(event);
        }
        let finished = asked - still_pending.len();
        *pending = still_pending;
        Ok(finished)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn config(url: &str) -> WriterConfig {
        WriterConfig {
            client: Client::new(url, Some("masterKey"), Duration::from_secs(5)).expect("valid URL"),
            index_uid: "books".to_string(),
            primary_key: "id".to_string(),
            gzip: false,
            gzip_level: 1,
            max_inflight: 4,
            poll_interval: Duration::from_millis(20),
            retry_base: Duration::from_millis(5),
            retry_cap: Duration::from_millis(50),
            vanished_after: Duration::from_millis(300),
        }
    }

    fn replace(seq: u64, ids: std::ops::Range<u64>) -> Batch {
        let mut body = Vec::new();
        for id in ids.clone() {
            body.extend_from_slice(format!("{{\"id\":{id},\"title\":\"book {id}\"}}\n").as_bytes());
        }
        Batch {
            seq,
            op: Operation::Replace,
            body: std::sync::Arc::new(body),
            docs: ids.count(),
            checkpoint: Some(seq * 10),
        }
    }

    /// Nothing listens on port 1 of loopback: every request is refused.
    const UNREACHABLE: &str = "http://127.0.0.1:1";

    #[test]
    fn refuses_batches_beyond_max_inflight() {
        let writer = Writer::start(WriterConfig {
            max_inflight: 3,
            ..config(UNREACHABLE)
        });
        for seq in 1..=3 {
            assert!(writer.try_send(replace(seq, 0..1)).is_ok());
        }
        let refused = writer.try_send(replace(4, 0..1)).expect_err("full");
        assert_eq!(refused.seq, 4);
        assert_eq!(writer.inflight(), 3);
        writer.shutdown();
    }

    #[test]
    fn retries_transport_errors_and_shuts_down_promptly_mid_backoff() {
        let writer = Writer::start(WriterConfig {
            retry_base: Duration::from_secs(30),
            retry_cap: Duration::from_secs(60),
            ..config(UNREACHABLE)
        });
        writer.try_send(replace(1, 0..1)).expect("room");
        match writer.events().recv_timeout(Duration::from_secs(5)) {
            Ok(WriterEvent::Retrying {
                seq,
                attempt,
                error,
            }) => {
                assert_eq!((seq, attempt), (1, 1));
                assert!(error.contains("cannot reach Meilisearch"), "{error}");
                assert!(!error.contains("masterKey"));
            }
            other => panic!("expected a retry, got {other:?}"),
        }
        assert_eq!(writer.stats().retries.load(Ordering::Relaxed), 1);
        let started = Instant::now();
        writer.shutdown();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn shutdown_interrupts_a_request_in_flight() {
        // Accepts one connection and never answers on it.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let url = format!("http://{}", listener.local_addr().expect("bound"));
        let (done_tx, done_rx) = bounded::<()>(0);
        let silent = thread::spawn(move || {
            let connection = listener.accept().expect("the sender connects");
            let _ = done_rx.recv();
            drop(connection);
        });
        let writer = Writer::start(WriterConfig {
            client: Client::new(&url, None, Duration::from_secs(60)).expect("valid URL"),
            ..config(&url)
        });
        writer.try_send(replace(1, 0..1)).expect("room");
        thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        writer.shutdown();
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        drop(done_tx);
        silent.join().expect("listener thread");
    }

    #[test]
    fn gzip_round_trips() {
        let body = replace(1, 0..100).body;
        let compressed = gzip(&body, Compression::new(6));
        assert!(compressed.len() < body.len() / 2);
        let mut decoded = Vec::new();
        std::io::Read::read_to_end(
            &mut flate2::read::GzDecoder::new(&compressed[..]),
            &mut decoded,
        )
        .expect("valid gzip");
        assert_eq!(decoded, *body);
    }

    #[test]
    fn write_errors_read_well() {
        let body = MeiliErrorBody {
            message: "Document identifier `\"a b\"` is invalid.".to_string(),
            code: "invalid_document_id".to_string(),
            kind: "invalid_request".to_string(),
            link: String::new(),
        };
        assert_eq!(
            WriteError::TaskFailed(Some(body)).to_string(),
            "Meilisearch task failed: Document identifier `\"a b\"` is invalid. (invalid_document_id)"
        );
        assert_eq!(
            WriteError::TaskCanceled.to_string(),
            "Meilisearch task was canceled"
        );
    }

    mod against_test_server {
        use super::*;
        use crate::pipeline::batch::Watermark;
        use meili_test_server::TestServer;
        use serde_json::{json, Value};

        const WAIT: Duration = Duration::from_secs(20);

        fn start(tune: impl FnOnce(&mut WriterConfig)) -> (TestServer, Writer) {
            let server = TestServer::start(Some("masterKey")).expect("test server starts");
            let mut config = config(&server.url());
            tune(&mut config);
            (server, Writer::start(config))
        }

        /// Collects events until `done` holds for them.
        fn events_until(
            writer: &Writer,
            done: impl Fn(&[WriterEvent]) -> bool,
        ) -> Vec<WriterEvent> {
            let deadline = Instant::now() + WAIT;
            let mut events = Vec::new();
            while !done(&events) {
                let left = deadline.saturating_duration_since(Instant::now());
                match writer.events().recv_timeout(left) {
                    Ok(event) => events.push(event),
                    Err(_) => panic!("timed out; events so far: {events:?}"),
                }
            }
            events
        }

        fn finished(events: &[WriterEvent]) -> usize {
            events
                .iter()
                .filter(|e| {
                    matches!(
                        e,
                        WriterEvent::Confirmed { .. } | WriterEvent::Failed { .. }
                    )
                })
                .count()
        }

        fn confirmed_seqs(events: &[WriterEvent]) -> Vec<u64> {
            events
                .iter()
                .filter_map(|e| match e {
                    WriterEvent::Confirmed { seq, .. } => Some(*seq),
                    _ => None,
                })
                .collect()
        }

        fn document_posts(server: &TestServer) -> Vec<Vec<u8>> {
            server
                .request_log()
                .into_iter()
                .filter(|r| r.method == "POST" && r.path.contains("/documents"))
                .map(|r| r.body)
                .collect()
        }

        #[test]
        fn delivers_many_batches_in_order() {
            let (server, writer) = start(|c| c.max_inflight = 4);
            // Writes and deletes of the same few ids: only the order
            // Meilisearch applies them in gives the expected final state.
            let mut expected: std::collections::BTreeMap<u64, Value> = Default::default();
            let mut batches = VecDeque::new();
            for seq in 1..=40u64 {
                let id = seq % 5;
                let batch = if seq % 3 == 0 {
                    expected.remove(&id);
                    Batch {
                        seq,
                        op: Operation::Delete,
                        body: format!("[{id}]").into_bytes().into(),
                        docs: 1,
                        checkpoint: Some(seq * 10),
                    }
                } else {
                    expected.insert(id, json!({"id": id, "v": seq}));
                    Batch {
                        seq,
                        op: Operation::Replace,
                        body: format!("{{\"id\":{id},\"v\":{seq}}}\n").into_bytes().into(),
                        docs: 1,
                        checkpoint: Some(seq * 10),
                    }
                };
                batches.push_back(batch);
            }
            let mut watermark = Watermark::new();
            let mut safe = None;
            let mut events = Vec::new();
            let deadline = Instant::now() + WAIT;
            while finished(&events) < 40 {
                assert!(Instant::now() < deadline, "timed out: {events:?}");
                while let Some(batch) = batches.pop_front() {
                    let (seq, checkpoint) = (batch.seq, batch.checkpoint);
                    match writer.try_send(batch) {
                        Ok(()) => watermark.sent(seq, checkpoint),
                        Err(batch) => {
                            batches.push_front(batch);
                            break;
                        }
                    }
                }
                assert!(writer.inflight() <= 4);
                if let Ok(event) = writer.events().recv_timeout(Duration::from_millis(50)) {
                    if let WriterEvent::Confirmed { seq, .. } = event {
                        safe = watermark.confirmed(seq).or(safe);
                    }
                    events.push(event);
                }
            }
            assert_eq!(safe, Some(400));
            assert_eq!(confirmed_seqs(&events).len(), 40, "{events:?}");
            let task_uids: Vec<(u64, u64)> = events
                .iter()
                .filter_map(|e| match e {
                    WriterEvent::Enqueued { seq, task_uid } => Some((*seq, *task_uid)),
                    _ => None,
                })
                .collect();
            assert!(task_uids
                .windows(2)
                .all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1));
            assert_eq!(
                server.documents("books"),
                expected.into_values().collect::<Vec<_>>()
            );
            let stats = writer.stats();
            assert_eq!(stats.batches_confirmed.load(Ordering::Relaxed), 40);
            assert_eq!(stats.docs_confirmed.load(Ordering::Relaxed), 40);
            assert_eq!(stats.deletes_confirmed.load(Ordering::Relaxed), 13);
            writer.shutdown();
        }

        #[test]
        fn respects_max_inflight_and_confirms_many_tasks_per_poll() {
            let (server, writer) = start(|c| {
                c.max_inflight = 3;
                c.poll_interval = Duration::from_millis(300);
            });
            for seq in 1..=3 {
                writer
                    .try_send(replace(seq, seq * 10..seq * 10 + 2))
                    .expect("room");
            }
            assert!(writer.try_send(replace(4, 0..1)).is_err());
            let events = events_until(&writer, |events| finished(events) == 3);
            assert_eq!(confirmed_seqs(&events), [1, 2, 3]);
            assert_eq!(writer.inflight(), 0);
            writer.try_send(replace(4, 0..1)).expect("room again");
            let task_polls: Vec<String> = server
                .request_log()
                .into_iter()
                .filter(|r| r.path.starts_with("/tasks?uids="))
                .map(|r| r.path)
                .collect();
            // The three tasks were enqueued within one poll interval, so one
            // request confirmed them all.
            assert!(
                task_polls.iter().any(|path| path.matches(',').count() == 2),
                "{task_polls:?}"
            );
            writer.shutdown();
        }

        /// The task polls of a writer that sent one batch of `docs` documents, which the server
        /// takes `delay` to finish.
        fn polls_for_one_batch(docs: u64, delay: Duration) -> usize {
            let (server, writer) = start(|c| c.poll_interval = Duration::from_millis(20));
            server.faults().set_task_delay(delay);
            writer.try_send(replace(1, 0..docs)).expect("room");
            let events = events_until(&writer, |events| finished(events) == 1);
            assert_eq!(confirmed_seqs(&events), [1]);
            writer.shutdown();
            server
                .request_log()
                .into_iter()
                .filter(|r| r.path.starts_with("/tasks?uids="))
                .count()
        }

        #[test]
        fn a_long_indexing_run_is_polled_less_and_less_often() {
            // Every 20 ms would be about 75 polls; doubling to 320 ms makes about 8.
            let polls =
                polls_for_one_batch(EAGER_POLLING_DOCS as u64 + 1, Duration::from_millis(1500));
            assert!(polls <= 15, "{polls} polls for one large batch");
        }

        #[test]
        fn a_lone_small_change_is_polled_every_interval() {
            // Every 20 ms makes about 25 polls in 500 ms; doubling would make about 5.
            let polls = polls_for_one_batch(2, Duration::from_millis(500));
            assert!(polls >= 15, "{polls} polls for one small batch");
        }

        #[test]
        fn retries_server_errors_with_the_same_bytes() {
            let (server, writer) = start(|_| {});
            server.faults().fail_next_requests(3, 503);
            writer.try_send(replace(1, 0..3)).expect("room");
            let events = events_until(&writer, |events| finished(events) == 1);
            let attempts: Vec<u32> = events
                .iter()
                .filter_map(|e| match e {
                    WriterEvent::Retrying {
                        seq: 1, attempt, ..
                    } => Some(*attempt),
                    _ => None,
                })
                .collect();
            assert_eq!(attempts, [1, 2, 3]);
            assert!(matches!(events[3], WriterEvent::Enqueued { seq: 1, .. }));
            assert_eq!(confirmed_seqs(&events), [1]);
            let posts = document_posts(&server);
            assert_eq!(posts.len(), 4);
            assert!(posts.iter().all(|body| *body == *replace(1, 0..3).body));
            assert_eq!(server.documents("books").len(), 3);
            assert_eq!(writer.stats().retries.load(Ordering::Relaxed), 3);
            writer.shutdown();
        }

        #[test]
        fn a_request_failing_again_and_again_says_so() {
            let (server, writer) = start(|_| {});
            server.faults().fail_next_requests(6, 503);
            writer.try_send(replace(1, 0..3)).expect("room");
            let events = events_until(&writer, |events| finished(events) == 1);
            let errors: Vec<&String> = events
                .iter()
                .filter_map(|e| match e {
                    WriterEvent::Retrying { seq: 1, error, .. } => Some(error),
                    _ => None,
                })
                .collect();
            assert_eq!(errors.len(), 6);
            assert!(
                errors[..4].iter().all(|error| !error.contains("in a row")),
                "{errors:?}"
            );
            assert!(
                errors[4].contains("failed 5 times in a row and is sent again unchanged"),
                "{errors:?}"
            );
            assert_eq!(confirmed_seqs(&events), [1]);
            writer.shutdown();
        }

        #[test]
        fn retries_dropped_connections() {
            let (server, writer) = start(|_| {});
            server.faults().drop_next_connections(2);
            writer.try_send(replace(1, 0..2)).expect("room");
            let events = events_until(&writer, |events| finished(events) == 1);
            let retries = events
                .iter()
                .filter(|e| matches!(e, WriterEvent::Retrying { .. }))
                .count();
            assert_eq!(retries, 2, "{events:?}");
            assert_eq!(confirmed_seqs(&events), [1]);
            assert_eq!(server.documents("books").len(), 2);
            writer.shutdown();
        }

        #[test]
        fn reports_failed_tasks_and_goes_on() {
            let (server, writer) = start(|_| {});
            server.faults().fail_next_tasks(1, "invalid_document_id");
            writer.try_send(replace(1, 0..1)).expect("room");
            writer.try_send(replace(2, 1..2)).expect("room");
            let events = events_until(&writer, |events| finished(events) == 2);
            let failure = events
                .iter()
                .find_map(|e| match e {
                    WriterEvent::Failed {
                        seq,
                        task_uid,
                        error,
                    } => Some((*seq, *task_uid, error)),
                    _ => None,
                })
                .expect("a failure");
            assert_eq!(failure.0, 1);
            assert!(failure.1.is_some());
            let WriteError::TaskFailed(Some(body)) = failure.2 else {
                panic!("{failure:?}");
            };
            assert_eq!(body.code, "invalid_document_id");
            assert_eq!(confirmed_seqs(&events), [2]);
            assert_eq!(writer.inflight(), 0);
            assert_eq!(writer.stats().batches_failed.load(Ordering::Relaxed), 1);
            writer.shutdown();
        }

        #[test]
        fn rejected_batches_fail_without_a_task() {
            let (server, writer) = start(|_| {});
            server.faults().fail_next_requests(1, 400);
            writer.try_send(replace(1, 0..1)).expect("room");
            writer.try_send(replace(2, 1..2)).expect("room");
            let events = events_until(&writer, |events| finished(events) == 2);
            assert!(
                matches!(
                    &events[0],
                    WriterEvent::Failed {
                        seq: 1,
                        task_uid: None,
                        error: WriteError::Rejected(MeiliError::Http { status: 400, .. })
                    }
                ),
                "{events:?}"
            );
            assert_eq!(confirmed_seqs(&events), [2]);
            writer.shutdown();
        }

        #[test]
        fn gzip_bodies_are_accepted() {
            let (server, writer) = start(|c| {
                c.gzip = true;
                c.gzip_level = 6;
            });
            writer.try_send(replace(1, 0..200)).expect("room");
            let delete = Batch {
                seq: 2,
                op: Operation::Delete,
                body: b"[0,1]".to_vec().into(),
                docs: 2,
                checkpoint: None,
            };
            writer.try_send(delete).expect("room");
            let events = events_until(&writer, |events| finished(events) == 2);
            assert_eq!(confirmed_seqs(&events), [1, 2]);
            assert_eq!(server.documents("books").len(), 198);
            let log = server.request_log();
            let encodings: Vec<Option<&str>> = log
                .iter()
                .filter(|r| r.method == "POST")
                .map(|r| r.content_encoding.as_deref())
                .collect();
            // Delete bodies go uncompressed.
            assert_eq!(encodings, [Some("gzip"), None]);
            let stats = writer.stats();
            let uncompressed = stats.bytes_uncompressed.load(Ordering::Relaxed);
            let sent = stats.bytes_sent.load(Ordering::Relaxed);
            assert_eq!(uncompressed, replace(1, 0..200).body.len() as u64 + 5);
            assert!(sent < uncompressed / 4, "{sent} of {uncompressed}");
            writer.shutdown();
        }

        #[test]
        fn shutdown_while_unavailable_is_prompt() {
            let (server, writer) = start(|c| {
                c.retry_base = Duration::from_millis(200);
                c.retry_cap = Duration::from_secs(30);
            });
            server.faults().set_unavailable(true);
            writer.try_send(replace(1, 0..1)).expect("room");
            events_until(&writer, |events| events.len() >= 3);
            let started = Instant::now();
            writer.shutdown();
            assert!(
                started.elapsed() < Duration::from_secs(1),
                "{:?}",
                started.elapsed()
            );
        }

        #[test]
        fn poller_retries_its_own_errors() {
            let (server, writer) = start(|c| c.poll_interval = Duration::from_millis(100));
            writer.try_send(replace(1, 0..1)).expect("room");
            events_until(&writer, |events| {
                events
                    .iter()
                    .any(|e| matches!(e, WriterEvent::Enqueued { .. }))
            });
            // The next requests are the poller's.
            server.faults().fail_next_requests(2, 502);
            let events = events_until(&writer, |events| finished(events) == 1);
            let retries = events
                .iter()
                .filter(|e| matches!(e, WriterEvent::Retrying { seq: 1, .. }))
                .count();
            assert_eq!(retries, 2, "{events:?}");
            assert_eq!(confirmed_seqs(&events), [1]);
            writer.shutdown();
        }
    }
}
