//! `meili_sync_verify` and `meili_sync_repair`: the table and the index compared page by page
//! (ids and document bodies), so memory is bounded by the page size, not the table.
//!
//! Pass 1 reads the table in key order, encodes each row as the worker would, and fetches the
//! same ids from the index: missing and different documents. A row the worker dead-letters (no
//! valid id, a `_geo` Meilisearch would refuse) is neither: it is not compared, and repair does
//! not send it. Pass 2 browses the index's ids and looks them up in the table: extra documents.
//! Repair sends the current rows (locked FOR UPDATE so that no newer version can be overtaken)
//! and deletes the extra documents (with writes to the table blocked while it re-checks and
//! deletes, so that no new row is deleted).

use std::collections::HashMap;

use pgrx::pg_sys;
use serde_json::Value;

use pg_meili_sync_core::document::encode::{
    encode_row, key_of_id, ColumnValue, EncodeError, ValueKind,
};
use pg_meili_sync_core::document::shard::ShardFilter;
use pg_meili_sync_core::meili::client::{Client, MeiliError, HTTP_TIMEOUT, TASK_WAIT};
use pg_meili_sync_core::meili::request::Operation;
use pg_meili_sync_core::task::options::{TaskOptions, WriteMode};

use crate::catalog::{self, source::KeyMatch, tasks::TaskRecord};
use crate::error::{ErrorKind, SyncError};
use crate::plan::{build_plan, PageSizer, SnapshotPlan};
use crate::security;

const PAGE_ROWS: usize = 1000;

/// What a comparison found: counts, and up to `sample_limit` document ids of each kind.
#[derive(Debug, Default, PartialEq)]
pub struct Findings {
    pub rows_checked: i64,
    pub documents_checked: i64,
    pub missing: i64,
    pub extra: i64,
    pub different: i64,
    pub sample_missing: Vec<String>,
    pub sample_extra: Vec<String>,
    pub sample_different: Vec<String>,
}

/// What a repair did.
#[derive(Debug, Default)]
pub struct Repairs {
    pub resent: i64,
    pub deleted: i64,
}

/// A document id as Meilisearch reports it: numbers and strings alike become their text.
pub fn id_text(id: &Value) -> Option<String> {
    match id {
        Value::String(text) => Some(text.clone()),
        Value::Number(number) => Some(number.to_string()),
        _ => None,
    }
}

/// Whether the index's document matches the one the table's row makes. Numbers compare by value
/// (Meilisearch may print `2.0` as `2`), embeddings within a 32-bit float's precision. In
/// `upsert` mode the index may hold fields the task does not send; only the task's own fields
/// are compared.
pub fn same_document(expected: &Value, found: &Value, only_expected_fields: bool) -> bool {
    match (expected, found) {
        (Value::Number(a), Value::Number(b)) => {
            a == b || a.as_f64().zip(b.as_f64()).is_some_and(|(a, b)| a == b)
        }
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(a, b)| same_document(a, b, false))
        }
        (Value::Object(a), Value::Object(b)) => {
            (only_expected_fields || a.len() == b.len())
                && a.iter().all(|(name, value)| {
                    b.get(name).is_some_and(|other| {
                        if name == pg_meili_sync_core::document::vectors::VECTORS_FIELD {
                            pg_meili_sync_core::document::vectors::same_vectors(value, other)
                        } else {
                            same_document(value, other, false)
                        }
                    })
                })
        }
        _ => expected == found,
    }
}

/// One page's verdicts: for each expected (id, document), missing or different in `found`.
pub fn compare_page(
    expected: &[(String, Value)],
    found: &[Value],
    primary_key: &str,
    only_expected_fields: bool,
) -> (Vec<usize>, Vec<usize>) {
    let by_id: HashMap<String, &Value> = found
        .iter()
        .filter_map(|document| Some((id_text(document.get(primary_key)?)?, document)))
        .collect();
    let mut missing = Vec::new();
    let mut different = Vec::new();
    for (position, (id, document)) in expected.iter().enumerate() {
        match by_id.get(id) {
            None => missing.push(position),
            Some(found) if !same_document(document, found, only_expected_fields) => {
                different.push(position)
            }
            Some(_) => {}
        }
    }
    (missing, different)
}

/// Whether `text` is valid input for a key of this kind and SQL type, so that it can be cast to
/// it without an ERROR; the caller matches other ids by text.
fn castable(text: &str, kind: &ValueKind, type_name: &str) -> bool {
    match kind {
        ValueKind::Integer => text.parse::<i64>().is_ok(),
        ValueKind::Text if type_name == "uuid" => {
            text.len() == 36
                && text.char_indices().all(|(position, c)| {
                    if [8, 13, 18, 23].contains(&position) {
                        c == '-'
                    } else {
                        c.is_ascii_hexdigit()
                    }
                })
        }
        ValueKind::Text => !type_name.starts_with("character(") && type_name != "\"char\"",
        _ => false,
    }
}

/// A Meilisearch failure while doing `what`, with the SQLSTATE and hint every SQL function gives
/// one (`From<MeiliError>`).
fn meili_error(what: &str) -> impl Fn(MeiliError) -> SyncError + '_ {
    move |error| SyncError::from(error).context(what)
}

/// Called with the key values of each page's missing or different rows.
type OnDamagedRows<'a> = dyn FnMut(&Context, Vec<Vec<String>>) -> Result<(), SyncError> + 'a;

/// (id, document, key values) of each row of a page that becomes a document.
type PageDocuments = Vec<(String, Value, Vec<String>)>;

/// What to send for a page's documents, and with which operation.
type PageSend<'a> = dyn Fn(PageDocuments) -> (Operation, Vec<Value>) + 'a;

/// Rows as the worker encodes them.
struct EncodedRows {
    documents: PageDocuments,
    /// Key values of each row the worker dead-letters instead, and why.
    dead_letters: Vec<(Vec<String>, EncodeError)>,
}

struct Context {
    task: TaskRecord,
    /// The table (`ONLY` it) or view, schema-qualified and quoted, as queries name it.
    relation: String,
    /// A table (partitioned or not) locks the rows it reads; a view blocks writes to its tables.
    is_view: bool,
    plan: SnapshotPlan,
    client: Client,
    key: Vec<(String, String)>,
    key_kinds: Vec<ValueKind>,
    /// The source's columns, as the rows are read (`SnapshotPlan::source_columns`).
    column_names: Vec<String>,
    upsert: bool,
    /// On a shard's row: the rows it keeps; the index's other documents are extra.
    shard: Option<ShardFilter>,
}

impl Context {
    fn new(task: TaskRecord) -> Result<Context, SyncError> {
        // The plan's columns are read in one statement and the pages in later ones: without the
        // lock, a column dropped in between fails them ("column … does not exist" when the values
        // of an ADD COLUMN were sent while a DROP COLUMN committed: a task stopped in error).
        catalog::source::hold_against_alter(task.relid);
        let options = TaskOptions::parse(&task.options)?;
        catalog::source::set_output_formats(true)?;
        let plan = build_plan(&task, &options)?;
        let info = catalog::source::relation_info(task.relid)?;
        let key: Vec<(String, String)> = task
            .primary_key
            .iter()
            .map(|name| (name.clone(), info.type_name_of(name)))
            .collect();
        let columns = plan.shape.columns();
        let key_kinds = plan
            .shape
            .key_columns()
            .iter()
            .map(|&index| columns[index].kind.clone())
            .collect();
        let column_names = plan.source_columns.clone();
        let shard = task.shard_filter();
        let client = Client::new(&task.url, task.api_key.as_deref(), HTTP_TIMEOUT)
            .map_err(meili_error("cannot reach Meilisearch"))?;
        Ok(Context {
            relation: info.query_name(),
            is_view: info.is_view(),
            upsert: options.write_mode == WriteMode::Upsert,
            task,
            plan,
            client,
            key,
            key_kinds,
            column_names,
            shard,
        })
    }

    fn primary_key(&self) -> &str {
        self.plan.shape.primary_key_attribute()
    }

    /// Work on the table (reads, key casts, locks) runs with its owner's rights, never as the
    /// superuser or admin who called.
    fn as_owner<T>(&self, work: impl FnOnce() -> T) -> T {
        security::as_table_owner(self.plan.table_owner, work)
    }

    /// A document id as Meilisearch holds it: a number for an integer key, else the text.
    fn id_value(&self, id: &str) -> Value {
        if self.key_kinds.len() == 1 && matches!(self.key_kinds[0], ValueKind::Integer) {
            if let Ok(number) = id.parse::<i64>() {
                return Value::from(number);
            }
        }
        Value::String(id.to_owned())
    }

    /// Rows as documents, or as dead letters, which are neither compared nor sent.
    fn encode(&self, rows: &[Vec<Option<String>>]) -> EncodedRows {
        let mut buffer = Vec::with_capacity(1024);
        let mut encoded = EncodedRows {
            documents: Vec::with_capacity(rows.len()),
            dead_letters: Vec::new(),
        };
        for row in rows {
            let values = ColumnValue::row(row);
            let key = self.plan.shape.key_of_row(row);
            buffer.clear();
            if let Err(error) = encode_row(&self.plan.shape, &values, &mut buffer) {
                encoded.dead_letters.push((key, error));
                continue;
            }
            let Ok(document) = serde_json::from_slice::<Value>(&buffer) else {
                continue;
            };
            let Some(id) = document.get(self.primary_key()).and_then(id_text) else {
                continue;
            };
            encoded.documents.push((id, document, key));
        }
        encoded
    }

    /// Pass 1: calls `damaged` with each page's missing or different rows (key values).
    fn compare_rows(
        &self,
        findings: &mut Findings,
        sample_limit: usize,
        damaged: &mut OnDamagedRows<'_>,
    ) -> Result<(), SyncError> {
        let mut after: Option<Vec<String>> = None;
        let mut pages = PageSizer::new(self.plan.page_rows);
        loop {
            let (query, key) = match &after {
                Some(key) => (&self.plan.next_page_query, Some(key.as_slice())),
                None => (&self.plan.first_page_query, None),
            };
            let limit = pages.rows();
            let rows = self.as_owner(|| {
                catalog::source::read_page(query, key, limit, self.plan.shape.columns().len())
            })?;
            pages.read(&rows);
            let page_rows = rows.len();
            let Some(last_key) = rows.last().map(|last| self.plan.shape.key_of_row(last)) else {
                return Ok(());
            };
            let rows = self.own_rows(rows);
            findings.rows_checked += rows.len() as i64;
            let documents = self.encode(&rows).documents;
            let ids: Vec<Value> = documents
                .iter()
                .map(|(id, document, _)| {
                    document
                        .get(self.primary_key())
                        .cloned()
                        .unwrap_or(Value::String(id.clone()))
                })
                .collect();
            let found = if ids.is_empty() {
                Vec::new()
            } else {
                self.client
                    .fetch_by_ids(&self.task.index_uid, &ids, self.plan.shape.has_vectors())
                    .map_err(meili_error("reading documents"))?
            };
            let expected: Vec<(String, Value)> = documents
                .iter()
                .map(|(id, document, _)| (id.clone(), document.clone()))
                .collect();
            let (missing, different) =
                compare_page(&expected, &found, self.primary_key(), self.upsert);
            findings.missing += missing.len() as i64;
            findings.different += different.len() as i64;
            for (positions, samples) in [
                (&missing, &mut findings.sample_missing),
                (&different, &mut findings.sample_different),
            ] {
                for &position in positions {
                    if samples.len() < sample_limit {
                        samples.push(expected[position].0.clone());
                    }
                }
            }
            let mut keys: Vec<Vec<String>> = Vec::new();
            for position in missing.iter().chain(&different) {
                keys.push(documents[*position].2.clone());
            }
            if !keys.is_empty() {
                damaged(self, keys)?;
            }
            if page_rows < limit {
                return Ok(());
            }
            after = Some(last_key);
        }
    }

    /// The rows of a page this row's index should hold: on a shard, those whose id hashes to it.
    fn own_rows(&self, rows: Vec<Vec<Option<String>>>) -> Vec<Vec<Option<String>>> {
        match &self.shard {
            Some(shard) => rows
                .into_iter()
                .filter(|row| shard.keeps_row(&self.plan.shape, row))
                .collect(),
            None => rows,
        }
    }

    /// Which of these document ids no row of the table has (or, on a shard, that hash to another
    /// shard: left behind when a document moved).
    fn absent(&self, ids: &[String]) -> Result<Vec<usize>, SyncError> {
        let mut typed = Vec::new();
        let mut as_text = Vec::new();
        let mut absent = Vec::new();
        for (position, id) in ids.iter().enumerate() {
            if self.shard.as_ref().is_some_and(|shard| !shard.keeps_id(id)) {
                absent.push(position);
                continue;
            }
            match key_of_id(id, self.key.len()) {
                None => absent.push(position),
                Some(values) => {
                    let castable =
                        values.iter().zip(&self.key_kinds).zip(&self.key).all(
                            |((value, kind), (_, type_name))| castable(value, kind, type_name),
                        );
                    if castable {
                        typed.push((position, values));
                    } else {
                        as_text.push((position, values));
                    }
                }
            }
        }
        for (group, matching) in [(typed, KeyMatch::Typed), (as_text, KeyMatch::AsText)] {
            let keys: Vec<Vec<String>> = group.iter().map(|(_, values)| values.clone()).collect();
            let missing = self.as_owner(|| {
                catalog::source::absent_keys(&self.relation, &self.key, &keys, &matching)
            })?;
            for index in missing {
                if let Some((position, _)) = group.get(index) {
                    absent.push(*position);
                }
            }
        }
        absent.sort_unstable();
        Ok(absent)
    }

    /// Pass 2: documents of the index whose row does not exist; returns their ids.
    fn extra_documents(
        &self,
        findings: &mut Findings,
        sample_limit: usize,
    ) -> Result<Vec<Value>, SyncError> {
        let mut extra = Vec::new();
        let mut offset = 0u64;
        loop {
            let (page, total) = self
                .client
                .browse_field(
                    &self.task.index_uid,
                    self.primary_key(),
                    offset,
                    PAGE_ROWS as u64,
                )
                .map_err(meili_error("browsing the index"))?;
            findings.documents_checked += page.len() as i64;
            let ids: Vec<Value> = page
                .iter()
                .filter_map(|document| document.get(self.primary_key()).cloned())
                .collect();
            let texts: Vec<String> = ids.iter().filter_map(id_text).collect();
            for position in self.absent(&texts)? {
                findings.extra += 1;
                if findings.sample_extra.len() < sample_limit {
                    findings.sample_extra.push(texts[position].clone());
                }
                if let Some(id) = ids.get(position) {
                    extra.push(id.clone());
                }
            }
            offset += page.len() as u64;
            if page.is_empty() || offset >= total {
                return Ok(extra);
            }
        }
    }

    fn wait_succeeded(&self, uid: u64, what: &str) -> Result<(), SyncError> {
        let state = self
            .client
            .wait_task(uid, TASK_WAIT)
            .map_err(meili_error(what))?;
        match state.failure() {
            None => Ok(()),
            Some(failure) => Err(SyncError::new(
                ErrorKind::Meilisearch,
                format!("{what}: {failure}"),
            )
            .hint("See meili_sync_verify for what is still different.")),
        }
    }

    /// The current version of these rows, locked until COMMIT so that no newer version is
    /// overtaken by sending it.
    fn locked_rows(&self, keys: Vec<Vec<String>>) -> Result<EncodedRows, SyncError> {
        let rows = self.as_owner(|| {
            catalog::source::lock_rows(
                &self.relation,
                self.is_view,
                &self.column_names,
                &self.key,
                &keys,
            )
        })?;
        Ok(self.encode(&rows))
    }

    /// Sends documents of locked rows; returns how many.
    fn send(&self, documents: &[(String, Value, Vec<String>)]) -> Result<i64, SyncError> {
        if documents.is_empty() {
            return Ok(0);
        }
        let uid = self.enqueue(documents)?;
        self.wait_succeeded(uid, "re-sending documents")?;
        Ok(documents.len() as i64)
    }

    /// Enqueues documents of locked rows in Meilisearch; returns its task's uid.
    fn enqueue(&self, documents: &[(String, Value, Vec<String>)]) -> Result<u64, SyncError> {
        let op = if self.upsert {
            Operation::Update
        } else {
            Operation::Replace
        };
        self.enqueue_as(op, documents.iter().map(|(_, document, _)| document))
    }

    /// Enqueues `documents` with `op` in Meilisearch; returns its task's uid.
    fn enqueue_as<'a>(
        &self,
        op: Operation,
        documents: impl Iterator<Item = &'a Value>,
    ) -> Result<u64, SyncError> {
        let mut body = Vec::new();
        for document in documents {
            body.extend_from_slice(document.to_string().as_bytes());
            body.push(b'\n');
        }
        self.client
            .send_batch(&self.task.index_uid, self.primary_key(), op, &body, false)
            .map_err(meili_error("re-sending documents"))
    }

    /// Reads every row of `query`, page by page, and enqueues what `send` makes of each page's
    /// documents (with the operation it gives). Rows that are dead letters are left to the
    /// stream's dead letters, as in `repair`. Returns how many documents were enqueued and
    /// Meilisearch's task uids, to wait for together (which lets Meilisearch batch them).
    fn enqueue_pages(
        &self,
        query: &catalog::source::PageQueries,
        send: &PageSend<'_>,
    ) -> Result<(i64, Vec<u64>), SyncError> {
        let width = self.plan.shape.columns().len();
        let (mut sent, mut enqueued) = (0, Vec::new());
        let mut after: Option<Vec<String>> = None;
        let mut pages = PageSizer::new(self.plan.page_rows);
        loop {
            let (page_query, key) = match &after {
                Some(key) => (&query.next_page, Some(key.as_slice())),
                None => (&query.first_page, None),
            };
            let limit = pages.rows();
            let rows =
                self.as_owner(|| catalog::source::read_page(page_query, key, limit, width))?;
            pages.read(&rows);
            let last = rows.last().map(|last| self.plan.shape.key_of_row(last));
            let full = rows.len() >= limit;
            let (op, documents) = send(self.encode(&self.own_rows(rows)).documents);
            if !documents.is_empty() {
                enqueued.push(self.enqueue_as(op, documents.iter())?);
                sent += documents.len() as i64;
            }
            match last {
                Some(last) if full => after = Some(last),
                _ => return Ok((sent, enqueued)),
            }
        }
    }

    /// Deletes documents whose row does not exist, checked again while writes are blocked.
    fn delete_extra(&self, candidates: Vec<Value>) -> Result<i64, SyncError> {
        if candidates.is_empty() {
            return Ok(0);
        }
        self.as_owner(|| catalog::source::lock_table_against_writes(&self.relation))?;
        let mut deleted = 0;
        for chunk in candidates.chunks(PAGE_ROWS) {
            let texts: Vec<String> = chunk.iter().filter_map(id_text).collect();
            let gone: Vec<Value> = self
                .absent(&texts)?
                .into_iter()
                .filter_map(|position| chunk.get(position).cloned())
                .collect();
            deleted += self.delete_ids(gone)?;
        }
        Ok(deleted)
    }

    fn delete_ids(&self, ids: Vec<Value>) -> Result<i64, SyncError> {
        let mut deleted = 0;
        for gone in ids.chunks(PAGE_ROWS) {
            let body = Value::Array(gone.to_vec()).to_string();
            let uid = self
                .client
                .send_batch(
                    &self.task.index_uid,
                    self.primary_key(),
                    Operation::Delete,
                    body.as_bytes(),
                    false,
                )
                .map_err(meili_error("deleting extra documents"))?;
            self.wait_succeeded(uid, "deleting extra documents")?;
            deleted += gone.len() as i64;
        }
        Ok(deleted)
    }
}

/// After a copy into an index that already held documents (a new snapshot, or one that started
/// over): deletes the documents whose row no longer exists, which the copy cannot overwrite.
/// The worker runs it before streaming, so changes committed meanwhile are applied after it.
pub fn prune(task: TaskRecord) -> Result<i64, SyncError> {
    let context = Context::new(task)?;
    let extra = context.extra_documents(&mut Findings::default(), 0)?;
    context.delete_ids(extra)
}

/// Re-sends dead-lettered documents from their rows' current state, locked meanwhile, straight to
/// Meilisearch; the ids whose row is gone are deleted from the index (checked again with writes
/// to the table blocked). Nothing is written to the table, so none of its triggers fire.
/// Returns how many documents were re-sent or deleted. A row that would still be a dead letter
/// fails the call, and nothing of its chunk (1,000 ids) is sent.
pub fn resend_dead_letters(task: TaskRecord, ids: &[String]) -> Result<i64, SyncError> {
    let context = Context::new(task)?;
    let mut sent = 0;
    for chunk in ids.chunks(PAGE_ROWS) {
        let chunk = chunk.to_vec();
        let gone: Vec<Value> = context
            .absent(&chunk)?
            .into_iter()
            .map(|position| context.id_value(&chunk[position]))
            .collect();
        let present: Vec<Vec<String>> = chunk
            .iter()
            .filter_map(|id| key_of_id(id, context.key.len()))
            .collect();
        let rows = context.locked_rows(present)?;
        // Refused before anything of the chunk is sent, as Meilisearch would refuse it.
        if let Some((key, error)) = rows.dead_letters.first() {
            return Err(SyncError::new(
                ErrorKind::Prerequisite,
                format!(
                    "the row with key ({}) would be a dead letter again: {error} ({})",
                    key.join(", "),
                    error.code()
                ),
            )
            .hint("Fix the row, or forget its dead letter with meili_sync_discard_dead_letters."));
        }
        sent += context.send(&rows.documents)?;
        sent += context.delete_extra(gone)?;
    }
    Ok(sent)
}

pub fn verify(task: TaskRecord, sample_limit: usize) -> Result<Findings, SyncError> {
    let context = Context::new(task)?;
    let mut findings = Findings::default();
    context.compare_rows(&mut findings, sample_limit, &mut |_, _| Ok(()))?;
    context.extra_documents(&mut findings, sample_limit)?;
    Ok(findings)
}

pub fn repair(task: TaskRecord) -> Result<Repairs, SyncError> {
    let context = Context::new(task)?;
    let mut findings = Findings::default();
    let mut repairs = Repairs::default();
    // Rows that became dead letters since the comparison are left to the worker's dead letters.
    context.compare_rows(&mut findings, 0, &mut |context, keys| {
        repairs.resent += context.send(&context.locked_rows(keys)?.documents)?;
        Ok(())
    })?;
    let extra = context.extra_documents(&mut findings, 0)?;
    repairs.deleted = context.delete_extra(extra)?;
    Ok(repairs)
}

/// Before `repair_partitions`, in a transaction of its own that the caller ends at once: locks
/// each of the partitions attached against writes for that moment (as the table's owner), which
/// waits for the writers whose commits the stream has read but which may not be visible yet.
/// False, with nothing locked, when a partition cannot be read on its own as the table's owner
/// reads the table (another owner, or row-level security of its own): then only `repair` brings
/// its rows in.
pub fn wait_for_partition_writers(
    task: &TaskRecord,
    partitions: &[u32],
) -> Result<bool, SyncError> {
    let owner = catalog::source::relation_info(task.relid)?.owner;
    let mut names = Vec::new();
    for &partition in partitions {
        let partition = pg_sys::Oid::from(partition);
        if !catalog::reads_like_its_root(partition, owner)? {
            return Ok(false);
        }
        names.push(catalog::source::relation_info(partition)?.query_name());
    }
    for name in &names {
        security::as_table_owner(owner, || catalog::source::lock_table_against_writes(name))?;
    }
    Ok(true)
}

/// After an ATTACH PARTITION of tables with rows (`partitions`, leaf partitions of the task's
/// partitioned table), from the task's stream, once `wait_for_partition_writers` returned true:
/// sends every row of those partitions, reading only them, so the work grows with the partitions
/// attached and not with the table. The pages are enqueued one after the other and waited for
/// together, which lets Meilisearch batch them. Unlike `repair`, the rows are not locked: the
/// stream reads no change while this runs, so a change committed after a page was read is
/// enqueued after that page, and one the stream read before is visible to every page (see
/// `wait_for_partition_writers`); no newer version is overtaken. An attach deletes no row, so
/// the index is not browsed. Returns how many rows were sent.
pub fn repair_partitions(task: TaskRecord, partitions: &[u32]) -> Result<i64, SyncError> {
    let context = Context::new(task)?;
    let op = if context.upsert {
        Operation::Update
    } else {
        Operation::Replace
    };
    let whole = |documents: PageDocuments| {
        let documents = documents.into_iter().map(|(_, document, _)| document);
        (op, documents.collect())
    };
    let mut sent = 0;
    let mut enqueued = Vec::new();
    for &partition in partitions {
        let info = catalog::source::relation_info(pg_sys::Oid::from(partition))?;
        let query =
            catalog::source::page_queries(&info.query_name(), &context.column_names, &context.key);
        let (pages_sent, uids) = context.enqueue_pages(&query, &whole)?;
        sent += pages_sent;
        enqueued.extend(uids);
    }
    for uid in enqueued {
        context.wait_succeeded(uid, "sending the rows of partitions attached")?;
    }
    Ok(sent)
}

/// Before `send_added_columns`, in a transaction of its own that the caller ends at once: locks
/// the task's table (with its partitions) against writes for that moment, as its owner, which
/// waits for the writers whose commits the stream has read but which may not be visible yet.
pub fn wait_for_writers(task: &TaskRecord) -> Result<(), SyncError> {
    let info = catalog::source::relation_info(task.relid)?;
    security::as_table_owner(info.owner, || {
        catalog::source::lock_table_against_writes(&info.qualified_name)
    })?;
    Ok(())
}

/// After `ALTER TABLE … ADD COLUMN` on a table task's table, from the task's stream, once
/// Meilisearch has everything the stream read before it and `wait_for_writers` returned: sends
/// the added `columns` of every row as partial updates (`PUT` with the key and the new fields),
/// so every document gets them without being sent whole or the index rebuilt. The rows are read
/// as they are now, unlocked: the stream reads no change while this runs, and a change committed
/// after a page was read is streamed after that page (whole, in the new shape), so no newer
/// version is overtaken. Rows that are dead letters, and the documents of dead letters, get
/// nothing: a partial update would make a document of the fields it names. Returns how many
/// documents were updated.
pub fn send_added_columns(task: TaskRecord, columns: &[String]) -> Result<i64, SyncError> {
    let unsent: std::collections::HashSet<String> =
        catalog::dead_letters::dead_letter_ids(task.id, None)?
            .into_iter()
            .collect();
    let context = Context::new(task)?;
    let primary_key = context.primary_key().to_owned();
    let partial = |documents: PageDocuments| {
        let documents = documents
            .into_iter()
            .filter(|(id, _, _)| !unsent.contains(id))
            .filter_map(|(_, document, _)| {
                let mut fields = serde_json::Map::new();
                fields.insert(primary_key.clone(), document.get(&primary_key)?.clone());
                for column in columns {
                    if let Some(value) = document.get(column) {
                        fields.insert(column.clone(), value.clone());
                    }
                }
                (fields.len() > 1).then_some(Value::Object(fields))
            });
        (Operation::Update, documents.collect())
    };
    let query =
        catalog::source::page_queries(&context.relation, &context.column_names, &context.key);
    let (sent, enqueued) = context.enqueue_pages(&query, &partial)?;
    for uid in enqueued {
        context.wait_succeeded(uid, "sending the columns added")?;
    }
    Ok(sent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn documents_compare_by_value_and_fields() {
        let expected = json!({"id": 1, "price": 2.0, "tags": ["a", "b"], "meta": {"x": 1}});
        assert!(same_document(
            &expected,
            &json!({"id": 1, "price": 2, "tags": ["a", "b"], "meta": {"x": 1.0}}),
            false
        ));
        assert!(!same_document(
            &expected,
            &json!({"id": 1, "price": 2.5, "tags": ["a", "b"], "meta": {"x": 1}}),
            false
        ));
        assert!(!same_document(
            &expected,
            &json!({"id": 1, "price": 2.0, "tags": ["b", "a"], "meta": {"x": 1}}),
            false
        ));
        let with_more =
            json!({"id": 1, "price": 2.0, "tags": ["a", "b"], "meta": {"x": 1}, "extra": true});
        assert!(!same_document(&expected, &with_more, false));
        assert!(
            same_document(&expected, &with_more, true),
            "upsert mode keeps others' fields"
        );
        assert!(!same_document(
            &expected,
            &json!({"id": 1, "price": 2.0}),
            true
        ));
        assert!(!same_document(&json!({"v": null}), &json!({}), false));
    }

    #[test]
    fn a_page_splits_into_missing_and_different() {
        let expected = vec![
            ("1".to_owned(), json!({"id": 1, "n": "a"})),
            ("2".to_owned(), json!({"id": 2, "n": "b"})),
            ("x-y".to_owned(), json!({"id": "x-y", "n": "c"})),
        ];
        let found = vec![
            json!({"id": 2, "n": "B"}),
            json!({"id": "x-y", "n": "c"}),
            json!({"id": 9}),
        ];
        assert_eq!(
            compare_page(&expected, &found, "id", false),
            (vec![0], vec![1])
        );
    }

    #[test]
    fn ids_map_back_to_key_values() {
        assert_eq!(id_text(&json!(42)), Some("42".to_owned()));
        assert_eq!(id_text(&json!("a_b")), Some("a_b".to_owned()));
        assert_eq!(id_text(&json!(null)), None);
        assert_eq!(key_of_id("42", 1), Some(vec!["42".to_owned()]));
        assert_eq!(
            key_of_id("7__abc", 2),
            Some(vec!["7".to_owned(), "abc".to_owned()])
        );
        assert_eq!(key_of_id("7", 2), None);
    }

    #[test]
    fn only_valid_input_is_cast_to_the_key_type() {
        assert!(castable("-12", &ValueKind::Integer, "bigint"));
        assert!(!castable("12abc", &ValueKind::Integer, "bigint"));
        assert!(castable(
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            &ValueKind::Text,
            "uuid"
        ));
        assert!(!castable("a0eebc99", &ValueKind::Text, "uuid"));
        assert!(castable("anything", &ValueKind::Text, "text"));
        assert!(!castable("2024-01-01", &ValueKind::Date, "date"));
    }
}
