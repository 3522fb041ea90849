//! Counters, worker states and waiting backends, from shared memory.

use pgrx::datum::TimestampWithTimeZone;
use pgrx::prelude::*;

use super::require_admin;
use crate::catalog;
use crate::error::OrRaise;
use crate::shmem;

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
        shmem::live::task_counters()
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

/// Zeroes the cumulative counters of `pg_stat_meili_sync`: of one task (with its replicas' or
/// shards' rows when it is a task's own row), or of all.
#[pg_extern(volatile, parallel_unsafe)]
fn pg_stat_meili_sync_reset(task: default!(Option<i64>, "NULL")) -> bool {
    let result = (|| {
        require_admin()?;
        if !crate::preloaded() {
            return Ok(true);
        }
        match task {
            None => shmem::live::reset_counters(None),
            Some(id) => {
                shmem::live::reset_counters(Some(id));
                for member in crate::catalog::tasks::replicas_of(id)? {
                    shmem::live::reset_counters(Some(member.id));
                }
            }
        }
        Ok(true)
    })();
    result.or_raise()
}

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
        name!(progressed_at, Option<TimestampWithTimeZone>),
    ),
> {
    let tasks = if crate::preloaded() {
        shmem::live::live_tasks()
    } else {
        Vec::new()
    };
    // An error can quote a row's values: each is shown as `catalog::readable_error` allows.
    let sources = catalog::task_sources().or_raise();
    let tasks: Vec<_> = tasks
        .into_iter()
        .map(|mut live| {
            live.last_error =
                catalog::readable_error(sources.get(&live.task_id).copied(), live.last_error)
                    .or_raise();
            live
        })
        .collect();
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
            live.progressed_at
                .and_then(|at| TimestampWithTimeZone::try_from(at).ok()),
        )
    }))
}

/// A task's error as the calling role may read it (`catalog::readable_error`): the view
/// `meili_sync_status` shows the catalog's errors through it.
#[pg_extern(stable, parallel_safe)]
fn meili_sync_readable_error(source: Option<pg_sys::Oid>, error: Option<String>) -> Option<String> {
    catalog::readable_error(source, error).or_raise()
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
        shmem::waiters::waiting_backends()
    } else {
        Vec::new()
    };
    TableIterator::new(
        waiting
            .into_iter()
            .map(|(pid, task, lsn)| (pid, task, catalog::format_lsn(lsn))),
    )
}
