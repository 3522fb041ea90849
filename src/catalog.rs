//! All SPI: the task catalog, progress, slots and publications, and reading source pages.
//!
//! Every function here expects to run inside a transaction (the caller's, or one a worker opened).

use std::ffi::CStr;

use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::quote_identifier;
use pgrx::JsonB;

use crate::dispatch::DeadLetter;
use crate::encode::ValueKind;
use crate::error::{ErrorKind, SyncError};
use crate::security;

pub type CatalogResult<T> = Result<T, SyncError>;

/// A column of the source table as the catalog describes it.
#[derive(Debug, Clone)]
pub struct ColumnInfo {
    pub name: String,
    pub type_oid: pg_sys::Oid,
    pub type_name: String,
    pub not_null: bool,
    pub generated: bool,
}

#[derive(Debug, Clone)]
pub struct RelationInfo {
    pub qualified_name: String,
    /// The table's owner: work on its rows runs with this role's rights.
    pub owner: pg_sys::Oid,
    pub relkind: String,
    pub persistence: String,
    pub replica_identity: String,
    pub columns: Vec<ColumnInfo>,
    pub primary_key: Option<Vec<String>>,
    pub replica_identity_index: Option<Vec<String>>,
    pub unique_keys: Vec<Vec<String>>,
}

/// What a task should be doing: `meili_sync.tasks.state`, whose CHECK constraint allows exactly
/// these. (Not to be confused with a worker's live [`crate::shmem::Phase`], nor with the status of a
/// Meilisearch task.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskState {
    /// Copying the table (or about to).
    Snapshot,
    Streaming,
    Paused,
    Stopped,
    /// Stopped by a failure; `last_error` says why.
    Error,
    /// Held by its resync helper for the swap.
    Swapping,
}

impl TaskState {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Snapshot => "snapshot",
            TaskState::Streaming => "streaming",
            TaskState::Paused => "paused",
            TaskState::Stopped => "stopped",
            TaskState::Error => "error",
            TaskState::Swapping => "swapping",
        }
    }

    /// The stored text; anything the CHECK constraint would not let in reads as `Error`, a state
    /// in which no worker runs.
    fn from_stored(text: &str) -> TaskState {
        match text {
            "snapshot" => TaskState::Snapshot,
            "streaming" => TaskState::Streaming,
            "paused" => TaskState::Paused,
            "stopped" => TaskState::Stopped,
            "swapping" => TaskState::Swapping,
            _ => TaskState::Error,
        }
    }
}

impl std::fmt::Display for TaskState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One task row, with its key: only the worker and privileged functions load it.
#[derive(Debug, Clone)]
pub struct TaskRecord {
    pub id: i64,
    pub relid: pg_sys::Oid,
    pub relation: String,
    pub index_uid: String,
    pub url: String,
    pub api_key: Option<String>,
    pub primary_key: Vec<String>,
    pub options: serde_json::Value,
    /// The role that created the task.
    pub owner: pg_sys::Oid,
    pub state: TaskState,
    /// Bumped by every change that must restart the task's worker.
    pub generation: i32,
    pub slot_name: String,
    pub publication_name: String,
    pub snapshot_key: Option<Vec<String>>,
    pub rows_copied: i64,
    /// Set on a resync helper: the task whose index it rebuilds.
    pub resync_of: Option<i64>,
    pub resync_phase: Option<String>,
    pub swap_lsn: Option<u64>,
    pub swap_created_at: Option<String>,
}

/// A task's slot as the launcher's WAL guard sees it.
pub struct SlotHealth {
    pub task_id: i64,
    pub slot_name: String,
    pub wal_status: String,
    /// None once the slot was invalidated (it no longer has a restart position).
    pub retained_bytes: Option<i64>,
}

/// A task as the launcher sees it.
#[derive(Debug, Clone, Copy)]
pub struct TaskSummary {
    pub id: i64,
    pub active: bool,
    pub generation: i32,
}

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

pub fn current_role_is_admin() -> CatalogResult<bool> {
    Ok(select_one::<bool>(
        "SELECT (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user)
             OR pg_catalog.pg_has_role(current_user, 'meili_sync_admin', 'MEMBER')",
        &[],
    )?
    .unwrap_or(false))
}

/// Runs catalog writes as the catalog's owner: `meili_sync_admin` may only read the catalog, so
/// that every task comes through a function that checked its caller.
fn as_catalog_owner<T>(work: impl FnOnce() -> CatalogResult<T>) -> CatalogResult<T> {
    let owner = select_one::<pg_sys::Oid>(
        "SELECT c.relowner FROM pg_catalog.pg_class c
          WHERE c.oid = 'meili_sync.tasks'::pg_catalog.regclass",
        &[],
    )?
    .ok_or_else(|| SyncError::new(ErrorKind::Internal, "meili_sync.tasks has no owner"))?;
    security::as_catalog_owner(owner, work)
}

/// Whether `role` may SELECT from the table (false if the role no longer exists).
pub fn may_select(role: pg_sys::Oid, relid: pg_sys::Oid) -> CatalogResult<bool> {
    Ok(select_one::<bool>(
        "SELECT CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.oid = $1)
                      AND EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid = $2)
                     THEN pg_catalog.has_table_privilege($1, $2, 'SELECT') ELSE false END",
        &[role.into(), relid.into()],
    )?
    .unwrap_or(false))
}

/// Whether the current role has the rights of `role` (is it, a member of it, or a superuser).
pub fn acts_as(role: pg_sys::Oid) -> CatalogResult<bool> {
    Ok(select_one::<bool>(
        "SELECT CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.oid = $1)
                     THEN pg_catalog.pg_has_role($1, 'USAGE')
                     ELSE (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname = current_user) END",
        &[role.into()],
    )?
    .unwrap_or(false))
}

/// A role's name, or its OID in brackets once it is gone.
pub fn role_name(role: pg_sys::Oid) -> CatalogResult<String> {
    Ok(select_one::<String>(
        "SELECT coalesce((SELECT r.rolname::text FROM pg_catalog.pg_roles r WHERE r.oid = $1),
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

pub fn relation_info(relid: pg_sys::Oid) -> CatalogResult<RelationInfo> {
    Spi::connect(|client| {
        let mut header = client.select(
            "SELECT c.relkind::text, c.relpersistence::text, c.relreplident::text,
                    pg_catalog.format('%I.%I', n.nspname, c.relname), c.relowner
               FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
              WHERE c.oid = $1",
            Some(1),
            &[relid.into()],
        )?;
        let Some(row) = header.next() else {
            return Err(SyncError::new(
                ErrorKind::UndefinedTable,
                format!("relation with OID {relid} does not exist"),
            ));
        };
        let relkind: String = row.get(1)?.unwrap_or_default();
        let persistence: String = row.get(2)?.unwrap_or_default();
        let replica_identity: String = row.get(3)?.unwrap_or_default();
        let qualified_name: String = row.get(4)?.unwrap_or_default();
        let owner: pg_sys::Oid = row.get(5)?.unwrap_or(pg_sys::InvalidOid);

        let mut columns = Vec::new();
        let rows = client.select(
            "SELECT a.attname::text, a.atttypid, pg_catalog.format_type(a.atttypid, a.atttypmod),
                    a.attnotnull, a.attgenerated <> ''
               FROM pg_catalog.pg_attribute a
              WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped
              ORDER BY a.attnum",
            None,
            &[relid.into()],
        )?;
        for row in rows {
            columns.push(ColumnInfo {
                name: row.get(1)?.unwrap_or_default(),
                type_oid: row.get(2)?.unwrap_or(pg_sys::InvalidOid),
                type_name: row.get(3)?.unwrap_or_default(),
                not_null: row.get(4)?.unwrap_or(false),
                generated: row.get(5)?.unwrap_or(false),
            });
        }

        let mut primary_key = None;
        let mut replica_identity_index = None;
        let mut unique_keys = Vec::new();
        let indexes = client.select(
            "SELECT i.indisprimary, i.indisreplident,
                    ARRAY(SELECT a.attname::text
                            FROM pg_catalog.unnest(i.indkey) WITH ORDINALITY k(attnum, ord)
                            JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                           ORDER BY k.ord)
               FROM pg_catalog.pg_index i
              WHERE i.indrelid = $1 AND i.indisunique AND i.indisvalid AND i.indpred IS NULL
                AND i.indexprs IS NULL AND i.indimmediate",
            None,
            &[relid.into()],
        )?;
        for row in indexes {
            let is_primary: bool = row.get(1)?.unwrap_or(false);
            let is_replica_identity: bool = row.get(2)?.unwrap_or(false);
            let Some(names) = names_from(row.get::<Vec<Option<String>>>(3)?) else {
                continue;
            };
            if is_primary {
                primary_key = Some(names.clone());
            }
            if is_replica_identity {
                replica_identity_index = Some(names.clone());
            }
            unique_keys.push(names);
        }
        Ok(RelationInfo {
            qualified_name,
            owner,
            relkind,
            persistence,
            replica_identity,
            columns,
            primary_key,
            replica_identity_index,
            unique_keys,
        })
    })
}

/// The table a task syncs, checked as `meili_sync_start` checks it and as the worker checks it
/// again before each copy: an ordinary, permanent user table that `role` may read.
pub fn syncable_source(relid: pg_sys::Oid, role: pg_sys::Oid) -> CatalogResult<RelationInfo> {
    let info = relation_info(relid)?;
    let table = &info.qualified_name;
    if info.relkind != "r" {
        return Err(SyncError::new(ErrorKind::InvalidParameter, format!("{table} is not an ordinary table"))
            .hint("Sync an ordinary table; partitioned tables, views and foreign tables are not supported."));
    }
    if u32::from(relid) < pg_sys::FirstNormalObjectId {
        return Err(SyncError::new(
            ErrorKind::UnsupportedType,
            format!("{table} is a system catalog"),
        )
        .hint("Sync a user table; system catalogs cannot be published for logical decoding."));
    }
    if info.persistence != "p" {
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!("table {table} is temporary or unlogged, so its changes are not in the WAL"),
        )
        .hint(format!(
            "Run ALTER TABLE {table} SET LOGGED, or sync a permanent table."
        )));
    }
    if !may_select(role, relid)? {
        let role = role_name(role)?;
        return Err(SyncError::new(
            ErrorKind::Privilege,
            format!("permission denied for table {table}: role {role} may not read it"),
        )
        .hint(format!(
            "A task copies the table's rows out of the database, so it needs SELECT on it: GRANT SELECT ON {table} TO {role}."
        )));
    }
    Ok(info)
}

impl RelationInfo {
    /// The SQL type of a column (as `format_type` prints it), for casts in generated queries.
    pub fn type_name_of(&self, column: &str) -> String {
        self.columns
            .iter()
            .find(|c| c.name == column)
            .map(|c| c.type_name.clone())
            .unwrap_or_default()
    }
}

/// Resolves how values of a type become JSON: domains to their base type, enums to text,
/// arrays to their element kind. Uses the syscache, not SPI, so that it also works inside a
/// decoding callback (where the catalog is read as of the decoded change).
pub fn value_kind(type_oid: pg_sys::Oid) -> CatalogResult<ValueKind> {
    // SAFETY: lsyscache lookups by OID; they raise an ERROR for a missing type, which pgrx turns
    // into a panic handled by the caller's error path.
    let (base, element, typtype) = unsafe {
        let base = pg_sys::getBaseType(type_oid);
        (
            base,
            pg_sys::get_element_type(base),
            pg_sys::get_typtype(base) as u8,
        )
    };
    if element != pg_sys::InvalidOid {
        return Ok(ValueKind::Array(Box::new(value_kind(element)?)));
    }
    match typtype {
        b'e' => Ok(ValueKind::Text),
        0 => Err(SyncError::new(
            ErrorKind::Internal,
            format!("type with OID {type_oid} does not exist"),
        )),
        _ => Ok(builtin_kind(base)),
    }
}

fn builtin_kind(oid: pg_sys::Oid) -> ValueKind {
    use pg_sys::BuiltinOid as B;
    match B::from_u32(oid.to_u32()) {
        Ok(B::INT2OID | B::INT4OID | B::INT8OID | B::OIDOID) => ValueKind::Integer,
        Ok(B::FLOAT4OID | B::FLOAT8OID) => ValueKind::Float,
        Ok(B::NUMERICOID) => ValueKind::Numeric,
        Ok(B::BOOLOID) => ValueKind::Bool,
        Ok(B::TEXTOID | B::VARCHAROID | B::BPCHAROID | B::NAMEOID | B::UUIDOID | B::CHAROID) => {
            ValueKind::Text
        }
        Ok(B::JSONOID | B::JSONBOID) => ValueKind::Json,
        Ok(B::TIMESTAMPOID) => ValueKind::Timestamp,
        Ok(B::TIMESTAMPTZOID) => ValueKind::TimestampTz,
        Ok(B::DATEOID) => ValueKind::Date,
        Ok(B::TIMEOID) => ValueKind::Time,
        Ok(B::TIMETZOID) => ValueKind::TimeTz,
        Ok(B::BYTEAOID) => ValueKind::Bytea,
        _ => ValueKind::Other,
    }
}

/// The task that writes into this index at this URL, if any, and the table it syncs: one index
/// holds one table's documents (a TRUNCATE of one table would otherwise delete the other's).
pub fn index_owner_task(url: &str, index_uid: &str) -> CatalogResult<Option<(i64, String)>> {
    Spi::connect(|client| {
        let mut rows = client.select(
            "SELECT t.id, t.source::text FROM meili_sync.tasks t WHERE t.url = $1 AND t.index_uid = $2",
            Some(1),
            &[url.into(), index_uid.into()],
        )?;
        let Some(row) = rows.next() else {
            return Ok(None);
        };
        Ok(row
            .get::<i64>(1)?
            .map(|id| (id, row.get::<String>(2).ok().flatten().unwrap_or_default())))
    })
}

/// An LSN in Postgres's text form, `X/X`.
pub fn format_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

pub struct NewTask<'a> {
    pub relid: pg_sys::Oid,
    pub owner: pg_sys::Oid,
    pub index_uid: &'a str,
    pub url: &'a str,
    pub api_key: Option<&'a str>,
    pub primary_key: &'a [String],
    pub options: serde_json::Value,
    pub resync_of: Option<i64>,
}

/// Inserts the task and its publication; returns the task id. The caller checked that
/// `task.owner` may read the table.
pub fn insert_task(task: NewTask<'_>, qualified_table: &str) -> CatalogResult<i64> {
    as_catalog_owner(|| insert_task_row(task, qualified_table))
}

fn insert_task_row(task: NewTask<'_>, qualified_table: &str) -> CatalogResult<i64> {
    Spi::connect_mut(|client| {
        let id: i64 = client
            .update(
                "INSERT INTO meili_sync.tasks (source, index_uid, url, primary_key, options, resync_of, owner)
                 VALUES ($1::oid::regclass, $2, $3, $4, $5, $6, $7::oid::regrole) RETURNING id",
                Some(1),
                &[
                    task.relid.into(),
                    task.index_uid.into(),
                    task.url.into(),
                    task.primary_key.to_vec().into(),
                    JsonB(task.options).into(),
                    task.resync_of.into(),
                    task.owner.into(),
                ],
            )?
            .first()
            .get_one::<i64>()?
            .ok_or_else(|| {
                SyncError::new(
                    ErrorKind::Internal,
                    "INSERT into meili_sync.tasks returned no id",
                )
            })?;
        if let Some(key) = task.api_key {
            client.update(
                "INSERT INTO meili_sync.task_secrets (task_id, api_key) VALUES ($1, $2)",
                None,
                &[id.into(), key.into()],
            )?;
        }
        let install = client
            .select("SELECT 'meili_sync.tasks'::regclass::oid", Some(1), &[])?
            .first()
            .get_one::<pg_sys::Oid>()?
            .unwrap_or(pg_sys::InvalidOid);
        // Publish every column: a column list would have to cover the replica identity, or
        // UPDATEs on the user's table would fail; the worker picks the columns itself.
        client.update(
            &format!(
                "CREATE PUBLICATION {} FOR TABLE ONLY {} WITH (publish = 'insert, update, delete, truncate')",
                quote_identifier(object_name(install, id)),
                qualified_table
            ),
            None,
            &[],
        )?;
        Ok(id)
    })
}

/// The name of a task's slot and publication. It includes the OID of `meili_sync.tasks`, which
/// is new each time the extension is created, so that a task id reused after DROP EXTENSION never
/// meets the slot or publication of an old install (the launcher drops those as orphans).
pub fn object_name(install: pg_sys::Oid, task_id: i64) -> String {
    format!("meili_sync_{}_{task_id}", install.to_u32())
}

const OBJECT_NAME_SQL: &str =
    "pg_catalog.format('meili_sync_%s_%s', 'meili_sync.tasks'::pg_catalog.regclass::pg_catalog.oid, t.id)";

pub fn load_task(task_id: i64) -> CatalogResult<Option<TaskRecord>> {
    Spi::connect(|client| {
        let mut rows = client.select(
            "SELECT t.id, t.source::oid, t.source::text, t.index_uid, t.url, s.api_key, t.primary_key,
                    t.options, t.state, t.snapshot_key, t.rows_copied, 'meili_sync.tasks'::regclass::oid,
                    t.resync_of, t.resync_phase, pg_catalog.pg_wal_lsn_diff(t.swap_lsn, '0/0')::bigint,
                    t.swap_created_at, t.owner::oid, t.generation
               FROM meili_sync.tasks t LEFT JOIN meili_sync.task_secrets s ON s.task_id = t.id
              WHERE t.id = $1",
            Some(1),
            &[task_id.into()],
        )?;
        let Some(row) = rows.next() else {
            return Ok(None);
        };
        let id: i64 = row.get(1)?.unwrap_or(task_id);
        Ok(Some(TaskRecord {
            id,
            relid: row.get(2)?.unwrap_or(pg_sys::InvalidOid),
            relation: row.get(3)?.unwrap_or_default(),
            index_uid: row.get(4)?.unwrap_or_default(),
            url: row.get(5)?.unwrap_or_default(),
            api_key: row.get(6)?,
            primary_key: names_from(row.get(7)?).unwrap_or_default(),
            options: row
                .get::<JsonB>(8)?
                .map(|json| json.0)
                .unwrap_or(serde_json::Value::Null),
            state: TaskState::from_stored(&row.get::<String>(9)?.unwrap_or_default()),
            slot_name: object_name(row.get(12)?.unwrap_or(pg_sys::InvalidOid), id),
            publication_name: object_name(row.get(12)?.unwrap_or(pg_sys::InvalidOid), id),
            snapshot_key: names_from(row.get(10)?),
            rows_copied: row.get(11)?.unwrap_or(0),
            resync_of: row.get(13)?,
            resync_phase: row.get(14)?,
            swap_lsn: row.get::<i64>(15)?.map(|lsn| lsn as u64),
            swap_created_at: row.get(16)?,
            owner: row.get(17)?.unwrap_or(pg_sys::InvalidOid),
            generation: row.get(18)?.unwrap_or(0),
        }))
    })
}

/// For the task-changing functions: the task's id, index and connection, or "no such task".
pub fn require_task(task_id: i64) -> CatalogResult<TaskRecord> {
    load_task(task_id)?.ok_or_else(|| {
        SyncError::new(
            ErrorKind::UndefinedTask,
            format!("meili_sync task {task_id} does not exist"),
        )
        .hint("SELECT task FROM meili_sync_status lists the tasks.")
    })
}

pub fn set_state(task_id: i64, state: TaskState) -> CatalogResult<()> {
    as_catalog_owner(|| {
        Spi::run_with_args(
            "UPDATE meili_sync.tasks SET state = $2, generation = generation + 1 WHERE id = $1",
            &[task_id.into(), state.as_str().into()],
        )?;
        Ok(())
    })
}

/// Stores changed options (and URL, and key when given) and restarts the task's worker.
pub fn alter_task(
    task_id: i64,
    url: &str,
    api_key: Option<&str>,
    options: serde_json::Value,
) -> CatalogResult<()> {
    as_catalog_owner(|| {
        Spi::connect_mut(|client| {
            client.update(
            "UPDATE meili_sync.tasks SET url = $2, options = $3, generation = generation + 1 WHERE id = $1",
            None,
            &[task_id.into(), url.trim_end_matches('/').into(), JsonB(options).into()],
        )?;
            if let Some(key) = api_key {
                client.update(
                    "INSERT INTO meili_sync.task_secrets (task_id, api_key) VALUES ($1, $2)
                 ON CONFLICT (task_id) DO UPDATE SET api_key = EXCLUDED.api_key",
                    None,
                    &[task_id.into(), key.into()],
                )?;
            }
            Ok(())
        })
    })
}

pub fn resume(task_id: i64) -> CatalogResult<()> {
    as_catalog_owner(|| {
        Ok(Spi::run_with_args(
            "UPDATE meili_sync.tasks
            SET state = CASE WHEN snapshot_finished_at IS NULL THEN 'snapshot' ELSE 'streaming' END,
                generation = generation + 1, last_error = NULL, last_error_at = NULL
          WHERE id = $1",
            &[task_id.into()],
        )?)
    })
}

pub fn reset_snapshot(task_id: i64) -> CatalogResult<()> {
    as_catalog_owner(|| {
        Ok(Spi::run_with_args(
        "UPDATE meili_sync.tasks
            SET state = 'snapshot', generation = generation + 1, snapshot_key = NULL, rows_copied = 0,
                snapshot_started_at = NULL, snapshot_finished_at = NULL, last_error = NULL, last_error_at = NULL
          WHERE id = $1",
        &[task_id.into()],
    )?)
    })
}

pub fn delete_task(task: &TaskRecord) -> CatalogResult<()> {
    as_catalog_owner(|| {
        Spi::connect_mut(|client| {
            client.update(
                &format!(
                    "DROP PUBLICATION IF EXISTS {}",
                    quote_identifier(&task.publication_name)
                ),
                None,
                &[],
            )?;
            client.update(
                "DELETE FROM meili_sync.tasks WHERE id = $1",
                None,
                &[task.id.into()],
            )?;
            Ok(())
        })
    })
}

/// The copy begins (a resumed copy keeps its first start).
pub fn mark_snapshot_started(task_id: i64) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET snapshot_started_at = coalesce(snapshot_started_at, pg_catalog.now()) WHERE id = $1",
        &[task_id.into()],
    )?;
    Ok(())
}

pub fn save_snapshot_progress(task_id: i64, key: &[String], rows_copied: i64) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks
            SET snapshot_key = $2, rows_copied = $3, snapshot_started_at = coalesce(snapshot_started_at, pg_catalog.now())
          WHERE id = $1",
        &[task_id.into(), key.to_vec().into(), rows_copied.into()],
    )?;
    Ok(())
}

pub fn finish_snapshot(task_id: i64, rows_copied: i64) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks
            SET state = 'streaming', rows_copied = $2, snapshot_started_at = coalesce(snapshot_started_at, pg_catalog.now()),
                snapshot_finished_at = pg_catalog.now()
          WHERE id = $1 AND state = 'snapshot'",
        &[task_id.into(), rows_copied.into()],
    )?;
    Ok(())
}

/// Stores documents Meilisearch refused; a document already there is updated (attempts + 1).
/// During streaming the checkpoint is the commit LSN of the change.
pub fn insert_dead_letters(
    task_id: i64,
    dead_letters: &[DeadLetter],
    streaming: bool,
) -> CatalogResult<()> {
    Spi::connect_mut(|client| {
        for dead in dead_letters {
            let id = match &dead.id {
                serde_json::Value::String(text) => Some(text.clone()),
                serde_json::Value::Null => None,
                other => Some(other.to_string()),
            };
            let lsn = dead.checkpoint.filter(|_| streaming).map(format_lsn);
            client.update(
                "INSERT INTO meili_sync.dead_letters
                     (task_id, document_id, operation, document, error_code, error_message, meili_task_uid, lsn)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8::pg_lsn)
                 ON CONFLICT (task_id, document_id) DO UPDATE
                    SET operation = EXCLUDED.operation, document = EXCLUDED.document,
                        error_code = EXCLUDED.error_code, error_message = EXCLUDED.error_message,
                        meili_task_uid = EXCLUDED.meili_task_uid, lsn = EXCLUDED.lsn,
                        last_seen = pg_catalog.now(), attempts = meili_sync.dead_letters.attempts + 1",
                None,
                &[
                    task_id.into(),
                    id.into(),
                    dead.op.name().into(),
                    String::from_utf8_lossy(&dead.document).into_owned().into(),
                    dead.code.as_str().into(),
                    dead.message.as_str().into(),
                    dead.task_uid.and_then(|uid| i64::try_from(uid).ok()).into(),
                    lsn.into(),
                ],
            )?;
        }
        Ok(())
    })
}

/// Document ids of a task's dead letters (all, or those in `only`).
pub fn dead_letter_ids(task_id: i64, only: Option<&[String]>) -> CatalogResult<Vec<String>> {
    Spi::connect(|client| {
        let rows = client.select(
            "SELECT document_id FROM meili_sync.dead_letters
              WHERE task_id = $1 AND document_id IS NOT NULL AND ($2::text[] IS NULL OR document_id = ANY ($2))
              ORDER BY id",
            None,
            &[task_id.into(), only.map(<[String]>::to_vec).into()],
        )?;
        let mut ids = Vec::new();
        for row in rows {
            if let Some(id) = row.get::<String>(1)? {
                ids.push(id);
            }
        }
        Ok(ids)
    })
}

pub fn delete_dead_letters(task_id: i64, only: Option<&[String]>) -> CatalogResult<i64> {
    as_catalog_owner(|| {
        Spi::connect_mut(|client| {
            let table = client.update(
            "WITH gone AS (DELETE FROM meili_sync.dead_letters
                            WHERE task_id = $1 AND ($2::text[] IS NULL OR document_id = ANY ($2)) RETURNING 1)
             SELECT pg_catalog.count(*) FROM gone",
            None,
            &[task_id.into(), only.map(<[String]>::to_vec).into()],
        )?;
            Ok(table.first().get_one::<i64>()?.unwrap_or(0))
        })
    })
}

/// How a key column is matched against document ids from the index: through the key's type
/// (uses the key's index; the text must be valid input for the type) or through its text output
/// (always valid, but scans).
pub enum KeyMatch {
    Typed,
    AsText,
}

/// The key columns of one key tuple per position, as `text[]` arguments (one per column).
fn key_arrays(keys: &[Vec<String>], columns: usize) -> Vec<DatumWithOid<'static>> {
    (0..columns)
        .map(|column| {
            let values: Vec<String> = keys
                .iter()
                .map(|key| key.get(column).cloned().unwrap_or_default())
                .collect();
            values.into()
        })
        .collect()
}

fn key_condition(key: &[(String, String)], matching: &KeyMatch, alias: &str) -> String {
    key.iter()
        .enumerate()
        .map(|(index, (name, type_name))| match matching {
            KeyMatch::Typed => format!(
                "{alias}.{} = (${}::text[])[i]::{type_name}",
                quote_identifier(name),
                index + 1
            ),
            KeyMatch::AsText => format!(
                "{alias}.{}::text = (${}::text[])[i]",
                quote_identifier(name),
                index + 1
            ),
        })
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// Positions (0-based) of the key tuples that no row of the table has.
pub fn absent_keys(
    qualified_table: &str,
    key: &[(String, String)],
    keys: &[Vec<String>],
    matching: &KeyMatch,
) -> CatalogResult<Vec<usize>> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let condition = key_condition(key, matching, "t");
    Spi::connect(|client| {
        let rows = client.select(
            &format!(
                "SELECT i FROM pg_catalog.generate_subscripts($1::text[], 1) i
                  WHERE NOT EXISTS (SELECT 1 FROM ONLY {qualified_table} t WHERE {condition})
                  ORDER BY i"
            ),
            None,
            &key_arrays(keys, key.len()),
        )?;
        let mut absent = Vec::new();
        for row in rows {
            if let Some(position) = row.get::<i32>(1)? {
                absent.push(usize::try_from(position - 1).unwrap_or_default());
            }
        }
        Ok(absent)
    })
}

/// The `columns` of the rows with these keys, locked FOR UPDATE until the end of the transaction so that they cannot change meanwhile.
pub fn lock_rows(
    qualified_table: &str,
    columns: &[String],
    key: &[(String, String)],
    keys: &[Vec<String>],
) -> CatalogResult<Vec<Vec<Option<String>>>> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let select: Vec<String> = columns
        .iter()
        .map(|name| format!("t.{}", quote_identifier(name)))
        .collect();
    let condition = key_condition(key, &KeyMatch::Typed, "t");
    Spi::connect_mut(|client| {
        let table = client.update(
            &format!(
                "SELECT {} FROM ONLY {qualified_table} t
                  WHERE EXISTS (SELECT 1 FROM pg_catalog.generate_subscripts($1::text[], 1) i WHERE {condition})
                  FOR UPDATE OF t",
                select.join(", ")
            ),
            None,
            &key_arrays(keys, key.len()),
        )?;
        Ok(page_text_values(&table, select.len()))
    })
}

/// Blocks writes to the table until the end of the transaction (reads go on).
pub fn lock_table_against_writes(qualified_table: &str) -> CatalogResult<()> {
    Spi::run(&format!("LOCK TABLE ONLY {qualified_table} IN SHARE MODE"))?;
    Ok(())
}

pub fn set_error_state(task_id: i64, message: &str) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET state = 'error', last_error = $2, last_error_at = pg_catalog.now() WHERE id = $1",
        &[task_id.into(), message.into()],
    )?;
    Ok(())
}

pub fn extension_installed() -> CatalogResult<bool> {
    Ok(select_one::<bool>(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'pg_meili_sync')",
        &[],
    )?
    .unwrap_or(false))
}

pub fn task_count() -> CatalogResult<i64> {
    Ok(select_one::<i64>("SELECT pg_catalog.count(*) FROM meili_sync.tasks", &[])?.unwrap_or(0))
}

/// The resync helper of a task, if one is running.
pub fn resync_helper(task_id: i64) -> CatalogResult<Option<i64>> {
    select_one::<i64>(
        "SELECT id FROM meili_sync.tasks WHERE resync_of = $1",
        &[task_id.into()],
    )
}

/// What a resync helper needs to know of the task it rebuilds before swapping: its state, and
/// whether a worker still holds its slot and how far that slot is confirmed.
pub struct HeldTask {
    pub state: TaskState,
    pub slot_active: bool,
    pub confirmed: Option<u64>,
}

pub fn held_task(task_id: i64) -> CatalogResult<Option<HeldTask>> {
    Spi::connect(|client| {
        let mut rows = client.select(
            &format!(
                "SELECT t.state, coalesce(s.active, false),
                        pg_catalog.pg_wal_lsn_diff(s.confirmed_flush_lsn, '0/0')::bigint
                   FROM meili_sync.tasks t
                   LEFT JOIN pg_catalog.pg_replication_slots s ON s.slot_name = {OBJECT_NAME_SQL}
                  WHERE t.id = $1"
            ),
            Some(1),
            &[task_id.into()],
        )?;
        let Some(row) = rows.next() else {
            return Ok(None);
        };
        Ok(Some(HeldTask {
            state: TaskState::from_stored(&row.get::<String>(1)?.unwrap_or_default()),
            slot_active: row.get(2)?.unwrap_or(false),
            confirmed: row.get::<i64>(3)?.map(|lsn| lsn as u64),
        }))
    })
}

/// Holds a streaming task for the swap of its index: the launcher stops its worker.
pub fn hold_for_swap(task_id: i64) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET state = 'swapping', generation = generation + 1
          WHERE id = $1 AND state = 'streaming'",
        &[task_id.into()],
    )?;
    Ok(())
}

/// The helper is about to swap: where it stopped, and its index's createdAt before the swap.
pub fn record_swap(
    helper_id: i64,
    lsn: Option<u64>,
    created_at: Option<&str>,
) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks
            SET resync_phase = CASE WHEN $2::text IS NULL THEN NULL ELSE 'swapping' END,
                swap_lsn = $2::text::pg_lsn, swap_created_at = $3
          WHERE id = $1",
        &[
            helper_id.into(),
            lsn.map(format_lsn).into(),
            created_at.into(),
        ],
    )?;
    Ok(())
}

/// After the swap: the held task's slot moves to where the helper stopped (everything before is
/// in the new index), and the task streams on from there.
pub fn finish_swap(helper_id: i64, task_id: i64, slot_name: &str, lsn: u64) -> CatalogResult<()> {
    let position = format_lsn(lsn);
    select_one::<String>(
        "SELECT pg_catalog.pg_replication_slot_advance(slot_name, $2::text::pg_lsn)::text
           FROM pg_catalog.pg_replication_slots
          WHERE slot_name = $1 AND confirmed_flush_lsn < $2::text::pg_lsn",
        &[slot_name.into(), position.into()],
    )?;
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET state = 'streaming', generation = generation + 1
          WHERE id = $1 AND state = 'swapping'",
        &[task_id.into()],
    )?;
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET resync_phase = 'swapped' WHERE id = $1",
        &[helper_id.into()],
    )?;
    Ok(())
}

/// Tasks held for a swap whose helper is gone or no longer running (dropped, stopped, failed)
/// stream on; returns their ids.
pub fn release_held_tasks() -> CatalogResult<Vec<i64>> {
    const ORPHANED: &str = "m.state = 'swapping'
        AND NOT EXISTS (SELECT 1 FROM meili_sync.tasks r
                         WHERE r.resync_of = m.id AND r.state IN ('snapshot', 'streaming'))";
    // Read-only first: the launcher asks every round and must not burn an xid each time.
    let any = select_one::<bool>(
        &format!("SELECT EXISTS (SELECT 1 FROM meili_sync.tasks m WHERE {ORPHANED})"),
        &[],
    )?;
    if any != Some(true) {
        return Ok(Vec::new());
    }
    Spi::connect_mut(|client| {
        let rows = client.update(
            &format!(
                "UPDATE meili_sync.tasks m SET state = 'streaming', generation = generation + 1
                  WHERE {ORPHANED} RETURNING m.id"
            ),
            None,
            &[],
        )?;
        let mut ids = Vec::new();
        for row in rows {
            if let Some(id) = row.get::<i64>(1)? {
                ids.push(id);
            }
        }
        Ok(ids)
    })
}

pub fn list_tasks() -> CatalogResult<Vec<TaskSummary>> {
    Spi::connect(|client| {
        let rows = client.select(
            "SELECT id, state IN ('snapshot', 'streaming'), generation FROM meili_sync.tasks ORDER BY id",
            None,
            &[],
        )?;
        let mut tasks = Vec::new();
        for row in rows {
            let Some(id) = row.get::<i64>(1)? else {
                continue;
            };
            tasks.push(TaskSummary {
                id,
                active: row.get(2)?.unwrap_or(false),
                generation: row.get(3)?.unwrap_or(0),
            });
        }
        Ok(tasks)
    })
}

/// The slot's `wal_status` (`lost` once `max_slot_wal_keep_size` invalidated it); None if missing.
pub fn slot_wal_status(name: &str) -> CatalogResult<Option<String>> {
    select_one::<String>(
        "SELECT coalesce(wal_status, 'unknown') FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
        &[name.into()],
    )
}

/// Starts the copy over (the slot it relied on was replaced).
pub fn restart_copy(task_id: i64) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET snapshot_key = NULL, rows_copied = 0 WHERE id = $1",
        &[task_id.into()],
    )?;
    Ok(())
}

/// Retained WAL and `wal_status` of every task's slot, for the launcher's warnings.
pub fn slot_health() -> CatalogResult<Vec<SlotHealth>> {
    Spi::connect(|client| {
        let rows = client.select(
            &format!(
                "SELECT t.id, s.slot_name::text, coalesce(s.wal_status, 'unknown'),
                        pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), s.restart_lsn)::bigint
                   FROM meili_sync.tasks t
                   JOIN pg_catalog.pg_replication_slots s ON s.slot_name = {OBJECT_NAME_SQL}"
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
                    wal_status,
                    retained_bytes: row.get::<i64>(4)?,
                });
            }
        }
        Ok(health)
    })
}

/// Creates the task's logical slot; must be the first statement of its transaction.
pub fn create_slot(name: &str) -> CatalogResult<()> {
    select_one::<String>(
        "SELECT slot_name::text FROM pg_catalog.pg_create_logical_replication_slot($1, 'pgoutput')",
        &[name.into()],
    )?;
    Ok(())
}

/// What names the extension's slots and publications (`meili_sync_<install>_<task>`).
const OBJECT_NAME_PATTERN: &str = "'^meili_sync_[0-9]+_[0-9]+$'";

/// Slots and publications this extension created in this database whose task is gone (dropped,
/// or from an earlier install of the extension) and which nobody holds: (kind, name).
pub fn orphans() -> CatalogResult<Vec<(String, String)>> {
    slots_and_publications(&format!(
        "SELECT 'slot', s.slot_name::text FROM pg_catalog.pg_replication_slots s
          WHERE s.database OPERATOR(pg_catalog.=) pg_catalog.current_database() AND NOT s.active
            AND s.slot_name::text OPERATOR(pg_catalog.~) {OBJECT_NAME_PATTERN}
            AND NOT EXISTS (SELECT 1 FROM meili_sync.tasks t WHERE {OBJECT_NAME_SQL} = s.slot_name)
         UNION ALL
         SELECT 'publication', p.pubname::text FROM pg_catalog.pg_publication p
          WHERE p.pubname::text OPERATOR(pg_catalog.~) {OBJECT_NAME_PATTERN}
            AND NOT EXISTS (SELECT 1 FROM meili_sync.tasks t WHERE {OBJECT_NAME_SQL} = p.pubname)"
    ))
}

/// After DROP EXTENSION: every slot (once no worker holds it) and publication its tasks left.
pub fn leftovers_without_extension() -> CatalogResult<Vec<(String, String)>> {
    slots_and_publications(&format!(
        "SELECT 'slot', s.slot_name::text FROM pg_catalog.pg_replication_slots s
          WHERE s.database OPERATOR(pg_catalog.=) pg_catalog.current_database() AND NOT s.active
            AND s.slot_name::text OPERATOR(pg_catalog.~) {OBJECT_NAME_PATTERN}
         UNION ALL
         SELECT 'publication', p.pubname::text FROM pg_catalog.pg_publication p
          WHERE p.pubname::text OPERATOR(pg_catalog.~) {OBJECT_NAME_PATTERN}"
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
pub fn terminate_backend(pid: i32) -> CatalogResult<()> {
    select_one::<bool>("SELECT pg_catalog.pg_terminate_backend($1)", &[pid.into()])?;
    Ok(())
}

pub fn drop_slot(name: &str) -> CatalogResult<()> {
    select_one::<String>(
        "SELECT pg_catalog.pg_drop_replication_slot($1)::text",
        &[name.into()],
    )?;
    Ok(())
}

/// Sets the session so that every type's text output is the one the encoder expects, in the
/// snapshot and in the decoded stream alike.
pub fn set_output_formats(transaction_only: bool) -> CatalogResult<()> {
    for (name, value) in [
        ("DateStyle", "ISO, YMD"),
        ("TimeZone", "UTC"),
        ("IntervalStyle", "iso_8601"),
        ("extra_float_digits", "1"),
        ("bytea_output", "hex"),
    ] {
        select_one::<String>(
            "SELECT pg_catalog.set_config($1, $2, $3)",
            &[name.into(), value.into(), transaction_only.into()],
        )?;
    }
    Ok(())
}

/// One page of the source table in key order after `after`, at most `limit` rows, each value as
/// its type's text output (what pgoutput sends), or None for NULL.
pub fn read_page(
    query: &str,
    after: Option<&[String]>,
    limit: usize,
    column_count: usize,
) -> CatalogResult<Vec<Vec<Option<String>>>> {
    Spi::connect(|client| {
        let mut args: Vec<DatumWithOid> = after
            .map(|key| key.iter().map(|value| value.as_str().into()).collect())
            .unwrap_or_default();
        args.push(i64::try_from(limit).unwrap_or(i64::MAX).into());
        let table = client.select(query, None, &args)?;
        Ok(page_text_values(&table, column_count))
    })
}

fn page_text_values(
    table: &pgrx::spi::SpiTupleTable<'_>,
    column_count: usize,
) -> Vec<Vec<Option<String>>> {
    let mut rows = Vec::with_capacity(table.len());
    // SAFETY: `client.select` just filled SPI_tuptable and we are still inside its SPI connection,
    // so the tuple table, its tuple descriptor and its `table.len()` tuples are valid; SPI_getvalue
    // calls the column type's output function and returns a palloc'd C string or NULL for NULL.
    unsafe {
        let tuptable = pg_sys::SPI_tuptable;
        if tuptable.is_null() {
            return rows;
        }
        let tupdesc = (*tuptable).tupdesc;
        let tuples = std::slice::from_raw_parts((*tuptable).vals, table.len());
        for &tuple in tuples {
            let mut values = Vec::with_capacity(column_count);
            for column in 1..=column_count {
                let text = pg_sys::SPI_getvalue(tuple, tupdesc, column as i32);
                if text.is_null() {
                    values.push(None);
                } else {
                    values.push(Some(CStr::from_ptr(text).to_string_lossy().into_owned()));
                    pg_sys::pfree(text.cast());
                }
            }
            rows.push(values);
        }
    }
    rows
}

/// The keyset page queries (first page, and pages after a key): the document columns, then the
/// key columns, in key order. The row limit is the last parameter, so that each page can be sized
/// by the bytes of the rows before it.
pub fn page_queries(
    relation: &str,
    columns: &[String],
    key: &[(String, String)],
) -> (String, String) {
    let select: Vec<String> = columns
        .iter()
        .chain(key.iter().map(|(name, _)| name))
        .map(quote_identifier)
        .collect();
    let key_names: Vec<String> = key.iter().map(|(name, _)| quote_identifier(name)).collect();
    let key_params: Vec<String> = key
        .iter()
        .enumerate()
        .map(|(index, (_, type_name))| format!("${}::{}", index + 1, type_name))
        .collect();
    let head = format!("SELECT {} FROM ONLY {}", select.join(", "), relation);
    let order = format!("ORDER BY {}", key_names.join(", "));
    (
        format!("{head} {order} LIMIT $1"),
        format!(
            "{head} WHERE ({}) > ({}) {order} LIMIT ${}",
            key_names.join(", "),
            key_params.join(", "),
            key.len() + 1
        ),
    )
}
