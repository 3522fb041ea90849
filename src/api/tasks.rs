//! Tasks: start and preview, pause, resume, stop, alter, a new copy, resync and drop.

use pgrx::prelude::*;
use pgrx::{JsonB, PgRelation};

use pg_meili_sync_core::document::encode::{encode_row, ColumnValue};
use pg_meili_sync_core::document::geo;
use pg_meili_sync_core::document::vectors;
use pg_meili_sync_core::meili::client::{
    Client, MeiliError, MeiliTaskStatus, HTTP_TIMEOUT, TASK_WAIT,
};
use pg_meili_sync_core::task::options::{
    option_altered_as, options_altered_as, validate_index_uid, Alter, Replica, TaskOptions,
    WriteMode,
};

use super::{
    require_admin, require_launcher_database, require_logical_wal, require_preloaded,
    require_select, require_task, required, wake_launcher_at_commit,
};
use crate::catalog::{
    self,
    source::RelationInfo,
    tasks::{NewTask, TaskState},
};
use crate::error::{ErrorKind, OrRaise, SyncError};
use crate::{gucs, plan, resync_request, security};

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
    plan::check_key_identity(info, &key)?;
    for name in &key {
        let Some(column) = info.columns.iter().find(|column| &column.name == name) else {
            continue;
        };
        let kind = catalog::source::value_kind(column.type_oid)?;
        if !kind.can_be_document_id() {
            return Err(SyncError::new(
                ErrorKind::UnsupportedType,
                format!("key column \"{name}\" has type {}, which cannot be a Meilisearch document id", column.type_name),
            )
            .hint("Use an integer, text, uuid, numeric, date or time key, or pass other columns as \"primary_key\"."));
        }
    }
    Ok(key)
}

/// What start and preview check of the source the caller names, before anything is created or
/// read: a syncable table or view that the caller may read, the option's column names, its key
/// and the tables its publication would hold (`source_plan`).
fn checked_source(
    relid: pg_sys::Oid,
    options: &TaskOptions,
) -> Result<(RelationInfo, Vec<String>, Vec<String>), SyncError> {
    let info = catalog::source::syncable_source(relid, security::current_role())?;
    if let Some(columns) = &options.columns {
        check_column_names(&info, "columns", columns)?;
    }
    check_column_names(&info, "exclude_columns", &options.exclude_columns)?;
    let (key, published) = source_plan(&info, relid, options)?;
    if let Some(geo) = &options.geo {
        check_geo_column(&info, &key, options, geo)?;
    }
    check_vector_columns(&info, &key, options)?;
    Ok((info, key, published))
}

/// The column an option names to become a field of its own kind (`geo`, `vectors`): it exists,
/// is synced, is not a key column (a document id), and its type suits the option
/// (`ColumnRules::document_column`).
fn option_column<'a>(
    info: &'a RelationInfo,
    key: &[String],
    rules: &plan::ColumnRules,
    option: &str,
    name: &str,
) -> Result<&'a catalog::source::ColumnInfo, SyncError> {
    let table = &info.qualified_name;
    let column = info
        .columns
        .iter()
        .find(|column| column.name == name)
        .ok_or_else(|| {
            SyncError::new(
                ErrorKind::UndefinedColumn,
                format!("column \"{name}\" of option \"{option}\" does not exist in table {table}"),
            )
            .hint("Name columns of the table, as in its definition.")
        })?;
    if key.iter().any(|column| column == name) {
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!("column \"{name}\" of option \"{option}\" is a key column of {table}"),
        )
        .hint("A key column makes the document id: name another column, or another key with \"primary_key\"."));
    }
    if !rules.includes(name) {
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!("column \"{name}\" of option \"{option}\" is not among the synced columns of {table}"),
        )
        .hint("Add it to \"columns\", or take it out of \"exclude_columns\"."));
    }
    rules.document_column(name, column.type_oid)?;
    Ok(column)
}

/// A synced column named like a field an option writes (`_geo`, `_geojson`, `_vectors`) would
/// make two fields of one name.
fn refuse_field_clash(
    info: &RelationInfo,
    rules: &plan::ColumnRules,
    option: &str,
    fields: &[&str],
    option_column: Option<&str>,
) -> Result<(), SyncError> {
    let Some(clash) = info.columns.iter().find(|column| {
        Some(column.name.as_str()) != option_column
            && fields.contains(&column.name.as_str())
            && rules.includes(&column.name)
    }) else {
        return Ok(());
    };
    Err(SyncError::new(
        ErrorKind::InvalidParameter,
        format!(
            "column \"{}\" of {} clashes with the field the \"{option}\" option writes",
            clash.name, info.qualified_name
        ),
    )
    .hint(format!(
        "Leave that column out with \"exclude_columns\", or sync it without the \"{option}\" option."
    )))
}

/// Each column of the `vectors` option is a synced pgvector column with declared dimensions (the
/// embedder is set up with them), not a key column, not also the `geo` column, and no other
/// synced column is called `_vectors`.
fn check_vector_columns(
    info: &RelationInfo,
    key: &[String],
    options: &TaskOptions,
) -> Result<(), SyncError> {
    if options.vectors.is_empty() {
        return Ok(());
    }
    let table = &info.qualified_name;
    let rules = plan::ColumnRules::new(table, key, options);
    refuse_field_clash(info, &rules, "vectors", &[vectors::VECTORS_FIELD], None)?;
    for (embedder, name) in &options.vectors {
        if options.geo.as_ref() == Some(name) {
            return Err(SyncError::new(
                ErrorKind::InvalidParameter,
                format!("column \"{name}\" is named by both options \"vectors\" and \"geo\""),
            )
            .hint("An embedding can only be an embedding: name another column."));
        }
        let column = option_column(info, key, &rules, "vectors", name)?;
        if vectors::declared_dimensions(&column.type_name).is_none() {
            return Err(SyncError::new(
                ErrorKind::UnsupportedType,
                format!(
                    "column \"{name}\" of {table} (embedder \"{embedder}\") has type {}, without dimensions",
                    column.type_name
                ),
            )
            .hint("Declare the column with its dimensions, for example ALTER TABLE … ALTER COLUMN … TYPE vector(768): the task sets the embedder up with them."));
        }
    }
    Ok(())
}

/// The `geo` option names a synced PostGIS column, not a key column, and no other synced column
/// is called `_geo` or `_geojson`.
fn check_geo_column(
    info: &RelationInfo,
    key: &[String],
    options: &TaskOptions,
    geo: &str,
) -> Result<(), SyncError> {
    let rules = plan::ColumnRules::new(&info.qualified_name, key, options);
    option_column(info, key, &rules, "geo", geo)?;
    refuse_field_clash(
        info,
        &rules,
        "geo",
        &[geo::POINT_FIELD, geo::SHAPE_FIELD],
        Some(geo),
    )?;
    check_geo_write_mode(info, options)
}

/// Upsert mode with a `geo` column that may hold more than points is refused: a row whose value
/// turns from a shape into a point must lose its `_geojson` field, which only replacing the whole
/// document does.
fn check_geo_write_mode(info: &RelationInfo, options: &TaskOptions) -> Result<(), SyncError> {
    let Some(geo) = &options.geo else {
        return Ok(());
    };
    let declared = info.type_name_of(geo);
    if options.write_mode == WriteMode::Upsert && !geo::declared_points_only(&declared) {
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!(
                "column \"{geo}\" of option \"geo\" has type {declared}, which holds more than points, and \"write_mode\" is \"upsert\""
            ),
        )
        .hint("Use \"write_mode\": \"replace\" (a row whose value turns from a shape into a point must lose its _geojson field), or declare the column geometry(Point, 4326) or geography(Point)."));
    }
    Ok(())
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
    let mut parsed = TaskOptions::parse(options)?;
    let (servers, shard_names) = task_servers(&parsed)?;
    let (info, key, published) = checked_source(source.oid(), &parsed)?;
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
    catalog::tasks::require_task_room(servers.len())?;
    for server in &servers {
        refuse_index_in_use(&server.url, index_uid, None)?;
    }
    // The first server is the task's own row; each other replica or shard gets a row of its own.
    let mut id = None;
    for (position, server) in servers.iter().enumerate() {
        let inserted = catalog::tasks::insert_task(
            NewTask {
                relid: source.oid(),
                owner: security::current_role(),
                index_uid,
                url: &server.url,
                api_key: server.api_key.as_deref(),
                search_api_key: parsed.search_api_key.as_deref(),
                primary_key: &key,
                options: parsed.to_stored_json(),
                resync_of: None,
                replica_of: id,
                shard: shard_names
                    .get(position)
                    .map(|name| (name.as_str(), shard_names.as_slice())),
            },
            &published,
        )?;
        id.get_or_insert(inserted);
    }
    wake_launcher_at_commit();
    id.ok_or_else(|| SyncError::new(ErrorKind::Internal, "a task without a server"))
}

/// The servers a new task writes to: its `replicas`, its `shards` (with their names, in the same
/// order), or its one `url` (else `meili_sync.url`). A server without a key of its own uses
/// `meili_sync.api_key`.
fn task_servers(parsed: &TaskOptions) -> Result<(Vec<Replica>, Vec<String>), SyncError> {
    let server = |url: &String, api_key: &Option<String>| Replica {
        url: url.clone(),
        api_key: api_key.clone().or_else(gucs::default_api_key),
    };
    if !parsed.replicas.is_empty() {
        return Ok((
            parsed
                .replicas
                .iter()
                .map(|replica| server(&replica.url, &replica.api_key))
                .collect(),
            Vec::new(),
        ));
    }
    if !parsed.shards.is_empty() {
        return Ok((
            parsed
                .shards
                .iter()
                .map(|shard| server(&shard.url, &shard.api_key))
                .collect(),
            parsed
                .shards
                .iter()
                .map(|shard| shard.name.clone())
                .collect(),
        ));
    }
    let url = parsed
        .url
        .clone()
        .or_else(gucs::default_url)
        .ok_or_else(|| {
            SyncError::new(ErrorKind::InvalidParameter, "no Meilisearch URL given")
                .hint("Pass {\"url\": \"http://host:7700\"} in the options, or set meili_sync.url.")
        })?;
    pg_meili_sync_core::task::options::validate_url(&url)?;
    Ok((
        vec![Replica {
            url: url.trim_end_matches('/').to_owned(),
            api_key: parsed.api_key.clone().or_else(gucs::default_api_key),
        }],
        Vec::new(),
    ))
}

/// One index, one task: a second task writing into an index at the same URL would mix two
/// tables' documents, and a TRUNCATE of either would delete the other's.
fn refuse_index_in_use(
    url: &str,
    index_uid: &str,
    this_task: Option<i64>,
) -> Result<(), SyncError> {
    let Some((existing, table)) = catalog::tasks::index_owner_task(url, index_uid)? else {
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
fn refuse_while_swapping(record: &catalog::tasks::TaskRecord) -> Result<(), SyncError> {
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
/// rows are read as the table owner, under `SECURITY_RESTRICTED_OPERATION`, as a task reads them.
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
        let (_, key, _) = checked_source(source.oid(), &parsed)?;
        catalog::source::set_output_formats(true)?;
        let plan = plan::source_plan(source.oid(), &key, &parsed)?;
        let width = plan.shape.columns().len();
        // Read as a task reads: as the table's (or view's) owner under
        // SECURITY_RESTRICTED_OPERATION, never as the caller, who may be a superuser and whose
        // SELECT was checked above.
        let rows = security::as_table_owner(plan.table_owner, || {
            catalog::source::read_page(&plan.first_page_query, None, limit as usize, width)
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

/// Stops a task's worker; its slot and progress are kept.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_stop(task: Option<i64>) -> bool {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        catalog::tasks::set_state(record.id, TaskState::Stopped)?;
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
        catalog::tasks::set_state(record.id, TaskState::Paused)?;
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
        catalog::tasks::resume(record.id)?;
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
        refuse_on_replica(&record, |task| {
            format!("Alter task {task} itself: its replicas or shards follow it.")
        })?;
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
        refuse_server_change_of_shards(&record, changes)?;
        if let Some(name) = option_altered_as(changes, Alter::NewTask) {
            return Err(SyncError::new(
                ErrorKind::UnsupportedType,
                format!("option \"{name}\" cannot be changed on an existing task"),
            )
            .hint("Drop the task and start a new one (meili_sync_drop, then meili_sync_start)."));
        }
        refuse_leaving_shared_decoding(&record, changes.get("decoding"))?;
        let parsed = TaskOptions::parse(&pg_meili_sync_core::task::options::merged_options(
            &record.options,
            changes,
        ))?;
        if parsed.geo.is_some() {
            check_geo_write_mode(&catalog::source::relation_info(record.relid)?, &parsed)?;
        }
        require_select(&record)?;
        if option_altered_as(changes, Alter::ByOwner).is_some() && !catalog::acts_as(record.owner)?
        {
            let owner = catalog::role_name(record.owner)?;
            let names: Vec<_> = options_altered_as(Alter::ByOwner).collect();
            let names = match names.split_last() {
                Some((last, [])) => last.to_string(),
                Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
                None => String::new(),
            };
            return Err(SyncError::new(
                ErrorKind::Privilege,
                format!(
                    "only the owner of task {} may change its {names}",
                    record.id
                ),
            )
            .detail(format!("Task {} was created by role {owner}.", record.id))
            .hint(format!(
                "Ask role {owner} or a superuser to make the change."
            )));
        }
        let url = parsed.url.clone().unwrap_or_else(|| record.url.clone());
        pg_meili_sync_core::task::options::validate_url(&url)?;
        refuse_index_in_use(
            url.trim_end_matches('/'),
            &record.index_uid,
            Some(record.id),
        )?;
        let own_key = if changes.contains_key("replicas") {
            change_replicas(&record, &parsed)?
        } else if changes.contains_key("shards") {
            change_shards(&record, &parsed)?
        } else {
            None
        };
        catalog::tasks::alter_task(
            record.id,
            &url,
            parsed.api_key.as_deref().or(own_key.as_deref()),
            parsed.search_api_key.as_deref(),
            parsed.to_stored_json(),
        )?;
        wake_launcher_at_commit();
        Ok(true)
    })();
    result.or_raise()
}

/// The servers of a sharded task are its `shards` (which `change_shards` adds to): a change of
/// `url`, `api_key` or `replicas` would leave the others' network behind. A task that is not
/// sharded does not become so.
fn refuse_server_change_of_shards(
    record: &catalog::tasks::TaskRecord,
    changes: &serde_json::Map<String, serde_json::Value>,
) -> Result<(), SyncError> {
    let sharded = record.shard.is_some();
    if changes.contains_key("shards") && !sharded {
        return Err(SyncError::new(
            ErrorKind::UnsupportedType,
            format!("task {} is not sharded, and cannot become so", record.id),
        )
        .detail("The task writes to one server, or to replicas; shards are given when a task starts.")
        .hint("Start a new task with \"shards\" into another index uid, and drop this one once it streams (meili_sync_drop)."));
    }
    if let Some(name) = ["url", "api_key", "replicas"]
        .into_iter()
        .find(|name| sharded && changes.contains_key(*name))
    {
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!(
                "task {} is sharded; option \"{name}\" does not apply to it",
                record.id
            ),
        )
        .hint(
            "Each shard's url and api_key are in its \"shards\" entry, given when the task starts.",
        ));
    }
    Ok(())
}

/// A replica's row takes its options from its task, and has no resync of its own;
/// `hint(task)` says what to do instead.
fn refuse_on_replica(
    record: &catalog::tasks::TaskRecord,
    hint: impl Fn(i64) -> String,
) -> Result<(), SyncError> {
    let Some(task) = record.replica_of else {
        return Ok(());
    };
    let role = if record.shard.is_some() {
        "shard"
    } else {
        "replica"
    };
    Err(SyncError::new(
        ErrorKind::InvalidParameter,
        format!("task {} is a {role} of task {task}", record.id),
    )
    .hint(hint(task)))
}

/// `meili_sync_alter(task, '{"replicas": [...]}')`: each server the task does not write to yet
/// gets a replica row (its worker copies the table into it while the others stream on), and each
/// replica left out is removed. The task's own server stays. Returns the key given for it.
fn change_replicas(
    record: &catalog::tasks::TaskRecord,
    parsed: &TaskOptions,
) -> Result<Option<String>, SyncError> {
    let Some(own) = parsed
        .replicas
        .iter()
        .find(|replica| replica.url == record.url)
    else {
        return Err(SyncError::new(
            ErrorKind::UnsupportedType,
            format!(
                "option \"replicas\" leaves out {}, the server of task {} itself",
                record.url, record.id
            ),
        )
        .detail("A task's own row writes to its first server; its other replicas have rows of their own.")
        .hint("Keep that server in \"replicas\"; to move the task to another server, alter its \"url\" on its own."));
    };
    let existing = catalog::tasks::replicas_of(record.id)?;
    refuse_while_resyncing(record, &existing, "replicas")?;
    let adding: Vec<&Replica> = parsed
        .replicas
        .iter()
        .filter(|replica| {
            replica.url != record.url && !existing.iter().any(|row| row.url == replica.url)
        })
        .collect();
    catalog::tasks::require_task_room(adding.len())?;
    for replica in &adding {
        refuse_index_in_use(&replica.url, &record.index_uid, None)?;
    }
    for row in &existing {
        match parsed
            .replicas
            .iter()
            .find(|replica| replica.url == row.url)
        {
            Some(kept) => {
                if let Some(key) = &kept.api_key {
                    catalog::tasks::set_replica_key(row.id, key)?;
                }
            }
            None => {
                catalog::tasks::delete_task(row)?;
                warning!(
                    "pg_meili_sync task {}: replica {} at {} is removed; index \"{}\" there is no longer kept in step, and its position no longer holds back WAL",
                    record.id, row.id, row.url, row.index_uid
                );
            }
        }
    }
    if !adding.is_empty() {
        let published = plan::published_tables(record, parsed)?;
        for replica in adding {
            insert_member(
                record,
                parsed,
                &replica.url,
                &replica.api_key,
                None,
                &published,
            )?;
        }
    }
    Ok(own.api_key.clone())
}

/// The servers of a task do not change while a resync rebuilds one of them: its helper copies with
/// the task's list (a shard's, the ids its shard keeps) and swaps on that server alone.
fn refuse_while_resyncing(
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

/// Inserts a row of the task for another of its servers (a replica, or the shard named in
/// `shard` with the task's shard list), with the task's options and search key.
fn insert_member(
    record: &catalog::tasks::TaskRecord,
    parsed: &TaskOptions,
    url: &str,
    api_key: &Option<String>,
    shard: Option<(&str, &[String])>,
    published: &[String],
) -> Result<i64, SyncError> {
    catalog::tasks::insert_task(
        NewTask {
            relid: record.relid,
            owner: record.owner,
            index_uid: &record.index_uid,
            url,
            api_key: api_key.clone().or_else(gucs::default_api_key).as_deref(),
            search_api_key: record.search_api_key.as_deref(),
            primary_key: &record.primary_key,
            options: parsed.to_stored_json(),
            resync_of: None,
            replica_of: Some(record.id),
            shard,
        },
        published,
    )
}

/// `meili_sync_alter(task, '{"shards": [...]}')` on a sharded task: the shards it has, in their
/// order, then the new ones. Each new shard gets a row that copies its documents while the others
/// stream on and keep all theirs; then the task's rebalance worker moves the task to the new list
/// (`worker::rebalance`). Returns the key given for the task's own shard.
fn change_shards(
    record: &catalog::tasks::TaskRecord,
    parsed: &TaskOptions,
) -> Result<Option<String>, SyncError> {
    let existing: Vec<catalog::tasks::TaskRecord> = std::iter::once(record.clone())
        .chain(catalog::tasks::replicas_of(record.id)?)
        .collect();
    refuse_while_resyncing(record, &existing[1..], "shards")?;
    if catalog::tasks::shard_rebalance_pending(record.id)? {
        return Err(SyncError::new(
            ErrorKind::Prerequisite,
            format!("a shard is still being added to task {}", record.id),
        )
        .hint("Alter the shards again once every shard streams and the documents that moved are gone (the server log says when)."));
    }
    let kept =
        existing.len() <= parsed.shards.len()
            && parsed.shards.iter().zip(&existing).all(|(entry, row)| {
                row.shard.as_ref() == Some(&entry.name) && entry.url == row.url
            });
    if !kept {
        return Err(SyncError::new(
            ErrorKind::UnsupportedType,
            format!(
                "the shards of task {} can only be added to, after the ones it has and in their order",
                record.id
            ),
        )
        .detail("Removing, renaming, reordering or moving a shard would move documents in a way meili_sync_alter does not do yet.")
        .hint("List the task's shards (meili_sync_status, column shard, in task order) with the same names and URLs, then the new ones."));
    }
    for (entry, row) in parsed.shards.iter().zip(&existing).skip(1) {
        if let Some(key) = &entry.api_key {
            catalog::tasks::set_replica_key(row.id, key)?;
        }
    }
    let adding = &parsed.shards[existing.len()..];
    if !adding.is_empty() {
        catalog::tasks::require_task_room(adding.len())?;
        for shard in adding {
            refuse_index_in_use(&shard.url, &record.index_uid, None)?;
        }
        let names: Vec<String> = parsed
            .shards
            .iter()
            .map(|shard| shard.name.clone())
            .collect();
        let published = plan::published_tables(record, parsed)?;
        for shard in adding {
            insert_member(
                record,
                parsed,
                &shard.url,
                &shard.api_key,
                Some((&shard.name, &names)),
                &published,
            )?;
        }
    }
    Ok(parsed
        .shards
        .first()
        .and_then(|shard| shard.api_key.clone()))
}

/// Copies the whole table into the index again, then keeps streaming.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_snapshot(task: Option<i64>) -> bool {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        refuse_while_swapping(&record)?;
        require_select(&record)?;
        catalog::tasks::reset_snapshot(record.id)?;
        wake_launcher_at_commit();
        Ok(true)
    })();
    result.or_raise()
}

/// Rebuilds a task's index without downtime: a helper task copies the table into a new index
/// while the live one keeps serving and streaming, then swaps the two (`/swap-indexes`) and
/// deletes the old one. A task with replicas or shards gets a helper for each of its servers,
/// each swapping on its own; a replica's or shard's row, one for that server alone. Returns the
/// helper's task id (the one of the row called), which `meili_sync_status` shows.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_resync(task: Option<i64>) -> i64 {
    let result = (|| {
        require_admin()?;
        require_preloaded()?;
        require_launcher_database()?;
        let record = require_task(task)?;
        require_select(&record)?;
        let helpers = resync_request::begin_resync(&record)?;
        wake_launcher_at_commit();
        Ok(helpers[0])
    })();
    result.or_raise()
}

/// Why an index of the task's server could not be deleted, as an ERROR with what to do.
fn index_not_deleted(index_uid: &str, error: MeiliError) -> SyncError {
    SyncError::from(error)
        .context(&format!(
            "could not delete Meilisearch index \"{index_uid}\""
        ))
        .hint("Check that Meilisearch is reachable, or drop the task with drop_index => false.")
}

/// The client of the task row's server, and whether the index is there.
fn index_on_server(
    record: &catalog::tasks::TaskRecord,
    index_uid: &str,
) -> Result<(Client, bool), SyncError> {
    let failed = |error| index_not_deleted(index_uid, error);
    let client =
        Client::new(&record.url, record.api_key.as_deref(), HTTP_TIMEOUT).map_err(failed)?;
    let exists = client.get_index(index_uid).map_err(failed)?.is_some();
    Ok((client, exists))
}

/// Deletes the index and waits for Meilisearch to do it (a cancel stops the wait). A deletion
/// Meilisearch refused is an error, and nothing is dropped; one still queued after
/// [`TASK_WAIT`] is left to Meilisearch, with a notice naming its task.
fn delete_index(record: &catalog::tasks::TaskRecord, index_uid: &str) -> Result<(), SyncError> {
    let failed = |error| index_not_deleted(index_uid, error);
    let (client, exists) = index_on_server(record, index_uid)?;
    if !exists {
        return Ok(());
    }
    let uid = client.delete_index(index_uid).map_err(failed)?;
    let task = client
        .wait_task_between(uid, TASK_WAIT, &mut || {
            pgrx::check_for_interrupts!();
        })
        .map_err(failed)?;
    match task.status {
        MeiliTaskStatus::Succeeded => Ok(()),
        MeiliTaskStatus::Enqueued | MeiliTaskStatus::Processing => {
            pgrx::notice!(
                "Meilisearch has not yet deleted index \"{index_uid}\": its task {uid} is still \
                 queued, and the index goes when Meilisearch reaches it"
            );
            Ok(())
        }
        MeiliTaskStatus::Failed | MeiliTaskStatus::Canceled => Err(SyncError::new(
            ErrorKind::Meilisearch,
            format!("could not delete Meilisearch index \"{index_uid}\""),
        )
        .detail(format!(
            "{}. Nothing was dropped.",
            task.failure().unwrap_or_default()
        ))
        .hint("Fix the cause and drop again, or drop the task with drop_index => false.")),
    }
}

/// Removes a task: its worker, publication, slot and catalog rows; with `drop_index`, the index too.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_drop(task: Option<i64>, drop_index: default!(Option<bool>, false)) -> bool {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        if let (Some(task), Some(shard)) = (record.replica_of, &record.shard) {
            return Err(SyncError::new(
                ErrorKind::UnsupportedType,
                format!("task {} is shard \"{shard}\" of task {task}", record.id),
            )
            .detail("Its documents are on no other shard: without it, searches of the task would miss them.")
            .hint(format!("Drop task {task} itself, with all its shards.")));
        }
        let drop_index = required(
            drop_index,
            "drop_index",
            "Pass true to delete the Meilisearch index too, false to keep it.",
        )?;
        let replicas = catalog::tasks::replicas_of(record.id)?;
        // The resync helpers of the row and of its replicas or shards, each with the row it
        // rebuilds.
        let mut helpers = Vec::new();
        for row in replicas.iter().chain(std::iter::once(&record)) {
            if let Some(helper) = catalog::tasks::resync_helper(row.id)? {
                helpers.push((row, helper));
            }
        }
        if drop_index {
            // Every server answers before any index goes: a drop that failed half-way would
            // leave indexes deleted under replicas that go on.
            if !replicas.is_empty() {
                for row in replicas.iter().chain(std::iter::once(&record)) {
                    index_on_server(row, &row.index_uid)?;
                }
            }
            for replica in &replicas {
                delete_index(replica, &replica.index_uid)?;
            }
            delete_index(&record, &record.index_uid)?;
            // The indexes the resyncs were building go too.
            for (row, _) in &helpers {
                delete_index(row, &resync_request::helper_index_uid(&row.index_uid))?;
            }
        }
        // Before any row goes (and after the servers answered, which may take a while): the
        // rows are locked in the order of their ids, as the workers' writes of several rows are.
        catalog::tasks::lock_task_rows(record.id)?;
        for (_, helper) in helpers {
            catalog::tasks::delete_task(&catalog::tasks::require_task(helper)?)?;
        }
        catalog::tasks::delete_task(&record)?;
        if let Some(task) = record.replica_of {
            warning!(
                "pg_meili_sync task {task}: replica {} at {} is removed; index \"{}\" there is no longer kept in step{}",
                record.id,
                record.url,
                record.index_uid,
                if drop_index { " (and it was deleted)" } else { "" }
            );
        }
        wake_launcher_at_commit();
        Ok(true)
    })();
    result.or_raise()
}
