//! What one request asks of Meilisearch: an [`Operation`] on a body of items, a [`Batch`]. The
//! pipeline makes batches (`crate::pipeline::batch`) and the writer threads send them
//! (`crate::meili::writer`); the type lives here so that `meili/` never depends on `pipeline/`.

use std::sync::Arc;

/// What a batch asks Meilisearch to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// Add or replace whole documents: `POST /indexes/{uid}/documents`, NDJSON.
    Replace,
    /// Add or update fields of documents: `PUT /indexes/{uid}/documents`, NDJSON.
    Update,
    /// Delete by id: `POST /indexes/{uid}/documents/delete-batch`, a JSON array of ids.
    Delete,
    /// Delete every document: `DELETE /indexes/{uid}/documents`, no body.
    DeleteAll,
}

impl Operation {
    /// How dead letters name the operation.
    pub fn name(self) -> &'static str {
        match self {
            Operation::Replace => "replace",
            Operation::Update => "update",
            Operation::Delete => "delete",
            Operation::DeleteAll => "delete_all",
        }
    }
}

/// One request's worth of items.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// 1 for the first batch of a [`Batcher`], then increasing by 1.
    pub seq: u64,
    pub op: Operation,
    /// NDJSON for `Replace`/`Update`, `[id,…]` for `Delete`, empty for `DeleteAll`. Shared so that
    /// the sender and the dispatcher (which may need to split a failed batch) hold one copy.
    pub body: Arc<Vec<u8>>,
    /// Items in the batch (documents, ids, or merged delete-alls).
    pub docs: usize,
    /// The newest checkpoint that this batch completes, if any.
    pub checkpoint: Option<u64>,
}
