//! Committed changes on the tables a view reads → the keys of the documents they affect (pure: no
//! pgrx). A view task does not turn rows into documents: it collects, per window, which document
//! keys changed, and the extension renders those keys from the view afterwards, once each however
//! many of their rows changed.
//!
//! Each published table has one or more [`KeyRoute`]s, made by the extension before decoding:
//! - [`KeySource::Document`]: columns of the changed row that hold the document key (the view's
//!   root table, whose column is the view's key, and tables with a foreign key to it). The old
//!   row counts too, so a child moved from one parent to another affects both.
//! - [`KeySource::Mapping`]: the changed row's own key columns, handed to the user's mapping query
//!   at render time (lookup tables, many-to-many links, the tables of a UNION).
//!
//! A TRUNCATE of any published table affects every document ([`Window::everything`]).
//!
//! A partitioned table's changes come under its partitions' own OIDs (pgoutput, with
//! `publish_via_partition_root` off): each partition takes the routes of the partitioned table it
//! belongs to, resolved against the partition's own Relation message (its columns may be in
//! another order).

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use crate::task::failure::{Advice, Failure, FailureKind};
use crate::wal::pgoutput::{Message, Relation, Tuple, TupleValue};
use crate::wal::route::PartitionAncestors;

/// Where a route's key values go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource {
    /// The values are a document key.
    Document,
    /// The values are the changed row's key, for the mapping query with this index.
    Mapping(usize),
}

/// Which columns of one table's rows name affected documents (or mapping input).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRoute {
    pub source: KeySource,
    /// Column names, in the order of the document key (or of the mapping's parameters).
    pub columns: Vec<String>,
}

/// The routes of one table, as the extension planned them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableRoutes {
    /// Schema-qualified, for messages.
    pub table: String,
    pub routes: Vec<KeyRoute>,
}

/// A table's routes resolved against its Relation message: column positions.
struct ResolvedRoutes {
    table: String,
    routes: Vec<(KeySource, Vec<usize>)>,
}

/// What one window of changes affects.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Window {
    /// Document keys (text values, one per key column), without duplicates.
    pub documents: Vec<Vec<String>>,
    /// Per mapping query: the changed rows' keys to hand to it.
    pub mapped: Vec<Vec<Vec<String>>>,
    /// A TRUNCATE: every document must be rendered again.
    pub everything: bool,
    /// Top-level transaction ids of the window's commits: rendering waits until none is still
    /// in progress, so that its snapshot sees them all.
    pub xids: Vec<u32>,
    /// End LSN of the newest commit in the window (where the slot may be confirmed once the
    /// window's documents are in the index).
    pub checkpoint: Option<u64>,
}

impl Window {
    pub fn is_empty(&self) -> bool {
        self.documents.is_empty() && self.mapped.iter().all(Vec::is_empty) && !self.everything
    }
}

/// Collects the keys affected by decoded changes, window by window.
pub struct AffectedKeys {
    planned: HashMap<u32, TableRoutes>,
    resolved: HashMap<u32, ResolvedRoutes>,
    /// Partitions described so far whose partitioned ancestor is planned: partition → ancestor.
    partitions: HashMap<u32, u32>,
    /// Looks up a described relation's partitioned ancestors (none: every relation is planned
    /// under its own OID).
    ancestors_of: Option<PartitionAncestors>,
    mappings: usize,
    documents: HashSet<Vec<String>>,
    mapped: Vec<HashSet<Vec<String>>>,
    everything: bool,
    xids: Vec<u32>,
    /// The transaction being replayed: its xid, and whether it touched a published table.
    open: Option<(u32, bool)>,
    checkpoint: Option<u64>,
    opened_at: Option<Instant>,
    changes: usize,
}

impl AffectedKeys {
    /// `planned`: each published table's routes, by relation OID; `mappings`: how many mapping
    /// queries the routes refer to.
    pub fn new(planned: HashMap<u32, TableRoutes>, mappings: usize) -> Self {
        AffectedKeys {
            planned,
            resolved: HashMap::new(),
            partitions: HashMap::new(),
            ancestors_of: None,
            mappings,
            documents: HashSet::new(),
            mapped: vec![HashSet::new(); mappings],
            everything: false,
            xids: Vec::new(),
            open: None,
            checkpoint: None,
            opened_at: None,
            changes: 0,
        }
    }

    /// Changes of partitions count as changes of their planned partitioned ancestors, which
    /// `ancestors_of` names (nearest first) when a partition is described.
    pub fn with_partition_ancestors(mut self, ancestors_of: PartitionAncestors) -> Self {
        self.ancestors_of = Some(ancestors_of);
        self
    }

    /// The planned table whose routes a relation's changes take: itself, or the partitioned
    /// table it is a partition of (as when it was last described).
    fn planned_as(&self, relation: u32) -> Option<u32> {
        if self.planned.contains_key(&relation) {
            return Some(relation);
        }
        self.partitions.get(&relation).copied()
    }

    /// Applies one decoded message. An error is permanent for the task: the change's documents
    /// cannot be known.
    pub fn apply(
        &mut self,
        message: &Message<'_>,
        now: &dyn Fn() -> Instant,
    ) -> Result<(), Failure> {
        match message {
            Message::Begin { xid, .. } => self.open = Some((*xid, false)),
            Message::Relation(relation) => self.resolve(relation)?,
            Message::Insert { relation, new } => self.collect(*relation, new, false, now)?,
            Message::Update {
                relation,
                key,
                old,
                new,
            } => {
                if let Some(old_row) = key.as_ref().or(old.as_ref()) {
                    self.collect(*relation, old_row, true, now)?;
                }
                self.collect(*relation, new, false, now)?;
            }
            Message::Delete { relation, key, old } => match key.as_ref().or(old.as_ref()) {
                Some(old_row) => self.collect(*relation, old_row, true, now)?,
                None => return Err(self.lost_old_row(*relation, "a DELETE")),
            },
            Message::Truncate { relations, .. }
                if relations.iter().any(|oid| self.planned_as(*oid).is_some()) =>
            {
                self.everything = true;
                self.touch(now);
            }
            Message::Commit { end_lsn, .. } => {
                if let Some((xid, true)) = self.open.take() {
                    self.xids.push(xid);
                }
                self.checkpoint = Some(*end_lsn);
            }
            _ => {}
        }
        Ok(())
    }

    fn resolve(&mut self, relation: &Relation) -> Result<(), Failure> {
        // Described again after an ATTACH or DETACH: its ancestors are looked up again.
        self.partitions.remove(&relation.oid);
        self.resolved.remove(&relation.oid);
        if !self.planned.contains_key(&relation.oid) {
            let ancestors = self
                .ancestors_of
                .as_mut()
                .map(|ancestors_of| ancestors_of(relation.oid))
                .unwrap_or_default();
            if let Some(&ancestor) = ancestors
                .iter()
                .find(|ancestor| self.planned.contains_key(ancestor))
            {
                self.partitions.insert(relation.oid, ancestor);
            }
        }
        let Some(planned) = self
            .planned_as(relation.oid)
            .and_then(|planned| self.planned.get(&planned))
        else {
            return Ok(());
        };
        let mut routes = Vec::new();
        for route in &planned.routes {
            let mut positions = Vec::new();
            for name in &route.columns {
                let Some(position) = relation.columns.iter().position(|c| &c.name == name) else {
                    return Err(Failure::new(
                        FailureKind::Source,
                        format!(
                            "column \"{name}\" of table {} was dropped or renamed, and the task needs it to know which documents a change affects; the task stopped so as not to leave documents stale",
                            planned.table
                        ),
                    )
                    .hint("drop the task and start a new one"));
                };
                // The old row of an UPDATE or DELETE carries only replica-identity columns.
                if relation.columns[position].flags & 1 == 0 {
                    return Err(Failure::new(
                        FailureKind::Source,
                        format!(
                            "the replica identity of table {} no longer carries column \"{name}\", so the documents a DELETE affects cannot be known",
                            planned.table
                        ),
                    )
                    .advice(replica_identity_full(&planned.table)));
                }
                positions.push(position);
            }
            if let KeySource::Mapping(index) = route.source {
                if index >= self.mappings {
                    return Err(Failure::new(
                        FailureKind::Internal,
                        format!("mapping {index} of table {} does not exist", planned.table),
                    ));
                }
            }
            routes.push((route.source, positions));
        }
        self.resolved.insert(
            relation.oid,
            ResolvedRoutes {
                table: planned.table.clone(),
                routes,
            },
        );
        Ok(())
    }

    fn collect(
        &mut self,
        relation: u32,
        row: &Tuple<'_>,
        old: bool,
        now: &dyn Fn() -> Instant,
    ) -> Result<(), Failure> {
        if self.planned_as(relation).is_none() {
            return Ok(());
        }
        let Some(resolved) = self.resolved.get(&relation) else {
            return Err(Failure::new(
                FailureKind::Decoding,
                format!("a change for relation {relation} came before its Relation message"),
            ));
        };
        let mut touched = false;
        for (source, positions) in &resolved.routes {
            let mut key = Vec::with_capacity(positions.len());
            for &position in positions {
                match row.values.get(position) {
                    Some(TupleValue::Text(text)) => key.push((*text).to_owned()),
                    // A NULL foreign key points to no document.
                    Some(TupleValue::Null) | None => break,
                    Some(TupleValue::UnchangedToast) if !old => break,
                    Some(TupleValue::UnchangedToast | TupleValue::Binary(_)) => {
                        return Err(Failure::new(
                            FailureKind::Source,
                            format!(
                                "a change on {} came without the value of a key column (stored out of line or binary), so the documents it affects cannot be known",
                                resolved.table
                            ),
                        )
                        .advice(replica_identity_full(&resolved.table)))
                    }
                }
            }
            if key.len() != positions.len() {
                continue;
            }
            touched = true;
            match source {
                KeySource::Document => {
                    self.documents.insert(key);
                }
                KeySource::Mapping(index) => {
                    if let Some(set) = self.mapped.get_mut(*index) {
                        set.insert(key);
                    }
                }
            }
        }
        if touched {
            self.touch(now);
        }
        Ok(())
    }

    fn touch(&mut self, now: &dyn Fn() -> Instant) {
        self.changes += 1;
        if self.opened_at.is_none() {
            self.opened_at = Some(now());
        }
        if let Some((_, touched)) = self.open.as_mut() {
            *touched = true;
        }
    }

    fn lost_old_row(&self, relation: u32, change: &str) -> Failure {
        let table = self
            .planned_as(relation)
            .and_then(|planned| self.planned.get(&planned))
            .map_or("a table of the view", |planned| planned.table.as_str());
        Failure::new(
            FailureKind::Source,
            format!(
                "{change} on {table} came without its old row, so the documents it affects cannot be known"
            ),
        )
        .advice(replica_identity_full(table))
    }

    /// Distinct keys collected (documents and mapping inputs).
    pub fn len(&self) -> usize {
        self.documents.len() + self.mapped.iter().map(HashSet::len).sum::<usize>()
    }

    /// Nothing collected since the last window, and no commit to confirm.
    pub fn is_empty(&self) -> bool {
        self.len() == 0 && !self.everything && self.checkpoint.is_none()
    }

    /// Changes seen in the open window (each row change counts, also repeats of one key).
    pub fn changes(&self) -> usize {
        self.changes
    }

    /// When the open window got its first affecting change.
    pub fn opened_at(&self) -> Option<Instant> {
        self.opened_at
    }

    /// A transaction is being replayed: a window taken now would split it.
    pub fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    /// Ends the window: what it affects, and the checkpoint that covers it. Only between
    /// transactions (pgoutput replays each transaction whole, so after a read this always holds).
    pub fn take(&mut self) -> Window {
        self.opened_at = None;
        self.changes = 0;
        let mut documents: Vec<Vec<String>> = self.documents.drain().collect();
        documents.sort();
        Window {
            documents,
            mapped: self
                .mapped
                .iter_mut()
                .map(|set| {
                    let mut keys: Vec<Vec<String>> = set.drain().collect();
                    keys.sort();
                    keys
                })
                .collect(),
            everything: std::mem::take(&mut self.everything),
            xids: std::mem::take(&mut self.xids),
            checkpoint: self.checkpoint.take(),
        }
    }
}

/// What to do when a table of a view task no longer logs the old rows its changes need.
fn replica_identity_full(table: &str) -> Advice {
    Advice::FixThenSnapshot(format!("run ALTER TABLE {table} REPLICA IDENTITY FULL"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::pgoutput::RelationColumn;

    const PRODUCTS: u32 = 100;
    const REVIEWS: u32 = 200;
    const TAGS: u32 = 300;
    const OTHER: u32 = 400;

    fn relation(oid: u32, name: &str, columns: &[(&str, bool)]) -> Message<'static> {
        Message::Relation(Relation {
            oid,
            namespace: "public".into(),
            name: name.into(),
            replica_identity: b'd',
            columns: columns
                .iter()
                .map(|(name, key)| RelationColumn {
                    flags: u8::from(*key),
                    name: (*name).into(),
                    type_oid: 23,
                    type_modifier: -1,
                })
                .collect(),
        })
    }

    fn tuple<'a>(values: &[Option<&'a str>]) -> Tuple<'a> {
        Tuple {
            values: values
                .iter()
                .map(|value| value.map_or(TupleValue::Null, TupleValue::Text))
                .collect(),
        }
    }

    fn collector() -> AffectedKeys {
        let route = |source, columns: &[&str]| KeyRoute {
            source,
            columns: columns.iter().map(|c| (*c).to_owned()).collect(),
        };
        let mut planned = HashMap::new();
        planned.insert(
            PRODUCTS,
            TableRoutes {
                table: "public.products".into(),
                routes: vec![route(KeySource::Document, &["id"])],
            },
        );
        planned.insert(
            REVIEWS,
            TableRoutes {
                table: "public.reviews".into(),
                routes: vec![route(KeySource::Document, &["product_id"])],
            },
        );
        planned.insert(
            TAGS,
            TableRoutes {
                table: "public.tags".into(),
                routes: vec![route(KeySource::Mapping(0), &["id"])],
            },
        );
        let mut keys = AffectedKeys::new(planned, 1);
        for message in [
            relation(PRODUCTS, "products", &[("id", true), ("name", false)]),
            relation(
                REVIEWS,
                "reviews",
                &[("id", true), ("product_id", true), ("stars", true)],
            ),
            relation(TAGS, "tags", &[("id", true), ("label", false)]),
        ] {
            keys.apply(&message, &Instant::now).expect("relation");
        }
        keys
    }

    fn begin(xid: u32) -> Message<'static> {
        Message::Begin {
            final_lsn: 0,
            commit_time: 0,
            xid,
        }
    }

    fn commit(end_lsn: u64) -> Message<'static> {
        Message::Commit {
            flags: 0,
            commit_lsn: end_lsn - 1,
            end_lsn,
            commit_time: 0,
        }
    }

    fn keys(values: &[&[&str]]) -> Vec<Vec<String>> {
        values
            .iter()
            .map(|key| key.iter().map(|v| (*v).to_owned()).collect())
            .collect()
    }

    #[test]
    fn a_parent_whose_children_change_many_times_is_one_key() {
        let mut collected = collector();
        collected.apply(&begin(7), &Instant::now).unwrap();
        for review in 0..500 {
            let id = review.to_string();
            collected
                .apply(
                    &Message::Insert {
                        relation: REVIEWS,
                        new: tuple(&[Some(&id), Some("1"), Some("5")]),
                    },
                    &Instant::now,
                )
                .unwrap();
        }
        collected.apply(&commit(50), &Instant::now).unwrap();
        assert_eq!(collected.changes(), 500);
        let window = collected.take();
        assert_eq!(window.documents, keys(&[&["1"]]));
        assert_eq!(window.xids, vec![7]);
        assert_eq!(window.checkpoint, Some(50));
        assert!(collected.is_empty(), "the window was taken");
    }

    #[test]
    fn a_moved_child_affects_its_old_and_new_parent() {
        let mut collected = collector();
        collected.apply(&begin(8), &Instant::now).unwrap();
        collected
            .apply(
                &Message::Update {
                    relation: REVIEWS,
                    key: None,
                    old: Some(tuple(&[Some("9"), Some("1"), Some("5")])),
                    new: tuple(&[Some("9"), Some("2"), Some("5")]),
                },
                &Instant::now,
            )
            .unwrap();
        collected
            .apply(
                &Message::Delete {
                    relation: PRODUCTS,
                    key: Some(tuple(&[Some("3"), None])),
                    old: None,
                },
                &Instant::now,
            )
            .unwrap();
        collected.apply(&commit(60), &Instant::now).unwrap();
        let window = collected.take();
        assert_eq!(window.documents, keys(&[&["1"], &["2"], &["3"]]));
    }

    #[test]
    fn mapped_tables_collect_their_own_keys_and_null_foreign_keys_point_nowhere() {
        let mut collected = collector();
        collected.apply(&begin(9), &Instant::now).unwrap();
        for message in [
            Message::Update {
                relation: TAGS,
                key: None,
                old: None,
                new: tuple(&[Some("4"), Some("red")]),
            },
            Message::Insert {
                relation: REVIEWS,
                new: tuple(&[Some("10"), None, Some("1")]),
            },
            Message::Insert {
                relation: OTHER,
                new: tuple(&[Some("1")]),
            },
        ] {
            collected.apply(&message, &Instant::now).unwrap();
        }
        collected.apply(&commit(70), &Instant::now).unwrap();
        let window = collected.take();
        assert!(window.documents.is_empty());
        assert_eq!(window.mapped, vec![keys(&[&["4"]])]);
        assert_eq!(window.xids, vec![9]);
    }

    #[test]
    fn a_truncate_affects_everything_and_unrelated_commits_only_move_the_checkpoint() {
        let mut collected = collector();
        collected.apply(&begin(10), &Instant::now).unwrap();
        collected.apply(&commit(80), &Instant::now).unwrap();
        let quiet = collected.take();
        assert!(quiet.is_empty());
        assert!(quiet.xids.is_empty(), "nothing to wait for");
        assert_eq!(quiet.checkpoint, Some(80));
        collected.apply(&begin(11), &Instant::now).unwrap();
        collected
            .apply(
                &Message::Truncate {
                    options: 0,
                    relations: vec![REVIEWS],
                },
                &Instant::now,
            )
            .unwrap();
        collected.apply(&commit(90), &Instant::now).unwrap();
        let window = collected.take();
        assert!(window.everything);
        assert_eq!(window.xids, vec![11]);
    }

    #[test]
    fn a_lost_identity_column_stops_the_task() {
        let mut collected = collector();
        let error = collected
            .apply(
                &relation(REVIEWS, "reviews", &[("id", true), ("product_id", false)]),
                &Instant::now,
            )
            .unwrap_err()
            .last_error(Some(5));
        assert!(error.contains("REPLICA IDENTITY FULL"), "{error}");
        assert!(error.contains("public.reviews"), "{error}");
        let mut collected = collector();
        let error = collected
            .apply(
                &relation(REVIEWS, "reviews", &[("id", true), ("stars", true)]),
                &Instant::now,
            )
            .unwrap_err()
            .last_error(Some(5));
        assert!(error.contains("\"product_id\""), "{error}");
        let error = collector()
            .apply(
                &Message::Delete {
                    relation: REVIEWS,
                    key: None,
                    old: None,
                },
                &Instant::now,
            )
            .unwrap_err()
            .last_error(Some(5));
        assert!(error.contains("without its old row"), "{error}");
    }

    #[test]
    fn a_partition_takes_its_partitioned_tables_routes() {
        // Reviews is partitioned: 201 and 202 are its partitions (202 with its columns in
        // another order), 203 a partition of another table, and 204 one detached later.
        let ancestors = |relation: u32| match relation {
            201 | 202 | 204 => vec![REVIEWS],
            203 => vec![OTHER],
            _ => Vec::new(),
        };
        let mut collected = collector().with_partition_ancestors(Box::new(ancestors));
        for message in [
            relation(
                201,
                "reviews_2025",
                &[("id", true), ("product_id", true), ("stars", true)],
            ),
            relation(
                202,
                "reviews_2026",
                &[("stars", true), ("product_id", true), ("id", true)],
            ),
            relation(203, "other_1", &[("product_id", true)]),
        ] {
            collected.apply(&message, &Instant::now).unwrap();
        }
        collected.apply(&begin(7), &Instant::now).unwrap();
        for (relation, values) in [
            (201, [Some("1"), Some("10"), Some("5")]),
            (202, [Some("4"), Some("20"), Some("2")]),
        ] {
            collected
                .apply(
                    &Message::Insert {
                        relation,
                        new: tuple(&values),
                    },
                    &Instant::now,
                )
                .unwrap();
        }
        collected
            .apply(
                &Message::Insert {
                    relation: 203,
                    new: tuple(&[Some("30")]),
                },
                &Instant::now,
            )
            .unwrap();
        collected.apply(&commit(20), &Instant::now).unwrap();
        let window = collected.take();
        assert_eq!(window.documents, keys(&[&["10"], &["20"]]));
        assert_eq!(window.xids, vec![7]);

        // A TRUNCATE of one partition affects every document of the view.
        collected.apply(&begin(8), &Instant::now).unwrap();
        collected
            .apply(
                &Message::Truncate {
                    options: 0,
                    relations: vec![202],
                },
                &Instant::now,
            )
            .unwrap();
        collected.apply(&commit(30), &Instant::now).unwrap();
        assert!(collected.take().everything);

        // A partition of a table the view does not read is ignored, also when truncated.
        collected.apply(&begin(9), &Instant::now).unwrap();
        collected
            .apply(
                &Message::Truncate {
                    options: 0,
                    relations: vec![203],
                },
                &Instant::now,
            )
            .unwrap();
        collected.apply(&commit(40), &Instant::now).unwrap();
        assert!(!collected.take().everything);

        // A partition whose identity lost a route column stops the task, naming the table.
        let error = collected
            .apply(
                &relation(204, "reviews_old", &[("id", true), ("product_id", false)]),
                &Instant::now,
            )
            .unwrap_err()
            .last_error(Some(5));
        assert!(error.contains("public.reviews"), "{error}");

        // Without a lookup of ancestors, partitions are unknown relations.
        let mut plain = collector();
        plain
            .apply(
                &relation(201, "reviews_2025", &[("product_id", true)]),
                &Instant::now,
            )
            .unwrap();
        plain
            .apply(
                &Message::Insert {
                    relation: 201,
                    new: tuple(&[Some("10")]),
                },
                &Instant::now,
            )
            .unwrap();
        assert!(plain.take().documents.is_empty());
    }
}
