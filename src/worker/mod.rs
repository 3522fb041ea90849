//! The kinds of background worker: one launcher, one worker per task that copies or streams from
//! a slot of its own, and one shared decoder for the tasks that share the database's decoding.

pub mod control;
pub mod drive;
pub mod handover;
pub mod launcher;
pub mod render;
pub mod resync;
pub mod shared;
pub mod snapshot;
pub mod stream;
pub mod task;
