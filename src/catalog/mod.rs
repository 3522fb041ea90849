//! All SPI: the task catalog, progress, slots and publications, and reading source pages, in
//! one module per concern (tasks, dead letters, replication slots and publications, source
//! tables); the shared helpers live here.
//!
//! Every function here expects to run inside a transaction (the caller's, or one a worker opened).

pub mod dead_letters;
mod fragments;
pub mod install;
pub mod reader_dependence;
pub mod replication;
pub mod search_targets;
pub mod shared;
pub mod source;
pub mod tasks;
pub mod view;

use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

use crate::error::{ErrorKind, SyncError};
use crate::security;
use fragments::CATALOG_OWNER_SQL;

pub type CatalogResult<T> = Result<T, SyncError>;

/// Runs a read-only query and returns the first column of its first row. pgrx's `Spi::get_one`
/// and `Spi::run` mark the transaction as writing, which assigns it an xid: a worker polling
/// the catalog would burn xids, and a slot cannot be created after one.
fn select_one<T: IntoDatum + FromDatum>(
    query: &str,
    args: &[DatumWithOid],
) -> CatalogResult<Option<T>> {
    Spi::connect(|client| {
        let table = client.select(query, Some(1), args)?;
        if table.is_empty() {
            Ok(None)
        } else {
            Ok(table.first().get_one::<T>()?)
        }
    })
}

fn names_from(value: Option<Vec<Option<String>>>) -> Option<Vec<String>> {
    value.map(|names| names.into_iter().flatten().collect())
}

/// What a role sees instead of an error it may not read.
pub const HIDDEN_ERROR: &str = "hidden: reading this task's errors needs SELECT on its table or view, or membership in meili_sync_admin";

/// The one rule of who may read a task's error, which can quote a row's values (a refused
/// document's id, a value that failed a cast): superusers and members of `meili_sync_admin` (who
/// read the dead letters, whole documents) read every error; any other role reads the errors of
/// the tasks whose table or view it may SELECT. Every view and function that shows an error goes
/// through here: the view `meili_sync_status` through `meili_sync_readable_error`.
pub fn readable_error(
    source: Option<pg_sys::Oid>,
    error: Option<String>,
) -> CatalogResult<Option<String>> {
    let Some(error) = error else {
        return Ok(None);
    };
    let readable = select_one::<bool>(
        "SELECT pg_catalog.pg_has_role('meili_sync_admin', 'MEMBER')
             OR coalesce(pg_catalog.has_table_privilege($1::pg_catalog.oid, 'SELECT'), false)",
        &[source.into()],
    )?
    .unwrap_or(false);
    Ok(Some(if readable {
        error
    } else {
        HIDDEN_ERROR.to_owned()
    }))
}

/// The table or view of each task of this database, read as the catalog's owner: the roles
/// that may watch the workers (`pg_monitor`) may not read the catalog itself.
pub fn task_sources() -> CatalogResult<std::collections::HashMap<i64, pg_sys::Oid>> {
    as_catalog_owner(|| {
        Spi::connect(|client| {
            let mut sources = std::collections::HashMap::new();
            for row in client.select(
                "SELECT t.id, t.source::pg_catalog.oid FROM meili_sync.tasks t",
                None,
                &[],
            )? {
                if let (Some(task), Some(source)) = (row.get::<i64>(1)?, row.get::<pg_sys::Oid>(2)?)
                {
                    sources.insert(task, source);
                }
            }
            Ok(sources)
        })
    })
}

pub fn current_role_is_admin() -> CatalogResult<bool> {
    Ok(select_one::<bool>(
        "SELECT (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) current_user)
             OR pg_catalog.pg_has_role(current_user, 'meili_sync_admin', 'MEMBER')",
        &[],
    )?
    .unwrap_or(false))
}

/// Runs catalog writes as the catalog's owner: `meili_sync_admin` may only read the catalog, so
/// that every task comes through a function that checked its caller.
fn as_catalog_owner<T>(work: impl FnOnce() -> CatalogResult<T>) -> CatalogResult<T> {
    let owner = select_one::<pg_sys::Oid>(&format!("SELECT {CATALOG_OWNER_SQL}"), &[])?
        .ok_or_else(|| SyncError::new(ErrorKind::Internal, "meili_sync.tasks has no owner"))?;
    security::as_catalog_owner(owner, work)
}

/// Whether `role` may SELECT from the table (false if the role no longer exists).
pub fn may_select(role: pg_sys::Oid, relid: pg_sys::Oid) -> CatalogResult<bool> {
    Ok(select_one::<bool>(
        "SELECT CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.oid OPERATOR(pg_catalog.=) $1)
                      AND EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) $2)
                     THEN pg_catalog.has_table_privilege($1, $2, 'SELECT') ELSE false END",
        &[role.into(), relid.into()],
    )?
    .unwrap_or(false))
}

/// Whether the partition `partition` can be read and locked on its own as its partitioned table
/// is, by that table's owner `owner`: `owner` owns it too, and it has no row-level security of
/// its own (a query through the partitioned table applies only the partitioned table's).
pub fn reads_like_its_root(partition: pg_sys::Oid, owner: pg_sys::Oid) -> CatalogResult<bool> {
    Ok(select_one::<bool>(
        "SELECT c.relowner OPERATOR(pg_catalog.=) $2 AND NOT c.relrowsecurity
           FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) $1",
        &[partition.into(), owner.into()],
    )?
    .unwrap_or(false))
}

/// Whether the current role has the rights of `role` (is it, a member of it, or a superuser).
pub fn acts_as(role: pg_sys::Oid) -> CatalogResult<bool> {
    Ok(select_one::<bool>(
        "SELECT CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.oid OPERATOR(pg_catalog.=) $1)
                     THEN pg_catalog.pg_has_role($1, 'USAGE')
                     ELSE (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) current_user) END",
        &[role.into()],
    )?
    .unwrap_or(false))
}

/// A role's name, or its OID in brackets once it is gone.
pub fn role_name(role: pg_sys::Oid) -> CatalogResult<String> {
    Ok(select_one::<String>(
        "SELECT coalesce((SELECT r.rolname::text FROM pg_catalog.pg_roles r WHERE r.oid OPERATOR(pg_catalog.=) $1),
                         pg_catalog.format('(dropped role %s)', $1))",
        &[role.into()],
    )?
    .unwrap_or_default())
}

pub fn wal_level() -> CatalogResult<String> {
    Ok(
        select_one::<String>("SELECT pg_catalog.current_setting('wal_level')", &[])?
            .unwrap_or_default(),
    )
}

pub fn current_database() -> CatalogResult<String> {
    Ok(
        select_one::<String>("SELECT pg_catalog.current_database()::text", &[])?
            .unwrap_or_default(),
    )
}

/// Where the WAL ends now (`pg_current_wal_lsn()`), in bytes: past every commit made before.
pub fn current_wal_lsn() -> CatalogResult<u64> {
    Ok(select_one::<i64>(
        "SELECT pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), '0/0')::bigint",
        &[],
    )?
    .map_or(0, |lsn| lsn as u64))
}

/// An LSN in Postgres's text form, `X/X`.
pub fn format_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

pub fn extension_installed() -> CatalogResult<bool> {
    Ok(select_one::<bool>(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname OPERATOR(pg_catalog.=) 'pg_meili_sync')",
        &[],
    )?
    .unwrap_or(false))
}

/// This install of the extension: its catalog table's OID, which is in the names of its slots
/// and publications (a DROP and CREATE EXTENSION makes a new one).
pub fn install_id() -> CatalogResult<Option<pg_sys::Oid>> {
    select_one::<pg_sys::Oid>(
        "SELECT 'meili_sync.tasks'::pg_catalog.regclass::pg_catalog.oid",
        &[],
    )
}

/// The SQL expression of a task's slot and publication name (see [`object_name`]), for queries
/// over `meili_sync.tasks`.
const OBJECT_NAME_SQL: &str =
    "pg_catalog.format('meili_sync_%s_%s', 'meili_sync.tasks'::pg_catalog.regclass::pg_catalog.oid, t.id)";

/// The first column of `rows`: task ids (a NULL id is skipped).
fn ids_of(rows: pgrx::spi::SpiTupleTable<'_>) -> Result<Vec<i64>, pgrx::spi::SpiError> {
    let mut ids = Vec::new();
    for row in rows {
        if let Some(id) = row.get::<i64>(1)? {
            ids.push(id);
        }
    }
    Ok(ids)
}
