//! The servers and indexes a task writes to: the servers a new task gets (`url`, `replicas` or
//! `shards`), one task per index, the changes of replicas and shards that alter allows (each new
//! server a row of the task; a replica's or shard's row follows its task), and deleting a task's
//! indexes when it is dropped.

use pgrx::prelude::*;

use pg_meili_sync_core::meili::client::{
    Client, MeiliError, MeiliTaskStatus, HTTP_TIMEOUT, TASK_WAIT,
};
use pg_meili_sync_core::task::options::{Replica, TaskOptions};

use super::states;
use crate::catalog::{self, tasks::NewTask};
use crate::error::{ErrorKind, SyncError};
use crate::{gucs, plan};

/// The servers a new task writes to: its `replicas`, its `shards` (with their names, in the same
/// order), or its one `url` (else `meili_sync.url`). A server without a key of its own uses
/// `meili_sync.api_key`.
pub fn task_servers(parsed: &TaskOptions) -> Result<(Vec<Replica>, Vec<String>), SyncError> {
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
pub fn refuse_index_in_use(
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

/// The servers of a sharded task are its `shards` (which `change_shards` adds to): a change of
/// `url`, `api_key` or `replicas` would leave the others' network behind. A task that is not
/// sharded does not become so.
pub fn refuse_server_change_of_shards(
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
pub fn refuse_on_replica(
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
pub fn change_replicas(
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
    states::refuse_while_resyncing(record, &existing, "replicas")?;
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
pub fn change_shards(
    record: &catalog::tasks::TaskRecord,
    parsed: &TaskOptions,
) -> Result<Option<String>, SyncError> {
    let existing: Vec<catalog::tasks::TaskRecord> = std::iter::once(record.clone())
        .chain(catalog::tasks::replicas_of(record.id)?)
        .collect();
    states::refuse_while_resyncing(record, &existing[1..], "shards")?;
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

/// Why an index of the task's server could not be deleted, as an ERROR with what to do.
fn index_not_deleted(index_uid: &str, error: MeiliError) -> SyncError {
    SyncError::from(error)
        .context(&format!(
            "could not delete Meilisearch index \"{index_uid}\""
        ))
        .hint("Check that Meilisearch is reachable, or drop the task with drop_index => false.")
}

/// The client of the task row's server, and whether the index is there.
pub fn index_on_server(
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
pub fn delete_index(record: &catalog::tasks::TaskRecord, index_uid: &str) -> Result<(), SyncError> {
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
        // Gone before this deletion ran (another deletion was queued first): gone, as asked.
        MeiliTaskStatus::Failed if task.found_no_index() => Ok(()),
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
