//! What a task's state forbids meanwhile: a task held for its resync's swap, a task whose server
//! a resync rebuilds, and a task in the shared decoding pass, which cannot go back to a slot of its
//! own.

use crate::catalog::{self, tasks::TaskState};
use crate::error::{ErrorKind, SyncError};

/// A task with a slot of its own moves into the shared decoding pass when altered to
/// `"decoding": "shared"`: its worker hands over once the shared slot holds its changes. The way
/// back has no such hand-over: a new slot of its own would start at the present and skip what the
/// shared slot still holds for the task.
pub fn refuse_leaving_shared_decoding(
    record: &catalog::tasks::TaskRecord,
    decoding: Option<&serde_json::Value>,
) -> Result<(), SyncError> {
    if !record.shared || decoding.and_then(|value| value.as_str()) != Some("own") {
        return Ok(());
    }
    Err(SyncError::new(
        ErrorKind::UnsupportedType,
        format!(
            "task {} is in the shared decoding pass and cannot move to a slot of its own",
            record.id
        ),
    )
    .hint("Start a new task with '{\"decoding\": \"own\"}' (meili_sync_drop, then meili_sync_start): it copies the table again."))
}

/// A task held for the swap of its resync changes only through the helper, for a moment.
pub fn refuse_while_swapping(record: &catalog::tasks::TaskRecord) -> Result<(), SyncError> {
    if record.state != TaskState::Swapping {
        return Ok(());
    }
    let helper = catalog::tasks::resync_helper(record.id)?.unwrap_or_default();
    Err(SyncError::new(
        ErrorKind::Prerequisite,
        format!(
            "task {} is held while its resync swaps in the new index",
            record.id
        ),
    )
    .hint(format!(
        "The task streams on by itself once the swap is done. To cancel the resync instead, run SELECT meili_sync_drop({helper}, drop_index => true)."
    )))
}

/// The servers of a task do not change while a resync rebuilds one of them: its helper copies with
/// the task's list (a shard's, the ids its shard keeps) and swaps on that server alone.
pub fn refuse_while_resyncing(
    record: &catalog::tasks::TaskRecord,
    members: &[catalog::tasks::TaskRecord],
    servers: &str,
) -> Result<(), SyncError> {
    for row in std::iter::once(record).chain(members) {
        if let Some(helper) = catalog::tasks::resync_helper(row.id)? {
            return Err(SyncError::new(
                ErrorKind::Prerequisite,
                format!(
                    "row {} of task {} is being resynced by helper task {helper}; its {servers} cannot change meanwhile",
                    row.id, record.id
                ),
            )
            .hint(format!(
                "Change them once the resync is done (meili_sync_status shows the helper), or cancel it with SELECT meili_sync_drop({helper}, drop_index => true)."
            )));
        }
    }
    Ok(())
}
