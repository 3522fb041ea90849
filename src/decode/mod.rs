//! Logical decoding in the worker's process: the decoding session, which holds all of the
//! decoding FFI. The pgoutput parser it feeds is pure and lives in the core crate.

pub mod session;
