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

    fn auto(&self) -> Auto<'_> {
        match self {
            Op::AddDocuments { primary_key, .. } => Auto::Import(primary_key.as_deref()),
            Op::DeleteDocuments(_) => Auto::Deletion { by_filter: false },
            Op::DeleteByFilter(_) => Auto::Deletion { by_filter: true },
            Op::ClearDocuments => Auto::Clear,
            Op::Settings(_) => Auto::Settings,
            Op::DeleteIndex => Auto::IndexDeletion,
            Op::CreateIndex(_) | Op::UpdateIndex(_) => Auto::Alone,
        }
    }

    /// Details of a task that ends without being applied: counts still unknown become 0.
    fn finished_details(&self) -> Vec<(String, Value)> {
        let mut details = self.details();
        for (k, v) in details.iter_mut() {
            if (k == "indexedDocuments" || k == "deletedDocuments") && v.is_null() {
                *v = json!(0);
            }
        }
        details
    }
}

/// How a task takes part in auto-batching (Meilisearch's `AutobatchKind`).
enum Auto<'a> {
    /// A document addition or update, with the primary key it asks for.
    Import(Option<&'a str>),
    Deletion {
        by_filter: bool,
    },
    Clear,
    Settings,
    IndexDeletion,
    /// Index creation or update: a batch of its own.
    Alone,
}

/// What a batch on one index does (Meilisearch's `BatchKind`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum BatchKind {
    /// Additions, replacements and deletions by id, indexed together in task order.
    Documents,
    Deletions {
        by_filter: bool,
    },
    /// Document clears, absorbing the document tasks batched before them.
    Clear,
    Settings,
    ClearAndSettings,
    /// An index deletion, absorbing the tasks batched before it.
    IndexDeletion,
    Alone,
}

/// What auto-batching does with the next task of the index.
enum Next {
    Take(BatchKind),
    /// Take it and close the batch.
    TakeLast(BatchKind),
    Stop,
}

impl BatchKind {
    /// The batch the oldest enqueued task starts.
    fn start(auto: &Auto, index_pk: Option<&str>) -> Next {
        match auto {
            Auto::Alone => Next::TakeLast(BatchKind::Alone),
            Auto::IndexDeletion => Next::TakeLast(BatchKind::IndexDeletion),
            Auto::Clear => Next::Take(BatchKind::Clear),
            Auto::Settings => Next::Take(BatchKind::Settings),
            Auto::Deletion { by_filter } => Next::Take(BatchKind::Deletions {
                by_filter: *by_filter,
            }),
            // An addition asking for another primary key than the index's fails on its own.
            Auto::Import(Some(pk)) if index_pk.is_some_and(|current| current != *pk) => {
                Next::TakeLast(BatchKind::Documents)
            }
            Auto::Import(_) => Next::Take(BatchKind::Documents),
        }
    }

    /// Whether the next task of the index joins the batch, as Meilisearch 1.50's autobatcher
    /// decides: document additions, updates and deletions by id go together; a clear absorbs
    /// the document tasks before it; an index deletion joins any batch and ends it; index
    /// creations, updates and swaps are batched alone.
    fn accumulate(self, auto: &Auto, index_exists: bool) -> Next {
        use BatchKind as B;
        match (self, auto) {
            (B::IndexDeletion | B::Alone, _) | (_, Auto::Alone) => Next::Stop,
            (_, Auto::IndexDeletion) => Next::TakeLast(B::IndexDeletion),
            (B::Clear, Auto::Clear | Auto::Deletion { .. }) => Next::Take(B::Clear),
            (B::Clear, _) => Next::Stop,
            (B::Documents, Auto::Clear) => Next::Take(B::Clear),
            (B::Documents, Auto::Import(_) | Auto::Deletion { by_filter: false }) => {
                Next::Take(B::Documents)
            }
            (B::Documents, _) => Next::Stop,
            (B::Deletions { .. }, Auto::Clear) => Next::Take(B::Clear),
            // A deletion by ids and an addition go together if the index exists already.
            (B::Deletions { by_filter: false }, Auto::Import(_)) if index_exists => {
                Next::Take(B::Documents)
            }
            (B::Deletions { by_filter }, Auto::Deletion { by_filter: more }) => {
                Next::Take(B::Deletions {
                    by_filter: by_filter || *more,
                })
            }
            (B::Deletions { .. }, _) => Next::Stop,
            (B::Settings, Auto::Clear) => Next::Take(B::ClearAndSettings),
            (B::Settings, Auto::Settings) => Next::Take(B::Settings),
            (B::Settings, _) => Next::Stop,
            (B::ClearAndSettings, Auto::Import(_)) => Next::Stop,
            (B::ClearAndSettings, _) => Next::Take(B::ClearAndSettings),
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

/// A batch taken off the queue for processing.
enum Work {
    Index {
        index: String,
        kind: BatchKind,
        ops: Vec<(u32, Op)>,
    },
    Swap(u32, Vec<Swap>),
}

/// Most tasks in one batch, as Meilisearch's default `--experimental-max-number-of-batched-tasks`
/// would allow far more; this keeps a test's batches bounded.
const MAX_BATCH: usize = 1000;

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
    /// The `customMetadata` query parameter of the write, shown as is.
    custom_metadata: Option<String>,
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
        let json = Obj::new()
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
            .opt_str("finishedAt", self.finished_at.map(rfc3339).as_deref());
        with_metadata(json, self.custom_metadata.as_deref())
    }

    /// The 202 answer to a write.
    fn summary_json(&self) -> String {
        let json = Obj::new()
            .num("taskUid", self.uid)
            .opt_str("indexUid", self.index_uid())
            .str("status", self.status.name())
            .str("type", self.kind.name())
            .str("enqueuedAt", &rfc3339(self.enqueued_at));
        with_metadata(json, self.custom_metadata.as_deref())
    }
}

/// Ends a task view; Meilisearch adds `customMetadata` last, and only when the write had one
/// (observed: `POST /indexes/cm/documents?customMetadata=my-meta-1` answers
/// `{"taskUid":44,...,"enqueuedAt":"...","customMetadata":"my-meta-1"}`, and the task shows it
/// after `finishedAt`; an empty value is kept as `""`).
fn with_metadata(json: Obj, metadata: Option<&str>) -> String {
    match metadata {
        Some(m) => json.str("customMetadata", m).end(),
        None => json.end(),
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
        // Details add up numbers over the tasks and keep the last value otherwise; nulls are
        // left out (observed: a batch of a deletion by ids, a clear and a deletion by filter
        // shows `{"providedIds":1,"deletedDocuments":3,"originalFilter":"\"x = 1\""}`).
        let mut details: Vec<(String, Value)> = Vec::new();
        let (mut statuses, mut types, mut indexes) =
            (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        for t in &tasks {
            for (k, v) in t.details.iter().filter(|(_, v)| !v.is_null()) {
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
        // In the order of Meilisearch's `DetailsView`, settings after the document counts.
        details.sort_by_key(|(k, _)| detail_rank(k));
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

/// Where a key goes in batch details.
fn detail_rank(key: &str) -> usize {
    const FIRST: [&str; 6] = [
        "receivedDocuments",
        "indexedDocuments",
        "primaryKey",
        "providedIds",
        "deletedDocuments",
        "originalFilter",
    ];
    FIRST
        .iter()
        .position(|k| *k == key)
        .or_else(|| settings::position(key).map(|i| FIRST.len() + i))
        .unwrap_or(usize::MAX)
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

/// One batch taken off the queue: its uid and work.
type Taken = (u32, Work);

/// Outcome of one task: uid, final details and error.
type Done = (u32, Vec<(String, Value)>, Option<ApiError>);

impl Queue {
    /// Enqueues a task on one index and returns its summarized view.
    pub(crate) fn register(&mut self, index_uid: &str, op: Op, metadata: Option<String>) -> String {
        let (kind, details) = (op.kind(), op.details());
        self.push(
            Target::Index(index_uid.to_string()),
            kind,
            details,
            Some(op),
            metadata,
        )
    }

    /// Enqueues an index swap and returns its summarized view.
    pub(crate) fn register_swap(&mut self, swaps: Vec<Swap>) -> String {
        let details = swap_details(&swaps);
        self.push(Target::Swaps(swaps), Kind::IndexSwap, details, None, None)
    }

    fn push(
        &mut self,
        target: Target,
        kind: Kind,
        details: Vec<(String, Value)>,
        op: Option<Op>,
        custom_metadata: Option<String>,
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
            custom_metadata,
        };
        let summary = task.summary_json();
        self.tasks.push(task);
        self.enqueued.insert(uid);
        self.pending += 1;
        summary
    }

    /// The oldest enqueued task and the following tasks of its index that Meilisearch would
    /// batch with it ([`BatchKind::accumulate`]); marks them processing. Tasks of other indexes
    /// are skipped; any task of the index that does not join (a swap naming it included) ends
    /// the batch, so every task runs after all the tasks of its indexes enqueued before it.
    /// `index_state` tells whether an index exists and its primary key.
    fn take_batch(
        &mut self,
        index_state: impl Fn(&str) -> (bool, Option<String>),
    ) -> Option<Taken> {
        let first = *self.enqueued.first()?;
        let head = &self.tasks[first as usize];
        let index_uid = head.index_uid().map(String::from);
        let mut uids = vec![first];
        let mut kind = BatchKind::Alone;
        if let (Some(index_uid), Some(op)) = (&index_uid, head.op.as_ref()) {
            let (exists, index_pk) = index_state(index_uid);
            let auto = op.auto();
            // An addition or a settings change creates the index for the tasks after it.
            let exists = exists || matches!(auto, Auto::Import(_) | Auto::Settings);
            let mut batch_pk = match auto {
                Auto::Import(pk) => pk.map(String::from),
                _ => None,
            };
            let mut open = match BatchKind::start(&auto, index_pk.as_deref()) {
                Next::Take(k) => {
                    kind = k;
                    true
                }
                Next::TakeLast(k) => {
                    kind = k;
                    false
                }
                Next::Stop => false,
            };
            for uid in self.enqueued.iter().skip(1) {
                if !open || uids.len() >= MAX_BATCH {
                    break;
                }
                let t = &self.tasks[*uid as usize];
                if !t.concerns(index_uid) {
                    continue;
                }
                let Some(auto) = t.op.as_ref().map(Op::auto) else {
                    break; // a swap
                };
                // Observed: an addition asking for another primary key than the index's (or
                // than an earlier addition of the batch) starts a batch of its own.
                if let Auto::Import(Some(pk)) = auto {
                    let expected = index_pk.as_deref().or(batch_pk.as_deref());
                    if expected.is_some_and(|expected| expected != pk) {
                        break;
                    }
                    batch_pk = Some(pk.to_string());
                }
                match kind.accumulate(&auto, exists) {
                    Next::Take(k) => kind = k,
                    Next::TakeLast(k) => {
                        kind = k;
                        open = false;
                    }
                    Next::Stop => break,
                }
                uids.push(*uid);
            }
        }
        let batch_uid = self.batches.len() as u32;
        let now = SystemTime::now();
        let (mut ops, mut swaps) = (Vec::new(), None);
        for uid in &uids {
            self.enqueued.remove(uid);
            let t = &mut self.tasks[*uid as usize];
            t.status = Status::Processing;
            t.batch_uid = Some(batch_uid);
            t.started_at = Some(now);
            match &t.target {
                Target::Swaps(s) => swaps = Some(s.clone()),
                Target::Index(_) => ops.extend(t.op.take().map(|op| (*uid, op))),
            }
        }
        let work = match swaps {
            Some(swaps) => Work::Swap(first, swaps),
            None => Work::Index {
                index: index_uid.clone().unwrap_or_default(),
                kind,
                ops,
            },
        };
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
                if let Some(taken) = queue.take_batch(|uid| index_state(&shared, uid)) {
                    break taken;
                }
                queue = shared.cond.wait(queue).unwrap_or_else(|e| e.into_inner());
            }
        };
        shared.faults.wait_while_hung(|| shared.stopping());
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

/// Whether an index exists, and its primary key.
fn index_state(shared: &Shared, uid: &str) -> (bool, Option<String>) {
    match get_index(shared, uid) {
        Some(index) => (true, read(&index).primary_key.clone()),
        None => (false, None),
    }
}

fn get_or_create(shared: &Shared, uid: &str) -> Arc<RwLock<Index>> {
    lock(&shared.indexes)
        .entry(uid.to_string())
        .or_insert_with(|| Arc::new(RwLock::new(Index::new(uid, None, SystemTime::now()))))
        .clone()
}

/// Runs a batch; returns each task's uid, final details and error.
fn apply_batch(shared: &Shared, work: Work) -> Vec<Done> {
    let (index, kind, ops) = match work {
        Work::Swap(uid, swaps) => {
            let error = swap_indexes(shared, &swaps).err();
            return vec![(uid, swap_details(&swaps), error)];
        }
        Work::Index { index, kind, ops } => (index, kind, ops),
    };
    let mut results = Vec::new();
    let mut rest = Vec::with_capacity(ops.len());
    for (uid, op) in ops {
        match injected_failure(shared, &op) {
            Some((details, error)) => results.push((uid, details, Some(error))),
            None => rest.push((uid, op)),
        }
    }
    // A batch whose every task failed changes nothing (an index deletion would still delete).
    if !rest.is_empty() {
        results.extend(run_kind(shared, &index, kind, rest));
    }
    results
}

fn run_kind(shared: &Shared, index: &str, kind: BatchKind, ops: Vec<(u32, Op)>) -> Vec<Done> {
    match kind {
        BatchKind::Documents => document_operation(shared, index, ops),
        BatchKind::Deletions { .. } => deletions(shared, index, ops),
        BatchKind::Clear | BatchKind::Settings | BatchKind::ClearAndSettings => {
            clear_and_settings(shared, index, ops)
        }
        BatchKind::IndexDeletion => index_deletion(shared, index, ops),
        BatchKind::Alone => ops
            .into_iter()
            .flat_map(|(uid, op)| alone(shared, index, uid, op))
            .collect(),
    }
}

/// A failure injected with [`crate::Faults::fail_next_tasks`], for document tasks and index
/// deletions.
fn injected_failure(shared: &Shared, op: &Op) -> Option<(Vec<(String, Value)>, ApiError)> {
    let may_fail = matches!(
        op.kind(),
        Kind::DocumentAdditionOrUpdate | Kind::DocumentDeletion | Kind::IndexDeletion
    );
    if !may_fail {
        return None;
    }
    let (code, kind) = shared.faults.take_task_failure()?;
    let mut error = ApiError::new(
        &code,
        format!("Injected failure: this task failed with `{code}`."),
    );
    if let Some(kind) = kind {
        error.kind = kind;
    }
    Some((op.finished_details(), error))
}

/// The error of a task in a batch that cannot run it (auto-batching never makes one).
fn misplaced() -> ApiError {
    ApiError::internal("this task cannot be processed in this batch")
}

/// Fails every task of a batch with one error.
fn fail_all(ops: Vec<(u32, Op)>, error: &ApiError) -> Vec<Done> {
    ops.into_iter()
        .map(|(uid, op)| (uid, op.finished_details(), Some(error.clone())))
        .collect()
}

/// Runs a task batched alone (index creation or update).
fn alone(shared: &Shared, uid: &str, task: u32, op: Op) -> Vec<Done> {
    let (details, error) = match op {
        Op::CreateIndex(pk) => {
            let details = pairs(&[("primaryKey", json!(pk))]);
            let mut indexes = lock(&shared.indexes);
            if indexes.contains_key(uid) {
                let error = ApiError::new(
                    "index_already_exists",
                    format!("Index `{uid}` already exists."),
                );
                (details, Some(error))
            } else {
                let index = Index::new(uid, pk, SystemTime::now());
                indexes.insert(uid.to_string(), Arc::new(RwLock::new(index)));
                (details, None)
            }
        }
        Op::UpdateIndex(pk) => {
            let details = pairs(&[("primaryKey", json!(pk))]);
            let Some(index) = get_index(shared, uid) else {
                return vec![(task, details, Some(ApiError::index_not_found(uid)))];
            };
            let mut idx = write(&index);
            match pk {
                Some(pk) if idx.len() > 0 && idx.primary_key.as_deref() != Some(pk.as_str()) => {
                    let current = idx.primary_key.clone().unwrap_or_default();
                    (details, Some(pk_already_exists(&current)))
                }
                pk => {
                    if pk.is_some() {
                        idx.primary_key = pk;
                    }
                    idx.updated_at = SystemTime::now();
                    (details, None)
                }
            }
        }
        // Other kinds start batches of their own kind.
        other => {
            let kind = match BatchKind::start(&other.auto(), None) {
                Next::Take(kind) | Next::TakeLast(kind) => kind,
                Next::Stop => BatchKind::Alone,
            };
            if kind == BatchKind::Alone {
                return fail_all(vec![(task, other)], &misplaced());
            }
            return run_kind(shared, uid, kind, vec![(task, other)]);
        }
    };
    vec![(task, details, error)]
}

/// Runs a batch of deletions by id and by filter as Meilisearch does: each task counts the
/// documents it adds to the set to delete (ids and filters are looked up before anything is
/// deleted, so an id deleted by an earlier task of the batch counts once); a bad filter fails
/// its task alone.
fn deletions(shared: &Shared, uid: &str, ops: Vec<(u32, Op)>) -> Vec<Done> {
    let Some(index) = get_index(shared, uid) else {
        return fail_all(ops, &ApiError::index_not_found(uid));
    };
    let mut idx = write(&index);
    let mut doomed: HashSet<String> = HashSet::new();
    let mut results = Vec::with_capacity(ops.len());
    for (task, op) in ops {
        let before = doomed.len();
        let (error, provided) = match &op {
            Op::DeleteDocuments(ids) => {
                doomed.extend(ids.iter().filter(|id| idx.get(id).is_some()).cloned());
                (None, ids.len())
            }
            Op::DeleteByFilter(filter) => match filter_matches(&idx, uid, filter) {
                Ok(ids) => {
                    doomed.extend(ids);
                    (None, 0)
                }
                Err(error) => (Some(error), 0),
            },
            _ => (Some(misplaced()), 0),
        };
        let original = match &op {
            Op::DeleteByFilter(filter) => json!(filter.to_string()),
            _ => Value::Null,
        };
        let details = pairs(&[
            ("providedIds", json!(provided)),
            ("deletedDocuments", json!(doomed.len() - before)),
            ("originalFilter", original),
        ]);
        results.push((task, details, error));
    }
    for id in &doomed {
        idx.delete(id);
    }
    idx.updated_at = SystemTime::now();
    results
}

/// Runs a batch of settings changes and document clears as Meilisearch's settings, clear and
/// clear-and-settings batches do. The settings of the batch are merged and applied at once: if
/// they fail (turning the geo feature on over a stored bad `_geo`, `oneTypo` above `twoTypos`),
/// every task of the batch fails (observed: three settings PATCHes in one batch, the second
/// adding `_geo` to `sortableAttributes` of an index holding `{"id":1,"_geo":"abc"}`, all three
/// failed with `invalid_document_geo_field`). A clear deletes every document (the first clear
/// counts them, later ones 0); the document tasks before it are not applied and keep their
/// enqueued details (observed: `{"receivedDocuments":1,"indexedDocuments":null}`).
fn clear_and_settings(shared: &Shared, uid: &str, ops: Vec<(u32, Op)>) -> Vec<Done> {
    let creates = ops
        .iter()
        .any(|(_, op)| matches!(op, Op::AddDocuments { .. } | Op::Settings(_)));
    let index = match get_index(shared, uid) {
        Some(index) => index,
        None if creates => get_or_create(shared, uid),
        None => return fail_all(ops, &ApiError::index_not_found(uid)),
    };
    let mut idx = write(&index);
    let clears = ops.iter().any(|(_, op)| matches!(op, Op::ClearDocuments));
    let mut updated = idx.settings.clone();
    for (_, op) in &ops {
        if let Op::Settings(changes) = op {
            settings::apply(&mut updated, changes);
        }
    }
    // Turning the geo feature on makes Meilisearch extract (and check) the `_geo` field of
    // every stored document; none is left after a clear.
    let turns_geo_on = settings::geo_enabled(&updated) && !settings::geo_enabled(&idx.settings);
    let error = settings::check_merged(&updated).err().or_else(|| {
        (turns_geo_on && !clears)
            .then(|| stored_geo_error(&idx))
            .flatten()
    });
    if let Some(error) = error {
        let error = error.prefixed(&format!("Index `{uid}`: "));
        return ops
            .into_iter()
            .map(|(task, op)| match op {
                Op::Settings(changes) => (task, changes, Some(error.clone())),
                other => (task, other.finished_details(), Some(error.clone())),
            })
            .collect();
    }
    let mut cleared = if clears { Some(idx.clear()) } else { None };
    idx.settings = updated;
    idx.updated_at = SystemTime::now();
    ops.into_iter()
        .map(|(task, op)| {
            let details = match op {
                Op::Settings(changes) => changes,
                Op::ClearDocuments => {
                    pairs(&[("deletedDocuments", json!(cleared.take().unwrap_or(0)))])
                }
                other => other.details(),
            };
            (task, details, None)
        })
        .collect()
}

/// Runs an index deletion with the tasks batched before it, which Meilisearch marks succeeded
/// without applying them (observed: a deletion by ids, a clear and a deletion by filter batched
/// with `DELETE /indexes/del` ended succeeded with `deletedDocuments` 0, null and 0, the index
/// deletion with the 3 documents the index held; an addition to a missing index batched with
/// its deletion ended succeeded with `indexedDocuments` 0 and `deletedDocuments` 0). Without
/// such a task, a missing index fails the batch.
fn index_deletion(shared: &Shared, uid: &str, ops: Vec<(u32, Op)>) -> Vec<Done> {
    let creates = ops
        .iter()
        .any(|(_, op)| matches!(op, Op::AddDocuments { .. } | Op::Settings(_)));
    let removed = lock(&shared.indexes).remove(uid);
    let deleted = removed.as_ref().map(|index| read(index).len());
    let error = (deleted.is_none() && !creates).then(|| ApiError::index_not_found(uid));
    ops.into_iter()
        .map(|(task, op)| {
            let details = match op {
                Op::DeleteIndex => pairs(&[("deletedDocuments", json!(deleted.unwrap_or(0)))]),
                Op::ClearDocuments if error.is_none() => op.details(),
                other => other.finished_details(),
            };
            (task, details, error.clone())
        })
        .collect()
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

/// One task of a document batch once staged: an addition's checked documents (or its error),
/// or the ids a deletion names.
enum Step {
    Add {
        received: usize,
        staged: Result<Staged, ApiError>,
    },
    Delete(Vec<String>),
}

/// Runs a batch of document additions, updates and deletions by id on one index, as Meilisearch
/// indexes them together: each addition's documents are checked first (a bad primary key or id
/// fails that task alone, like the real per-payload errors); then, if the geo feature is on,
/// the `_geo` fields of what the batch would store. A bad `_geo` fails the indexing of the
/// whole batch, so every task of it fails with that error (prefixed with the index), deletions
/// included, and nothing is written (observed: a POST, a PUT, a delete-batch and two more POSTs
/// batched together, one with `"_geo":{"lat":"north","lng":0}`: all five failed with
/// `invalid_document_geo_field`, the deletion with `deletedDocuments` 0, its documents kept).
/// Otherwise the tasks are applied in order. A deletion reports the distinct ids it names,
/// stored or not (observed: `[1, 99, 1]` batched with an addition, 99 never stored:
/// `deletedDocuments` 2).
fn document_operation(shared: &Shared, uid: &str, ops: Vec<(u32, Op)>) -> Vec<Done> {
    let index = get_index(shared, uid);
    let (mut current, geo) = index.as_ref().map_or((None, false), |index| {
        let idx = read(index);
        (
            idx.primary_key.clone(),
            settings::geo_enabled(&idx.settings),
        )
    });
    let mut steps = Vec::with_capacity(ops.len());
    for (task, op) in ops {
        let step = match op {
            Op::AddDocuments {
                docs,
                primary_key,
                merge,
            } => {
                let received = docs.len();
                let addition = Addition {
                    docs,
                    primary_key,
                    merge,
                };
                let staged = stage(current.as_deref(), addition);
                if let Ok(s) = &staged {
                    // A task that passes sets the primary key the next ones of the batch see.
                    current = Some(s.pk.clone());
                }
                Step::Add { received, staged }
            }
            Op::DeleteDocuments(ids) => Step::Delete(ids),
            // Auto-batching puts no other kind of task here.
            _ => Step::Add {
                received: 0,
                staged: Err(misplaced()),
            },
        };
        steps.push((task, step));
    }
    let addition = |received: usize, indexed: usize| {
        pairs(&[
            ("receivedDocuments", json!(received)),
            ("indexedDocuments", json!(indexed)),
        ])
    };
    let deletion = |provided: usize, deleted: usize| {
        pairs(&[
            ("providedIds", json!(provided)),
            ("deletedDocuments", json!(deleted)),
            ("originalFilter", Value::Null),
        ])
    };
    if geo {
        if let Some(error) = batch_geo_error(steps.iter().map(|(_, step)| step)) {
            let error = error.prefixed(&format!("Index `{uid}`: "));
            return steps
                .iter()
                .map(|(task, step)| {
                    let details = match step {
                        Step::Add { received, .. } => addition(*received, 0),
                        Step::Delete(ids) => deletion(ids.len(), 0),
                    };
                    (*task, details, Some(error.clone()))
                })
                .collect();
        }
    }
    steps
        .into_iter()
        .map(|(task, step)| match step {
            Step::Add {
                received,
                staged: Ok(s),
            } => {
                let indexed = write_documents(shared, uid, s);
                (task, addition(received, indexed), None)
            }
            Step::Add {
                received,
                staged: Err(error),
            } => (task, addition(received, 0), Some(error)),
            Step::Delete(ids) => {
                if let Some(index) = get_index(shared, uid) {
                    let mut idx = write(&index);
                    for id in &ids {
                        idx.delete(id);
                    }
                    idx.updated_at = SystemTime::now();
                }
                let distinct = ids.iter().collect::<HashSet<_>>().len();
                (task, deletion(ids.len(), distinct), None)
            }
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

/// A partial update's fields over the stored document. `_vectors` merges by embedder, as on
/// Meilisearch 1.50 (a `PUT` whose `_vectors` names one embedder keeps the other embedders'
/// embeddings: tests/e2e/tests/vectors.rs checks it against the real server).
fn merge_document(stored: &mut crate::docs::Doc, update: crate::docs::Doc) {
    for (field, value) in update {
        match (field.as_str(), stored.get_mut(&field), value) {
            ("_vectors", Some(Value::Object(kept)), Value::Object(entries)) => kept.extend(entries),
            (_, _, value) => {
                stored.insert(field, value);
            }
        }
    }
}

/// The first bad `_geo` among the documents a batch would store. A later version of a
/// document supersedes an earlier one's `_geo` when it replaces the document or (merging)
/// carries its own `_geo`, and a deletion drops it; a merged `_geo` kept from the stored
/// document is valid already, since the index holds no bad `_geo` while the geo feature is on.
fn batch_geo_error<'a>(steps: impl Iterator<Item = &'a Step>) -> Option<ApiError> {
    let mut versions: Vec<(&str, &Doc)> = Vec::new();
    let mut last = HashMap::new();
    for step in steps {
        match step {
            Step::Add { staged: Ok(s), .. } => {
                for (id, p) in &s.keyed {
                    if !s.merge || p.doc.contains_key("_geo") {
                        last.insert(id.as_str(), versions.len());
                    }
                    versions.push((id, &p.doc));
                }
            }
            Step::Add { staged: Err(_), .. } => {}
            Step::Delete(ids) => {
                for id in ids {
                    last.remove(id.as_str());
                }
            }
        }
    }
    versions
        .iter()
        .enumerate()
        .filter(|(i, (id, _))| last.get(id) == Some(i))
        .find_map(|(_, (id, doc))| doc.get("_geo").and_then(|geo| geo_error(id, geo)))
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
                    merge_document(&mut doc, p.doc);
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

/// The ids of the documents a deletion filter matches.
fn filter_matches(idx: &Index, uid: &str, filter: &Value) -> Result<Vec<String>, ApiError> {
    let invalid =
        |m: String| ApiError::new("invalid_document_filter", format!("Index `{uid}`: {m}"));
    let Some(f) = filter::from_json(filter).map_err(invalid)? else {
        return Ok(Vec::new());
    };
    f.check_filterable(&settings::filterable_patterns(&idx.settings))
        .map_err(invalid)?;
    let pk = idx.primary_key.clone().unwrap_or_default();
    Ok(idx
        .iter()
        .map(|d| d.parse())
        .filter(|d| f.matches(d))
        .filter_map(|d| document_id(&d, &pk).ok())
        .collect())
}

pub(crate) fn read(index: &RwLock<Index>) -> std::sync::RwLockReadGuard<'_, Index> {
    index.read().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn write(index: &RwLock<Index>) -> std::sync::RwLockWriteGuard<'_, Index> {
    index.write().unwrap_or_else(|e| e.into_inner())
}

/// `GET /tasks` and `GET /batches` listing: newest first unless `reverse`, from `from`, at
/// most `limit`. As Meilisearch does, the `limit + 1` matches from `from` are taken first (the
/// last one only tells `next`), then those `listed` refuses are left out, so a page can come out
/// short or empty (observed with a swap of `sa` and `sb` as tasks 66 and 68 and an addition to
/// `sa` as task 64: `GET /tasks?indexUids=sa&limit=1` answered `{"results":[],"total":3,
/// "limit":1,"from":null,"next":null}`, `limit=2` listed task 64 alone, `next` null). `total`
/// is the number of matches.
pub(crate) fn page<T>(
    mut items: Vec<(u32, T)>,
    total: usize,
    (limit, from, reverse): (usize, Option<u32>, bool),
    listed: impl Fn(&T) -> bool,
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
    let end = start
        .saturating_add(limit)
        .saturating_add(1)
        .min(items.len());
    let mut shown: Vec<&(u32, T)> = items[start..end]
        .iter()
        .filter(|(_, t)| listed(t))
        .collect();
    let next = if shown.len() > limit {
        shown.pop().map(|(uid, _)| u64::from(*uid))
    } else {
        None
    };
    Obj::new()
        .raw("results", &array(shown.iter().map(|(_, t)| render(t))))
        .num("total", total as u64)
        .num("limit", limit as u64)
        .opt_num("from", shown.first().map(|(uid, _)| u64::from(*uid)))
        .opt_num("next", next)
        .end()
}
