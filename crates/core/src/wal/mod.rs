//! Reading the WAL: the bytes of the shared slot → each task's own stream of pgoutput messages →
//! what its committed changes mean for the index: document operations for a table task, the keys
//! of the documents to render again for a view task.
//!
//! - `pgoutput`: parses one pgoutput message (protocol version 1).
//! - `route`: splits the one decoded stream into a stream per task, each framed as its own slot.
//! - `state_change`: the logical message where a task's pause, stop, alter or drop committed.
//! - `changes`: a table task's committed changes → Meilisearch operations, in commit order.
//! - `affected`: a view task's committed changes → the keys of the documents they affect.

pub mod affected;
pub mod changes;
pub mod pgoutput;
pub mod route;
pub mod state_change;
