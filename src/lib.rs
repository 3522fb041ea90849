//! pg_meili_sync: keeps Meilisearch indexes in step with PostgreSQL tables.
//!
//! Wiring only: modules, SQL files in order, and `_PG_init`.

use std::sync::atomic::{AtomicBool, Ordering};

use pgrx::prelude::*;

mod api;
mod catalog;
mod ddl_guard;
mod decode;
mod error;
mod gucs;
mod plan;
mod resync_request;
mod rules;
mod search;
mod security;
mod shmem;
mod verify;
mod worker;

::pgrx::pg_module_magic!(name, version);

extension_sql_file!("../sql/bootstrap.sql", bootstrap);
extension_sql_file!("../sql/views.sql", finalize);

static PRELOADED: AtomicBool = AtomicBool::new(false);

/// Whether the library came in through shared_preload_libraries (and so has shared memory and a launcher).
pub fn preloaded() -> bool {
    PRELOADED.load(Ordering::Relaxed)
}

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // pgrx captures a Rust backtrace for every error that crosses our frames and shows it in the
    // ERROR's DETAIL whenever RUST_BACKTRACE is set in the server's environment: not what a user
    // should read. RUST_LIB_BACKTRACE=1 in that environment still turns them on for debugging.
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        // Still single-threaded: the postmaster loading its preloaded libraries, or a backend
        // loading this one (threads start only later, in workers).
        std::env::set_var("RUST_LIB_BACKTRACE", "0");
    }
    gucs::init();
    // SAFETY: reading a postmaster-set global during library load.
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        return;
    }
    PRELOADED.store(true, Ordering::Relaxed);
    shmem::init();
    ddl_guard::install();
    worker::cluster::register();
}

#[cfg(any(test, feature = "pg_test"))]
mod sql_tests;

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![
            "shared_preload_libraries = 'pg_meili_sync'",
            "wal_level = logical",
            "meili_sync.database = 'pgrx_tests'",
        ]
    }
}
