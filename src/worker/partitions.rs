//! The partitions of a task's partitioned tables (a table task's table, or the partitioned
//! tables a view reads) change without row changes in the WAL: a partition attached brings rows
//! that were never changes, one detached or dropped takes its rows away silently, and a TRUNCATE
//! of some partitions cannot be mapped to documents. A `PartitionWatch` notices each, and has the
//! index brought in line once Meilisearch has everything before it, before the slot is confirmed
//! past it (a worker that dies before reads it again and does it again).

use std::time::{Duration, Instant};

use pgrx::prelude::*;

use pg_meili_sync_core::pipeline::due::Due;
use pg_meili_sync_core::task::failure::{Advice, Failure, FailureKind};
use pg_meili_sync_core::task::options::TaskOptions;

use crate::catalog::{self, tasks::TaskRecord};
use crate::error::ErrorKind;
use crate::plan::{check_task_source, SnapshotPlan};
use crate::shmem::{self, live::LiveStatus};
use crate::worker::control::{
    in_transaction, in_user_transaction, in_user_transaction_retrying, Stop,
};
use crate::worker::drive::DueWork;

/// How often a task looks for partitions detached, dropped or attached, besides at once after a
/// commit that may have changed some (`shmem::commits::note_sources_changed_at_commit`).
const LOOK_INTERVAL: Duration = Duration::from_secs(2);

pub struct PartitionWatch {
    task: TaskRecord,
    options: TaskOptions,
    /// The table or view, for the log.
    source: String,
    /// The partitioned tables whose partitions are followed.
    roots: Vec<u32>,
    /// A view task's documents may be made of rows of several partitions and tables, so every
    /// change of partitions is followed by a repair (which compares bodies), never a prune only.
    is_view: bool,
    /// The commit of the last partial TRUNCATE read, or where partitions were found changed:
    /// once Meilisearch has confirmed everything up to it, the index is brought in line.
    due: Due,
    /// Partitions attached with rows: theirs are sent (`verify::repair_partitions`).
    attached: Vec<u32>,
    /// Rows are gone without row changes (a partial TRUNCATE, a partition detached or
    /// dropped): the documents whose rows no longer exist are deleted (`verify::prune`).
    prune: bool,
    /// The leaf partitions when last looked at, in OID order.
    leaves: Vec<u32>,
    /// The leaf partitions the catalog says the index is in line with
    /// (`catalog::tasks::save_partitions`).
    stored: Option<Vec<u32>>,
    next_look: Instant,
    /// `shmem::commits::sources_changed` at the last look: when it moves, the next look is now.
    changes_seen: u64,
}

impl PartitionWatch {
    /// A watch over the plan's partitioned tables (None when there is none). The plan's leaf
    /// partitions, as the worker found them when it checked the source, are taken as the
    /// index's unless the catalog has those (`TaskRecord::partitions`): then the first look, at
    /// once, brings in or prunes what changed while no worker looked.
    pub fn of_plan(
        plan: &SnapshotPlan,
        task: &TaskRecord,
        options: &TaskOptions,
        is_view: bool,
    ) -> Option<PartitionWatch> {
        if plan.partitioned_roots.is_empty() {
            return None;
        }
        Some(PartitionWatch {
            task: task.clone(),
            options: options.clone(),
            source: task.relation.clone(),
            roots: plan.partitioned_roots.clone(),
            is_view,
            due: Due::default(),
            attached: Vec::new(),
            prune: false,
            leaves: task
                .partitions
                .clone()
                .unwrap_or_else(|| plan.partitions.clone()),
            stored: task.partitions.clone(),
            next_look: Instant::now(),
            changes_seen: shmem::commits::sources_changed(),
        })
    }

    /// Whether a TRUNCATE empties some partitions of a followed table but not all of them. Their
    /// documents cannot be told from the others' by their ids, so instead of deleting the whole
    /// index (or nothing), the task prunes (`truncated`): once Meilisearch has everything before
    /// it, the documents whose rows are gone are deleted, which is exact whenever it runs after
    /// the TRUNCATE, since every later change is streamed after the prune's deletes. Looked up
    /// inside the decoding callback, so the partitions are those of the truncating transaction.
    pub fn is_partial_truncate(&self, truncated: &[u32]) -> bool {
        self.roots.iter().any(|&root| {
            let leaves = catalog::source::partition_leaves(root);
            let emptied = leaves
                .iter()
                .filter(|leaf| truncated.contains(leaf))
                .count();
            emptied > 0 && emptied < leaves.len()
        })
    }

    /// A partial TRUNCATE committed at `commit` (see `is_partial_truncate`).
    pub fn truncated(&mut self, task_id: i64, commit: u64) {
        log!(
            "pg_meili_sync task {task_id}: a TRUNCATE emptied some partitions of {}; their documents are deleted once everything before it is in the index",
            self.source
        );
        self.prune = true;
        self.due.set(commit);
    }

    /// Every few seconds: the leaf partitions now, against those the index is in line with. A
    /// partition that is gone has its documents pruned. A new one that has rows is checked as
    /// `meili_sync_start` checks every partition (logged, a replica identity that carries the
    /// key), then its rows are brought in by a repair, which sends what the index lacks. A new
    /// partition without pages (created ahead) streams like the others.
    pub fn look(&mut self, live: LiveStatus) -> Result<(), Stop> {
        let changes = shmem::commits::sources_changed();
        if Instant::now() < self.next_look && changes == self.changes_seen {
            return Ok(());
        }
        self.next_look = Instant::now() + LOOK_INTERVAL;
        self.changes_seen = changes;
        let roots = &self.roots;
        let (leaves, now) = in_transaction(live, "looking at the partitions", || {
            Ok((
                catalog::source::leaves_of(roots)?,
                catalog::source::wal_insert_position()?,
            ))
        })?;
        let attached: Vec<u32> = leaves
            .iter()
            .filter(|(leaf, has_pages)| *has_pages && !self.leaves.contains(leaf))
            .map(|(leaf, _)| *leaf)
            .collect();
        let current: Vec<u32> = leaves.iter().map(|(leaf, _)| *leaf).collect();
        let gone = self.leaves.iter().any(|leaf| !current.contains(leaf));
        if !attached.is_empty() {
            // Refused as meili_sync_start refuses it. The way back is a new copy: a task of 0.2.0
            // that had not recorded its partitions yet would not know the partition as new.
            let (task, options) = (&self.task, &self.options);
            let checked = in_transaction(live, "checking a partition attached", || {
                Ok(check_task_source(task, options))
            })?;
            if let Err(error) = checked {
                let fix = error.hint.as_deref().map_or_else(
                    || "fix the partition".to_owned(),
                    |hint| hint.trim_end_matches('.').to_owned(),
                );
                return Err(Stop::Failed(
                    Failure::new(FailureKind::Source, error.message)
                        .advice(Advice::FixThenSnapshot(fix)),
                ));
            }
            log!(
                "pg_meili_sync task {}: a partition was attached to {} with rows; they are sent once everything before it is in the index",
                self.task.id,
                self.source
            );
        } else if gone {
            log!(
                "pg_meili_sync task {}: a partition of {} was detached or dropped; its documents are brought in line once everything before it is in the index",
                self.task.id,
                self.source
            );
        }
        if !attached.is_empty() || gone {
            self.attached.extend(attached);
            self.prune |= gone;
            self.due.set(now);
        }
        self.leaves = current;
        self.store(live)
    }

    /// Records the leaf partitions in the catalog once the index is in line with them: nothing
    /// is due.
    fn store(&mut self, live: LiveStatus) -> Result<(), Stop> {
        if self.due.is_set() || self.stored.as_ref() == Some(&self.leaves) {
            return Ok(());
        }
        let (task_id, leaves) = (self.task.id, &self.leaves);
        in_transaction(live, "recording the partitions", || {
            catalog::tasks::save_partitions(task_id, leaves)
        })?;
        self.stored = Some(self.leaves.clone());
        Ok(())
    }

    /// Something is due, or a look: the stream is not quiet.
    pub fn pending(&self) -> bool {
        self.due.is_set()
            || Instant::now() >= self.next_look
            || shmem::commits::sources_changed() != self.changes_seen
    }
}

impl DueWork for PartitionWatch {
    fn due(&mut self) -> &mut Due {
        &mut self.due
    }

    /// Brings the index in line with the partitions.
    fn work(&mut self, live: LiveStatus) -> Result<(), Stop> {
        // A view's documents may be made of rows of several partitions and tables: repaired
        // whole, bodies compared.
        let whole =
            self.is_view || !repair_partitions(&self.task, &self.roots, &self.attached, live)?;
        if whole {
            repair_index(&self.task, live)?;
        } else if self.prune {
            prune_index(&self.task, live)?;
        }
        self.due.clear();
        self.attached.clear();
        self.prune = false;
        self.store(live)
    }
}

/// Sends the rows of the partitions `attached` (those still partitions of `roots`), reading only
/// them (`verify::repair_partitions`), once their writers are visible
/// (`verify::wait_for_partition_writers`). False, with nothing done, when one of them cannot be
/// read on its own: then the whole table is repaired.
fn repair_partitions(
    task: &TaskRecord,
    roots: &[u32],
    attached: &[u32],
    live: LiveStatus,
) -> Result<bool, Stop> {
    if attached.is_empty() {
        return Ok(true);
    }
    // One detached or dropped since is pruned instead (its documents are gone too).
    let attached = in_transaction(live, "looking at the partitions attached", || {
        let still = catalog::source::leaves_of(roots)?;
        Ok(attached
            .iter()
            .copied()
            .filter(|leaf| still.iter().any(|(other, _)| other == leaf))
            .collect::<Vec<u32>>())
    })?;
    let readable = in_user_transaction(
        live,
        "waiting for the writers of partitions attached",
        Advice::FixThenResume,
        || crate::verify::wait_for_partition_writers(task, &attached),
    )?;
    if !readable {
        return Ok(false);
    }
    let sent = in_user_transaction_retrying(
        live,
        "sending the rows of partitions attached",
        Advice::FixThenResume,
        |error| error.kind == ErrorKind::Meilisearch,
        || crate::verify::repair_partitions(task.clone(), &attached),
    )?;
    log!(
        "pg_meili_sync task {}: sent {sent} rows of the partitions attached",
        task.id
    );
    Ok(true)
}

/// Sends the rows the index lacks or holds in another version, and deletes the documents of rows
/// that no longer exist (see `verify::repair`), retrying while Meilisearch is unreachable. An
/// ERROR of the source's own code (a view's query, a type's output) stops the task, never the
/// worker.
fn repair_index(task: &TaskRecord, live: LiveStatus) -> Result<(), Stop> {
    let repairs = in_user_transaction_retrying(
        live,
        "bringing the index in line with the partitions",
        Advice::FixThenResume,
        |error| error.kind == ErrorKind::Meilisearch,
        || crate::verify::repair(task.clone()),
    )?;
    if repairs.resent > 0 || repairs.deleted > 0 {
        log!(
            "pg_meili_sync task {}: sent {} rows the index lacked or held in another version, deleted {} documents whose rows no longer exist",
            task.id,
            repairs.resent,
            repairs.deleted
        );
    }
    Ok(())
}

/// Deletes the documents of rows that no longer exist (see `verify::prune`), retrying while
/// Meilisearch is unreachable.
pub fn prune_index(task: &TaskRecord, live: LiveStatus) -> Result<(), Stop> {
    let deleted = in_user_transaction_retrying(
        live,
        "deleting the documents whose rows no longer exist",
        Advice::FixThenResume,
        |error| error.kind == ErrorKind::Meilisearch,
        || crate::verify::prune(task.clone()),
    )?;
    if deleted > 0 {
        log!(
            "pg_meili_sync task {}: deleted {deleted} documents whose rows no longer exist",
            task.id
        );
    }
    Ok(())
}
