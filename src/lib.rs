//! pg_meili_sync: keeps Meilisearch indexes in step with PostgreSQL tables.
//!
//! Wiring only: modules, SQL files in order, and `_PG_init`.

use std::sync::atomic::{AtomicBool, Ordering};

use pgrx::prelude::*;

mod api;
mod batch;
mod catalog;
mod changes;
mod decode;
mod dispatch;
mod encode;
mod error;
mod gucs;
mod meili;
mod meter;
mod options;
mod plan;
mod security;
mod shmem;
#[cfg(test)]
mod test_support;
mod verify;
mod worker;

/// The pure (pgrx-free) stages of the streaming pipeline, for the micro benchmarks
/// (`benches/micro.rs`), which link this crate as an ordinary Rust library: the linker keeps only
/// what they reach, so the Postgres symbols the rest of the crate needs (resolved by the server
/// when it loads the extension) are never asked for. Re-exports rather than `pub mod`, so the
/// compiler still reports dead code in the rest of these modules. Not an API.
#[doc(hidden)]
pub mod bench {
    pub use crate::batch::{Batch, BatchLimits, Batcher, Operation};
    pub use crate::changes::{ChangeMapper, RelationShape};
    pub use crate::decode::pgoutput::{parse, Message, Relation};
    pub use crate::encode::{
        encode_document, write_value, Column, ColumnValue, DocumentShape, ValueKind,
    };
    pub use crate::meili::writer::gzip;
}

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
    gucs::init();
    // SAFETY: reading a postmaster-set global during library load.
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        return;
    }
    PRELOADED.store(true, Ordering::Relaxed);
    shmem::init();
    worker::launcher::register();
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
