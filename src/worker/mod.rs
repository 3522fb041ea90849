//! The two kinds of background worker: one launcher, and one worker per active task.

pub mod control;
pub mod launcher;
pub mod resync;
pub mod snapshot;
pub mod stream;
pub mod task;
