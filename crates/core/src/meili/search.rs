//! Searching from SQL: the request body from a query and options, and an answer's hits and facet
//! distribution as rows. (A backend makes the request itself, through
//! [`waiting_tcp`](super::waiting_tcp).)

use serde_json::{Map, Value};

/// The search body: Meilisearch's own parameters from `options` (a JSON object, passed as is),
/// with `q` from `query` unless the options set it.
pub fn search_body(query: Option<&str>, options: &Value) -> Result<Value, String> {
    let mut body = match options {
        Value::Object(object) => object.clone(),
        Value::Null => Map::new(),
        other => {
            return Err(format!(
                "search options must be a JSON object of Meilisearch search parameters, not {other}"
            ))
        }
    };
    if let Some(query) = query {
        body.entry("q").or_insert_with(|| Value::from(query));
    }
    Ok(Value::Object(body))
}

/// One hit as a row: the document id (as text: the number of an integer id), the ranking score
/// when Meilisearch sent one, the document without the fields Meilisearch adds, and the
/// highlighted (`_formatted`) document when asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct Hit {
    pub id: Option<String>,
    pub score: Option<f64>,
    pub document: Value,
    pub formatted: Option<Value>,
}

/// The hits of a search answer; `primary_key` is the index's key attribute.
pub fn hits(answer: &Value, primary_key: &str) -> Result<Vec<Hit>, String> {
    let Some(hits) = answer.get("hits").and_then(Value::as_array) else {
        return Err("the search answer has no \"hits\" array".to_owned());
    };
    Ok(hits
        .iter()
        .map(|hit| {
            let mut document = hit.as_object().cloned().unwrap_or_default();
            let score = document.remove("_rankingScore").and_then(|v| v.as_f64());
            let formatted = document.remove("_formatted");
            document.remove("_rankingScoreDetails");
            document.remove("_matchesPosition");
            let id = document.get(primary_key).and_then(|id| match id {
                Value::String(text) => Some(text.clone()),
                Value::Number(number) => Some(number.to_string()),
                _ => None,
            });
            Hit {
                id,
                score,
                document: Value::Object(document),
                formatted,
            }
        })
        .collect())
}

/// A search answer's `facetDistribution` as (facet, value, count) rows, in the answer's order.
pub fn facet_counts(answer: &Value) -> Vec<(String, String, i64)> {
    let mut rows = Vec::new();
    let Some(distribution) = answer.get("facetDistribution").and_then(Value::as_object) else {
        return rows;
    };
    for (facet, values) in distribution {
        let Some(values) = values.as_object() else {
            continue;
        };
        for (value, count) in values {
            rows.push((facet.clone(), value.clone(), count.as_i64().unwrap_or(0)));
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_body_is_the_options_with_the_query() {
        let body =
            search_body(Some("kettle"), &json!({"limit": 3, "filter": "price > 10"})).unwrap();
        assert_eq!(
            body,
            json!({"q": "kettle", "limit": 3, "filter": "price > 10"})
        );
        let body = search_body(Some("kettle"), &json!({"q": "own"})).unwrap();
        assert_eq!(body, json!({"q": "own"}), "the options' q wins");
        assert_eq!(search_body(None, &Value::Null).unwrap(), json!({}));
        assert!(search_body(Some("x"), &json!([1]))
            .unwrap_err()
            .contains("JSON object"));
    }

    #[test]
    fn hits_become_rows_without_meilisearch_fields() {
        let answer = json!({"hits": [
            {"id": 7, "name": "kettle", "_rankingScore": 0.9, "_formatted": {"id": "7", "name": "<em>kettle</em>"}},
            {"id": "a_20b", "name": "pot"},
            {"name": "no id"}
        ]});
        let rows = hits(&answer, "id").unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].id.as_deref(), Some("7"));
        assert_eq!(rows[0].score, Some(0.9));
        assert_eq!(rows[0].document, json!({"id": 7, "name": "kettle"}));
        assert_eq!(
            rows[0].formatted,
            Some(json!({"id": "7", "name": "<em>kettle</em>"}))
        );
        assert_eq!(rows[1].id.as_deref(), Some("a_20b"));
        assert_eq!(rows[1].score, None);
        assert_eq!(rows[2].id, None);
        assert!(hits(&json!({"message": "x"}), "id").is_err());
    }

    #[test]
    fn facet_distribution_becomes_rows() {
        let answer = json!({"facetDistribution": {"category": {"garden": 3, "kitchen": 5}, "color": {"red": 1}}});
        let rows = facet_counts(&answer);
        assert_eq!(
            rows,
            vec![
                ("category".to_owned(), "garden".to_owned(), 3),
                ("category".to_owned(), "kitchen".to_owned(), 5),
                ("color".to_owned(), "red".to_owned(), 1),
            ]
        );
        assert!(facet_counts(&json!({})).is_empty());
    }
}
