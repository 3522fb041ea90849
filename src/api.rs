//! The SQL functions: validate, write the catalog, and wake the launcher at COMMIT.

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pgrx::datum::TimestampWithTimeZone;
use pgrx::prelude::*;
use pgrx::{register_xact_callback, JsonB, PgRelation, PgXactCallbackEvent};

use crate::catalog::{self, NewTask, RelationInfo, TaskState};
use crate::encode::{encode_row, ColumnValue, ValueKind};
use crate::error::{ErrorKind, OrRaise, SyncError};
use crate::jsonb::DirectJsonb;
use crate::meili::client::{Client, MeiliError};
use crate::options::{validate_index_uid, TaskOptions};
use crate::worker::resync;
use crate::{gucs, plan, search, security, shmem};

static WAKE_PENDING: AtomicBool = AtomicBool::new(false);

/// Wakes the launcher when this transaction commits, so a new or changed task takes effect at once.
fn wake_launcher_at_commit() {
    if !WAKE_PENDING.swap(true, Ordering::Relaxed) {
        register_xact_callback(PgXactCallbackEvent::Commit, || {
            WAKE_PENDING.store(false, Ordering::Relaxed);
            shmem::wake_launcher();
        });
        register_xact_callback(PgXactCallbackEvent::Abort, || {
            WAKE_PENDING.store(false, Ordering::Relaxed);
        });
    }
}

fn require_admin() -> Result<(), SyncError> {
    if catalog::current_role_is_admin()? {
        Ok(())
    } else {
        Err(SyncError::new(
            ErrorKind::Privilege,
            "permission denied to manage meili_sync tasks",
        )
        .hint("Only superusers and members of the meili_sync_admin role can manage tasks."))
    }
}

/// The caller must be able to read the task's table: these functions copy, compare or re-send
/// its rows, and a task must not be a way around the table's privileges.
fn require_select(record: &catalog::TaskRecord) -> Result<(), SyncError> {
    if catalog::may_select(security::current_role(), record.relid)? {
        return Ok(());
    }
    Err(select_denied(record)?)
}

fn select_denied(record: &catalog::TaskRecord) -> Result<SyncError, SyncError> {
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
fn required<T>(value: Option<T>, name: &str, hint: &str) -> Result<T, SyncError> {
    value.ok_or_else(|| {
        SyncError::new(
            ErrorKind::NullArgument,
            format!("argument \"{name}\" must not be NULL"),
        )
        .hint(hint)
    })
}

const TASK_HINT: &str = "Pass a task id, as listed in the \"task\" column of meili_sync_status.";

fn require_task(task: Option<i64>) -> Result<catalog::TaskRecord, SyncError> {
    catalog::require_task(required(task, "task", TASK_HINT)?)
}

fn require_preloaded() -> Result<(), SyncError> {
    if crate::preloaded() {
        Ok(())
    } else {
        Err(SyncError::new(ErrorKind::Prerequisite, "pg_meili_sync is not loaded by shared_preload_libraries")
            .hint("Add pg_meili_sync to shared_preload_libraries in postgresql.conf and restart the server."))
    }
}

fn require_logical_wal() -> Result<(), SyncError> {
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

/// The launcher runs the tasks of one database only; a task created elsewhere would never run.
fn require_launcher_database() -> Result<(), SyncError> {
    let current = catalog::current_database()?;
    let configured = gucs::database();
    if current == configured {
        Ok(())
    } else {
        Err(SyncError::new(
            ErrorKind::Prerequisite,
            format!("meili_sync tasks run in database \"{configured}\", not in \"{current}\""),
        )
        .hint(format!(
            "Connect to database \"{configured}\", or set meili_sync.database = '{current}' in postgresql.conf and restart the server."
        )))
    }
}

/// Each task (resync helpers too) keeps a slot of shared memory for its live state and counters.
fn require_task_room() -> Result<(), SyncError> {
    let limit = gucs::max_tasks();
    if catalog::task_count()? < limit as i64 {
        return Ok(());
    }
    Err(SyncError::new(
        ErrorKind::Limit,
        format!("there are already {limit} meili_sync tasks, as many as meili_sync.max_tasks allows"),
    )
    .hint("Drop tasks you no longer need, or raise meili_sync.max_tasks (and max_worker_processes) in postgresql.conf and restart the server."))
}

/// Chooses the key columns: the `primary_key` option, else the table's primary key; checks that
/// they identify rows and that the old key of a DELETE will be in the WAL.
fn resolve_key(
    info: &RelationInfo,
    requested: Option<&Vec<String>>,
) -> Result<Vec<String>, SyncError> {
    let table = &info.qualified_name;
    let key = match requested {
        Some(names) => {
            for name in names {
                let column = info.columns.iter().find(|column| &column.name == name).ok_or_else(|| {
                    SyncError::new(
                        ErrorKind::UndefinedColumn,
                        format!("column \"{name}\" of option \"primary_key\" does not exist in table {table}"),
                    )
                    .hint("Name columns of the table, as in its definition.")
                })?;
                if !column.not_null || column.generated {
                    return Err(SyncError::new(
                        ErrorKind::NoKey,
                        format!("key column \"{name}\" of table {table} must be NOT NULL and not generated"),
                    )
                    .hint("Meilisearch needs an id for every document."));
                }
            }
            let mut wanted = names.clone();
            wanted.sort();
            let unique = info.unique_keys.iter().any(|index| {
                let mut columns = index.clone();
                columns.sort();
                columns == wanted
            });
            if !unique {
                return Err(SyncError::new(
                    ErrorKind::NoKey,
                    format!("no unique index of table {table} is on exactly ({})", names.join(", ")),
                )
                .hint("Create a unique index on those columns, or name the columns of an existing one."));
            }
            names.clone()
        }
        None => info.primary_key.clone().ok_or_else(|| {
            SyncError::new(ErrorKind::NoKey, format!("table {table} has no primary key"))
                .hint("Add a primary key, or pass the columns of a unique NOT NULL index as the \"primary_key\" option.")
        })?,
    };
    let mut sorted_key = key.clone();
    sorted_key.sort();
    let identity_covers_key = match info.replica_identity.as_str() {
        "f" => true,
        "d" => info.primary_key.as_ref().is_some_and(|pk| {
            let mut pk = pk.clone();
            pk.sort();
            pk == sorted_key
        }),
        "i" => info.replica_identity_index.as_ref().is_some_and(|index| {
            let mut index = index.clone();
            index.sort();
            index == sorted_key
        }),
        _ => false,
    };
    if !identity_covers_key {
        return Err(SyncError::new(
            ErrorKind::NoKey,
            format!("the replica identity of table {table} does not carry the key ({})", key.join(", ")),
        )
        .detail("Deleted rows are found by their old key, which logical decoding takes from the replica identity.")
        .hint(format!(
            "Run ALTER TABLE {table} REPLICA IDENTITY USING INDEX <unique index on the key>, or REPLICA IDENTITY FULL."
        )));
    }
    for name in &key {
        let Some(column) = info.columns.iter().find(|column| &column.name == name) else {
            continue;
        };
        let kind = catalog::value_kind(column.type_oid)?;
        if matches!(
            kind,
            ValueKind::Json | ValueKind::Float | ValueKind::Array(_)
        ) {
            return Err(SyncError::new(
                ErrorKind::UnsupportedType,
                format!("key column \"{name}\" has type {}, which cannot be a Meilisearch document id", column.type_name),
            )
            .hint("Use an integer, text, uuid, numeric, date or time key, or pass other columns as \"primary_key\"."));
        }
    }
    Ok(key)
}

/// The key of a task's documents and the tables its publication holds: for a table, its key
/// (see `resolve_key`) and itself; for a view, the `primary_key` option (required) and the tables
/// it reads, once `plan::view_plan` found how to follow each.
fn source_plan(
    info: &RelationInfo,
    relid: pg_sys::Oid,
    options: &TaskOptions,
) -> Result<(Vec<String>, Vec<String>), SyncError> {
    if !info.is_view() {
        let key = resolve_key(info, options.primary_key.as_ref())?;
        return Ok((key, vec![info.qualified_name.clone()]));
    }
    let key = options.primary_key.clone().ok_or_else(|| {
        SyncError::new(
            ErrorKind::InvalidParameter,
            format!("option \"primary_key\" is required to sync view {}", info.qualified_name),
        )
        .hint("Name the view's key column or columns, unique by construction: {\"primary_key\": \"id\"}.")
    })?;
    let plan = plan::view_plan(info, relid, &key, options, security::current_role(), true)?;
    Ok((key, plan.published_tables()))
}

/// The `mappings` option as stored: each table by its schema-qualified name, so that workers,
/// whose search_path holds only pg_catalog, find the same tables.
fn stored_mappings(
    info: &RelationInfo,
    relid: pg_sys::Oid,
    key: &[String],
    options: &TaskOptions,
) -> Result<Vec<(String, String)>, SyncError> {
    if !info.is_view() {
        return Ok(Vec::new());
    }
    let plan = plan::view_plan(info, relid, key, options, security::current_role(), false)?;
    Ok(plan
        .mappings
        .into_iter()
        .map(|mapping| (mapping.table, mapping.query))
        .collect())
}

fn check_column_names(
    info: &RelationInfo,
    option: &str,
    names: &[String],
) -> Result<(), SyncError> {
    for name in names {
        if !info.columns.iter().any(|column| &column.name == name) {
            return Err(SyncError::new(
                ErrorKind::UndefinedColumn,
                format!(
                    "column \"{name}\" of option \"{option}\" does not exist in table {}",
                    info.qualified_name
                ),
            )
            .hint("Name columns of the table, as in its definition."));
        }
    }
    Ok(())
}

fn start_task(
    source: &PgRelation,
    index_uid: &str,
    options: &serde_json::Value,
) -> Result<i64, SyncError> {
    require_preloaded()?;
    require_logical_wal()?;
    require_launcher_database()?;
    validate_index_uid(index_uid)?;
    let parsed = TaskOptions::parse(options)?;
    let url = parsed
        .url
        .clone()
        .or_else(gucs::default_url)
        .ok_or_else(|| {
            SyncError::new(ErrorKind::InvalidParameter, "no Meilisearch URL given")
                .hint("Pass {\"url\": \"http://host:7700\"} in the options, or set meili_sync.url.")
        })?;
    crate::options::validate_url(&url)?;
    let url = url.trim_end_matches('/').to_owned();

    let mut parsed = parsed;
    let info = catalog::syncable_source(source.oid(), security::current_role())?;
    if let Some(columns) = &parsed.columns {
        check_column_names(&info, "columns", columns)?;
    }
    check_column_names(&info, "exclude_columns", &parsed.exclude_columns)?;
    let (key, published) = source_plan(&info, source.oid(), &parsed)?;
    if info.is_view() {
        parsed.mappings = stored_mappings(&info, source.oid(), &key, &parsed)?;
    } else if !parsed.mappings.is_empty() {
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!(
                "option \"mappings\" is for views, and {} is a table",
                info.qualified_name
            ),
        )
        .hint("A table's own changes say which documents they affect: leave out \"mappings\"."));
    }
    if let Some(name) = parsed
        .exclude_columns
        .iter()
        .find(|name| key.contains(name))
    {
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!("option \"exclude_columns\" leaves out key column \"{name}\""),
        )
        .hint("The key columns identify each document and are always sent."));
    }
    require_task_room()?;
    refuse_index_in_use(&url, index_uid, None)?;
    let api_key = parsed.api_key.clone().or_else(gucs::default_api_key);
    let id = catalog::insert_task(
        NewTask {
            relid: source.oid(),
            owner: security::current_role(),
            index_uid,
            url: &url,
            api_key: api_key.as_deref(),
            search_api_key: parsed.search_api_key.as_deref(),
            primary_key: &key,
            options: parsed.to_stored_json(),
            resync_of: None,
        },
        &published,
    )?;
    wake_launcher_at_commit();
    Ok(id)
}

/// One index, one task: a second task writing into an index at the same URL would mix two
/// tables' documents, and a TRUNCATE of either would delete the other's.
fn refuse_index_in_use(
    url: &str,
    index_uid: &str,
    this_task: Option<i64>,
) -> Result<(), SyncError> {
    let Some((existing, table)) = catalog::index_owner_task(url, index_uid)? else {
        return Ok(());
    };
    if Some(existing) == this_task {
        return Ok(());
    }
    Err(SyncError::new(
        ErrorKind::DuplicateTask,
        format!("task {existing} already syncs {table} into index \"{index_uid}\" at {url}"),
    )
    .detail("An index holds the documents of one task: a TRUNCATE of either table would delete the other's documents.")
    .hint(format!("Pick another index uid; to copy {table} again use meili_sync_snapshot({existing}), or meili_sync_drop({existing}) first.")))
}

/// A task with a slot of its own moves into the shared decoding pass when altered to
/// `"decoding": "shared"`: its worker hands over once the shared slot holds its changes. The way
/// back has no such hand-over: a new slot of its own would start at the present and skip what the
/// shared slot still holds for the task.
fn refuse_leaving_shared_decoding(
    record: &catalog::TaskRecord,
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

/// A task moving into the shared decoding pass streams from its own slot for a moment more; a
/// resync waits until it has moved.
fn refuse_while_moving(record: &catalog::TaskRecord) -> Result<(), SyncError> {
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

/// A task held for the swap of its resync changes only through the helper, for a moment.
fn refuse_while_swapping(record: &catalog::TaskRecord) -> Result<(), SyncError> {
    if record.state != TaskState::Swapping {
        return Ok(());
    }
    let helper = catalog::resync_helper(record.id)?.unwrap_or_default();
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

/// Creates a task that copies `source` into the Meilisearch index `index_uid` and keeps it in step.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_start(
    source: Option<PgRelation>,
    index_uid: Option<&str>,
    options: default!(Option<JsonB>, "'{}'"),
) -> i64 {
    let result = (|| {
        require_admin()?;
        let source = required(
            source,
            "source",
            "Pass the table to sync, for example 'products'.",
        )?;
        let index_uid = required(
            index_uid,
            "index_uid",
            "Pass the uid of the Meilisearch index to fill, for example 'products'.",
        )?;
        let options = required(options, "options", "Pass '{}' for the defaults.")?;
        start_task(&source, index_uid, &options.0)
    })();
    result.or_raise()
}

/// The first documents of a table or view, exactly as a task with these options would send them
/// (in key order), to check a view and its options before starting a task. It creates nothing;
/// rows are read with the caller's rights (so row-level security applies).
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_preview(
    source: Option<PgRelation>,
    options: default!(Option<JsonB>, "'{}'"),
    limit: default!(Option<i32>, 5),
) -> SetOfIterator<'static, JsonB> {
    let result = (|| {
        require_admin()?;
        let source = required(
            source,
            "source",
            "Pass the table or view to preview, for example 'products'.",
        )?;
        let options = required(options, "options", "Pass '{}' for the defaults.")?;
        let limit = required(
            limit,
            "limit",
            "Pass how many documents to show, for example 5.",
        )?;
        if !(0..=10_000).contains(&limit) {
            return Err(SyncError::new(
                ErrorKind::InvalidParameter,
                format!("limit {limit} is out of range"),
            )
            .hint("Preview between 0 and 10000 documents."));
        }
        let parsed = TaskOptions::parse(&options.0)?;
        let caller = security::current_role();
        let info = catalog::syncable_source(source.oid(), caller)?;
        if let Some(columns) = &parsed.columns {
            check_column_names(&info, "columns", columns)?;
        }
        check_column_names(&info, "exclude_columns", &parsed.exclude_columns)?;
        let (key, _) = source_plan(&info, source.oid(), &parsed)?;
        catalog::set_output_formats(true)?;
        let plan = plan::source_plan(source.oid(), &key, &parsed)?;
        let width = plan.shape.columns().len();
        // Read as a task reads: as the table's (or view's) owner under
        // SECURITY_RESTRICTED_OPERATION, never as the caller, who may be a superuser and whose
        // SELECT was checked above.
        let rows = security::as_table_owner(plan.table_owner, || {
            catalog::read_page(&plan.first_page_query, None, limit as usize, width)
        })?;
        let mut documents = Vec::with_capacity(rows.len());
        let mut body = Vec::new();
        for row in &rows {
            let values = ColumnValue::row(row);
            body.clear();
            match encode_row(&plan.shape, &values, &mut body) {
                Ok(_) => match serde_json::from_slice(&body) {
                    Ok(document) => documents.push(JsonB(document)),
                    Err(error) => {
                        warning!("pg_meili_sync: a preview document is not JSON: {error}")
                    }
                },
                Err(error) => warning!(
                    "pg_meili_sync: row with key ({}) would be a dead letter: {error} ({})",
                    plan.shape.key_of_row(row).join(", "),
                    error.code()
                ),
            }
        }
        Ok(documents)
    })();
    SetOfIterator::new(result.or_raise())
}

/// A task for any role that may read its table or view (`42501` otherwise): the search functions
/// and `meili_sync_wait` are granted to PUBLIC. The task comes from the backend's cache and the
/// privilege is checked on every call, both without SPI.
fn readable_target(task: Option<i64>) -> Result<Rc<catalog::SearchTarget>, SyncError> {
    let task_id = required(task, "task", TASK_HINT)?;
    let no_task = || {
        SyncError::new(
            ErrorKind::UndefinedTask,
            format!("meili_sync task {task_id} does not exist"),
        )
        .hint("SELECT task FROM meili_sync_status lists the tasks (ask a meili_sync_admin member).")
    };
    let target = catalog::search_target(task_id)?.ok_or_else(no_task)?;
    if catalog::current_role_may_select(target.relid) {
        if let Some(refusal) = &target.refusal {
            return Err(refusal.clone());
        }
        return Ok(target);
    }
    // Admins may read the catalog anyway: their refusal names the table and role. Any other role
    // learns nothing of a table it may not read.
    if catalog::current_role_is_admin()? {
        let record = catalog::load_task_for_search(task_id)?.ok_or_else(no_task)?;
        return Err(select_denied(&record)?);
    }
    Err(SyncError::new(
        ErrorKind::Privilege,
        format!("permission denied for meili_sync task {task_id}"),
    )
    .detail("Searching through a task, or waiting for it, needs SELECT on the table or view it syncs.")
    .hint(format!(
        "Ask a meili_sync_admin member which table task {task_id} syncs, and that table's owner for SELECT on it."
    )))
}

/// The task to search through, for a caller that may read its table (or view), and the
/// backend's client for its URL and key (its `search_api_key` when it has one, never then its
/// `api_key`).
fn search_target(task: Option<i64>) -> Result<(Client, Rc<catalog::SearchTarget>), SyncError> {
    let target = readable_target(task)?;
    let client = search::client(&target.url, target.api_key.as_deref())?;
    Ok((client, target))
}

fn search_options(options: Option<JsonB>) -> Result<serde_json::Value, SyncError> {
    Ok(required(
        options,
        "options",
        "Pass '{}', or Meilisearch search parameters such as '{\"limit\": 10}'.",
    )?
    .0)
}

type HitRows = TableIterator<
    'static,
    (
        name!(id, Option<String>),
        name!(key, Option<Vec<String>>),
        name!(score, Option<f64>),
        name!(document, DirectJsonb),
        name!(formatted, Option<DirectJsonb>),
    ),
>;

/// Searches and returns one row per hit, in Meilisearch's order.
fn hit_rows(
    client: &Client,
    index_uid: &str,
    key_columns: &[String],
    query: Option<&str>,
    options: serde_json::Value,
) -> Result<HitRows, SyncError> {
    let body = crate::meili::search::search_body(query, &options).map_err(|message| {
        SyncError::new(ErrorKind::InvalidParameter, message)
            .hint("For example '{\"limit\": 10, \"filter\": \"price > 10\"}'.")
    })?;
    let answer = search::run(client, index_uid, body)?;
    let hits = crate::meili::search::hits(&answer, search::id_attribute(key_columns))
        .map_err(|message| SyncError::new(ErrorKind::Meilisearch, message))?;
    let key_count = key_columns.len().max(1);
    Ok(TableIterator::new(hits.into_iter().map(move |hit| {
        let key = hit
            .id
            .as_deref()
            .and_then(|id| crate::encode::key_of_id(id, key_count));
        (
            hit.id,
            key,
            hit.score,
            DirectJsonb(hit.document),
            hit.formatted.map(DirectJsonb),
        )
    })))
}

/// Searches the index of a task: one row per hit with the document id, its key values (to join
/// with the table: `key[1]` compares with a one-column key after a cast), the ranking score
/// (with `"showRankingScore": true`), the document, and the highlighted document (with
/// `attributesToHighlight`). Options are Meilisearch's search parameters as they are. Needs
/// SELECT on the task's table.
// pgrx must see the row type in the signature itself (an alias does not resolve in its SQL).
#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_unsafe)]
fn meili_search(
    task: Option<i64>,
    query: Option<&str>,
    options: default!(Option<JsonB>, "'{}'"),
) -> TableIterator<
    'static,
    (
        name!(id, Option<String>),
        name!(key, Option<Vec<String>>),
        name!(score, Option<f64>),
        name!(document, DirectJsonb),
        name!(formatted, Option<DirectJsonb>),
    ),
> {
    let result = (|| {
        let (client, target) = search_target(task)?;
        hit_rows(
            &client,
            &target.index_uid,
            &target.primary_key,
            query,
            search_options(options)?,
        )
    })();
    result.or_raise()
}

/// Searches any index at any URL (one the extension does not sync): only for meili_sync_admin.
/// `id_attribute` names the documents' id field for the `id` and `key` columns. (The result type
/// is spelled out again, not named by an alias: pgrx reads it from the signature to write SQL.)
#[allow(clippy::type_complexity)]
#[pg_extern(name = "meili_search", volatile, parallel_unsafe)]
fn meili_search_index(
    url: Option<&str>,
    index_uid: Option<&str>,
    query: Option<&str>,
    options: default!(Option<JsonB>, "'{}'"),
    api_key: default!(Option<&str>, "NULL"),
    id_attribute: default!(Option<&str>, "'id'"),
) -> TableIterator<
    'static,
    (
        name!(id, Option<String>),
        name!(key, Option<Vec<String>>),
        name!(score, Option<f64>),
        name!(document, DirectJsonb),
        name!(formatted, Option<DirectJsonb>),
    ),
> {
    let result = (|| {
        require_admin()?;
        let url = required(
            url,
            "url",
            "Pass the Meilisearch URL, for example 'http://127.0.0.1:7700'.",
        )?;
        crate::options::validate_url(url)?;
        let index_uid = required(
            index_uid,
            "index_uid",
            "Pass the uid of the index to search.",
        )?;
        validate_index_uid(index_uid)?;
        let id_attribute = required(
            id_attribute,
            "id_attribute",
            "Pass the documents' id field, for example 'id'.",
        )?;
        let client = search::client(url.trim_end_matches('/'), api_key)?;
        hit_rows(
            &client,
            index_uid,
            &[id_attribute.to_owned()],
            query,
            search_options(options)?,
        )
    })();
    result.or_raise()
}

/// The facet distribution of a search of a task's index, one row per facet value. The facets
/// must be filterable in the index (`settings`). Needs SELECT on the task's table.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_facets(
    task: Option<i64>,
    query: Option<&str>,
    facets: Option<Vec<String>>,
    options: default!(Option<JsonB>, "'{}'"),
) -> TableIterator<
    'static,
    (
        name!(facet, String),
        name!(value, String),
        name!(count, i64),
    ),
> {
    let result = (|| {
        let (client, target) = search_target(task)?;
        let facets = required(
            facets,
            "facets",
            "Pass the facets to count, for example ARRAY['category'].",
        )?;
        let mut options = search_options(options)?;
        if let Some(object) = options.as_object_mut() {
            object.insert("facets".into(), serde_json::Value::from(facets));
            object
                .entry("limit")
                .or_insert_with(|| serde_json::Value::from(0));
        }
        let body = crate::meili::search::search_body(query, &options)
            .map_err(|message| SyncError::new(ErrorKind::InvalidParameter, message))?;
        let answer = search::run(&client, &target.index_uid, body)?;
        Ok(TableIterator::new(crate::meili::search::facet_counts(
            &answer,
        )))
    })();
    result.or_raise()
}

/// A search request passed through as it is (`POST /indexes/<uid>/search` with `body`), and
/// Meilisearch's whole answer: for what the other functions do not cover. Needs SELECT on the
/// task's table.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_search_raw(task: Option<i64>, body: Option<JsonB>) -> DirectJsonb {
    let result = (|| {
        let (client, target) = search_target(task)?;
        let body = required(
            body,
            "body",
            "Pass a search request, for example '{\"q\": \"kettle\"}'.",
        )?;
        Ok(DirectJsonb(search::run(
            &client,
            &target.index_uid,
            body.0,
        )?))
    })();
    result.or_raise()
}

/// The engine of `meili_sync_wait` (which `sql/views.sql` defines with `pg_lsn` and `interval`
/// arguments): true once the task confirmed every change committed up to `lsn` (a WAL position
/// in bytes), false after `timeout_ms`. Needs SELECT on the task's table.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_wait_at(task: Option<i64>, lsn: Option<i64>, timeout_ms: Option<f64>) -> bool {
    let result = (|| {
        let target = readable_target(task)?;
        let lsn = required(
            lsn,
            "lsn",
            "Pass a WAL position, for example pg_current_wal_lsn().",
        )?;
        let timeout_ms = required(
            timeout_ms,
            "timeout",
            "Pass how long to wait, for example '30 seconds'.",
        )?;
        if !(0.0..=86_400_000.0).contains(&timeout_ms) {
            return Err(SyncError::new(
                ErrorKind::InvalidParameter,
                format!("timeout {timeout_ms} ms is out of range"),
            )
            .hint("Wait between 0 seconds and 1 day."));
        }
        Ok(shmem::wait_confirmed(
            target.task_id,
            u64::try_from(lsn).unwrap_or(0),
            Duration::from_millis(timeout_ms as u64),
        ))
    })();
    result.or_raise()
}

/// Stops a task's worker; its slot and progress are kept.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_stop(task: Option<i64>) -> bool {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        catalog::set_state(record.id, TaskState::Stopped)?;
        wake_launcher_at_commit();
        Ok(true)
    })();
    result.or_raise()
}

/// Pauses a task: its worker stops sending, the slot keeps every change for later.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_pause(task: Option<i64>) -> bool {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        refuse_while_swapping(&record)?;
        catalog::set_state(record.id, TaskState::Paused)?;
        wake_launcher_at_commit();
        Ok(true)
    })();
    result.or_raise()
}

/// Resumes a paused, stopped or failed task where it left off (the copy if unfinished, else the stream).
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_resume(task: Option<i64>) -> bool {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        refuse_while_swapping(&record)?;
        catalog::resume(record.id)?;
        wake_launcher_at_commit();
        Ok(true)
    })();
    result.or_raise()
}

/// Changes a task's batching, settings, URL or key in place; the worker restarts with them and
/// re-sends whatever was not yet confirmed. Key and column options need a new task.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_alter(task: Option<i64>, options: Option<JsonB>) -> bool {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        refuse_while_swapping(&record)?;
        let options = required(
            options,
            "options",
            "Pass the options to change, for example '{\"batch_size\": 5000}'.",
        )?;
        let changes = options.0.as_object().ok_or_else(|| {
            SyncError::new(ErrorKind::InvalidParameter, "options must be a JSON object")
                .hint("For example '{\"batch_size\": 5000}'.")
        })?;
        if let Some(name) = crate::options::fixed_option_in(changes) {
            return Err(SyncError::new(
                ErrorKind::UnsupportedType,
                format!("option \"{name}\" cannot be changed on an existing task"),
            )
            .hint("Drop the task and start a new one (meili_sync_drop, then meili_sync_start)."));
        }
        refuse_leaving_shared_decoding(&record, changes.get("decoding"))?;
        let parsed = TaskOptions::parse(&crate::options::merged_options(&record.options, changes))?;
        require_select(&record)?;
        if (changes.contains_key("url")
            || changes.contains_key("api_key")
            || changes.contains_key("search_api_key"))
            && !catalog::acts_as(record.owner)?
        {
            let owner = catalog::role_name(record.owner)?;
            return Err(SyncError::new(
                ErrorKind::Privilege,
                format!(
                    "only the owner of task {} may change its url, api_key or search_api_key",
                    record.id
                ),
            )
            .detail(format!("Task {} was created by role {owner}.", record.id))
            .hint(format!(
                "Ask role {owner} or a superuser to make the change."
            )));
        }
        let url = parsed.url.clone().unwrap_or_else(|| record.url.clone());
        crate::options::validate_url(&url)?;
        refuse_index_in_use(
            url.trim_end_matches('/'),
            &record.index_uid,
            Some(record.id),
        )?;
        catalog::alter_task(
            record.id,
            &url,
            parsed.api_key.as_deref(),
            parsed.search_api_key.as_deref(),
            parsed.to_stored_json(),
        )?;
        wake_launcher_at_commit();
        Ok(true)
    })();
    result.or_raise()
}

/// Copies the whole table into the index again, then keeps streaming.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_snapshot(task: Option<i64>) -> bool {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        refuse_while_swapping(&record)?;
        require_select(&record)?;
        catalog::reset_snapshot(record.id)?;
        wake_launcher_at_commit();
        Ok(true)
    })();
    result.or_raise()
}

/// Rebuilds a task's index without downtime: a helper task copies the table into a new index
/// while the live one keeps serving and streaming, then swaps the two (`/swap-indexes`) and
/// deletes the old one. Returns the helper's task id, which `meili_sync_status` shows.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_resync(task: Option<i64>) -> i64 {
    let result = (|| {
        require_admin()?;
        require_preloaded()?;
        let record = require_task(task)?;
        require_select(&record)?;
        if let Some(rebuilt) = record.resync_of {
            return Err(SyncError::new(
                ErrorKind::InvalidParameter,
                format!("task {} is the resync helper of task {rebuilt}", record.id),
            )
            .hint(format!("Resync task {rebuilt} itself.")));
        }
        refuse_while_moving(&record)?;
        if let Some(helper) = catalog::resync_helper(record.id)? {
            return Err(SyncError::new(
                ErrorKind::DuplicateTask,
                format!("task {} is already being resynced by helper task {helper}", record.id),
            )
            .hint(format!(
                "Follow it in meili_sync_status; SELECT meili_sync_drop({helper}, drop_index => true) cancels it."
            )));
        }
        if record.state != TaskState::Streaming {
            return Err(SyncError::new(
                ErrorKind::Prerequisite,
                format!(
                    "task {} is in state \"{}\"; only a streaming task can be resynced",
                    record.id, record.state
                ),
            )
            .hint(format!(
                "Resume a paused or stopped task first; a task that has not finished its copy, or failed, is copied again with SELECT meili_sync_snapshot({}).",
                record.id
            )));
        }
        let fresh_uid = resync::helper_index_uid(&record.index_uid);
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
        if let Some((existing, _)) = catalog::index_owner_task(&record.url, &fresh_uid)? {
            return Err(SyncError::new(
                ErrorKind::DuplicateTask,
                format!("task {existing} already syncs into index \"{fresh_uid}\", the index a resync would build"),
            )
            .hint(format!("Drop task {existing} first.")));
        }
        require_task_room()?;
        let info = catalog::relation_info(record.relid)?;
        let options = TaskOptions::parse(&record.options)?;
        let published = if info.is_view() {
            plan::view_plan(
                &info,
                record.relid,
                &record.primary_key,
                &options,
                record.owner,
                false,
            )?
            .published_tables()
        } else {
            vec![info.qualified_name.clone()]
        };
        let helper = catalog::insert_task(
            NewTask {
                relid: record.relid,
                // The helper acts for the task it rebuilds: its reads, mapping queries and the
                // worker's privilege checks are that task owner's, never the caller's.
                owner: record.owner,
                index_uid: &fresh_uid,
                url: &record.url,
                api_key: record.api_key.as_deref(),
                search_api_key: record.search_api_key.as_deref(),
                primary_key: &record.primary_key,
                options: record.options.clone(),
                resync_of: Some(record.id),
            },
            &published,
        )?;
        wake_launcher_at_commit();
        Ok(helper)
    })();
    result.or_raise()
}

fn delete_index(record: &catalog::TaskRecord, index_uid: &str) -> Result<(), SyncError> {
    let failed =
        |error: MeiliError| {
            SyncError::from(error)
            .context(&format!("could not delete Meilisearch index \"{index_uid}\""))
            .hint("Check that Meilisearch is reachable, or drop the task with drop_index => false.")
        };
    let client = Client::new(
        &record.url,
        record.api_key.as_deref(),
        Duration::from_secs(30),
    )
    .map_err(failed)?;
    if client.get_index(index_uid).map_err(failed)?.is_none() {
        return Ok(());
    }
    let uid = client.delete_index(index_uid).map_err(failed)?;
    client
        .wait_task(uid, Duration::from_secs(60))
        .map_err(failed)?;
    Ok(())
}

/// Removes a task: its worker, publication, slot and catalog rows; with `drop_index`, the index too.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_drop(task: Option<i64>, drop_index: default!(Option<bool>, false)) -> bool {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        let drop_index = required(
            drop_index,
            "drop_index",
            "Pass true to delete the Meilisearch index too, false to keep it.",
        )?;
        let helper = catalog::resync_helper(record.id)?;
        if drop_index {
            delete_index(&record, &record.index_uid)?;
            // The index a resync was building goes too.
            if helper.is_some() {
                delete_index(&record, &resync::helper_index_uid(&record.index_uid))?;
            }
        }
        if let Some(helper) = helper {
            catalog::delete_task(&catalog::require_task(helper)?)?;
        }
        catalog::delete_task(&record)?;
        wake_launcher_at_commit();
        Ok(true)
    })();
    result.or_raise()
}

/// Sends dead-lettered documents again from their rows' current state, straight to Meilisearch
/// (the rows are locked meanwhile, so no newer version can be overtaken), and clears them; a
/// dead letter whose row is gone becomes a delete. Returns how many documents were re-sent or
/// deleted. Nothing is written to the table, so no trigger of the table fires.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_retry_dead_letters(task: Option<i64>) -> i64 {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        require_select(&record)?;
        let ids = catalog::dead_letter_ids(record.id, None)?;
        let task_id = record.id;
        let resent = crate::verify::resend_dead_letters(record, &ids)?;
        // Only those re-sent: one the worker stores meanwhile stays for the next retry.
        catalog::delete_dead_letters(task_id, Some(&ids))?;
        Ok(resent)
    })();
    result.or_raise()
}

/// Forgets dead letters: all of a task's, or those with the given document ids. Returns how many.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_discard_dead_letters(
    task: Option<i64>,
    document_ids: default!(Option<Vec<String>>, "NULL"),
) -> i64 {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        require_select(&record)?;
        catalog::delete_dead_letters(record.id, document_ids.as_deref())
    })();
    result.or_raise()
}

/// Compares the table with the index, page by page: documents missing from the index, extra in
/// it (no such row), and different from their row; with up to `samples` ids of each.
#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_verify(
    task: Option<i64>,
    samples: default!(Option<i32>, 10),
) -> TableIterator<
    'static,
    (
        name!(rows_checked, i64),
        name!(documents_checked, i64),
        name!(missing, i64),
        name!(extra, i64),
        name!(different, i64),
        name!(sample_missing, Vec<String>),
        name!(sample_extra, Vec<String>),
        name!(sample_different, Vec<String>),
    ),
> {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        require_select(&record)?;
        let samples = required(
            samples,
            "samples",
            "Pass how many ids of each kind to show, e.g. 10.",
        )?;
        crate::verify::verify(record, usize::try_from(samples).unwrap_or(0))
    })();
    let findings = result.or_raise();
    TableIterator::once((
        findings.rows_checked,
        findings.documents_checked,
        findings.missing,
        findings.extra,
        findings.different,
        findings.sample_missing,
        findings.sample_extra,
        findings.sample_different,
    ))
}

/// Fixes what `meili_sync_verify` finds: re-sends missing and different documents from their
/// rows (locked meanwhile) and deletes extra ones (writes to the table wait while it deletes).
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_repair(
    task: Option<i64>,
) -> TableIterator<'static, (name!(resent, i64), name!(deleted, i64))> {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        require_select(&record)?;
        crate::verify::repair(record)
    })();
    let repairs = result.or_raise();
    TableIterator::once((repairs.resent, repairs.deleted))
}

/// Cumulative counters per task, from shared memory (kept across worker restarts, lost at a
/// server restart); `pg_stat_meili_sync` joins them with the catalog.
#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_safe)]
fn meili_sync_stats() -> TableIterator<
    'static,
    (
        name!(task, i64),
        name!(documents, i64),
        name!(deletes, i64),
        name!(updates, i64),
        name!(truncates, i64),
        name!(batches, i64),
        name!(bytes_before_gzip, i64),
        name!(bytes_sent, i64),
        name!(retries, i64),
        name!(dead_letters, i64),
        name!(last_confirmed_at, Option<TimestampWithTimeZone>),
        name!(stats_reset, Option<TimestampWithTimeZone>),
    ),
> {
    let tasks = if crate::preloaded() {
        shmem::task_counters()
    } else {
        Vec::new()
    };
    TableIterator::new(tasks.into_iter().map(|(task, counters, confirmed, reset)| {
        (
            task,
            counters.documents,
            counters.deletes,
            counters.updates,
            counters.truncates,
            counters.batches,
            counters.bytes_before_gzip,
            counters.bytes_sent,
            counters.retries,
            counters.dead_letters,
            confirmed.and_then(|at| TimestampWithTimeZone::try_from(at).ok()),
            TimestampWithTimeZone::try_from(reset).ok(),
        )
    }))
}

/// Zeroes the cumulative counters of `pg_stat_meili_sync` (of one task, or of all).
#[pg_extern(volatile, parallel_unsafe)]
fn pg_stat_meili_sync_reset(task: default!(Option<i64>, "NULL")) -> bool {
    let result = (|| {
        require_admin()?;
        if crate::preloaded() {
            shmem::reset_counters(task);
        }
        Ok(true)
    })();
    result.or_raise()
}

/// An LSN as Postgres writes it (the view casts it to pg_lsn).
/// Live state of every task worker, from shared memory; the status view joins it with the catalog.
// The named tuple is how pgrx declares the SQL result columns.
#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_safe)]
fn meili_sync_worker_state() -> TableIterator<
    'static,
    (
        name!(task, i64),
        name!(pid, Option<i32>),
        name!(phase, Option<String>),
        name!(rows_copied, i64),
        name!(documents_confirmed, i64),
        name!(documents_deleted, i64),
        name!(batches_in_flight, i32),
        name!(retries, i64),
        name!(bytes_before_gzip, i64),
        name!(bytes_sent, i64),
        name!(documents_sent, i64),
        name!(failed_tasks, i64),
        name!(documents_per_second, f64),
        name!(received_lsn, Option<String>),
        name!(confirmed_lsn, Option<String>),
        name!(oldest_unconfirmed_commit, Option<TimestampWithTimeZone>),
        name!(last_sent_at, Option<TimestampWithTimeZone>),
        name!(last_confirmed_at, Option<TimestampWithTimeZone>),
        name!(last_error, Option<String>),
        name!(last_error_at, Option<TimestampWithTimeZone>),
    ),
> {
    let tasks = if crate::preloaded() {
        shmem::live_tasks()
    } else {
        Vec::new()
    };
    TableIterator::new(tasks.into_iter().map(|live| {
        (
            live.task_id,
            // A process that died without detaching (a crash) serves nothing: the view then
            // shows the task as starting or restarting, never as streaming.
            live.pid.filter(|pid| shmem::backend_alive(*pid)),
            live.phase.map(|phase| phase.as_str().to_owned()),
            live.rows_copied,
            live.docs_confirmed,
            live.deletes_confirmed,
            live.batches_inflight,
            live.retries,
            live.bytes_uncompressed,
            live.bytes_sent,
            live.docs_sent,
            live.failed_tasks,
            live.docs_per_second,
            live.received_lsn.map(catalog::format_lsn),
            live.confirmed_lsn.map(catalog::format_lsn),
            live.oldest_unconfirmed_at
                .and_then(|at| TimestampWithTimeZone::try_from(at).ok()),
            live.last_sent_at
                .and_then(|at| TimestampWithTimeZone::try_from(at).ok()),
            live.last_confirmed_at
                .and_then(|at| TimestampWithTimeZone::try_from(at).ok()),
            live.last_error,
            live.last_error_at
                .and_then(|at| TimestampWithTimeZone::try_from(at).ok()),
        )
    }))
}

/// The backends waiting in `meili_sync_wait` with a place in shared memory (behind the view
/// `meili_sync_waits`).
#[pg_extern(volatile, parallel_safe)]
fn meili_sync_waiting() -> TableIterator<
    'static,
    (
        name!(pid, i32),
        name!(task, i64),
        name!(wait_for_lsn, String),
    ),
> {
    let waiting = if crate::preloaded() {
        shmem::waiting_backends()
    } else {
        Vec::new()
    };
    TableIterator::new(
        waiting
            .into_iter()
            .map(|(pid, task, lsn)| (pid, task, catalog::format_lsn(lsn))),
    )
}

/// The triggers on `meili_sync.tasks` and `meili_sync.task_secrets` that keep every backend's
/// cache of search targets true: a change to a task's URL, index, key columns, table or keys
/// invalidates them at commit.
#[pg_trigger]
fn meili_sync_invalidate_search_targets<'a>(
    trigger: &'a PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, std::convert::Infallible> {
    if let Ok(table) = trigger.relation() {
        catalog::invalidate_search_targets(table.oid());
    }
    Ok(None)
}
