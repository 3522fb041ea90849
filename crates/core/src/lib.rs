//! The pure stages of pg_meili_sync: everything between a pgoutput message and a confirmed
//! Meilisearch task that needs no Postgres. No pgrx here, by construction: these modules may run
//! on any thread, and their tests run under plain `cargo test`. The extension crate
//! (`pg_meili_sync`) owns the SQL API, the catalog, shared memory, decoding and the workers, and
//! maps these modules' errors to SQLSTATEs.

pub mod affected;
pub mod batch;
pub mod changes;
mod dead_letter;
pub mod dispatch;
pub mod due;
pub mod encode;
pub mod failure;
pub mod function_body;
pub mod geo;
pub mod meili;
pub mod meter;
pub mod options;
pub mod pacing;
pub mod pg_catalog;
pub mod pgoutput;
pub mod route;
pub mod shard;
pub mod state_change;
#[cfg(test)]
mod test_support;
pub mod vectors;
