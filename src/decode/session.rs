//! In-process logical decoding of the task's `pgoutput` slot: the steps of the server's own
//! `pg_logical_slot_get_changes` (logicalfuncs.c), but with one decoding context kept open for the
//! worker's whole life, fed WAL as it is flushed, and our own write callback receiving pgoutput's
//! messages in memory. Every FFI call of the project's decoding lives here.
//!
//! Read the rules below before changing this file: a mistake here takes the whole cluster down
//! (a segfault in any backend restarts all of them).
//!
//!
//! - **Order of setup.** The slot is acquired (`ReplicationSlotAcquire`) after
//!   `CheckLogicalDecodingRequirements`; the plugin options (`proto_version` 1, the publication,
//!   `messages`) and the reader routine are built in a memory context that outlives transactions;
//!   one `CreateDecodingContext` with our own prepare-write, write and update-progress callbacks; one
//!   `XLogBeginRead` at the slot's `restart_lsn`, then cache invalidation.
//! - **Memory contexts.** `XLogReadRecord` allocates the reader's decode buffer lazily in the current
//!   memory context, so reading and `LogicalDecodingProcessRecord` run with the long-lived context
//!   current, never one that is reset per round.
//! - **The page reader** is the blocking `read_local_xlog_page`, and a round reads only up to the
//!   flush position taken when it starts (`GetFlushRecPtr`), so the reader never waits at the end of
//!   WAL. The no-wait reader cannot be used as it is: it writes its end-of-WAL flag into the
//!   reader's `private_data`, which for a decoding context is the context itself.
//! - **Bindings.** pgrx does not bind `LogicalDecodingProcessRecord`, and its `pg_sys` functions are
//!   Rust wrappers: the C functions handed over as callbacks (page reader, segment open/close) are
//!   declared as raw `extern "C-unwind"` symbols, and calls cross the FFI boundary guard.
//! - **Confirming.** `LogicalConfirmReceivedLocation` is followed by `ReplicationSlotMarkDirty`
//!   (without it PostgreSQL 15 forgets the position at a clean restart), and never goes backwards.
//!   Only a Commit's end LSN is a safe point (pgoutput reports progress at other LSNs too); when
//!   caught up and idle, the read position is confirmed so that `restart_lsn` can move.
//! - **Caches after decoding.** Replaying a transaction fills the relation and catalog caches from
//!   the catalog as it was at that point of the WAL. Every transaction of a worker starts with
//!   `control::worker_transaction`, which empties them first if the process decoded since
//!   (`forget_historic_catalog`, as `pg_logical_slot_get_changes` does after its loop); without it,
//!   a worker that decoded a change of `meili_sync.tasks` from before an `ALTER EXTENSION … UPDATE`
//!   wrote the task's row without the new columns.
//! - **Stopping.** A big transaction replays inside one `LogicalDecodingProcessRecord` call; the
//!   write callback checks for SIGTERM and leaves with an ERROR, the only way out (the worker logs it
//!   as a stop, and the slot has not moved past that transaction).

use std::ffi::{c_char, c_int, CStr, CString};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};

use pgrx::pg_sys;
use pgrx::pg_sys::submodules::ffi::pg_guard_ffi_boundary;
use pgrx::prelude::*;

// pgrx binds these as Rust wrappers (or not at all); callbacks handed to C must be the C symbols.
extern "C-unwind" {
    fn LogicalDecodingProcessRecord(
        ctx: *mut pg_sys::LogicalDecodingContext,
        record: *mut pg_sys::XLogReaderState,
    );
    #[link_name = "read_local_xlog_page"]
    fn c_read_local_xlog_page(
        state: *mut pg_sys::XLogReaderState,
        target_page: pg_sys::XLogRecPtr,
        request_length: c_int,
        target_record: pg_sys::XLogRecPtr,
        buffer: *mut c_char,
    ) -> c_int;
    #[link_name = "wal_segment_open"]
    fn c_wal_segment_open(
        state: *mut pg_sys::XLogReaderState,
        segment: pg_sys::XLogSegNo,
        timeline: *mut pg_sys::TimeLineID,
    );
    #[link_name = "wal_segment_close"]
    fn c_wal_segment_close(state: *mut pg_sys::XLogReaderState);
}

/// Whether this process decoded WAL since it last emptied its catalog caches.
static DECODED_SINCE_RESET: AtomicBool = AtomicBool::new(false);

/// Empties this process's catalog caches if it decoded WAL since they were last emptied, as the
/// server's own `pg_logical_slot_get_changes` does after decoding. Replaying a transaction builds
/// relation and catalog cache entries from the catalog as it was at that point of the WAL (a
/// historic snapshot), and nothing removes those whose relation changed later: a query after
/// decoding would see a table without its newest columns, and an UPDATE would write rows without
/// them. Call inside a transaction, before its first query.
pub fn forget_historic_catalog() {
    if DECODED_SINCE_RESET.swap(false, Ordering::Relaxed) {
        // SAFETY: called inside a transaction, outside any decoding callback, as logicalfuncs.c
        // calls it after its decoding loop; open relations are rebuilt in place.
        unsafe { pg_sys::InvalidateSystemCaches() };
    }
}

/// Receives each pgoutput message, with the LSN the plugin gave it (for Commit: the commit's end).
pub trait MessageSink {
    fn message(&mut self, lsn: u64, data: &[u8]);
}

/// Where the write callback finds the sink of the current `read` call.
struct SinkSlot {
    current: Option<*mut dyn MessageSink>,
}

pub struct DecodingSession {
    context: *mut pg_sys::LogicalDecodingContext,
    memory: pg_sys::MemoryContext,
    sink: Box<SinkSlot>,
    // The routine must outlive the reader that points to it.
    _routine: Box<pg_sys::XLogReaderRoutine>,
    standbys: StandbyWait,
    /// The reader's last record ends past what the standbys confirmed: it is decoded once they
    /// have it (see `StandbyWait`).
    record_held: bool,
}

/// How far the failover standbys have the WAL (PostgreSQL 17 on). A change must not reach
/// Meilisearch before the standbys named in `synchronized_standby_slots` have it, or after a
/// promotion the index would hold rows the new primary never had. Walsenders and the SQL decoding
/// functions wait for them; this decoder runs in-process, so it reads no record that ends past
/// the position they confirmed. Like a walsender it asks them to reach a target (the flush
/// position when it asked) and takes a new one once they do, so that reading goes on under
/// steady writes.
#[derive(Default)]
struct StandbyWait {
    /// The standbys have the WAL up to here.
    #[cfg(not(any(feature = "pg15", feature = "pg16")))]
    confirmed: u64,
    /// The position they were last asked to reach.
    #[cfg(not(any(feature = "pg15", feature = "pg16")))]
    target: u64,
    /// When the reason for waiting was last logged.
    #[cfg(not(any(feature = "pg15", feature = "pg16")))]
    logged: Option<std::time::Instant>,
}

/// How often a wait for the standbys logs its reason (a missing, logical, invalidated or inactive
/// slot in `synchronized_standby_slots`) as a WARNING.
#[cfg(not(any(feature = "pg15", feature = "pg16")))]
const STANDBY_WARNING_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

impl StandbyWait {
    /// The end of WAL that may be read: `flushed`, unless the slot is a failover slot and the
    /// standbys of `synchronized_standby_slots` do not have it yet.
    #[cfg(not(any(feature = "pg15", feature = "pg16")))]
    fn readable_end(&mut self, flushed: u64) -> u64 {
        // SAFETY: the session holds the slot (MyReplicationSlot) for its whole life, and
        // StandbySlotsHaveCaughtup reads the slots under ReplicationSlotControlLock and raises
        // at most the `elevel` given (WARNING or DEBUG1), never an ERROR.
        unsafe {
            if !(*pg_sys::MyReplicationSlot).data.failover {
                return flushed;
            }
            let warn = self
                .logged
                .is_none_or(|at| at.elapsed() >= STANDBY_WARNING_INTERVAL);
            let elevel = if warn {
                pg_sys::WARNING as c_int
            } else {
                pg_sys::DEBUG1 as c_int
            };
            if pg_sys::StandbySlotsHaveCaughtup(flushed, pg_sys::DEBUG1 as c_int) {
                self.confirmed = flushed;
                self.target = flushed;
                return flushed;
            }
            if self.target > self.confirmed && pg_sys::StandbySlotsHaveCaughtup(self.target, elevel)
            {
                self.confirmed = self.target;
            }
            if warn {
                self.logged = Some(std::time::Instant::now());
            }
            if self.target <= self.confirmed {
                self.target = flushed;
            }
            self.confirmed
        }
    }

    /// Before PostgreSQL 17 there are no failover slots: everything flushed may be read.
    #[cfg(any(feature = "pg15", feature = "pg16"))]
    fn readable_end(&mut self, flushed: u64) -> u64 {
        flushed
    }
}

// SAFETY: an output-plugin write callback, called by logical decoding on the main thread with the
// context this session created; #[pg_guard] keeps a panic from unwinding into C.
#[pg_guard]
unsafe extern "C-unwind" fn prepare_write(
    context: *mut pg_sys::LogicalDecodingContext,
    _lsn: pg_sys::XLogRecPtr,
    _xid: pg_sys::TransactionId,
    _last_write: bool,
) {
    // SAFETY: Postgres calls this with the live decoding context, whose `out` buffer it owns.
    unsafe { pg_sys::resetStringInfo((*context).out) };
}

// SAFETY: the write callback after `prepare_write`, with the same context and guarantees.
#[pg_guard]
unsafe extern "C-unwind" fn write_message(
    context: *mut pg_sys::LogicalDecodingContext,
    lsn: pg_sys::XLogRecPtr,
    _xid: pg_sys::TransactionId,
    _last_write: bool,
) {
    // SAFETY: `output_writer_private` is the session's boxed SinkSlot, which outlives the context;
    // `current` is only Some during `DecodingSession::read`, which holds the `&mut dyn MessageSink`
    // it points to. `out` holds exactly one whole pgoutput message of `len` bytes.
    unsafe {
        let slot = (*context).output_writer_private.cast::<SinkSlot>();
        let Some(sink) = slot.as_mut().and_then(|slot| slot.current) else {
            return;
        };
        let out = (*context).out;
        let length = usize::try_from((*out).len).unwrap_or(0);
        let data = if length == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts((*out).data.cast::<u8>(), length)
        };
        (*sink).message(lsn, data);
    }
}

/// Runs `f` with `memory` as CurrentMemoryContext, restoring the previous one afterwards (also
/// when `f` raises, since pgrx turns the ERROR into a panic that unwinds through here).
fn in_memory_context<T>(memory: pg_sys::MemoryContext, f: impl FnOnce() -> T) -> T {
    struct Restore(pg_sys::MemoryContext);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: puts back the context that was current on entry, which is still alive.
            unsafe { (&raw mut pg_sys::CurrentMemoryContext).write(self.0) };
        }
    }
    // SAFETY: `memory` is a live context owned by the session; switching is what MemoryContextSwitchTo does.
    let _restore = Restore(unsafe {
        let previous = (&raw const pg_sys::CurrentMemoryContext).read();
        (&raw mut pg_sys::CurrentMemoryContext).write(memory);
        previous
    });
    f()
}

fn option(name: &str, value: &str) -> *mut pg_sys::DefElem {
    let name = CString::new(name).unwrap_or_default();
    let value = CString::new(value).unwrap_or_default();
    // SAFETY: pstrdup copies into the current (session) memory context; makeDefElem/makeString
    // build nodes there, as pg_logical_slot_get_changes does for its options.
    unsafe {
        pg_sys::makeDefElem(
            pg_sys::pstrdup(name.as_ptr()),
            pg_sys::makeString(pg_sys::pstrdup(value.as_ptr())).cast(),
            -1,
        )
    }
}

/// Why a decoding session could not open or read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// A slot name with a NUL byte in it.
    SlotName(String),
    /// The WAL reader's own message.
    WalRead(String),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::SlotName(name) => write!(f, "invalid slot name {name:?}"),
            DecodeError::WalRead(why) => {
                write!(f, "could not read WAL for logical decoding: {why}")
            }
        }
    }
}

impl DecodingSession {
    /// Acquires the slot and opens a decoding context on it with pgoutput for `publication`.
    /// Must run outside a transaction, in the worker's main thread.
    pub fn open(slot_name: &str, publication: &str) -> Result<DecodingSession, DecodeError> {
        let slot =
            CString::new(slot_name).map_err(|_| DecodeError::SlotName(slot_name.to_owned()))?;
        // SAFETY: a child of TopMemoryContext lives until we delete it in `close`, so the context,
        // the reader and its lazily allocated decode buffer outlive every transaction.
        let memory = unsafe {
            pg_sys::AllocSetContextCreateInternal(
                pg_sys::TopMemoryContext,
                c"pg_meili_sync decoding".as_ptr(),
                0,
                8 * 1024,
                8 * 1024 * 1024,
            )
        };
        let mut routine = Box::new(pg_sys::XLogReaderRoutine {
            page_read: Some(c_read_local_xlog_page),
            segment_open: Some(c_wal_segment_open),
            segment_close: Some(c_wal_segment_close),
        });
        let mut sink = Box::new(SinkSlot { current: None });
        let context = in_memory_context(memory, || {
            // SAFETY: the documented sequence of logicalfuncs.c: check requirements, acquire the
            // slot by name (errors if another process holds it), build the plugin options as a
            // List of DefElem and create the context starting at the slot's confirmed position.
            unsafe {
                pg_sys::CheckLogicalDecodingRequirements();
                // PostgreSQL 18 added `error_if_invalid`: true raises on an invalidated slot
                // here, as logicalfuncs.c asks; earlier majors raise in CreateDecodingContext.
                #[cfg(any(feature = "pg15", feature = "pg16", feature = "pg17"))]
                pg_sys::ReplicationSlotAcquire(slot.as_ptr(), true);
                #[cfg(not(any(feature = "pg15", feature = "pg16", feature = "pg17")))]
                pg_sys::ReplicationSlotAcquire(slot.as_ptr(), true, true);
                let mut options: *mut pg_sys::List = ptr::null_mut();
                // `messages`: the logical messages that announce tasks' state changes.
                for (name, value) in [
                    ("proto_version", "1"),
                    ("publication_names", publication),
                    ("messages", "true"),
                ] {
                    options = pg_sys::lappend(options, option(name, value).cast());
                }
                let context = pg_sys::CreateDecodingContext(
                    pg_sys::InvalidXLogRecPtr as pg_sys::XLogRecPtr,
                    options,
                    false,
                    &mut *routine,
                    Some(prepare_write),
                    Some(write_message),
                    None,
                );
                (*context).output_writer_private = (&mut *sink as *mut SinkSlot).cast();
                // Decode from restart_lsn so transactions committing after confirmed_flush are complete.
                pg_sys::XLogBeginRead(
                    (*context).reader,
                    (*pg_sys::MyReplicationSlot).data.restart_lsn,
                );
                pg_sys::InvalidateSystemCaches();
                context
            }
        });
        Ok(DecodingSession {
            context,
            memory,
            sink,
            _routine: routine,
            standbys: StandbyWait::default(),
            record_held: false,
        })
    }

    /// Where the reader is: the end of the last record decoded (the start of a record held for
    /// the standbys).
    pub fn read_position(&self) -> u64 {
        // SAFETY: the context and its reader live as long as the session.
        unsafe {
            let reader = (*self.context).reader;
            if self.record_held {
                (*reader).ReadRecPtr
            } else {
                (*reader).EndRecPtr
            }
        }
    }

    /// The slot's confirmed position.
    pub fn confirmed(&self) -> u64 {
        // SAFETY: we hold the slot (MyReplicationSlot) for the session's life.
        unsafe { (*pg_sys::MyReplicationSlot).data.confirmed_flush }
    }

    /// WAL flushed so far: decoding never reads past it, so it never waits inside the page reader.
    pub fn flushed() -> u64 {
        // SAFETY: reads shared WAL state under its own lock.
        unsafe { pg_sys::GetFlushRecPtr(ptr::null_mut()) }
    }

    /// Reads and decodes up to `max_records` WAL records that are already flushed (and that the
    /// failover standbys have: `StandbyWait`), handing every pgoutput message to `sink`; returns
    /// how many records it read (0 when caught up).
    pub fn read(
        &mut self,
        sink: &mut dyn MessageSink,
        max_records: usize,
    ) -> Result<usize, DecodeError> {
        let end_of_wal = self.standbys.readable_end(Self::flushed());
        let record_held = &mut self.record_held;
        // SAFETY: erases the borrow's lifetime for the callback; cleared again before returning
        // (and on an ERROR the worker exits without touching the session again).
        self.sink.current = Some(unsafe {
            std::mem::transmute::<&mut dyn MessageSink, &'static mut dyn MessageSink>(sink)
        });
        let context = self.context;
        let result = in_memory_context(self.memory, || {
            let mut records = 0;
            while records < max_records {
                // SAFETY: the reader belongs to our live context and its decode buffer is allocated in
                // the session's memory context (current here), as the decoding notes require.
                unsafe {
                    let reader = (*context).reader;
                    if *record_held {
                        // The reader's current record, read by an earlier call and not decoded
                        // yet: nothing has been read after it, so it is still the reader's.
                        if (*reader).EndRecPtr > end_of_wal {
                            break;
                        }
                        *record_held = false;
                        pg_guard_ffi_boundary(|| LogicalDecodingProcessRecord(context, reader));
                        records += 1;
                        continue;
                    }
                    if (*reader).EndRecPtr >= end_of_wal {
                        break;
                    }
                    let mut error: *mut c_char = ptr::null_mut();
                    let record = pg_sys::XLogReadRecord(reader, &mut error);
                    if !error.is_null() {
                        return Err(DecodeError::WalRead(
                            CStr::from_ptr(error).to_string_lossy().into_owned(),
                        ));
                    }
                    if !record.is_null() {
                        if (*reader).EndRecPtr > end_of_wal {
                            // It starts before what the standbys have and ends after it.
                            *record_held = true;
                            break;
                        }
                        pg_guard_ffi_boundary(|| LogicalDecodingProcessRecord(context, reader));
                    }
                }
                records += 1;
            }
            Ok(records)
        });
        self.sink.current = None;
        if matches!(result, Ok(records) if records > 0) {
            DECODED_SINCE_RESET.store(true, Ordering::Relaxed);
        }
        result
    }

    /// Confirms that everything up to `lsn` is in Meilisearch: the slot may release that WAL.
    /// Never moves backwards (PG15's LogicalConfirmReceivedLocation would).
    pub fn confirm(&mut self, lsn: u64) {
        if lsn <= self.confirmed() {
            return;
        }
        // SAFETY: we hold the slot; marking it dirty makes a clean shutdown keep the position
        // (the decoding notes: without it PG15 forgot it).
        unsafe {
            pg_sys::LogicalConfirmReceivedLocation(lsn);
            pg_sys::ReplicationSlotMarkDirty();
        }
    }

    /// Frees the decoding context and releases the slot (on an ERROR Postgres releases it itself).
    pub fn close(self) {
        // SAFETY: the context is ours and no read is in progress; the memory context holding it is
        // deleted last.
        unsafe {
            pg_sys::FreeDecodingContext(self.context);
            pg_sys::ReplicationSlotRelease();
            pg_sys::MemoryContextDelete(self.memory);
        }
    }
}
