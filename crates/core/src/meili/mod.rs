//! Talking to Meilisearch: the HTTP client, the retry policy, the writer
//! threads that send batches and confirm their tasks, and the request bodies
//! of sharded tasks. Nothing here calls Postgres, so all of it may run off the
//! main thread.

pub mod client;
pub mod network;
pub mod request;
pub mod retry;
pub mod search;
pub mod waiting_tcp;
pub mod writer;
