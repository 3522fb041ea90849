//! Snapshot backfill: copies the table by keyset pages (each page its own short transaction)
//! through the document encoder into the dispatcher, and saves the last key that Meilisearch has
//! confirmed so that a restarted worker resumes the copy instead of starting over.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pgrx::bgworkers::BackgroundWorker;

use crate::batch::{BatchLimits, Batcher, Operation};
use crate::dispatch::{item_id, DeadLetter, Dispatcher, Progress};
use crate::encode::{check_geo, encode_document, ColumnValue, DocumentShape};
use crate::error::SyncError;
use crate::shmem::{Phase, SlotHandle};
use crate::worker::task::{report_progress, should_stop};
use crate::{catalog, security};
use serde_json::Value;

/// What the copy reads: the page queries and how rows become documents.
pub struct SnapshotPlan {
    pub first_page_query: String,
    pub next_page_query: String,
    /// Rows per page at most (pages of wide rows hold fewer, see [`PageSizer`]).
    pub page_rows: usize,
    pub shape: DocumentShape,
    pub limits: BatchLimits,
    /// The table's owner: pages are read with its rights (see `security::as_table_owner`).
    pub table_owner: pgrx::pg_sys::Oid,
}

/// Bytes of row values one page may hold, about: 10,000 rows of 1 MB must not be read at once.
const PAGE_BYTES: usize = 32 << 20;

/// Sizes each page of the copy by the bytes of the rows read so far, so that a page of wide rows
/// stays near [`PAGE_BYTES`] while narrow rows still come `max_rows` at a time. The first page is
/// small, since nothing is known of the rows yet.
pub struct PageSizer {
    max_rows: usize,
    next_rows: usize,
}

impl PageSizer {
    pub fn new(max_rows: usize) -> Self {
        let max_rows = max_rows.max(1);
        PageSizer {
            max_rows,
            next_rows: max_rows.min(100),
        }
    }

    /// Rows to ask for next.
    pub fn rows(&self) -> usize {
        self.next_rows
    }

    /// A page came back with these rows (each a row of values).
    pub fn read(&mut self, rows: &[Vec<Option<String>>]) {
        let bytes: usize = rows
            .iter()
            .flatten()
            .map(|value| value.as_ref().map_or(1, String::len))
            .sum();
        let Some(average) = bytes.checked_div(rows.len()) else {
            return;
        };
        self.next_rows = (PAGE_BYTES / average.max(1)).clamp(1, self.max_rows);
    }
}

pub enum SnapshotOutcome {
    Done {
        rows: i64,
    },
    Interrupted,
    /// Meilisearch refused something for good; the message says why.
    Failed(String),
}

struct Copy<'a> {
    task_id: i64,
    slot: SlotHandle,
    dispatcher: &'a mut Dispatcher,
    /// Page number → (last key of that page, rows read through it).
    page_ends: BTreeMap<u64, (Vec<String>, i64)>,
    rows_confirmed: i64,
}

impl Copy<'_> {
    /// Records dead letters, then saves the newest fully confirmed page (in that order, so a
    /// crash in between re-sends rather than forgets).
    fn settle(&mut self, progress: Progress) -> Result<(), SyncError> {
        report_progress(
            self.task_id,
            self.slot,
            self.dispatcher,
            &progress,
            Phase::Snapshot,
        )?;
        let Some(page) = progress.checkpoint else {
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
        self.slot.set_progress(
            self.rows_confirmed,
            self.dispatcher.backlog(),
            self.dispatcher.writer().stats(),
        );
        Ok(())
    }
}

pub fn run(
    task: &catalog::TaskRecord,
    plan: &SnapshotPlan,
    dispatcher: &mut Dispatcher,
    slot: SlotHandle,
) -> Result<SnapshotOutcome, SyncError> {
    let mut copy = Copy {
        task_id: task.id,
        slot,
        dispatcher,
        page_ends: BTreeMap::new(),
        rows_confirmed: task.rows_copied,
    };
    let mut after = task.snapshot_key.clone();
    let mut rows_read = task.rows_copied;
    let mut page = 0u64;
    let mut batcher = Batcher::new(plan.limits);
    let mut done_reading = false;
    let mut document = Vec::with_capacity(1024);
    let mut pages = PageSizer::new(plan.page_rows);
    slot.set_phase(Phase::Snapshot);
    BackgroundWorker::transaction(|| catalog::mark_snapshot_started(task.id))?;

    loop {
        if should_stop() {
            return Ok(SnapshotOutcome::Interrupted);
        }
        let progress = copy.dispatcher.pump(None);
        copy.settle(progress)?;
        if let Some(failure) = copy.dispatcher.take_failure() {
            return Ok(SnapshotOutcome::Failed(failure));
        }
        if let Some(batch) = batcher.flush_due(Instant::now()) {
            copy.dispatcher.push(batch);
        }
        if !done_reading && copy.dispatcher.has_room() {
            let (query, key) = match &after {
                Some(key) => (&plan.next_page_query, Some(key.as_slice())),
                None => (&plan.first_page_query, None),
            };
            let column_count = plan.shape.columns().len();
            let limit = pages.rows();
            let rows = BackgroundWorker::transaction(|| {
                security::as_table_owner(plan.table_owner, || {
                    catalog::read_page(query, key, limit, column_count)
                })
            })?;
            pages.read(&rows);
            for row in &rows {
                let values = ColumnValue::row(row);
                document.clear();
                let encoded = encode_document(&plan.shape, &values, &mut document)
                    .and_then(|_| check_geo(&plan.shape, &values));
                if let Err(error) = encoded {
                    copy.dispatcher.add_dead_letter(DeadLetter {
                        id: item_id(
                            Operation::Replace,
                            &document,
                            plan.shape.primary_key_attribute(),
                        )
                        .unwrap_or(Value::Null),
                        op: Operation::Replace,
                        document: document.clone(),
                        code: error.code().to_owned(),
                        message: error.to_string(),
                        task_uid: None,
                        checkpoint: None,
                    });
                    continue;
                }
                if let Some(batch) = batcher.push(Operation::Replace, &document, Instant::now()) {
                    copy.dispatcher.push(batch);
                }
            }
            if let Some(last) = rows.last() {
                let key = plan.shape.key_of_row(last);
                page += 1;
                rows_read += rows.len() as i64;
                batcher.mark_checkpoint(page);
                copy.page_ends.insert(page, (key.clone(), rows_read));
                after = Some(key);
            }
            if rows.len() < limit {
                done_reading = true;
                if let Some(batch) = batcher.flush() {
                    copy.dispatcher.push(batch);
                }
                if let Some(checkpoint) = batcher.take_pending_checkpoint() {
                    let checkpoint = copy.dispatcher.standalone(checkpoint);
                    copy.settle(Progress {
                        checkpoint,
                        retries: Vec::new(),
                    })?;
                }
            }
            continue;
        }
        if done_reading && copy.dispatcher.is_idle() {
            return Ok(SnapshotOutcome::Done { rows: rows_read });
        }
        let progress = copy.dispatcher.pump(Some(Duration::from_millis(50)));
        copy.settle(progress)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(count: usize, bytes: usize) -> Vec<Vec<Option<String>>> {
        (0..count)
            .map(|_| vec![Some("x".repeat(bytes)), None])
            .collect()
    }

    #[test]
    fn pages_of_wide_rows_stay_near_the_byte_budget() {
        let mut pages = PageSizer::new(10_000);
        assert_eq!(pages.rows(), 100, "the first page is small");
        pages.read(&rows(100, 1 << 20));
        assert_eq!(pages.rows(), PAGE_BYTES / ((1 << 20) + 1));
        pages.read(&rows(1, 200 << 20));
        assert_eq!(pages.rows(), 1, "a row over the budget comes alone");
        pages.read(&rows(10, 10));
        assert_eq!(pages.rows(), 10_000, "narrow rows come max_rows at a time");
        pages.read(&[]);
        assert_eq!(pages.rows(), 10_000, "an empty page changes nothing");
    }
}
