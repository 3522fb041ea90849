//! Searching a task's index from SQL, and waiting for a task to confirm a position.

use std::rc::Rc;
use std::time::{Duration, Instant};

use pgrx::prelude::*;
use pgrx::JsonB;

use pg_meili_sync_core::meili::client::Client;
use pg_meili_sync_core::task::options::validate_index_uid;

use super::{require_admin, required, select_denied, TASK_HINT};
use crate::catalog;
use crate::catalog::search_targets::SearchTarget;
use crate::error::{ErrorKind, OrRaise, SyncError};
use crate::search::jsonb::{BuiltJsonb, DirectJsonb, JsonbBuilder};
use crate::search::materialized::TableIterator;
use crate::search::ShardsFailed;
use crate::shmem::live::Phase;
use crate::{search, shmem};

/// A task for any role that may read its table or view (`42501` otherwise): the search functions
/// and `meili_sync_wait` are granted to PUBLIC. The task comes from the backend's cache and the
/// privilege is checked on every call, both without SPI.
fn readable_target(task: Option<i64>) -> Result<Rc<SearchTarget>, SyncError> {
    let task_id = required(task, "task", TASK_HINT)?;
    let no_task = || {
        SyncError::new(
            ErrorKind::UndefinedTask,
            format!("meili_sync task {task_id} does not exist"),
        )
        .hint("SELECT task FROM meili_sync_status lists the tasks (ask a meili_sync_admin member).")
    };
    let target = catalog::search_targets::search_target(task_id)?.ok_or_else(no_task)?;
    if catalog::search_targets::current_role_may_select(target.relid) {
        if let Some(refusal) = &target.refusal {
            return Err(refusal.clone());
        }
        return Ok(target);
    }
    // Admins may read the catalog anyway: their refusal names the table and role. Any other role
    // learns nothing of a table it may not read.
    if catalog::current_role_is_admin()? {
        let record = catalog::tasks::load_task_for_search(task_id)?.ok_or_else(no_task)?;
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

/// Runs `request` with the backend's client for a server of the task, for a caller that may read
/// its table (or view), with the server's `search_api_key` when it has one (never then its
/// `api_key`). A task with replicas tries those streaming with nothing failing first, in their
/// order, then the others (never one still copying), and after a `meili_sync_wait` of this
/// session only those that have confirmed its position (read-your-writes); a server that cannot
/// be reached, times out, fails inside, or lacks the index hands the request on to the next. Any
/// other answer, a refusal too, is the answer.
fn on_a_server<T>(
    task: Option<i64>,
    mut request: impl FnMut(&Client, &SearchTarget) -> Result<T, SyncError>,
) -> Result<T, SyncError> {
    let target = readable_target(task)?;
    if target.replicas.is_empty() {
        let client = search::client(&target.url, target.api_key.as_deref())?;
        return request(&client, &target);
    }
    // Each server's row, URL, key and live phase (looked up once: a lock and a scan each).
    let mut servers: Vec<(i64, &str, Option<&str>, Option<Phase>)> = std::iter::once((
        target.task_id,
        target.url.as_str(),
        target.api_key.as_deref(),
    ))
    .chain(target.replicas.iter().map(|replica| {
        (
            replica.task_id,
            replica.url.as_str(),
            replica.api_key.as_deref(),
        )
    }))
    .map(|(row, url, key)| (row, url, key, shmem::live::phase_of(row)))
    .collect();
    // A replica still copying holds part of the index (unless all do, as while a task starts:
    // then its search answers from a part, as a task without replicas does).
    let copying = |phase: &Option<Phase>| *phase == Some(Phase::Snapshot);
    let sharded = !target.shards.is_empty();
    // Any shard answers for all (a federated search over its network), whatever its own phase.
    if !sharded && servers.iter().any(|(_, _, _, phase)| !copying(phase)) {
        servers.retain(|(_, _, _, phase)| !copying(phase));
    }
    // A wait of a sharded task is for every shard (`replicas => 'all'`), and a search asks all.
    let waited = search::waited_for(target.task_id).filter(|_| !sharded);
    if let Some(lsn) = waited {
        let published: Vec<_> = servers
            .iter()
            .copied()
            .filter(|(row, _, _, _)| shmem::live::confirmed_past(*row, lsn))
            .collect();
        servers = if published.is_empty() {
            // No worker has published a position past it yet (one restarted): the catalog's.
            let rows: Vec<i64> = servers.iter().map(|(row, _, _, _)| *row).collect();
            let stored = catalog::tasks::stored_positions(&rows)?;
            servers
                .into_iter()
                .filter(|(row, _, _, _)| {
                    stored
                        .iter()
                        .any(|(id, position)| id == row && *position >= lsn)
                })
                .collect()
        } else {
            published
        };
        if servers.is_empty() {
            return Err(SyncError::new(
                ErrorKind::Prerequisite,
                format!(
                    "no replica of task {} has confirmed the changes this session waited for (up to {})",
                    target.task_id,
                    catalog::format_lsn(lsn)
                ),
            )
            .hint(format!(
                "SELECT meili_sync_wait({}, replicas => 'any') waits until one has them.",
                target.task_id
            )));
        }
    }
    servers.sort_by_key(|(_, _, _, phase)| *phase != Some(Phase::Streaming));
    let mut failures = Vec::new();
    for (_, url, api_key, _) in servers {
        let client = search::client(url, api_key)?;
        match request(&client, &target) {
            Err(error)
                if matches!(
                    error.kind,
                    ErrorKind::Meilisearch | ErrorKind::UndefinedTask
                ) =>
            {
                failures.push(format!("{url}: {}", error.message));
            }
            answer => return answer,
        }
    }
    Err(SyncError::new(
        ErrorKind::Meilisearch,
        format!(
            "no {} of task {} answered the search: {}",
            if sharded { "shard" } else { "replica" },
            target.task_id,
            failures.join("; ")
        ),
    )
    .hint("Check that at least one of the task's Meilisearch servers is up (meili_sync_status shows each replica); meili_sync.search_timeout bounds the wait for each."))
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
        name!(document, BuiltJsonb),
        name!(formatted, Option<BuiltJsonb>),
    ),
>;

/// Searches and returns one row per hit, in Meilisearch's order.
fn hit_rows(
    client: &Client,
    index_uid: &str,
    shards: &[String],
    key_columns: &[String],
    query: Option<&str>,
    options: serde_json::Value,
) -> Result<HitRows, SyncError> {
    let body =
        pg_meili_sync_core::meili::search::search_body(query, &options).map_err(|refused| {
            SyncError::new(ErrorKind::InvalidParameter, refused.0)
                .hint("For example '{\"limit\": 10, \"filter\": \"price > 10\"}'.")
        })?;
    let answer = search::run_for_text(client, index_uid, shards, body)?;
    let hits = pg_meili_sync_core::meili::search::read_hits(
        &answer,
        search::id_attribute(key_columns),
        JsonbBuilder::new,
    )
    .map_err(|unreadable| SyncError::new(ErrorKind::Meilisearch, unreadable.0))?;
    let key_count = key_columns.len().max(1);
    // Between a rebalance's new shard list and its prune, a moved document is on its old shard
    // too: only the copy on the shard its id hashes to is a hit.
    let shards = shards.to_vec();
    let hits = hits
        .into_iter()
        .filter(move |hit| match (&hit.id, &hit.remote) {
            (Some(id), Some(remote)) => {
                !pg_meili_sync_core::document::shard::is_left_behind(id, remote, &shards)
            }
            _ => true,
        });
    Ok(TableIterator::new(hits.map(move |hit| {
        let key = hit
            .id
            .as_deref()
            .and_then(|id| pg_meili_sync_core::document::encode::key_of_id(id, key_count));
        (hit.id, key, hit.score, hit.document, hit.formatted)
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
        name!(document, BuiltJsonb),
        name!(formatted, Option<BuiltJsonb>),
    ),
> {
    let result = (|| {
        let options = search_options(options)?;
        on_a_server(task, |client, target| {
            hit_rows(
                client,
                &target.index_uid,
                &target.shards,
                &target.primary_key,
                query,
                options.clone(),
            )
        })
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
        name!(document, BuiltJsonb),
        name!(formatted, Option<BuiltJsonb>),
    ),
> {
    let result = (|| {
        require_admin()?;
        let url = required(
            url,
            "url",
            "Pass the Meilisearch URL, for example 'http://127.0.0.1:7700'.",
        )?;
        pg_meili_sync_core::task::options::validate_url(url)?;
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
            &[],
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
        let body = pg_meili_sync_core::meili::search::search_body(query, &options)
            .map_err(|refused| SyncError::new(ErrorKind::InvalidParameter, refused.0))?;
        let answer = on_a_server(task, |client, target| {
            search::run(
                client,
                &target.index_uid,
                &target.shards,
                body.clone(),
                ShardsFailed::Refuse,
            )
        })?;
        Ok(TableIterator::new(
            pg_meili_sync_core::meili::search::facet_counts(&answer),
        ))
    })();
    result.or_raise()
}

/// A search request passed through as it is (`POST /indexes/<uid>/search` with `body`), and
/// Meilisearch's whole answer: for what the other functions do not cover. Needs SELECT on the
/// task's table.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_search_raw(task: Option<i64>, body: Option<JsonB>) -> DirectJsonb {
    let result = (|| {
        let body = required(
            body,
            "body",
            "Pass a search request, for example '{\"q\": \"kettle\"}'.",
        )?;
        Ok(DirectJsonb(on_a_server(task, |client, target| {
            search::run(
                client,
                &target.index_uid,
                &target.shards,
                body.0.clone(),
                ShardsFailed::Return,
            )
        })?))
    })();
    result.or_raise()
}

/// The engine of `meili_sync_wait` (which `sql/views.sql` defines with `pg_lsn` and `interval`
/// arguments): true once the task confirmed every change committed up to `lsn` (a WAL position
/// in bytes), false after `timeout_ms`. A task with replicas: each of them (`replicas` 'all'),
/// or one (`'any'`). With `publisher_lsn` (a search replica's task, whose table a subscription
/// fills): first until every subscription feeding the task has applied its publisher's WAL up to
/// there, then until the task confirmed what this server had written by then. Needs SELECT on the
/// task's table.
#[pg_extern(volatile, parallel_unsafe)]
fn meili_sync_wait_at(
    task: Option<i64>,
    lsn: Option<i64>,
    timeout_ms: Option<f64>,
    replicas: Option<&str>,
    publisher_lsn: Option<i64>,
) -> bool {
    let result = (|| {
        let target = readable_target(task)?;
        let any = match required(replicas, "replicas", "Pass 'all' or 'any'.")? {
            "all" => false,
            "any" => true,
            other => {
                return Err(SyncError::new(
                    ErrorKind::InvalidParameter,
                    format!(
                        "replicas must be 'all' or 'any', not '{}'",
                        other.escape_default()
                    ),
                )
                .hint("'all' waits until every replica of the task has the changes, 'any' until one has (a search then asks only replicas that have them)."))
            }
        };
        if any && !target.shards.is_empty() {
            return Err(SyncError::new(
                ErrorKind::InvalidParameter,
                format!(
                    "task {} is sharded: each shard holds part of the documents, so a wait is for all of them",
                    target.task_id
                ),
            )
            .hint("Leave out replicas, or pass replicas => 'all'."));
        }
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
        let tasks: Vec<i64> = std::iter::once(target.task_id)
            .chain(target.replicas.iter().map(|replica| replica.task_id))
            .collect();
        let mut lsn = u64::try_from(lsn).unwrap_or(0);
        let deadline = Instant::now() + Duration::from_millis(timeout_ms as u64);
        if let Some(publisher_lsn) = publisher_lsn {
            match wait_for_subscriptions(
                &target,
                u64::try_from(publisher_lsn).unwrap_or(0),
                deadline,
            )? {
                Some(applied_at) => lsn = lsn.max(applied_at),
                None => return Ok(false),
            }
        }
        let confirmed = shmem::waiters::wait_confirmed(
            &tasks,
            lsn,
            deadline.saturating_duration_since(Instant::now()),
            any,
        );
        if confirmed {
            // Read-your-writes: this session's searches through the task now ask only replicas
            // that have these changes.
            search::note_waited(target.task_id, lsn);
        }
        Ok(confirmed)
    })();
    result.or_raise()
}

/// Waits until every subscription that feeds the task's table (or, for a view, the tables it
/// reads) has applied its publisher's WAL up to `publisher_lsn`, and returns where this server's
/// WAL was then: every change applied by then is before it. None when `deadline` comes first (a
/// subscription disabled, behind, or still copying a table).
fn wait_for_subscriptions(
    target: &SearchTarget,
    publisher_lsn: u64,
    deadline: Instant,
) -> Result<Option<u64>, SyncError> {
    let relations = catalog::replication::relations_fed_for(target.relid)?;
    loop {
        let feeds = catalog::replication::subscriptions_feeding(&relations)?;
        if feeds.is_empty() {
            return Err(SyncError::new(
                ErrorKind::Prerequisite,
                format!(
                    "no subscription feeds the table of meili_sync task {}",
                    target.task_id
                ),
            )
            .detail("publisher_lsn is a position in the WAL of the publisher a subscription copies the task's table from.")
            .hint("Leave out publisher_lsn to wait for this server's own writes (lsn), or run the wait on the search replica the subscription fills."));
        }
        if feeds.iter().all(|feed| feed.has_applied(publisher_lsn)) {
            return Ok(Some(catalog::source::wal_insert_position()?));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        // The apply workers set no latch of ours: look again shortly.
        shmem::waiters::nap(Duration::from_millis(10));
    }
}

/// The triggers on `meili_sync.tasks` and `meili_sync.task_secrets` that keep every backend's
/// cache of search targets true: a change to a task's URL, index, key columns, table or keys
/// invalidates them at commit.
#[pg_trigger]
fn meili_sync_invalidate_search_targets<'a>(
    trigger: &'a PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, std::convert::Infallible> {
    if let Ok(table) = trigger.relation() {
        catalog::search_targets::invalidate_search_targets(table.oid());
    }
    Ok(None)
}
