//! Tasks: start and preview, pause, resume, stop, alter, a new copy, resync and drop. What a
//! task may be, which these functions check before they change anything, is in `rules`.

use pgrx::prelude::*;
use pgrx::{JsonB, PgRelation};

use pg_meili_sync_core::document::encode::{encode_row, ColumnValue};
use pg_meili_sync_core::task::options::{
    option_altered_as, options_altered_as, validate_index_uid, Alter, TaskOptions,
};

use super::{
    require_admin, require_launcher_database, require_logical_wal, require_preloaded,
    require_select, require_task, required, wake_launcher_at_commit,
};
use crate::catalog::{
    self,
    tasks::{NewTask, TaskState},
};
use crate::error::{ErrorKind, OrRaise, SyncError};
use crate::rules::{servers, source_and_key, states};
use crate::{plan, resync_request, security};

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
    let (servers, shard_names) = servers::task_servers(&parsed)?;
    let (info, key, published) = source_and_key::checked_source(source.oid(), &parsed)?;
    if info.is_view() {
        parsed.mappings = source_and_key::stored_mappings(&info, source.oid(), &key, &parsed)?;
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
        servers::refuse_index_in_use(&server.url, index_uid, None)?;
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
        let (_, key, _) = source_and_key::checked_source(source.oid(), &parsed)?;
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
        states::refuse_while_swapping(&record)?;
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
        states::refuse_while_swapping(&record)?;
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
        servers::refuse_on_replica(&record, |task| {
            format!("Alter task {task} itself: its replicas or shards follow it.")
        })?;
        states::refuse_while_swapping(&record)?;
        let options = required(
            options,
            "options",
            "Pass the options to change, for example '{\"batch_size\": 5000}'.",
        )?;
        let changes = options.0.as_object().ok_or_else(|| {
            SyncError::new(ErrorKind::InvalidParameter, "options must be a JSON object")
                .hint("For example '{\"batch_size\": 5000}'.")
        })?;
        servers::refuse_server_change_of_shards(&record, changes)?;
        if let Some(name) = option_altered_as(changes, Alter::NewTask) {
            return Err(SyncError::new(
                ErrorKind::UnsupportedType,
                format!("option \"{name}\" cannot be changed on an existing task"),
            )
            .hint("Drop the task and start a new one (meili_sync_drop, then meili_sync_start)."));
        }
        states::refuse_leaving_shared_decoding(&record, changes.get("decoding"))?;
        let parsed = TaskOptions::parse(&pg_meili_sync_core::task::options::merged_options(
            &record.options,
            changes,
        ))?;
        if parsed.geo.is_some() {
            source_and_key::check_geo_write_mode(
                &catalog::source::relation_info(record.relid)?,
                &parsed,
            )?;
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
        servers::refuse_index_in_use(
            url.trim_end_matches('/'),
            &record.index_uid,
            Some(record.id),
        )?;
        let own_key = if changes.contains_key("replicas") {
            servers::change_replicas(&record, &parsed)?
        } else if changes.contains_key("shards") {
            servers::change_shards(&record, &parsed)?
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

/// Copies the whole table into the index again, then keeps streaming.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_snapshot(task: Option<i64>) -> bool {
    let result = (|| {
        require_admin()?;
        let record = require_task(task)?;
        states::refuse_while_swapping(&record)?;
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
                    servers::index_on_server(row, &row.index_uid)?;
                }
            }
            for replica in &replicas {
                servers::delete_index(replica, &replica.index_uid)?;
            }
            servers::delete_index(&record, &record.index_uid)?;
            // The indexes the resyncs were building go too.
            for (row, _) in &helpers {
                servers::delete_index(row, &resync_request::helper_index_uid(&row.index_uid))?;
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
