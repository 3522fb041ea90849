//! The SQL functions, by topic: tasks (start, preview, state changes, alter, resync, drop),
//! search (and `meili_sync_wait`), dead letters, verify/repair, and statistics. This module holds
//! what they share: the checks of who may call them and of the server's settings, and the wake-up
//! of the launcher at COMMIT.
//!
//! Only searches, `verify`, `repair`, the dead-letter retry and `drop(drop_index => true)` call
//! Meilisearch from the backend; every other function writes the catalog and lets the workers act.
//! The wake-up (`shmem::commits::wake_launcher_at_commit`) happens at COMMIT only: an aborted transaction
//! wakes nobody. Without it a launcher's next round comes within its round interval.

mod dead_letters;
mod search;
mod stats;
mod tasks;
mod verify;

use crate::catalog;
use crate::error::{ErrorKind, SyncError};
use crate::{gucs, security};

pub(super) use crate::shmem::commits::wake_launcher_at_commit;

/// The caller manages tasks: it must be an admin, and the installed SQL objects must be this
/// library's (a task written by another version's functions could be misread).
pub(super) fn require_admin() -> Result<(), SyncError> {
    if !catalog::current_role_is_admin()? {
        return Err(SyncError::new(
            ErrorKind::Privilege,
            "permission denied to manage meili_sync tasks",
        )
        .hint("Only superusers and members of the meili_sync_admin role can manage tasks."));
    }
    if let Some(mismatch) = catalog::install::sql_version_mismatch()? {
        return Err(SyncError::new(ErrorKind::Prerequisite, mismatch)
            .hint("Run ALTER EXTENSION pg_meili_sync UPDATE, which brings the SQL objects to the library's version; then try again."));
    }
    Ok(())
}

/// The caller must be able to read the task's table: these functions copy, compare or re-send
/// its rows, and a task must not be a way around the table's privileges.
pub(super) fn require_select(record: &catalog::tasks::TaskRecord) -> Result<(), SyncError> {
    if catalog::may_select(security::current_role(), record.relid)? {
        return Ok(());
    }
    Err(select_denied(record)?)
}

pub(super) fn select_denied(record: &catalog::tasks::TaskRecord) -> Result<SyncError, SyncError> {
    let role = catalog::role_name(security::current_role())?;
    Ok(SyncError::new(
        ErrorKind::Privilege,
        format!("permission denied for table {}", record.relation),
    )
    .detail(format!(
        "Task {} syncs {}, which role {role} may not read.",
        record.id, record.relation
    ))
    .hint(format!(
        "Ask the table's owner for SELECT: GRANT SELECT ON {} TO {role}.",
        record.relation
    )))
}

/// The functions are not STRICT: a NULL argument is a mistake to report, not a silent NULL result.
pub(super) fn required<T>(value: Option<T>, name: &str, hint: &str) -> Result<T, SyncError> {
    value.ok_or_else(|| {
        SyncError::new(
            ErrorKind::NullArgument,
            format!("argument \"{name}\" must not be NULL"),
        )
        .hint(hint)
    })
}

pub(super) const TASK_HINT: &str =
    "Pass a task id, as listed in the \"task\" column of meili_sync_status.";

pub(super) fn require_task(task: Option<i64>) -> Result<catalog::tasks::TaskRecord, SyncError> {
    catalog::tasks::require_task(required(task, "task", TASK_HINT)?)
}

pub(super) fn require_preloaded() -> Result<(), SyncError> {
    if crate::preloaded() {
        Ok(())
    } else {
        Err(SyncError::new(ErrorKind::Prerequisite, "pg_meili_sync is not loaded by shared_preload_libraries")
            .hint("Add pg_meili_sync to shared_preload_libraries in postgresql.conf and restart the server."))
    }
}

pub(super) fn require_logical_wal() -> Result<(), SyncError> {
    let level = catalog::wal_level()?;
    if level == "logical" {
        Ok(())
    } else {
        Err(SyncError::new(
            ErrorKind::Prerequisite,
            format!("wal_level is \"{level}\", not \"logical\""),
        )
        .hint("Set wal_level = logical in postgresql.conf and restart the server."))
    }
}

/// The launcher must run this database's tasks: with `meili_sync.database` set it runs that
/// database's only, and in a copy of another database (`CREATE DATABASE … TEMPLATE`) it runs
/// none, as a new task's slot name could be one of the original's.
pub(super) fn require_launcher_database() -> Result<(), SyncError> {
    if let Some(original) = catalog::install::copied_from()? {
        return Err(SyncError::new(
            ErrorKind::Prerequisite,
            format!(
                "this database is a copy of the database with OID {}, and the tasks of a copy do not run",
                original.to_u32()
            ),
        )
        .hint("Run DROP EXTENSION pg_meili_sync CASCADE, then CREATE EXTENSION pg_meili_sync, in this database; then start its tasks."));
    }
    let Some(configured) = gucs::database() else {
        return Ok(());
    };
    let current = catalog::current_database()?;
    if current == configured {
        Ok(())
    } else {
        Err(SyncError::new(
            ErrorKind::Prerequisite,
            format!("meili_sync tasks run in database \"{configured}\", not in \"{current}\""),
        )
        .hint(format!(
            "Connect to database \"{configured}\", or set meili_sync.database = '{current}' (or unset it, to serve every database) in postgresql.conf and restart the server."
        )))
    }
}

/// The task's row and its replicas' rows (on a replica's row: that replica alone).
pub(super) fn task_and_replicas(
    record: catalog::tasks::TaskRecord,
) -> Result<Vec<catalog::tasks::TaskRecord>, SyncError> {
    let mut rows = catalog::tasks::replicas_of(record.id)?;
    rows.insert(0, record);
    Ok(rows)
}
