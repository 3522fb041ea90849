//! The resync helper: a hidden task that copies the table into a fresh index (`<index>__resync`)
//! and streams into it through a slot of its own while the task it rebuilds keeps serving and
//! streaming. Once caught up it swaps the two indexes:
//!
//! 1. It holds the task (state `swapping`: the launcher stops its worker) and streams on until it
//!    has applied at least everything the task's slot confirmed.
//! 2. It stops reading at a position P, drains, and waits until Meilisearch has no unfinished task
//!    on the live index, so every write the task made lands before the swap.
//! 3. `POST /swap-indexes`; then the task's slot is advanced to P (what the new index already
//!    holds) and the task streams on from there; the old index, now under the helper's uid, is
//!    deleted, and so is the helper.
//!
//! Nothing is lost: the new index holds every change up to P, and the task sends every change
//! after P. A crash between the steps is resumed from `resync_phase`: the index's `createdAt`
//! moves with its content, so it tells whether the swap happened.

use std::time::Duration;

use pgrx::prelude::*;
use serde_json::Value;

use pg_meili_sync_core::meili::client::{Client, TASK_WAIT};
use pg_meili_sync_core::task::failure::{Failure, FailureKind};

use crate::catalog::{
    self,
    tasks::{ResyncPhase, TaskRecord, TaskState},
};
use crate::shmem::{
    self,
    live::{LiveStatus, Phase},
};
use crate::worker::control::{
    await_index_deletion, await_meili_task, in_transaction, meili_task_succeeded, should_stop,
    with_retry, worker_transaction, Stop,
};
use crate::worker::drive::{Reading, SwapGate};

/// How many times the resync index is made again when an earlier request made it meanwhile.
const CREATE_ATTEMPTS: u32 = 3;

/// Before the copy: a new, empty index with the live index's key and settings. A leftover of an
/// earlier resync is deleted first.
pub fn prepare_fresh_index(
    task_id: i64,
    live: LiveStatus,
    client: &Client,
    live_uid: &str,
    fresh_uid: &str,
    key_attribute: &str,
) -> Result<(), Stop> {
    // A create Meilisearch took although its answer was lost (a dropped connection, a restart,
    // a helper that died) makes the next one fail with `index_already_exists`: that index is
    // deleted and made again, a few times at most.
    for attempt in 1..=CREATE_ATTEMPTS {
        if with_retry(live, "reading the resync index", || {
            client.get_index(fresh_uid)
        })?
        .is_some()
        {
            let uid = with_retry(live, "deleting an old resync index", || {
                client.delete_index(fresh_uid)
            })?;
            await_index_deletion(live, client, uid, "deleting an old resync index")?;
        }
        let uid = with_retry(live, "creating the resync index", || {
            client.create_index(fresh_uid, key_attribute)
        })?;
        let made = with_retry(live, "creating the resync index", || {
            client.wait_task(uid, TASK_WAIT)
        })?;
        let made_meanwhile = made
            .error
            .as_ref()
            .is_some_and(|error| error.code == "index_already_exists");
        if made_meanwhile && attempt < CREATE_ATTEMPTS {
            log!("pg_meili_sync task {task_id}: the resync index was made meanwhile by an earlier request; it is made again");
            continue;
        }
        meili_task_succeeded(&made, "creating the resync index")?;
        break;
    }
    let settings = with_retry(live, "reading the live index's settings", || {
        client.get_settings(live_uid)
    })?;
    // Unset settings read back as null; sending them back would be refused by some versions.
    let settings: serde_json::Map<String, Value> = settings
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, value)| !value.is_null())
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect();
    if settings.is_empty()
        || try_settings(live, client, fresh_uid, Value::Object(settings.clone()))?
    {
        return Ok(());
    }
    // Some setting read back cannot be written as it is (say, one of an experimental feature
    // that is off): copy them one by one and name those refused.
    let mut refused = Vec::new();
    for (name, value) in settings {
        let single = Value::Object([(name.clone(), value)].into_iter().collect());
        if !try_settings(live, client, fresh_uid, single)? {
            refused.push(name);
        }
    }
    warning!(
        "pg_meili_sync task {task_id}: Meilisearch refused to copy these settings of index \"{live_uid}\" to the new index \"{fresh_uid}\": {}; set them on the new index before the swap, or in the task's settings option",
        refused.join(", ")
    );
    Ok(())
}

/// Applies settings to an index; false when Meilisearch refuses them (a 4xx, or a failed task).
fn try_settings(
    live: LiveStatus,
    client: &Client,
    uid: &str,
    settings: Value,
) -> Result<bool, Stop> {
    let what = "copying the live index's settings";
    let enqueued = with_retry(live, what, || {
        match client.update_settings(uid, &settings) {
            Ok(task_uid) => Ok(Some(task_uid)),
            Err(error) if error.is_retryable() || error.is_auth() => Err(error),
            Err(_) => Ok(None),
        }
    })?;
    let Some(task_uid) = enqueued else {
        return Ok(false);
    };
    let state = with_retry(live, what, || client.wait_task(task_uid, TASK_WAIT))?;
    Ok(state.failure().is_none())
}

/// Holds the rebuilt task once the helper has caught up with the WAL, and opens the gate when the
/// helper has applied everything the held task's slot confirmed and no worker holds that slot.
/// Its field is the held task's id.
pub struct ResyncGate(pub i64);

impl SwapGate for ResyncGate {
    fn ready_to_drain(&mut self, reading: &Reading) -> Result<bool, Stop> {
        let live = reading.live;
        let held_task = self.0;
        let held = in_transaction(live, "reading the task to swap", || {
            catalog::tasks::held_task(held_task)
        })?
        .ok_or_else(|| {
            Failure::new(
                FailureKind::Source,
                format!("task {held_task}, which this resync rebuilds, no longer exists"),
            )
            .hint("drop this resync helper with meili_sync_drop")
        })?;
        // Held only once the helper has caught up, so that the task pauses for a moment, not
        // for the helper's catch-up after its copy: when it has read all the WAL there is, or at
        // least all the task has confirmed. Under a steady write load and a slow sink (a real
        // Meilisearch confirms a batch in about a second) the first never happens: there is
        // always WAL the back-pressured reader has not read yet.
        let abreast = held
            .confirmed
            .is_some_and(|confirmed| confirmed <= reading.position);
        match held.state {
            TaskState::Streaming if reading.caught_up || abreast => {
                in_transaction(live, "holding the task for the swap", || {
                    catalog::tasks::hold_for_swap(held_task)
                })?;
                shmem::launchers::wake_launcher();
                log!(
                    "pg_meili_sync task {}: resync caught up; the task is held for the swap",
                    held_task
                );
                Ok(false)
            }
            TaskState::Swapping => {
                // A shared task is let go by the shared decoder, which stores its position first.
                let still_streamed = if held.shared {
                    shmem::live::attached_pid(held_task).is_some_and(shmem::backend_alive)
                } else {
                    held.slot_active
                };
                Ok(!still_streamed
                    && held
                        .confirmed
                        .is_some_and(|confirmed| confirmed <= reading.position))
            }
            // Paused, stopped or failed: the swap waits until it streams again.
            _ => Ok(false),
        }
    }
}

/// Waits until Meilisearch has finished every task matching `filters`.
fn await_quiet(live: LiveStatus, client: &Client, filters: &[(&str, &str)]) -> Result<(), Stop> {
    while with_retry(live, "reading Meilisearch's task queue", || {
        client.has_unfinished_tasks(filters)
    })? {
        if should_stop() {
            return Err(Stop::Terminated);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// A resync helper's swap of its index with the live index of the task it rebuilds.
pub struct Swap<'a> {
    pub helper: &'a TaskRecord,
    pub held: &'a TaskRecord,
    pub client: &'a Client,
    pub live: LiveStatus,
}

impl Swap<'_> {
    /// The stream stopped at `position`: swap the helper's index with the live one and hand over.
    pub fn run(&self, position: u64) -> Result<(), Stop> {
        let Swap {
            helper,
            held,
            client,
            live,
        } = *self;
        live.set_phase(Phase::Swapping);
        await_quiet(live, client, &[("indexUids", &held.index_uid)])?;
        let Some(fresh_created_at) =
            self.created_at(&helper.index_uid, "reading the resync index")?
        else {
            return Err(Failure::new(
                FailureKind::Index,
                format!("resync index \"{}\" no longer exists", helper.index_uid),
            )
            .hint(format!(
                "drop this resync helper with SELECT meili_sync_drop({}), then run SELECT meili_sync_resync({}) again",
                helper.id, held.id
            ))
            .into());
        };
        in_transaction(live, "recording the swap", || {
            catalog::tasks::record_swap(helper.id, Some(position), Some(&fresh_created_at))
        })?;
        let uid = with_retry(live, "swapping the indexes", || {
            client.swap_indexes(&held.index_uid, &helper.index_uid)
        })?;
        if let Err(stop) = await_meili_task(live, client, uid, "swapping the indexes") {
            // Forget the recorded swap so that a restarted helper tries it again; should that
            // fail too, the restarted helper reads the index's createdAt to tell whether it
            // happened.
            if let Err(error) =
                worker_transaction(|| catalog::tasks::record_swap(helper.id, None, None))
            {
                warning!(
                    "pg_meili_sync task {}: could not clear the recorded swap: {}",
                    helper.id,
                    error.message
                );
            }
            return Err(stop);
        }
        self.hand_over(position)
    }

    /// When index `uid` was created (its identity across a swap); None if it does not exist.
    fn created_at(&self, uid: &str, what: &str) -> Result<Option<String>, Stop> {
        let index = with_retry(self.live, what, || self.client.get_index(uid))?;
        Ok(index.and_then(|index| index.created_at))
    }

    /// A helper that restarts with its swap recorded finishes it: true when it happened and the
    /// helper is done. False when it did not (the recorded swap is cleared): the helper streams on
    /// and tries again.
    pub fn recover(&self) -> Result<bool, Stop> {
        let (helper, live) = (self.helper, self.live);
        match &helper.resync_phase {
            None => Ok(false),
            Some(ResyncPhase::Swapped) => {
                self.clean_up()?;
                Ok(true)
            }
            Some(ResyncPhase::Swapping {
                position,
                created_at,
            }) => {
                await_quiet(live, self.client, &[("types", "indexSwap")])?;
                let live_created_at = self.created_at(&self.held.index_uid, "reading the index")?;
                if live_created_at.as_ref() == Some(created_at) {
                    log!(
                        "pg_meili_sync task {}: the swap of the interrupted resync happened; handing over",
                        helper.id
                    );
                    self.hand_over(*position)?;
                    return Ok(true);
                }
                log!(
                    "pg_meili_sync task {}: the swap of the interrupted resync did not happen; it will be tried again",
                    helper.id
                );
                in_transaction(live, "clearing the recorded swap", || {
                    catalog::tasks::record_swap(helper.id, None, None)
                })?;
                Ok(false)
            }
        }
    }

    /// After the swap: the held task streams on from `position`, and the old index and the
    /// helper go.
    fn hand_over(&self, position: u64) -> Result<(), Stop> {
        let (helper, held) = (self.helper, self.held);
        in_transaction(self.live, "handing the swapped index over", || {
            catalog::tasks::finish_swap(helper.id, held, position)
        })?;
        shmem::launchers::wake_launcher();
        log!(
            "pg_meili_sync task {}: resync swapped in the new index \"{}\"; streaming goes on from {}",
            held.id,
            held.index_uid,
            catalog::format_lsn(position)
        );
        self.clean_up()
    }

    /// Deletes the old index (now under the helper's uid), then the helper with its slot.
    fn clean_up(&self) -> Result<(), Stop> {
        let (helper, client, live) = (self.helper, self.client, self.live);
        while with_retry(live, "reading the old index", || {
            client.get_index(&helper.index_uid)
        })?
        .is_some()
        {
            let uid = with_retry(live, "deleting the old index", || {
                client.delete_index(&helper.index_uid)
            })?;
            await_index_deletion(live, client, uid, "deleting the old index")?;
        }
        in_transaction(live, "removing the resync helper", || {
            catalog::tasks::delete_task(helper)?;
            if catalog::replication::slot_wal_status(&helper.slot_name)?.is_some() {
                catalog::replication::drop_slot(&helper.slot_name)?;
            }
            Ok(())
        })?;
        shmem::launchers::wake_launcher();
        Ok(())
    }
}
