//! Postgres values → Meilisearch JSON documents.
//!
//! Every value reaches the encoder as its Postgres *text output*: snapshot
//! rows are selected with each column's text output in a session set to
//! `DateStyle 'ISO, YMD'`, `TimeZone 'UTC'`, `IntervalStyle 'iso_8601'` and
//! `extra_float_digits 1`, and pgoutput (protocol v1) sends the same text
//! for every column. So a row gives byte-identical documents whether it came
//! from the snapshot or from the change stream.
//!
//! # Values
//!
//! | Postgres type | JSON |
//! |---|---|
//! | `int2`, `int4`, `int8`, `oid` | number, the text as is |
//! | `float4`, `float8` | number, the text as is (`1e+300` is valid JSON); `NaN`, `Infinity`, `-Infinity` → `null`, since JSON has no such numbers and Meilisearch rejects them |
//! | `numeric` | number, the text as is, so the JSON keeps every digit (Meilisearch itself reads an `f64`); `NaN`, `±Infinity` → `null`; a value beyond the `f64` range (e.g. `1e400`) → the text as a string, because a JSON parser reading `f64` refuses such a number and Meilisearch would reject the whole batch |
//! | `bool` | `true` / `false` |
//! | `text`, `varchar`, `bpchar`, `name`, enums, `citext`, `uuid`, … | string, escaped per RFC 8259 (`"`, `\`, control characters below U+0020); other characters, U+2028/U+2029 included, are kept as UTF-8 |
//! | `json`, `jsonb` | embedded as is (Postgres' output is valid JSON); raw line breaks, which only `json` keeps and only as whitespace between tokens, become spaces so that a document stays on one NDJSON line |
//! | `date` | `"2024-05-01"` |
//! | `timestamp` | `"2024-05-01T10:00:00"`, fractional seconds kept (`"…T10:00:00.123456"`) |
//! | `timestamptz` | `"2024-05-01T10:00:00Z"` for offset zero; other offsets as `"+05:30"`, and `-08` becomes `"-08:00"` (RFC 3339); an offset with seconds (local mean time before 1900, never under `TimeZone 'UTC'`) is kept as Postgres wrote it |
//! | `time`, `timetz` | the text, with the `timetz` offset written as for `timestamptz` |
//! | `infinity`, `-infinity`, BC dates (` BC` suffix) | the text output as a string, not reformatted |
//! | `bytea` | base64 string (standard alphabet, padded) of the bytes in the hex output `\x0a0b…` |
//! | arrays | JSON arrays (nested for multi-dimensional arrays, dimension decoration such as `[0:1]=` dropped); each element encoded by the element type's rule, unquoted `NULL` → `null`, quoted `"NULL"` → the string `NULL`; elements of `json[]`/`jsonb[]` are embedded |
//! | any other type (`interval`, geometric types, ranges, composites, …) | its text output as a string |
//! | SQL `NULL` | `null` |
//!
//! Text that does not have the shape its type's output function produces
//! (it cannot happen with the session settings above) is written as a
//! string rather than as broken JSON.
//!
//! Arrays are split at `,`, the delimiter of every built-in type but `box`
//! (`;`): the caller maps `box[]` (and any array whose element type's
//! `typdelim` is not `,`) to [`ValueKind::Other`], so that its text goes
//! through as one string.
//!
//! # Document ids
//!
//! Meilisearch accepts as a document id an integer (it reads it into a `u64`
//! or `i64`) or a string of `[A-Za-z0-9_-]` of 1 to 511 bytes, and treats
//! the number `1` and the string `"1"` as the same document.
//!
//! * **One key column**: the primary-key attribute is that column's name, and
//!   its value in the document *is* the id. A non-negative integer column
//!   value within `u64` is written as a number. Anything else (negative
//!   integers, text, uuid, …) is a string made from the column's text output
//!   (so a `timestamp` key gives `2024-05-01_2010_3A00_3A00`, not the ISO
//!   form): kept as is when every byte is in `[A-Za-z0-9-]`, otherwise
//!   escaped reversibly ([`decode_id_component`] undoes it): every byte outside
//!   `[A-Za-z0-9-]` (including `_`) becomes `_` followed by two uppercase hex
//!   digits (`a b` → `a_20b`, `a_b` → `a_5Fb`, `é` → `_C3_A9`). A negative
//!   integer is sent as the string `"-5"`, which Meilisearch treats as the
//!   same document as the number `-5`.
//! * **Composite keys**: the primary-key attribute is `_pk`, written as the
//!   first field of the document; the key columns stay in the document with
//!   their normal values. The id is each key column's text output escaped as
//!   above, joined by `__` (`(42, 'a b')` → `42__a_20b`). The join is
//!   unambiguous because an escape is `_` followed by two hex digits, so `__`
//!   never occurs inside an escaped component. A table with a column named
//!   `_pk` and a composite key is refused.
//! * An id that is empty or longer than 511 bytes after escaping, or a key
//!   column that is NULL, is an [`EncodeError`]: Meilisearch would fail the
//!   whole batch, so the caller dead-letters the row instead of sending it.
//!
//! An `UPDATE` that leaves a TOASTed column unchanged sends no value for it
//! ([`ColumnValue::Unchanged`]); the field is left out of the document, which
//! the caller sends as a partial update.

use std::borrow::Cow;
use std::fmt;

/// Longest string id Meilisearch accepts, in bytes.
pub const MAX_ID_BYTES: usize = 511;

/// Primary-key attribute of tables with a composite key.
pub const COMPOSITE_KEY_ATTRIBUTE: &str = "_pk";

/// How a column's text output becomes JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueKind {
    /// `int2`, `int4`, `int8`, `oid`.
    Integer,
    /// `float4`, `float8`.
    Float,
    Numeric,
    Bool,
    /// `text`, `varchar`, `bpchar`, `name`, enums, `citext`, `uuid`, …
    Text,
    /// `json`, `jsonb`: embedded.
    Json,
    Timestamp,
    TimestampTz,
    Date,
    Time,
    TimeTz,
    Bytea,
    /// An array; the element kind.
    Array(Box<ValueKind>),
    /// The PostGIS column of the `geo` option: `_geo` or `_geojson` by value (see [`crate::document::geo`]).
    Geometry,
    /// A pgvector column of the `vectors` option, for the embedder named: an entry of
    /// `_vectors`, not a field of its own (see [`crate::document::vectors`]).
    Vector(String),
    /// Any other type: its text output as a JSON string.
    Other,
}

impl ValueKind {
    /// Whether a key column of this kind can make a Meilisearch document id: a float's, a JSON
    /// value's or an array's text is no stable id.
    pub fn can_be_document_id(&self) -> bool {
        !matches!(
            self,
            ValueKind::Json
                | ValueKind::Float
                | ValueKind::Array(_)
                | ValueKind::Geometry
                | ValueKind::Vector(_)
        )
    }
}

/// One column of one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnValue<'a> {
    Null,
    /// The column's text output.
    Text(&'a str),
    /// An unchanged TOASTed value in an `UPDATE`: the field is omitted.
    Unchanged,
}

impl ColumnValue<'_> {
    /// A row read by SPI (each value its type's text output, None for NULL) as column values.
    pub fn row(values: &[Option<String>]) -> Vec<ColumnValue<'_>> {
        values
            .iter()
            .map(|value| {
                value
                    .as_deref()
                    .map_or(ColumnValue::Null, ColumnValue::Text)
            })
            .collect()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    pub kind: ValueKind,
}

/// The columns of a table's documents and how their id is made.
#[derive(Debug, Clone)]
pub struct DocumentShape {
    columns: Vec<Column>,
    key_columns: Vec<usize>,
    primary_key_attribute: String,
    /// `"name":` of each column, JSON-escaped once instead of once per row.
    field_prefixes: Vec<Vec<u8>>,
    /// The column named `_geo` (JSON, or the PostGIS column of the `geo` option), which
    /// [`check_geo`] checks.
    geo_column: Option<usize>,
    /// Whether some column is an embedder's (`ValueKind::Vector`): the document has `_vectors`.
    has_vectors: bool,
}

impl DocumentShape {
    /// `key_columns` are indexes into `columns`, in key order.
    pub fn new(columns: Vec<Column>, key_columns: Vec<usize>) -> Result<Self, EncodeError> {
        if key_columns.is_empty() {
            return Err(EncodeError::NoKeyColumns);
        }
        for (position, &index) in key_columns.iter().enumerate() {
            if index >= columns.len() {
                return Err(EncodeError::KeyColumnOutOfRange {
                    index,
                    columns: columns.len(),
                });
            }
            if key_columns[..position].contains(&index) {
                return Err(EncodeError::DuplicateKeyColumn {
                    column: columns[index].name.clone(),
                });
            }
        }
        for (position, column) in columns.iter().enumerate() {
            if columns[..position].iter().any(|c| c.name == column.name) {
                return Err(EncodeError::DuplicateColumnName {
                    column: column.name.clone(),
                });
            }
        }
        let primary_key_attribute = if key_columns.len() == 1 {
            columns[key_columns[0]].name.clone()
        } else {
            if columns.iter().any(|c| c.name == COMPOSITE_KEY_ATTRIBUTE) {
                return Err(EncodeError::ReservedColumnName {
                    column: COMPOSITE_KEY_ATTRIBUTE.to_string(),
                });
            }
            COMPOSITE_KEY_ATTRIBUTE.to_string()
        };
        let field_prefixes = columns
            .iter()
            .map(|column| {
                let mut prefix = Vec::with_capacity(column.name.len() + 3);
                write_string(&mut prefix, &column.name);
                prefix.push(b':');
                prefix
            })
            .collect();
        let geo_column = columns
            .iter()
            .position(|column| column.name == crate::document::geo::POINT_FIELD);
        let has_vectors = columns
            .iter()
            .any(|column| matches!(column.kind, ValueKind::Vector(_)));
        Ok(DocumentShape {
            columns,
            key_columns,
            primary_key_attribute,
            field_prefixes,
            geo_column,
            has_vectors,
        })
    }

    /// The attribute Meilisearch uses as primary key (`?primaryKey=`).
    pub fn primary_key_attribute(&self) -> &str {
        &self.primary_key_attribute
    }

    pub fn key_columns(&self) -> &[usize] {
        &self.key_columns
    }

    /// The key columns' text of a row read by SPI (the copy's resume point, a row to re-send).
    pub fn key_of_row(&self, row: &[Option<String>]) -> Vec<String> {
        self.key_columns
            .iter()
            .map(|&index| row.get(index).cloned().flatten().unwrap_or_default())
            .collect()
    }

    pub fn columns(&self) -> &[Column] {
        &self.columns
    }

    fn is_composite(&self) -> bool {
        self.key_columns.len() > 1
    }

    /// Whether its documents carry `_vectors` (Meilisearch returns them only when asked to).
    pub fn has_vectors(&self) -> bool {
        self.has_vectors
    }
}

/// A Meilisearch document id, valid by construction; borrowed from the key's text when that
/// needs no escaping.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DocumentId<'a> {
    /// Decimal digits of a `u64`.
    Number(Cow<'a, str>),
    /// Only `[A-Za-z0-9_-]`, 1 to [`MAX_ID_BYTES`] bytes.
    String(Cow<'a, str>),
}

impl DocumentId<'_> {
    /// The id as a JSON value: a number, or a string that needs no escaping.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        match self {
            DocumentId::Number(digits) => out.extend_from_slice(digits.as_bytes()),
            DocumentId::String(id) => {
                out.push(b'"');
                out.extend_from_slice(id.as_bytes());
                out.push(b'"');
            }
        }
    }

    /// The id's text, as Meilisearch hashes it to pick a shard.
    pub fn as_str(&self) -> &str {
        match self {
            DocumentId::Number(id) | DocumentId::String(id) => id,
        }
    }
}

/// Why a row cannot become a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodeError {
    NoKeyColumns,
    KeyColumnOutOfRange {
        index: usize,
        columns: usize,
    },
    DuplicateKeyColumn {
        column: String,
    },
    DuplicateColumnName {
        column: String,
    },
    ReservedColumnName {
        column: String,
    },
    ValueCount {
        expected: usize,
        got: usize,
    },
    NullKey {
        column: String,
    },
    UnchangedKey {
        column: String,
    },
    EmptyId {
        column: String,
    },
    IdTooLong {
        bytes: usize,
    },
    /// A `_geo` column Meilisearch would refuse.
    InvalidGeo {
        reason: String,
    },
}

impl EncodeError {
    /// The Meilisearch error code the row would have met, for dead letters.
    pub fn code(&self) -> &'static str {
        match self {
            EncodeError::InvalidGeo { .. } => "invalid_document_geo_field",
            EncodeError::NullKey { .. } | EncodeError::UnchangedKey { .. } => "missing_document_id",
            EncodeError::EmptyId { .. } | EncodeError::IdTooLong { .. } => "invalid_document_id",
            _ => "invalid_document",
        }
    }
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EncodeError::NoKeyColumns => write!(
                f,
                "the table has no key columns: give it a primary key (or a unique index as replica identity) so its rows have document ids"
            ),
            EncodeError::KeyColumnOutOfRange { index, columns } => write!(
                f,
                "key column {index} does not exist: the table has {columns} synced columns"
            ),
            EncodeError::DuplicateKeyColumn { column } => {
                write!(f, "column \"{column}\" appears twice in the key")
            }
            EncodeError::DuplicateColumnName { column } => {
                write!(f, "column \"{column}\" appears twice in the column list")
            }
            EncodeError::ReservedColumnName { column } => write!(
                f,
                "column \"{column}\" clashes with the attribute that holds composite-key ids: leave it out of the synced columns or rename it"
            ),
            EncodeError::ValueCount { expected, got } => write!(
                f,
                "the row has {got} values but the document shape has {expected} columns"
            ),
            EncodeError::NullKey { column } => write!(
                f,
                "key column \"{column}\" is NULL, so the row has no document id"
            ),
            EncodeError::UnchangedKey { column } => write!(
                f,
                "key column \"{column}\" is an unchanged TOASTed value with no text, so the row has no document id"
            ),
            EncodeError::EmptyId { column } => write!(
                f,
                "key column \"{column}\" is an empty string, and Meilisearch does not accept an empty document id"
            ),
            EncodeError::InvalidGeo { reason } => write!(f, "invalid _geo field: {reason}"),
            EncodeError::IdTooLong { bytes } => write!(
                f,
                "the document id is {bytes} bytes after escaping, Meilisearch accepts at most {MAX_ID_BYTES}: use a shorter key (each character outside [A-Za-z0-9-] takes 3 bytes per byte)"
            ),
        }
    }
}

impl std::error::Error for EncodeError {}

/// A row as every path sends it (the copy, the stream, view renders, verify, repair, the preview
/// and dead-letter resends): appends its document (no newline) and returns the id, or returns why
/// the row must not be sent, which its dead letter records ([`EncodeError::code`] and the
/// message). A row without a valid id appends nothing; a row whose `_geo` Meilisearch would
/// refuse leaves its whole document in `out`, for the dead letter. When both are wrong, the id's
/// error is the one returned.
pub fn encode_row<'a>(
    shape: &DocumentShape,
    values: &[ColumnValue<'a>],
    out: &mut Vec<u8>,
) -> Result<DocumentId<'a>, EncodeError> {
    let id = encode_document(shape, values, out)?;
    check_geo(shape, values)?;
    Ok(id)
}

/// Meilisearch's rule for a `_geo` field: null, or an object with exactly `lat` and `lng`, each a
/// finite number or a string holding one. Checked before sending so that one bad row cannot fail
/// a whole Meilisearch batch (which, for `_geo`, fails every task indexed with it).
fn check_geo(shape: &DocumentShape, values: &[ColumnValue]) -> Result<(), EncodeError> {
    let Some(index) = shape.geo_column else {
        return Ok(());
    };
    let text = match values.get(index) {
        Some(ColumnValue::Text(text)) => *text,
        _ => return Ok(()),
    };
    let invalid = |reason: String| Err(EncodeError::InvalidGeo { reason });
    if shape.columns[index].kind == ValueKind::Geometry {
        return crate::document::geo::from_postgis_text(text)
            .map(|_| ())
            .or_else(|error| invalid(error.to_string()));
    }
    if shape.columns[index].kind != ValueKind::Json {
        return invalid(format!(
            "expected an object with lat and lng, got the string {text:?}"
        ));
    }
    let value: serde_json::Value = match serde_json::from_str(text) {
        Ok(value) => value,
        Err(error) => return invalid(error.to_string()),
    };
    let object = match value {
        serde_json::Value::Null => return Ok(()),
        serde_json::Value::Object(object) => object,
        other => return invalid(format!("expected an object with lat and lng, got {other}")),
    };
    if let Some(extra) = object.keys().find(|key| *key != "lat" && *key != "lng") {
        return invalid(format!("unexpected field \"{extra}\""));
    }
    for field in ["lat", "lng"] {
        let number = match object.get(field) {
            Some(serde_json::Value::Number(number)) => number.as_f64(),
            Some(serde_json::Value::String(text)) => text.parse::<f64>().ok(),
            _ => None,
        };
        if !number.is_some_and(f64::is_finite) {
            return invalid(format!(
                "{field} must be a finite number, got {}",
                object
                    .get(field)
                    .map_or("nothing".into(), ToString::to_string)
            ));
        }
    }
    Ok(())
}

/// Appends one document (no newline) with its fields in column order and
/// returns its id. Nothing is appended on error. It does not check `_geo`: a row to send goes
/// through [`encode_row`].
pub fn encode_document<'a>(
    shape: &DocumentShape,
    values: &[ColumnValue<'a>],
    out: &mut Vec<u8>,
) -> Result<DocumentId<'a>, EncodeError> {
    if values.len() != shape.columns.len() {
        return Err(EncodeError::ValueCount {
            expected: shape.columns.len(),
            got: values.len(),
        });
    }
    let key_text = |index: usize| match values[index] {
        ColumnValue::Text(text) => Ok(text),
        ColumnValue::Null => Err(EncodeError::NullKey {
            column: shape.columns[index].name.clone(),
        }),
        ColumnValue::Unchanged => Err(EncodeError::UnchangedKey {
            column: shape.columns[index].name.clone(),
        }),
    };
    // The usual single key needs no Vec.
    let id = match shape.key_columns[..] {
        [index] => encode_id(shape, &[key_text(index)?])?,
        _ => {
            let key_texts = shape
                .key_columns
                .iter()
                .map(|&index| key_text(index))
                .collect::<Result<Vec<_>, _>>()?;
            encode_id(shape, &key_texts)?
        }
    };

    out.push(b'{');
    let mut first = true;
    if shape.is_composite() {
        write_string(out, COMPOSITE_KEY_ATTRIBUTE);
        out.push(b':');
        id.write_json(out);
        first = false;
    }
    let single_key = (!shape.is_composite()).then(|| shape.key_columns[0]);
    for (index, value) in values.iter().enumerate() {
        if matches!(shape.columns[index].kind, ValueKind::Vector(_)) {
            continue;
        }
        let text = match value {
            ColumnValue::Unchanged => continue,
            ColumnValue::Null => None,
            ColumnValue::Text(text) => Some(*text),
        };
        if !first {
            out.push(b',');
        }
        first = false;
        if let (Some(text), ValueKind::Geometry) = (text, &shape.columns[index].kind) {
            write_geometry(out, &shape.field_prefixes[index], text);
            continue;
        }
        out.extend_from_slice(&shape.field_prefixes[index]);
        match text {
            None => out.extend_from_slice(b"null"),
            Some(_) if single_key == Some(index) => id.write_json(out),
            Some(text) => write_value(out, &shape.columns[index].kind, text),
        }
    }
    if shape.has_vectors {
        write_vectors(out, shape, values, first);
    }
    out.push(b'}');
    Ok(id)
}

/// The `_vectors` field: one entry per embedder column, `null` for a NULL. An unchanged TOASTed
/// embedding (an UPDATE that did not touch it) has no entry, and without any entry the field is
/// left out: the document is then a partial update, which keeps what Meilisearch has.
fn write_vectors(out: &mut Vec<u8>, shape: &DocumentShape, values: &[ColumnValue], first: bool) {
    let mut opened = false;
    for (column, value) in shape.columns.iter().zip(values) {
        let ValueKind::Vector(embedder) = &column.kind else {
            continue;
        };
        if *value == ColumnValue::Unchanged {
            continue;
        }
        if opened {
            out.push(b',');
        } else {
            if !first {
                out.push(b',');
            }
            write_string(out, crate::document::vectors::VECTORS_FIELD);
            out.extend_from_slice(b":{");
            opened = true;
        }
        write_string(out, embedder);
        out.push(b':');
        match value {
            ColumnValue::Text(text) => crate::document::vectors::write_embedding(out, text),
            _ => out.extend_from_slice(b"null"),
        }
    }
    if opened {
        out.push(b'}');
    }
}

/// A PostGIS value as `_geo` (a point, or null when empty) or `_geojson` (any other geometry).
/// A value that cannot be either is written as `_geo` holding its text, for the dead letter that
/// [`check_geo`] makes of the row.
fn write_geometry(out: &mut Vec<u8>, point_prefix: &[u8], text: &str) {
    match crate::document::geo::from_postgis_text(text) {
        Ok(value) => {
            if value.field() == crate::document::geo::POINT_FIELD {
                out.extend_from_slice(point_prefix);
            } else {
                write_string(out, value.field());
                out.push(b':');
            }
            value.write_json(out);
        }
        Err(_) => {
            out.extend_from_slice(point_prefix);
            write_string(out, text);
        }
    }
}

/// The id of the row whose key columns have these text outputs (in key
/// order), for deletes where only the key is known.
pub fn encode_id<'a>(
    shape: &DocumentShape,
    key_values: &[&'a str],
) -> Result<DocumentId<'a>, EncodeError> {
    if key_values.len() != shape.key_columns.len() {
        return Err(EncodeError::ValueCount {
            expected: shape.key_columns.len(),
            got: key_values.len(),
        });
    }
    let id = if let [text] = key_values {
        let column = &shape.columns[shape.key_columns[0]];
        if column.kind == ValueKind::Integer && is_u64(text) {
            return Ok(DocumentId::Number(Cow::Borrowed(text)));
        }
        if text.is_empty() {
            return Err(EncodeError::EmptyId {
                column: column.name.clone(),
            });
        }
        if text.bytes().all(is_plain_id_byte) {
            Cow::Borrowed(*text)
        } else {
            let mut id = String::with_capacity(text.len());
            escape_id_component(text, &mut id);
            Cow::Owned(id)
        }
    } else {
        let mut id = String::new();
        for (position, text) in key_values.iter().enumerate() {
            if position > 0 {
                id.push_str("__");
            }
            escape_id_component(text, &mut id);
        }
        Cow::Owned(id)
    };
    if id.len() > MAX_ID_BYTES {
        return Err(EncodeError::IdTooLong { bytes: id.len() });
    }
    Ok(DocumentId::String(id))
}

/// Splits a document id back into the key columns' text (the inverse of the id encoding); None
/// if it cannot come from a key of `key_columns` columns.
pub fn key_of_id(id: &str, key_columns: usize) -> Option<Vec<String>> {
    let values: Option<Vec<String>> = if key_columns == 1 {
        decode_id_component(id).map(|value| vec![value])
    } else {
        id.split("__").map(decode_id_component).collect()
    };
    values.filter(|values| values.len() == key_columns)
}

/// Inverse of the id escaping for one component (one key column's text).
/// `None` if `escaped` is not the output of the escaping.
fn decode_id_component(escaped: &str) -> Option<String> {
    let bytes = escaped.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'_' => {
                let high = bytes.get(i + 1).copied().and_then(upper_hex_value)?;
                let low = bytes.get(i + 2).copied().and_then(upper_hex_value)?;
                let byte = high << 4 | low;
                if is_plain_id_byte(byte) {
                    return None;
                }
                decoded.push(byte);
                i += 3;
            }
            byte if is_plain_id_byte(byte) => {
                decoded.push(byte);
                i += 1;
            }
            _ => return None,
        }
    }
    String::from_utf8(decoded).ok()
}

fn is_plain_id_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'-'
}

fn upper_hex_value(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

fn escape_id_component(text: &str, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &byte in text.as_bytes() {
        if is_plain_id_byte(byte) {
            out.push(byte as char);
        } else {
            out.push('_');
            out.push(HEX[usize::from(byte >> 4)] as char);
            out.push(HEX[usize::from(byte & 0x0f)] as char);
        }
    }
}

/// Decimal digits of a `u64`, as valid JSON (no leading zeros).
fn is_u64(text: &str) -> bool {
    let bytes = text.as_bytes();
    !bytes.is_empty()
        && bytes.iter().all(u8::is_ascii_digit)
        && (bytes[0] != b'0' || bytes.len() == 1)
        && text.parse::<u64>().is_ok()
}

/// Appends one non-NULL value, given as its Postgres text output, as JSON.
pub fn write_value(out: &mut Vec<u8>, kind: &ValueKind, text: &str) {
    match kind {
        ValueKind::Integer => write_number_or_string(out, text),
        ValueKind::Float | ValueKind::Numeric => {
            if is_special_float(text) {
                out.extend_from_slice(b"null");
            } else {
                write_number_or_string(out, text);
            }
        }
        ValueKind::Bool => match text {
            "t" => out.extend_from_slice(b"true"),
            "f" => out.extend_from_slice(b"false"),
            _ => write_string(out, text),
        },
        // A geometry is written by `write_geometry`, which needs the field; its text is the fallback.
        ValueKind::Text | ValueKind::Other | ValueKind::Geometry | ValueKind::Vector(_) => {
            write_string(out, text)
        }
        ValueKind::Json => write_embedded_json(out, text),
        ValueKind::Date
        | ValueKind::Timestamp
        | ValueKind::TimestampTz
        | ValueKind::Time
        | ValueKind::TimeTz => write_datetime(out, kind, text),
        ValueKind::Bytea => write_bytea(out, text),
        ValueKind::Array(element) => {
            let start = out.len();
            if ArrayParser::new(text).write(out, element).is_none() {
                out.truncate(start);
                write_string(out, text);
            }
        }
    }
}

fn is_special_float(text: &str) -> bool {
    matches!(text, "NaN" | "Infinity" | "-Infinity")
}

/// The text as a JSON number if it is one that an `f64` reader accepts,
/// else as a string.
fn write_number_or_string(out: &mut Vec<u8>, text: &str) {
    if is_json_number(text) && fits_f64(text) {
        out.extend_from_slice(text.as_bytes());
    } else {
        write_string(out, text);
    }
}

/// Within the finite `f64` range (tiny values round to 0, which readers
/// accept). Without an exponent, 308 characters are below 1e308.
fn fits_f64(text: &str) -> bool {
    let plain = text.len() <= 308 && !text.bytes().any(|b| b == b'e' || b == b'E');
    plain || text.parse::<f64>().is_ok_and(f64::is_finite)
}

/// RFC 8259 number: `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`.
fn is_json_number(text: &str) -> bool {
    let bytes = text.as_bytes();
    let mut i = usize::from(bytes.first() == Some(&b'-'));
    let digits = |i: &mut usize| {
        let start = *i;
        while *i < bytes.len() && bytes[*i].is_ascii_digit() {
            *i += 1;
        }
        *i - start
    };
    let integer_start = i;
    let integer_digits = digits(&mut i);
    if integer_digits == 0 || (integer_digits > 1 && bytes[integer_start] == b'0') {
        return false;
    }
    if bytes.get(i) == Some(&b'.') {
        i += 1;
        if digits(&mut i) == 0 {
            return false;
        }
    }
    if matches!(bytes.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(bytes.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        if digits(&mut i) == 0 {
            return false;
        }
    }
    i == bytes.len()
}

/// Appends `text` as a JSON string.
fn write_string(out: &mut Vec<u8>, text: &str) {
    out.push(b'"');
    write_escaped(out, text);
    out.push(b'"');
}

/// Marks the bytes of `word` (little-endian) that are `"`, `\` or below U+0020 (the classic
/// SWAR tests: a byte below `n` borrows in `x - n` and had its high bit clear). A borrow can mark
/// a byte above a marked one too, but the lowest mark is always exact.
fn escape_marks(word: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let below = |x: u64, n: u64| x.wrapping_sub(ONES * n) & !x & HIGH;
    let control = below(word, 0x20);
    let quote = below(word ^ (ONES * u64::from(b'"')), 1);
    let backslash = below(word ^ (ONES * u64::from(b'\\')), 1);
    control | quote | backslash
}

/// Appends the inside of a JSON string: looks at 8 bytes at a time for the
/// next byte to escape and copies the run before it in one go.
fn write_escaped(out: &mut Vec<u8>, text: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = text.as_bytes();
    let mut run_start = 0;
    let mut i = 0;
    loop {
        let next = match bytes[i..].first_chunk::<8>() {
            Some(word) => match escape_marks(u64::from_le_bytes(*word)) {
                0 => {
                    i += 8;
                    continue;
                }
                marks => i + marks.trailing_zeros() as usize / 8,
            },
            // Fewer than 8 bytes left.
            None => match bytes[i..]
                .iter()
                .position(|&byte| byte < 0x20 || byte == b'"' || byte == b'\\')
            {
                Some(offset) => i + offset,
                None => break,
            },
        };
        out.extend_from_slice(&bytes[run_start..next]);
        let byte = bytes[next];
        match byte {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            _ => {
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(byte >> 4)]);
                out.push(HEX[usize::from(byte & 0x0f)]);
            }
        }
        i = next + 1;
        run_start = i;
    }
    out.extend_from_slice(&bytes[run_start..]);
}

/// Postgres' `json` output is the input text, which may hold line breaks
/// between tokens (never inside strings, where JSON requires escapes).
fn write_embedded_json(out: &mut Vec<u8>, text: &str) {
    let start = out.len();
    out.extend_from_slice(text.as_bytes());
    // An unconditional store lets the loop run on vector registers.
    for byte in &mut out[start..] {
        *byte = if matches!(*byte, b'\n' | b'\r') {
            b' '
        } else {
            *byte
        };
    }
}

fn write_datetime(out: &mut Vec<u8>, kind: &ValueKind, text: &str) {
    if text.ends_with(" BC") || text == "infinity" || text == "-infinity" {
        write_string(out, text);
        return;
    }
    let (date, time) = match kind {
        ValueKind::Timestamp | ValueKind::TimestampTz => match text.split_once(' ') {
            Some((date, time)) => (Some(date), time),
            None => {
                write_string(out, text);
                return;
            }
        },
        ValueKind::Time | ValueKind::TimeTz => (None, text),
        _ => {
            write_string(out, text);
            return;
        }
    };
    out.push(b'"');
    if let Some(date) = date {
        write_escaped(out, date);
        out.push(b'T');
    }
    match kind {
        ValueKind::TimestampTz | ValueKind::TimeTz => write_time_with_offset(out, time),
        _ => write_escaped(out, time),
    }
    out.push(b'"');
}

/// `10:00:00+00` → `10:00:00Z`, `…+05:30` kept, `…-08` → `…-08:00`.
fn write_time_with_offset(out: &mut Vec<u8>, time: &str) {
    let Some(sign_at) = time.bytes().position(|b| b == b'+' || b == b'-') else {
        write_escaped(out, time);
        return;
    };
    let (clock, offset) = time.split_at(sign_at);
    let (mut fields, mut well_formed, mut zero) = (0, true, true);
    for field in offset[1..].split(':') {
        fields += 1;
        well_formed &= field.len() == 2 && field.bytes().all(|b| b.is_ascii_digit());
        zero &= field == "00";
    }
    well_formed &= fields <= 3;
    write_escaped(out, clock);
    if !well_formed {
        write_escaped(out, offset);
    } else if zero {
        out.push(b'Z');
    } else if fields == 1 {
        out.extend_from_slice(offset.as_bytes());
        out.extend_from_slice(b":00");
    } else {
        out.extend_from_slice(offset.as_bytes());
    }
}

/// `\x0a0b…` → base64 string; any other text as a plain string.
fn write_bytea(out: &mut Vec<u8>, text: &str) {
    let hex = match text.strip_prefix("\\x") {
        Some(hex) if hex.len() % 2 == 0 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => hex,
        _ => {
            write_string(out, text);
            return;
        }
    };
    let bytes: Vec<u8> = hex
        .as_bytes()
        .chunks_exact(2)
        .map(|pair| hex_value(pair[0]) << 4 | hex_value(pair[1]))
        .collect();
    out.push(b'"');
    write_base64(out, &bytes);
    out.push(b'"');
}

fn hex_value(digit: u8) -> u8 {
    match digit {
        b'0'..=b'9' => digit - b'0',
        b'a'..=b'f' => digit - b'a' + 10,
        _ => digit - b'A' + 10,
    }
}

/// Standard base64 alphabet, padded (RFC 4648 §4).
fn write_base64(out: &mut Vec<u8>, bytes: &[u8]) {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for chunk in bytes.chunks(3) {
        let group = u32::from(chunk[0]) << 16
            | u32::from(chunk.get(1).copied().unwrap_or(0)) << 8
            | u32::from(chunk.get(2).copied().unwrap_or(0));
        let sextet = |shift: u32| ALPHABET[((group >> shift) & 0x3f) as usize];
        out.push(sextet(18));
        out.push(sextet(12));
        out.push(if chunk.len() > 1 { sextet(6) } else { b'=' });
        out.push(if chunk.len() > 2 { sextet(0) } else { b'=' });
    }
}

/// Reads Postgres' array output (`{1,2}`, `{{1,2},{3,4}}`, `{"a b",NULL}`,
/// `[0:1]={1,2}`) and writes it as a JSON array.
struct ArrayParser<'a> {
    text: &'a str,
    position: usize,
    /// An unescaped quoted element.
    element: String,
}

impl<'a> ArrayParser<'a> {
    fn new(text: &'a str) -> Self {
        // Dimension decoration `[lo:hi][lo:hi]=` precedes the braces when a
        // lower bound is not 1; the brace structure already has the shape.
        let text = match text.strip_prefix('[') {
            Some(_) => text.split_once('=').map_or(text, |(_, rest)| rest),
            None => text,
        };
        ArrayParser {
            text,
            position: 0,
            element: String::new(),
        }
    }

    /// `None` if the text is not an array literal.
    fn write(mut self, out: &mut Vec<u8>, element_kind: &ValueKind) -> Option<()> {
        self.skip_whitespace();
        self.write_level(out, element_kind)?;
        self.skip_whitespace();
        (self.position == self.text.len()).then_some(())
    }

    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.position).copied()
    }

    fn skip_whitespace(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_whitespace()) {
            self.position += 1;
        }
    }

    fn write_level(&mut self, out: &mut Vec<u8>, element_kind: &ValueKind) -> Option<()> {
        if self.peek()? != b'{' {
            return None;
        }
        self.position += 1;
        out.push(b'[');
        self.skip_whitespace();
        if self.peek()? == b'}' {
            self.position += 1;
            out.push(b']');
            return Some(());
        }
        loop {
            self.skip_whitespace();
            match self.peek()? {
                b'{' => self.write_level(out, element_kind)?,
                b'"' => {
                    self.read_quoted()?;
                    write_value(out, element_kind, &self.element);
                }
                _ => {
                    let token = self.read_unquoted()?;
                    if token.eq_ignore_ascii_case("NULL") {
                        out.extend_from_slice(b"null");
                    } else {
                        write_value(out, element_kind, token);
                    }
                }
            }
            self.skip_whitespace();
            match self.peek()? {
                b',' => {
                    self.position += 1;
                    out.push(b',');
                }
                b'}' => {
                    self.position += 1;
                    out.push(b']');
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A `"…"` element with backslash escapes, into `self.element`.
    fn read_quoted(&mut self) -> Option<()> {
        self.element.clear();
        self.position += 1;
        let mut chars = self.text[self.position..].char_indices();
        while let Some((offset, c)) = chars.next() {
            match c {
                '"' => {
                    self.position += offset + 1;
                    return Some(());
                }
                '\\' => self.element.push(chars.next()?.1),
                c => self.element.push(c),
            }
        }
        None
    }

    /// An element up to the next `,` or `}`, without surrounding whitespace.
    fn read_unquoted(&mut self) -> Option<&'a str> {
        let rest = &self.text[self.position..];
        let length = rest.bytes().position(|b| b == b',' || b == b'}')?;
        self.position += length;
        let token = rest[..length].trim_ascii();
        (!token.is_empty() && !token.bytes().any(|b| b == b'{' || b == b'"')).then_some(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_json_and_arrays_cannot_be_document_ids_and_the_rest_can() {
        let refused = [
            ValueKind::Float,
            ValueKind::Json,
            ValueKind::Array(Box::new(ValueKind::Integer)),
        ];
        assert!(refused.iter().all(|kind| !kind.can_be_document_id()));
        let allowed = [
            ValueKind::Integer,
            ValueKind::Text,
            ValueKind::Numeric,
            ValueKind::Date,
            ValueKind::Other,
        ];
        assert!(allowed.iter().all(ValueKind::can_be_document_id));
    }
    use serde_json::{json, Value};

    fn value(kind: ValueKind, text: &str) -> Value {
        let mut out = Vec::new();
        write_value(&mut out, &kind, text);
        serde_json::from_slice(&out)
            .unwrap_or_else(|e| panic!("{kind:?} {text:?} gave invalid JSON {out:?}: {e}"))
    }

    fn raw(kind: ValueKind, text: &str) -> String {
        let mut out = Vec::new();
        write_value(&mut out, &kind, text);
        String::from_utf8(out).expect("the encoder writes UTF-8")
    }

    fn array(element: ValueKind) -> ValueKind {
        ValueKind::Array(Box::new(element))
    }

    fn column(name: &str, kind: ValueKind) -> Column {
        Column {
            name: name.to_string(),
            kind,
        }
    }

    use crate::test_support::Prng;

    #[test]
    fn integers_are_numbers() {
        assert_eq!(raw(ValueKind::Integer, "42"), "42");
        assert_eq!(
            raw(ValueKind::Integer, "-9223372036854775808"),
            "-9223372036854775808"
        );
        assert_eq!(raw(ValueKind::Integer, "0"), "0");
        assert_eq!(
            value(ValueKind::Integer, "4294967295"),
            json!(4294967295u64)
        );
    }

    #[test]
    fn text_that_is_not_a_number_becomes_a_string() {
        assert_eq!(value(ValueKind::Integer, "007"), json!("007"));
        assert_eq!(value(ValueKind::Float, "1."), json!("1."));
        assert_eq!(value(ValueKind::Numeric, ".5"), json!(".5"));
        assert_eq!(value(ValueKind::Integer, ""), json!(""));
    }

    #[test]
    fn floats_are_numbers_and_special_values_null() {
        assert_eq!(raw(ValueKind::Float, "1.5"), "1.5");
        assert_eq!(raw(ValueKind::Float, "1e+300"), "1e+300");
        assert_eq!(raw(ValueKind::Float, "-0"), "-0");
        assert_eq!(
            value(ValueKind::Float, "1.7976931348623157e+308"),
            json!(f64::MAX)
        );
        assert_eq!(value(ValueKind::Float, "5e-324"), json!(5e-324));
        assert_eq!(value(ValueKind::Float, "0.1"), json!(0.1));
        for special in ["NaN", "Infinity", "-Infinity"] {
            assert_eq!(raw(ValueKind::Float, special), "null");
            assert_eq!(raw(ValueKind::Numeric, special), "null");
        }
    }

    #[test]
    fn numerics_keep_their_digits() {
        let text = "123456789012345678901234567890.123";
        assert_eq!(raw(ValueKind::Numeric, text), text);
        assert!(value(ValueKind::Numeric, text).is_number());
        assert_eq!(raw(ValueKind::Numeric, "-0.000100"), "-0.000100");
        let tiny = format!("0.{}1", "0".repeat(400));
        assert_eq!(value(ValueKind::Numeric, &tiny), json!(0.0));
    }

    #[test]
    fn numerics_beyond_f64_become_strings() {
        assert_eq!(value(ValueKind::Numeric, "1e400"), json!("1e400"));
        let huge = format!("1{}", "0".repeat(400));
        assert_eq!(value(ValueKind::Numeric, &huge), json!(huge));
        let negative = format!("-{huge}.5");
        assert_eq!(value(ValueKind::Numeric, &negative), json!(negative));
    }

    #[test]
    fn booleans() {
        assert_eq!(raw(ValueKind::Bool, "t"), "true");
        assert_eq!(raw(ValueKind::Bool, "f"), "false");
    }

    #[test]
    fn strings_are_escaped_per_rfc_8259() {
        assert_eq!(raw(ValueKind::Text, "plain"), "\"plain\"");
        assert_eq!(raw(ValueKind::Text, "a\"b\\c"), r#""a\"b\\c""#);
        assert_eq!(
            raw(ValueKind::Text, "\n\r\t\u{8}\u{c}\u{1}\u{1f}\u{7f}"),
            "\"\\n\\r\\t\\b\\f\\u0001\\u001f\u{7f}\""
        );
        let unicode = "héllo 日本 🎉 \u{2028}\u{2029}";
        assert_eq!(raw(ValueKind::Text, unicode), format!("\"{unicode}\""));
        assert_eq!(value(ValueKind::Text, unicode), json!(unicode));
        assert_eq!(
            value(ValueKind::Other, "1 day 02:00:00"),
            json!("1 day 02:00:00")
        );
        assert_eq!(value(ValueKind::Text, ""), json!(""));
    }

    #[test]
    fn every_control_character_round_trips() {
        let text: String = (0u8..0x20).map(char::from).skip(1).collect();
        assert_eq!(value(ValueKind::Text, &text), json!(text));
    }

    #[test]
    fn json_is_embedded() {
        let jsonb = r#"{"a": 1, "b": {"c": [1, 2, {"d": null}]}, "e": "x\ny"}"#;
        assert_eq!(raw(ValueKind::Json, jsonb), jsonb);
        assert_eq!(
            value(ValueKind::Json, jsonb),
            json!({"a": 1, "b": {"c": [1, 2, {"d": null}]}, "e": "x\ny"})
        );
        assert_eq!(value(ValueKind::Json, "\"s\""), json!("s"));
        assert_eq!(value(ValueKind::Json, "3.5"), json!(3.5));
    }

    #[test]
    fn json_line_breaks_become_spaces() {
        let text = "{\n  \"a\": [1,\r\n 2]\n}";
        assert!(!raw(ValueKind::Json, text).contains('\n'));
        assert_eq!(value(ValueKind::Json, text), json!({"a": [1, 2]}));
    }

    #[test]
    fn dates_and_timestamps_are_iso_8601() {
        assert_eq!(value(ValueKind::Date, "2024-05-01"), json!("2024-05-01"));
        assert_eq!(
            value(ValueKind::Timestamp, "2024-05-01 10:00:00"),
            json!("2024-05-01T10:00:00")
        );
        assert_eq!(
            value(ValueKind::Timestamp, "2024-05-01 10:00:00.123456"),
            json!("2024-05-01T10:00:00.123456")
        );
        assert_eq!(
            value(ValueKind::TimestampTz, "2024-05-01 10:00:00+00"),
            json!("2024-05-01T10:00:00Z")
        );
        assert_eq!(
            value(ValueKind::TimestampTz, "2024-05-01 10:00:00.5+05:30"),
            json!("2024-05-01T10:00:00.5+05:30")
        );
        assert_eq!(
            value(ValueKind::TimestampTz, "2024-05-01 10:00:00-08"),
            json!("2024-05-01T10:00:00-08:00")
        );
        assert_eq!(
            value(ValueKind::TimestampTz, "1890-01-01 00:00:00+00:53:28"),
            json!("1890-01-01T00:00:00+00:53:28")
        );
        assert_eq!(
            value(ValueKind::Timestamp, "12345-01-01 00:00:00"),
            json!("12345-01-01T00:00:00")
        );
    }

    #[test]
    fn times_keep_their_text_with_normalized_offsets() {
        assert_eq!(value(ValueKind::Time, "10:00:00.25"), json!("10:00:00.25"));
        assert_eq!(value(ValueKind::TimeTz, "10:00:00+00"), json!("10:00:00Z"));
        assert_eq!(
            value(ValueKind::TimeTz, "10:00:00-08"),
            json!("10:00:00-08:00")
        );
        assert_eq!(
            value(ValueKind::TimeTz, "23:59:59.999+05:45"),
            json!("23:59:59.999+05:45")
        );
    }

    #[test]
    fn infinity_and_bc_are_kept_as_text() {
        for kind in [
            ValueKind::Date,
            ValueKind::Timestamp,
            ValueKind::TimestampTz,
        ] {
            assert_eq!(value(kind.clone(), "infinity"), json!("infinity"));
            assert_eq!(value(kind, "-infinity"), json!("-infinity"));
        }
        assert_eq!(
            value(ValueKind::Date, "0044-03-15 BC"),
            json!("0044-03-15 BC")
        );
        assert_eq!(
            value(ValueKind::Timestamp, "0044-03-15 10:00:00 BC"),
            json!("0044-03-15 10:00:00 BC")
        );
        assert_eq!(
            value(ValueKind::TimestampTz, "0044-03-15 10:00:00+00 BC"),
            json!("0044-03-15 10:00:00+00 BC")
        );
    }

    #[test]
    fn bytea_is_base64() {
        // RFC 4648 §10 test vectors.
        let vectors = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (plain, encoded) in vectors {
            let hex: String = plain.bytes().map(|b| format!("{b:02x}")).collect();
            assert_eq!(
                value(ValueKind::Bytea, &format!("\\x{hex}")),
                json!(encoded)
            );
        }
        assert_eq!(value(ValueKind::Bytea, "\\x00FFfe"), json!("AP/+"));
        assert_eq!(value(ValueKind::Bytea, "\\xfbff"), json!("+/8="));
        assert_eq!(value(ValueKind::Bytea, "\\x0"), json!("\\x0"));
        assert_eq!(value(ValueKind::Bytea, "abc\\000"), json!("abc\\000"));
    }

    #[test]
    fn arrays() {
        assert_eq!(
            value(array(ValueKind::Integer), "{1,2,NULL}"),
            json!([1, 2, null])
        );
        assert_eq!(value(array(ValueKind::Integer), "{}"), json!([]));
        assert_eq!(value(array(ValueKind::Text), "{}"), json!([]));
        assert_eq!(
            value(
                array(ValueKind::Text),
                r#"{"a b","c\"d",NULL,"NULL",e\f,"x\\y",""}"#
            ),
            json!(["a b", "c\"d", null, "NULL", "e\\f", "x\\y", ""])
        );
        assert_eq!(
            value(array(ValueKind::Text), "{null,Null}"),
            json!([null, null])
        );
        assert_eq!(
            value(array(ValueKind::Integer), "{{1,2},{3,4}}"),
            json!([[1, 2], [3, 4]])
        );
        assert_eq!(
            value(array(ValueKind::Integer), "{{{1},{2}},{{3},{NULL}}}"),
            json!([[[1], [2]], [[3], [null]]])
        );
        assert_eq!(
            value(array(ValueKind::Integer), "[0:1]={1,2}"),
            json!([1, 2])
        );
        assert_eq!(
            value(array(ValueKind::Integer), "[0:1][-1:0]={{1,2},{3,4}}"),
            json!([[1, 2], [3, 4]])
        );
        assert_eq!(value(array(ValueKind::Bool), "{t,f}"), json!([true, false]));
        assert_eq!(
            value(array(ValueKind::Float), "{1.5,NaN,-Infinity}"),
            json!([1.5, null, null])
        );
        assert_eq!(
            value(
                array(ValueKind::TimestampTz),
                r#"{"2024-05-01 10:00:00+00"}"#
            ),
            json!(["2024-05-01T10:00:00Z"])
        );
        assert_eq!(
            value(array(ValueKind::Bytea), r#"{"\\x666f6f"}"#),
            json!(["Zm9v"])
        );
        assert_eq!(
            value(array(ValueKind::Text), "{\"日本\",🎉, spaced }"),
            json!(["日本", "🎉", "spaced"])
        );
    }

    #[test]
    fn json_array_elements_are_embedded() {
        assert_eq!(
            value(
                array(ValueKind::Json),
                r#"{"{\"a\": 1}","[1, {\"b\": \"c\\\\d\"}]",NULL}"#
            ),
            json!([{"a": 1}, [1, {"b": "c\\d"}], null])
        );
    }

    #[test]
    fn malformed_arrays_fall_back_to_their_text() {
        for text in ["{1,2", "{1,,2}", "1,2", "{\"a}", "{1}x", "{{1},2"] {
            assert_eq!(
                value(array(ValueKind::Integer), text),
                json!(text),
                "{text}"
            );
        }
    }

    fn shape(columns: Vec<Column>, keys: Vec<usize>) -> DocumentShape {
        DocumentShape::new(columns, keys).expect("valid shape")
    }

    fn document<'a>(
        shape: &DocumentShape,
        values: &[ColumnValue<'a>],
    ) -> (DocumentId<'a>, Value, String) {
        let mut out = Vec::new();
        let id = encode_document(shape, values, &mut out).expect("encodes");
        let text = String::from_utf8(out).expect("UTF-8");
        let parsed = serde_json::from_str(&text).expect("valid JSON");
        (id, parsed, text)
    }

    #[test]
    fn document_fields_follow_column_order() {
        let shape = shape(
            vec![
                column("id", ValueKind::Integer),
                column("name", ValueKind::Text),
                column("price", ValueKind::Numeric),
                column("tags", array(ValueKind::Text)),
                column("meta", ValueKind::Json),
                column("note", ValueKind::Text),
            ],
            vec![0],
        );
        assert_eq!(shape.primary_key_attribute(), "id");
        let (id, parsed, text) = document(
            &shape,
            &[
                ColumnValue::Text("7"),
                ColumnValue::Text("Red \"Kettle\""),
                ColumnValue::Text("29.99"),
                ColumnValue::Text("{new,eco}"),
                ColumnValue::Text(r#"{"color": "red"}"#),
                ColumnValue::Null,
            ],
        );
        assert_eq!(id, DocumentId::Number("7".into()));
        assert_eq!(
            text,
            r#"{"id":7,"name":"Red \"Kettle\"","price":29.99,"tags":["new","eco"],"meta":{"color": "red"},"note":null}"#
        );
        assert_eq!(parsed["tags"], json!(["new", "eco"]));
    }

    #[test]
    fn unchanged_toast_values_are_omitted() {
        let shape = shape(
            vec![
                column("id", ValueKind::Integer),
                column("body", ValueKind::Text),
            ],
            vec![0],
        );
        let (_, _, text) = document(&shape, &[ColumnValue::Text("1"), ColumnValue::Unchanged]);
        assert_eq!(text, r#"{"id":1}"#);
        let shape = self::shape(
            vec![
                column("body", ValueKind::Text),
                column("id", ValueKind::Integer),
            ],
            vec![1],
        );
        let (_, _, text) = document(&shape, &[ColumnValue::Unchanged, ColumnValue::Text("1")]);
        assert_eq!(text, r#"{"id":1}"#);
    }

    #[test]
    fn field_names_are_escaped() {
        let shape = shape(
            vec![
                column("id", ValueKind::Integer),
                column("we\"ird\n", ValueKind::Text),
            ],
            vec![0],
        );
        let (_, parsed, _) = document(&shape, &[ColumnValue::Text("1"), ColumnValue::Text("x")]);
        assert_eq!(parsed, json!({"id": 1, "we\"ird\n": "x"}));
    }

    fn single_id(kind: ValueKind, text: &str) -> Result<DocumentId<'_>, EncodeError> {
        encode_id(&shape(vec![column("k", kind)], vec![0]), &[text])
    }

    #[test]
    fn integer_ids() {
        assert_eq!(
            single_id(ValueKind::Integer, "0"),
            Ok(DocumentId::Number("0".into()))
        );
        assert_eq!(
            single_id(ValueKind::Integer, "18446744073709551615"),
            Ok(DocumentId::Number("18446744073709551615".into()))
        );
        assert_eq!(
            single_id(ValueKind::Integer, "18446744073709551616"),
            Ok(DocumentId::String("18446744073709551616".into()))
        );
        assert_eq!(
            single_id(ValueKind::Integer, "-5"),
            Ok(DocumentId::String("-5".into()))
        );
        assert_eq!(
            single_id(ValueKind::Numeric, "12"),
            Ok(DocumentId::String("12".into()))
        );
        assert_eq!(
            single_id(ValueKind::Numeric, "1.5"),
            Ok(DocumentId::String("1_2E5".into()))
        );
    }

    #[test]
    fn string_ids_are_escaped() {
        let id = |text| single_id(ValueKind::Text, text).map(|id| id.as_str().to_string());
        assert_eq!(id("abc-DEF123"), Ok("abc-DEF123".into()));
        assert_eq!(id("a_b"), Ok("a_5Fb".into()));
        assert_eq!(id("a b!"), Ok("a_20b_21".into()));
        assert_eq!(id("é"), Ok("_C3_A9".into()));
        assert_eq!(
            id("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
            Ok("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11".into())
        );
        assert_eq!(
            single_id(ValueKind::Text, ""),
            Err(EncodeError::EmptyId { column: "k".into() })
        );
    }

    #[test]
    fn id_length_limit_is_511_bytes() {
        assert!(single_id(ValueKind::Text, &"a".repeat(511)).is_ok());
        assert_eq!(
            single_id(ValueKind::Text, &"a".repeat(512)),
            Err(EncodeError::IdTooLong { bytes: 512 })
        );
        // 170 escaped bytes take 510, one more plain byte makes 511.
        assert!(single_id(ValueKind::Text, &format!("{}a", " ".repeat(170))).is_ok());
        assert_eq!(
            single_id(ValueKind::Text, &" ".repeat(171)),
            Err(EncodeError::IdTooLong { bytes: 513 })
        );
    }

    #[test]
    fn single_key_value_in_the_document_is_the_id() {
        let shape = shape(
            vec![
                column("code", ValueKind::Text),
                column("n", ValueKind::Integer),
            ],
            vec![0],
        );
        let (id, parsed, _) =
            document(&shape, &[ColumnValue::Text("a b"), ColumnValue::Text("-1")]);
        assert_eq!(id.as_str(), "a_20b");
        assert_eq!(parsed, json!({"code": "a_20b", "n": -1}));
        let shape = self::shape(vec![column("id", ValueKind::Integer)], vec![0]);
        let (id, parsed, _) = document(&shape, &[ColumnValue::Text("-5")]);
        assert_eq!(id, DocumentId::String("-5".into()));
        assert_eq!(parsed, json!({"id": "-5"}));
    }

    #[test]
    fn composite_ids() {
        let shape = shape(
            vec![
                column("name", ValueKind::Text),
                column("tenant", ValueKind::Integer),
                column("code", ValueKind::Text),
            ],
            vec![1, 2],
        );
        assert_eq!(shape.primary_key_attribute(), "_pk");
        let (id, parsed, text) = document(
            &shape,
            &[
                ColumnValue::Text("n"),
                ColumnValue::Text("42"),
                ColumnValue::Text("a_b c"),
            ],
        );
        assert_eq!(id, DocumentId::String("42__a_5Fb_20c".into()));
        assert!(text.starts_with(r#"{"_pk":"42__a_5Fb_20c","name""#));
        assert_eq!(
            parsed,
            json!({"_pk": "42__a_5Fb_20c", "name": "n", "tenant": 42, "code": "a_b c"})
        );
        assert_eq!(encode_id(&shape, &["42", "a_b c"]), Ok(id));
        assert_eq!(
            encode_id(&shape, &["", ""]),
            Ok(DocumentId::String("__".into()))
        );
        assert_eq!(
            encode_id(
                &shape,
                &["x".repeat(254).as_str(), "y".repeat(255).as_str()]
            ),
            Ok(DocumentId::String(
                format!("{}__{}", "x".repeat(254), "y".repeat(255)).into()
            ))
        );
        assert_eq!(
            encode_id(
                &shape,
                &["x".repeat(255).as_str(), "y".repeat(255).as_str()]
            ),
            Err(EncodeError::IdTooLong { bytes: 512 })
        );
        assert_eq!(
            encode_id(&shape, &["1"]),
            Err(EncodeError::ValueCount {
                expected: 2,
                got: 1
            })
        );
    }

    #[test]
    fn id_escaping_is_reversible() {
        const ALPHABET: &[char] = &['a', 'Z', '0', '9', '-', '_', ' ', '/', 'é', '🎉', '\u{1}'];
        let mut prng = Prng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..2000 {
            let components: Vec<String> = (0..1 + prng.below(3))
                .map(|_| {
                    (0..prng.below(8))
                        .map(|_| ALPHABET[prng.below(ALPHABET.len())])
                        .collect()
                })
                .collect();
            let mut joined = String::new();
            for (position, component) in components.iter().enumerate() {
                if position > 0 {
                    joined.push_str("__");
                }
                let mut escaped = String::new();
                escape_id_component(component, &mut escaped);
                assert!(escaped
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
                assert!(!escaped.contains("__"), "{escaped}");
                assert_eq!(decode_id_component(&escaped).as_ref(), Some(component));
                joined.push_str(&escaped);
            }
            if components.len() > 1 {
                assert_eq!(key_of_id(&joined, components.len()), Some(components));
            }
        }
    }

    #[test]
    fn decoding_refuses_what_escaping_never_writes() {
        for text in ["a_5", "a_2g", "a_41", "a b", "_5f", "_C3"] {
            assert_eq!(decode_id_component(text), None, "{text}");
        }
    }

    #[test]
    fn key_errors() {
        let shape = shape(
            vec![
                column("id", ValueKind::Integer),
                column("x", ValueKind::Text),
            ],
            vec![0],
        );
        let mut out = b"kept".to_vec();
        let error = encode_document(
            &shape,
            &[ColumnValue::Null, ColumnValue::Text("x")],
            &mut out,
        );
        assert_eq!(
            error,
            Err(EncodeError::NullKey {
                column: "id".into()
            })
        );
        let error = encode_document(
            &shape,
            &[ColumnValue::Unchanged, ColumnValue::Null],
            &mut out,
        );
        assert_eq!(
            error,
            Err(EncodeError::UnchangedKey {
                column: "id".into()
            })
        );
        let error = encode_document(&shape, &[ColumnValue::Text("1")], &mut out);
        assert_eq!(
            error,
            Err(EncodeError::ValueCount {
                expected: 2,
                got: 1
            })
        );
        assert_eq!(out, b"kept");
        assert!(EncodeError::NullKey {
            column: "id".into()
        }
        .to_string()
        .contains("\"id\" is NULL"));
    }

    #[test]
    fn shape_errors() {
        let columns = || {
            vec![
                column("a", ValueKind::Integer),
                column("_pk", ValueKind::Text),
            ]
        };
        assert_eq!(
            DocumentShape::new(columns(), vec![]).err(),
            Some(EncodeError::NoKeyColumns)
        );
        assert_eq!(
            DocumentShape::new(columns(), vec![2]).err(),
            Some(EncodeError::KeyColumnOutOfRange {
                index: 2,
                columns: 2
            })
        );
        assert_eq!(
            DocumentShape::new(columns(), vec![0, 0]).err(),
            Some(EncodeError::DuplicateKeyColumn { column: "a".into() })
        );
        assert_eq!(
            DocumentShape::new(columns(), vec![0, 1]).err(),
            Some(EncodeError::ReservedColumnName {
                column: "_pk".into()
            })
        );
        assert_eq!(
            DocumentShape::new(
                vec![column("a", ValueKind::Text), column("a", ValueKind::Text)],
                vec![0]
            )
            .err(),
            Some(EncodeError::DuplicateColumnName { column: "a".into() })
        );
        assert_eq!(shape(columns(), vec![1]).primary_key_attribute(), "_pk");
    }

    #[test]
    fn random_rows_give_valid_json() {
        let kinds = [
            ValueKind::Integer,
            ValueKind::Float,
            ValueKind::Numeric,
            ValueKind::Bool,
            ValueKind::Text,
            ValueKind::Json,
            ValueKind::Timestamp,
            ValueKind::TimestampTz,
            ValueKind::Date,
            ValueKind::Time,
            ValueKind::TimeTz,
            ValueKind::Bytea,
            array(ValueKind::Text),
            array(ValueKind::Integer),
            array(ValueKind::Json),
            ValueKind::Other,
        ];
        let samples = [
            "1",
            "-1",
            "1.5",
            "NaN",
            "Infinity",
            "1e400",
            "t",
            "f",
            "",
            "NULL",
            "{}",
            "{1,2}",
            "{\"a\\\"\",NULL}",
            "{{1},{2}}",
            "{",
            "\"",
            "\\",
            "\\x00ff",
            "\\x0",
            "[1, {\"a\": 2}]",
            "2024-05-01 10:00:00+05:30",
            "2024-05-01",
            "10:00:00-08",
            "infinity",
            "0001-01-01 BC",
            "a\u{0}b",
            "\u{1f}\u{7f}🎉",
            "{\"\\\\\"}",
            "[0:0]={x}",
            "x y z",
        ];
        let json_samples = [
            "1",
            "null",
            "\"a\\nb\"",
            "{\"a\": [1, {\"b\": null}]}",
            "[\n1\n]",
        ];
        let json_array_samples = ["{}", "{NULL}", "{1,\"{\\\"a\\\": 1}\",\"[]\"}"];
        let mut prng = Prng(42);
        for _ in 0..500 {
            let columns: Vec<Column> = (0..1 + prng.below(6))
                .map(|i| column(&format!("c{i}"), kinds[prng.below(kinds.len())].clone()))
                .collect();
            let count = columns.len();
            let keys = if count > 1 && prng.below(2) == 0 {
                vec![0, count - 1]
            } else {
                vec![0]
            };
            let shape = shape(columns, keys);
            let values: Vec<ColumnValue> = (0..count)
                .map(|i| {
                    // Postgres only ever outputs valid JSON for json columns.
                    let sample = match &shape.columns()[i].kind {
                        ValueKind::Json => json_samples[prng.below(json_samples.len())],
                        ValueKind::Array(element) if **element == ValueKind::Json => {
                            json_array_samples[prng.below(json_array_samples.len())]
                        }
                        _ => samples[prng.below(samples.len())],
                    };
                    match prng.below(6) {
                        0 if !shape.key_columns().contains(&i) => ColumnValue::Null,
                        1 if !shape.key_columns().contains(&i) => ColumnValue::Unchanged,
                        _ if sample.is_empty() && shape.key_columns() == [i] => {
                            ColumnValue::Text("k")
                        }
                        _ => ColumnValue::Text(sample),
                    }
                })
                .collect();
            let mut out = Vec::new();
            let id = encode_document(&shape, &values, &mut out).expect("keys are set");
            let parsed: Value = serde_json::from_slice(&out).unwrap_or_else(|e| {
                panic!("{values:?} gave {}: {e}", String::from_utf8_lossy(&out))
            });
            let key_field = &parsed[shape.primary_key_attribute()];
            match &id {
                DocumentId::Number(digits) => assert_eq!(key_field.to_string(), *digits),
                DocumentId::String(text) => assert_eq!(key_field, &json!(text)),
            }
        }
    }

    #[test]
    fn escaping_matches_serde_json_at_every_position() {
        const ALPHABET: &[&str] = &[
            "a", "Z", " ", "\"", "\\", "\n", "\r", "\t", "\u{8}", "\u{c}", "\u{0}", "\u{1f}",
            "\u{7f}", "é", "✓", "🦀", "\u{2028}", "/",
        ];
        let mut prng = Prng(0x5eed);
        for _ in 0..3000 {
            let text: String = (0..prng.below(40))
                .map(|_| ALPHABET[prng.below(ALPHABET.len())])
                .collect();
            let mut out = Vec::new();
            write_string(&mut out, &text);
            let expected = serde_json::to_string(&text).expect("serializes");
            assert_eq!(String::from_utf8(out).expect("UTF-8"), expected, "{text:?}");
        }
        // One escape at each offset around the 8-byte words, and runs of them.
        for len in 0..20 {
            for at in 0..len {
                for special in ["\"", "\\", "\u{1}", "\u{1f}", "é"] {
                    let mut text = "x".repeat(len);
                    text.replace_range(at..=at, special);
                    let mut out = Vec::new();
                    write_string(&mut out, &text);
                    let expected = serde_json::to_string(&text).expect("serializes");
                    assert_eq!(String::from_utf8(out).expect("UTF-8"), expected);
                }
            }
        }
        let mut out = Vec::new();
        write_string(
            &mut out,
            "\"\"\"\"\"\"\"\"\\\\\\\\\\\\\\\\\u{0}\u{1}\u{2}\u{3}\u{4}\u{5}\u{6}\u{7}",
        );
        assert_eq!(
            out,
            br#""\"\"\"\"\"\"\"\"\\\\\\\\\\\\\\\\\u0000\u0001\u0002\u0003\u0004\u0005\u0006\u0007""#
        );
    }

    #[test]
    fn embedded_json_line_breaks_become_spaces() {
        let mut out = b"x".to_vec();
        write_value(&mut out, &ValueKind::Json, "[\r\n1,\n\"a\\nb\"]");
        assert_eq!(out, br#"x[  1, "a\nb"]"#);
    }

    #[test]
    fn ids_write_as_json() {
        let mut out = Vec::new();
        DocumentId::Number("5".into()).write_json(&mut out);
        out.push(b',');
        DocumentId::String("a-b".into()).write_json(&mut out);
        assert_eq!(out, b"5,\"a-b\"");
    }

    #[test]
    fn geo_fields_follow_meilisearch_rules() {
        let shape = DocumentShape::new(
            vec![
                Column {
                    name: "id".into(),
                    kind: ValueKind::Integer,
                },
                Column {
                    name: "_geo".into(),
                    kind: ValueKind::Json,
                },
            ],
            vec![0],
        )
        .expect("shape");
        let check = |geo: ColumnValue| check_geo(&shape, &[ColumnValue::Text("1"), geo]);
        for good in [
            r#"{"lat": 48.8, "lng": 2.35}"#,
            r#"{"lat": "1e2", "lng": "-3"}"#,
            "null",
        ] {
            assert_eq!(check(ColumnValue::Text(good)), Ok(()), "{good}");
        }
        assert_eq!(check(ColumnValue::Null), Ok(()));
        for bad in [
            r#""abc""#,
            r#"{"lat": 1}"#,
            r#"{"lat": "north", "lng": 2}"#,
            r#"{"lat": 1, "lng": 2, "alt": 3}"#,
            "[1, 2]",
        ] {
            let error = check(ColumnValue::Text(bad)).expect_err(bad);
            assert_eq!(error.code(), "invalid_document_geo_field", "{bad}");
        }
    }

    /// A shape with an integer key, a text column and a `_geo` column, and a row of it.
    fn geo_shape() -> DocumentShape {
        shape(
            vec![
                column("id", ValueKind::Integer),
                column("name", ValueKind::Text),
                column("_geo", ValueKind::Json),
            ],
            vec![0],
        )
    }

    #[test]
    fn a_good_row_is_its_document_and_id() {
        let shape = geo_shape();
        let mut out = b"{}\n".to_vec();
        let values = [
            ColumnValue::Text("7"),
            ColumnValue::Text("kettle"),
            ColumnValue::Text(r#"{"lat": 1, "lng": 2}"#),
        ];
        let id = encode_row(&shape, &values, &mut out).expect("a document");
        assert_eq!(id, DocumentId::Number("7".into()));
        assert_eq!(
            out,
            b"{}\n{\"id\":7,\"name\":\"kettle\",\"_geo\":{\"lat\": 1, \"lng\": 2}}"
        );
        let mut without_geo = Vec::new();
        let values = [ColumnValue::Text("8"), ColumnValue::Null, ColumnValue::Null];
        assert!(encode_row(&shape, &values, &mut without_geo).is_ok());
        assert_eq!(without_geo, br#"{"id":8,"name":null,"_geo":null}"#);
    }

    #[test]
    fn embedder_columns_are_entries_of_vectors() {
        let shape = DocumentShape::new(
            vec![
                column("id", ValueKind::Integer),
                column("embedding", ValueKind::Vector("default".into())),
                column("name", ValueKind::Text),
                column("mini", ValueKind::Vector("small".into())),
            ],
            vec![0],
        )
        .unwrap();
        assert!(shape.has_vectors());
        let encode = |values: &[ColumnValue]| {
            let mut out = Vec::new();
            encode_row(&shape, values, &mut out).unwrap();
            String::from_utf8(out).unwrap()
        };
        let id = ColumnValue::Text("7");
        let name = ColumnValue::Text("kettle");
        assert_eq!(
            encode(&[id, ColumnValue::Text("[1,2,3]"), name, ColumnValue::Null]),
            r#"{"id":7,"name":"kettle","_vectors":{"default":{"embeddings":[1,2,3],"regenerate":false},"small":null}}"#
        );
        // An UPDATE that left a TOASTed embedding alone: no entry for it, no field without any.
        assert_eq!(
            encode(&[id, ColumnValue::Unchanged, name, ColumnValue::Text("[0.5]")]),
            r#"{"id":7,"name":"kettle","_vectors":{"small":{"embeddings":[0.5],"regenerate":false}}}"#
        );
        assert_eq!(
            encode(&[id, ColumnValue::Unchanged, name, ColumnValue::Unchanged]),
            r#"{"id":7,"name":"kettle"}"#
        );
    }

    #[test]
    fn a_postgis_column_is_written_as_geo_or_geojson_by_value() {
        let shape = DocumentShape::new(
            vec![
                column("id", ValueKind::Integer),
                column("_geo", ValueKind::Geometry),
            ],
            vec![0],
        )
        .unwrap();
        let encode = |value: ColumnValue| {
            let mut out = Vec::new();
            let result = encode_row(&shape, &[ColumnValue::Text("7"), value], &mut out);
            (result.map(|_| ()), String::from_utf8(out).unwrap())
        };
        // SELECT 'SRID=4326;POINT(2.2945 48.8584)'::geometry
        let point = encode(ColumnValue::Text(
            "0101000020E61000004260E5D0225B024076711B0DE06D4840",
        ));
        assert_eq!(
            point,
            (
                Ok(()),
                r#"{"id":7,"_geo":{"lat":48.8584,"lng":2.2945}}"#.to_owned()
            )
        );
        // SELECT 'SRID=4326;LINESTRING(1 2, 3 4)'::geometry
        let line = encode(ColumnValue::Text(
            "0102000020E610000002000000000000000000F03F000000000000004000000000000008400000000000001040",
        ));
        assert_eq!(
            line,
            (
                Ok(()),
                r#"{"id":7,"_geojson":{"coordinates":[[1.0,2.0],[3.0,4.0]],"type":"LineString"}}"#
                    .to_owned()
            )
        );
        assert_eq!(
            encode(ColumnValue::Null),
            (Ok(()), r#"{"id":7,"_geo":null}"#.to_owned())
        );
        // SELECT 'SRID=3857;POINT(1 2)'::geometry: a dead letter holding the value's text.
        let (result, document) = encode(ColumnValue::Text(
            "0101000020110F0000000000000000F03F0000000000000040",
        ));
        let error = result.unwrap_err();
        assert_eq!(error.code(), "invalid_document_geo_field");
        assert!(error.to_string().contains("SRID 3857"), "{error}");
        assert_eq!(
            document,
            r#"{"id":7,"_geo":"0101000020110F0000000000000000F03F0000000000000040"}"#
        );
    }

    #[test]
    fn a_bad_geo_is_a_dead_letter_with_the_whole_document() {
        let shape = geo_shape();
        let mut out = Vec::new();
        let values = [
            ColumnValue::Text("7"),
            ColumnValue::Text("kettle"),
            ColumnValue::Text(r#"{"lat": "north", "lng": 2}"#),
        ];
        let error = encode_row(&shape, &values, &mut out).expect_err("a dead letter");
        assert_eq!(error.code(), "invalid_document_geo_field");
        assert_eq!(
            error.to_string(),
            "invalid _geo field: lat must be a finite number, got \"north\""
        );
        assert_eq!(
            out, br#"{"id":7,"name":"kettle","_geo":{"lat": "north", "lng": 2}}"#,
            "kept for the dead letter"
        );
    }

    #[test]
    fn every_dead_letter_reason_of_a_row() {
        let int_key = geo_shape();
        let text_key = shape(
            vec![
                column("sku", ValueKind::Text),
                column("_geo", ValueKind::Json),
            ],
            vec![0],
        );
        // 2 bytes each, escaped to 6: 600 bytes.
        let long = "é".repeat(100);
        let bad_geo = ColumnValue::Text(r#""somewhere""#);
        let cases: [(&DocumentShape, Vec<ColumnValue>, &str, EncodeError); 6] = [
            (
                &int_key,
                vec![ColumnValue::Null, ColumnValue::Null, ColumnValue::Null],
                "missing_document_id",
                EncodeError::NullKey {
                    column: "id".into(),
                },
            ),
            (
                &int_key,
                vec![ColumnValue::Unchanged, ColumnValue::Null, ColumnValue::Null],
                "missing_document_id",
                EncodeError::UnchangedKey {
                    column: "id".into(),
                },
            ),
            (
                &text_key,
                vec![ColumnValue::Text(""), ColumnValue::Null],
                "invalid_document_id",
                EncodeError::EmptyId {
                    column: "sku".into(),
                },
            ),
            (
                &text_key,
                vec![ColumnValue::Text(&long), ColumnValue::Null],
                "invalid_document_id",
                EncodeError::IdTooLong { bytes: 600 },
            ),
            (
                &int_key,
                vec![ColumnValue::Text("1")],
                "invalid_document",
                EncodeError::ValueCount {
                    expected: 3,
                    got: 1,
                },
            ),
            // A key error wins over a bad `_geo` in the same row: there is no id to report.
            (
                &int_key,
                vec![ColumnValue::Null, ColumnValue::Null, bad_geo],
                "missing_document_id",
                EncodeError::NullKey {
                    column: "id".into(),
                },
            ),
        ];
        for (shape, values, code, expected) in cases {
            let mut out = b"kept".to_vec();
            let error = encode_row(shape, &values, &mut out);
            assert_eq!(error.as_ref().err(), Some(&expected), "{values:?}");
            assert_eq!(expected.code(), code, "{values:?}");
            assert_eq!(out, b"kept", "nothing appended without an id: {values:?}");
        }
    }
}
