//! Replication slots and publications: creating, checking, and dropping them, and finding those
//! whose task is gone.
//!
//! `check_publication` decides whether a publication is ours: made by this install (its OID as
//! recorded in `meili_sync.publications`), owned by the catalog's owner, publishing whole rows of
//! its tables with every operation. One another role made first is dropped and made anew, and the
//! options are set explicitly whenever we make or change one. It runs when a task is created, at
//! each start of the shared decoder and of an own-slot worker, and, without changing anything, at
//! every refresh of the shared decoder and every 0.5 s of an own-slot stream. A publication found
//! changed after a slot decoded with it means changes went out wrongly or not at all: the slot is
//! made anew and its tasks copy their tables again, with a `last_error` saying so.

use pgrx::prelude::*;
use pgrx::spi::quote_identifier;

use pg_meili_sync_core::task::pg_catalog::SlotStatus;

use super::fragments::{CATALOG_OWNER_SQL, SHARED_NAME_SQL, SHARED_TASK_SQL};
use super::{select_one, CatalogResult, OBJECT_NAME_SQL};

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

/// The options of every publication of ours, set explicitly each time one is made or changed:
/// every operation, and each partition's changes under its own table (a task maps partitions to
/// their root itself).
pub(super) const PUBLICATION_OPTIONS: &str =
    "publish = 'insert, update, delete, truncate', publish_via_partition_root = false";

/// What [`check_publication`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublicationCheck {
    /// As this install made it.
    Ours,
    /// There was none, and none was made before: it is made now.
    Made,
    /// It was not as this install left it; the text says how. It is now, and the changes a slot
    /// decoded with it since may have gone out wrongly or not at all.
    Mended(String),
}

/// Makes the publication `name` one of ours as it must be, before a slot decodes with it: made by
/// this install (its OID is the one recorded in `meili_sync.publications`), owned by the catalog's
/// owner, publishing whole rows of tables, with [`PUBLICATION_OPTIONS`], and holding `must_hold`.
/// A publication of that name that another role made or owns is never adopted: it is dropped and
/// made anew, with `create_with` (or `must_hold`) as its tables. With `mend` false nothing is
/// changed: what is wrong is only told.
pub fn check_publication(
    name: &str,
    create_with: &[pg_sys::Oid],
    must_hold: &[pg_sys::Oid],
    mend: bool,
) -> CatalogResult<PublicationCheck> {
    let found = Spi::connect(|client| {
        let mut rows = client.select(
            &format!("SELECT p.oid, p.pubowner OPERATOR(pg_catalog.=) {CATALOG_OWNER_SQL}
                      OR coalesce((SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.oid OPERATOR(pg_catalog.=) p.pubowner), false),
                    p.pubowner::pg_catalog.regrole::pg_catalog.text,
                    p.puballtables
                      OR EXISTS (SELECT 1 FROM pg_catalog.pg_publication_namespace s
                                  WHERE s.pnpubid OPERATOR(pg_catalog.=) p.oid)
                      OR EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel r
                                  WHERE r.prpubid OPERATOR(pg_catalog.=) p.oid
                                    AND (r.prqual IS NOT NULL OR r.prattrs IS NOT NULL)),
                    p.pubinsert AND p.pubupdate AND p.pubdelete AND p.pubtruncate AND NOT p.pubviaroot,
                    (SELECT pg_catalog.array_agg(m.relid) FROM pg_catalog.unnest($2::pg_catalog.oid[]) AS m(relid)
                      WHERE EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) m.relid)
                        AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel r
                                         WHERE r.prpubid OPERATOR(pg_catalog.=) p.oid
                                           AND r.prrelid OPERATOR(pg_catalog.=) m.relid))
               FROM pg_catalog.pg_publication p
              WHERE p.pubname OPERATOR(pg_catalog.=) $1"),
            Some(1),
            &[name.into(), must_hold.to_vec().into()],
        )?;
        let Some(row) = rows.next() else {
            return Ok::<_, pgrx::spi::SpiError>(None);
        };
        Ok(Some(FoundPublication {
            oid: row.get(1)?.unwrap_or(pg_sys::InvalidOid),
            owned: row.get(2)?.unwrap_or(false),
            owner: row.get(3)?.unwrap_or_default(),
            publishes_more_or_less: row.get(4)?.unwrap_or(true),
            options_right: row.get(5)?.unwrap_or(false),
            lacking: row.get::<Vec<pg_sys::Oid>>(6)?.unwrap_or_default(),
        }))
    })?;
    let recorded = select_one::<pg_sys::Oid>(
        "SELECT publication FROM meili_sync.publications WHERE name OPERATOR(pg_catalog.=) $1",
        &[name.into()],
    )?;
    let tables = if create_with.is_empty() {
        must_hold
    } else {
        create_with
    };
    if !mend {
        return Ok(match found {
            None => PublicationCheck::Mended("is missing".into()),
            Some(found) => {
                let right = found.owned
                    && !found.publishes_more_or_less
                    && found.options_right
                    && found.lacking.is_empty()
                    && recorded.is_none_or(|recorded| recorded == found.oid);
                if right {
                    PublicationCheck::Ours
                } else {
                    PublicationCheck::Mended("is not as it was left".into())
                }
            }
        });
    }
    let check = match found {
        None => {
            create_publication(name, tables)?;
            match recorded {
                Some(_) => PublicationCheck::Mended("was dropped by someone else".into()),
                None => PublicationCheck::Made,
            }
        }
        Some(found) if !found.owned || found.publishes_more_or_less => {
            let why = if found.owned {
                "was changed by someone else to publish more than its tables, or only some of their rows or columns".to_owned()
            } else {
                format!(
                    "was made or taken by role {}, not by the catalog's owner, so it was not ours",
                    found.owner
                )
            };
            Spi::run(&format!("DROP PUBLICATION {}", quote_identifier(name)))?;
            create_publication(name, tables)?;
            PublicationCheck::Mended(why)
        }
        Some(found) => {
            let mut faults = Vec::new();
            if recorded.is_some_and(|recorded| recorded != found.oid) {
                faults.push("was dropped and made again by someone else".to_owned());
            }
            if !found.options_right {
                Spi::run(&format!(
                    "ALTER PUBLICATION {} SET ({PUBLICATION_OPTIONS})",
                    quote_identifier(name)
                ))?;
                faults.push("was changed by someone else to publish only some operations, or partitions' changes as their root's".to_owned());
            }
            if !found.lacking.is_empty() {
                add_to_publication(name, &found.lacking)?;
                faults.push("had tables taken out of it by someone else".to_owned());
            }
            set_owner(name)?;
            if faults.is_empty() {
                PublicationCheck::Ours
            } else {
                PublicationCheck::Mended(faults.join(", and "))
            }
        }
    };
    // Recorded only when it changed: a write would use up a transaction id at every check.
    if check != PublicationCheck::Ours || recorded.is_none() {
        Spi::run_with_args(
            "INSERT INTO meili_sync.publications (name, publication)
             SELECT p.pubname::pg_catalog.text, p.oid FROM pg_catalog.pg_publication p
              WHERE p.pubname OPERATOR(pg_catalog.=) $1
             ON CONFLICT (name) DO UPDATE SET publication = excluded.publication",
            &[name.into()],
        )?;
    }
    Ok(check)
}

/// A publication named like ours, as the catalog shows it.
struct FoundPublication {
    oid: pg_sys::Oid,
    /// Owned by the catalog's owner, or by a superuser (0.5.0's shared decoder made the shared
    /// publication as the superuser it connects as): only those could have made it.
    owned: bool,
    owner: String,
    /// FOR ALL TABLES, FOR TABLES IN SCHEMA, a row filter or a column list.
    publishes_more_or_less: bool,
    options_right: bool,
    /// Tables it must hold and does not.
    lacking: Vec<pg_sys::Oid>,
}

/// Makes a publication of `tables` (none: an empty one) with [`PUBLICATION_OPTIONS`], owned by the
/// catalog's owner. A table dropped meanwhile is left out (its task fails on its own).
fn create_publication(name: &str, tables: &[pg_sys::Oid]) -> CatalogResult<()> {
    let tables = qualified_names(tables)?;
    let scope = if tables.is_empty() {
        String::new()
    } else {
        format!("FOR TABLE ONLY {}", tables.join(", ONLY "))
    };
    Spi::run(&format!(
        "CREATE PUBLICATION {} {scope} WITH ({PUBLICATION_OPTIONS})",
        quote_identifier(name)
    ))?;
    set_owner(name)
}

/// Gives a publication of ours to the catalog's owner, unless it has it.
fn set_owner(name: &str) -> CatalogResult<()> {
    let owner = select_one::<String>(
        &format!(
            "SELECT {CATALOG_OWNER_SQL}::pg_catalog.regrole::pg_catalog.text FROM pg_catalog.pg_publication p
              WHERE p.pubname OPERATOR(pg_catalog.=) $1
                AND p.pubowner OPERATOR(pg_catalog.<>) {CATALOG_OWNER_SQL}"
        ),
        &[name.into()],
    )?;
    let Some(owner) = owner else {
        return Ok(());
    };
    Spi::run(&format!(
        "ALTER PUBLICATION {} OWNER TO {owner}",
        quote_identifier(name)
    ))?;
    Ok(())
}

/// Adds `tables` to a publication of ours, and sets its options again.
pub fn add_to_publication(name: &str, tables: &[pg_sys::Oid]) -> CatalogResult<()> {
    let tables = qualified_names(tables)?;
    if tables.is_empty() {
        return Ok(());
    }
    Spi::run(&format!(
        "ALTER PUBLICATION {} ADD TABLE ONLY {}",
        quote_identifier(name),
        tables.join(", ONLY ")
    ))?;
    Spi::run(&format!(
        "ALTER PUBLICATION {} SET ({PUBLICATION_OPTIONS})",
        quote_identifier(name)
    ))?;
    Ok(())
}

/// The schema-qualified, quoted names of the tables that still exist among `relids`.
pub fn qualified_names(relids: &[pg_sys::Oid]) -> CatalogResult<Vec<String>> {
    Spi::connect(|client| {
        let mut names = Vec::new();
        for row in client.select(
            "SELECT pg_catalog.format('%I.%I', n.nspname, c.relname)
               FROM pg_catalog.unnest($1::pg_catalog.oid[]) WITH ORDINALITY AS r(relid, place)
               JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) r.relid
               JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
              ORDER BY r.place",
            None,
            &[relids.to_vec().into()],
        )? {
            if let Some(name) = row.get::<String>(1)? {
                names.push(name);
            }
        }
        Ok(names)
    })
}

/// The relations a subscription may fill for a task on `relid`: the table and its partitions,
/// or, for a view, the tables it reads and theirs.
pub fn relations_fed_for(relid: pg_sys::Oid) -> CatalogResult<Vec<pg_sys::Oid>> {
    let roots: Vec<pg_sys::Oid> = if super::source::relation_info(relid)?.is_view() {
        super::view::base_tables(relid)?
            .into_iter()
            .map(|table| table.relid)
            .collect()
    } else {
        vec![relid]
    };
    Spi::connect(|client| {
        let mut relations = Vec::new();
        for row in client.select(
            "SELECT r.relid FROM pg_catalog.unnest($1::pg_catalog.oid[]) AS r(relid)
             UNION
             SELECT t.relid::pg_catalog.oid
               FROM pg_catalog.unnest($1::pg_catalog.oid[]) AS r(relid),
                    LATERAL pg_catalog.pg_partition_tree(r.relid) t",
            None,
            &[roots.into()],
        )? {
            if let Some(relation) = row.get::<pg_sys::Oid>(1)? {
                relations.push(relation);
            }
        }
        Ok(relations)
    })
}

/// A subscription of this database that fills some of a task's relations, and how far it is.
pub struct SubscriptionFeed {
    /// Where its apply worker has applied the publisher's WAL to (the position the publisher last
    /// reported, once what came before it was applied); None while no apply worker runs.
    pub applied: Option<u64>,
    /// Whether each of the task's relations it fills has finished its first copy.
    pub ready: bool,
}

impl SubscriptionFeed {
    pub fn has_applied(&self, publisher_lsn: u64) -> bool {
        self.ready && self.applied.is_some_and(|applied| applied >= publisher_lsn)
    }
}

/// The subscriptions that fill any of `relations` (pg_subscription_rel), each with how far its
/// apply worker is (pg_stat_subscription, which every role may read).
pub fn subscriptions_feeding(relations: &[pg_sys::Oid]) -> CatalogResult<Vec<SubscriptionFeed>> {
    Spi::connect(|client| {
        let rows = client.select(
            "SELECT (SELECT (pg_catalog.max(w.latest_end_lsn) OPERATOR(pg_catalog.-) '0/0'::pg_catalog.pg_lsn)::bigint
                       FROM pg_catalog.pg_stat_subscription w
                      WHERE w.subid OPERATOR(pg_catalog.=) r.srsubid AND w.relid IS NULL),
                    pg_catalog.bool_and(r.srsubstate OPERATOR(pg_catalog.=) 'r')
               FROM pg_catalog.pg_subscription_rel r
              WHERE r.srrelid OPERATOR(pg_catalog.=) ANY ($1::pg_catalog.oid[])
              GROUP BY r.srsubid",
            None,
            &[relations.to_vec().into()],
        )?;
        let mut feeds = Vec::new();
        for row in rows {
            feeds.push(SubscriptionFeed {
                applied: row.get::<i64>(1)?.and_then(|lsn| u64::try_from(lsn).ok()),
                ready: row.get::<bool>(2)?.unwrap_or(false),
            });
        }
        Ok(feeds)
    })
}

pub fn drop_publication(name: &str) -> CatalogResult<()> {
    Spi::run(&format!(
        "DROP PUBLICATION IF EXISTS {}",
        quote_identifier(name)
    ))?;
    forget_publication(name)
}

/// Forgets the record of a publication of ours that was dropped (or is about to be, in the same
/// transaction). After DROP EXTENSION there is no record to forget.
pub fn forget_publication(name: &str) -> CatalogResult<()> {
    let recorded = select_one::<bool>(
        "SELECT pg_catalog.to_regclass('meili_sync.publications') IS NOT NULL",
        &[],
    )?;
    if recorded != Some(true) {
        return Ok(());
    }
    Spi::run_with_args(
        "DELETE FROM meili_sync.publications WHERE name OPERATOR(pg_catalog.=) $1",
        &[name.into()],
    )?;
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
