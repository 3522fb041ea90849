//! Who our code runs as. Workers connect as the bootstrap superuser inside the user's database,
//! and the SQL functions run as their caller: both pin `search_path`, and both switch identity
//! around work that can reach code somebody else controls.
//!
//! - Work on a user's table (reads, casts, locks: anything that can call a domain's CHECK
//!   function, a policy or an operator) runs as the table's owner under
//!   `SECURITY_RESTRICTED_OPERATION`, as VACUUM, ANALYZE and REFRESH MATERIALIZED VIEW do.
//! - Writes to the extension's catalog run as the catalog's owner: `meili_sync_admin` may read
//!   the catalog but not write it, so a task can only come from a function that checked the
//!   caller's privileges.

use std::ffi::CString;

use pgrx::pg_sys;

/// What workers and the SQL functions search: the system catalog first and temporary objects
/// last, so that no user schema can shadow an operator or function our SQL names (what
/// PostgreSQL's own apply workers do since CVE-2020-14349).
pub const SAFE_SEARCH_PATH: &str = "pg_catalog, pg_temp";

/// Pins `search_path` for the rest of this process, over anything `ALTER DATABASE` or
/// `ALTER ROLE` set. Called by workers right after connecting.
pub fn pin_search_path() {
    let (Ok(name), Ok(value)) = (CString::new("search_path"), CString::new(SAFE_SEARCH_PATH))
    else {
        return;
    };
    // SAFETY: called from a worker's main thread; SetConfigOption copies both strings, and
    // PGC_S_OVERRIDE outranks every configuration source (it raises an ERROR on a bad value,
    // which this constant is not).
    unsafe {
        pg_sys::SetConfigOption(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_OVERRIDE,
        );
    }
}

/// The role the current statement runs as (`current_user`).
pub fn current_role() -> pg_sys::Oid {
    // SAFETY: reads the backend's current user id.
    unsafe { pg_sys::GetUserId() }
}

/// Restores the saved identity when dropped, also while an ERROR unwinds (the transaction's
/// abort would restore it too; this keeps a caught error from running on as someone else).
struct RestoreIdentity {
    user: pg_sys::Oid,
    context: i32,
}

impl Drop for RestoreIdentity {
    fn drop(&mut self) {
        // SAFETY: puts back the user id and security context saved just before the switch.
        unsafe { pg_sys::SetUserIdAndSecContext(self.user, self.context) };
    }
}

fn run_as<T>(role: pg_sys::Oid, restricted: bool, work: impl FnOnce() -> T) -> T {
    let mut user = pg_sys::InvalidOid;
    let mut context = 0;
    // SAFETY: reads the current user id and security context into the two locals.
    unsafe { pg_sys::GetUserIdAndSecContext(&mut user, &mut context) };
    let mut flags = context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32;
    if restricted {
        flags |= pg_sys::SECURITY_RESTRICTED_OPERATION as i32;
    }
    let _restore = RestoreIdentity { user, context };
    // SAFETY: a local identity change, undone by `_restore` on every way out of this function;
    // `role` is a role OID read from the catalog in this transaction.
    unsafe { pg_sys::SetUserIdAndSecContext(role, flags) };
    work()
}

/// Runs `work` with the rights of a user table's owner, under `SECURITY_RESTRICTED_OPERATION`:
/// functions the table's types, domains and policies call run as that owner (never as the
/// superuser a worker is), and cannot change the session (no SET ROLE, no temporary objects).
pub fn as_table_owner<T>(owner: pg_sys::Oid, work: impl FnOnce() -> T) -> T {
    run_as(owner, true, work)
}

/// Runs `work` as the owner of the extension's catalog, for writes the caller may not make
/// itself. The caller's privileges must have been checked before.
pub fn as_catalog_owner<T>(owner: pg_sys::Oid, work: impl FnOnce() -> T) -> T {
    run_as(owner, false, work)
}
