//! The backends waiting in `meili_sync_wait` for a task's confirmation: each holds a place with
//! its latch, which the worker that publishes a confirmation far enough sets, so that the wait
//! ends at once rather than at its next look.

use pgrx::prelude::*;

use super::live::confirmed_past;
use super::{my_database, SharedState, STATE};

/// A backend in `meili_sync_wait`: which task's confirmation, up to where, and its latch.
#[derive(Clone, Copy)]
pub(super) struct Waiter {
    database: pg_sys::Oid,
    task_id: i64,
    lsn: u64,
    /// Address of the backend's PGPROC latch; 0 for a free place.
    latch: usize,
    pid: i32,
}

impl Waiter {
    pub(super) const FREE: Waiter = Waiter {
        database: pg_sys::Oid::INVALID,
        task_id: 0,
        lsn: 0,
        latch: 0,
        pid: 0,
    };
}

/// The backends of this database waiting in `meili_sync_wait` with a place: (pid, task,
/// position waited for).
pub fn waiting_backends() -> Vec<(i32, i64, u64)> {
    let database = my_database();
    STATE
        .share()
        .waiters
        .iter()
        .filter(|waiter| waiter.latch != 0 && waiter.database == database)
        .map(|waiter| (waiter.pid, waiter.task_id, waiter.lsn))
        .collect()
}

/// Backends that may wait in `meili_sync_wait` at once with a latch the workers set; more wait
/// by looking every 10 ms.
pub(super) const WAITERS: usize = 128;

/// Sets the latch of each backend of `database` waiting for the task's confirmation at or before
/// `confirmed`, which the task's worker has just published under the same exclusive lock.
pub(super) fn wake_confirmed(
    state: &SharedState,
    database: pg_sys::Oid,
    task_id: i64,
    confirmed: u64,
) {
    for waiter in state.waiters.iter().filter(|waiter| {
        waiter.latch != 0
            && waiter.task_id == task_id
            && waiter.database == database
            && waiter.lsn <= confirmed
    }) {
        // SAFETY: the address is a waiting backend's PGPROC latch in shared memory, valid
        // for the cluster's life; setting the latch of a backend that stopped waiting
        // is harmless.
        unsafe { pg_sys::SetLatch(waiter.latch as *mut pg_sys::Latch) };
    }
}

/// Whether a backend waits in `meili_sync_wait` for the task (so that its position is worth
/// publishing at once).
pub fn has_waiters(task_id: i64) -> bool {
    let database = my_database();
    STATE
        .share()
        .waiters
        .iter()
        .any(|waiter| waiter.latch != 0 && waiter.task_id == task_id && waiter.database == database)
}

/// Frees a waiter's places when the wait ends, also when a cancel's ERROR unwinds through it.
struct WaiterPlaces(Vec<usize>);

impl Drop for WaiterPlaces {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        let mut state = STATE.exclusive();
        for index in &self.0 {
            state.waiters[*index] = Waiter::FREE;
        }
    }
}

/// Frees every place this backend holds when it exits. `pg_terminate_backend` ends a backend
/// with a FATAL that does not unwind Rust frames, so `WaiterPlace` alone would leave its place
/// taken for good.
// SAFETY: called by Postgres's exit machinery (before_shmem_exit) on this backend's main thread,
// with the arguments it documents; #[pg_guard] keeps a panic from unwinding into C.
#[pg_guard]
unsafe extern "C-unwind" fn free_waiter_places_at_exit(_code: i32, _arg: pg_sys::Datum) {
    // SAFETY: MyProc stays valid through before_shmem_exit callbacks.
    let latch = unsafe { &raw mut (*pg_sys::MyProc).procLatch } as usize;
    let mut state = STATE.exclusive();
    for waiter in state
        .waiters
        .iter_mut()
        .filter(|waiter| waiter.latch == latch)
    {
        *waiter = Waiter::FREE;
    }
}

/// Registers [`free_waiter_places_at_exit`] once per backend, before its first wait.
fn free_waiter_places_at_exit_once() {
    thread_local! {
        static REGISTERED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if REGISTERED.get() {
        return;
    }
    // SAFETY: main thread of a backend; the callback runs at process exit, before shared
    // memory detaches, and only takes the extension's own lock (held nowhere a FATAL can come).
    unsafe { pg_sys::before_shmem_exit(Some(free_waiter_places_at_exit), pg_sys::Datum::from(0)) };
    REGISTERED.set(true);
}

/// Sleeps on this backend's latch until workers confirm each of `tasks` (a task and its
/// replicas; with `any`, one of them) at or past `lsn` (true) or `timeout` passes (false). The
/// worker that publishes a confirmation sets the latch; a cancel or `statement_timeout` ends the
/// wait with its ERROR.
/// Sleeps `duration` on this backend's latch, and answers a cancel or a terminate at once.
pub fn nap(duration: std::time::Duration) {
    let millis = duration.as_millis().clamp(1, i32::MAX as u128) as i64;
    // SAFETY: waits on this backend's own latch (MyLatch) with a timeout; WL_EXIT_ON_PM_DEATH ends
    // the backend if the postmaster dies. The latch is reset after, as its other waits expect.
    unsafe {
        pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            millis,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
    }
    pgrx::check_for_interrupts!();
}

pub fn wait_confirmed(tasks: &[i64], lsn: u64, timeout: std::time::Duration, any: bool) -> bool {
    // SAFETY: MyProc is this backend's PGPROC, in shared memory at the same address everywhere.
    let latch = unsafe { &raw mut (*pg_sys::MyProc).procLatch } as usize;
    free_waiter_places_at_exit_once();
    let places = {
        let mut state = STATE.exclusive();
        let mut places = WaiterPlaces(Vec::with_capacity(tasks.len()));
        for &task_id in tasks {
            let Some(index) = state.waiters.iter().position(|waiter| waiter.latch == 0) else {
                break;
            };
            state.waiters[index] = Waiter {
                database: my_database(),
                task_id,
                lsn,
                latch,
                // SAFETY: this backend's own pid.
                pid: unsafe { pg_sys::MyProcPid },
            };
            places.0.push(index);
        }
        places
    };
    // Without a place for each task, a confirmation may set no latch: look every 10 ms.
    let look_every = if places.0.len() == tasks.len() {
        timeout
    } else {
        std::time::Duration::from_millis(10)
    };
    let deadline = std::time::Instant::now() + timeout;
    loop {
        // SAFETY: resets this backend's own latch before looking, so that a confirmation
        // published after the look sets it again and the wait below returns at once.
        unsafe { pg_sys::ResetLatch(latch as *mut pg_sys::Latch) };
        let confirmed = |task_id: &i64| confirmed_past(*task_id, lsn);
        if (any && tasks.iter().any(confirmed)) || (!any && tasks.iter().all(confirmed)) {
            return true;
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        let nap = left.min(look_every).as_millis().clamp(1, i32::MAX as u128) as i64;
        // SAFETY: waits on this backend's own latch with a timeout; WL_EXIT_ON_PM_DEATH ends the
        // backend if the postmaster dies.
        unsafe {
            pg_sys::WaitLatch(
                latch as *mut pg_sys::Latch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                nap,
                pg_sys::PG_WAIT_EXTENSION,
            )
        };
        pgrx::check_for_interrupts!();
    }
}
