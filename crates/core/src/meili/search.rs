//! Searching from SQL: the request body from a query and options, and an answer's hits and facet
//! distribution as rows. (A backend makes the request itself, through
//! [`waiting_tcp`](super::waiting_tcp).)

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// A search the caller asked for that cannot be sent as asked (the caller's mistake); the text
/// says which parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidSearch(pub String);

impl fmt::Display for InvalidSearch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A search answer that cannot be read (the server's fault, not the caller's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnreadableAnswer(pub String);

impl fmt::Display for UnreadableAnswer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The search body: Meilisearch's own parameters from `options` (a JSON object, passed as is),
/// with `q` from `query` unless the options set it.
pub fn search_body(query: Option<&str>, options: &Value) -> Result<Value, InvalidSearch> {
    let mut body = match options {
        Value::Object(object) => object.clone(),
        Value::Null => Map::new(),
        other => {
            return Err(InvalidSearch(format!(
                "search options must be a JSON object of Meilisearch search parameters, not {other}"
            )))
        }
    };
    if let Some(query) = query {
        body.entry("q").or_insert_with(|| Value::from(query));
    }
    Ok(Value::Object(body))
}

/// Builds one JSON value from the events of its text, as a search answer is read: the hits'
/// documents become the caller's values (`jsonb` in a backend) with no `serde_json::Value` in
/// between. Events come in document order; a container's members come between its begin and end.
pub trait DocumentBuilder {
    type Document;
    fn begin_object(&mut self);
    fn key(&mut self, key: &str);
    fn end_object(&mut self);
    fn begin_array(&mut self);
    fn end_array(&mut self);
    fn null(&mut self);
    fn boolean(&mut self, value: bool);
    fn number(&mut self, value: &Number);
    fn string(&mut self, value: &str);
    /// The value whose events were given.
    fn finish(self) -> Self::Document;
}

/// One hit as a row: the document id (as text: the number of an integer id), the ranking score
/// when Meilisearch sent one, the document without the fields Meilisearch adds, and the
/// highlighted (`_formatted`) document when asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct Hit<D> {
    pub id: Option<String>,
    pub score: Option<f64>,
    pub document: D,
    pub formatted: Option<D>,
    /// In a federated search over remotes: the remote (shard) whose index the hit came from.
    pub remote: Option<String>,
}

/// The fields Meilisearch adds to a hit that are not the document's, beside `_rankingScore`,
/// `_formatted` (which become their own columns) and `_federation` (whose remote is kept).
const ADDED_FIELDS: [&str; 2] = ["_rankingScoreDetails", "_matchesPosition"];

/// The hits of a search answer's text, each document built by a builder from `new_builder`;
/// `primary_key` is the index's key attribute.
pub fn read_hits<B: DocumentBuilder>(
    answer: &[u8],
    primary_key: &str,
    new_builder: impl Fn() -> B,
) -> Result<Vec<Hit<B::Document>>, UnreadableAnswer> {
    let mut reader = serde_json::Deserializer::from_slice(answer);
    let hits = AnswerSeed {
        primary_key,
        new_builder: &new_builder,
    }
    .deserialize(&mut reader)
    .and_then(|hits| reader.end().map(|()| hits))
    .map_err(|error| UnreadableAnswer(format!("the search answer is not valid JSON: {error}")))?;
    hits.ok_or_else(|| UnreadableAnswer("the search answer has no \"hits\" array".to_owned()))
}

/// The answer object: its `hits`, and nothing else kept.
struct AnswerSeed<'a, F> {
    primary_key: &'a str,
    new_builder: &'a F,
}

impl<'de, B: DocumentBuilder, F: Fn() -> B> DeserializeSeed<'de> for AnswerSeed<'_, F> {
    type Value = Option<Vec<Hit<B::Document>>>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de, B: DocumentBuilder, F: Fn() -> B> Visitor<'de> for AnswerSeed<'_, F> {
    type Value = Option<Vec<Hit<B::Document>>>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("a search answer object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut hits = None;
        while let Some(key) = map.next_key_seed(KeySeed)? {
            if key == "hits" {
                hits = Some(map.next_value_seed(HitsSeed {
                    primary_key: self.primary_key,
                    new_builder: self.new_builder,
                })?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(hits)
    }
}

/// The `hits` array.
struct HitsSeed<'a, F> {
    primary_key: &'a str,
    new_builder: &'a F,
}

impl<'de, B: DocumentBuilder, F: Fn() -> B> DeserializeSeed<'de> for HitsSeed<'_, F> {
    type Value = Vec<Hit<B::Document>>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, B: DocumentBuilder, F: Fn() -> B> Visitor<'de> for HitsSeed<'_, F> {
    type Value = Vec<Hit<B::Document>>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("an array of hits")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Self::Value, A::Error> {
        let mut hits = Vec::with_capacity(items.size_hint().unwrap_or(0));
        while let Some(hit) = items.next_element_seed(HitSeed {
            primary_key: self.primary_key,
            new_builder: self.new_builder,
        })? {
            hits.push(hit);
        }
        Ok(hits)
    }
}

/// One hit object: the document's own fields go to its builder, Meilisearch's to their columns.
struct HitSeed<'a, F> {
    primary_key: &'a str,
    new_builder: &'a F,
}

impl<'de, B: DocumentBuilder, F: Fn() -> B> DeserializeSeed<'de> for HitSeed<'_, F> {
    type Value = Hit<B::Document>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de, B: DocumentBuilder, F: Fn() -> B> Visitor<'de> for HitSeed<'_, F> {
    type Value = Hit<B::Document>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("a hit object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut document = (self.new_builder)();
        document.begin_object();
        let (mut id, mut score, mut formatted, mut remote) = (None, None, None, None);
        while let Some(key) = map.next_key_seed(KeySeed)? {
            match &*key {
                "_rankingScore" => score = map.next_value::<Value>()?.as_f64(),
                "_formatted" => {
                    let mut builder = (self.new_builder)();
                    map.next_value_seed(ValueSeed(&mut builder))?;
                    formatted = Some(builder.finish());
                }
                "_federation" => {
                    remote = map
                        .next_value::<Value>()?
                        .get("remote")
                        .and_then(Value::as_str)
                        .map(str::to_owned);
                }
                added if ADDED_FIELDS.contains(&added) => {
                    map.next_value::<IgnoredAny>()?;
                }
                field => {
                    document.key(field);
                    let text = map.next_value_seed(ValueSeed(&mut document))?;
                    if field == self.primary_key {
                        id = text;
                    }
                }
            }
        }
        document.end_object();
        Ok(Hit {
            id,
            score,
            document: document.finish(),
            formatted,
            remote,
        })
    }
}

/// An object key, borrowed from the answer's text when it has no escapes.
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("an object key")
    }

    fn visit_borrowed_str<E: de::Error>(self, key: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(key))
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(key.to_owned()))
    }
}

/// Any JSON value, given to a builder as events. It returns the value's text when it is a string
/// or a number (a document id's), and `None` otherwise.
struct ValueSeed<'b, B>(&'b mut B);

impl<'de, B: DocumentBuilder> DeserializeSeed<'de> for ValueSeed<'_, B> {
    type Value = Option<String>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<B: DocumentBuilder> ValueSeed<'_, B> {
    fn number(self, number: Number) -> Option<String> {
        self.0.number(&number);
        Some(number.to_string())
    }
}

impl<'de, B: DocumentBuilder> Visitor<'de> for ValueSeed<'_, B> {
    type Value = Option<String>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("a JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        self.0.null();
        Ok(None)
    }

    fn visit_bool<E: de::Error>(self, value: bool) -> Result<Self::Value, E> {
        self.0.boolean(value);
        Ok(None)
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Self::Value, E> {
        Ok(self.number(Number::from(value)))
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Self::Value, E> {
        Ok(self.number(Number::from(value)))
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<Self::Value, E> {
        // JSON text has no NaN or infinity, so every number it holds is a Number.
        match Number::from_f64(value) {
            Some(number) => Ok(self.number(number)),
            None => Err(E::custom(format!("{value} is not a JSON number"))),
        }
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Self::Value, E> {
        self.0.string(value);
        Ok(Some(value.to_owned()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Self::Value, A::Error> {
        self.0.begin_array();
        while items.next_element_seed(ValueSeed(&mut *self.0))?.is_some() {}
        self.0.end_array();
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        self.0.begin_object();
        while let Some(key) = map.next_key_seed(KeySeed)? {
            self.0.key(&key);
            map.next_value_seed(ValueSeed(&mut *self.0))?;
        }
        self.0.end_object();
        Ok(None)
    }
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
            .0
            .contains("JSON object"));
    }

    /// Builds a `serde_json::Value` from the events, as the backend builds a `jsonb`.
    #[derive(Default)]
    struct ValueBuilder {
        open: Vec<(Value, Option<String>)>,
        done: Option<Value>,
    }

    impl ValueBuilder {
        fn put(&mut self, value: Value) {
            match self.open.last_mut() {
                Some((Value::Object(members), key)) => {
                    members.insert(key.take().expect("a key before a member"), value);
                }
                Some((Value::Array(items), _)) => items.push(value),
                Some(_) => unreachable!("only containers are open"),
                None => self.done = Some(value),
            }
        }
    }

    impl DocumentBuilder for ValueBuilder {
        type Document = Value;
        fn begin_object(&mut self) {
            self.open.push((json!({}), None));
        }
        fn key(&mut self, key: &str) {
            self.open.last_mut().expect("an open object").1 = Some(key.to_owned());
        }
        fn end_object(&mut self) {
            let (object, _) = self.open.pop().expect("an open object");
            self.put(object);
        }
        fn begin_array(&mut self) {
            self.open.push((json!([]), None));
        }
        fn end_array(&mut self) {
            let (array, _) = self.open.pop().expect("an open array");
            self.put(array);
        }
        fn null(&mut self) {
            self.put(Value::Null);
        }
        fn boolean(&mut self, value: bool) {
            self.put(Value::Bool(value));
        }
        fn number(&mut self, value: &Number) {
            self.put(Value::Number(value.clone()));
        }
        fn string(&mut self, value: &str) {
            self.put(Value::from(value));
        }
        fn finish(self) -> Value {
            assert!(self.open.is_empty(), "every container closed");
            self.done.expect("a value")
        }
    }

    fn read(answer: &Value, primary_key: &str) -> Result<Vec<Hit<Value>>, UnreadableAnswer> {
        read_hits(
            answer.to_string().as_bytes(),
            primary_key,
            ValueBuilder::default,
        )
    }

    #[test]
    fn hits_become_rows_without_meilisearch_fields() {
        let answer = json!({"query": "kettle", "hits": [
            {"id": 7, "name": "kettle", "_rankingScore": 0.9, "_formatted": {"id": "7", "name": "<em>kettle</em>"},
             "_rankingScoreDetails": {"words": {"order": 0}}, "_matchesPosition": {"name": [{"start": 0}]}},
            {"id": "a_20b", "name": "pot", "tags": ["x", {"deep": [1.5, null, true, -3, 18446744073709551615_u64]}]},
            {"name": "no id", "id": null},
            {"sku": 12, "id": "not the key here"}
        ], "processingTimeMs": 1, "estimatedTotalHits": 4});
        let rows = read(&answer, "id").unwrap();
        assert_eq!(rows.len(), 4);
        assert_eq!(rows[0].id.as_deref(), Some("7"));
        assert_eq!(rows[0].score, Some(0.9));
        assert_eq!(rows[0].document, json!({"id": 7, "name": "kettle"}));
        assert_eq!(
            rows[0].formatted,
            Some(json!({"id": "7", "name": "<em>kettle</em>"}))
        );
        assert_eq!(rows[1].id.as_deref(), Some("a_20b"));
        assert_eq!(rows[1].score, None);
        assert_eq!(rows[1].document, answer["hits"][1], "every value, as sent");
        assert_eq!(rows[1].formatted, None);
        assert_eq!(rows[2].id, None, "a null id is no id");
        assert_eq!(rows[2].document, json!({"name": "no id", "id": null}));
        let by_sku = read(&answer, "sku").unwrap();
        assert_eq!(by_sku[3].id.as_deref(), Some("12"));
        assert_eq!(by_sku[0].id, None);
    }

    #[test]
    fn a_federated_hit_keeps_its_remote_out_of_the_document() {
        let answer = json!({"hits": [
            {"id": 3, "name": "pan", "_federation": {"indexUid": "products", "queriesPosition": 1, "remote": "shard-b", "weightedRankingScore": 0.5}},
            {"id": 4, "_federation": {"indexUid": "products", "queriesPosition": 0}},
            {"id": 5}
        ]});
        let rows = read(&answer, "id").unwrap();
        assert_eq!(rows[0].remote.as_deref(), Some("shard-b"));
        assert_eq!(rows[0].document, json!({"id": 3, "name": "pan"}));
        assert_eq!(rows[1].remote, None, "a federated search without remotes");
        assert_eq!(rows[2].remote, None);
    }

    #[test]
    fn an_answer_without_hits_or_not_json_is_refused() {
        let missing = read(&json!({"message": "x"}), "id").unwrap_err();
        assert!(missing.0.contains("no \"hits\" array"), "{missing}");
        let broken =
            read_hits(b"{\"hits\": [{\"id\": 1}", "id", ValueBuilder::default).unwrap_err();
        assert!(broken.0.contains("not valid JSON"), "{broken}");
        let trailing = read_hits(b"{\"hits\": []} x", "id", ValueBuilder::default).unwrap_err();
        assert!(trailing.0.contains("not valid JSON"), "{trailing}");
        assert_eq!(read(&json!({"hits": []}), "id").unwrap(), vec![]);
    }

    #[test]
    fn escaped_keys_and_strings_arrive_unescaped() {
        let text = br#"{"hits": [{"i\u0064": "a\"b", "k\\ey": "\u00e9\ud83d\ude00"}]}"#;
        let rows = read_hits(text, "id", ValueBuilder::default).unwrap();
        assert_eq!(rows[0].id.as_deref(), Some("a\"b"));
        assert_eq!(rows[0].document, json!({"id": "a\"b", "k\\ey": "é😀"}));
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
