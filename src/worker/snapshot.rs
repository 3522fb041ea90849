//! Snapshot backfill: copies the table by keyset pages (each page its own short transaction)
//! through the document encoder into the dispatcher, and saves the last key that Meilisearch has
//! confirmed so that a restarted worker resumes the copy instead of starting over.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::batch::{Batcher, Operation};
use crate::dispatch::{item_id, DeadLetter, Dispatcher, Progress};
use crate::encode::{check_geo, encode_document, ColumnValue};
use crate::plan::{PageSizer, SnapshotPlan};
use crate::shmem::{LiveStatus, Phase};
use crate::worker::control::{in_transaction, report_progress, should_stop, Stop};
use crate::{catalog, security};
use serde_json::Value;

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
            catalog::save_snapshot_progress(self.task_id, &key, rows)
        })?;
        self.rows_confirmed = rows;
        self.live.set_progress(
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
    live: LiveStatus,
) -> Result<SnapshotOutcome, Stop> {
    let mut copy = Copy {
        task_id: task.id,
        live,
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
    live.set_phase(Phase::Snapshot);
    in_transaction(live, "starting the copy", || {
        catalog::mark_snapshot_started(task.id)
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
            let rows = in_transaction(live, "reading a page of the table", || {
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
