//! Document payloads (JSON, NDJSON, CSV), document ids and primary keys, with the error
//! messages Meilisearch uses for them.

use serde_json::{Map, Value};

use crate::error::ApiError;

pub(crate) type Doc = Map<String, Value>;

/// A document as received: parsed, plus the JSON text to store. Prepared in the connection
/// thread so the task processor only extracts ids and inserts.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub(crate) doc: Doc,
    pub(crate) json: Box<str>,
}

impl Prepared {
    pub(crate) fn new(doc: Doc) -> Self {
        let json = serde_json::to_string(&doc).unwrap_or_default().into();
        Prepared { doc, json }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Format {
    Json,
    Ndjson,
    Csv(u8),
}

impl Format {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::Ndjson => "ndjson",
            Format::Csv(_) => "csv",
        }
    }
}

/// Parses a whole payload; errors are returned exactly as the real server answers them
/// synchronously (before a task is created).
pub(crate) fn parse_payload(body: &[u8], format: Format) -> Result<Vec<Prepared>, ApiError> {
    if body.is_empty() {
        return Err(ApiError::new(
            "missing_payload",
            format!("A {} payload is missing.", format.name()),
        ));
    }
    match format {
        Format::Ndjson => parse_ndjson(body),
        Format::Json => Ok(parse_json(body)?.into_iter().map(Prepared::new).collect()),
        Format::Csv(delimiter) => Ok(parse_csv(body, delimiter)?
            .into_iter()
            .map(Prepared::new)
            .collect()),
    }
}

fn malformed(format: Format, message: String) -> ApiError {
    // Meilisearch shortens very long parser messages (meilisearch#2107).
    let mut message = message;
    if message.len() > 50 + 85 + 3 {
        let end = floor_char_boundary(&message, message.len() - 85);
        let start = floor_char_boundary(&message, 50);
        message.replace_range(start..end, "...");
    }
    ApiError::new(
        "malformed_payload",
        format!(
            "The `{}` payload provided is malformed. `Couldn't serialize document value: {message}`.",
            format.name()
        ),
    )
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// A non-object document: Meilisearch reports serde's message as an internal error (500).
fn not_an_object(v: &Value) -> ApiError {
    let message = match serde_json::from_str::<Doc>(&v.to_string()) {
        Err(e) => e.to_string(),
        Ok(_) => "invalid type, expected a map".to_string(),
    };
    ApiError::internal(message)
}

/// NDJSON documents keep their text as sent (re-serializing is the costliest step of a load).
fn parse_ndjson(body: &[u8]) -> Result<Vec<Prepared>, ApiError> {
    let mut docs = Vec::new();
    let mut stream = serde_json::Deserializer::from_slice(body).into_iter::<Value>();
    let mut start = 0;
    while let Some(item) = stream.next() {
        let end = stream.byte_offset();
        match item {
            Ok(Value::Object(doc)) => {
                let json = String::from_utf8_lossy(&body[start..end]).trim().into();
                docs.push(Prepared { doc, json });
            }
            Ok(other) => return Err(not_an_object(&other)),
            Err(e) => return Err(malformed(Format::Ndjson, e.to_string())),
        }
        start = end;
    }
    Ok(docs)
}

fn parse_json(body: &[u8]) -> Result<Vec<Doc>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(doc)) => Ok(vec![doc]),
        Ok(Value::Array(items)) => items
            .into_iter()
            .map(|item| match item {
                Value::Object(doc) => Ok(doc),
                other => Err(not_an_object(&other)),
            })
            .collect(),
        Ok(_) => Err(malformed(
            Format::Json,
            "data are neither an object nor a list of objects".into(),
        )),
        Err(e) => Err(malformed(Format::Json, e.to_string())),
    }
}

/// CSV with a header line; `name:number` / `name:boolean` columns are typed, empty cells are null.
fn parse_csv(body: &[u8], delimiter: u8) -> Result<Vec<Doc>, ApiError> {
    let text =
        std::str::from_utf8(body).map_err(|e| malformed(Format::Csv(delimiter), e.to_string()))?;
    let mut records = csv_records(text, delimiter as char).into_iter();
    let Some(header) = records.next() else {
        return Ok(Vec::new());
    };
    let columns: Vec<(String, &str)> = header
        .iter()
        .map(|h| match h.rsplit_once(':') {
            Some((name, t @ ("string" | "number" | "boolean"))) => (name.to_string(), t),
            _ => (h.clone(), "string"),
        })
        .collect();
    let mut docs = Vec::new();
    for (line, record) in records.enumerate() {
        let mut doc = Doc::new();
        for (i, (name, kind)) in columns.iter().enumerate() {
            let cell = record.get(i).map(String::as_str).unwrap_or("");
            let trimmed = cell.trim();
            let value = match *kind {
                _ if trimmed.is_empty() => Value::Null,
                "number" => match trimmed.parse::<i64>() {
                    Ok(n) => Value::from(n),
                    Err(_) => trimmed.parse::<f64>().map(Value::from).map_err(|e| {
                        ApiError::new(
                            "malformed_payload",
                            format!(
                                "The `csv` payload provided is malformed: `Error parsing number {cell:?} at line {}: {e}`.",
                                line + 1
                            ),
                        )
                    })?,
                },
                "boolean" => match trimmed {
                    "true" => Value::Bool(true),
                    "false" => Value::Bool(false),
                    _ => {
                        return Err(ApiError::new(
                            "malformed_payload",
                            format!(
                                "The `csv` payload provided is malformed: `Error parsing boolean {cell:?} at line {}: provided string was not `true` or `false``.",
                                line + 1
                            ),
                        ))
                    }
                },
                _ => Value::String(cell.to_string()),
            };
            doc.insert(name.clone(), value);
        }
        docs.push(doc);
    }
    Ok(docs)
}

/// RFC 4180 records: quoted fields may contain delimiters, newlines and doubled quotes.
fn csv_records(text: &str, delimiter: char) -> Vec<Vec<String>> {
    let mut records = Vec::new();
    let (mut record, mut field) = (Vec::new(), String::new());
    let (mut quoted, mut chars) = (false, text.chars().peekable());
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            '"' if quoted => quoted = false,
            '"' if field.is_empty() => quoted = true,
            c if quoted => field.push(c),
            c if c == delimiter => record.push(std::mem::take(&mut field)),
            '\r' => {}
            '\n' => {
                record.push(std::mem::take(&mut field));
                records.push(std::mem::take(&mut record));
            }
            c => field.push(c),
        }
    }
    if !field.is_empty() || !record.is_empty() {
        record.push(field);
        records.push(record);
    }
    records
}

/// The normalized external id of a document id value, if valid: integers (i64 or u64) and
/// strings of `[A-Za-z0-9_-]` up to 511 bytes. A number and the equal string share an id.
pub(crate) fn normalize_id(v: &Value) -> Option<String> {
    match v {
        Value::String(s) if valid_id_str(s) => Some(s.clone()),
        Value::Number(n) if !n.is_f64() => Some(n.to_string()),
        _ => None,
    }
}

/// Meilisearch's check: 1.50 fails a 512-byte id (`invalid_document_id`) and takes 511, as its
/// message says.
pub(crate) fn valid_id_str(s: &str) -> bool {
    !s.is_empty()
        && s.len() < 512
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

pub(crate) fn invalid_id_error(v: &Value) -> ApiError {
    ApiError::new(
        "invalid_document_id",
        format!(
            "Document identifier `{v}` is invalid. A document identifier can be of type integer or string, only composed of alphanumeric characters (a-z A-Z 0-9), hyphens (-) and underscores (_), and can not be more than 511 bytes."
        ),
    )
}

/// Extracts and validates the id of `doc` under primary key `pk` (which may be dotted).
pub(crate) fn document_id(doc: &Doc, pk: &str) -> Result<String, ApiError> {
    let mut found = Vec::new();
    if pk.contains('.') {
        collect_path(doc, pk, &mut found);
    } else {
        found.extend(doc.get(pk));
    }
    let document = || Value::Object(doc.clone()).to_string();
    match found.as_slice() {
        [] => Err(ApiError::new(
            "missing_document_id",
            format!(
                "Document doesn't have a `{pk}` attribute: `{}`.",
                document()
            ),
        )),
        [v] => normalize_id(v).ok_or_else(|| invalid_id_error(v)),
        _ => Err(ApiError::new(
            "invalid_document_id",
            format!(
                "Document have too many matching `{pk}` attribute: `{}`.",
                document()
            ),
        )),
    }
}

/// Values at a dotted path, trying every split so that keys containing dots also match.
fn collect_path<'a>(obj: &'a Doc, path: &str, out: &mut Vec<&'a Value>) {
    for (key, value) in obj {
        if key == path {
            out.push(value);
        } else if let Some(rest) = path
            .strip_prefix(key.as_str())
            .and_then(|r| r.strip_prefix('.'))
        {
            if let Value::Object(inner) = value {
                collect_path(inner, rest, out);
            }
        }
    }
}

/// Meilisearch's check of a document's top-level `_geo` value (milli's `extract_geo_coordinates`):
/// null is fine; otherwise an object with exactly `lat` and `lng`, each a finite number or a
/// string that parses as one. `id` is the document's normalized id. Errors carry the bare milli
/// message; a task reports it prefixed with the index (`Index `uid`: …`).
pub(crate) fn geo_error(id: &str, geo: &Value) -> Option<ApiError> {
    let id = Value::from(id);
    let error = |message: String| Some(ApiError::new("invalid_document_geo_field", message));
    let mut fields = match geo {
        Value::Null => return None,
        Value::Object(fields) => fields.clone(),
        other => {
            return error(format!(
                "The `_geo` field in the document with the id: `{id}` is not an object. Was expecting an object with the `_geo.lat` and `_geo.lng` fields but instead got `{other}`."
            ))
        }
    };
    let (lat, lng) = match (fields.remove("lat"), fields.remove("lng")) {
        (Some(_), Some(_)) if !fields.is_empty() => {
            let extra = Value::Object(fields);
            return error(format!(
                "The `_geo` field in the document with the id: `{id}` contains the following unexpected fields: `{extra}`."
            ));
        }
        (Some(lat), Some(lng)) => (lat, lng),
        (Some(_), None) => {
            return error(format!(
                "Could not find longitude in the document with the id: `{id}`. Was expecting a `_geo.lng` field."
            ))
        }
        (None, Some(_)) => {
            return error(format!(
                "Could not find latitude in the document with the id: `{id}`. Was expecting a `_geo.lat` field."
            ))
        }
        (None, None) => {
            return error(format!(
                "Could not find latitude nor longitude in the document with the id: `{id}`. Was expecting `_geo.lat` and `_geo.lng` fields."
            ))
        }
    };
    match (finite_float(&lat), finite_float(&lng)) {
        (true, true) => None,
        (false, true) => error(format!(
            "Could not parse latitude in the document with the id: `{id}`. Was expecting a finite number but instead got `{lat}`."
        )),
        (true, false) => error(format!(
            "Could not parse longitude in the document with the id: `{id}`. Was expecting a finite number but instead got `{lng}`."
        )),
        (false, false) => error(format!(
            "Could not parse latitude nor longitude in the document with the id: `{id}`. Was expecting finite numbers but instead got `{lat}` and `{lng}`."
        )),
    }
}

/// A finite number, or a string Rust parses as a finite `f64` (so `"1e3"` is fine and
/// `" 1"`, `"inf"` and `"NaN"` are not), as milli's `extract_finite_float_from_value`.
fn finite_float(v: &Value) -> bool {
    let number = match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.parse::<f64>().ok(),
        _ => None,
    };
    number.is_some_and(f64::is_finite)
}

/// Primary key inference: the only top-level field whose lowercased name ends with `id`.
pub(crate) fn guess_primary_key(first: Option<&Doc>) -> Result<String, ApiError> {
    let no_candidate = || {
        ApiError::new(
            "index_primary_key_no_candidate_found",
            "The primary key inference failed as the engine did not find any field ending with `id` in its name. Please specify the primary key manually using the `primaryKey` query parameter.",
        )
    };
    let doc = first.ok_or_else(no_candidate)?;
    let mut candidates: Vec<&String> = doc
        .keys()
        .filter(|k| k.to_lowercase().ends_with("id"))
        .collect();
    candidates.sort();
    match candidates.as_slice() {
        [] => Err(no_candidate()),
        [one] => Ok((*one).clone()),
        [a, b, ..] => Err(ApiError::new(
            "index_primary_key_multiple_candidates_found",
            format!(
                "The primary key inference failed as the engine found {} fields ending with `id` in their names: '{a}' and '{b}'. Please specify the primary key manually using the `primaryKey` query parameter.",
                candidates.len()
            ),
        )),
    }
}

/// The document restricted to `fields` (`*` keeps everything; dotted names keep a nested part).
pub(crate) fn select_fields(doc: &Doc, fields: &[String]) -> Doc {
    if fields.iter().any(|f| f == "*") {
        return doc.clone();
    }
    let mut out = Doc::new();
    for (key, value) in doc {
        if fields.iter().any(|f| f == key) {
            out.insert(key.clone(), value.clone());
            continue;
        }
        let nested: Vec<String> = fields
            .iter()
            .filter_map(|f| {
                f.strip_prefix(key.as_str())
                    .and_then(|r| r.strip_prefix('.'))
            })
            .map(String::from)
            .collect();
        if nested.is_empty() {
            continue;
        }
        let picked = match value {
            Value::Object(inner) => Value::Object(select_fields(inner, &nested)),
            Value::Array(items) => Value::Array(
                items
                    .iter()
                    .filter_map(|i| {
                        i.as_object()
                            .map(|o| Value::Object(select_fields(o, &nested)))
                    })
                    .collect(),
            ),
            _ => continue,
        };
        out.insert(key.clone(), picked);
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn doc(v: Value) -> Doc {
        match v {
            Value::Object(m) => m,
            _ => Doc::new(),
        }
    }

    #[test]
    fn id_rules() {
        assert_eq!(normalize_id(&json!(1)), Some("1".into()));
        assert_eq!(normalize_id(&json!("1")), Some("1".into()));
        assert_eq!(normalize_id(&json!(-5)), Some("-5".into()));
        assert_eq!(normalize_id(&json!(u64::MAX)), Some(u64::MAX.to_string()));
        assert_eq!(
            normalize_id(&json!("abc-DEF_123")),
            Some("abc-DEF_123".into())
        );
        assert_eq!(normalize_id(&json!(1.5)), None);
        assert_eq!(normalize_id(&json!(7.0)), None);
        assert_eq!(normalize_id(&json!("bad id!")), None);
        assert_eq!(normalize_id(&json!("")), None);
        assert_eq!(normalize_id(&json!("a".repeat(511))), Some("a".repeat(511)));
        assert_eq!(normalize_id(&json!("a".repeat(512))), None);
        assert_eq!(normalize_id(&json!(true)), None);
        assert_eq!(normalize_id(&Value::Null), None);
    }

    #[test]
    fn id_above_u64_is_a_float() {
        let v: Value = serde_json::from_str("18446744073709551616").unwrap_or_default();
        let err = document_id(&doc(json!({ "id": v })), "id").unwrap_err();
        assert!(err
            .message
            .starts_with("Document identifier `1.8446744073709552e+19` is invalid."));
        let err = document_id(&doc(json!({"id": "bad id!"})), "id").unwrap_err();
        assert!(err
            .message
            .starts_with("Document identifier `\"bad id!\"` is invalid."));
        assert_eq!(err.code, "invalid_document_id");
    }

    #[test]
    fn missing_and_nested_ids() {
        let err = document_id(&doc(json!({"name": "no id field"})), "id").unwrap_err();
        assert_eq!(err.code, "missing_document_id");
        assert_eq!(
            err.message,
            "Document doesn't have a `id` attribute: `{\"name\":\"no id field\"}`."
        );
        let d = doc(json!({"a": {"b": 5}}));
        assert_eq!(document_id(&d, "a.b").ok(), Some("5".into()));
    }

    #[test]
    fn primary_key_guess() {
        assert_eq!(
            guess_primary_key(Some(&doc(json!({"ID": 1, "x": 2})))).ok(),
            Some("ID".into())
        );
        let err = guess_primary_key(Some(&doc(json!({"x": 1})))).unwrap_err();
        assert_eq!(err.code, "index_primary_key_no_candidate_found");
        let err = guess_primary_key(Some(&doc(json!({"id": 1, "author_id": 2})))).unwrap_err();
        assert!(err
            .message
            .contains("found 2 fields ending with `id` in their names: 'author_id' and 'id'"));
    }

    #[test]
    fn payload_errors() {
        let err = parse_payload(
            b"{\"id\":30}\n{\"id\":31,\"name\": \"broken\"\n{\"id\":32}\n",
            Format::Ndjson,
        )
        .unwrap_err();
        assert_eq!(
            err.message,
            "The `ndjson` payload provided is malformed. `Couldn't serialize document value: expected `,` or `}` at line 3 column 1`."
        );
        let err = parse_payload(b"[{\"id\":33}]\n", Format::Ndjson).unwrap_err();
        assert_eq!((err.status, err.code.as_str()), (500, "internal"));
        assert_eq!(
            err.message,
            "invalid type: sequence, expected a map at line 1 column 0"
        );
        let err = parse_payload(b"", Format::Json).unwrap_err();
        assert_eq!(err.code, "missing_payload");
        let docs = parse_payload(b"{\"id\": 1}", Format::Json).unwrap_or_default();
        assert_eq!(&*docs[0].json, "{\"id\":1}");
        let docs =
            parse_payload(b"{\"b\":1,\"a\":2}\n {\"a\":3}", Format::Ndjson).unwrap_or_default();
        let texts: Vec<&str> = docs.iter().map(|d| &*d.json).collect();
        assert_eq!(texts, ["{\"b\":1,\"a\":2}", "{\"a\":3}"]);
        let err = parse_payload(b"\"x\"", Format::Json).unwrap_err();
        assert_eq!(err.code, "malformed_payload");
    }

    #[test]
    fn geo_rules() {
        let ok = [
            json!(null),
            json!({"lat": 1, "lng": -2}),
            json!({"lat": 48.85, "lng": 2.35}),
            json!({"lng": "2.35", "lat": "48.85"}),
            json!({"lat": "-1e1", "lng": "+0"}),
            json!({"lat": 200, "lng": 500}),
        ];
        for geo in ok {
            assert_eq!(geo_error("1", &geo), None, "{geo}");
        }
        let bad = [
            (json!("abc"), "The `_geo` field in the document with the id: `\"3\"` is not an object. Was expecting an object with the `_geo.lat` and `_geo.lng` fields but instead got `\"abc\"`."),
            (json!([1, 2]), "The `_geo` field in the document with the id: `\"3\"` is not an object. Was expecting an object with the `_geo.lat` and `_geo.lng` fields but instead got `[1,2]`."),
            (json!({}), "Could not find latitude nor longitude in the document with the id: `\"3\"`. Was expecting `_geo.lat` and `_geo.lng` fields."),
            (json!({"lat": 1}), "Could not find longitude in the document with the id: `\"3\"`. Was expecting a `_geo.lng` field."),
            (json!({"lng": 1, "x": 0}), "Could not find latitude in the document with the id: `\"3\"`. Was expecting a `_geo.lat` field."),
            (json!({"lat": "north", "lng": 2}), "Could not parse latitude in the document with the id: `\"3\"`. Was expecting a finite number but instead got `\"north\"`."),
            (json!({"lat": 1, "lng": null}), "Could not parse longitude in the document with the id: `\"3\"`. Was expecting a finite number but instead got `null`."),
            (json!({"lat": "inf", "lng": " 2"}), "Could not parse latitude nor longitude in the document with the id: `\"3\"`. Was expecting finite numbers but instead got `\"inf\"` and `\" 2\"`."),
            (json!({"lat": "x", "lng": 2, "alt": 3}), "The `_geo` field in the document with the id: `\"3\"` contains the following unexpected fields: `{\"alt\":3}`."),
        ];
        for (geo, message) in bad {
            let err = geo_error("3", &geo).unwrap_or_else(|| panic!("{geo} passed"));
            assert_eq!(err.message, message);
            assert_eq!(
                (err.status, err.code.as_str(), err.kind),
                (400, "invalid_document_geo_field", "invalid_request")
            );
        }
        for lat in [
            json!(true),
            json!("NaN"),
            json!("infinity"),
            json!({"v": 1}),
        ] {
            assert!(
                geo_error("3", &json!({"lat": lat, "lng": 0})).is_some(),
                "{lat}"
            );
        }
    }

    #[test]
    fn field_selection() {
        let d = doc(json!({"id": 1, "meta": {"color": "red", "size": "M"}, "name": "x"}));
        let picked = select_fields(&d, &["id".into(), "meta.color".into()]);
        assert_eq!(
            Value::Object(picked),
            json!({"id": 1, "meta": {"color": "red"}})
        );
    }

    #[test]
    fn csv_payload() {
        let docs = parse_payload(
            b"id,name,price:number\n1,\"a, b\",2.5\n2,,\n",
            Format::Csv(b','),
        )
        .unwrap_or_default();
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[0].doc["name"], json!("a, b"));
        assert_eq!(docs[0].doc["price"], json!(2.5));
        assert_eq!(docs[1].doc["name"], Value::Null);
    }
}
