//! Meilisearch error objects: `{message, code, type, link}` plus the HTTP status.

use crate::json::Obj;

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ApiError {
    pub(crate) status: u16,
    pub(crate) code: String,
    pub(crate) kind: &'static str,
    pub(crate) message: String,
}

impl ApiError {
    pub(crate) fn new(code: &str, message: impl Into<String>) -> Self {
        let (status, kind) = code_info(code);
        ApiError {
            status,
            code: code.to_string(),
            kind,
            message: message.into(),
        }
    }

    /// Same error with a fixed status (for injected faults whose code is not a real one).
    pub(crate) fn with_status(mut self, status: u16) -> Self {
        self.status = status;
        self
    }

    pub(crate) fn prefixed(mut self, prefix: &str) -> Self {
        self.message = format!("{prefix}{}", self.message);
        self
    }

    pub(crate) fn to_json(&self) -> String {
        Obj::new()
            .str("message", &self.message)
            .str("code", &self.code)
            .str("type", self.kind)
            .str(
                "link",
                &format!("https://docs.meilisearch.com/errors#{}", self.code),
            )
            .end()
    }

    pub(crate) fn index_not_found(uid: &str) -> Self {
        Self::new("index_not_found", format!("Index `{uid}` not found."))
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self::new("internal", message)
    }
}

/// HTTP status and error type of a Meilisearch error code.
pub(crate) fn code_info(code: &str) -> (u16, &'static str) {
    match code {
        "internal"
        | "database_size_limit_reached"
        | "index_creation_failed"
        | "invalid_state"
        | "invalid_store_file"
        | "dump_process_failed" => (500, "internal"),
        "missing_authorization_header" | "missing_master_key" => (401, "auth"),
        "invalid_api_key" => (403, "auth"),
        "index_not_found" | "task_not_found" | "batch_not_found" | "document_not_found"
        | "api_key_not_found" => (404, "invalid_request"),
        "index_already_exists" | "api_key_already_exists" => (409, "invalid_request"),
        "payload_too_large" => (413, "invalid_request"),
        "invalid_content_type" | "missing_content_type" | "unsupported_media_type" => {
            (415, "invalid_request")
        }
        "io_error" | "no_space_left_on_device" | "too_many_open_files" => (422, "system"),
        "too_many_search_requests" => (503, "system"),
        _ => (400, "invalid_request"),
    }
}
