//! Columns added to a table task's table (`ALTER TABLE … ADD COLUMN`, whatever the default) change
//! no row in the WAL, yet every document should get them. When that is the only change of the
//! table's shape since its documents were copied (`catalog::tasks::columns_added`), the task's
//! stream sends each row's values of them as partial updates, once Meilisearch has everything the
//! stream read before the change, instead of the launcher rebuilding the index by a resync.

use pgrx::prelude::*;

use pg_meili_sync_core::pipeline::due::Due;
use pg_meili_sync_core::task::failure::Advice;

use crate::catalog::{
    self,
    tasks::{ColumnsAdded, TaskRecord},
};
use crate::error::ErrorKind;
use crate::shmem::{self, live::LiveStatus};
use crate::worker::control::{
    in_transaction, in_user_transaction, in_user_transaction_retrying, Stop,
};
use crate::worker::drive::DueWork;

pub struct ColumnsAddedWatch {
    task: TaskRecord,
    /// `shmem::commits::sources_changed` at the last look: None before the first, at the stream's
    /// start, so that columns added while no worker ran are sent too.
    seen: Option<u64>,
    /// Columns found added, sent once everything up to `due` is confirmed.
    added: Option<ColumnsAdded>,
    due: Due,
}

impl ColumnsAddedWatch {
    pub fn new(task: &TaskRecord) -> ColumnsAddedWatch {
        ColumnsAddedWatch {
            task: task.clone(),
            seen: None,
            added: None,
            due: Due::default(),
        }
    }

    /// At the stream's start, and after each commit that may have altered a table: whether
    /// columns were added, and only that. They are sent once everything the stream reads up to
    /// the WAL's end now (past the DDL's commit) is in the index.
    pub fn look(&mut self, live: LiveStatus) -> Result<(), Stop> {
        let changes = shmem::commits::sources_changed();
        if self.seen == Some(changes) {
            return Ok(());
        }
        self.seen = Some(changes);
        let task_id = self.task.id;
        let found = in_transaction(live, "looking for columns added", || {
            match catalog::tasks::columns_added(task_id)? {
                Some(added) => Ok(Some((added, catalog::source::wal_insert_position()?))),
                None => Ok(None),
            }
        })?;
        let Some((added, now)) = found else {
            return Ok(());
        };
        log!(
            "pg_meili_sync task {task_id}: columns were added to {}: {}; their values go to every document as partial updates once everything before is in the index",
            self.task.relation,
            added.columns.join(", ")
        );
        self.added = Some(added);
        self.due.set(now);
        Ok(())
    }

    /// Columns added wait to be sent, or a look: the stream is not quiet.
    pub fn pending(&self) -> bool {
        self.due.is_set() || self.seen != Some(shmem::commits::sources_changed())
    }
}

impl DueWork for ColumnsAddedWatch {
    fn due(&mut self) -> &mut Due {
        &mut self.due
    }

    /// Sends the columns added, and records the shape they give the documents.
    fn work(&mut self, live: LiveStatus) -> Result<(), Stop> {
        let Some(added) = self.added.take() else {
            return Ok(());
        };
        let task = &self.task;
        // Writers whose commits the stream read must be visible to the pages read next.
        in_user_transaction(
            live,
            "waiting for the writers of the table",
            Advice::FixThenResume,
            || crate::verify::wait_for_writers(task),
        )?;
        let sent = in_user_transaction_retrying(
            live,
            "sending the columns added",
            Advice::FixThenResume,
            |error| error.kind == ErrorKind::Meilisearch,
            || crate::verify::send_added_columns(task.clone(), &added.columns),
        )?;
        in_transaction(live, "recording the columns added", || {
            catalog::tasks::record_columns_added(task.id, &added)
        })?;
        log!(
            "pg_meili_sync task {}: sent the columns added ({}) to {sent} documents",
            task.id,
            added.columns.join(", ")
        );
        Ok(())
    }
}
