//! What a task may be: the rules that the SQL functions of `api` apply before they create,
//! change or drop a task, one module per concern: its source and key (`source_and_key`), the
//! servers and indexes it writes to (`servers`), and what its state forbids meanwhile
//! (`states`). Like the workers, these modules are called by `api` and never call it, so that a
//! rule has one home whichever function applies it.

pub mod servers;
pub mod source_and_key;
pub mod states;
