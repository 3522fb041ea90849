//! A task moving into the shared decoding pass: one created before shared decoding was the
//! default, or altered from `"decoding": "own"`. Its worker streams from the task's own slot
//! until it has read past the position the shared decoder gave it, drains, and then, in one
//! transaction, stores where its stream ended and drops its own slot and publication. The shared
//! decoder then streams the task from there: nothing is skipped, because the shared slot is held
//! at or before the given position, and nothing before the hand-over is sent twice.

use pgrx::prelude::*;

use crate::catalog::{self, tasks::TaskRecord};
use crate::shmem::{self, live::LiveStatus};
use crate::worker::control::{in_transaction, Stop};
use crate::worker::drive::{Reading, SwapGate};

/// Ends the moving task's own stream once it has read past its position in the shared pass; holds
/// the moving task's id.
pub struct MoveGate(pub i64);

impl SwapGate for MoveGate {
    fn ready_to_drain(&mut self, reading: &Reading) -> Result<bool, Stop> {
        let task_id = self.0;
        let position = in_transaction(reading.live, "reading the task's shared position", || {
            catalog::shared::stream_position(task_id)
        })?;
        Ok(position.is_some_and(|position| position <= reading.position))
    }
}

/// The moving task's own stream ended at `position` with everything before it confirmed: the
/// shared decoder takes over from there. The worker exits either way; if the task changed
/// meanwhile, the launcher starts it again as it now is.
pub fn hand_over(task: &TaskRecord, live: LiveStatus, position: u64) -> Result<(), Stop> {
    // A moving task's slot and publication are its own (see `catalog::tasks::load_task`).
    let own_object = &task.slot_name;
    let moved = in_transaction(live, "handing over to the shared decoding pass", || {
        catalog::shared::hand_over(task.id, task.generation, position, own_object)
    })?;
    if moved {
        log!(
            "pg_meili_sync task {}: moved into the shared decoding pass at {}; its replication slot \"{own_object}\" is dropped",
            task.id,
            catalog::format_lsn(position)
        );
        shmem::launchers::wake_launcher();
    }
    Err(Stop::Terminated)
}
