//! Replication slots and publications: creating, checking, and dropping them, and finding those
//! whose task is gone.

use pgrx::prelude::*;
use pgrx::spi::quote_identifier;

use super::shared::{SHARED_NAME_SQL, SHARED_TASK_SQL};
use super::{select_one, CatalogResult, OBJECT_NAME_SQL};
use crate::pg_catalog::SlotStatus;

/// A task's slot as the launcher's WAL guard sees it.
pub struct SlotHealth {
    pub task_id: i64,
    pub slot_name: String,
    pub wal_status: SlotStatus,
    /// None once the slot was invalidated (it no longer has a restart position).
    pub retained_bytes: Option<i64>,
}

/// The slot's `wal_status` (`Lost` once `max_slot_wal_keep_size` invalidated it); None if missing.
pub fn slot_wal_status(name: &str) -> CatalogResult<Option<SlotStatus>> {
    let status = select_one::<String>(
        "SELECT coalesce(wal_status, 'unknown') FROM pg_catalog.pg_replication_slots WHERE slot_name OPERATOR(pg_catalog.=) $1",
        &[name.into()],
    )?;
    Ok(status.map(|status| SlotStatus::from_stored(Some(&status))))
}

/// Retained WAL and `wal_status` of every task's slot, for the launcher's warnings.
pub fn slot_health() -> CatalogResult<Vec<SlotHealth>> {
    Spi::connect(|client| {
        let rows = client.select(
            &format!(
                "SELECT t.id, s.slot_name::text, coalesce(s.wal_status, 'unknown'),
                        pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), s.restart_lsn)::bigint
                   FROM meili_sync.tasks t
                   JOIN pg_catalog.pg_replication_slots s ON s.slot_name OPERATOR(pg_catalog.=) {OBJECT_NAME_SQL}
                 UNION ALL
                 -- The shared slot, named after the shared task that holds it back the most.
                 SELECT (SELECT t.id FROM meili_sync.tasks t WHERE {SHARED_TASK_SQL}
                          ORDER BY t.stream_position NULLS LAST, t.id LIMIT 1),
                        s.slot_name::text, coalesce(s.wal_status, 'unknown'),
                        pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), s.restart_lsn)::bigint
                   FROM pg_catalog.pg_replication_slots s
                  WHERE s.slot_name::text OPERATOR(pg_catalog.=) {SHARED_NAME_SQL}"
            ),
            None,
            &[],
        )?;
        let mut health = Vec::new();
        for row in rows {
            if let (Some(task_id), Some(slot_name), Some(wal_status)) = (
                row.get::<i64>(1)?,
                row.get::<String>(2)?,
                row.get::<String>(3)?,
            ) {
                health.push(SlotHealth {
                    task_id,
                    slot_name,
                    wal_status: SlotStatus::from_stored(Some(&wal_status)),
                    retained_bytes: row.get::<i64>(4)?,
                });
            }
        }
        Ok(health)
    })
}

/// Creates a logical slot (a task's own or the shared one); must be the first statement of its
/// transaction. From PostgreSQL 17 on it is a failover slot: a standby with
/// `sync_replication_slots` keeps a copy of it, so that the tasks go on from their positions after
/// a promotion.
pub fn create_slot(name: &str) -> CatalogResult<()> {
    select_one::<String>(CREATE_SLOT_SQL, &[name.into()])?;
    Ok(())
}

#[cfg(any(feature = "pg15", feature = "pg16"))]
const CREATE_SLOT_SQL: &str =
    "SELECT slot_name::text FROM pg_catalog.pg_create_logical_replication_slot($1, 'pgoutput')";
#[cfg(not(any(feature = "pg15", feature = "pg16")))]
const CREATE_SLOT_SQL: &str = "SELECT slot_name::text FROM pg_catalog.pg_create_logical_replication_slot($1, 'pgoutput', failover => true)";

/// What names the extension's slots and publications (`meili_sync_<install>_<task>`).
const OBJECT_NAME_PATTERN: &str = "'^meili_sync_[0-9]+_[0-9]+$'";
/// The shared decoding pass's slot and publication, of any install of the extension.
const SHARED_NAME_PATTERN: &str = "'^meili_sync_[0-9]+_shared$'";
/// Also the shared decoding pass's slot and publication.
const ANY_OBJECT_NAME_PATTERN: &str = "'^meili_sync_[0-9]+_([0-9]+|shared)$'";

/// Slots and publications this extension created in this database whose task is gone (dropped,
/// or from an earlier install of the extension) and which nobody holds, and the shared pass's of
/// an earlier install (DROP and CREATE EXTENSION within one launcher round): (kind, name).
pub fn orphans() -> CatalogResult<Vec<(String, String)>> {
    slots_and_publications(&format!(
        "SELECT 'slot', s.slot_name::text FROM pg_catalog.pg_replication_slots s
          WHERE s.database OPERATOR(pg_catalog.=) pg_catalog.current_database() AND NOT s.active
            AND s.slot_name::text OPERATOR(pg_catalog.~) {OBJECT_NAME_PATTERN}
            AND NOT EXISTS (SELECT 1 FROM meili_sync.tasks t WHERE {OBJECT_NAME_SQL} OPERATOR(pg_catalog.=) s.slot_name)
         UNION ALL
         SELECT 'publication', p.pubname::text FROM pg_catalog.pg_publication p
          WHERE p.pubname::text OPERATOR(pg_catalog.~) {OBJECT_NAME_PATTERN}
            AND NOT EXISTS (SELECT 1 FROM meili_sync.tasks t WHERE {OBJECT_NAME_SQL} OPERATOR(pg_catalog.=) p.pubname)
         UNION ALL
         SELECT 'slot', s.slot_name::text FROM pg_catalog.pg_replication_slots s
          WHERE s.slot_name::text OPERATOR(pg_catalog.=) {SHARED_NAME_SQL} AND NOT s.active
            AND NOT EXISTS (SELECT 1 FROM meili_sync.tasks t WHERE {SHARED_TASK_SQL})
         UNION ALL
         SELECT 'publication', p.pubname::text FROM pg_catalog.pg_publication p
          WHERE p.pubname::text OPERATOR(pg_catalog.=) {SHARED_NAME_SQL}
            AND NOT EXISTS (SELECT 1 FROM meili_sync.tasks t WHERE {SHARED_TASK_SQL})
         UNION ALL
         SELECT 'slot', s.slot_name::text FROM pg_catalog.pg_replication_slots s
          WHERE s.database OPERATOR(pg_catalog.=) pg_catalog.current_database() AND NOT s.active
            AND s.slot_name::text OPERATOR(pg_catalog.~) {SHARED_NAME_PATTERN}
            AND s.slot_name::text OPERATOR(pg_catalog.<>) {SHARED_NAME_SQL}
         UNION ALL
         SELECT 'publication', p.pubname::text FROM pg_catalog.pg_publication p
          WHERE p.pubname::text OPERATOR(pg_catalog.~) {SHARED_NAME_PATTERN}
            AND p.pubname::text OPERATOR(pg_catalog.<>) {SHARED_NAME_SQL}"
    ))
}

/// After DROP EXTENSION: every slot (once no worker holds it) and publication its tasks left.
pub fn leftovers_without_extension() -> CatalogResult<Vec<(String, String)>> {
    slots_and_publications(&format!(
        "SELECT 'slot', s.slot_name::text FROM pg_catalog.pg_replication_slots s
          WHERE s.database OPERATOR(pg_catalog.=) pg_catalog.current_database() AND NOT s.active
            AND s.slot_name::text OPERATOR(pg_catalog.~) {ANY_OBJECT_NAME_PATTERN}
         UNION ALL
         SELECT 'publication', p.pubname::text FROM pg_catalog.pg_publication p
          WHERE p.pubname::text OPERATOR(pg_catalog.~) {ANY_OBJECT_NAME_PATTERN}"
    ))
}

/// Runs a query of (kind, name) rows.
fn slots_and_publications(query: &str) -> CatalogResult<Vec<(String, String)>> {
    Spi::connect(|client| {
        let mut names = Vec::new();
        for row in client.select(query, None, &[])? {
            if let (Some(kind), Some(name)) = (row.get::<String>(1)?, row.get::<String>(2)?) {
                names.push((kind, name));
            }
        }
        Ok(names)
    })
}

pub fn drop_publication(name: &str) -> CatalogResult<()> {
    Spi::run(&format!(
        "DROP PUBLICATION IF EXISTS {}",
        quote_identifier(name)
    ))?;
    Ok(())
}

/// Asks a backend (a task worker) to exit; its SIGTERM handler only sets a flag it checks.
/// Signals a worker unless it has exited already (a task that hands over to the shared decoder
/// exits by itself as the launcher stops it; pg_terminate_backend would WARN of a gone pid).
pub fn terminate_backend(pid: i32) -> CatalogResult<()> {
    select_one::<bool>(
        "SELECT pg_catalog.pg_terminate_backend(a.pid) FROM pg_catalog.pg_stat_activity a
          WHERE a.pid OPERATOR(pg_catalog.=) $1",
        &[pid.into()],
    )?;
    Ok(())
}

pub fn drop_slot(name: &str) -> CatalogResult<()> {
    select_one::<String>(
        "SELECT pg_catalog.pg_drop_replication_slot($1)::text",
        &[name.into()],
    )?;
    Ok(())
}
