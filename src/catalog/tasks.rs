//! Task rows: their state, creation, loading, changes made by the SQL functions, the copy's
//! progress, and the resync's hold and swap.

use pgrx::prelude::*;
use pgrx::spi::quote_identifier;
use pgrx::JsonB;

use pg_meili_sync_core::document::shard::ShardFilter;
use pg_meili_sync_core::wal::state_change;

use super::fragments::{
    columns_added_sql, copy_again_sql, source_shape_sql, update_in_id_order_sql, LAST_COLUMN_SQL,
    OWN_SLOT_SQL, SENT_COLUMN_SQL, SHARED_TASK_SQL,
};
use super::install::INSTALL_TOKEN_SQL;
use super::shared::shared_object_name;
use super::{
    as_catalog_owner, format_lsn, ids_of, names_from, select_one, CatalogResult, OBJECT_NAME_SQL,
};
use crate::error::{ErrorKind, SyncError};

/// Where a resync helper is in its swap, recorded before each step so that a helper restarted
/// between them resumes it (`meili_sync.tasks.resync_phase` with `swap_lsn` and
/// `swap_created_at`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResyncPhase {
    /// The swap was asked for with the stream stopped at `position`, when the new index had been
    /// created at `created_at`: after the swap the live index has that `createdAt`.
    Swapping { position: u64, created_at: String },
    /// The swap happened and the task streams on; the old index and the helper are left to go.
    Swapped,
}

impl ResyncPhase {
    /// A swap recorded without its position or `createdAt` is no swap to recover: the helper
    /// streams on and records its next swap afresh.
    fn from_stored(
        phase: Option<&str>,
        position: Option<u64>,
        created_at: Option<String>,
    ) -> Option<Self> {
        match (phase, position, created_at) {
            (Some("swapped"), _, _) => Some(ResyncPhase::Swapped),
            (Some("swapping"), Some(position), Some(created_at)) => Some(ResyncPhase::Swapping {
                position,
                created_at,
            }),
            _ => None,
        }
    }
}

/// What a task should be doing: `meili_sync.tasks.state`, whose CHECK constraint allows exactly
/// these. (Not to be confused with a worker's live [`crate::shmem::live::Phase`], nor with the
/// status of a Meilisearch task.)
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
    /// The key `meili_search` uses instead of `api_key` when set.
    pub search_api_key: Option<String>,
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
    /// A resync helper's swap, once it is recorded (None before, and for every other task).
    pub resync_phase: Option<ResyncPhase>,
    /// In the database's shared decoding pass (`slot_name` and `publication_name` are then the
    /// shared ones, unless it is `moving`).
    pub shared: bool,
    /// A shared task that still has a slot of its own (it had one before, or was altered to
    /// shared): its worker streams from that slot until it hands over to the shared decoder.
    pub moving: bool,
    /// A shared task's position: every transaction that committed before it is in its index or
    /// its copy. None until the shared decoder gives it one.
    pub stream_position: Option<u64>,
    /// A partitioned table's leaf partitions that the index is in line with (`save_partitions`).
    /// None before a copy of 0.3.0 recorded them.
    pub partitions: Option<Vec<u32>>,
    /// On a replica's row: the task it is a replica of (its state changes apply to this row too).
    pub replica_of: Option<i64>,
    /// On a shard's row: its name, and the names of the task's shards (which documents it keeps).
    pub shard: Option<String>,
    pub shard_names: Option<Vec<String>>,
}

impl TaskRecord {
    /// The documents this row keeps: on a shard's row, those whose id hashes to it.
    pub fn shard_filter(&self) -> Option<ShardFilter> {
        ShardFilter::new(self.shard_names.clone()?, self.shard.as_deref()?)
    }
}

/// A task as the launcher sees it.
#[derive(Debug, Clone, Copy)]
pub struct TaskSummary {
    pub id: i64,
    /// Needs a task worker of its own: copying, or streaming from its own slot (also while it
    /// moves into the shared pass; the shared decoder streams the shared tasks).
    pub active: bool,
    pub generation: i32,
    pub shared: bool,
    /// A sharded task that a rebalance worker must bring to its new shard list: every shard
    /// being added has its documents, or a shard still holds documents that moved.
    pub rebalancing: bool,
}

/// The task that writes into this index at this URL, if any, and the table it syncs: one index
/// holds one table's documents (a TRUNCATE of one table would otherwise delete the other's).
pub fn index_owner_task(url: &str, index_uid: &str) -> CatalogResult<Option<(i64, String)>> {
    Spi::connect(|client| {
        let mut rows = client.select(
            "SELECT t.id, t.source::text FROM meili_sync.tasks t WHERE t.url OPERATOR(pg_catalog.=) $1 AND t.index_uid OPERATOR(pg_catalog.=) $2",
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

pub struct NewTask<'a> {
    pub relid: pg_sys::Oid,
    pub owner: pg_sys::Oid,
    pub index_uid: &'a str,
    pub url: &'a str,
    pub api_key: Option<&'a str>,
    pub search_api_key: Option<&'a str>,
    pub primary_key: &'a [String],
    pub options: serde_json::Value,
    pub resync_of: Option<i64>,
    pub replica_of: Option<i64>,
    /// A shard's name and the names of all the task's shards.
    pub shard: Option<(&'a str, &'a [String])>,
}

/// Inserts the task and its publication of `published` (schema-qualified tables: the task's
/// table, or every table its view reads); returns the task id. The caller checked that
/// `task.owner` may read the source.
pub fn insert_task(task: NewTask<'_>, published: &[String]) -> CatalogResult<i64> {
    as_catalog_owner(|| insert_task_row(task, published))
}

fn insert_task_row(task: NewTask<'_>, published: &[String]) -> CatalogResult<i64> {
    let shared = task.resync_of.is_none()
        && task
            .options
            .get("decoding")
            .and_then(|value| value.as_str())
            != Some("own");
    Spi::connect_mut(|client| {
        let id: i64 = client
            .update(
                &format!(
                    "INSERT INTO meili_sync.tasks (source, index_uid, url, primary_key, options, resync_of, owner, install_token, replica_of, shard, shard_names)
                     VALUES ($1::oid::regclass, $2, $3, $4, $5, $6, $7::oid::regrole, {INSTALL_TOKEN_SQL}, $8, $9, $10) RETURNING id"
                ),
                Some(1),
                &[
                    task.relid.into(),
                    task.index_uid.into(),
                    task.url.into(),
                    task.primary_key.to_vec().into(),
                    JsonB(task.options).into(),
                    task.resync_of.into(),
                    task.owner.into(),
                    task.replica_of.into(),
                    task.shard.map(|(name, _)| name).into(),
                    task.shard.map(|(_, names)| names.to_vec()).into(),
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
        if task.api_key.is_some() || task.search_api_key.is_some() {
            client.update(
                "INSERT INTO meili_sync.task_secrets (task_id, api_key, search_api_key) VALUES ($1, $2, $3)",
                None,
                &[id.into(), task.api_key.into(), task.search_api_key.into()],
            )?;
        }
        if shared {
            // The shared decoder publishes the table in the shared publication itself.
            return Ok(id);
        }
        let install = client
            .select("SELECT 'meili_sync.tasks'::regclass::oid", Some(1), &[])?
            .first()
            .get_one::<pg_sys::Oid>()?
            .unwrap_or(pg_sys::InvalidOid);
        let relids: Vec<pg_sys::Oid> = client
            .select(
                "SELECT pg_catalog.to_regclass(n)::pg_catalog.oid FROM pg_catalog.unnest($1::pg_catalog.text[]) AS n",
                None,
                &[published.to_vec().into()],
            )?
            .filter_map(|row| row.get::<pg_sys::Oid>(1).ok().flatten())
            .collect();
        // Publish every column: a column list would have to cover the replica identity, or
        // UPDATEs on the user's table would fail; the worker picks the columns itself. A
        // publication of this name that someone made first is not ours, and is made anew.
        let name = object_name(install, id);
        if let super::replication::PublicationCheck::Mended(why) =
            super::replication::check_publication(&name, &relids, &[], true)?
        {
            warning!("pg_meili_sync task {id}: publication \"{name}\" {why}; it was made anew");
        }
        Ok(id)
    })
}

/// The name of a task's slot and publication. It includes the OID of `meili_sync.tasks`, which
/// is new each time the extension is created, so that a task id reused after DROP EXTENSION never
/// meets the slot or publication of an old install (the launcher drops those as orphans).
pub fn object_name(install: pg_sys::Oid, task_id: i64) -> String {
    format!("meili_sync_{}_{task_id}", install.to_u32())
}

pub fn load_task(task_id: i64) -> CatalogResult<Option<TaskRecord>> {
    Spi::connect(|client| {
        let mut rows = client.select(
            &format!("SELECT t.id, t.source::oid, t.source::text, t.index_uid, t.url, s.api_key, t.primary_key,
                    t.options, t.state, t.snapshot_key, t.rows_copied, 'meili_sync.tasks'::regclass::oid,
                    t.resync_of, t.resync_phase, pg_catalog.pg_wal_lsn_diff(t.swap_lsn, '0/0')::bigint,
                    t.swap_created_at, t.owner::oid, t.generation, {SHARED_TASK_SQL},
                    pg_catalog.pg_wal_lsn_diff(t.stream_position, '0/0')::bigint, {OWN_SLOT_SQL},
                    s.search_api_key, t.partitions, t.replica_of, t.shard, t.shard_names
               FROM meili_sync.tasks t LEFT JOIN meili_sync.task_secrets s ON s.task_id OPERATOR(pg_catalog.=) t.id
              WHERE t.id OPERATOR(pg_catalog.=) $1"),
            Some(1),
            &[task_id.into()],
        )?;
        let Some(row) = rows.next() else {
            return Ok(None);
        };
        let id: i64 = row.get(1)?.unwrap_or(task_id);
        let install = row.get(12)?.unwrap_or(pg_sys::InvalidOid);
        let shared = row.get(19)?.unwrap_or(false);
        let moving = shared && row.get(21)?.unwrap_or(false);
        let object = if shared && !moving {
            shared_object_name(install)
        } else {
            object_name(install, id)
        };
        Ok(Some(TaskRecord {
            id,
            relid: row.get(2)?.unwrap_or(pg_sys::InvalidOid),
            relation: row.get(3)?.unwrap_or_default(),
            index_uid: row.get(4)?.unwrap_or_default(),
            url: row.get(5)?.unwrap_or_default(),
            api_key: row.get(6)?,
            search_api_key: row.get(22)?,
            primary_key: names_from(row.get(7)?).unwrap_or_default(),
            options: row
                .get::<JsonB>(8)?
                .map(|json| json.0)
                .unwrap_or(serde_json::Value::Null),
            state: TaskState::from_stored(&row.get::<String>(9)?.unwrap_or_default()),
            slot_name: object.clone(),
            publication_name: object,
            snapshot_key: names_from(row.get(10)?),
            rows_copied: row.get(11)?.unwrap_or(0),
            resync_of: row.get(13)?,
            resync_phase: ResyncPhase::from_stored(
                row.get::<String>(14)?.as_deref(),
                row.get::<i64>(15)?.map(|lsn| lsn as u64),
                row.get(16)?,
            ),
            owner: row.get(17)?.unwrap_or(pg_sys::InvalidOid),
            generation: row.get(18)?.unwrap_or(0),
            shared,
            moving,
            stream_position: row.get::<i64>(20)?.map(|lsn| lsn as u64),
            partitions: row
                .get::<Vec<pg_sys::Oid>>(23)?
                .map(|oids| oids.into_iter().map(pg_sys::Oid::to_u32).collect()),
            replica_of: row.get(24)?,
            shard: row.get(25)?,
            shard_names: row.get(26)?,
        }))
    })
}

/// A task as `meili_search` needs it (its URL and keys), read with the catalog owner's rights:
/// the caller may be any role that can read the task's table, which is checked after.
pub fn load_task_for_search(task_id: i64) -> CatalogResult<Option<TaskRecord>> {
    as_catalog_owner(|| load_task(task_id))
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

/// Sets the state of the task and of its replicas (on a replica's row: of that replica alone).
pub fn set_state(task_id: i64, state: TaskState) -> CatalogResult<()> {
    as_catalog_owner(|| {
        let changed = update_task_and_replicas(
            task_id,
            "state = $2, generation = generation + 1",
            vec![state.as_str().into()],
        )?;
        changed.into_iter().try_for_each(announce_state_change)
    })
}

/// Gives every shard row of the task the shard list `names`; the rows that had another list
/// restart with it at this commit (from here on they keep only the ids that hash to them), and
/// are marked to have the documents that moved deleted once every shard has passed this commit
/// (`note_prune_position` sets where). Returns the rows that changed.
pub fn adopt_shard_names(task_id: i64, names: &[String]) -> CatalogResult<Vec<i64>> {
    as_catalog_owner(|| {
        let changed = Spi::connect_mut(|client| {
            let rows = client.update(
                "UPDATE meili_sync.tasks
                    SET shard_names = $2, generation = generation + 1, shard_prune_after = 'FFFFFFFF/FFFFFFFF'
                  WHERE (id OPERATOR(pg_catalog.=) $1 OR replica_of OPERATOR(pg_catalog.=) $1)
                    AND shard IS NOT NULL AND shard_names OPERATOR(pg_catalog.<>) $2
                 RETURNING id",
                None,
                &[task_id.into(), names.to_vec().into()],
            )?;
            ids_of(rows)
        })?;
        changed
            .iter()
            .copied()
            .try_for_each(announce_state_change)?;
        Ok(changed)
    })
}

/// Whether a shard is still being added to the task (its rows have two shard lists), or a shard
/// still holds documents that moved.
pub fn shard_rebalance_pending(task_id: i64) -> CatalogResult<bool> {
    Ok(select_one::<bool>(
        "SELECT pg_catalog.count(DISTINCT shard_names) OPERATOR(pg_catalog.>) 1
                OR pg_catalog.bool_or(shard_prune_after IS NOT NULL)
           FROM meili_sync.tasks
          WHERE id OPERATOR(pg_catalog.=) $1 OR replica_of OPERATOR(pg_catalog.=) $1",
        &[task_id.into()],
    )?
    .unwrap_or(false))
}

/// The shard rows of the task with documents to delete that moved to another shard, and the WAL
/// position every shard must have passed first: the end of the WAL when first asked after
/// `adopt_shard_names` committed (so past its commit).
pub fn note_prune_position(task_id: i64) -> CatalogResult<Vec<(i64, u64)>> {
    as_catalog_owner(|| {
        Spi::connect_mut(|client| {
            let rows = client.update(
                "UPDATE meili_sync.tasks
                    SET shard_prune_after = LEAST(shard_prune_after, pg_catalog.pg_current_wal_lsn())
                  WHERE (id OPERATOR(pg_catalog.=) $1 OR replica_of OPERATOR(pg_catalog.=) $1)
                    AND shard_prune_after IS NOT NULL
                 RETURNING id, pg_catalog.pg_wal_lsn_diff(shard_prune_after, '0/0')::bigint",
                None,
                &[task_id.into()],
            )?;
            let mut pending = Vec::new();
            for row in rows {
                if let (Some(id), Some(lsn)) = (row.get::<i64>(1)?, row.get::<i64>(2)?) {
                    pending.push((id, lsn as u64));
                }
            }
            Ok(pending)
        })
    })
}

/// The documents that moved away from this shard row are deleted.
pub fn prune_done(task_id: i64) -> CatalogResult<()> {
    as_catalog_owner(|| {
        Spi::run_with_args(
            "UPDATE meili_sync.tasks SET shard_prune_after = NULL WHERE id OPERATOR(pg_catalog.=) $1",
            &[task_id.into()],
        )?;
        Ok(())
    })
}

/// `UPDATE meili_sync.tasks SET <set>` on the task and on its replicas' rows (parameters `$2`...
/// are `args`); returns their ids.
fn update_task_and_replicas(
    task_id: i64,
    set: &str,
    args: Vec<pgrx::datum::DatumWithOid<'_>>,
) -> CatalogResult<Vec<i64>> {
    let mut all = vec![task_id.into()];
    all.extend(args);
    Spi::connect_mut(|client| {
        let rows = client.update(
            &update_in_id_order_sql(
                "t",
                set,
                "t.id OPERATOR(pg_catalog.=) $1 OR t.replica_of OPERATOR(pg_catalog.=) $1",
                "RETURNING t.id",
            ),
            None,
            &all,
        )?;
        Ok(ids_of(rows)?)
    })
}

/// The rows of a task's other replicas (none for a task without `replicas`, and for a replica's
/// own row), in the order they were added.
pub fn replicas_of(task_id: i64) -> CatalogResult<Vec<TaskRecord>> {
    let ids = Spi::connect(|client| {
        let rows = client.select(
            "SELECT id FROM meili_sync.tasks WHERE replica_of OPERATOR(pg_catalog.=) $1 ORDER BY id",
            None,
            &[task_id.into()],
        )?;
        ids_of(rows)
    })?;
    let mut replicas = Vec::with_capacity(ids.len());
    for id in ids {
        replicas.extend(load_task(id)?);
    }
    Ok(replicas)
}

/// The shards of the task whose own row is `task_id`: each one's name, URL and the key a
/// federated search through another shard uses on it (its search key, else its key).
pub fn shard_servers(task_id: i64) -> CatalogResult<Vec<(String, String, Option<String>)>> {
    Spi::connect(|client| {
        let rows = client.select(
            "SELECT t.shard, t.url, coalesce(s.search_api_key, s.api_key)
               FROM meili_sync.tasks t LEFT JOIN meili_sync.task_secrets s ON s.task_id OPERATOR(pg_catalog.=) t.id
              WHERE (t.id OPERATOR(pg_catalog.=) $1 OR t.replica_of OPERATOR(pg_catalog.=) $1)
                AND t.shard IS NOT NULL
              ORDER BY t.id",
            None,
            &[task_id.into()],
        )?;
        let mut shards = Vec::new();
        for row in rows {
            if let (Some(name), Some(url)) = (row.get::<String>(1)?, row.get::<String>(2)?) {
                shards.push((name, url, row.get::<String>(3)?));
            }
        }
        Ok(shards)
    })
}

/// Writes the task's new generation into the WAL, in the transaction that changed it: a decoder
/// that reads it stops taking the task's changes exactly at this transaction's commit
/// (`state_change`), whenever the launcher gets to the worker.
fn announce_state_change(task_id: i64) -> CatalogResult<()> {
    let generation = select_one::<i32>(
        "SELECT generation FROM meili_sync.tasks WHERE id OPERATOR(pg_catalog.=) $1",
        &[task_id.into()],
    )?
    .unwrap_or(0);
    announce_generation(task_id, i64::from(generation))
}

/// The shape recorded for a view task whose stream did not follow some tables its view reads for
/// a while (the view was replaced to read them): it equals no source's shape, so the launcher
/// brings the index in line as after any change of shape (`show_tasks_out_of_shape`).
const SHAPE_OF_UNFOLLOWED_CHANGES: &str = "changes of tables the view reads were not followed";

/// A view task's stream found its view reading tables its plan does not follow: at this
/// transaction's commit its stream stops and starts again with a plan that follows them (a new
/// generation, announced in the WAL), and the task is out of shape, since their changes before
/// were not followed. False when the task has another generation already.
pub fn follow_new_tables(task_id: i64, generation: i32) -> CatalogResult<bool> {
    let bumped = Spi::connect_mut(|client| {
        let rows = client.update(
            "UPDATE meili_sync.tasks SET generation = generation + 1, shape = $3, shape_through = NULL
              WHERE id OPERATOR(pg_catalog.=) $1 AND generation OPERATOR(pg_catalog.=) $2
             RETURNING id",
            None,
            &[
                task_id.into(),
                generation.into(),
                SHAPE_OF_UNFOLLOWED_CHANGES.into(),
            ],
        )?;
        ids_of(rows)
    })?;
    if bumped.is_empty() {
        return Ok(false);
    }
    announce_state_change(task_id)?;
    Ok(true)
}

/// A view task's worker published tables its view reads that the task did not follow: the task
/// is out of shape (see `follow_new_tables`).
pub fn note_unfollowed_changes(task_id: i64) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET shape = $2, shape_through = NULL WHERE id OPERATOR(pg_catalog.=) $1",
        &[task_id.into(), SHAPE_OF_UNFOLLOWED_CHANGES.into()],
    )?;
    Ok(())
}

fn announce_generation(task_id: i64, generation: i64) -> CatalogResult<()> {
    Spi::run_with_args(
        "SELECT pg_catalog.pg_logical_emit_message(true, $1::pg_catalog.text, $2::pg_catalog.text)",
        &[
            state_change::PREFIX.into(),
            state_change::content(task_id, generation).into(),
        ],
    )?;
    Ok(())
}

/// Stores changed options (and URL, and key when given) and restarts the task's worker.
pub fn alter_task(
    task_id: i64,
    url: &str,
    api_key: Option<&str>,
    search_api_key: Option<&str>,
    options: serde_json::Value,
) -> CatalogResult<()> {
    let options_for_replicas = options.clone();
    as_catalog_owner(|| {
        Spi::connect_mut(|client| {
            client.update(
            "UPDATE meili_sync.tasks SET url = $2, options = $3, generation = generation + 1 WHERE id OPERATOR(pg_catalog.=) $1",
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
            if let Some(key) = search_api_key {
                client.update(
                    "INSERT INTO meili_sync.task_secrets (task_id, search_api_key) VALUES ($1, $2)
                 ON CONFLICT (task_id) DO UPDATE SET search_api_key = EXCLUDED.search_api_key",
                    None,
                    &[task_id.into(), key.into()],
                )?;
            }
            Ok::<(), pgrx::spi::Error>(())
        })?;
        announce_state_change(task_id)?;
        // A replica writes what its task writes: the same options, restarted with them.
        let replicas = Spi::connect_mut(|client| {
            let rows = client.update(
                "UPDATE meili_sync.tasks SET options = $2, generation = generation + 1
                  WHERE replica_of OPERATOR(pg_catalog.=) $1 RETURNING id",
                None,
                &[task_id.into(), JsonB(options_for_replicas).into()],
            )?;
            ids_of(rows)
        })?;
        for replica in &replicas {
            // The task's search key is every replica's (Meilisearch derives a key from its uid and the
            // master key, so servers with one master key can share it).
            if let Some(key) = search_api_key {
                Spi::run_with_args(
                    "INSERT INTO meili_sync.task_secrets (task_id, search_api_key) VALUES ($1, $2)
                     ON CONFLICT (task_id) DO UPDATE SET search_api_key = EXCLUDED.search_api_key",
                    &[(*replica).into(), key.into()],
                )?;
            }
            announce_state_change(*replica)?;
        }
        Ok(())
    })
}

/// Sets the key a replica's row writes with.
pub fn set_replica_key(replica_id: i64, api_key: &str) -> CatalogResult<()> {
    as_catalog_owner(|| {
        Spi::run_with_args(
            "INSERT INTO meili_sync.task_secrets (task_id, api_key) VALUES ($1, $2)
             ON CONFLICT (task_id) DO UPDATE SET api_key = EXCLUDED.api_key",
            &[replica_id.into(), api_key.into()],
        )?;
        Ok(())
    })
}

/// Resumes the task, and those of its replicas that are paused, stopped or failed (a replica
/// that streams keeps its worker). On a replica's row: that replica alone.
pub fn resume(task_id: i64) -> CatalogResult<()> {
    as_catalog_owner(|| {
        Spi::run_with_args(
            "UPDATE meili_sync.tasks
                SET state = CASE WHEN snapshot_finished_at IS NULL THEN 'snapshot' ELSE 'streaming' END,
                    generation = generation + 1, last_error = NULL, last_error_at = NULL
              WHERE id OPERATOR(pg_catalog.=) $1
                 OR (replica_of OPERATOR(pg_catalog.=) $1
                     AND state OPERATOR(pg_catalog.=) ANY ('{paused,stopped,error}'::pg_catalog.text[]))",
            &[task_id.into()],
        )?;
        Ok(())
    })
}

/// Copies the task and its replicas again (on a replica's row: that replica alone).
pub fn reset_snapshot(task_id: i64) -> CatalogResult<()> {
    as_catalog_owner(|| {
        let changed = update_task_and_replicas(
            task_id,
            "state = 'snapshot', generation = generation + 1, snapshot_key = NULL, rows_copied = 0,
             stream_position = NULL, partitions = NULL,
             snapshot_started_at = NULL, snapshot_finished_at = NULL, shape = NULL, shape_through = NULL,
             last_error = NULL, last_error_at = NULL",
            Vec::new(),
        )?;
        changed.into_iter().try_for_each(announce_state_change)
    })
}

/// Whether the task is still at `generation`, holding its row (FOR SHARE) until the end of the
/// transaction: what a worker makes for the task then cannot outlive a drop or an alter that
/// commits meanwhile (the drop waits, and then finds what was made).
pub fn hold_task_at(task_id: i64, generation: i32) -> CatalogResult<bool> {
    // A locking read is not read-only.
    let held = Spi::connect_mut(|client| {
        let rows = client.update(
            "SELECT 1 FROM meili_sync.tasks
              WHERE id OPERATOR(pg_catalog.=) $1 AND generation OPERATOR(pg_catalog.=) $2
                FOR SHARE",
            None,
            &[task_id.into(), generation.into()],
        )?;
        Ok::<_, pgrx::spi::SpiError>(rows.len())
    })?;
    Ok(held > 0)
}

/// Locks the rows of the task, of its replicas or shards and of their resync helpers, in the
/// order of their ids (as `update_in_id_order_sql` does), before a drop deletes them one by one.
pub fn lock_task_rows(task_id: i64) -> CatalogResult<()> {
    as_catalog_owner(|| {
        Spi::run_with_args(
            "SELECT t.id FROM meili_sync.tasks t
              WHERE t.id OPERATOR(pg_catalog.=) $1 OR t.replica_of OPERATOR(pg_catalog.=) $1
                 OR t.resync_of OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT f.id FROM meili_sync.tasks f
                                     WHERE f.id OPERATOR(pg_catalog.=) $1 OR f.replica_of OPERATOR(pg_catalog.=) $1))
              ORDER BY t.id FOR UPDATE OF t",
            &[task_id.into()],
        )?;
        Ok(())
    })
}

/// Deletes the task, and first its replicas' rows: each stream of each ends at this commit.
pub fn delete_task(task: &TaskRecord) -> CatalogResult<()> {
    lock_task_rows(task.id)?;
    for replica in replicas_of(task.id)? {
        delete_task(&replica)?;
    }
    as_catalog_owner(|| {
        let deleted = Spi::connect_mut(|client| {
            // The shared publication stays: the shared decoder stops publishing the table.
            if !task.shared || task.moving {
                client.update(
                    &format!(
                        "DROP PUBLICATION IF EXISTS {}",
                        quote_identifier(&task.publication_name)
                    ),
                    None,
                    &[],
                )?;
            }
            client
                .update(
                    "DELETE FROM meili_sync.tasks WHERE id OPERATOR(pg_catalog.=) $1 RETURNING generation",
                    None,
                    &[task.id.into()],
                )?
                .first()
                .get::<i32>(1)
        })?;
        if !task.shared || task.moving {
            super::replication::forget_publication(&task.publication_name)?;
        }
        // A generation no stream runs: every stream of the task ends at this commit.
        match deleted {
            Some(generation) => announce_generation(task.id, i64::from(generation) + 1),
            None => Ok(()),
        }
    })
}

/// The copy begins (a resumed copy keeps its first start, and the partitions it began with: its
/// stream brings in what was attached or detached since).
pub fn mark_snapshot_started(task_id: i64, partitions: Option<&[u32]>) -> CatalogResult<()> {
    let partitions: Option<Vec<pg_sys::Oid>> =
        partitions.map(|leaves| leaves.iter().copied().map(pg_sys::Oid::from).collect());
    // The shape the documents are copied in: kept by a resumed copy, whose first rows may have
    // gone in the shape of its first start.
    Spi::run_with_args(
        &format!(
            "UPDATE meili_sync.tasks t
                SET snapshot_started_at = coalesce(t.snapshot_started_at, pg_catalog.now()),
                    partitions = coalesce(t.partitions, $2),
                    shape = coalesce(t.shape, {}),
                    shape_through = CASE WHEN t.shape IS NULL THEN {LAST_COLUMN_SQL} ELSE t.shape_through END
              WHERE t.id OPERATOR(pg_catalog.=) $1",
            source_shape_sql(None)
        ),
        &[task_id.into(), partitions.into()],
    )?;
    Ok(())
}

/// The leaf partitions the task's index is now in line with.
pub fn save_partitions(task_id: i64, partitions: &[u32]) -> CatalogResult<()> {
    let partitions: Vec<pg_sys::Oid> = partitions.iter().copied().map(pg_sys::Oid::from).collect();
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET partitions = $2 WHERE id OPERATOR(pg_catalog.=) $1",
        &[task_id.into(), partitions.into()],
    )?;
    Ok(())
}

pub fn save_snapshot_progress(task_id: i64, key: &[String], rows_copied: i64) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks
            SET snapshot_key = $2, rows_copied = $3, snapshot_started_at = coalesce(snapshot_started_at, pg_catalog.now())
          WHERE id OPERATOR(pg_catalog.=) $1",
        &[task_id.into(), key.to_vec().into(), rows_copied.into()],
    )?;
    Ok(())
}

pub fn finish_snapshot(task_id: i64, rows_copied: i64) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks
            SET state = 'streaming', rows_copied = $2, snapshot_started_at = coalesce(snapshot_started_at, pg_catalog.now()),
                snapshot_finished_at = pg_catalog.now()
          WHERE id OPERATOR(pg_catalog.=) $1 AND state OPERATOR(pg_catalog.=) 'snapshot'",
        &[task_id.into(), rows_copied.into()],
    )?;
    Ok(())
}

pub fn set_error_state(task_id: i64, message: &str) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET state = 'error', last_error = $2, last_error_at = pg_catalog.now() WHERE id OPERATOR(pg_catalog.=) $1",
        &[task_id.into(), message.into()],
    )?;
    Ok(())
}

/// Each task row (resync helpers' and replicas' too) keeps a slot of shared memory for its live
/// state and counters: room for `adding` more rows within `meili_sync.max_tasks`.
pub fn require_task_room(adding: usize) -> Result<(), SyncError> {
    let limit = crate::gucs::max_tasks();
    // The other databases' tasks that have run since the server started hold entries too.
    let elsewhere = crate::shmem::live::entries_of_other_databases() as i64;
    if task_count()? + elsewhere + adding as i64 <= limit as i64 {
        return Ok(());
    }
    Err(SyncError::new(
        ErrorKind::Limit,
        format!("there are already {limit} meili_sync tasks in this cluster's databases, as many as meili_sync.max_tasks allows"),
    )
    .hint("Drop tasks you no longer need, or raise meili_sync.max_tasks (and max_worker_processes) in postgresql.conf and restart the server."))
}

pub fn task_count() -> CatalogResult<i64> {
    Ok(select_one::<i64>("SELECT pg_catalog.count(*) FROM meili_sync.tasks", &[])?.unwrap_or(0))
}

/// The resync helper of a task, if one is running.
pub fn resync_helper(task_id: i64) -> CatalogResult<Option<i64>> {
    select_one::<i64>(
        "SELECT id FROM meili_sync.tasks WHERE resync_of OPERATOR(pg_catalog.=) $1",
        &[task_id.into()],
    )
}

/// The confirmed positions of these task rows as the catalog keeps them (the stored position in
/// the shared pass, else the slot's), read as the catalog's owner: for a search after a
/// `meili_sync_wait` when no worker has published one yet (a worker that just restarted).
pub fn stored_positions(task_ids: &[i64]) -> CatalogResult<Vec<(i64, u64)>> {
    as_catalog_owner(|| {
        Spi::connect(|client| {
            let rows = client.select(
                &format!(
                    "SELECT t.id, pg_catalog.pg_wal_lsn_diff(coalesce(t.stream_position, s.confirmed_flush_lsn), '0/0')::bigint
                       FROM meili_sync.tasks t
                       LEFT JOIN pg_catalog.pg_replication_slots s ON s.slot_name OPERATOR(pg_catalog.=) {OBJECT_NAME_SQL}
                      WHERE t.id OPERATOR(pg_catalog.=) ANY ($1)"
                ),
                None,
                &[task_ids.to_vec().into()],
            )?;
            let mut positions = Vec::new();
            for row in rows {
                if let (Some(id), Some(lsn)) = (row.get::<i64>(1)?, row.get::<i64>(2)?) {
                    positions.push((id, lsn as u64));
                }
            }
            Ok(positions)
        })
    })
}

/// What a resync helper needs to know of the task it rebuilds before swapping: its state, and
/// whether a worker still holds its slot and how far that slot is confirmed.
pub struct HeldTask {
    pub state: TaskState,
    pub slot_active: bool,
    /// For a task of the shared decoding pass: its stored position (whether the shared decoder
    /// still streams it is in shared memory, not in the slot).
    pub confirmed: Option<u64>,
    pub shared: bool,
}

pub fn held_task(task_id: i64) -> CatalogResult<Option<HeldTask>> {
    Spi::connect(|client| {
        let mut rows = client.select(
            &format!(
                "SELECT t.state, coalesce(s.active, false),
                        pg_catalog.pg_wal_lsn_diff(coalesce(t.stream_position, s.confirmed_flush_lsn), '0/0')::bigint,
                        {SHARED_TASK_SQL}
                   FROM meili_sync.tasks t
                   LEFT JOIN pg_catalog.pg_replication_slots s ON s.slot_name OPERATOR(pg_catalog.=) {OBJECT_NAME_SQL}
                  WHERE t.id OPERATOR(pg_catalog.=) $1"
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
            shared: row.get(4)?.unwrap_or(false),
        }))
    })
}

/// Holds a streaming task for the swap of its index: the launcher stops its worker.
pub fn hold_for_swap(task_id: i64) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET state = 'swapping', generation = generation + 1
          WHERE id OPERATOR(pg_catalog.=) $1 AND state OPERATOR(pg_catalog.=) 'streaming'",
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
          WHERE id OPERATOR(pg_catalog.=) $1",
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
pub fn finish_swap(helper_id: i64, task: &TaskRecord, lsn: u64) -> CatalogResult<()> {
    let position = format_lsn(lsn);
    if task.shared {
        // The shared slot serves other tasks too: only the task's own position moves.
        Spi::run_with_args(
            "UPDATE meili_sync.tasks SET stream_position = GREATEST(stream_position, $2::text::pg_catalog.pg_lsn)
              WHERE id OPERATOR(pg_catalog.=) $1",
            &[task.id.into(), position.into()],
        )?;
    } else {
        select_one::<String>(
            "SELECT pg_catalog.pg_replication_slot_advance(slot_name, $2::text::pg_lsn)::text
               FROM pg_catalog.pg_replication_slots
              WHERE slot_name OPERATOR(pg_catalog.=) $1 AND confirmed_flush_lsn OPERATOR(pg_catalog.<) $2::text::pg_lsn",
            &[task.slot_name.as_str().into(), position.into()],
        )?;
    }
    let task_id = task.id;
    // The index now holds the helper's documents, in the shape the helper copied them in.
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET state = 'streaming', generation = generation + 1,
                (shape, shape_through) = (SELECT h.shape, h.shape_through FROM meili_sync.tasks h WHERE h.id OPERATOR(pg_catalog.=) $2)
          WHERE id OPERATOR(pg_catalog.=) $1 AND state OPERATOR(pg_catalog.=) 'swapping'",
        &[task_id.into(), helper_id.into()],
    )?;
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET resync_phase = 'swapped' WHERE id OPERATOR(pg_catalog.=) $1",
        &[helper_id.into()],
    )?;
    Ok(())
}

/// Tasks held for a swap whose helper is gone or no longer running (dropped, stopped, failed)
/// stream on; returns their ids.
pub fn release_held_tasks() -> CatalogResult<Vec<i64>> {
    update_tasks_where(
        "m",
        "m.state OPERATOR(pg_catalog.=) 'swapping'
            AND NOT EXISTS (SELECT 1 FROM meili_sync.tasks r
                             WHERE r.resync_of OPERATOR(pg_catalog.=) m.id AND r.state OPERATOR(pg_catalog.=) ANY ('{snapshot,streaming}'::pg_catalog.text[]))",
        "state = 'streaming', generation = generation + 1",
    )
}

/// `UPDATE meili_sync.tasks <alias> SET <set> WHERE <condition>`, returning the ids. Asks
/// read-only first: the launcher asks every round and must not burn an xid each time.
fn update_tasks_where(alias: &str, condition: &str, set: &str) -> CatalogResult<Vec<i64>> {
    let any = select_one::<bool>(
        &format!("SELECT EXISTS (SELECT 1 FROM meili_sync.tasks {alias} WHERE {condition})"),
        &[],
    )?;
    if any != Some(true) {
        return Ok(Vec::new());
    }
    Spi::connect_mut(|client| {
        let rows = client.update(
            &update_in_id_order_sql(alias, set, condition, &format!("RETURNING {alias}.id")),
            None,
            &[],
        )?;
        Ok(ids_of(rows)?)
    })
}

/// Stops, in state `error`, every task whose table or view was dropped (a `regclass` column does
/// not depend on what it names), with a `last_error` that says so; returns their ids. The
/// launcher asks every round, and the shared decoder before it publishes, so a dropped table
/// fails its own task, never the shared pass.
pub fn fail_tasks_of_dropped_sources() -> CatalogResult<Vec<i64>> {
    update_tasks_where(
        "t",
        "t.state OPERATOR(pg_catalog.<>) 'error'
            AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class c
                             WHERE c.oid OPERATOR(pg_catalog.=) t.source::pg_catalog.oid)",
        "state = 'error', last_error_at = pg_catalog.now(),
         last_error = pg_catalog.format('the table or view this task synced (OID %s) was dropped, so nothing reaches index \"%s\" any more; run SELECT meili_sync_drop(%s) to remove the task, with drop_index => true to delete the index too', t.source::pg_catalog.oid, t.index_uid, t.id)",
    )
}

/// How a task's `last_error` begins while its documents are not all in its source's shape.
const OUT_OF_SHAPE: &str = "out of shape";

/// How it begins while its stream sends the columns added to its table (`columns_added_sql`).
const ADDING_COLUMNS: &str = "adding columns";

/// Compares each task's source with the shape its documents were copied in (`tasks.shape`):
/// a task whose source changed shape since (a column added, dropped, renamed or retyped, an enum
/// value renamed, a view replaced) shows it in its `last_error`, with the call that brings every
/// document in line, or that its stream sends the columns added; the ids of the tasks newly
/// shown out of shape are returned. A task back in shape (after a resync, the columns added sent, or the DDL
/// undone) no longer shows it. A task of an earlier version that has no shape recorded gets its
/// source's shape of now. The launcher asks every round.
pub fn show_tasks_out_of_shape() -> CatalogResult<Vec<i64>> {
    let shape = source_shape_sql(None);
    update_tasks_where(
        "t",
        "t.shape IS NULL AND t.snapshot_started_at IS NOT NULL",
        &format!("shape = {shape}, shape_through = {LAST_COLUMN_SQL}"),
    )?;
    let shown = format!(
        "CASE WHEN {columns_added}
              THEN pg_catalog.format('{ADDING_COLUMNS}: %s were added to %s since its documents were copied; the task sends their values to every document as partial updates once Meilisearch has what it read before, and the server log says when it is done',
                       (SELECT pg_catalog.string_agg(pg_catalog.quote_ident(a.attname), ', ' ORDER BY a.attnum) FROM pg_catalog.pg_attribute a
                         WHERE a.attrelid OPERATOR(pg_catalog.=) t.source::pg_catalog.oid AND a.attnum OPERATOR(pg_catalog.>) t.shape_through
                           AND NOT a.attisdropped AND {SENT_COLUMN_SQL}),
                       t.source)
              ELSE pg_catalog.format('{OUT_OF_SHAPE}: the columns of %s changed since its documents were copied (a column added, dropped, renamed or retyped, an enum value renamed, or the view replaced); documents of rows that have not changed since keep their old fields, a dropped column''s values included. %s',
             t.source,
             CASE WHEN t.options OPERATOR(pg_catalog.->>) 'schema_changes' OPERATOR(pg_catalog.=) 'report'
                  THEN pg_catalog.format('Run SELECT meili_sync_resync(%s) to rebuild the index in the new shape while the task streams on (its option \"schema_changes\" is \"report\")', coalesce(t.replica_of, t.id))
                  ELSE pg_catalog.format('A resync rebuilds the index in the new shape while the task streams on (meili_sync_status shows its helper); if none starts, the server log says why, and SELECT meili_sync_resync(%s) asks again', coalesce(t.replica_of, t.id)) END) END",
        columns_added = columns_added_sql()
    );
    update_tasks_where(
        "t",
        &format!(
            "t.resync_of IS NULL AND t.shape IS NOT NULL
             AND t.state OPERATOR(pg_catalog.=) ANY ('{{snapshot,streaming,swapping}}'::pg_catalog.text[])
             AND EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) t.source::pg_catalog.oid)
             AND t.shape OPERATOR(pg_catalog.<>) {shape}
             AND (t.last_error IS NULL OR t.last_error OPERATOR(pg_catalog.<>) {shown})"
        ),
        &format!("last_error = {shown}, last_error_at = pg_catalog.now()"),
    )
    .and_then(|shown_now| {
        update_tasks_where(
            "t",
            &format!(
                "(pg_catalog.starts_with(t.last_error, '{OUT_OF_SHAPE}') OR pg_catalog.starts_with(t.last_error, '{ADDING_COLUMNS}'))
                 AND (t.state OPERATOR(pg_catalog.<>) ALL ('{{snapshot,streaming,swapping}}'::pg_catalog.text[])
                      OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) t.source::pg_catalog.oid)
                      OR t.shape OPERATOR(pg_catalog.=) {shape})"
            ),
            "last_error = NULL, last_error_at = NULL",
        )?;
        // Columns added are the stream's to send, and it logs them.
        Spi::connect(|client| {
            let rows = client.select(
                &format!(
                    "SELECT t.id FROM meili_sync.tasks t
                      WHERE t.id OPERATOR(pg_catalog.=) ANY ($1)
                        AND pg_catalog.starts_with(t.last_error, '{OUT_OF_SHAPE}')
                      ORDER BY t.id"
                ),
                None,
                &[shown_now.into()],
            )?;
            Ok(ids_of(rows)?)
        })
    })
}

/// The tasks out of shape that resync on their own (`"schema_changes"` other than `"report"`):
/// a streaming task (not a replica's or shard's row: its resync rebuilds every server) whose
/// source changed shape other than by columns added (which its stream sends), or one of whose
/// rows shows it, and that no resync rebuilds yet.
pub fn tasks_to_resync_for_their_shape() -> CatalogResult<Vec<i64>> {
    Spi::connect(|client| {
        let rows = client.select(
            &format!(
                "SELECT t.id FROM meili_sync.tasks t
                  WHERE t.replica_of IS NULL AND t.resync_of IS NULL
                    AND t.state OPERATOR(pg_catalog.=) 'streaming'
                    AND coalesce(t.options OPERATOR(pg_catalog.->>) 'schema_changes', '') OPERATOR(pg_catalog.<>) 'report'
                    AND EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) t.source::pg_catalog.oid)
                    AND ((t.shape OPERATOR(pg_catalog.<>) {shape} AND NOT {columns_added})
                         OR EXISTS (SELECT 1 FROM meili_sync.tasks m
                                     WHERE m.replica_of OPERATOR(pg_catalog.=) t.id
                                       AND pg_catalog.starts_with(m.last_error, '{OUT_OF_SHAPE}')))
                    AND NOT EXISTS (SELECT 1 FROM meili_sync.tasks h JOIN meili_sync.tasks m ON h.resync_of OPERATOR(pg_catalog.=) m.id
                                     WHERE m.id OPERATOR(pg_catalog.=) t.id OR m.replica_of OPERATOR(pg_catalog.=) t.id)
                  ORDER BY t.id",
                shape = source_shape_sql(None),
                columns_added = columns_added_sql()
            ),
            None,
            &[],
        )?;
        Ok(ids_of(rows)?)
    })
}

/// The columns added to a table task's table since its documents were copied, when that is the
/// only change of its shape (`columns_added_sql`), for its stream to send.
pub struct ColumnsAdded {
    /// The shape recorded, and the source's now, with its highest column number.
    pub from_shape: String,
    pub shape: String,
    pub through: i16,
    /// The columns added that the task sends, in column order.
    pub columns: Vec<String>,
}

pub fn columns_added(task_id: i64) -> CatalogResult<Option<ColumnsAdded>> {
    Spi::connect(|client| {
        let rows = client.select(
            &format!(
                "SELECT t.shape, {shape}, {LAST_COLUMN_SQL},
                        ARRAY(SELECT a.attname::pg_catalog.text FROM pg_catalog.pg_attribute a
                               WHERE a.attrelid OPERATOR(pg_catalog.=) t.source::pg_catalog.oid
                                 AND a.attnum OPERATOR(pg_catalog.>) t.shape_through
                                 AND NOT a.attisdropped AND {SENT_COLUMN_SQL}
                               ORDER BY a.attnum)
                   FROM meili_sync.tasks t
                  WHERE t.id OPERATOR(pg_catalog.=) $1 AND {columns_added}",
                shape = source_shape_sql(None),
                columns_added = columns_added_sql()
            ),
            Some(1),
            &[task_id.into()],
        )?;
        let Some(row) = rows.into_iter().next() else {
            return Ok(None);
        };
        let (Some(from_shape), Some(shape), Some(through)) = (
            row.get::<String>(1)?,
            row.get::<String>(2)?,
            row.get::<i16>(3)?,
        ) else {
            return Ok(None);
        };
        let columns: Vec<String> =
            names_from(row.get::<Vec<Option<String>>>(4)?).unwrap_or_default();
        Ok(Some(ColumnsAdded {
            from_shape,
            shape,
            through,
            columns,
        }))
    })
}

/// Records that the task's documents have the columns added (`columns_added`): its shape is the
/// source's of then, unless something else recorded another meanwhile (a resync's swap).
pub fn record_columns_added(task_id: i64, added: &ColumnsAdded) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET shape = $3, shape_through = $4
          WHERE id OPERATOR(pg_catalog.=) $1 AND shape OPERATOR(pg_catalog.=) $2",
        &[
            task_id.into(),
            added.from_shape.clone().into(),
            added.shape.clone().into(),
            added.through.into(),
        ],
    )?;
    Ok(())
}

pub fn list_tasks() -> CatalogResult<Vec<TaskSummary>> {
    Spi::connect(|client| {
        let rows = client.select(
            &format!(
                "SELECT t.id, t.state OPERATOR(pg_catalog.=) ANY ('{{snapshot,streaming}}'::pg_catalog.text[])
                        AND NOT ({SHARED_TASK_SQL} AND t.state OPERATOR(pg_catalog.=) 'streaming' AND NOT {OWN_SLOT_SQL}),
                        t.generation, {SHARED_TASK_SQL},
                        t.shard IS NOT NULL AND t.replica_of IS NULL AND t.state OPERATOR(pg_catalog.=) 'streaming' AND (
                            EXISTS (SELECT 1 FROM meili_sync.tasks m
                                     WHERE (m.id OPERATOR(pg_catalog.=) t.id OR m.replica_of OPERATOR(pg_catalog.=) t.id)
                                       AND m.shard_prune_after IS NOT NULL)
                            OR (EXISTS (SELECT 1 FROM meili_sync.tasks m
                                         WHERE m.replica_of OPERATOR(pg_catalog.=) t.id
                                           AND m.shard_names OPERATOR(pg_catalog.<>) t.shard_names)
                                AND NOT EXISTS (SELECT 1 FROM meili_sync.tasks m
                                                 WHERE m.replica_of OPERATOR(pg_catalog.=) t.id
                                                   AND m.shard_names OPERATOR(pg_catalog.<>) t.shard_names
                                                   AND m.snapshot_finished_at IS NULL)))
                   FROM meili_sync.tasks t ORDER BY t.id"
            ),
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
                shared: row.get(4)?.unwrap_or(false),
                rebalancing: row.get(5)?.unwrap_or(false),
            });
        }
        Ok(tasks)
    })
}

/// The task's publication was not as it was left (`check_publication`): its slot, which decoded
/// with it, is dropped, and the task copies its table again (an inactive one when it is resumed),
/// with `message` as its last error. The copy re-sends every row and deletes the documents of
/// rows that are gone.
pub fn copy_again(task_id: i64, slot: &str, message: &str) -> CatalogResult<()> {
    if super::replication::slot_wal_status(slot)?.is_some() {
        super::replication::drop_slot(slot)?;
    }
    Spi::run_with_args(
        &format!(
            "UPDATE meili_sync.tasks t SET {} WHERE t.id OPERATOR(pg_catalog.=) $1",
            copy_again_sql("$2")
        ),
        &[task_id.into(), message.into()],
    )?;
    announce_state_change(task_id)
}

/// Starts the copy over (the slot it relied on was replaced).
pub fn restart_copy(task_id: i64) -> CatalogResult<()> {
    Spi::run_with_args(
        "UPDATE meili_sync.tasks SET snapshot_key = NULL, rows_copied = 0 WHERE id OPERATOR(pg_catalog.=) $1",
        &[task_id.into()],
    )?;
    Ok(())
}
