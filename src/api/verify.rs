//! Comparing a task's table with its index, and repairing what differs.

use pgrx::prelude::*;

use super::{require_admin, require_select, require_task, required, task_and_replicas};
use crate::error::OrRaise;
use crate::verify::{Findings, Repairs};

/// The findings of several replicas as one: counts added up (the table's rows counted once),
/// samples merged up to `samples` of each kind.
fn add_findings(total: &mut Findings, more: Findings, samples: usize) {
    total.rows_checked = total.rows_checked.max(more.rows_checked);
    total.documents_checked += more.documents_checked;
    total.missing += more.missing;
    total.extra += more.extra;
    total.different += more.different;
    for (into, from) in [
        (&mut total.sample_missing, more.sample_missing),
        (&mut total.sample_extra, more.sample_extra),
        (&mut total.sample_different, more.sample_different),
    ] {
        for id in from {
            if into.len() < samples && !into.contains(&id) {
                into.push(id);
            }
        }
    }
}

/// Compares the table with the index, page by page: documents missing from the index, extra in
/// it (no such row), and different from their row; with up to `samples` ids of each. A task with
/// replicas compares each (the counts add up; a NOTICE gives each replica's).
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
        let samples = usize::try_from(samples).unwrap_or(0);
        let rows = task_and_replicas(record)?;
        let several = rows.len() > 1;
        let mut total = Findings::default();
        for row in rows {
            let (id, url) = (row.id, row.url.clone());
            let findings = crate::verify::verify(row, samples)?;
            if several {
                notice!(
                    "pg_meili_sync: replica {id} at {url}: {} missing, {} extra, {} different of {} documents",
                    findings.missing, findings.extra, findings.different, findings.documents_checked
                );
            }
            add_findings(&mut total, findings, samples);
        }
        Ok(total)
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
/// A task with replicas repairs each; the counts add up.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_repair(
    task: Option<i64>,
) -> TableIterator<'static, (name!(resent, i64), name!(deleted, i64))> {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        require_select(&record)?;
        let mut total = Repairs::default();
        for row in task_and_replicas(record)? {
            let repairs = crate::verify::repair(row)?;
            total.resent += repairs.resent;
            total.deleted += repairs.deleted;
        }
        Ok(total)
    })();
    let repairs = result.or_raise();
    TableIterator::once((repairs.resent, repairs.deleted))
}
