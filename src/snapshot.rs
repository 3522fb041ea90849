//! Snapshot backfill: copies the table by keyset pages (each page its own short transaction)
//! through the document encoder into the writer, and saves the last key that Meilisearch has
//! confirmed so that a restarted worker resumes the copy instead of starting over.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use pgrx::bgworkers::BackgroundWorker;

use crate::batch::{Batch, BatchLimits, Batcher, Operation, Watermark};
use crate::catalog;
use crate::encode::{encode_document, ColumnValue, DocumentShape};
use crate::error::SyncError;
use crate::meili::writer::{Writer, WriterEvent};
use crate::shmem::{Phase, SlotHandle};
use crate::worker::task::should_stop;

/// What the copy reads: the page queries and how rows become documents.
pub struct SnapshotPlan {
    pub first_page_query: String,
    pub next_page_query: String,
    pub page_rows: usize,
    pub shape: DocumentShape,
    pub limits: BatchLimits,
    pub max_inflight: usize,
}

pub enum SnapshotOutcome {
    Done {
        rows: i64,
    },
    Interrupted,
    /// Meilisearch refused a batch for good; the message says why.
    Failed(String),
}

struct Progress {
    task_id: i64,
    slot: SlotHandle,
    watermark: Watermark,
    /// Page number → (last key of that page, rows read through it).
    page_ends: BTreeMap<u64, (Vec<String>, i64)>,
    rows_confirmed: i64,
}

impl Progress {
    /// Saves the newest fully confirmed page, if the watermark moved.
    fn checkpoint_confirmed(&mut self, checkpoint: Option<u64>) -> Result<(), SyncError> {
        let Some(page) = checkpoint else {
            return Ok(());
        };
        let Some((key, rows)) = self.page_ends.get(&page).cloned() else {
            return Ok(());
        };
        self.page_ends = self.page_ends.split_off(&(page + 1));
        BackgroundWorker::transaction(|| {
            catalog::save_snapshot_progress(self.task_id, &key, rows)
        })?;
        self.rows_confirmed = rows;
        Ok(())
    }

    fn handle(&mut self, event: WriterEvent, writer: &Writer) -> Result<Option<String>, SyncError> {
        match event {
            WriterEvent::Confirmed { seq, .. } => {
                let checkpoint = self.watermark.confirmed(seq);
                self.checkpoint_confirmed(checkpoint)?;
                self.slot.set_phase(Phase::Snapshot);
            }
            WriterEvent::Failed { error, .. } => return Ok(Some(error.to_string())),
            WriterEvent::Retrying { error, .. } => {
                self.slot.add_retry();
                self.slot.set_error(&error);
                self.slot.set_phase(Phase::Retrying);
            }
            WriterEvent::Enqueued { .. } => {}
        }
        self.slot
            .set_progress(self.rows_confirmed, writer.inflight(), writer.stats());
        Ok(None)
    }
}

pub fn run(
    task: &catalog::TaskRecord,
    plan: &SnapshotPlan,
    writer: &Writer,
    slot: SlotHandle,
) -> Result<SnapshotOutcome, SyncError> {
    let mut progress = Progress {
        task_id: task.id,
        slot,
        watermark: Watermark::new(),
        page_ends: BTreeMap::new(),
        rows_confirmed: task.rows_copied,
    };
    let mut after = task.snapshot_key.clone();
    let mut rows_read = task.rows_copied;
    let mut page = 0u64;
    let mut batcher = Batcher::new(plan.limits.clone());
    let mut pending: VecDeque<Batch> = VecDeque::new();
    let mut done_reading = false;
    let mut document = Vec::with_capacity(1024);
    slot.set_phase(Phase::Snapshot);

    loop {
        if should_stop() {
            return Ok(SnapshotOutcome::Interrupted);
        }
        while let Ok(event) = writer.events().try_recv() {
            if let Some(message) = progress.handle(event, writer)? {
                return Ok(SnapshotOutcome::Failed(message));
            }
        }
        if let Some(batch) = batcher.flush_due(Instant::now()) {
            progress.watermark.sent(batch.seq, batch.checkpoint);
            pending.push_back(batch);
        }
        while let Some(batch) = pending.pop_front() {
            if let Err(refused) = writer.try_send(batch) {
                pending.push_front(refused);
                break;
            }
        }
        if !done_reading && pending.is_empty() && writer.inflight() < plan.max_inflight {
            let (query, key) = match &after {
                Some(key) => (&plan.next_page_query, Some(key.as_slice())),
                None => (&plan.first_page_query, None),
            };
            let column_count = plan.shape.columns().len();
            let rows =
                BackgroundWorker::transaction(|| catalog::read_page(query, key, column_count))?;
            for row in &rows {
                let values: Vec<ColumnValue> = row
                    .iter()
                    .map(|value| {
                        value
                            .as_deref()
                            .map_or(ColumnValue::Null, ColumnValue::Text)
                    })
                    .collect();
                document.clear();
                if let Err(error) = encode_document(&plan.shape, &values, &mut document) {
                    // Dead letters arrive with the retry work; until then the row is reported and skipped.
                    let message = format!("row skipped: {error}");
                    pgrx::warning!("pg_meili_sync task {}: {message}", task.id);
                    slot.set_error(&message);
                    continue;
                }
                if let Some(batch) = batcher.push(Operation::Replace, &document, Instant::now()) {
                    progress.watermark.sent(batch.seq, batch.checkpoint);
                    pending.push_back(batch);
                }
            }
            if let Some(last) = rows.last() {
                let key: Vec<String> = plan
                    .shape
                    .key_columns()
                    .iter()
                    .map(|&index| last.get(index).cloned().flatten().unwrap_or_default())
                    .collect();
                page += 1;
                rows_read += rows.len() as i64;
                batcher.mark_checkpoint(page);
                progress.page_ends.insert(page, (key.clone(), rows_read));
                after = Some(key);
            }
            if rows.len() < plan.page_rows {
                done_reading = true;
                if let Some(batch) = batcher.flush() {
                    progress.watermark.sent(batch.seq, batch.checkpoint);
                    pending.push_back(batch);
                }
                if let Some(checkpoint) = batcher.take_pending_checkpoint() {
                    let confirmed = progress.watermark.standalone(checkpoint);
                    progress.checkpoint_confirmed(confirmed)?;
                }
            }
            continue;
        }
        if done_reading && pending.is_empty() && progress.watermark.inflight() == 0 {
            return Ok(SnapshotOutcome::Done { rows: rows_read });
        }
        if let Ok(event) = writer.events().recv_timeout(Duration::from_millis(50)) {
            if let Some(message) = progress.handle(event, writer)? {
                return Ok(SnapshotOutcome::Failed(message));
            }
        }
    }
}
