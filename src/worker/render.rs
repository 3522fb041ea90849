//! The streaming phase of a view task. Decoding collects, per window, the keys of the documents
//! that committed changes affect (`affected::AffectedKeys`, inside the decoding callback);
//! between reads, outside any callback, the window is rendered: mapping queries turn changed rows
//! of other tables into document keys, and `SELECT … FROM view WHERE key = ANY(…)` gives each
//! affected document once, however many of its rows changed. Keys the view no longer returns are
//! deleted. Each render runs in a short transaction of its own, after the window's transactions
//! became visible, with the rights of the view's owner (mapping queries: the task's owner).
//!
//! A render reads the present state, never an older one than the changes it follows, and renders
//! reach Meilisearch in order, so a later render never loses to an earlier one. The slot is
//! confirmed to a window's last commit only once its documents are confirmed.
//!
//! A window is rendered when due (caught up: Meilisearch idle, the flush interval, or `batch_size`
//! keys; behind: half the key limit, or the flush interval with Meilisearch idle), in one
//! transaction: `catalog::view::wait_for_transactions` (a commit record is decoded before the transaction
//! is visible), the mapping queries, then `catalog::view::canonical_keys`; a `Rendering` then renders a
//! batch's worth of keys per round while the dispatcher has room. The plan is made again at each
//! render, so the fields follow `CREATE OR REPLACE VIEW`. A view that now reads a table the stream
//! does not follow makes the stream ask for a new plan once (`follow_new_tables`: a new generation,
//! announced in the WAL). Decoding stops while `COLLECTED_BATCHES` batches' worth of keys wait; in
//! the shared pass a task that holds that many and cannot render leaves the pass, keeping what it
//! rendered (`hand_over_held`).

use std::borrow::BorrowMut;
use std::time::Instant;

use pgrx::prelude::*;

use pg_meili_sync_core::document::encode::{encode_id, encode_row, ColumnValue};
use pg_meili_sync_core::meili::request::Operation;
use pg_meili_sync_core::pipeline::batch::{BatchLimits, ChangeBatcher};
use pg_meili_sync_core::pipeline::dispatch::{DeadLetter, Dispatcher};
use pg_meili_sync_core::task::failure::Advice;
use pg_meili_sync_core::task::options::TaskOptions;
use pg_meili_sync_core::wal::affected::{AffectedKeys, Window};
use pg_meili_sync_core::wal::pgoutput;
use pg_meili_sync_core::wal::state_change;

use crate::catalog;
use crate::plan::{self, SnapshotPlan, ViewPlan};
use crate::security;
use crate::shmem::{self, live::LiveStatus};
use crate::worker::control::{in_transaction, in_user_transaction, should_stop, Stop};
use crate::worker::drive::{DueWork, ParsedSink, PassStream, Settlement, TaskStream};
use crate::worker::partitions::PartitionWatch;
use crate::worker::stream::note_commit;

/// What to do when the view's or a mapping's query fails at run time: a render failed, so the
/// documents are rendered again from the source.
fn render_advice() -> Advice {
    Advice::FixThenSnapshot(
        "fix the view or the mapping query (or drop the task and start a new one with other mappings)"
            .to_owned(),
    )
}

/// Keys rendered by one query (and handed to one mapping query) at most.
const RENDER_CHUNK: usize = 1000;

/// Distinct keys collected, in batches' worth, before decoding waits for a render (200,000 for
/// the default batch size): keys are small, and a window that collects while Meilisearch is busy
/// renders each hot document once.
const COLLECTED_BATCHES: usize = 20;

/// A collector of the keys that changes of the view's tables affect.
fn collector(view: &ViewPlan) -> AffectedKeys {
    let planned = view
        .tables
        .iter()
        .map(|(relid, routes)| (relid.to_u32(), routes.clone()))
        .collect();
    AffectedKeys::new(planned, view.mappings.len())
        .with_partition_ancestors(Box::new(catalog::source::partition_ancestors))
}

/// The view reads tables the task's plan does not follow (it was replaced to read them): asks for a
/// new plan, which stops the task's stream at this transaction's commit and starts it again
/// following them (`catalog::tasks::follow_new_tables`). Their changes until then were not
/// followed, so the task is out of shape until its documents are brought in line.
pub fn follow_new_tables(
    task: &catalog::tasks::TaskRecord,
    view: &str,
    missing: &[String],
    live: LiveStatus,
) -> Result<(), Stop> {
    let asked = in_transaction(live, "following the tables the view reads now", || {
        catalog::tasks::follow_new_tables(task.id, task.generation)
    })?;
    if asked {
        log!(
            "pg_meili_sync task {}: view {view} now reads {}, which the task follows from here on; its documents are brought in line as after any change of shape",
            task.id,
            missing.join(", ")
        );
    }
    Ok(())
}

/// One view task's stream: collects affected keys while decoding and renders them between reads.
/// Its dispatcher is borrowed in a task worker (which used it for the copy first) and owned in the
/// shared decoder.
pub struct ViewStream<D: BorrowMut<Dispatcher>> {
    task: catalog::tasks::TaskRecord,
    live: LiveStatus,
    dispatcher: D,
    view: ViewPlan,
    options: TaskOptions,
    keys: AffectedKeys,
    batcher: ChangeBatcher,
    limits: BatchLimits,
    settlement: Settlement,
    /// Read a state change of the task (`state_change`): nothing after it is collected, and
    /// the window it interrupted is never rendered (the slot keeps it).
    ended: bool,
    /// The partitions of the partitioned tables the view reads.
    partitioned: Option<PartitionWatch>,
    /// `shmem::commits::sources_changed` when the tables the view reads were last compared with the
    /// plan's.
    sources_seen: Option<u64>,
    /// A new plan was asked for (`follow_new_tables`): this stream ends at its commit.
    replanned: bool,
    /// A window's render under way, a part at a time between reads.
    rendering: Option<Rendering>,
}

/// A window's render, a part at a time as the dispatcher has room: Meilisearch indexes the first
/// documents while the next are rendered, memory holds a part, and the render never waits for
/// Meilisearch inside the shared pass.
struct Rendering {
    plan: SnapshotPlan,
    what: RenderingWhat,
    /// The commit the window ends at: confirmed once the last part's documents are.
    checkpoint: Option<u64>,
}

enum RenderingWhat {
    /// The documents of these keys (canonical, sorted); those before `next` are rendered.
    Keys { keys: Vec<Vec<String>>, next: usize },
    /// Every document (after a TRUNCATE), page by page; `after` is the last row's key.
    Everything { after: Option<Vec<String>> },
}

impl<D: BorrowMut<Dispatcher>> ViewStream<D> {
    pub fn new(
        task: &catalog::tasks::TaskRecord,
        live: LiveStatus,
        dispatcher: D,
        view: ViewPlan,
        limits: BatchLimits,
        options: &TaskOptions,
    ) -> Self {
        let keys = collector(&view);
        let mut dispatcher = dispatcher;
        // A view's documents are rendered, not decoded again: its deep queue holds them all.
        dispatcher.borrow_mut().set_held_depth(options.stream_depth);
        ViewStream {
            task: task.clone(),
            live,
            dispatcher,
            view,
            options: options.clone(),
            keys,
            batcher: ChangeBatcher::new(limits).with_shard(task.shard_filter()),
            limits,
            settlement: Settlement::default(),
            ended: false,
            partitioned: None,
            sources_seen: None,
            replanned: false,
            rendering: None,
        }
    }

    /// Once, and after each commit that may have replaced a view: compares the tables the view
    /// reads with those this stream follows, so that a new table is followed without waiting for
    /// a render.
    fn look_at_tables(&mut self) -> Result<(), Stop> {
        let changes = shmem::commits::sources_changed();
        if self.replanned || self.sources_seen == Some(changes) {
            return Ok(());
        }
        self.sources_seen = Some(changes);
        let (view, relid) = (&self.view, self.task.relid);
        let missing = in_transaction(self.live, "looking at the tables the view reads", || {
            view.unfollowed_tables(relid)
        })?;
        self.follow(&missing)
    }

    /// Asks once for a plan that follows `missing` (see `follow_new_tables`); renders go on
    /// meanwhile, reading the view as it is now.
    fn follow(&mut self, missing: &[String]) -> Result<(), Stop> {
        if missing.is_empty() || self.replanned {
            return Ok(());
        }
        self.replanned = true;
        follow_new_tables(&self.task, &self.view.view, missing, self.live)
    }

    /// Follows the partitions of the partitioned tables the view reads (see `PartitionWatch`).
    pub fn with_partitions(mut self, watch: Option<PartitionWatch>) -> Self {
        self.partitioned = watch;
        self
    }

    fn pump(&mut self) {
        self.settlement.pump(self.dispatcher.borrow_mut(), None);
    }

    /// Distinct keys collected at most (see `COLLECTED_BATCHES`).
    fn key_limit(&self) -> usize {
        self.limits.max_docs.saturating_mul(COLLECTED_BATCHES)
    }

    /// Whether the collected window should be rendered now. Caught up: at once when Meilisearch
    /// has nothing of ours to do, and while it is busy, when the window is due or full, so that
    /// hot documents are rendered once for many changes. Behind (more to read): once the window
    /// holds half of `key_limit`, or is due while Meilisearch has nothing of ours, so that a catch-up renders a document changed all the
    /// time (say through a lookup table that maps to thousands) a few times, not once a window.
    fn render_due(&self, caught_up: bool) -> bool {
        if !self.can_render() {
            return false;
        }
        let idle = self.dispatcher.borrow().is_idle();
        let due = self
            .keys
            .opened_at()
            .is_none_or(|opened| opened.elapsed() >= self.limits.max_age);
        if !caught_up {
            return self.keys.len() >= self.key_limit() / 2 || (idle && due);
        }
        idle || due || self.keys.len() >= self.limits.max_docs
    }

    /// A window was collected and may be rendered: nothing rendered waits for room.
    fn can_render(&self) -> bool {
        !self.keys.is_empty() && !self.keys.in_transaction() && self.has_room_to_render()
    }

    /// Nothing rendered waits for room, and no render is under way.
    fn has_room_to_render(&self) -> bool {
        self.rendering.is_none() && self.has_room_for_a_part()
    }

    fn has_room_for_a_part(&self) -> bool {
        !self.batcher.has_closed() && self.dispatcher.borrow().has_room()
    }

    /// Starts rendering the collected window (see `Rendering`): its first part now, the others
    /// in the next rounds; the window closes with its checkpoint after the last.
    fn render(&mut self) -> Result<(), Stop> {
        let window = self.keys.take();
        let started = if window.everything {
            self.start_full_render(&window)?
        } else if !window.is_empty() {
            self.start_key_render(&window)?
        } else {
            None
        };
        match started {
            Some(rendering) => {
                self.rendering = Some(rendering);
                self.render_next_part()
            }
            None => {
                self.close_window(window.checkpoint);
                Ok(())
            }
        }
    }

    fn close_window(&mut self, checkpoint: Option<u64>) {
        if let Some(checkpoint) = checkpoint {
            self.batcher.mark_checkpoint(checkpoint);
        }
        self.batcher.close();
    }

    /// The documents of the window's keys, read from the view once its transactions are visible:
    /// the mapping queries turn the window into the keys of its documents, which are rendered a
    /// part at a time (`render_next_part`).
    fn start_key_render(&mut self, window: &Window) -> Result<Option<Rendering>, Stop> {
        let view = &self.view;
        let task = &self.task;
        let options = &self.options;
        let planned = in_user_transaction(
            self.live,
            "rendering documents from the view",
            render_advice(),
            || {
                if !catalog::view::wait_for_transactions(&window.xids, should_stop) {
                    return Ok(None);
                }
                let mut keys = window.documents.clone();
                for (mapping, input) in view.mappings.iter().zip(&window.mapped) {
                    for chunk in input.chunks(RENDER_CHUNK) {
                        keys.extend(security::as_table_owner(view.mapping_role, || {
                            catalog::view::run_mapping(
                                &mapping.table,
                                &mapping.query,
                                mapping.params,
                                chunk,
                                view.key.len(),
                            )
                        })?);
                    }
                }
                // Planned again for each render, so that the view's columns follow CREATE OR
                // REPLACE VIEW; a view that lost its key column stops the task.
                let plan = plan::source_plan(task.relid, &task.primary_key, options)?;
                let unfollowed = view.unfollowed_tables(task.relid)?;
                catalog::reader_dependence::refuse_rows_by_who_asks(
                    task.relid,
                    &view.view,
                    options.reader_independent.then_some(task.owner),
                )?;
                let keys = security::as_table_owner(plan.table_owner, || {
                    catalog::view::canonical_keys(&view.key, &keys)
                })?;
                Ok(Some((plan, keys, unfollowed)))
            },
        )?;
        let Some((plan, keys, unfollowed)) = planned else {
            return Err(Stop::Terminated);
        };
        self.follow(&unfollowed)?;
        Ok(Some(Rendering {
            plan,
            what: RenderingWhat::Keys { keys, next: 0 },
            checkpoint: window.checkpoint,
        }))
    }

    /// After a TRUNCATE of a table the view reads: deletes every document, then renders the whole
    /// view page by page, each page in a transaction of its own.
    fn start_full_render(&mut self, window: &Window) -> Result<Option<Rendering>, Stop> {
        let task = &self.task;
        let options = &self.options;
        let plan = in_transaction(self.live, "planning the view", || {
            if !catalog::view::wait_for_transactions(&window.xids, should_stop) {
                return Ok(None);
            }
            plan::source_plan(task.relid, &task.primary_key, options).map(Some)
        })?
        .ok_or(Stop::Terminated)?;
        log!(
            "pg_meili_sync task {}: a table of view {} was truncated; rendering every document again",
            task.id,
            self.view.view
        );
        self.batcher
            .push(Operation::DeleteAll, &[], &[], &Instant::now);
        Ok(Some(Rendering {
            plan,
            what: RenderingWhat::Everything { after: None },
            checkpoint: window.checkpoint,
        }))
    }

    /// The next part of the render under way (a batch's worth of keys, or a page), in a
    /// transaction of its own as the view's owner; after the last, the window closes with its
    /// checkpoint.
    fn render_next_part(&mut self) -> Result<(), Stop> {
        let Some(rendering) = self.rendering.take() else {
            return Ok(());
        };
        let Rendering {
            plan,
            what,
            checkpoint,
        } = rendering;
        let what = match what {
            RenderingWhat::Keys { keys, next } => {
                let part = self.limits.max_docs.max(RENDER_CHUNK);
                let end = keys.len().min(next + part);
                self.render_key_part(&plan, &keys[next..end])?;
                (end < keys.len()).then_some(RenderingWhat::Keys { keys, next: end })
            }
            RenderingWhat::Everything { after } => self
                .render_page(&plan, after)?
                .map(|after| RenderingWhat::Everything { after: Some(after) }),
        };
        match what {
            Some(what) => {
                self.rendering = Some(Rendering {
                    plan,
                    what,
                    checkpoint,
                });
            }
            None => self.close_window(checkpoint),
        }
        Ok(())
    }

    /// Renders the documents of `keys`; the keys the view no longer returns are deleted.
    fn render_key_part(&mut self, plan: &SnapshotPlan, keys: &[Vec<String>]) -> Result<(), Stop> {
        let view = &self.view;
        // The view's columns, not the documents' fields (a `geo` column's is `_geo`).
        let columns = &plan.source_columns;
        let rows = in_user_transaction(
            self.live,
            "rendering documents from the view",
            render_advice(),
            || {
                security::as_table_owner(plan.table_owner, || {
                    let mut rows = Vec::new();
                    for chunk in keys.chunks(RENDER_CHUNK) {
                        rows.extend(catalog::view::render_rows(
                            &view.view, columns, &view.key, chunk,
                        )?);
                    }
                    Ok(rows)
                })
            },
        )?;
        let found: std::collections::HashSet<Vec<String>> =
            rows.iter().map(|row| plan.shape.key_of_row(row)).collect();
        self.push_rows(plan, &rows);
        let mut id = Vec::new();
        for key in keys.iter().filter(|key| !found.contains(*key)) {
            let values: Vec<&str> = key.iter().map(String::as_str).collect();
            match encode_id(&plan.shape, &values) {
                Ok(document_id) => {
                    id.clear();
                    document_id.write_json(&mut id);
                    self.batcher
                        .push(Operation::Delete, &id, &id, &Instant::now);
                }
                // No document can have had this id.
                Err(_) => continue,
            }
        }
        Ok(())
    }

    /// The page of the whole view after `after`; the key of its last row, or None past the end.
    fn render_page(
        &mut self,
        plan: &SnapshotPlan,
        after: Option<Vec<String>>,
    ) -> Result<Option<Vec<String>>, Stop> {
        let (query, key) = match &after {
            Some(key) => (&plan.next_page_query, Some(key.as_slice())),
            None => (&plan.first_page_query, None),
        };
        let width = plan.shape.columns().len();
        let rows = in_user_transaction(
            self.live,
            "rendering the whole view",
            render_advice(),
            || {
                security::as_table_owner(plan.table_owner, || {
                    catalog::source::read_page(query, key, plan.page_rows, width)
                })
            },
        )?;
        let Some(last) = rows.last() else {
            return Ok(None);
        };
        let after = plan.shape.key_of_row(last);
        self.push_rows(plan, &rows);
        Ok(Some(after))
    }

    /// Renders the next part of the render under way when nothing rendered waits for room.
    fn go_on_rendering(&mut self) -> Result<(), Stop> {
        if self.rendering.is_some() && self.has_room_for_a_part() {
            self.render_next_part()?;
        }
        Ok(())
    }

    /// Rendered rows into the batcher as whole documents; rows that cannot be documents become
    /// dead letters.
    fn push_rows(&mut self, plan: &SnapshotPlan, rows: &[Vec<Option<String>>]) {
        let mut document = Vec::with_capacity(1024);
        let mut id = Vec::with_capacity(64);
        for row in rows {
            let values = ColumnValue::row(row);
            document.clear();
            match encode_row(&plan.shape, &values, &mut document) {
                Ok(doc_id) => {
                    id.clear();
                    doc_id.write_json(&mut id);
                    self.batcher
                        .push(Operation::Replace, &id, &document, &Instant::now);
                }
                Err(error) => {
                    let dispatcher = self.dispatcher.borrow_mut();
                    let letter = DeadLetter::unsent_row(
                        document.clone(),
                        error.code(),
                        error.to_string(),
                        dispatcher.primary_key(),
                    );
                    dispatcher.add_dead_letter(letter);
                }
            }
        }
    }

    /// Hands closed batches to the dispatcher while it has room; a commit that rendered nothing
    /// counts once everything before it is confirmed.
    fn send_ready(&mut self) {
        self.pump();
        self.settlement
            .hand_over(self.dispatcher.borrow_mut(), &mut self.batcher);
    }
}

impl<D: BorrowMut<Dispatcher>> TaskStream for ViewStream<D> {
    fn live(&self) -> LiveStatus {
        self.live
    }

    fn settle(&mut self) -> Result<Option<u64>, Stop> {
        self.pump();
        let settled =
            self.settlement
                .settle(self.task.id, self.live, self.dispatcher.borrow_mut())?;
        match self.partitioned.as_mut() {
            Some(partitioned) => partitioned.when_due(self.live, settled),
            None => Ok(settled),
        }
    }

    fn confirm_idle(&mut self, read_position: u64) -> Option<u64> {
        let idle = self.is_idle();
        if let Some(partitioned) = self.partitioned.as_mut() {
            // Not past a change of partitions before the view's documents are in line.
            if partitioned.due().holds(idle, read_position) {
                return None;
            }
        }
        self.settlement.confirm_idle(idle, read_position)
    }

    fn is_idle(&self) -> bool {
        self.keys.is_empty()
            && self.rendering.is_none()
            && self.batcher.is_empty()
            && !self.batcher.has_closed()
            && self.dispatcher.borrow().is_idle()
    }

    /// Renders the collected window when due, and hands what is ready to the dispatcher.
    fn before_read(&mut self, nothing_coming: bool) -> Result<(), Stop> {
        self.go_on_rendering()?;
        if self.render_due(nothing_coming) {
            self.render()?;
        }
        self.send_ready();
        Ok(())
    }

    /// Decoding may go on: nothing rendered waits for room, and the window is not too large.
    fn may_read(&self) -> bool {
        self.rendering.is_none() && !self.batcher.has_closed() && self.keys.len() < self.key_limit()
    }

    fn has_ended(&self) -> bool {
        self.ended
    }

    /// A message the collector could not take fails the task.
    fn after_read(&mut self, _nothing_coming: bool) -> Result<(), Stop> {
        if let Some(failure) = self.settlement.take_failure() {
            return Err(Stop::Failed(failure));
        }
        self.look_at_tables()?;
        match self.partitioned.as_mut() {
            Some(partitioned) => partitioned.look(self.live),
            None => Ok(()),
        }
    }

    fn publish(&mut self, read_position: u64, confirmed: u64) {
        self.settlement.publish(
            self.live,
            self.task.rows_copied,
            self.dispatcher.borrow(),
            (read_position, confirmed),
        );
    }

    fn waits_on_meilisearch(&self) -> bool {
        !self.is_idle()
    }
}

impl PassStream for ViewStream<Dispatcher> {
    fn dispatcher(&mut self) -> &mut Dispatcher {
        &mut self.dispatcher
    }

    fn is_quiet(&self) -> bool {
        self.keys.is_empty()
            && !self.keys.in_transaction()
            && self.rendering.is_none()
            && self.batcher.is_empty()
            && !self.batcher.has_closed()
            && self.dispatcher.is_quiet()
            && self.settlement.is_empty()
            && !self
                .partitioned
                .as_ref()
                .is_some_and(PartitionWatch::pending)
    }

    /// Decoding does not wait for a view's renders in the shared pass: a task that collected as
    /// many keys as a task of its own would stop reading at, and cannot render them now, has
    /// fallen behind.
    fn is_stalled(&self) -> bool {
        self.keys.len() >= self.key_limit() && !self.can_render()
    }

    fn why_it_left(&self) -> String {
        format!(
            "it collected changes to {} documents while Meilisearch was still busy with those it rendered before",
            self.keys.len()
        )
    }

    /// Forgets the keys collected since the last render; what was rendered is kept and sent,
    /// with the commit its window ends at, so that the task reads on from there (a render
    /// under way goes on to its end).
    fn restart(&mut self) {
        self.keys = collector(&self.view);
        if let Some(partitioned) = self.partitioned.as_mut() {
            partitioned.due().forget_read();
        }
    }

    fn hand_over_held(&mut self) -> Result<(), Stop> {
        self.go_on_rendering()?;
        self.send_ready();
        Ok(())
    }

    fn unsent_bytes(&self) -> usize {
        self.batcher.held_bytes()
    }
}

impl<D: BorrowMut<Dispatcher>> ParsedSink for ViewStream<D> {
    fn message(&mut self, _lsn: u64, message: &pgoutput::Message<'_>) {
        if self.settlement.has_failed() || self.ended {
            return;
        }
        note_commit(message, self.settlement.ages());
        if state_change::ends_stream(message, self.task.id, i64::from(self.task.generation)) {
            self.ended = true;
            return;
        }
        if let Err(error) = self.keys.apply(message, &Instant::now) {
            self.settlement.fail(error);
        }
    }
}
