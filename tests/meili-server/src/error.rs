//! Meilisearch error objects: `{message, code, type, link}` plus the HTTP status.

use crate::json::Obj;

/// The message of the `std::io::Error` Meilisearch reports when its disk is full.
pub(crate) const NO_SPACE: &str = "No space left on device (os error 28)";

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
        "remote_bad_response"
        | "remote_could_not_send_request"
        | "remote_remote_error"
        | "remote_timeout" => (502, "system"),
        "remote_invalid_api_key" => (403, "auth"),
        "requires_enterprise_edition" => (451, "invalid_request"),
        _ => (400, "invalid_request"),
    }
}

/// deserr's suggestion for an unknown field or parameter: `did you mean `x`? ` (with the space)
/// for the closest accepted name within a few edits, the more the longer the name; none for
/// names of 3 bytes or less.
pub(crate) fn did_you_mean(received: &str, accepted: &[&str]) -> String {
    let allowed = match received.len() {
        0..=3 => return String::new(),
        4..=7 => 1,
        8..=12 => 2,
        13..=17 => 3,
        18..=24 => 4,
        _ => 5,
    };
    accepted
        .iter()
        .map(|a| (a, edit_distance(received, a)))
        .filter(|(_, d)| *d <= allowed)
        .min_by_key(|(_, d)| *d)
        .map_or(String::new(), |(a, _)| format!("did you mean `{a}`? "))
}

/// Edits (insertions, deletions, substitutions, swaps of neighbours) from `a` to `b`.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d: Vec<Vec<usize>> = (0..=a.len())
        .map(|i| (0..=b.len()).map(|j| if i == 0 { j } else { i }).collect())
        .collect();
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::did_you_mean;

    #[test]
    fn suggestions() {
        let known = ["limit", "from", "reverse", "statuses"];
        // Observed on Meilisearch 1.50 with `GET /tasks?NAME=1`.
        for (name, hint) in [
            ("limt", "did you mean `limit`? "),
            ("Limit", "did you mean `limit`? "),
            ("limitt", "did you mean `limit`? "),
            ("froms", "did you mean `from`? "),
            ("reverses", "did you mean `reverse`? "),
            ("statuse", "did you mean `statuses`? "),
            ("lim", ""),
            ("abcd", ""),
        ] {
            assert_eq!(did_you_mean(name, &known), hint, "{name}");
        }
    }
}
