//! What a commit sets off: it wakes the database's launcher and task workers, so that a new or
//! changed task, a write to a synced table or a changed source takes effect at once rather than
//! after a nap, and it counts the commits that changed tasks or sources, which the workers
//! compare with what they last saw.

use pgrx::prelude::*;

use super::{launchers, live, STATE};

static WROTE_WAL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Wakes the task workers when a transaction that wrote something commits, so they decode it at
/// once instead of after their nap. Runs in every backend; costs a shared lock per writing commit.
// SAFETY: called by Postgres's transaction machinery on this backend's main thread only, with the
// arguments RegisterXactCallback documents; #[pg_guard] keeps a panic from unwinding into C.
#[pg_guard]
pub(super) unsafe extern "C-unwind" fn wake_workers_at_commit(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    use std::sync::atomic::Ordering;
    match event {
        pg_sys::XactEvent::XACT_EVENT_PRE_COMMIT => {
            // SAFETY: reads this backend's transaction state during its own commit.
            let has_xid =
                unsafe { pg_sys::GetTopTransactionIdIfAny() } != pg_sys::InvalidTransactionId;
            WROTE_WAL.store(has_xid, Ordering::Relaxed);
        }
        pg_sys::XactEvent::XACT_EVENT_COMMIT if WROTE_WAL.swap(false, Ordering::Relaxed) => {
            live::wake_task_workers();
        }
        pg_sys::XactEvent::XACT_EVENT_ABORT => WROTE_WAL.store(false, Ordering::Relaxed),
        _ => {}
    }
}

static WAKE_PENDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Wakes this database's launcher and task workers when the transaction commits, so a new or
/// changed task takes effect at once (a shared decoder sees `tasks_changed` move); an aborted
/// transaction wakes nobody.
pub fn wake_launcher_at_commit() {
    use pgrx::{register_xact_callback, PgXactCallbackEvent};
    use std::sync::atomic::Ordering;
    if !WAKE_PENDING.swap(true, Ordering::Relaxed) {
        register_xact_callback(PgXactCallbackEvent::Commit, || {
            WAKE_PENDING.store(false, Ordering::Relaxed);
            {
                let mut state = STATE.exclusive();
                state.tasks_changed = state.tasks_changed.wrapping_add(1);
            }
            launchers::wake_launcher();
            live::wake_task_workers();
        });
        register_xact_callback(PgXactCallbackEvent::Abort, || {
            WAKE_PENDING.store(false, Ordering::Relaxed);
        });
    }
}

static SOURCES_PENDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// When the transaction commits, counts a change that may have changed a task's source without
/// changing rows (`sources_changed`: a partition attached, detached or dropped, a view replaced)
/// and wakes this database's workers: a task on a partitioned table then looks at its partitions,
/// and a view task at the tables its view reads, at once rather than at its next look.
pub fn note_sources_changed_at_commit() {
    use pgrx::{register_xact_callback, PgXactCallbackEvent};
    use std::sync::atomic::Ordering;
    if !SOURCES_PENDING.swap(true, Ordering::Relaxed) {
        register_xact_callback(PgXactCallbackEvent::Commit, || {
            SOURCES_PENDING.store(false, Ordering::Relaxed);
            {
                let mut state = STATE.exclusive();
                state.sources_changed = state.sources_changed.wrapping_add(1);
            }
            live::wake_task_workers();
        });
        register_xact_callback(PgXactCallbackEvent::Abort, || {
            SOURCES_PENDING.store(false, Ordering::Relaxed);
        });
    }
}

/// How many commits changed a task or its state since the server started.
pub fn tasks_changed() -> u64 {
    STATE.share().tasks_changed
}

/// How many commits may have changed a task's source without changing rows since the server
/// started.
pub fn sources_changed() -> u64 {
    STATE.share().sources_changed
}
