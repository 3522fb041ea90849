//! Snapshot backfill: copies the table by keyset pages (each page its own short transaction)
//! through the document encoder into the dispatcher, and saves the last key that Meilisearch has
//! confirmed so that a restarted worker resumes the copy instead of starting over.
//!
//! Meilisearch indexes the tasks of an index that are enqueued together as one auto-batch, each
//! with a large fixed cost, so the copy keeps `snapshot_depth` batches enqueued, not only the
//! `max_inflight` it holds in memory: a batch's body is let go once Meilisearch enqueued it, and a
//! batch that fails is read again from the table by its key range.
//!
//! A page is one transaction as the table's owner; `PageSizer` reads 100 rows first, then about
//! 32 MiB of values, at most `batch_size` clamped to 100–10,000 rows. Each batch notes its key range
//! (after the previous batch's last key, through its own), and a failed batch whose body was let go
//! is read again by that range (`reread_failed`). The checkpoint is the page number: when the
//! watermark releases a page, `Copy::settle` stores its dead letters, then saves that page's last
//! key and row count. When the copy is done and the index held documents before it, `verify::prune`
//! deletes the documents whose rows are gone, then streaming begins. The copy and the stream give
//! the same bytes because both read each value's text output, with the output settings fixed for
//! the worker's session (`catalog::source::set_output_formats`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pgrx::prelude::*;

use pg_meili_sync_core::document::encode::{encode_row, ColumnValue};
use pg_meili_sync_core::meili::request::{Batch, Operation};
use pg_meili_sync_core::pipeline::batch::Batcher;
use pg_meili_sync_core::pipeline::dispatch::{DeadLetter, Dispatcher, Progress};
use pg_meili_sync_core::task::failure::FailureKind;

use crate::plan::{PageSizer, SnapshotPlan};
use crate::shmem::live::{LiveStatus, Phase};
use crate::worker::control::{fail, in_transaction, report_progress, should_stop, Stop};
use crate::{catalog, security};

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
    live: LiveStatus,
    dispatcher: &'a mut Dispatcher,
    /// Page number → (last key of that page, rows read through it).
    page_ends: BTreeMap<u64, (Vec<String>, i64)>,
    rows_confirmed: i64,
    /// Batch seq → the key range its documents came from, while the batch is unresolved.
    ranges: BTreeMap<u64, KeyRange>,
    /// The key before the open batch's first row (None: from the start of the table).
    open_after: Option<Vec<String>>,
}

/// The rows with keys after `after` (from the start when None) through `through`.
struct KeyRange {
    after: Option<Vec<String>>,
    through: Vec<String>,
}

impl Copy<'_> {
    /// Records dead letters, then saves the newest fully confirmed page (in that order, so a
    /// crash in between re-sends rather than forgets).
    fn settle(&mut self, progress: Progress) -> Result<(), Stop> {
        report_progress(
            self.task_id,
            self.live,
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
        in_transaction(self.live, "saving the copy's progress", || {
            catalog::tasks::save_snapshot_progress(self.task_id, &key, rows)
        })?;
        self.rows_confirmed = rows;
        self.live.set_progress(
            self.rows_confirmed,
            self.dispatcher.backlog(),
            self.dispatcher.writer().stats(),
        );
        Ok(())
    }

    /// Hands a closed batch to the dispatcher, noting the key range its rows came from: after the
    /// previous batch's, through `through` (the last row it read).
    fn push(&mut self, batch: Batch, through: Vec<String>) {
        self.ranges.insert(
            batch.seq,
            KeyRange {
                after: self.open_after.replace(through.clone()),
                through,
            },
        );
        self.dispatcher.push_rereadable(batch);
    }

    /// Reads again the failed batches whose bodies the dispatcher let go, and forgets the ranges
    /// of resolved batches.
    fn reread_failed(&mut self, plan: &SnapshotPlan) -> Result<(), Stop> {
        for seq in self.dispatcher.take_rereads() {
            let Some(range) = self.ranges.get(&seq) else {
                return Err(fail(
                    FailureKind::Internal,
                    format!("no key range for batch {seq} of the copy, which Meilisearch failed"),
                ));
            };
            let (query, after) = match &range.after {
                Some(key) => (&plan.next_range_query, Some(key.as_slice())),
                None => (&plan.first_range_query, None),
            };
            let through = range.through.as_slice();
            let rows = in_transaction(self.live, "reading a batch of the table again", || {
                security::as_table_owner(plan.table_owner, || {
                    catalog::source::read_range(query, after, through, plan.shape.columns().len())
                })
            })?;
            log!(
                "pg_meili_sync task {}: batch {seq} of the copy failed after Meilisearch enqueued it; its {} rows were read again from the table",
                self.task_id,
                rows.len()
            );
            let progress = self.dispatcher.reread(seq, encode_rows(plan, &rows));
            self.settle(progress)?;
        }
        match self.dispatcher.oldest_unresolved() {
            Some(oldest) => self.ranges = self.ranges.split_off(&oldest),
            None => self.ranges.clear(),
        }
        Ok(())
    }
}

/// The key of the last row read, which a batch closed between pages ends with.
fn last_read(after: &Option<Vec<String>>) -> Result<Vec<String>, Stop> {
    after.clone().ok_or_else(|| {
        fail(
            FailureKind::Internal,
            "the copy closed a batch before reading any row",
        )
    })
}

/// The NDJSON body of rows read again. Rows that cannot become documents are left out: they went
/// to the dead letters when first read (or, inserted since, come through the stream).
fn encode_rows(plan: &SnapshotPlan, rows: &[Vec<Option<String>>]) -> Vec<u8> {
    let mut body = Vec::new();
    let mut document = Vec::with_capacity(1024);
    for row in rows {
        let values = ColumnValue::row(row);
        document.clear();
        if encode_row(&plan.shape, &values, &mut document).is_ok() {
            body.extend_from_slice(&document);
            body.push(b'\n');
        }
    }
    body
}

pub fn run(
    task: &catalog::tasks::TaskRecord,
    plan: &SnapshotPlan,
    dispatcher: &mut Dispatcher,
    live: LiveStatus,
) -> Result<SnapshotOutcome, Stop> {
    let mut copy = Copy {
        task_id: task.id,
        live,
        dispatcher,
        page_ends: BTreeMap::new(),
        rows_confirmed: task.rows_copied,
        ranges: BTreeMap::new(),
        open_after: task.snapshot_key.clone(),
    };
    copy.dispatcher.set_depth(plan.depth);
    let mut after = task.snapshot_key.clone();
    let mut rows_read = task.rows_copied;
    let mut page = 0u64;
    let mut batcher = Batcher::new(plan.limits);
    let mut done_reading = false;
    let mut document = Vec::with_capacity(1024);
    let mut pages = PageSizer::new(plan.page_rows);
    // A shard copies the rows whose document id hashes to it.
    let shard = task.shard_filter();
    live.set_phase(Phase::Snapshot);
    in_transaction(live, "starting the copy", || {
        catalog::tasks::mark_snapshot_started(
            task.id,
            (!plan.partitioned_roots.is_empty()).then_some(plan.partitions.as_slice()),
        )
    })?;

    loop {
        if should_stop() {
            return Ok(SnapshotOutcome::Interrupted);
        }
        let progress = copy.dispatcher.pump(None);
        copy.settle(progress)?;
        if let Some(failure) = copy.dispatcher.take_failure() {
            return Ok(SnapshotOutcome::Failed(failure));
        }
        copy.reread_failed(plan)?;
        if let Some(batch) = batcher.flush_due(Instant::now()) {
            copy.push(batch, last_read(&after)?);
        }
        if !done_reading && copy.dispatcher.has_room() {
            let (query, key) = match &after {
                Some(key) => (&plan.next_page_query, Some(key.as_slice())),
                None => (&plan.first_page_query, None),
            };
            let column_count = plan.shape.columns().len();
            let limit = pages.rows();
            let rows = in_transaction(live, "reading a page of the table", || {
                security::as_table_owner(plan.table_owner, || {
                    catalog::source::read_page(query, key, limit, column_count)
                })
            })?;
            pages.read(&rows);
            for (index, row) in rows.iter().enumerate() {
                if shard
                    .as_ref()
                    .is_some_and(|shard| !shard.keeps_row(&plan.shape, row))
                {
                    continue;
                }
                let values = ColumnValue::row(row);
                document.clear();
                if let Err(error) = encode_row(&plan.shape, &values, &mut document) {
                    copy.dispatcher.add_dead_letter(DeadLetter::unsent_row(
                        document.clone(),
                        error.code(),
                        error.to_string(),
                        plan.shape.primary_key_attribute(),
                    ));
                    continue;
                }
                if let Some(batch) = batcher.push(Operation::Replace, &document, Instant::now()) {
                    // Closed after taking this row (nothing is open), or before it (this row
                    // opened the next batch): the batch's last row is this one, or the one before.
                    let through = if batcher.is_empty() {
                        plan.shape.key_of_row(row)
                    } else if index > 0 {
                        plan.shape.key_of_row(&rows[index - 1])
                    } else {
                        last_read(&after)?
                    };
                    copy.push(batch, through);
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
                    copy.push(batch, last_read(&after)?);
                }
                if let Some(checkpoint) = batcher.take_pending_checkpoint() {
                    let checkpoint = copy.dispatcher.standalone(checkpoint);
                    copy.settle(Progress {
                        checkpoint,
                        ..Progress::default()
                    })?;
                }
            }
            continue;
        }
        if done_reading && copy.dispatcher.is_idle() {
            // The stream holds no more than `max_inflight`: its batches cannot be read again.
            copy.dispatcher.set_depth(0);
            return Ok(SnapshotOutcome::Done { rows: rows_read });
        }
        let progress = copy.dispatcher.pump(Some(Duration::from_millis(50)));
        copy.settle(progress)?;
    }
}
