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
//!
//! Every switch goes through the one `run_as`, which also opens a GUC nest level
//! (`NewGUCNestLevel`), restricts `search_path` inside it, and rolls it back
//! (`AtEOXact_GUC(false, …)`) when it drops, as REFRESH MATERIALIZED VIEW does: nothing user code
//! sets, `set_config(…, false)` included, survives the switch. No caller may span a commit inside
//! it. `pin_worker_settings` pins `search_path` to `pg_catalog, pg_temp` and `jit = off`
//! (`PGC_S_OVERRIDE`) right after a worker connects.

use std::ffi::CString;

use pgrx::pg_sys;

/// What workers and the SQL functions search: the system catalog first and temporary objects
/// last, so that no user schema can shadow an operator or function our SQL names (what
/// PostgreSQL's own apply workers do since CVE-2020-14349).
pub const SAFE_SEARCH_PATH: &str = "pg_catalog, pg_temp";

/// Pins the settings our workers' own queries depend on for the rest of this process, over
/// anything `ALTER DATABASE`, `ALTER ROLE` or `postgresql.conf` set: `search_path` (see
/// [`SAFE_SEARCH_PATH`]), and `jit = off`, since the catalog queries a launcher runs every round
/// are cheap but estimated dear on small unanalyzed tables, and compiling them would cost more
/// CPU than running them. Called by workers right after connecting.
pub fn pin_worker_settings() {
    for (name, value) in [("search_path", SAFE_SEARCH_PATH), ("jit", "off")] {
        set_setting(
            name,
            value,
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_OVERRIDE,
            pg_sys::GucAction::GUC_ACTION_SET,
        );
    }
}

/// Sets setting `name` to `value` at `source` with `action`.
fn set_setting(
    name: &str,
    value: &str,
    context: pg_sys::GucContext::Type,
    source: pg_sys::GucSource::Type,
    action: pg_sys::GucAction::Type,
) {
    let (Ok(name), Ok(value)) = (CString::new(name), CString::new(value)) else {
        return;
    };
    // SAFETY: main thread, inside a transaction or a worker's setup; set_config_option copies
    // both strings, and raises an ERROR only on a bad value, which our constants are not.
    unsafe {
        pg_sys::set_config_option(
            name.as_ptr(),
            value.as_ptr(),
            context,
            source,
            action,
            true,
            0,
            false,
        );
    }
}

/// The role the current statement runs as (`current_user`).
pub fn current_role() -> pg_sys::Oid {
    // SAFETY: reads the backend's current user id.
    unsafe { pg_sys::GetUserId() }
}

/// Undoes an identity switch when dropped, also while an ERROR unwinds: first every setting
/// changed since the switch (at any source, `set_config(…, false)` included), then the identity.
/// The transaction's abort would do both too; this keeps a caught error, or a normal return,
/// from running on with what the other role's code set.
struct RestoreIdentity {
    user: pg_sys::Oid,
    context: i32,
    guc_nest_level: i32,
}

impl Drop for RestoreIdentity {
    fn drop(&mut self) {
        // SAFETY: `guc_nest_level` is the level `NewGUCNestLevel` opened in `run_as`, in this
        // transaction (no caller spans a commit with the switch); rolling it back (false) restores
        // the values saved at it and above, as REFRESH MATERIALIZED VIEW does. Then the user id
        // and security context saved just before the switch go back.
        unsafe {
            pg_sys::AtEOXact_GUC(false, self.guc_nest_level);
            pg_sys::SetUserIdAndSecContext(self.user, self.context);
        }
    }
}

/// Switches to `role` for `work`, as PostgreSQL's own VACUUM, ANALYZE, CREATE INDEX and REFRESH
/// MATERIALIZED VIEW do: the identity and security context change, a new GUC nest level opens so
/// that nothing the other role's code sets survives the switch back, and `search_path` is
/// restricted to [`SAFE_SEARCH_PATH`] inside it (`RestrictSearchPath` of PostgreSQL 17).
fn run_as<T>(role: pg_sys::Oid, restricted: bool, work: impl FnOnce() -> T) -> T {
    let mut user = pg_sys::InvalidOid;
    let mut context = 0;
    // SAFETY: reads the current user id and security context into the two locals.
    unsafe { pg_sys::GetUserIdAndSecContext(&mut user, &mut context) };
    let mut flags = context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32;
    if restricted {
        flags |= pg_sys::SECURITY_RESTRICTED_OPERATION as i32;
    }
    // SAFETY: a local identity change and a new GUC nest level, both undone by `_restore` on
    // every way out of this function; `role` is a role OID read from the catalog in this
    // transaction.
    let _restore = unsafe {
        pg_sys::SetUserIdAndSecContext(role, flags);
        RestoreIdentity {
            user,
            context,
            guc_nest_level: pg_sys::NewGUCNestLevel(),
        }
    };
    restrict_search_path();
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

/// Sets `search_path` to [`SAFE_SEARCH_PATH`] at the current GUC nest level, saved so that the
/// level's roll-back restores the value before it: PGC_S_SESSION outranks every other source, as
/// in PostgreSQL 17's `RestrictSearchPath`.
fn restrict_search_path() {
    set_setting(
        "search_path",
        SAFE_SEARCH_PATH,
        pg_sys::GucContext::PGC_USERSET,
        pg_sys::GucSource::PGC_S_SESSION,
        pg_sys::GucAction::GUC_ACTION_SAVE,
    );
}
