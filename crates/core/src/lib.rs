//! The pure stages of pg_meili_sync: everything between a pgoutput message and a confirmed
//! Meilisearch task that needs no Postgres. No pgrx here, by construction: these modules may run
//! on any thread, and their tests run under plain `cargo test`. The extension crate
//! (`pg_meili_sync`) owns the SQL API, the catalog, shared memory, decoding and the workers, and
//! maps these modules' errors to SQLSTATEs.
//!
//! The folders follow a change through the pipeline:
//!
//! 1. [`wal`]: slot bytes → pgoutput messages → each task's stream → operations (a table task) or
//!    affected document keys (a view task).
//! 2. [`document`]: rows → JSON documents, ids, geo and vector fields, the shard of each id.
//! 3. [`pipeline`]: operations → batches → requests → confirmations → the checkpoint watermark,
//!    and the remedies for batches Meilisearch refuses.
//! 4. [`meili`]: the HTTP client, the writer threads that send batches and confirm their tasks,
//!    searches and the network of sharded indexes.
//!
//! Beside them, [`task`]: a task's options, the catalog facts that decide what it may do, and its
//! permanent failures.

pub mod document;
pub mod meili;
pub mod pipeline;
pub mod task;
#[cfg(test)]
mod test_support;
pub mod wal;
