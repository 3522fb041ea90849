//! Committed changes → Meilisearch operations, in commit order (pure: no pgrx).
//!
//! INSERT/UPDATE → add or replace the document (or a partial update in `upsert` mode, and always
//! when an UPDATE left TOASTed columns unchanged: those fields are omitted so the document keeps
//! them); an UPDATE that changes the key → delete the old id, then add the new document; DELETE →
//! delete by id; TRUNCATE → delete all documents. Every operation goes through one `Batcher`, so
//! consecutive operations of one kind share a batch and a change of kind closes it.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use crate::batch::{Batch, BatchLimits, Batcher, Operation};
use crate::decode::pgoutput::{Message, Relation, Tuple, TupleValue};
use crate::encode::{encode_document, encode_id, ColumnValue, DocumentShape};

/// How one published relation's columns become a document.
pub struct RelationShape {
    pub shape: DocumentShape,
    /// For each document column, its position among the relation message's columns.
    pub source_columns: Vec<usize>,
}

/// A row the mapper could not turn into an operation (it is skipped; the caller reports it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedRow {
    pub relation: u32,
    pub reason: String,
}

const NO_RELATION: &str = "change for a relation without a Relation message";

pub struct ChangeMapper {
    relations: HashMap<u32, RelationShape>,
    batcher: Batcher,
    upsert: bool,
    ready: VecDeque<Batch>,
    document: Vec<u8>,
    skipped: Vec<SkippedRow>,
}

impl ChangeMapper {
    pub fn new(limits: BatchLimits, upsert: bool) -> Self {
        ChangeMapper {
            relations: HashMap::new(),
            batcher: Batcher::new(limits),
            upsert,
            ready: VecDeque::new(),
            document: Vec::with_capacity(1024),
            skipped: Vec::new(),
        }
    }

    /// Applies one decoded message. `shape_for` builds the document shape when a Relation message
    /// arrives (first use, or after a schema change); its error is permanent for the task.
    pub fn apply(
        &mut self,
        message: Message<'_>,
        now: Instant,
        shape_for: &mut dyn FnMut(&Relation) -> Result<RelationShape, String>,
    ) -> Result<(), String> {
        match message {
            Message::Relation(relation) => {
                let shape = shape_for(&relation)?;
                self.relations.insert(relation.oid, shape);
            }
            Message::Insert { relation, new } => self.upsert_row(relation, &new, now),
            Message::Update {
                relation,
                key,
                old,
                new,
            } => {
                if let Some(old_row) = key.as_ref().or(old.as_ref()) {
                    let old_id = self.row_id(relation, old_row);
                    let new_id = self.row_id(relation, &new);
                    if let (Some(old_id), Some(new_id)) = (old_id, new_id) {
                        if old_id != new_id {
                            self.push(Operation::Delete, &old_id, now);
                        }
                    }
                }
                self.upsert_row(relation, &new, now);
            }
            Message::Delete { relation, key, old } => {
                if let Some(old_row) = key.as_ref().or(old.as_ref()) {
                    if let Some(id) = self.row_id(relation, old_row) {
                        self.push(Operation::Delete, &id, now);
                    }
                } else {
                    self.skip(
                        relation,
                        "DELETE without the old key (check the table's replica identity)".into(),
                    );
                }
            }
            Message::Truncate { relations, .. } => {
                if relations.iter().any(|oid| self.relations.contains_key(oid)) {
                    self.push(Operation::DeleteAll, &[], now);
                }
            }
            Message::Commit { end_lsn, .. } => self.batcher.mark_checkpoint(end_lsn),
            _ => {}
        }
        Ok(())
    }

    fn skip(&mut self, relation: u32, reason: String) {
        self.skipped.push(SkippedRow { relation, reason });
    }

    fn values<'t>(shape: &RelationShape, row: &'t Tuple<'t>) -> Vec<ColumnValue<'t>> {
        shape
            .source_columns
            .iter()
            .map(|&index| match row.values.get(index) {
                Some(TupleValue::Text(text)) => ColumnValue::Text(text),
                Some(TupleValue::UnchangedToast) => ColumnValue::Unchanged,
                _ => ColumnValue::Null,
            })
            .collect()
    }

    /// The id JSON of a row (new row, or old key), or None (reported) if it has none.
    fn row_id(&mut self, relation: u32, row: &Tuple<'_>) -> Option<Vec<u8>> {
        let Some(shape) = self.relations.get(&relation) else {
            self.skip(relation, NO_RELATION.into());
            return None;
        };
        let values = Self::values(shape, row);
        let key: Option<Vec<&str>> = shape
            .shape
            .key_columns()
            .iter()
            .map(|&index| match values.get(index) {
                Some(ColumnValue::Text(text)) => Some(*text),
                _ => None,
            })
            .collect();
        let result = match key {
            Some(key) => encode_id(&shape.shape, &key).map_err(|error| error.to_string()),
            None => Err("the row's key is NULL or missing".to_owned()),
        };
        match result {
            Ok(id) => {
                let mut json = Vec::new();
                id.write_json(&mut json);
                Some(json)
            }
            Err(reason) => {
                self.skipped.push(SkippedRow { relation, reason });
                None
            }
        }
    }

    fn upsert_row(&mut self, relation: u32, row: &Tuple<'_>, now: Instant) {
        let Some(shape) = self.relations.get(&relation) else {
            self.skip(relation, NO_RELATION.into());
            return;
        };
        let values = Self::values(shape, row);
        let partial = values.iter().any(|value| *value == ColumnValue::Unchanged);
        self.document.clear();
        match encode_document(&shape.shape, &values, &mut self.document) {
            Ok(_) => {
                let op = if partial || self.upsert {
                    Operation::Update
                } else {
                    Operation::Replace
                };
                if let Some(batch) = self.batcher.push(op, &self.document, now) {
                    self.ready.push_back(batch);
                }
            }
            Err(error) => self.skipped.push(SkippedRow {
                relation,
                reason: error.to_string(),
            }),
        }
    }

    fn push(&mut self, op: Operation, item: &[u8], now: Instant) {
        if let Some(batch) = self.batcher.push(op, item, now) {
            self.ready.push_back(batch);
        }
    }

    /// Closes the open batch if it is older than the flush interval.
    pub fn flush_due(&mut self, now: Instant) {
        if let Some(batch) = self.batcher.flush_due(now) {
            self.ready.push_back(batch);
        }
    }

    /// Closes the open batch now (caught up with the WAL: nothing else is coming to fill it).
    pub fn flush(&mut self) {
        if let Some(batch) = self.batcher.flush() {
            self.ready.push_back(batch);
        }
    }

    /// The next batch to send, in order.
    pub fn next_ready(&mut self) -> Option<Batch> {
        self.ready.pop_front()
    }

    /// A commit whose changes produced no document: confirmable once everything before it is.
    pub fn take_pending_checkpoint(&mut self) -> Option<u64> {
        self.batcher.take_pending_checkpoint()
    }

    pub fn take_skipped(&mut self) -> Vec<SkippedRow> {
        std::mem::take(&mut self.skipped)
    }

    /// True when no operation is waiting in an open or closed batch.
    pub fn is_idle(&self) -> bool {
        self.ready.is_empty() && self.batcher.is_empty()
    }
}
