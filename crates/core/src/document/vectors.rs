//! pgvector columns → Meilisearch's `_vectors` field, for embedders the task declares as
//! `userProvided`.
//!
//! The `vectors` option maps embedder names to `vector(n)` or `halfvec(n)` columns. Every such
//! column of a row goes into the one `_vectors` object, as
//! `{"<embedder>": {"embeddings": [...], "regenerate": false}}`, and is not sent as a field of its
//! own; a NULL is `"<embedder>": null` (the document has no embedding for it). pgvector's text
//! output (`[1,2.5,-3e-05]`) is already a JSON array of numbers.

use serde_json::{json, Map, Value};

/// The document field of the embeddings.
pub const VECTORS_FIELD: &str = "_vectors";

/// The dimensions a column's declared type fixes (`format_type` output such as `vector(768)` or
/// `halfvec(384)`); None for a column declared without them.
pub fn declared_dimensions(type_name: &str) -> Option<u32> {
    let (_, modifier) = type_name.split_once('(')?;
    modifier.strip_suffix(')')?.trim().parse().ok()
}

/// Appends one embedder's entry value: the embedding (pgvector's text) marked as not to be
/// regenerated. A text that is not a plain array of numbers is written as a string, which
/// Meilisearch refuses for that document alone (it becomes a dead letter).
pub fn write_embedding(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(b"{\"embeddings\":");
    let plain = text.len() >= 2
        && text.starts_with('[')
        && text.ends_with(']')
        && text[1..text.len() - 1]
            .bytes()
            .all(|byte| byte.is_ascii_digit() || b".,eE+-".contains(&byte));
    if plain {
        out.extend_from_slice(text.as_bytes());
    } else {
        // Writing a String into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, text);
    }
    out.extend_from_slice(b",\"regenerate\":false}");
}

/// An embedder of the index that cannot take the task's embeddings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbedderMismatch {
    pub name: String,
    /// The embedder's `source`, if it has a known one.
    pub source: Option<String>,
    pub dimensions: Option<u64>,
    /// The dimensions of the task's embeddings.
    pub wanted: u32,
}

impl std::fmt::Display for EmbedderMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "embedder \"{}\" of the index is {} with {} dimensions, but the task sends user-provided embeddings of {}",
            self.name,
            self.source.as_deref().unwrap_or("of no known source"),
            self.dimensions.map_or("unknown".to_string(), |n| n.to_string()),
            self.wanted,
        )
    }
}

/// The `embedders` settings the task needs, given the index's current settings and each
/// embedder's dimensions: a patch adding those that are missing (None when none is), or why the
/// index cannot take the task's embeddings (an embedder of that name that is not user-provided,
/// or has other dimensions).
pub fn missing_embedders(
    current: &Value,
    wanted: &[(String, u32)],
) -> Result<Option<Value>, EmbedderMismatch> {
    let existing = current.get("embedders").and_then(Value::as_object);
    let mut patch = Map::new();
    for (name, dimensions) in wanted {
        match existing.and_then(|embedders| embedders.get(name)) {
            None => {
                patch.insert(
                    name.clone(),
                    json!({"source": "userProvided", "dimensions": dimensions}),
                );
            }
            Some(embedder) => {
                let source = embedder.get("source").and_then(Value::as_str);
                let has = embedder.get("dimensions").and_then(Value::as_u64);
                if source != Some("userProvided") || has != Some(u64::from(*dimensions)) {
                    return Err(EmbedderMismatch {
                        name: name.clone(),
                        source: source.map(str::to_owned),
                        dimensions: has,
                        wanted: *dimensions,
                    });
                }
            }
        }
    }
    Ok((!patch.is_empty()).then(|| json!({ "embedders": patch })))
}

/// Whether the `_vectors` Meilisearch returns (`retrieveVectors`) holds the embeddings the task
/// sent: Meilisearch keeps 32-bit floats and returns a list of embeddings per embedder, so the
/// numbers compare within a 32-bit float's precision and one embedding equals a list of one.
pub fn same_vectors(sent: &Value, stored: &Value) -> bool {
    let (Some(sent), Some(stored)) = (sent.as_object(), stored.as_object()) else {
        return sent == stored;
    };
    sent.iter().all(|(embedder, entry)| {
        let stored_entry = stored.get(embedder);
        let embeddings = |entry: Option<&Value>| -> Vec<Vec<f64>> {
            let Some(embeddings) = entry.and_then(|entry| entry.get("embeddings")) else {
                return Vec::new();
            };
            let numbers = |list: &Value| -> Option<Vec<f64>> {
                list.as_array()?.iter().map(Value::as_f64).collect()
            };
            match embeddings.as_array() {
                Some(items) if items.iter().all(Value::is_number) && !items.is_empty() => {
                    numbers(embeddings).into_iter().collect()
                }
                Some(items) => items.iter().filter_map(numbers).collect(),
                None => Vec::new(),
            }
        };
        let (want, have) = (embeddings(Some(entry)), embeddings(stored_entry));
        want.len() == have.len()
            && want.iter().zip(&have).all(|(a, b)| {
                a.len() == b.len()
                    && a.iter()
                        .zip(b)
                        .all(|(a, b)| (a - b).abs() <= 1e-6 * a.abs().max(1e-30) + 1e-30)
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dimensions_come_from_the_declared_type() {
        assert_eq!(declared_dimensions("vector(768)"), Some(768));
        assert_eq!(declared_dimensions("halfvec(3)"), Some(3));
        assert_eq!(declared_dimensions("vector"), None);
    }

    #[test]
    fn an_embedding_is_user_provided_and_not_regenerated() {
        let mut out = Vec::new();
        write_embedding(&mut out, "[1,2.5,-3e-05]");
        assert_eq!(out, br#"{"embeddings":[1,2.5,-3e-05],"regenerate":false}"#);
        let mut odd = Vec::new();
        write_embedding(&mut odd, "{1,2}");
        assert_eq!(odd, br#"{"embeddings":"{1,2}","regenerate":false}"#);
    }

    #[test]
    fn embedders_are_added_or_checked() {
        let wanted = vec![("default".to_owned(), 3)];
        assert_eq!(
            missing_embedders(&json!({"embedders": {}}), &wanted),
            Ok(Some(
                json!({"embedders": {"default": {"source": "userProvided", "dimensions": 3}}})
            ))
        );
        assert_eq!(
            missing_embedders(
                &json!({"embedders": {"default": {"source": "userProvided", "dimensions": 3}}}),
                &wanted
            ),
            Ok(None)
        );
        let other = missing_embedders(
            &json!({"embedders": {"default": {"source": "userProvided", "dimensions": 4}}}),
            &wanted,
        );
        assert!(other.is_err_and(|e| e.to_string().contains("4 dimensions")));
        let openai = missing_embedders(
            &json!({"embedders": {"default": {"source": "openAi", "dimensions": 3}}}),
            &wanted,
        );
        assert!(openai.is_err_and(|e| e.to_string().contains("openAi")));
    }

    #[test]
    fn stored_vectors_compare_within_float_precision() {
        let sent = json!({"default": {"embeddings": [0.1, 2.0, -3.5], "regenerate": false}});
        let stored = json!({"default": {"embeddings": [[0.10000000149011612, 2.0, -3.5]], "regenerate": false}});
        assert!(same_vectors(&sent, &stored));
        let moved = json!({"default": {"embeddings": [[0.2, 2.0, -3.5]], "regenerate": false}});
        assert!(!same_vectors(&sent, &moved));
        let none = json!({"default": null});
        assert!(same_vectors(
            &none,
            &json!({"default": {"embeddings": [], "regenerate": false}})
        ));
        assert!(!same_vectors(&none, &stored));
    }
}
