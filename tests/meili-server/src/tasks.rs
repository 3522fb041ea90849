//! The task queue, batches, and the background processor that applies tasks.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};

use crate::docs::{document_id, geo_error, guess_primary_key, Doc, Prepared};
use crate::error::ApiError;
use crate::filter;
use crate::index::{Index, StoredDoc};
use crate::json::{array, object_of, Obj};
use crate::settings;
use crate::time::{iso_duration, rfc3339};
use crate::{lock, Shared};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Enqueued,
    Processing,
    Succeeded,
    Failed,
}

impl Status {
    pub(crate) const ALL: [&'static str; 5] =
        ["enqueued", "processing", "succeeded", "failed", "canceled"];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Status::Enqueued => "enqueued",
            Status::Processing => "processing",
            Status::Succeeded => "succeeded",
            Status::Failed => "failed",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    DocumentAdditionOrUpdate,
    DocumentDeletion,
    SettingsUpdate,
    IndexCreation,
    IndexUpdate,
    IndexDeletion,
    IndexSwap,
}

impl Kind {
    pub(crate) const ALL: [&'static str; 16] = [
        "documentAdditionOrUpdate",
        "documentEdition",
        "documentDeletion",
        "settingsUpdate",
        "indexCreation",
        "indexDeletion",
        "indexUpdate",
        "indexSwap",
        "taskCancelation",
        "taskDeletion",
        "dumpCreation",
        "snapshotCreation",
        "export",
        "upgradeDatabase",
        "indexCompaction",
        "networkTopologyChange",
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::DocumentAdditionOrUpdate => "documentAdditionOrUpdate",
            Kind::DocumentDeletion => "documentDeletion",
            Kind::SettingsUpdate => "settingsUpdate",
            Kind::IndexCreation => "indexCreation",
            Kind::IndexUpdate => "indexUpdate",
            Kind::IndexDeletion => "indexDeletion",
            Kind::IndexSwap => "indexSwap",
        }
    }
}

/// What a task does when processed.
pub(crate) enum Op {
    AddDocuments {
        docs: Vec<Prepared>,
        primary_key: Option<String>,
        merge: bool,
    },
    DeleteDocuments(Vec<String>),
    DeleteByFilter(Value),
    ClearDocuments,
    Settings(Vec<(String, Value)>),
    CreateIndex(Option<String>),
    UpdateIndex(Option<String>),
    DeleteIndex,
}

impl Op {
    fn kind(&self) -> Kind {
        match self {
            Op::AddDocuments { .. } => Kind::DocumentAdditionOrUpdate,
            Op::DeleteDocuments(_) | Op::DeleteByFilter(_) | Op::ClearDocuments => {
                Kind::DocumentDeletion
            }
            Op::Settings(_) => Kind::SettingsUpdate,
            Op::CreateIndex(_) => Kind::IndexCreation,
            Op::UpdateIndex(_) => Kind::IndexUpdate,
            Op::DeleteIndex => Kind::IndexDeletion,
        }
    }

    /// Task details while enqueued.
    fn details(&self) -> Vec<(String, Value)> {
        let d = |pairs: &[(&str, Value)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect::<Vec<_>>()
        };
        match self {
            Op::AddDocuments { docs, .. } => d(&[
                ("receivedDocuments", json!(docs.len())),
                ("indexedDocuments", Value::Null),
            ]),
            Op::DeleteDocuments(ids) => d(&[
                ("providedIds", json!(ids.len())),
                ("deletedDocuments", Value::Null),
                ("originalFilter", Value::Null),
            ]),
            Op::DeleteByFilter(f) => d(&[
                ("providedIds", json!(0)),
                ("deletedDocuments", Value::Null),
                ("originalFilter", json!(f.to_string())),
            ]),
            Op::ClearDocuments | Op::DeleteIndex => d(&[("deletedDocuments", Value::Null)]),
            Op::Settings(changes) => changes.clone(),
            Op::CreateIndex(pk) | Op::UpdateIndex(pk) => d(&[("primaryKey", json!(pk))]),
        }
    }

    fn batch_key(&self) -> Option<(bool, Option<&str>)> {
        match self {
            Op::AddDocuments {
                merge, primary_key, ..
            } => Some((*merge, primary_key.as_deref())),
            _ => None,
        }
    }
}

/// One pair of an index swap; with `rename`, the first index takes the second uid instead.
#[derive(Clone, Debug)]
pub(crate) struct Swap {
    pub(crate) indexes: [String; 2],
    pub(crate) rename: bool,
}

fn swap_details(swaps: &[Swap]) -> Vec<(String, Value)> {
    let list = swaps
        .iter()
        .map(|s| json!({"indexes": s.indexes, "rename": s.rename}))
        .collect();
    pairs(&[("swaps", Value::Array(list))])
}

/// What a task works on: one index, or the indexes of a swap (which has no `indexUid`).
enum Target {
    Index(String),
    Swaps(Vec<Swap>),
}

/// A task taken off the queue for processing.
enum Work {
    Index(String, Op),
    Swap(Vec<Swap>),
}

pub(crate) struct Task {
    pub(crate) uid: u32,
    pub(crate) batch_uid: Option<u32>,
    target: Target,
    pub(crate) status: Status,
    pub(crate) kind: Kind,
    details: Vec<(String, Value)>,
    error: Option<ApiError>,
    enqueued_at: SystemTime,
    started_at: Option<SystemTime>,
    finished_at: Option<SystemTime>,
    op: Option<Op>,
    /// Gone from the task list (as after `DELETE /tasks`, a restore from an older snapshot, or
    /// a wiped instance) while its work, if any, still runs.
    pub(crate) forgotten: bool,
}

impl Task {
    pub(crate) fn index_uid(&self) -> Option<&str> {
        match &self.target {
            Target::Index(uid) => Some(uid),
            Target::Swaps(_) => None,
        }
    }

    /// Whether the task belongs to index `uid`; Meilisearch files a swap under each of its
    /// indexes.
    pub(crate) fn concerns(&self, uid: &str) -> bool {
        match &self.target {
            Target::Index(own) => own == uid,
            Target::Swaps(swaps) => swaps.iter().any(|s| s.indexes.iter().any(|i| i == uid)),
        }
    }

    /// Puts `b` where the task names `a` and the other way round (task history after a swap).
    fn exchange(&mut self, a: &str, b: &str) {
        let exchange = |uid: &mut String| {
            if uid == a {
                *uid = b.to_string();
            } else if uid == b {
                *uid = a.to_string();
            }
        };
        match &mut self.target {
            Target::Index(uid) => exchange(uid),
            Target::Swaps(swaps) => {
                swaps
                    .iter_mut()
                    .flat_map(|s| s.indexes.iter_mut())
                    .for_each(exchange);
                self.details = swap_details(swaps);
            }
        }
    }

    pub(crate) fn to_json(&self) -> String {
        let duration = self
            .started_at
            .zip(self.finished_at)
            .map(|(s, f)| iso_duration(f.duration_since(s).unwrap_or_default()));
        Obj::new()
            .num("uid", self.uid)
            .opt_num("batchUid", self.batch_uid.map(u64::from))
            .opt_str("indexUid", self.index_uid())
            .str("status", self.status.name())
            .str("type", self.kind.name())
            .raw("canceledBy", "null")
            .raw("details", &object_of(&self.details))
            .raw(
                "error",
                &self.error.as_ref().map_or("null".into(), ApiError::to_json),
            )
            .opt_str("duration", duration.as_deref())
            .str("enqueuedAt", &rfc3339(self.enqueued_at))
            .opt_str("startedAt", self.started_at.map(rfc3339).as_deref())
            .opt_str("finishedAt", self.finished_at.map(rfc3339).as_deref())
            .end()
    }

    /// The 202 answer to a write.
    fn summary_json(&self) -> String {
        Obj::new()
            .num("taskUid", self.uid)
            .opt_str("indexUid", self.index_uid())
            .str("status", self.status.name())
            .str("type", self.kind.name())
            .str("enqueuedAt", &rfc3339(self.enqueued_at))
            .end()
    }
}

pub(crate) struct Batch {
    pub(crate) uid: u32,
    pub(crate) task_uids: Vec<u32>,
    started_at: SystemTime,
    finished_at: Option<SystemTime>,
}

impl Batch {
    pub(crate) fn to_json(&self, tasks: &[Task]) -> String {
        let tasks: Vec<&Task> = self
            .task_uids
            .iter()
            .filter_map(|uid| tasks.get(*uid as usize))
            .collect();
        // Details add up numbers over the tasks and keep the last value otherwise.
        let mut details: Vec<(String, Value)> = Vec::new();
        let (mut statuses, mut types, mut indexes) =
            (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        for t in &tasks {
            for (k, v) in &t.details {
                match details.iter_mut().find(|(dk, _)| dk == k) {
                    Some((_, old)) => {
                        *old = match (old.as_u64(), v.as_u64()) {
                            (Some(a), Some(b)) => json!(a + b),
                            _ => v.clone(),
                        }
                    }
                    None => details.push((k.clone(), v.clone())),
                }
            }
            *statuses.entry(t.status.name()).or_insert(0u64) += 1;
            *types.entry(t.kind.name()).or_insert(0u64) += 1;
            if let Some(uid) = t.index_uid() {
                *indexes.entry(uid).or_insert(0u64) += 1;
            }
        }
        let count_map = |m: BTreeMap<&str, u64>| {
            m.into_iter()
                .fold(Obj::new(), |o, (k, n)| o.num(k, n))
                .end()
        };
        let elapsed = self
            .finished_at
            .map(|f| f.duration_since(self.started_at).unwrap_or_default());
        let millis = format!(
            "{:.2}ms",
            elapsed.unwrap_or_default().as_secs_f64() * 1000.0
        );
        let kind = tasks.first().map(|t| t.kind);
        let mut stats = Obj::new()
            .num("totalNbTasks", tasks.len() as u64)
            .raw("status", &count_map(statuses))
            .raw("types", &count_map(types))
            .raw("indexUids", &count_map(indexes))
            .raw(
                "progressTrace",
                &Obj::new().str("processing tasks", &millis).end(),
            );
        if matches!(
            kind,
            Some(Kind::DocumentAdditionOrUpdate | Kind::SettingsUpdate)
        ) {
            stats = stats.raw(
                "writeChannelCongestion",
                r#"{"attempts":1,"blocking_attempts":0,"blocking_ratio":0.0}"#,
            );
        }
        if kind == Some(Kind::SettingsUpdate) {
            stats = stats.raw(
                "internalDatabaseSizes",
                r#"{"facetIdStringDocids":"4 KiB (+4 KiB)"}"#,
            );
        }
        let progress = match self.finished_at {
            Some(_) => "null".to_string(),
            None => format!(
                r#"{{"steps":[{{"currentStep":"processing tasks","finished":0,"total":{}}}],"percentage":0.0}}"#,
                tasks.len()
            ),
        };
        Obj::new()
            .num("uid", self.uid)
            .raw("progress", &progress)
            .raw("details", &object_of(&details))
            .raw("stats", &stats.end())
            .opt_str("duration", elapsed.map(iso_duration).as_deref())
            .str("startedAt", &rfc3339(self.started_at))
            .opt_str("finishedAt", self.finished_at.map(rfc3339).as_deref())
            .str("batchStrategy", "batched all enqueued tasks")
            .end()
    }
}

#[derive(Default)]
pub(crate) struct Queue {
    pub(crate) tasks: Vec<Task>,
    pub(crate) batches: Vec<Batch>,
    enqueued: BTreeSet<u32>,
    /// Tasks enqueued or processing.
    pub(crate) pending: usize,
    pub(crate) processing_index: Option<String>,
    pub(crate) last_update: Option<SystemTime>,
}

/// One batch taken off the queue: the uid and each task's uid and work.
type Taken = (u32, Vec<(u32, Work)>);

/// Outcome of one task: uid, final details and error.
type Done = (u32, Vec<(String, Value)>, Option<ApiError>);

impl Queue {
    /// Enqueues a task on one index and returns its summarized view.
    pub(crate) fn register(&mut self, index_uid: &str, op: Op) -> String {
        let (kind, details) = (op.kind(), op.details());
        self.push(
            Target::Index(index_uid.to_string()),
            kind,
            details,
            Some(op),
        )
    }

    /// Enqueues an index swap and returns its summarized view.
    pub(crate) fn register_swap(&mut self, swaps: Vec<Swap>) -> String {
        let details = swap_details(&swaps);
        self.push(Target::Swaps(swaps), Kind::IndexSwap, details, None)
    }

    fn push(
        &mut self,
        target: Target,
        kind: Kind,
        details: Vec<(String, Value)>,
        op: Option<Op>,
    ) -> String {
        let uid = self.tasks.len() as u32;
        let task = Task {
            uid,
            batch_uid: None,
            target,
            status: Status::Enqueued,
            kind,
            details,
            error: None,
            enqueued_at: SystemTime::now(),
            started_at: None,
            finished_at: None,
            op,
            forgotten: false,
        };
        let summary = task.summary_json();
        self.tasks.push(task);
        self.enqueued.insert(uid);
        self.pending += 1;
        summary
    }

    /// The oldest enqueued task plus, for document additions, the following compatible
    /// additions to the same index (auto-batching); marks them processing. Any other task of
    /// that index, a swap naming it included, ends the batch, so every task runs after all the
    /// tasks of its indexes enqueued before it.
    fn take_batch(&mut self) -> Option<Taken> {
        let first = *self.enqueued.first()?;
        let head = &self.tasks[first as usize];
        let index_uid = head.index_uid().map(String::from);
        let key = head.op.as_ref().and_then(Op::batch_key);
        let mut uids = vec![first];
        if let (Some(key), Some(index_uid)) = (key, &index_uid) {
            for uid in self.enqueued.iter().skip(1) {
                let t = &self.tasks[*uid as usize];
                if !t.concerns(index_uid) {
                    continue;
                }
                if t.op.as_ref().and_then(Op::batch_key) != Some(key) || uids.len() >= 1000 {
                    break;
                }
                uids.push(*uid);
            }
        }
        let batch_uid = self.batches.len() as u32;
        let now = SystemTime::now();
        let mut work = Vec::new();
        for uid in &uids {
            self.enqueued.remove(uid);
            let t = &mut self.tasks[*uid as usize];
            t.status = Status::Processing;
            t.batch_uid = Some(batch_uid);
            t.started_at = Some(now);
            let job = match &t.target {
                Target::Swaps(swaps) => Some(Work::Swap(swaps.clone())),
                Target::Index(index) => t.op.take().map(|op| Work::Index(index.clone(), op)),
            };
            work.extend(job.map(|job| (*uid, job)));
        }
        self.batches.push(Batch {
            uid: batch_uid,
            task_uids: uids,
            started_at: now,
            finished_at: None,
        });
        self.processing_index = index_uid;
        Some((batch_uid, work))
    }

    fn finish(&mut self, batch_uid: u32, results: Vec<Done>) {
        let now = SystemTime::now();
        for (uid, details, error) in results {
            let succeeded = error.is_none();
            let t = &mut self.tasks[uid as usize];
            t.status = if succeeded {
                Status::Succeeded
            } else {
                Status::Failed
            };
            t.details = details;
            t.error = error;
            t.finished_at = Some(now);
            self.pending -= 1;
            if succeeded {
                self.rewrite_history(uid);
            }
        }
        if let Some(b) = self.batches.get_mut(batch_uid as usize) {
            b.finished_at = Some(now);
        }
        self.processing_index = None;
        self.last_update = Some(now);
    }

    /// After swap `swap_uid`, the tasks before it name each swapped index by its new uid, as
    /// Meilisearch rewrites its task history. Those tasks are all finished (tasks run in
    /// order); the later ones, still enqueued, keep the uids they were sent with.
    fn rewrite_history(&mut self, swap_uid: u32) {
        let Target::Swaps(swaps) = &self.tasks[swap_uid as usize].target else {
            return;
        };
        let swaps = swaps.clone();
        for t in &mut self.tasks[..swap_uid as usize] {
            for s in &swaps {
                t.exchange(&s.indexes[0], &s.indexes[1]);
            }
        }
    }
}

/// The processor thread: one batch at a time, oldest task first.
pub(crate) fn run(shared: Arc<Shared>) {
    loop {
        let (batch_uid, work) = {
            let mut queue = lock(&shared.queue);
            loop {
                if shared.stopping() {
                    return;
                }
                if let Some(taken) = queue.take_batch() {
                    break taken;
                }
                queue = shared.cond.wait(queue).unwrap_or_else(|e| e.into_inner());
            }
        };
        // Simulated indexing time; re-read so that lowering the delay ends the wait early.
        let started = Instant::now();
        while started.elapsed() < shared.faults.task_delay() {
            if shared.stopping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let results = apply_batch(&shared, work);
        lock(&shared.queue).finish(batch_uid, results);
        shared.cond.notify_all();
    }
}

fn pairs(items: &[(&str, Value)]) -> Vec<(String, Value)> {
    items
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

fn get_index(shared: &Shared, uid: &str) -> Option<Arc<RwLock<Index>>> {
    lock(&shared.indexes).get(uid).cloned()
}

fn get_or_create(shared: &Shared, uid: &str) -> Arc<RwLock<Index>> {
    lock(&shared.indexes)
        .entry(uid.to_string())
        .or_insert_with(|| Arc::new(RwLock::new(Index::new(uid, None, SystemTime::now()))))
        .clone()
}

/// Runs the tasks of a batch. Its document additions (auto-batched: same index, same method
/// and primary key) run together in [`add_documents`], the other kinds hold one task.
fn apply_batch(shared: &Shared, work: Vec<(u32, Work)>) -> Vec<Done> {
    let mut results = Vec::new();
    let mut additions = Vec::new();
    let mut index_uid = String::new();
    for (uid, job) in work {
        let (index, op) = match job {
            Work::Index(index, op) => (index, op),
            Work::Swap(swaps) => {
                let error = swap_indexes(shared, &swaps).err();
                results.push((uid, swap_details(&swaps), error));
                continue;
            }
        };
        if let Some((details, error)) = injected_failure(shared, &op) {
            results.push((uid, details, Some(error)));
            continue;
        }
        match op {
            Op::AddDocuments {
                docs,
                primary_key,
                merge,
            } => {
                index_uid = index;
                additions.push((
                    uid,
                    Addition {
                        docs,
                        primary_key,
                        merge,
                    },
                ));
            }
            op => {
                let (details, error) = apply(shared, &index, op);
                results.push((uid, details, error));
            }
        }
    }
    if !additions.is_empty() {
        let (uids, additions): (Vec<u32>, Vec<Addition>) = additions.into_iter().unzip();
        let outcomes = add_documents(shared, &index_uid, additions);
        results.extend(
            uids.into_iter()
                .zip(outcomes)
                .map(|(uid, (details, error))| (uid, details, error)),
        );
    }
    results
}

/// A failure injected with [`crate::Faults::fail_next_tasks`], for document tasks.
fn injected_failure(shared: &Shared, op: &Op) -> Option<(Vec<(String, Value)>, ApiError)> {
    let is_document_task = matches!(
        op.kind(),
        Kind::DocumentAdditionOrUpdate | Kind::DocumentDeletion
    );
    if !is_document_task {
        return None;
    }
    let (code, kind) = shared.faults.take_task_failure()?;
    let mut details = op.details();
    for (k, v) in details.iter_mut() {
        if (k == "indexedDocuments" || k == "deletedDocuments") && v.is_null() {
            *v = json!(0);
        }
    }
    let mut error = ApiError::new(
        &code,
        format!("Injected failure: this task failed with `{code}`."),
    );
    if let Some(kind) = kind {
        error.kind = kind;
    }
    Some((details, error))
}

/// Runs one task; returns its final details and error.
fn apply(shared: &Shared, uid: &str, op: Op) -> Outcome {
    match op {
        Op::AddDocuments {
            docs,
            primary_key,
            merge,
        } => {
            let addition = Addition {
                docs,
                primary_key,
                merge,
            };
            add_documents(shared, uid, vec![addition])
                .pop()
                .unwrap_or_default()
        }
        Op::DeleteDocuments(ids) => {
            let provided = ids.len();
            let result = match get_index(shared, uid) {
                None => Err(ApiError::index_not_found(uid)),
                Some(index) => {
                    let mut idx = write(&index);
                    let deleted = ids.iter().filter(|id| idx.delete(id)).count();
                    idx.updated_at = SystemTime::now();
                    Ok(deleted)
                }
            };
            let details = pairs(&[
                ("providedIds", json!(provided)),
                ("deletedDocuments", json!(result.as_ref().unwrap_or(&0))),
                ("originalFilter", Value::Null),
            ]);
            (details, result.err())
        }
        Op::DeleteByFilter(filter) => {
            let result = delete_by_filter(shared, uid, &filter);
            let details = pairs(&[
                ("providedIds", json!(0)),
                ("deletedDocuments", json!(result.as_ref().unwrap_or(&0))),
                ("originalFilter", json!(filter.to_string())),
            ]);
            (details, result.err())
        }
        Op::ClearDocuments => {
            let result = match get_index(shared, uid) {
                None => Err(ApiError::index_not_found(uid)),
                Some(index) => {
                    let mut idx = write(&index);
                    idx.updated_at = SystemTime::now();
                    Ok(idx.clear())
                }
            };
            (
                pairs(&[("deletedDocuments", json!(result.as_ref().unwrap_or(&0)))]),
                result.err(),
            )
        }
        Op::Settings(changes) => {
            let index = get_or_create(shared, uid);
            let mut idx = write(&index);
            let mut updated = idx.settings.clone();
            settings::apply(&mut updated, &changes);
            // Turning the geo feature on makes Meilisearch extract (and check) the `_geo`
            // field of every stored document; one bad field fails the settings task.
            if settings::geo_enabled(&updated) && !settings::geo_enabled(&idx.settings) {
                if let Some(error) = stored_geo_error(&idx) {
                    return (changes, Some(error.prefixed(&format!("Index `{uid}`: "))));
                }
            }
            idx.settings = updated;
            idx.updated_at = SystemTime::now();
            (changes, None)
        }
        Op::CreateIndex(pk) => {
            let details = pairs(&[("primaryKey", json!(pk))]);
            let mut indexes = lock(&shared.indexes);
            if indexes.contains_key(uid) {
                let error = ApiError::new(
                    "index_already_exists",
                    format!("Index `{uid}` already exists."),
                );
                return (details, Some(error));
            }
            let index = Index::new(uid, pk, SystemTime::now());
            indexes.insert(uid.to_string(), Arc::new(RwLock::new(index)));
            (details, None)
        }
        Op::UpdateIndex(pk) => {
            let details = pairs(&[("primaryKey", json!(pk))]);
            let Some(index) = get_index(shared, uid) else {
                return (details, Some(ApiError::index_not_found(uid)));
            };
            let mut idx = write(&index);
            if let Some(pk) = pk {
                if idx.len() > 0 && idx.primary_key.as_deref() != Some(pk.as_str()) {
                    let current = idx.primary_key.clone().unwrap_or_default();
                    return (details, Some(pk_already_exists(&current)));
                }
                idx.primary_key = Some(pk);
            }
            idx.updated_at = SystemTime::now();
            (details, None)
        }
        Op::DeleteIndex => {
            let removed = lock(&shared.indexes).remove(uid);
            match removed {
                Some(index) => {
                    let n = read(&index).len();
                    (pairs(&[("deletedDocuments", json!(n))]), None)
                }
                None => (
                    pairs(&[("deletedDocuments", json!(0))]),
                    Some(ApiError::index_not_found(uid)),
                ),
            }
        }
    }
}

/// Applies every pair of a swap, or none of them: a missing index, or for a rename an existing
/// target, fails the task with Meilisearch's errors (every culprit named) and changes nothing.
/// Each index keeps its documents, settings, primary key and dates; only its uid changes.
fn swap_indexes(shared: &Shared, swaps: &[Swap]) -> Result<(), ApiError> {
    let mut indexes = lock(&shared.indexes);
    let mut missing = BTreeSet::new();
    let mut taken = BTreeSet::new();
    for Swap {
        indexes: [lhs, rhs],
        rename,
    } in swaps
    {
        if !indexes.contains_key(lhs) {
            missing.insert(lhs.as_str());
        }
        match (indexes.contains_key(rhs), *rename) {
            (true, true) => {
                taken.insert((lhs.as_str(), rhs.as_str()));
            }
            (false, false) => {
                missing.insert(rhs.as_str());
            }
            _ => {}
        }
    }
    let quoted = |uids: &[&str]| {
        let list: Vec<String> = uids.iter().map(|u| format!("`{u}`")).collect();
        list.join(", ")
    };
    let missing: Vec<&str> = missing.into_iter().collect();
    match missing.as_slice() {
        [] => {}
        [uid] => return Err(ApiError::index_not_found(uid)),
        _ => {
            let message = format!("Indexes {} not found.", quoted(&missing));
            return Err(ApiError::new("index_not_found", message));
        }
    }
    let taken: Vec<(&str, &str)> = taken.into_iter().collect();
    match taken.as_slice() {
        [] => {}
        [(lhs, rhs)] => {
            return Err(ApiError::new(
                "index_already_exists",
                format!("Cannot rename `{lhs}` to `{rhs}` as the index already exists. Hint: You can remove `{rhs}` first and then do your remove."),
            ));
        }
        _ => {
            let targets: Vec<&str> = taken.iter().map(|(_, rhs)| *rhs).collect();
            return Err(ApiError::new(
                "index_already_exists",
                format!("The following indexes are being renamed but cannot because their new name conflicts with an already existing index: {}. Renaming doesn't overwrite the other index name.", quoted(&targets)),
            ));
        }
    }
    for Swap {
        indexes: [lhs, rhs],
        ..
    } in swaps
    {
        let moves = [(indexes.remove(lhs), rhs), (indexes.remove(rhs), lhs)];
        for (index, uid) in moves {
            if let Some(index) = index {
                write(&index).uid = uid.clone();
                indexes.insert(uid.clone(), index);
            }
        }
    }
    Ok(())
}

fn pk_already_exists(pk: &str) -> ApiError {
    ApiError::new(
        "index_primary_key_already_exists",
        format!("Index already has a primary key: `{pk}`."),
    )
}

/// The payload of one document addition task.
struct Addition {
    docs: Vec<Prepared>,
    primary_key: Option<String>,
    merge: bool,
}

/// One task's documents that passed the primary key and id checks, keyed by id.
struct Staged {
    pk: String,
    keyed: Vec<(String, Prepared)>,
    merge: bool,
}

type Outcome = (Vec<(String, Value)>, Option<ApiError>);

/// Runs a batch of document additions to one index, as Meilisearch does: each task's documents
/// are checked first (a bad primary key or id fails that task alone, like the real per-payload
/// errors); then, if the geo feature is on, the `_geo` fields of what the batch would store. A bad
/// `_geo` fails the indexing of the whole batch, so every task of it fails with that error
/// (prefixed with the index) and nothing is written. Otherwise the valid tasks are written in
/// order. Returns each task's details and error, in order.
fn add_documents(shared: &Shared, uid: &str, additions: Vec<Addition>) -> Vec<Outcome> {
    let index = get_index(shared, uid);
    let (mut current, geo) = index.as_ref().map_or((None, false), |index| {
        let idx = read(index);
        (
            idx.primary_key.clone(),
            settings::geo_enabled(&idx.settings),
        )
    });
    let mut staged = Vec::with_capacity(additions.len());
    for addition in additions {
        let received = addition.docs.len();
        let result = stage(current.as_deref(), addition);
        if let Ok(s) = &result {
            // A task that passes sets the primary key the next ones of the batch see.
            current = Some(s.pk.clone());
        }
        staged.push((received, result));
    }
    let details = |received: usize, indexed: usize| {
        pairs(&[
            ("receivedDocuments", json!(received)),
            ("indexedDocuments", json!(indexed)),
        ])
    };
    if geo {
        let passed = staged.iter().filter_map(|(_, r)| r.as_ref().ok());
        if let Some(error) = batch_geo_error(passed) {
            let error = error.prefixed(&format!("Index `{uid}`: "));
            return staged
                .iter()
                .map(|(received, _)| (details(*received, 0), Some(error.clone())))
                .collect();
        }
    }
    staged
        .into_iter()
        .map(|(received, result)| match result {
            Ok(s) => {
                let indexed = write_documents(shared, uid, s);
                (details(received, indexed), None)
            }
            Err(error) => (details(received, 0), Some(error)),
        })
        .collect()
}

/// Validates one task's primary key and every document id; `current` is the index's primary
/// key (or the one an earlier task of the batch set).
fn stage(current: Option<&str>, addition: Addition) -> Result<Staged, ApiError> {
    let Addition {
        docs,
        primary_key,
        merge,
    } = addition;
    let pk = match (current, primary_key) {
        (Some(current), Some(asked)) if current != asked => return Err(pk_already_exists(current)),
        (Some(current), _) => current.to_string(),
        (None, Some(asked)) => asked,
        (None, None) => guess_primary_key(docs.first().map(|p| &p.doc))?,
    };
    let keyed = docs
        .into_iter()
        .map(|p| document_id(&p.doc, &pk).map(|id| (id, p)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Staged { pk, keyed, merge })
}

/// The first bad `_geo` among the documents a batch would store. A later version of a
/// document supersedes an earlier one's `_geo` when it replaces the document or (merging)
/// carries its own `_geo`; a merged `_geo` kept from the stored document is valid already,
/// since the index holds no bad `_geo` while the geo feature is on.
fn batch_geo_error<'a>(staged: impl Iterator<Item = &'a Staged>) -> Option<ApiError> {
    let versions: Vec<(&str, &Doc, bool)> = staged
        .flat_map(|s| s.keyed.iter().map(|(id, p)| (id.as_str(), &p.doc, s.merge)))
        .collect();
    let mut last = HashMap::new();
    for (i, (id, doc, merge)) in versions.iter().enumerate() {
        if !merge || doc.contains_key("_geo") {
            last.insert(*id, i);
        }
    }
    versions
        .iter()
        .enumerate()
        .filter(|(i, (id, _, _))| last.get(id) == Some(i))
        .find_map(|(_, (id, doc, _))| doc.get("_geo").and_then(|geo| geo_error(id, geo)))
}

/// The first stored document with a bad `_geo` (checked when the geo feature is turned on).
fn stored_geo_error(idx: &Index) -> Option<ApiError> {
    let pk = idx.primary_key.clone().unwrap_or_default();
    // A `_geo` key shows in the stored text unless it was written with escapes.
    let may_have_geo = |d: &&StoredDoc| d.json.contains("_geo") || d.json.contains('\\');
    idx.iter().filter(may_have_geo).find_map(|d| {
        let doc = d.parse();
        let geo = doc.get("_geo")?;
        geo_error(&document_id(&doc, &pk).ok()?, geo)
    })
}

/// Writes a staged task's documents (creating the index if needed); returns how many distinct
/// documents it indexed.
fn write_documents(shared: &Shared, uid: &str, staged: Staged) -> usize {
    let Staged { pk, keyed, merge } = staged;
    let distinct = keyed
        .iter()
        .map(|(id, _)| id.as_str())
        .collect::<HashSet<_>>()
        .len();
    // The index is only created by a task that passed its checks, as a failed batch leaves
    // no index behind.
    let index = get_or_create(shared, uid);
    // Parsed documents are dropped after the index lock is released.
    let mut parsed = Vec::with_capacity(keyed.len());
    {
        let mut idx = write(&index);
        idx.primary_key.get_or_insert(pk);
        for (id, p) in keyed {
            let old = if merge {
                idx.get(&id).map(|old| old.parse())
            } else {
                None
            };
            let p = match old {
                Some(mut doc) => {
                    doc.extend(p.doc);
                    Prepared::new(doc)
                }
                None => p,
            };
            idx.put(id, p.json, &p.doc);
            parsed.push(p.doc);
        }
        idx.updated_at = SystemTime::now();
    }
    if parsed.len() > 1000 {
        // Freeing many small allocations takes a while in debug builds; do not delay the task.
        std::thread::spawn(move || drop(parsed));
    }
    distinct
}

fn delete_by_filter(shared: &Shared, uid: &str, filter: &Value) -> Result<usize, ApiError> {
    let index = get_index(shared, uid).ok_or_else(|| ApiError::index_not_found(uid))?;
    let invalid =
        |m: String| ApiError::new("invalid_document_filter", format!("Index `{uid}`: {m}"));
    let mut idx = write(&index);
    let Some(f) = filter::from_json(filter).map_err(invalid)? else {
        return Ok(0);
    };
    f.check_filterable(&settings::filterable_patterns(&idx.settings))
        .map_err(invalid)?;
    let pk = idx.primary_key.clone().unwrap_or_default();
    let ids: Vec<String> = idx
        .iter()
        .map(|d| d.parse())
        .filter(|d| f.matches(d))
        .filter_map(|d| document_id(&d, &pk).ok())
        .collect();
    let deleted = ids.iter().filter(|id| idx.delete(id)).count();
    idx.updated_at = SystemTime::now();
    Ok(deleted)
}

pub(crate) fn read(index: &RwLock<Index>) -> std::sync::RwLockReadGuard<'_, Index> {
    index.read().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn write(index: &RwLock<Index>) -> std::sync::RwLockWriteGuard<'_, Index> {
    index.write().unwrap_or_else(|e| e.into_inner())
}

/// `GET /tasks` and `GET /batches` listing: newest first unless `reverse`, from `from`;
/// `total` is the number of matches, which can exceed the items listed.
pub(crate) fn page<T>(
    mut items: Vec<(u32, T)>,
    total: usize,
    limit: usize,
    from: Option<u32>,
    reverse: bool,
    render: impl Fn(&T) -> String,
) -> String {
    if reverse {
        items.sort_by_key(|(uid, _)| *uid);
    } else {
        items.sort_by_key(|(uid, _)| std::cmp::Reverse(*uid));
    }
    let start = from.map_or(0, |from| {
        items
            .iter()
            .position(|(uid, _)| if reverse { *uid >= from } else { *uid <= from })
            .unwrap_or(items.len())
    });
    let shown = &items[start..(start + limit).min(items.len())];
    let next = items.get(start + limit).map(|(uid, _)| u64::from(*uid));
    Obj::new()
        .raw("results", &array(shown.iter().map(|(_, t)| render(t))))
        .num("total", total as u64)
        .num("limit", limit as u64)
        .opt_num("from", shown.first().map(|(uid, _)| u64::from(*uid)))
        .opt_num("next", next)
        .end()
}
