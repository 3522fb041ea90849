//! The streaming phase of a task worker: decodes the slot in process, maps each committed change
//! to a Meilisearch operation, and confirms the slot only up to the newest commit whose batches
//! Meilisearch has all confirmed.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use pgrx::bgworkers::BackgroundWorker;
use pgrx::prelude::*;

use crate::batch::{Batch, BatchLimits, Watermark};
use crate::catalog;
use crate::changes::{ChangeMapper, RelationShape};
use crate::decode::pgoutput::{self, Relation};
use crate::decode::session::{DecodingSession, MessageSink};
use crate::encode::{Column, DocumentShape};
use crate::meili::writer::{Writer, WriterEvent};
use crate::options::{TaskOptions, WriteMode};
use crate::shmem::{Phase, SlotHandle};
use crate::worker::task::should_stop;

/// WAL records decoded between two looks at confirmations and signals.
const RECORDS_PER_ROUND: usize = 2000;

/// Which columns of the table become document fields, and which form the key.
pub struct ColumnRules {
    pub relation_name: String,
    pub key: Vec<String>,
    pub columns: Option<Vec<String>>,
    pub exclude_columns: Vec<String>,
}

impl ColumnRules {
    pub fn new(relation_name: &str, key: &[String], options: &TaskOptions) -> Self {
        ColumnRules {
            relation_name: relation_name.to_owned(),
            key: key.to_vec(),
            columns: options.columns.clone(),
            exclude_columns: options.exclude_columns.clone(),
        }
    }

    pub fn includes(&self, name: &str) -> bool {
        self.key.iter().any(|key| key == name)
            || (self
                .columns
                .as_ref()
                .is_none_or(|names| names.iter().any(|n| n == name))
                && !self.exclude_columns.iter().any(|n| n == name))
    }

    /// The document shape of a Relation message; a missing key column stops the task.
    fn relation_shape(&self, relation: &Relation) -> Result<RelationShape, String> {
        let mut columns = Vec::new();
        let mut source_columns = Vec::new();
        for (position, column) in relation.columns.iter().enumerate() {
            if self.includes(&column.name) {
                let kind = catalog::value_kind(pg_sys::Oid::from(column.type_oid))
                    .map_err(|error| error.message)?;
                columns.push(Column {
                    name: column.name.clone(),
                    kind,
                });
                source_columns.push(position);
            }
        }
        let mut key_columns = Vec::new();
        for name in &self.key {
            let position = columns.iter().position(|column| &column.name == name).ok_or_else(|| {
                format!(
                    "key column \"{name}\" of table {} was dropped or renamed; the task stopped so as not to corrupt the index (drop it and start a new one)",
                    self.relation_name
                )
            })?;
            key_columns.push(position);
        }
        let shape = DocumentShape::new(columns, key_columns).map_err(|error| error.to_string())?;
        Ok(RelationShape {
            shape,
            source_columns,
        })
    }
}

pub struct Streamer<'w> {
    task_id: i64,
    slot: SlotHandle,
    writer: &'w Writer,
    rules: ColumnRules,
    mapper: ChangeMapper,
    watermark: Watermark,
    pending: VecDeque<Batch>,
    confirmable: Option<u64>,
    failure: Option<String>,
}

impl<'w> Streamer<'w> {
    pub fn new(
        task_id: i64,
        slot: SlotHandle,
        writer: &'w Writer,
        rules: ColumnRules,
        limits: BatchLimits,
        options: &TaskOptions,
    ) -> Self {
        Streamer {
            task_id,
            slot,
            writer,
            rules,
            mapper: ChangeMapper::new(limits, options.write_mode == WriteMode::Upsert),
            watermark: Watermark::new(),
            pending: VecDeque::new(),
            confirmable: None,
            failure: None,
        }
    }

    fn handle(&mut self, event: WriterEvent) {
        match event {
            WriterEvent::Confirmed { seq, .. } => {
                if let Some(lsn) = self.watermark.confirmed(seq) {
                    self.confirmable = Some(self.confirmable.map_or(lsn, |old| old.max(lsn)));
                }
                self.slot.set_phase(Phase::Streaming);
            }
            WriterEvent::Failed { error, .. } => {
                self.failure.get_or_insert_with(|| error.to_string());
            }
            WriterEvent::Retrying { error, .. } => {
                self.slot.add_retry();
                self.slot.set_error(&error);
                self.slot.set_phase(Phase::Retrying);
            }
            WriterEvent::Enqueued { .. } => {}
        }
    }

    fn poll_events(&mut self) {
        while let Ok(event) = self.writer.events().try_recv() {
            self.handle(event);
        }
    }

    /// Moves closed batches to the writer, in order. With `block`, waits (handling confirmations)
    /// until all are accepted: that wait is the back pressure that stops reading the slot.
    fn send_ready(&mut self, block: bool) {
        loop {
            self.poll_events();
            if let Some(checkpoint) = self.mapper.take_pending_checkpoint() {
                if let Some(lsn) = self.watermark.standalone(checkpoint) {
                    self.confirmable = Some(self.confirmable.map_or(lsn, |old| old.max(lsn)));
                }
            }
            if self.pending.is_empty() {
                match self.mapper.next_ready() {
                    Some(batch) => {
                        self.watermark.sent(batch.seq, batch.checkpoint);
                        self.pending.push_back(batch);
                    }
                    None => return,
                }
            }
            let Some(batch) = self.pending.pop_front() else {
                return;
            };
            if let Err(refused) = self.writer.try_send(batch) {
                self.pending.push_front(refused);
                if !block || self.failure.is_some() {
                    return;
                }
                if should_stop() {
                    // Inside a replay: an ERROR is the only way out; the slot has not moved past
                    // anything unconfirmed, so the restarted worker decodes it again.
                    error!(
                        "pg_meili_sync task {}: stopping during a transaction replay",
                        self.task_id
                    );
                }
                if let Ok(event) = self.writer.events().recv_timeout(Duration::from_millis(20)) {
                    self.handle(event);
                }
            }
        }
    }

    fn report_skipped(&mut self) {
        for skipped in self.mapper.take_skipped() {
            let message = format!("change skipped: {}", skipped.reason);
            warning!("pg_meili_sync task {}: {message}", self.task_id);
            self.slot.set_error(&message);
        }
    }

    fn is_idle(&self) -> bool {
        self.pending.is_empty() && self.mapper.is_idle() && self.watermark.inflight() == 0
    }
}

impl MessageSink for Streamer<'_> {
    fn message(&mut self, _lsn: u64, data: &[u8]) {
        if self.failure.is_some() {
            return;
        }
        let message = match pgoutput::parse(data) {
            Ok(message) => message,
            Err(error) => {
                self.failure = Some(format!("cannot parse a pgoutput message: {error}"));
                return;
            }
        };
        let rules = &self.rules;
        if let Err(error) = self.mapper.apply(message, Instant::now(), &mut |relation| {
            rules.relation_shape(relation)
        }) {
            self.failure = Some(error);
            return;
        }
        self.report_skipped();
        self.send_ready(true);
    }
}

/// Streams until SIGTERM or a permanent failure (returned as Err).
pub fn run(streamer: &mut Streamer<'_>, task: &catalog::TaskRecord) -> Result<(), String> {
    let mut session = DecodingSession::open(&task.slot_name, &task.publication_name)?;
    streamer.slot.set_phase(Phase::Streaming);
    loop {
        if should_stop() {
            break;
        }
        streamer.poll_events();
        if let Some(failure) = streamer.failure.take() {
            session.close();
            return Err(failure);
        }
        if let Some(lsn) = streamer.confirmable.take() {
            session.confirm(lsn);
        }
        let records = session.read(streamer, RECORDS_PER_ROUND)?;
        if records == 0 {
            // Caught up: nothing else is coming to fill the open batch, so send it now.
            streamer.mapper.flush();
            streamer.send_ready(false);
            if streamer.is_idle() {
                // Nothing unconfirmed: let the slot release WAL that other tables wrote.
                session.confirm(session.read_position());
            }
            let inflight = streamer.watermark.inflight() > 0 || !streamer.pending.is_empty();
            let nap = if inflight {
                Duration::from_millis(5)
            } else {
                Duration::from_secs(1)
            };
            if !BackgroundWorker::wait_latch(Some(nap)) {
                break;
            }
        } else {
            streamer.mapper.flush_due(Instant::now());
            streamer.send_ready(false);
        }
        streamer.slot.set_progress(
            task.rows_copied,
            streamer.watermark.inflight(),
            streamer.writer.stats(),
        );
    }
    session.close();
    Ok(())
}
