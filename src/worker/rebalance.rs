//! Shards: each shard's Meilisearch network, and the rebalance after a shard was added.
//!
//! `meili_sync_alter` with more `shards` adds a row per new shard, with the new shard list; it
//! copies the documents whose id hashes to it while the old shards stream on with the old list,
//! keeping every document they have (searches still ask the old shards only). Once every new
//! shard has its copy, the launcher starts this worker beside the task's streams. It waits until
//! the new shards have streamed up to now, names every shard in every server's network, and gives
//! every row the new list at one commit (searches then ask all shards; the old shards stop
//! writing the ids that moved). Once every shard has passed that commit, it deletes from each old
//! shard the documents that moved. Until then a moved document is on two shards (a search may
//! show it twice), never on none.

use std::time::Duration;

use pgrx::bgworkers::BackgroundWorker;
use pgrx::prelude::*;

use pg_meili_sync_core::meili::client::Client;
use pg_meili_sync_core::meili::client::HTTP_TIMEOUT;
use pg_meili_sync_core::meili::network::{network_body, network_leader};
use pg_meili_sync_core::task::failure::{Failure, FailureKind};

use crate::catalog::{self, tasks::TaskRecord};
use crate::shmem::{
    self,
    live::{LiveStatus, Phase, WorkerId},
};
use crate::worker::control::{
    await_meili_task, fail, in_transaction, should_stop, with_retry, worker_main, Stop,
};
use crate::worker::partitions::prune_index;

/// A shard names its server in Meilisearch's network, with every shard of the task as a remote
/// (`shards`: name, URL, search key), so that a federated search through any shard reaches all
/// of them. A network with a leader (the enterprise edition's sharding) routes documents itself:
/// refused.
pub fn set_network(
    live: LiveStatus,
    client: &Client,
    task: &TaskRecord,
    shards: &[(String, String, Option<String>)],
) -> Result<(), Stop> {
    let Some(name) = task.shard.as_deref() else {
        return Ok(());
    };
    with_retry(live, "turning on Meilisearch's network feature", || {
        client.enable_network()
    })?;
    let current = with_retry(live, "reading the Meilisearch network", || client.network())?;
    if let Some(leader) = network_leader(&current) {
        return Err(Failure::new(
            FailureKind::Meilisearch,
            format!(
                "the Meilisearch server at {} is in a network led by \"{leader}\", which shards documents itself",
                task.url
            ),
        )
        .hint("pg_meili_sync does not write into an enterprise network with a leader yet: remove the leader from the servers' network (PATCH /network), then SELECT meili_sync_resume(task)")
        .into());
    }
    let remotes: Vec<(&str, &str, Option<&str>)> = shards
        .iter()
        .map(|(shard, url, key)| (shard.as_str(), url.as_str(), key.as_deref()))
        .collect();
    let body = network_body(name, &remotes);
    let answer = with_retry(live, "setting the Meilisearch network", || {
        client.update_network(&body)
    })?;
    if let Some(uid) = answer.get("taskUid").and_then(serde_json::Value::as_u64) {
        await_meili_task(live, client, uid, "setting the Meilisearch network")?;
    }
    Ok(())
}

/// The task's own row and its shards' rows.
fn shard_rows(task_id: i64) -> Result<Vec<TaskRecord>, crate::error::SyncError> {
    let mut rows: Vec<TaskRecord> = catalog::tasks::load_task(task_id)?.into_iter().collect();
    rows.extend(catalog::tasks::replicas_of(task_id)?);
    Ok(rows)
}

/// Waits until each of `rows` has confirmed every change committed before `lsn` (its published
/// position, else its stored one).
fn wait_passed(live: LiveStatus, rows: &[i64], lsn: u64) -> Result<(), Stop> {
    let mut waiting: Vec<i64> = rows.to_vec();
    let mut checks = 0u32;
    loop {
        waiting.retain(|row| !shmem::live::confirmed_past(*row, lsn));
        if !waiting.is_empty() && checks.is_multiple_of(10) {
            let stored = in_transaction(live, "reading the shards' positions", || {
                catalog::tasks::stored_positions(&waiting)
            })?;
            waiting.retain(|row| {
                !stored
                    .iter()
                    .any(|(id, position)| id == row && *position >= lsn)
            });
        }
        if waiting.is_empty() {
            return Ok(());
        }
        checks = checks.wrapping_add(1);
        if should_stop() || !BackgroundWorker::wait_latch(Some(Duration::from_millis(100))) {
            return Err(Stop::Terminated);
        }
    }
}

fn run(task_id: i64, live: LiveStatus) -> Result<(), Stop> {
    live.set_phase(Phase::Starting);
    let rows = in_transaction(live, "reading the task's shards", || shard_rows(task_id))?;
    let target = rows
        .iter()
        .filter_map(|row| row.shard_names.clone())
        .max_by_key(Vec::len)
        .ok_or(Stop::Terminated)?;
    let all: Vec<i64> = rows.iter().map(|row| row.id).collect();
    if rows
        .iter()
        .any(|row| row.shard_names.as_ref() != Some(&target))
    {
        // The new shards hold everything committed so far before searches ask them.
        let added: Vec<i64> = rows
            .iter()
            .filter(|row| row.shard_names.as_ref() == Some(&target))
            .map(|row| row.id)
            .collect();
        let now = in_transaction(live, "reading the WAL position", catalog::current_wal_lsn)?;
        live.report_step(&format!(
            "task {task_id}: waiting for the new shards to stream up to {}",
            catalog::format_lsn(now)
        ));
        wait_passed(live, &added, now)?;
        live.report_step(&format!(
            "task {task_id}: setting every shard's network, then the new shard list"
        ));
        let shards = in_transaction(live, "reading the task's shards", || {
            catalog::tasks::shard_servers(task_id)
        })?;
        for row in &rows {
            let client = Client::new(&row.url, row.api_key.as_deref(), HTTP_TIMEOUT)
                .map_err(|error| fail(FailureKind::Source, error.to_string()))?;
            set_network(live, &client, row, &shards)?;
        }
        let moved_from = in_transaction(live, "giving every shard the new shard list", || {
            catalog::tasks::adopt_shard_names(task_id, &target)
        })?;
        log!(
            "pg_meili_sync task {task_id}: every shard now has the shard list {}; shards {moved_from:?} keep only their own documents from here on",
            target.join(", ")
        );
    }
    let pending = in_transaction(live, "noting where the moved documents go", || {
        catalog::tasks::note_prune_position(task_id)
    })?;
    for (row, after) in pending {
        // Every shard has passed the new list's commit: the old shard writes no moved id again,
        // and the new one holds each of them.
        live.report_step(&format!(
            "task {task_id}: waiting for every shard to pass {}",
            catalog::format_lsn(after)
        ));
        wait_passed(live, &all, after)?;
        let record = in_transaction(live, "reading the shard", || catalog::tasks::load_task(row))?
            .ok_or(Stop::Terminated)?;
        live.report_step(&format!(
            "task {task_id}: deleting from shard \"{}\" the documents that moved",
            record.shard.as_deref().unwrap_or_default()
        ));
        prune_index(&record, live)?;
        in_transaction(live, "noting the moved documents deleted", || {
            catalog::tasks::prune_done(row)
        })?;
        log!(
            "pg_meili_sync task {task_id}: shard \"{}\" holds only its own documents",
            record.shard.as_deref().unwrap_or_default()
        );
    }
    Ok(())
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn meili_sync_rebalance_main(arg: pg_sys::Datum) {
    let task_id = arg.value() as i64;
    worker_main(WorkerId::Rebalance(task_id), |live, _| run(task_id, live));
}
