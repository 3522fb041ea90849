//! Our processes leave a database before a command that needs it to itself: `DROP DATABASE`,
//! `ALTER DATABASE … RENAME` or `SET TABLESPACE`, and `CREATE DATABASE … TEMPLATE` of it. A
//! `ProcessUtility` hook pauses the database in shared memory (no launcher or worker of ours
//! starts in it), stops its launcher and workers, waits for them to exit (so that no slot of the
//! database is active, which `DROP DATABASE` refuses), runs the command, and lifts the pause,
//! also when the command fails. Only for a caller who owns the database: anyone else's command
//! fails in Postgres as it would without us, and stops nothing.
//!
//! The same hook wakes the database's launcher at the commit of `CREATE`/`ALTER EXTENSION
//! pg_meili_sync` and of a `COPY` into its catalog (a restore), which call no task function, and
//! of a DDL that may change what a task's documents look like (the launcher compares shapes).

use std::ffi::CStr;
use std::time::{Duration, Instant};

use pgrx::prelude::*;

use crate::shmem;

/// How long the command waits for our processes to exit before it runs anyway (and Postgres
/// reports whatever still uses the database).
const LEAVE_TIMEOUT: Duration = Duration::from_secs(20);

static mut NEXT_HOOK: pg_sys::ProcessUtility_hook_type = None;

/// Installs the hook, from `_PG_init` of the preloaded library.
pub fn install() {
    // SAFETY: _PG_init runs once, single-threaded, before any statement; the previous hook is
    // kept and called (hooks chain).
    unsafe {
        NEXT_HOOK = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(leave_database_first);
    }
}

// SAFETY: Postgres calls the hook on a backend's main thread with the arguments ProcessUtility
// documents; #[pg_guard] turns a Rust panic into an ERROR instead of unwinding into C.
#[pg_guard]
#[allow(clippy::too_many_arguments)]
unsafe extern "C-unwind" fn leave_database_first(
    statement: *mut pg_sys::PlannedStmt,
    query: *const std::ffi::c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    environment: *mut pg_sys::QueryEnvironment,
    destination: *mut pg_sys::DestReceiver,
    completion: *mut pg_sys::QueryCompletion,
) {
    let run = move || {
        // SAFETY: the arguments Postgres gave this hook, passed on unchanged.
        unsafe {
            match NEXT_HOOK {
                Some(next) => next(
                    statement,
                    query,
                    read_only_tree,
                    context,
                    params,
                    environment,
                    destination,
                    completion,
                ),
                None => pg_sys::standard_ProcessUtility(
                    statement,
                    query,
                    read_only_tree,
                    context,
                    params,
                    environment,
                    destination,
                    completion,
                ),
            }
        }
    };
    // SAFETY: the statement Postgres is about to run, a valid node tree.
    let node = unsafe { (*statement).utilityStmt };
    // SAFETY: as above.
    let wakes = unsafe { fills_our_catalog(node) };
    // SAFETY: as above.
    let database =
        unsafe { database_needed_alone(node) }.filter(|database| owns_database(*database));
    match database.filter(|database| shmem::launchers::pause_database(*database)) {
        None => run(),
        Some(database) => {
            let run = std::panic::AssertUnwindSafe(run);
            PgTryBuilder::new(move || {
                let run = run;
                leave(database);
                (run.0)()
            })
            .finally(|| shmem::launchers::resume_database(database))
            .execute()
        }
    }
    // SAFETY: as above.
    let changes_shape = unsafe { may_change_shape(node) } && extension_is_here();
    if wakes || changes_shape {
        shmem::commits::wake_launcher_at_commit();
    }
    // SAFETY: as above.
    if changes_shape || unsafe { may_change_partitions(node) } {
        shmem::commits::note_sources_changed_at_commit();
    }
}

/// Whether `node` may change what a task's documents look like without changing rows, so that the
/// launcher compares each task's shape at its commit (`catalog::tasks::show_tasks_out_of_shape`)
/// rather than at its next round: an `ALTER TABLE` (of a table, a view or a composite type), a
/// rename (of a column or an attribute), `ALTER TYPE … RENAME VALUE`, `CREATE OR REPLACE VIEW`.
///
/// # Safety
/// `node` is a valid utility statement node (or null).
unsafe fn may_change_shape(node: *mut pg_sys::Node) -> bool {
    // SAFETY: the caller's node, checked for NULL first.
    !node.is_null()
        && matches!(
            unsafe { (*node).type_ },
            pg_sys::NodeTag::T_AlterTableStmt
                | pg_sys::NodeTag::T_RenameStmt
                | pg_sys::NodeTag::T_AlterEnumStmt
                | pg_sys::NodeTag::T_ViewStmt
        )
}

/// Whether this database has the extension: a DDL elsewhere wakes no launcher.
fn extension_is_here() -> bool {
    // SAFETY: called on a backend's main thread inside the statement's transaction, after the
    // command ran; `missing_ok` makes an absent extension InvalidOid, not an ERROR.
    unsafe { pg_sys::get_extension_oid(c"pg_meili_sync".as_ptr(), true) != pg_sys::InvalidOid }
}

/// Whether `node` may attach, detach or drop a partition: an `ALTER TABLE` with `ATTACH` or
/// `DETACH PARTITION` (also its `FINALIZE`), or a `DROP TABLE`.
///
/// # Safety
/// `node` is a valid utility statement node (or null).
unsafe fn may_change_partitions(node: *mut pg_sys::Node) -> bool {
    if node.is_null() {
        return false;
    }
    // SAFETY: each cast follows the node's tag; the command list is the parser's.
    unsafe {
        match (*node).type_ {
            pg_sys::NodeTag::T_AlterTableStmt => {
                let commands = (*node.cast::<pg_sys::AlterTableStmt>()).cmds;
                if commands.is_null() {
                    return false;
                }
                (0..(*commands).length).any(|index| {
                    let command = (*(*commands).elements.add(index as usize)).ptr_value
                        as *mut pg_sys::AlterTableCmd;
                    !command.is_null()
                        && matches!(
                            (*command).subtype,
                            pg_sys::AlterTableType::AT_AttachPartition
                                | pg_sys::AlterTableType::AT_DetachPartition
                                | pg_sys::AlterTableType::AT_DetachPartitionFinalize
                        )
                })
            }
            pg_sys::NodeTag::T_DropStmt => {
                (*node.cast::<pg_sys::DropStmt>()).removeType == pg_sys::ObjectType::OBJECT_TABLE
            }
            _ => false,
        }
    }
}

/// Whether `node` creates or updates the extension, or copies rows into its catalog (a
/// `pg_restore`): the database's launcher must then look, though no task function was called.
///
/// # Safety
/// `node` is a valid utility statement node (or null).
unsafe fn fills_our_catalog(node: *mut pg_sys::Node) -> bool {
    if node.is_null() {
        return false;
    }
    let ours = |name: *const std::ffi::c_char, wanted: &CStr| {
        // SAFETY: a NUL-terminated name from the parser, checked for NULL first.
        !name.is_null() && unsafe { CStr::from_ptr(name) } == wanted
    };
    // SAFETY: each cast follows the node's tag.
    unsafe {
        match (*node).type_ {
            pg_sys::NodeTag::T_CreateExtensionStmt => ours(
                (*node.cast::<pg_sys::CreateExtensionStmt>()).extname,
                c"pg_meili_sync",
            ),
            pg_sys::NodeTag::T_AlterExtensionStmt => ours(
                (*node.cast::<pg_sys::AlterExtensionStmt>()).extname,
                c"pg_meili_sync",
            ),
            pg_sys::NodeTag::T_CopyStmt => {
                let copy = &*node.cast::<pg_sys::CopyStmt>();
                copy.is_from
                    && !copy.relation.is_null()
                    && ours((*copy.relation).schemaname, c"meili_sync")
            }
            _ => false,
        }
    }
}

/// The database that `node` needs without other connections, if it is one of the commands above.
///
/// # Safety
/// `node` is a valid utility statement node (or null).
unsafe fn database_needed_alone(node: *mut pg_sys::Node) -> Option<pg_sys::Oid> {
    if node.is_null() {
        return None;
    }
    // SAFETY: each cast follows the node's tag; names and option lists are the parser's.
    let name: *const std::ffi::c_char = unsafe {
        match (*node).type_ {
            pg_sys::NodeTag::T_DropdbStmt => (*node.cast::<pg_sys::DropdbStmt>()).dbname,
            pg_sys::NodeTag::T_RenameStmt => {
                let rename = &*node.cast::<pg_sys::RenameStmt>();
                if rename.renameType != pg_sys::ObjectType::OBJECT_DATABASE {
                    return None;
                }
                rename.subname
            }
            pg_sys::NodeTag::T_CreatedbStmt => {
                option_value((*node.cast::<pg_sys::CreatedbStmt>()).options, c"template")?
            }
            pg_sys::NodeTag::T_AlterDatabaseStmt => {
                let alter = &*node.cast::<pg_sys::AlterDatabaseStmt>();
                option_value(alter.options, c"tablespace")?;
                alter.dbname
            }
            _ => return None,
        }
    };
    if name.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated name; missing_ok, so an unknown name is InvalidOid, not an ERROR.
    let database = unsafe { pg_sys::get_database_oid(name, true) };
    (database != pg_sys::Oid::INVALID).then_some(database)
}

/// The value of option `wanted` in a list of `DefElem`s, as text.
///
/// # Safety
/// `options` is a valid List of DefElem nodes (or NIL).
unsafe fn option_value(
    options: *mut pg_sys::List,
    wanted: &CStr,
) -> Option<*const std::ffi::c_char> {
    if options.is_null() {
        return None;
    }
    // SAFETY: an array-based List of `length` cells, each pointing to a DefElem.
    unsafe {
        for index in 0..(*options).length {
            let option =
                (*(*options).elements.add(index as usize)).ptr_value as *mut pg_sys::DefElem;
            if option.is_null() || (*option).defname.is_null() {
                continue;
            }
            if CStr::from_ptr((*option).defname) == wanted && !(*option).arg.is_null() {
                return Some(pg_sys::defGetString(option));
            }
        }
    }
    None
}

/// Whether the current user owns `database` (a superuser owns everything): only then may the
/// command stop anything of ours.
fn owns_database(database: pg_sys::Oid) -> bool {
    // SAFETY: catalog lookups on the backend's main thread, inside its transaction.
    unsafe {
        #[cfg(feature = "pg15")]
        {
            pg_sys::pg_database_ownercheck(database, pg_sys::GetUserId())
        }
        #[cfg(not(feature = "pg15"))]
        {
            pg_sys::object_ownercheck(pg_sys::DatabaseRelationId, database, pg_sys::GetUserId())
        }
    }
}

/// Stops our processes in `database` and waits until they have exited, or `LEAVE_TIMEOUT` passed.
fn leave(database: pg_sys::Oid) {
    let deadline = Instant::now() + LEAVE_TIMEOUT;
    let mut told = Vec::new();
    loop {
        let left: Vec<i32> = shmem::launchers::processes_in(database)
            .into_iter()
            .filter(|pid| shmem::backend_alive(*pid))
            .collect();
        if left.is_empty() || Instant::now() >= deadline {
            return;
        }
        for pid in &left {
            if !told.contains(pid) {
                log!("pg_meili_sync: stopping process {pid} so that the command can have its database to itself");
                told.push(*pid);
            }
            // SAFETY: SIGTERM to one of our own background workers (its handler only sets a
            // flag and its latch), as pg_terminate_backend would send it.
            unsafe { libc::kill(*pid, libc::SIGTERM) };
        }
        // SAFETY: waits on this backend's own latch with a timeout; WL_EXIT_ON_PM_DEATH ends the
        // backend if the postmaster dies.
        unsafe {
            pg_sys::WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                100,
                pg_sys::PG_WAIT_EXTENSION,
            );
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
        pgrx::check_for_interrupts!();
    }
}
