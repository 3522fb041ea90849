//! The database's shared decoding pass: one slot and one publication (both named
//! `meili_sync_<install>_shared`) for every task with `"decoding": "shared"`, and each such
//! task's own position in it. Only the shared decoder writes these.

use pgrx::prelude::*;
use pgrx::spi::quote_identifier;

use super::fragments::{
    copy_again_sql, update_in_id_order_sql, OWN_SLOT_SQL, SHARED_NAME_SQL, SHARED_TASK_SQL,
};
use super::{ids_of, select_one, CatalogResult};

/// The name of the shared slot and publication (see [`super::tasks::object_name`] for the install).
pub fn shared_object_name(install: pg_sys::Oid) -> String {
    format!("meili_sync_{}_shared", install.to_u32())
}

/// A task of the shared pass, as the shared decoder sees it.
#[derive(Debug, Clone)]
pub struct SharedTask {
    pub id: i64,
    pub relid: pg_sys::Oid,
    /// Syncs a view: its changes come from the tables the view reads.
    pub is_view: bool,
    /// Streaming, and no longer from a slot of its own: the decoder sends its changes. Any other
    /// task keeps its position only.
    pub streaming: bool,
    pub generation: i32,
    pub position: Option<u64>,
}

/// The shared slot's and publication's name in this install.
pub fn shared_name() -> CatalogResult<String> {
    Ok(select_one::<String>(&format!("SELECT {SHARED_NAME_SQL}"), &[])?.unwrap_or_default())
}

pub fn shared_tasks() -> CatalogResult<Vec<SharedTask>> {
    Spi::connect(|client| {
        let rows = client.select(
            &format!(
                "SELECT t.id, t.source::pg_catalog.oid, t.state OPERATOR(pg_catalog.=) 'streaming' AND NOT {OWN_SLOT_SQL}, t.generation,
                        pg_catalog.pg_wal_lsn_diff(t.stream_position, '0/0')::bigint,
                        EXISTS (SELECT 1 FROM pg_catalog.pg_class c
                                 WHERE c.oid OPERATOR(pg_catalog.=) t.source::pg_catalog.oid
                                   AND c.relkind OPERATOR(pg_catalog.=) 'v')
                   FROM meili_sync.tasks t WHERE {SHARED_TASK_SQL} ORDER BY t.id"
            ),
            None,
            &[],
        )?;
        let mut tasks = Vec::new();
        for row in rows {
            let (Some(id), Some(relid)) = (row.get::<i64>(1)?, row.get::<pg_sys::Oid>(2)?) else {
                continue;
            };
            tasks.push(SharedTask {
                id,
                relid,
                is_view: row.get(6)?.unwrap_or(false),
                streaming: row.get(3)?.unwrap_or(false),
                generation: row.get(4)?.unwrap_or(0),
                position: row.get::<i64>(5)?.map(|lsn| lsn as u64),
            });
        }
        Ok(tasks)
    })
}

/// Makes the shared publication one of ours (`check_publication`) that publishes exactly
/// `relids` (whole rows: tasks pick their columns themselves, and differing column lists would
/// break every task's stream), and returns what the check found.
pub fn publish_exactly(
    name: &str,
    relids: &[pg_sys::Oid],
) -> CatalogResult<super::replication::PublicationCheck> {
    let check = super::replication::check_publication(name, relids, &[], true)?;
    let published = published_tables(name)?;
    let adding: Vec<pg_sys::Oid> = relids
        .iter()
        .filter(|relid| !published.contains(relid))
        .copied()
        .collect();
    super::replication::add_to_publication(name, &adding)?;
    for relid in published.iter().filter(|relid| !relids.contains(relid)) {
        // A table dropped since the tasks were read is skipped: its task fails on its own.
        let Some(table) = qualified_name(*relid)? else {
            continue;
        };
        Spi::run(&format!(
            "ALTER PUBLICATION {} DROP TABLE ONLY {table}",
            quote_identifier(name),
        ))?;
    }
    Ok(check)
}

/// The tables a publication holds.
pub fn published_tables(name: &str) -> CatalogResult<Vec<pg_sys::Oid>> {
    Spi::connect(|client| {
        let rows = client.select(
            "SELECT r.prrelid FROM pg_catalog.pg_publication_rel r
               JOIN pg_catalog.pg_publication p ON p.oid OPERATOR(pg_catalog.=) r.prpubid
              WHERE p.pubname OPERATOR(pg_catalog.=) $1",
            None,
            &[name.into()],
        )?;
        let mut relids = Vec::new();
        for row in rows {
            if let Some(relid) = row.get::<pg_sys::Oid>(1)? {
                relids.push(relid);
            }
        }
        Ok(relids)
    })
}

/// Makes a task's own publication hold exactly `tables` (schema-qualified names).
pub fn set_published_tables(name: &str, tables: &[String]) -> CatalogResult<()> {
    Spi::run(&format!(
        "ALTER PUBLICATION {} SET TABLE ONLY {}",
        quote_identifier(name),
        tables.join(", ONLY ")
    ))?;
    Spi::run(&format!(
        "ALTER PUBLICATION {} SET ({})",
        quote_identifier(name),
        super::replication::PUBLICATION_OPTIONS
    ))?;
    Ok(())
}

/// A table's schema-qualified, quoted name; None once it is dropped.
fn qualified_name(relid: pg_sys::Oid) -> CatalogResult<Option<String>> {
    select_one::<String>(
        "SELECT pg_catalog.format('%I.%I', n.nspname, c.relname)
           FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
          WHERE c.oid OPERATOR(pg_catalog.=) $1",
        &[relid.into()],
    )
}

/// Gives a position to every shared task that needs one, and returns their ids:
/// - a task about to copy gets `confirmed` (the shared slot's confirmed position): the copy that
///   follows holds every transaction committed before it;
/// - a task moving from its own slot gets the WAL's insert position now, at least `confirmed`.
///   Its own slot streams it up to there, and the shared publication (made before this runs)
///   publishes its table in every transaction from there on.
pub fn assign_positions(confirmed: u64) -> CatalogResult<Vec<i64>> {
    Spi::connect_mut(|client| {
        let rows = client.update(
            &update_in_id_order_sql(
                "t",
                &format!(
                    "stream_position = CASE WHEN {OWN_SLOT_SQL}
                        THEN GREATEST(pg_catalog.pg_current_wal_insert_lsn(), '0/0'::pg_catalog.pg_lsn OPERATOR(pg_catalog.+) $1::pg_catalog.numeric)
                        ELSE '0/0'::pg_catalog.pg_lsn OPERATOR(pg_catalog.+) $1::pg_catalog.numeric END"
                ),
                &format!(
                    "{SHARED_TASK_SQL} AND t.stream_position IS NULL
                     AND (t.snapshot_finished_at IS NULL OR {OWN_SLOT_SQL})"
                ),
                "RETURNING t.id",
            ),
            None,
            &[(confirmed as i64).into()],
        )?;
        Ok(ids_of(rows)?)
    })
}

/// Shared tasks whose copy is done but that have no position and no slot of their own: the slot
/// that kept their changes was dropped before they moved into the shared pass (by hand, or lost
/// in a failover, restore or upgrade). They are not stopped yet.
pub fn tasks_without_changes() -> CatalogResult<Vec<i64>> {
    Spi::connect(|client| {
        let rows = client.select(
            &format!(
                "SELECT t.id FROM meili_sync.tasks t
                  WHERE {SHARED_TASK_SQL} AND t.stream_position IS NULL
                    AND t.snapshot_finished_at IS NOT NULL AND t.state OPERATOR(pg_catalog.<>) 'error'
                    AND NOT {OWN_SLOT_SQL}"
            ),
            None,
            &[],
        )?;
        Ok(ids_of(rows)?)
    })
}

/// The shared slot was `what` ("invalidated", "missing") and is made again: every shared task
/// loses its position. Those with a slot of their own (moving) only get a new one; the others stop
/// with an error asking for a new copy. Returns the ids of those stopped.
pub fn forget_positions(slot: &str, what: &str) -> CatalogResult<Vec<i64>> {
    Spi::connect_mut(|client| {
        let rows = client.update(
            &update_in_id_order_sql(
                "t",
                &format!(
                    "stream_position = NULL,
                     state = CASE WHEN {OWN_SLOT_SQL} THEN t.state ELSE 'error' END,
                     last_error = CASE WHEN {OWN_SLOT_SQL} THEN t.last_error
                         ELSE pg_catalog.format('the shared replication slot \"%s\" is %s, so the changes it kept for this task are lost; run SELECT meili_sync_snapshot(%s) to copy the table again', $1, $2, t.id) END,
                     last_error_at = CASE WHEN {OWN_SLOT_SQL} THEN t.last_error_at ELSE pg_catalog.now() END"
                ),
                &format!("{SHARED_TASK_SQL} AND t.stream_position IS NOT NULL"),
                &format!("RETURNING CASE WHEN {OWN_SLOT_SQL} THEN NULL ELSE t.id END"),
            ),
            None,
            &[slot.into(), what.into()],
        )?;
        Ok(ids_of(rows)?)
    })
}

/// The shared publication was not as it was left (`check_publication`): every shared task that
/// has a position in the shared slot loses it and copies its table again (an inactive one when it
/// is resumed), with `message` as its last error. The decoder then makes the slot anew
/// ([`any_shared_position`] is false), so that no slot decodes the WAL the wrong publication
/// covered. Returns the ids of those tasks.
pub fn copy_shared_tasks_again(message: &str) -> CatalogResult<Vec<i64>> {
    Spi::connect_mut(|client| {
        // A moving task streams from its own slot until it hands over: it only gets a position
        // in the new shared slot.
        client.update(
            &update_in_id_order_sql(
                "t",
                "stream_position = NULL",
                &format!("{SHARED_TASK_SQL} AND t.stream_position IS NOT NULL AND {OWN_SLOT_SQL}"),
                "",
            ),
            None,
            &[],
        )?;
        let rows = client.update(
            &update_in_id_order_sql(
                "t",
                &copy_again_sql("$1"),
                &format!("{SHARED_TASK_SQL} AND t.stream_position IS NOT NULL"),
                "RETURNING t.id",
            ),
            None,
            &[message.into()],
        )?;
        Ok(ids_of(rows)?)
    })
}

/// Whether any shared task holds a position in the shared slot: one that none holds keeps
/// nothing anyone needs, and is made anew rather than read from where it stands.
pub fn any_shared_position() -> CatalogResult<bool> {
    Ok(select_one::<bool>(
        &format!("SELECT EXISTS (SELECT 1 FROM meili_sync.tasks t WHERE {SHARED_TASK_SQL} AND t.stream_position IS NOT NULL)"),
        &[],
    )?
    .unwrap_or(false))
}

/// Hands a moving task over to the shared pass: stores `position` (everything that committed
/// before it is in the index, and its own slot was read up to it), then drops its own slot and
/// publication, all in the caller's transaction. False if the task changed meanwhile (altered,
/// paused, dropped): then nothing is done.
pub fn hand_over(
    task_id: i64,
    generation: i32,
    position: u64,
    own_object: &str,
) -> CatalogResult<bool> {
    let moved = Spi::connect_mut(|client| {
        let rows = client.update(
            &format!(
                "UPDATE meili_sync.tasks t
                    SET stream_position = GREATEST(t.stream_position, '0/0'::pg_catalog.pg_lsn OPERATOR(pg_catalog.+) $3::pg_catalog.numeric)
                  WHERE t.id OPERATOR(pg_catalog.=) $1 AND t.generation OPERATOR(pg_catalog.=) $2
                    AND {SHARED_TASK_SQL} AND t.state OPERATOR(pg_catalog.=) 'streaming'
                    AND t.stream_position IS NOT NULL
                    AND t.stream_position OPERATOR(pg_catalog.<=) ('0/0'::pg_catalog.pg_lsn OPERATOR(pg_catalog.+) $3::pg_catalog.numeric)
                  RETURNING t.id"
            ),
            None,
            &[task_id.into(), generation.into(), (position as i64).into()],
        )?;
        Ok::<_, pgrx::spi::SpiError>(rows.len())
    })?;
    if moved == 0 {
        return Ok(false);
    }
    super::replication::drop_slot(own_object)?;
    super::replication::drop_publication(own_object)?;
    Ok(true)
}

/// A task's stored position in the shared pass.
pub fn stream_position(task_id: i64) -> CatalogResult<Option<u64>> {
    Ok(select_one::<i64>(
        "SELECT pg_catalog.pg_wal_lsn_diff(stream_position, '0/0')::bigint
           FROM meili_sync.tasks WHERE id OPERATOR(pg_catalog.=) $1",
        &[task_id.into()],
    )?
    .map(|lsn| lsn as u64))
}

/// Records where each task's index is complete; positions never move backwards, and only a task
/// that has one moves: a position forgotten with its lost slot stays forgotten, and a task of a
/// new install (ids start again at 1) gets its first from its own decoder, never from this one.
pub fn store_positions(positions: &[(i64, u64)]) -> CatalogResult<()> {
    // In the order of the ids, as every write of several rows (`update_in_id_order_sql`).
    let mut positions = positions.to_vec();
    positions.sort_unstable();
    for (task_id, position) in positions {
        Spi::run_with_args(
            "UPDATE meili_sync.tasks SET stream_position = GREATEST(stream_position,
                    '0/0'::pg_catalog.pg_lsn OPERATOR(pg_catalog.+) $2::pg_catalog.numeric)
              WHERE id OPERATOR(pg_catalog.=) $1 AND stream_position IS NOT NULL",
            &[task_id.into(), (position as i64).into()],
        )?;
    }
    Ok(())
}

/// The lowest stored position among the shared tasks not in `except` (those the decoder
/// streams, whose positions it knows better).
pub fn lowest_position_except(except: &[i64]) -> CatalogResult<Option<u64>> {
    Ok(select_one::<i64>(
        &format!(
            "SELECT pg_catalog.pg_wal_lsn_diff(pg_catalog.min(t.stream_position), '0/0')::bigint
               FROM meili_sync.tasks t
              WHERE {SHARED_TASK_SQL} AND t.id OPERATOR(pg_catalog.<>) ALL ($1)"
        ),
        &[except.to_vec().into()],
    )?
    .map(|lsn| lsn as u64))
}
