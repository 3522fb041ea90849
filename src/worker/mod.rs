//! The kinds of background worker: one cluster launcher, one launcher per database with tasks,
//! one worker per task that copies or streams from a slot of its own, and one shared decoder per
//! database for the tasks that share its decoding.

pub mod cluster;
pub mod columns_added;
pub mod control;
pub mod drive;
pub mod handover;
pub mod launcher;
pub mod partitions;
pub mod rebalance;
pub mod render;
pub mod resync;
pub mod shared;
pub mod snapshot;
pub mod stream;
pub mod task;
