//! Committed changes → Meilisearch operations, in commit order (pure: no pgrx).
//!
//! INSERT/UPDATE → add or replace the document (or a partial update in `upsert` mode, and always
//! when an UPDATE left TOASTed columns unchanged: those fields are omitted so the document keeps
//! them); an UPDATE that changes the key → delete the old id, then add the new document; DELETE →
//! delete by id; TRUNCATE → delete all documents. Every operation goes through one
//! [`ChangeBatcher`], so the operations of many transactions share a window, and only a second
//! operation of another kind on the same document closes it.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Instant;

use crate::document::encode::{encode_id, encode_row, ColumnValue, DocumentShape};
use crate::document::shard::ShardFilter;
use crate::meili::request::{Batch, Operation};
use crate::pipeline::batch::{BatchLimits, ChangeBatcher};
use crate::task::failure::{Advice, Failure, FailureKind};
use crate::wal::pgoutput::{Message, Relation, Tuple, TupleValue};

/// How one published relation's columns become a document.
pub struct RelationShape {
    /// The table, schema-qualified, for messages.
    pub table: String,
    pub shape: DocumentShape,
    /// For each document column, its position among the relation message's columns.
    pub source_columns: Vec<usize>,
}

/// A row the mapper could not turn into an operation: it becomes a dead letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedRow {
    pub relation: u32,
    pub code: &'static str,
    pub reason: String,
    /// The document as it would have been sent, when it could be encoded.
    pub document: Vec<u8>,
}

const NO_RELATION: &str = "change for a relation without a Relation message";

pub struct ChangeMapper {
    relations: HashMap<u32, RelationShape, BuildHasherDefault<OidHasher>>,
    batcher: ChangeBatcher,
    upsert: bool,
    document: Vec<u8>,
    /// The id JSON of the last row, reused.
    id: Vec<u8>,
    /// The allocation of the last row's column values, reused for the next row.
    values: Vec<ColumnValue<'static>>,
    skipped: Vec<SkippedRow>,
}

impl ChangeMapper {
    pub fn new(limits: BatchLimits, upsert: bool) -> Self {
        ChangeMapper {
            relations: HashMap::default(),
            batcher: ChangeBatcher::new(limits),
            upsert,
            document: Vec::with_capacity(1024),
            id: Vec::with_capacity(64),
            values: Vec::new(),
            skipped: Vec::new(),
        }
    }

    /// On a shard's pipeline: only the changes of documents whose id hashes to it go on (a
    /// TRUNCATE goes to every shard).
    pub fn with_shard(mut self, shard: Option<ShardFilter>) -> Self {
        self.batcher.set_shard(shard);
        self
    }

    /// Applies one decoded message. `shape_for` builds the document shape when a Relation message
    /// arrives (first use, or after a schema change); its error is permanent for the task. `now`
    /// is read only when a batch opens, so most messages do not read the clock.
    pub fn apply(
        &mut self,
        message: &Message<'_>,
        now: &dyn Fn() -> Instant,
        shape_for: &mut dyn FnMut(&Relation) -> Result<RelationShape, Failure>,
    ) -> Result<(), Failure> {
        match message {
            Message::Relation(relation) => {
                let shape = shape_for(relation)?;
                self.relations.insert(relation.oid, shape);
            }
            Message::Insert { relation, new } => self.upsert_row(*relation, new, now),
            Message::Update {
                relation,
                key,
                old,
                new,
            } => {
                if let Some(old_row) = key.as_ref().or(old.as_ref()) {
                    self.require_old_key(*relation, old_row, "an UPDATE")?;
                    let old_id = self.row_id(*relation, old_row);
                    let new_id = self.row_id(*relation, new);
                    if let (Some(old_id), Some(new_id)) = (old_id, new_id) {
                        if old_id != new_id {
                            self.delete(&old_id, now);
                        }
                    }
                }
                self.upsert_row(*relation, new, now);
            }
            Message::Delete { relation, key, old } => {
                let Some(old_row) = key.as_ref().or(old.as_ref()) else {
                    return Err(self.lost_old_key(*relation, "a DELETE"));
                };
                self.require_old_key(*relation, old_row, "a DELETE")?;
                if let Some(id) = self.row_id(*relation, old_row) {
                    self.delete(&id, now);
                }
            }
            Message::Truncate { relations, .. }
                if relations.iter().any(|oid| self.relations.contains_key(oid)) =>
            {
                self.batcher.push(Operation::DeleteAll, &[], &[], now);
            }
            Message::Commit { end_lsn, .. } => self.batcher.mark_checkpoint(*end_lsn),
            _ => {}
        }
        Ok(())
    }

    /// The key columns are NOT NULL, so a NULL among them in an old-key tuple means the replica
    /// identity no longer carries them: the document to delete cannot be known, and going on
    /// would leave it in the index for good.
    fn require_old_key(&self, relation: u32, old: &Tuple<'_>, change: &str) -> Result<(), Failure> {
        let Some(shape) = self.relations.get(&relation) else {
            return Ok(());
        };
        let carried = shape.shape.key_columns().iter().all(|&column| {
            shape
                .source_columns
                .get(column)
                .and_then(|&index| old.values.get(index))
                .is_some_and(|value| matches!(value, TupleValue::Text(_)))
        });
        if carried {
            Ok(())
        } else {
            Err(self.lost_old_key(relation, change))
        }
    }

    fn lost_old_key(&self, relation: u32, change: &str) -> Failure {
        let table = self
            .relations
            .get(&relation)
            .map(|shape| shape.table.as_str())
            .unwrap_or("the table");
        Failure::new(
            FailureKind::Source,
            format!(
                "{change} on {table} came without the old key of the row: its replica identity no longer carries the task's key columns (ALTER TABLE … REPLICA IDENTITY, or a changed primary key), so the document to delete cannot be known"
            ),
        )
        .advice(Advice::FixThenSnapshot(format!(
            "run ALTER TABLE {table} REPLICA IDENTITY FULL (or USING INDEX on a unique index of the key)"
        )))
    }

    fn skip(&mut self, relation: u32, reason: String) {
        self.skipped.push(SkippedRow {
            relation,
            code: "invalid_change",
            reason,
            document: Vec::new(),
        });
    }

    /// The row's values in document column order, in `buffer`'s allocation.
    fn values<'t>(
        shape: &RelationShape,
        row: &Tuple<'t>,
        buffer: Vec<ColumnValue<'_>>,
    ) -> Vec<ColumnValue<'t>> {
        let mut values = recycle(buffer);
        values.extend(
            shape
                .source_columns
                .iter()
                .map(|&index| match row.values.get(index) {
                    Some(TupleValue::Text(text)) => ColumnValue::Text(text),
                    Some(TupleValue::UnchangedToast) => ColumnValue::Unchanged,
                    _ => ColumnValue::Null,
                }),
        );
        values
    }

    /// The id JSON of a row (new row, or old key), or None (reported) if it has none.
    fn row_id(&mut self, relation: u32, row: &Tuple<'_>) -> Option<Vec<u8>> {
        let Some(shape) = self.relations.get(&relation) else {
            self.skip(relation, NO_RELATION.into());
            return None;
        };
        let values = Self::values(shape, row, std::mem::take(&mut self.values));
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
            Some(key) => encode_id(&shape.shape, &key)
                .map(|id| {
                    let mut json = Vec::new();
                    id.write_json(&mut json);
                    json
                })
                .map_err(|error| (error.code(), error.to_string())),
            None => Err((
                "missing_document_id",
                "the row's key is NULL or missing".to_owned(),
            )),
        };
        self.values = recycle(values);
        match result {
            Ok(json) => Some(json),
            Err((code, reason)) => {
                self.skipped.push(SkippedRow {
                    relation,
                    code,
                    reason,
                    document: Vec::new(),
                });
                None
            }
        }
    }

    fn upsert_row(&mut self, relation: u32, row: &Tuple<'_>, now: &dyn Fn() -> Instant) {
        let Some(shape) = self.relations.get(&relation) else {
            self.skip(relation, NO_RELATION.into());
            return;
        };
        let values = Self::values(shape, row, std::mem::take(&mut self.values));
        let partial = values.contains(&ColumnValue::Unchanged);
        self.document.clear();
        let encoded = encode_row(&shape.shape, &values, &mut self.document).map(|id| {
            self.id.clear();
            id.write_json(&mut self.id);
        });
        match encoded {
            Ok(()) => {
                let op = if partial || self.upsert {
                    Operation::Update
                } else {
                    Operation::Replace
                };
                self.batcher.push(op, &self.id, &self.document, now);
            }
            Err(error) => self.skipped.push(SkippedRow {
                relation,
                code: error.code(),
                reason: error.to_string(),
                document: self.document.clone(),
            }),
        }
        self.values = recycle(values);
    }

    fn delete(&mut self, id: &[u8], now: &dyn Fn() -> Instant) {
        self.batcher.push(Operation::Delete, id, id, now);
    }

    /// Closes the open window if it is older than the flush interval.
    pub fn flush_due(&mut self, now: Instant) {
        self.batcher.flush_due(now);
    }

    /// Closes the open window now (caught up with the WAL: nothing else is coming to fill it).
    pub fn flush(&mut self) {
        self.batcher.close();
    }

    /// The batcher whose closed batches are ready to send (see `Dispatcher::take_closed`).
    pub fn ready(&mut self) -> &mut ChangeBatcher {
        &mut self.batcher
    }

    /// The next batch to send, in order.
    pub fn next_ready(&mut self) -> Option<Batch> {
        self.batcher.next_closed()
    }

    /// Body bytes mapped and not yet handed over (the open window and closed batches).
    pub fn held_bytes(&self) -> usize {
        self.batcher.held_bytes()
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
        !self.batcher.has_closed() && self.batcher.is_empty()
    }
}

/// Hashes relation oids, looked up once per change: they are few and come from the server, so a
/// multiplication does instead of SipHash.
#[derive(Default)]
struct OidHasher(u64);

impl Hasher for OidHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u32(u32::from(byte));
        }
    }

    fn write_u32(&mut self, value: u32) {
        self.0 = (self.0 ^ u64::from(value)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// `buffer` emptied, as a Vec for values of another lifetime: collecting in place keeps its
/// allocation, so rows do not allocate their values one by one.
fn recycle<'b>(mut buffer: Vec<ColumnValue<'_>>) -> Vec<ColumnValue<'b>> {
    buffer.clear();
    buffer.into_iter().map(|_| ColumnValue::Null).collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::document::encode::{Column, ValueKind};
    use crate::wal::pgoutput::RelationColumn;

    const OID: u32 = 16384;

    fn relation() -> Relation {
        let column = |name: &str, flags| RelationColumn {
            flags,
            name: name.into(),
            type_oid: 0,
            type_modifier: -1,
        };
        Relation {
            oid: OID,
            namespace: "public".into(),
            name: "items".into(),
            replica_identity: b'd',
            columns: vec![
                column("id", 1),
                column("name", 0),
                column("secret", 0),
                column("body", 0),
            ],
        }
    }

    /// Documents of `items` leave out `secret`.
    fn shape_for(relation: &Relation) -> Result<RelationShape, Failure> {
        let kinds = [
            ValueKind::Integer,
            ValueKind::Text,
            ValueKind::Text,
            ValueKind::Text,
        ];
        let mut columns = Vec::new();
        let mut source_columns = Vec::new();
        for (position, column) in relation
            .columns
            .iter()
            .enumerate()
            .filter(|(_, c)| c.name != "secret")
        {
            columns.push(Column {
                name: column.name.clone(),
                kind: kinds[position].clone(),
            });
            source_columns.push(position);
        }
        let shape = DocumentShape::new(columns, vec![0])
            .map_err(|error| Failure::new(FailureKind::Source, error.to_string()))?;
        Ok(RelationShape {
            table: format!("{}.{}", relation.namespace, relation.name),
            shape,
            source_columns,
        })
    }

    fn mapper(max_docs: usize, upsert: bool) -> ChangeMapper {
        let limits = BatchLimits {
            max_docs,
            max_bytes: 1 << 20,
            max_age: Duration::from_secs(60),
        };
        let mut mapper = ChangeMapper::new(limits, upsert);
        mapper
            .apply(
                &Message::Relation(relation()),
                &Instant::now,
                &mut shape_for,
            )
            .expect("relation");
        mapper
    }

    fn row<'a>(values: &[Option<&'a str>]) -> Tuple<'a> {
        Tuple {
            values: values
                .iter()
                .map(|v| v.map_or(TupleValue::Null, TupleValue::Text))
                .collect(),
        }
    }

    fn apply(mapper: &mut ChangeMapper, message: Message<'_>) {
        mapper
            .apply(&message, &Instant::now, &mut shape_for)
            .expect("apply");
    }

    fn commit(mapper: &mut ChangeMapper, end_lsn: u64) {
        apply(
            mapper,
            Message::Commit {
                flags: 0,
                commit_lsn: end_lsn - 8,
                end_lsn,
                commit_time: 0,
            },
        );
    }

    /// Every batch as (operation, body text, checkpoint).
    fn drain(mapper: &mut ChangeMapper) -> Vec<(Operation, String, Option<u64>)> {
        mapper.flush();
        std::iter::from_fn(|| mapper.next_ready())
            .map(|batch| {
                (
                    batch.op,
                    String::from_utf8_lossy(&batch.body).into_owned(),
                    batch.checkpoint,
                )
            })
            .collect()
    }

    #[test]
    fn inserts_become_one_ndjson_batch_with_the_commit_checkpoint() {
        let mut mapper = mapper(100, false);
        apply(
            &mut mapper,
            Message::Insert {
                relation: OID,
                new: row(&[Some("1"), Some("a"), Some("x"), None]),
            },
        );
        apply(
            &mut mapper,
            Message::Insert {
                relation: OID,
                new: row(&[Some("2"), Some("b\"q"), Some("x"), Some("t")]),
            },
        );
        commit(&mut mapper, 500);
        assert_eq!(
            drain(&mut mapper),
            vec![(
                Operation::Replace,
                "{\"id\":1,\"name\":\"a\",\"body\":null}\n{\"id\":2,\"name\":\"b\\\"q\",\"body\":\"t\"}\n".into(),
                Some(500)
            )]
        );
    }

    #[test]
    fn a_delete_or_key_change_without_the_old_key_stops_the_task() {
        for message in [
            Message::Delete {
                relation: OID,
                key: None,
                old: None,
            },
            // The replica identity moved to other columns: the key comes as NULL.
            Message::Delete {
                relation: OID,
                key: Some(row(&[None, Some("a"), None, None])),
                old: None,
            },
            Message::Update {
                relation: OID,
                key: Some(row(&[None, Some("a"), None, None])),
                old: None,
                new: row(&[Some("2"), Some("b"), None, None]),
            },
        ] {
            let mut mapper = mapper(100, false);
            let error = mapper
                .apply(&message, &Instant::now, &mut shape_for)
                .expect_err("a change whose document cannot be known")
                .last_error(Some(9));
            assert!(
                error.contains("replica identity no longer carries the task's key columns")
                    && error.contains("REPLICA IDENTITY FULL")
                    && error.contains("meili_sync_snapshot(9)"),
                "{error}"
            );
        }
    }

    #[test]
    fn key_change_deletes_the_old_id_before_adding_the_new_document() {
        let mut mapper = mapper(100, false);
        apply(
            &mut mapper,
            Message::Update {
                relation: OID,
                key: Some(row(&[Some("7"), None, None, None])),
                old: None,
                new: row(&[Some("8"), Some("n"), None, Some("b")]),
            },
        );
        commit(&mut mapper, 900);
        let batches = drain(&mut mapper);
        assert_eq!(batches[0], (Operation::Delete, "[7]".into(), None));
        assert_eq!(
            batches[1],
            (
                Operation::Replace,
                "{\"id\":8,\"name\":\"n\",\"body\":\"b\"}\n".into(),
                Some(900)
            )
        );
    }

    #[test]
    fn unchanged_toast_makes_a_partial_update_without_that_field() {
        let mut mapper = mapper(100, false);
        let new = Tuple {
            values: vec![
                TupleValue::Text("3"),
                TupleValue::Text("n"),
                TupleValue::Null,
                TupleValue::UnchangedToast,
            ],
        };
        apply(
            &mut mapper,
            Message::Update {
                relation: OID,
                key: None,
                old: None,
                new,
            },
        );
        commit(&mut mapper, 10);
        assert_eq!(
            drain(&mut mapper),
            vec![(
                Operation::Update,
                "{\"id\":3,\"name\":\"n\"}\n".into(),
                Some(10)
            )]
        );
    }

    #[test]
    fn upsert_mode_sends_partial_updates() {
        let mut mapper = mapper(100, true);
        apply(
            &mut mapper,
            Message::Insert {
                relation: OID,
                new: row(&[Some("1"), Some("a"), None, None]),
            },
        );
        assert_eq!(drain(&mut mapper)[0].0, Operation::Update);
    }

    #[test]
    fn deletes_truncate_and_kind_changes_keep_commit_order() {
        let mut mapper = mapper(100, false);
        apply(
            &mut mapper,
            Message::Insert {
                relation: OID,
                new: row(&[Some("1"), None, None, None]),
            },
        );
        apply(
            &mut mapper,
            Message::Delete {
                relation: OID,
                key: Some(row(&[Some("1"), None, None, None])),
                old: None,
            },
        );
        apply(
            &mut mapper,
            Message::Delete {
                relation: OID,
                key: None,
                old: Some(row(&[Some("2"), Some("x"), None, None])),
            },
        );
        commit(&mut mapper, 100);
        apply(
            &mut mapper,
            Message::Truncate {
                options: 0,
                relations: vec![OID],
            },
        );
        commit(&mut mapper, 200);
        apply(
            &mut mapper,
            Message::Insert {
                relation: OID,
                new: row(&[Some("3"), None, None, None]),
            },
        );
        commit(&mut mapper, 300);
        let kinds: Vec<(Operation, String)> = drain(&mut mapper)
            .into_iter()
            .map(|(op, body, _)| (op, body))
            .collect();
        assert_eq!(
            kinds,
            vec![
                (
                    Operation::Replace,
                    "{\"id\":1,\"name\":null,\"body\":null}\n".into()
                ),
                (Operation::Delete, "[1,2]".into()),
                (Operation::DeleteAll, String::new()),
                (
                    Operation::Replace,
                    "{\"id\":3,\"name\":null,\"body\":null}\n".into()
                ),
            ]
        );
    }

    #[test]
    fn a_commit_without_documents_is_a_pending_checkpoint() {
        let mut mapper = mapper(100, false);
        commit(&mut mapper, 42);
        assert!(drain(&mut mapper).is_empty());
        assert_eq!(mapper.take_pending_checkpoint(), Some(42));
        assert!(mapper.is_idle());
    }

    #[test]
    fn rows_without_a_usable_key_are_skipped_and_reported() {
        let mut mapper = mapper(100, false);
        apply(
            &mut mapper,
            Message::Insert {
                relation: OID,
                new: row(&[None, Some("no id"), None, None]),
            },
        );
        apply(
            &mut mapper,
            Message::Insert {
                relation: OID + 1,
                new: row(&[Some("1")]),
            },
        );
        // (A DELETE without its old key stops the task instead, see below.)
        assert_eq!(mapper.take_skipped().len(), 2);
        assert!(drain(&mut mapper).is_empty());
    }

    #[test]
    fn relations_are_found_by_oid() {
        let mut mapper = mapper(100, false);
        for oid in [OID + 1, OID + 1024, u32::MAX] {
            let relation = Relation { oid, ..relation() };
            apply(&mut mapper, Message::Relation(relation));
        }
        for (oid, id) in [
            (u32::MAX, "1"),
            (OID, "2"),
            (OID + 1024, "3"),
            (OID + 1, "4"),
        ] {
            apply(
                &mut mapper,
                Message::Insert {
                    relation: oid,
                    new: row(&[Some(id), None, None, None]),
                },
            );
        }
        assert!(mapper.take_skipped().is_empty());
        assert_eq!(drain(&mut mapper)[0].1.lines().count(), 4);
    }

    #[test]
    fn recycling_keeps_the_allocation() {
        let text = String::from("x");
        let mut values = recycle(Vec::with_capacity(16));
        values.push(ColumnValue::Text(&text));
        let capacity = values.capacity();
        let pointer = values.as_ptr().cast::<u8>();
        let recycled: Vec<ColumnValue<'static>> = recycle(values);
        assert!(recycled.is_empty());
        assert_eq!(recycled.capacity(), capacity);
        assert_eq!(recycled.as_ptr().cast::<u8>(), pointer);
    }

    #[test]
    fn a_shape_error_is_returned() {
        let limits = BatchLimits {
            max_docs: 10,
            max_bytes: 1 << 20,
            max_age: Duration::from_secs(1),
        };
        let mut mapper = ChangeMapper::new(limits, false);
        let result = mapper.apply(&Message::Relation(relation()), &Instant::now, &mut |_| {
            Err(Failure::new(FailureKind::Source, "key column dropped"))
        });
        assert_eq!(
            result.err().map(|failure| failure.message),
            Some("key column dropped".to_owned())
        );
    }
}
