//! One decoded pgoutput stream, many tasks: hands each task the messages of the tables it syncs,
//! framed as a stream of its own (Begin, the Relation messages it has not seen, its changes,
//! Commit), so that each task's `ChangeMapper` works exactly as on a slot of its own.
//!
//! Each message is parsed once, by the pass that read it: the router and every task it reaches
//! share the parsed message (a Begin and a Relation are kept, parsed, for the tasks they reach
//! later).
//!
//! The shared slot can be confirmed only to the lowest position any task still needs, so the
//! stream is read again from there whenever a task joins (new, resumed, or back from a full
//! queue). Each task therefore skips, by itself, every transaction that committed before the
//! position it already has: what PostgreSQL's own `SnapBuildXactNeedsSkip` does for one slot.

use std::collections::{HashMap, HashSet};

use crate::wal::pgoutput::{Message, Relation};
use crate::wal::state_change;

pub type TaskId = i64;

/// Where a task stands in the shared stream.
struct Route {
    /// Relations whose changes the task receives.
    relations: Vec<u32>,
    /// Transactions whose commit record starts before this position were already delivered to
    /// the task (or are in its copy): they are skipped.
    skip_before: u64,
    /// Relations whose current Relation message the task has received.
    described: HashSet<u32>,
}

/// The transaction being delivered: its Begin goes to a task only with the task's first change,
/// so a task sees no transactions of other tables.
struct Transaction {
    final_lsn: u64,
    /// The transaction's Begin, as it reaches each task with the task's first change.
    begin: Message<'static>,
    begun: Vec<TaskId>,
}

/// The partitioned tables a relation is a partition of, nearest first, as the catalog says at the
/// decoded change (the shared decoder asks PostgreSQL inside the decoding callback).
pub type PartitionAncestors = Box<dyn FnMut(u32) -> Vec<u32>>;

pub struct Router {
    routes: HashMap<TaskId, Route>,
    /// Which tasks each relation's changes go to.
    subscribers: HashMap<u32, Vec<TaskId>>,
    /// The newest Relation message of each relation this decoding session described.
    descriptions: HashMap<u32, Message<'static>>,
    /// The partitioned ancestors of each described relation that is a partition: a change to a
    /// partition also goes to the tasks of its partitioned tables. pgoutput (with
    /// `publish_via_partition_root` off) sends a partition's changes under the partition's own
    /// OID, and describes it again after an ATTACH or DETACH, when this is looked up again.
    ancestors: HashMap<u32, Vec<u32>>,
    ancestors_of: PartitionAncestors,
    transaction: Option<Transaction>,
}

impl Default for Router {
    fn default() -> Self {
        Router::new(Box::new(|_| Vec::new()))
    }
}

impl Router {
    pub fn new(ancestors_of: PartitionAncestors) -> Self {
        Router {
            routes: HashMap::new(),
            subscribers: HashMap::new(),
            descriptions: HashMap::new(),
            ancestors: HashMap::new(),
            ancestors_of,
            transaction: None,
        }
    }

    /// Starts routing `relations` to `task`, skipping transactions that committed before
    /// `skip_before`. Called between reads, never inside a transaction.
    pub fn attach(&mut self, task: TaskId, relations: &[u32], skip_before: u64) {
        self.detach(task);
        for &relation in relations {
            self.subscribers.entry(relation).or_default().push(task);
        }
        self.routes.insert(
            task,
            Route {
                relations: relations.to_vec(),
                skip_before,
                described: HashSet::new(),
            },
        );
    }

    pub fn detach(&mut self, task: TaskId) {
        let Some(route) = self.routes.remove(&task) else {
            return;
        };
        for relation in route.relations {
            if let Some(tasks) = self.subscribers.get_mut(&relation) {
                tasks.retain(|&other| other != task);
                if tasks.is_empty() {
                    self.subscribers.remove(&relation);
                }
            }
        }
    }

    pub fn is_attached(&self, task: TaskId) -> bool {
        self.routes.contains_key(&task)
    }

    pub fn attached(&self) -> impl Iterator<Item = TaskId> + '_ {
        self.routes.keys().copied()
    }

    /// The stream is read again from an earlier position in a new decoding session: every
    /// attached task has everything that committed before `read_position` (where the old session
    /// stopped) and skips it; the new session describes every relation again. Tasks that join
    /// with this new session are attached after this call, with their own positions.
    pub fn restart(&mut self, read_position: u64) {
        for route in self.routes.values_mut() {
            route.skip_before = route.skip_before.max(read_position);
            route.described.clear();
        }
        self.descriptions.clear();
        self.ancestors.clear();
        self.transaction = None;
    }

    /// Routes one parsed pgoutput message: `deliver(task, lsn, message)` for each task it
    /// concerns.
    pub fn route(
        &mut self,
        lsn: u64,
        message: &Message<'_>,
        deliver: &mut dyn FnMut(TaskId, u64, &Message<'_>),
    ) {
        match message {
            &Message::Begin {
                final_lsn,
                commit_time,
                xid,
            } => {
                self.transaction = Some(Transaction {
                    final_lsn,
                    begin: Message::Begin {
                        final_lsn,
                        commit_time,
                        xid,
                    },
                    begun: Vec::new(),
                });
            }
            Message::Relation(relation) => {
                // A new definition: every task must see it before its next change.
                for route in self.routes.values_mut() {
                    route.described.remove(&relation.oid);
                }
                self.describe(relation);
            }
            Message::Insert { relation, .. }
            | Message::Update { relation, .. }
            | Message::Delete { relation, .. } => {
                self.deliver_change(&[*relation], lsn, message, deliver);
            }
            Message::Truncate { relations, .. } => {
                self.deliver_change(relations, lsn, message, deliver);
            }
            Message::Commit { .. } => {
                if let Some(transaction) = self.transaction.take() {
                    for task in transaction.begun {
                        deliver(task, lsn, message);
                    }
                }
            }
            Message::Emitted { .. } => {
                // A task's state change goes to that task, at its place in the transaction.
                if let Some(task) = state_change::task_of(message) {
                    self.deliver_state_change(task, lsn, message, deliver);
                }
            }
            // Types and origins carry nothing a task maps.
            _ => {}
        }
    }

    /// Keeps a relation's newest description for the tasks it reaches, and looks up again the
    /// partitioned tables it is a partition of.
    fn describe(&mut self, relation: &Relation) {
        self.descriptions
            .insert(relation.oid, Message::Relation(relation.clone()));
        let ancestors = (self.ancestors_of)(relation.oid);
        if ancestors.is_empty() {
            self.ancestors.remove(&relation.oid);
        } else {
            self.ancestors.insert(relation.oid, ancestors);
        }
    }

    fn deliver_state_change(
        &mut self,
        task: TaskId,
        lsn: u64,
        message: &Message<'_>,
        deliver: &mut dyn FnMut(TaskId, u64, &Message<'_>),
    ) {
        let (Some(transaction), Some(route)) = (self.transaction.as_ref(), self.routes.get(&task))
        else {
            return;
        };
        if transaction.final_lsn >= route.skip_before {
            deliver(task, lsn, message);
        }
    }

    fn deliver_change(
        &mut self,
        relations: &[u32],
        lsn: u64,
        message: &Message<'_>,
        deliver: &mut dyn FnMut(TaskId, u64, &Message<'_>),
    ) {
        let Some(transaction) = self.transaction.as_mut() else {
            return;
        };
        let ancestors = &self.ancestors;
        let mut tasks: Vec<TaskId> = relations
            .iter()
            .flat_map(|relation| {
                std::iter::once(relation).chain(ancestors.get(relation).into_iter().flatten())
            })
            .filter_map(|relation| self.subscribers.get(relation))
            .flatten()
            .copied()
            .collect();
        tasks.sort_unstable();
        tasks.dedup();
        for task in tasks {
            let Some(route) = self.routes.get_mut(&task) else {
                continue;
            };
            if transaction.final_lsn < route.skip_before {
                continue;
            }
            if !transaction.begun.contains(&task) {
                transaction.begun.push(task);
                deliver(task, transaction.final_lsn, &transaction.begin);
            }
            for relation in relations {
                let routed = route.relations.contains(relation)
                    || ancestors
                        .get(relation)
                        .is_some_and(|up| up.iter().any(|a| route.relations.contains(a)));
                if !routed || route.described.contains(relation) {
                    continue;
                }
                if let Some(description) = self.descriptions.get(relation) {
                    deliver(task, lsn, description);
                    route.described.insert(*relation);
                }
            }
            deliver(task, lsn, message);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::pgoutput;

    fn begin(final_lsn: u64) -> Vec<u8> {
        let mut message = vec![b'B'];
        message.extend(final_lsn.to_be_bytes());
        message.extend(0i64.to_be_bytes());
        message.extend(7u32.to_be_bytes());
        message
    }

    fn commit(commit_lsn: u64, end_lsn: u64) -> Vec<u8> {
        let mut message = vec![b'C', 0];
        message.extend(commit_lsn.to_be_bytes());
        message.extend(end_lsn.to_be_bytes());
        message.extend(0i64.to_be_bytes());
        message
    }

    fn relation(oid: u32, name: &str) -> Vec<u8> {
        let mut message = vec![b'R'];
        message.extend(oid.to_be_bytes());
        message.extend(b"public\0");
        message.extend(name.as_bytes());
        message.extend([0, b'd']);
        message.extend(1u16.to_be_bytes());
        message.push(1);
        message.extend(b"id\0");
        message.extend(23u32.to_be_bytes());
        message.extend((-1i32).to_be_bytes());
        message
    }

    fn insert(oid: u32, id: &str) -> Vec<u8> {
        let mut message = vec![b'I'];
        message.extend(oid.to_be_bytes());
        message.push(b'N');
        message.extend(1u16.to_be_bytes());
        message.push(b't');
        message.extend((id.len() as u32).to_be_bytes());
        message.extend(id.as_bytes());
        message
    }

    fn truncate(oids: &[u32]) -> Vec<u8> {
        let mut message = vec![b'T'];
        message.extend((oids.len() as u32).to_be_bytes());
        message.push(0);
        for oid in oids {
            message.extend(oid.to_be_bytes());
        }
        message
    }

    /// A transactional logical message of ours announcing `generation` of `task`.
    fn state_change(task: TaskId, generation: i64) -> Vec<u8> {
        let content = state_change::content(task, generation);
        let mut message = vec![b'M', 1];
        message.extend(5000u64.to_be_bytes());
        message.extend(state_change::PREFIX.as_bytes());
        message.push(0);
        message.extend((content.len() as u32).to_be_bytes());
        message.extend(content.as_bytes());
        message
    }

    /// What each task received, as readable labels.
    #[derive(Default)]
    struct Received(HashMap<TaskId, Vec<String>>);

    impl Received {
        fn push(&mut self, task: TaskId, message: &Message<'_>) {
            let label = match message {
                Message::Begin { final_lsn, .. } => format!("B{final_lsn}"),
                Message::Commit { end_lsn, .. } => format!("C{end_lsn}"),
                Message::Relation(relation) => format!("R{}", relation.name),
                Message::Insert { relation, new } => match &new.values[0] {
                    pgoutput::TupleValue::Text(id) => {
                        format!("I{relation}:{id}")
                    }
                    other => format!("I{relation}:{other:?}"),
                },
                Message::Truncate { relations, .. } => format!("T{relations:?}"),
                Message::Emitted { content, .. } => {
                    format!("M{}", String::from_utf8_lossy(content))
                }
                other => format!("{other:?}"),
            };
            self.0.entry(task).or_default().push(label);
        }

        fn of(&self, task: TaskId) -> Vec<String> {
            self.0.get(&task).cloned().unwrap_or_default()
        }
    }

    fn feed(router: &mut Router, received: &mut Received, messages: &[Vec<u8>]) {
        for message in messages {
            let message = pgoutput::parse(message).expect("valid message");
            router.route(0, &message, &mut |task, _, message| {
                received.push(task, message)
            });
        }
    }

    /// One transaction writing `rows` into (relation, id) pairs, described first if `describe`.
    fn transaction(final_lsn: u64, rows: &[(u32, &str)], describe: &[(u32, &str)]) -> Vec<Vec<u8>> {
        let mut messages = vec![begin(final_lsn)];
        for &(oid, name) in describe {
            messages.push(relation(oid, name));
        }
        for &(oid, id) in rows {
            messages.push(insert(oid, id));
        }
        messages.push(commit(final_lsn, final_lsn + 10));
        messages
    }

    #[test]
    fn each_task_sees_only_its_tables_framed_as_its_own_stream() {
        let mut router = Router::default();
        router.attach(1, &[100], 0);
        router.attach(2, &[200], 0);
        let mut received = Received::default();
        feed(
            &mut router,
            &mut received,
            &transaction(
                1000,
                &[(100, "a"), (200, "b"), (300, "x")],
                &[(100, "items"), (200, "other"), (300, "nobody")],
            ),
        );
        // Nobody syncs 300; a transaction touching only it reaches no task at all.
        feed(
            &mut router,
            &mut received,
            &transaction(2000, &[(300, "y")], &[]),
        );
        feed(
            &mut router,
            &mut received,
            &transaction(3000, &[(100, "c")], &[]),
        );
        assert_eq!(
            received.of(1),
            ["B1000", "Ritems", "I100:a", "C1010", "B3000", "I100:c", "C3010"]
        );
        assert_eq!(received.of(2), ["B1000", "Rother", "I200:b", "C1010"]);
    }

    #[test]
    fn every_task_a_change_reaches_gets_the_message_parsed_once() {
        let mut router = Router::default();
        router.attach(1, &[100], 0);
        router.attach(2, &[100], 0);
        let mut received = Received::default();
        feed(
            &mut router,
            &mut received,
            &transaction(1000, &[], &[(100, "items")])[..2],
        );
        let data = insert(100, "a");
        let parsed = pgoutput::parse(&data).expect("valid message");
        let mut delivered = Vec::new();
        router.route(0, &parsed, &mut |task, _, message| {
            if matches!(message, Message::Insert { .. }) {
                delivered.push((task, std::ptr::eq(message, &parsed)));
            }
        });
        // The very message the pass parsed, not a copy parsed again per task.
        assert_eq!(delivered, [(1, true), (2, true)]);
    }

    #[test]
    fn a_state_change_reaches_its_task_alone_where_it_committed() {
        let mut router = Router::default();
        router.attach(1, &[100], 0);
        router.attach(2, &[100], 0);
        let mut received = Received::default();
        let mut paused = transaction(1000, &[(100, "a")], &[(100, "items")]);
        paused.insert(3, state_change(1, 4));
        feed(&mut router, &mut received, &paused);
        let announced = format!("M{}", state_change::content(1, 4));
        assert_eq!(
            received.of(1),
            ["B1000", "Ritems", "I100:a", announced.as_str(), "C1010"]
        );
        assert_eq!(received.of(2), ["B1000", "Ritems", "I100:a", "C1010"]);
        // Read again for a task that joins after that transaction: task 1 has it, and is not
        // told again.
        router.restart(1010);
        feed(&mut router, &mut received, &paused);
        assert_eq!(received.of(1).len(), 5);
    }

    #[test]
    fn a_task_attached_later_skips_what_it_has_and_is_described_first() {
        let mut router = Router::default();
        router.attach(1, &[100], 0);
        let mut received = Received::default();
        feed(
            &mut router,
            &mut received,
            &transaction(1000, &[(100, "a")], &[(100, "items")]),
        );
        feed(
            &mut router,
            &mut received,
            &transaction(2000, &[(100, "b")], &[]),
        );
        // Task 1 has read up to 2010; task 2 joins, syncing the same table from 1500 on, so the
        // stream is read again from the beginning.
        router.restart(2010);
        router.attach(2, &[100], 1500);
        feed(
            &mut router,
            &mut received,
            &transaction(1000, &[(100, "a")], &[(100, "items")]),
        );
        feed(
            &mut router,
            &mut received,
            &transaction(2000, &[(100, "b")], &[]),
        );
        feed(
            &mut router,
            &mut received,
            &transaction(3000, &[(100, "c")], &[]),
        );
        assert_eq!(
            received.of(1),
            [
                "B1000", "Ritems", "I100:a", "C1010", "B2000", "I100:b", "C2010", "B3000",
                "Ritems", "I100:c", "C3010"
            ]
        );
        assert_eq!(
            received.of(2),
            ["B2000", "Ritems", "I100:b", "C2010", "B3000", "I100:c", "C3010"]
        );
    }

    #[test]
    fn a_new_definition_reaches_every_task_before_its_next_change() {
        let mut router = Router::default();
        router.attach(1, &[100], 0);
        let mut received = Received::default();
        feed(
            &mut router,
            &mut received,
            &transaction(1000, &[(100, "a")], &[(100, "items")]),
        );
        feed(
            &mut router,
            &mut received,
            &transaction(2000, &[(100, "b")], &[(100, "items_v2")]),
        );
        feed(
            &mut router,
            &mut received,
            &transaction(3000, &[(100, "c")], &[]),
        );
        assert_eq!(
            received.of(1),
            [
                "B1000",
                "Ritems",
                "I100:a",
                "C1010",
                "B2000",
                "Ritems_v2",
                "I100:b",
                "C2010",
                "B3000",
                "I100:c",
                "C3010"
            ]
        );
    }

    #[test]
    fn a_truncate_reaches_every_task_of_the_tables_it_names() {
        let mut router = Router::default();
        router.attach(1, &[100], 0);
        router.attach(2, &[200], 0);
        router.attach(3, &[300], 0);
        let mut received = Received::default();
        let mut messages = vec![begin(1000), relation(100, "items"), relation(200, "other")];
        messages.push(truncate(&[100, 200]));
        messages.push(commit(1000, 1010));
        feed(&mut router, &mut received, &messages);
        assert_eq!(received.of(1), ["B1000", "Ritems", "T[100, 200]", "C1010"]);
        assert_eq!(received.of(2), ["B1000", "Rother", "T[100, 200]", "C1010"]);
        assert!(received.of(3).is_empty());
    }

    #[test]
    fn a_detached_task_receives_nothing_more() {
        let mut router = Router::default();
        router.attach(1, &[100], 0);
        router.attach(2, &[100], 0);
        router.detach(2);
        assert!(!router.is_attached(2));
        let mut received = Received::default();
        feed(
            &mut router,
            &mut received,
            &transaction(1000, &[(100, "a")], &[(100, "items")]),
        );
        assert_eq!(received.of(1).len(), 4);
        assert!(received.of(2).is_empty());
        assert_eq!(router.attached().collect::<Vec<_>>(), [1]);
    }

    #[test]
    fn a_partitions_changes_reach_the_tasks_of_its_partitioned_tables_and_its_own() {
        // 100 is partitioned; 101 is its partition, 102 a partition of 101 (two levels); 103 was
        // 100's partition until a DETACH, after which it is described again with no ancestor.
        let detached = std::rc::Rc::new(std::cell::Cell::new(false));
        let seen = detached.clone();
        let mut router = Router::new(Box::new(move |oid| match oid {
            101 => vec![100],
            102 => vec![101, 100],
            103 if !seen.get() => vec![100],
            _ => Vec::new(),
        }));
        router.attach(1, &[100], 0);
        router.attach(2, &[101], 0);
        let mut received = Received::default();
        feed(
            &mut router,
            &mut received,
            &transaction(
                1000,
                &[(101, "a"), (102, "b"), (103, "c")],
                &[(101, "p1"), (102, "p1a"), (103, "p2")],
            ),
        );
        let mut truncated = vec![begin(2000), truncate(&[101, 102])];
        truncated.push(commit(2000, 2010));
        feed(&mut router, &mut received, &truncated);
        detached.set(true);
        feed(
            &mut router,
            &mut received,
            &transaction(3000, &[(103, "d")], &[(103, "p2")]),
        );
        assert_eq!(
            received.of(1),
            [
                "B1000",
                "Rp1",
                "I101:a",
                "Rp1a",
                "I102:b",
                "Rp2",
                "I103:c",
                "C1010",
                "B2000",
                "T[101, 102]",
                "C2010"
            ]
        );
        assert_eq!(
            received.of(2),
            [
                "B1000",
                "Rp1",
                "I101:a",
                "Rp1a",
                "I102:b",
                "C1010",
                "B2000",
                "T[101, 102]",
                "C2010"
            ]
        );
        // A new decoding session looks every partition up again.
        router.restart(4000);
        assert!(router.ancestors.is_empty());
    }
}
