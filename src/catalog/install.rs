//! This install of the extension: the version of its SQL objects against the library's, and the
//! token that tells this install's tasks from tasks restored out of another's dump.
//!
//! The library serves only the SQL objects of its own version (`LIBRARY_VERSION` against
//! `pg_extension.extversion`): with others the launcher starts no task and marks each active one as
//! waiting for `ALTER EXTENSION pg_meili_sync UPDATE`, and the SQL functions refuse to manage
//! tasks. `sql/` keeps the install script of every earlier version and one update script per step;
//! a catalog or SQL API change bumps the version and adds the next update script.

use pgrx::prelude::*;

use super::fragments::update_in_id_order_sql;
use super::{as_catalog_owner, select_one, CatalogResult};

/// The version of the SQL objects this library was built with (the control file's
/// `default_version`).
pub const LIBRARY_VERSION: &str = env!("CARGO_PKG_VERSION");

/// How an active task's `last_error` begins while the installed SQL is not the library's; the
/// launcher clears it after `ALTER EXTENSION pg_meili_sync UPDATE`.
const WAITING_FOR_UPDATE: &str = "waiting for ALTER EXTENSION pg_meili_sync UPDATE";

/// The version of the extension's SQL objects in this database, if the extension exists.
pub fn installed_sql_version() -> CatalogResult<Option<String>> {
    select_one::<String>(
        "SELECT e.extversion::pg_catalog.text FROM pg_catalog.pg_extension e
          WHERE e.extname OPERATOR(pg_catalog.=) 'pg_meili_sync'",
        &[],
    )
}

/// Why the library cannot serve the installed SQL objects, if it cannot: they are of another
/// version (the library was replaced, and `ALTER EXTENSION … UPDATE` has not run yet).
pub fn sql_version_mismatch() -> CatalogResult<Option<String>> {
    Ok(installed_sql_version()?
        .filter(|installed| installed != LIBRARY_VERSION)
        .map(|installed| {
            format!(
                "the pg_meili_sync library is version {LIBRARY_VERSION}, but the extension's SQL objects in this database are version {installed}"
            )
        }))
}

/// Shows on every active task why it does not stream: `mismatch` (from
/// [`sql_version_mismatch`]). The task keeps its state and positions.
pub fn hold_tasks_for_update(mismatch: &str) -> CatalogResult<()> {
    show_on_tasks(
        "state OPERATOR(pg_catalog.=) ANY ('{snapshot,streaming,swapping}'::pg_catalog.text[])",
        &format!("{WAITING_FOR_UPDATE}: {mismatch}; nothing is lost, the task goes on from where it stopped once the update has run"),
    )
}

/// Sets `message` as the `last_error` of the tasks that `scope` (an SQL condition on
/// `meili_sync.tasks`) selects, unless they show it already: the launcher asks every round, and
/// a write would use up a transaction id.
fn show_on_tasks(scope: &str, message: &str) -> CatalogResult<()> {
    let shown = select_one::<bool>(
        &format!(
            "SELECT NOT EXISTS (SELECT 1 FROM meili_sync.tasks
              WHERE {scope} AND (last_error IS NULL OR last_error OPERATOR(pg_catalog.<>) $1))"
        ),
        &[message.into()],
    )?;
    if shown == Some(true) {
        return Ok(());
    }
    Spi::run_with_args(
        &update_in_id_order_sql(
            "t",
            "last_error = $1, last_error_at = pg_catalog.now()",
            &format!(
                "{scope} AND (t.last_error IS NULL OR t.last_error OPERATOR(pg_catalog.<>) $1)"
            ),
            "",
        ),
        &[message.into()],
    )?;
    Ok(())
}

/// Clears what [`hold_tasks_for_update`] showed, once the SQL objects are the library's.
pub fn release_tasks_held_for_update() -> CatalogResult<()> {
    clear_shown(WAITING_FOR_UPDATE)
}

/// How an active task's `last_error` begins while its database waits for a place in the table of
/// databases the extension serves (`meili_sync.max_databases`); cleared once it has one.
const WAITING_FOR_A_PLACE: &str = "waiting for a place among the databases pg_meili_sync serves";

/// Shows on every active task that its database waits for a place: `detail` says why.
pub fn show_waiting_for_a_place(detail: &str) -> CatalogResult<()> {
    show_on_tasks(
        "state OPERATOR(pg_catalog.=) ANY ('{snapshot,streaming,swapping}'::pg_catalog.text[])",
        &format!("{WAITING_FOR_A_PLACE}: {detail}"),
    )
}

/// Clears what [`show_waiting_for_a_place`] showed, once the database has a place.
pub fn release_tasks_waiting_for_a_place() -> CatalogResult<()> {
    clear_shown(WAITING_FOR_A_PLACE)
}

/// Clears the `last_error` of the tasks that show a message beginning with `prefix`.
fn clear_shown(prefix: &str) -> CatalogResult<()> {
    let shown = select_one::<bool>(
        "SELECT EXISTS (SELECT 1 FROM meili_sync.tasks WHERE pg_catalog.starts_with(last_error, $1))",
        &[prefix.into()],
    )?;
    if shown != Some(true) {
        return Ok(());
    }
    Spi::run_with_args(
        &update_in_id_order_sql(
            "t",
            "last_error = NULL, last_error_at = NULL",
            "pg_catalog.starts_with(t.last_error, $1)",
            "",
        ),
        &[prefix.into()],
    )?;
    Ok(())
}

/// Stops every task that another install made: a task restored from a dump (pg_dump keeps the
/// tasks, not the install they belong to). Its slot and positions are another cluster's, so it
/// must not stream here; it is put in state `error`, set to copy its table again when resumed,
/// and its last_error says so. A restored resync helper is dropped (its task can resync again).
/// Returns the ids of the stopped tasks.
pub fn stop_restored_tasks() -> CatalogResult<Vec<i64>> {
    let restored = select_one::<bool>(
        &format!(
            "SELECT EXISTS (SELECT 1 FROM meili_sync.tasks t, meili_sync.install i
                             WHERE {MADE_ELSEWHERE_SQL})"
        ),
        &[],
    )?;
    if restored != Some(true) {
        return Ok(Vec::new());
    }
    as_catalog_owner(|| {
        Spi::connect_mut(|client| {
            client.update(
                &format!(
                    "DELETE FROM meili_sync.tasks t USING meili_sync.install i
                      WHERE t.resync_of IS NOT NULL AND {MADE_ELSEWHERE_SQL}"
                ),
                None,
                &[],
            )?;
            let rows = client.update(
                &format!("UPDATE meili_sync.tasks t
                    SET state = 'error', generation = t.generation OPERATOR(pg_catalog.+) 1,
                        install_token = i.token, stream_position = NULL, partitions = NULL,
                        snapshot_key = NULL, rows_copied = 0,
                        snapshot_started_at = NULL, snapshot_finished_at = NULL, shape = NULL, shape_through = NULL,
                        resync_phase = NULL, swap_lsn = NULL, swap_created_at = NULL,
                        last_error = pg_catalog.format(
                            'restored from a dump: this task''s stream positions belong to the database it was dumped from, so it does not stream here. Check that its index (%s at %s) is the one this database should write to (meili_sync_alter changes it), then run SELECT meili_sync_resume(%s) to copy the table into the index again; or drop the task with SELECT meili_sync_drop(%s)',
                            t.index_uid, t.url, t.id, t.id),
                        last_error_at = pg_catalog.now()
                   FROM meili_sync.install i
                  WHERE {MADE_ELSEWHERE_SQL}
                  RETURNING t.id"),
                None,
                &[],
            )?;
            super::ids_of(rows)
        })
        .map_err(Into::into)
    })
}

/// A task `t` that another install made, against this install `i` (schema-qualified, as
/// `IS DISTINCT FROM` would look its operator up by search_path).
const MADE_ELSEWHERE_SQL: &str =
    "(t.install_token IS NULL OR t.install_token OPERATOR(pg_catalog.<>) i.token)";

/// The token of this install, which a new task is marked with.
pub(super) const INSTALL_TOKEN_SQL: &str = "(SELECT i.token FROM meili_sync.install i)";

/// The database this install was made in, when that is not this database: this one is a copy of
/// it (`CREATE DATABASE … TEMPLATE`), whose tasks are the original's and whose slot names are
/// the original's slots.
pub fn copied_from() -> CatalogResult<Option<pg_sys::Oid>> {
    select_one::<pg_sys::Oid>(
        "SELECT i.database FROM meili_sync.install i
          WHERE i.database OPERATOR(pg_catalog.<>)
                (SELECT d.oid FROM pg_catalog.pg_database d
                  WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())",
        &[],
    )
}

/// What a task of a copied database shows as its last error.
pub fn copy_message(original: pg_sys::Oid) -> String {
    format!(
        "this database is a copy (CREATE DATABASE ... TEMPLATE) of the database with OID {}: its tasks are that database's, and so are their replication slots, so no task runs here; to sync this database's tables, run DROP EXTENSION pg_meili_sync CASCADE, then CREATE EXTENSION pg_meili_sync, and start its tasks again",
        original.to_u32()
    )
}

/// Shows on every task of a copied database why it does not run (see [`copied_from`]).
pub fn hold_tasks_of_copy(original: pg_sys::Oid) -> CatalogResult<()> {
    show_on_tasks("true", &copy_message(original))
}
