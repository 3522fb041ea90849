//! Logical decoding: the in-process decoding session (all of its FFI) and the pgoutput parser (pure).

pub mod pgoutput;
pub mod session;
