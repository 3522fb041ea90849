//! Comparing a task's table with its index, and repairing what differs.

use pgrx::prelude::*;

use super::{require_admin, require_select, require_task, required};
use crate::error::OrRaise;

/// Compares the table with the index, page by page: documents missing from the index, extra in
/// it (no such row), and different from their row; with up to `samples` ids of each.
#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_verify(
    task: Option<i64>,
    samples: default!(Option<i32>, 10),
) -> TableIterator<
    'static,
    (
        name!(rows_checked, i64),
        name!(documents_checked, i64),
        name!(missing, i64),
        name!(extra, i64),
        name!(different, i64),
        name!(sample_missing, Vec<String>),
        name!(sample_extra, Vec<String>),
        name!(sample_different, Vec<String>),
    ),
> {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        require_select(&record)?;
        let samples = required(
            samples,
            "samples",
            "Pass how many ids of each kind to show, e.g. 10.",
        )?;
        crate::verify::verify(record, usize::try_from(samples).unwrap_or(0))
    })();
    let findings = result.or_raise();
    TableIterator::once((
        findings.rows_checked,
        findings.documents_checked,
        findings.missing,
        findings.extra,
        findings.different,
        findings.sample_missing,
        findings.sample_extra,
        findings.sample_different,
    ))
}

/// Fixes what `meili_sync_verify` finds: re-sends missing and different documents from their
/// rows (locked meanwhile) and deletes extra ones (writes to the table wait while it deletes).
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_repair(
    task: Option<i64>,
) -> TableIterator<'static, (name!(resent, i64), name!(deleted, i64))> {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        require_select(&record)?;
        crate::verify::repair(record)
    })();
    let repairs = result.or_raise();
    TableIterator::once((repairs.resent, repairs.deleted))
}
