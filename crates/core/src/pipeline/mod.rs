//! From operations to confirmed checkpoints: operations → batches → Meilisearch requests (sent by
//! `meili`) → confirmations → the watermark the slot is confirmed to, with the remedies for the
//! batches Meilisearch refuses or fails, and the measures and naps of the worker that drives it.
//!
//! - `batch`: groups operations into request bodies; the watermark of confirmed checkpoints.
//! - `dispatch`: hands batches to the writer in order, follows confirmations, repairs failures.
//! - `dead_letter`: the dead letter of a row that is never sent.
//! - `due`: a WAL position that work on the index waits for before the slot is confirmed past it.
//! - `meter`: live measures for the status view (lag of unconfirmed commits, documents/second).
//! - `pacing`: how long a worker naps between rounds, and how often it looks at slow things.

pub mod batch;
mod dead_letter;
pub mod dispatch;
pub mod due;
pub mod meter;
pub mod pacing;
