//! Asking for a resync: the checks, and a helper task row for each server of the task (see
//! `worker::resync` for what a helper does). Both `meili_sync_resync` and the launcher ask, the
//! launcher when a DDL changed what a task's documents look like (`"schema_changes": "resync"`).

use pgrx::prelude::*;

use pg_meili_sync_core::task::options::{validate_index_uid, TaskOptions};

use crate::catalog::{
    self,
    tasks::{NewTask, TaskRecord, TaskState},
};
use crate::error::{ErrorKind, SyncError};
use crate::plan;

/// The uid of the index a resync builds for `index_uid`.
pub fn helper_index_uid(index_uid: &str) -> String {
    format!("{index_uid}__resync")
}

/// Inserts the helper rows that resync `record` (one per server of a task with replicas or
/// shards; for a replica's or shard's row, one for that server alone), after checking that it can
/// be resynced now; returns their ids, the one of `record`'s own server first. The launcher
/// starts the helpers.
pub fn begin_resync(record: &TaskRecord) -> Result<Vec<i64>, SyncError> {
    if let Some(rebuilt) = record.resync_of {
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!("task {} is the resync helper of task {rebuilt}", record.id),
        )
        .hint(format!("Resync task {rebuilt} itself.")));
    }
    let rows: Vec<catalog::tasks::TaskRecord> = if record.replica_of.is_some() {
        vec![record.clone()]
    } else {
        std::iter::once(record.clone())
            .chain(catalog::tasks::replicas_of(record.id)?)
            .collect()
    };
    let root = record.replica_of.unwrap_or(record.id);
    if record.shard.is_some() && catalog::tasks::shard_rebalance_pending(root)? {
        return Err(SyncError::new(
            ErrorKind::Prerequisite,
            format!("a shard is still being added to task {root}"),
        )
        .hint("Resync once every shard streams and the documents that moved are gone (the server log says when)."));
    }
    for row in &rows {
        refuse_until_resyncable(row)?;
    }
    let fresh_uid = helper_index_uid(&record.index_uid);
    validate_index_uid(&fresh_uid).map_err(|_| {
        SyncError::new(
            ErrorKind::InvalidParameter,
            format!(
                "index uid \"{}\" is too long to add \"__resync\" for the new index",
                record.index_uid
            ),
        )
        .hint("Index uids of tasks to resync must be at most 392 characters long.")
    })?;
    for row in &rows {
        if let Some((existing, _)) = catalog::tasks::index_owner_task(&row.url, &fresh_uid)? {
            return Err(SyncError::new(
                ErrorKind::DuplicateTask,
                format!("task {existing} already syncs into index \"{fresh_uid}\" at {}, the index a resync would build", row.url),
            )
            .hint(format!("Drop task {existing} first.")));
        }
    }
    catalog::tasks::require_task_room(rows.len())?;
    let options = TaskOptions::parse(&record.options)?;
    // Checked as the task's worker checks it: the helper copies with the owner's rights.
    let published = plan::published_tables(record, &options)?;
    let mut helpers = Vec::with_capacity(rows.len());
    for row in &rows {
        helpers.push(catalog::tasks::insert_task(
            NewTask {
                relid: row.relid,
                // The helper acts for the task it rebuilds: its reads, mapping queries and the
                // worker's privilege checks are that task owner's, never the caller's.
                owner: row.owner,
                index_uid: &fresh_uid,
                url: &row.url,
                api_key: row.api_key.as_deref(),
                search_api_key: row.search_api_key.as_deref(),
                primary_key: &row.primary_key,
                options: row.options.clone(),
                resync_of: Some(row.id),
                replica_of: None,
                // A shard's helper keeps the ids its shard keeps.
                shard: row.shard.as_deref().zip(row.shard_names.as_deref()),
            },
            &published,
        )?);
    }
    if rows.len() > 1 {
        let each: Vec<String> = rows
            .iter()
            .zip(&helpers)
            .map(|(row, helper)| format!("helper {helper} rebuilds row {} at {}", row.id, row.url))
            .collect();
        notice!(
            "pg_meili_sync task {}: each server is resynced on its own: {}",
            record.id,
            each.join("; ")
        );
    }
    Ok(helpers)
}

/// A row can be resynced while it streams, outside a move, and without a resync under way.
fn refuse_until_resyncable(row: &catalog::tasks::TaskRecord) -> Result<(), SyncError> {
    refuse_while_moving(row)?;
    if let Some(helper) = catalog::tasks::resync_helper(row.id)? {
        return Err(SyncError::new(
            ErrorKind::DuplicateTask,
            format!("task {} is already being resynced by helper task {helper}", row.id),
        )
        .hint(format!(
            "Follow it in meili_sync_status; SELECT meili_sync_drop({helper}, drop_index => true) cancels it."
        )));
    }
    if row.state != TaskState::Streaming {
        return Err(SyncError::new(
            ErrorKind::Prerequisite,
            format!(
                "task {} is in state \"{}\"; only a streaming task can be resynced",
                row.id, row.state
            ),
        )
        .hint(format!(
            "Resume a paused or stopped task first; a task that has not finished its copy, or failed, is copied again with SELECT meili_sync_snapshot({}).",
            row.id
        )));
    }
    Ok(())
}

/// A task moving into the shared decoding pass streams from its own slot for a moment more; a
/// resync waits until it has moved.
fn refuse_while_moving(record: &catalog::tasks::TaskRecord) -> Result<(), SyncError> {
    if !record.moving {
        return Ok(());
    }
    Err(SyncError::new(
        ErrorKind::Prerequisite,
        format!(
            "task {} is moving into the shared decoding pass",
            record.id
        ),
    )
    .hint("It moves once it streams and has caught up; meili_sync_status shows decoding = 'shared' then. Try again after that."))
}
