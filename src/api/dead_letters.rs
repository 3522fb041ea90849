//! Dead letters: re-send them from their rows, or forget them.

use pgrx::prelude::*;

use super::{require_admin, require_select, require_task, task_and_replicas};
use crate::catalog;
use crate::error::OrRaise;

/// Sends dead-lettered documents again from their rows' current state, straight to Meilisearch
/// (the rows are locked meanwhile, so no newer version can be overtaken), and clears them; a
/// dead letter whose row is gone becomes a delete. Returns how many documents were re-sent or
/// deleted. Nothing is written to the table, so no trigger of the table fires. A task with
/// replicas re-sends each replica's own dead letters to it.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_retry_dead_letters(task: Option<i64>) -> i64 {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        require_select(&record)?;
        let mut resent = 0;
        for row in task_and_replicas(record)? {
            let ids = catalog::dead_letters::dead_letter_ids(row.id, None)?;
            let task_id = row.id;
            resent += crate::verify::resend_dead_letters(row, &ids)?;
            // Only those re-sent: one the worker stores meanwhile stays for the next retry.
            catalog::dead_letters::delete_dead_letters(task_id, Some(&ids))?;
        }
        Ok(resent)
    })();
    result.or_raise()
}

/// Forgets dead letters: all of a task's (and its replicas'), or those with the given document
/// ids. Returns how many.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_discard_dead_letters(
    task: Option<i64>,
    document_ids: default!(Option<Vec<String>>, "NULL"),
) -> i64 {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        require_select(&record)?;
        let mut deleted = 0;
        for row in task_and_replicas(record)? {
            deleted += catalog::dead_letters::delete_dead_letters(row.id, document_ids.as_deref())?;
        }
        Ok(deleted)
    })();
    result.or_raise()
}
