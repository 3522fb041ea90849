//! The dead letter of a row that is never sent: no valid document id, a `_geo` Meilisearch would
//! refuse (both found by [`crate::document::encode::encode_row`]), or a change the mapper could not follow.
//! [`DeadLetter::unsent_row`] is the one constructor the copy, the stream and view renders use.
//! The type, and the dead letters of documents Meilisearch refused, are the dispatcher's.

use serde_json::Value;

use crate::meili::request::Operation;
use crate::pipeline::dispatch::{item_id, DeadLetter};

impl DeadLetter {
    /// `document` as far as it was encoded (empty when the row has no id; the dead letter's id is
    /// then null, else read from the document), the Meilisearch error code the row would have
    /// met, and why.
    pub fn unsent_row(
        document: Vec<u8>,
        code: &str,
        message: String,
        primary_key: &str,
    ) -> DeadLetter {
        DeadLetter {
            id: item_id(Operation::Replace, &document, primary_key).unwrap_or(Value::Null),
            op: Operation::Replace,
            document,
            code: code.to_owned(),
            message,
            task_uid: None,
            checkpoint: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::document::encode::{encode_row, Column, ColumnValue, DocumentShape, ValueKind};

    fn shape() -> DocumentShape {
        let columns =
            [("id", ValueKind::Integer), ("_geo", ValueKind::Json)].map(|(name, kind)| Column {
                name: name.into(),
                kind,
            });
        DocumentShape::new(columns.to_vec(), vec![0]).expect("shape")
    }

    /// The dead letter a row gets, as the copy and the renders make it.
    fn dead_letter_of(values: &[ColumnValue]) -> DeadLetter {
        let mut document = Vec::new();
        let error = encode_row(&shape(), values, &mut document).expect_err("a dead letter");
        DeadLetter::unsent_row(document, error.code(), error.to_string(), "id")
    }

    #[test]
    fn a_bad_geo_keeps_the_document_and_its_id() {
        let dead = dead_letter_of(&[ColumnValue::Text("7"), ColumnValue::Text(r#""x""#)]);
        assert_eq!(dead.id, json!("7"));
        assert_eq!(dead.op, Operation::Replace);
        assert_eq!(dead.document, br#"{"id":7,"_geo":"x"}"#);
        assert_eq!(dead.code, "invalid_document_geo_field");
        assert!(dead.message.starts_with("invalid _geo field: "), "{dead:?}");
        assert_eq!((dead.task_uid, dead.checkpoint), (None, None));
    }

    #[test]
    fn a_row_without_an_id_has_a_null_id_and_no_document() {
        let dead = dead_letter_of(&[ColumnValue::Null, ColumnValue::Text(r#""x""#)]);
        assert_eq!(dead.id, Value::Null);
        assert!(dead.document.is_empty());
        assert_eq!(dead.code, "missing_document_id");
        assert_eq!(
            dead.message,
            "key column \"id\" is NULL, so the row has no document id"
        );
    }

    #[test]
    fn a_change_the_mapper_skipped_keeps_its_code_and_reason() {
        let dead = DeadLetter::unsent_row(Vec::new(), "invalid_change", "why".into(), "id");
        assert_eq!(
            (dead.id, dead.code.as_str(), dead.message.as_str()),
            (Value::Null, "invalid_change", "why")
        );
    }
}
