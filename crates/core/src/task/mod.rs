//! What a task is and may do, apart from its pipeline: its options, the catalog facts that decide
//! whether its source can be synced, and why it stops for good.
//!
//! - `options`: task options, parsed from `options jsonb`, validated and stored normalized.
//! - `pg_catalog`: relation kind, replica identity and slot status, the codes that decide them.
//! - `function_body`: what the body of a function a view calls reads (the role, run-time SQL).
//! - `failure`: a task's permanent failures and the advice to its owner.

pub mod failure;
pub mod function_body;
pub mod options;
pub mod pg_catalog;
