//! The `products` data set: rows generated in SQL from their id, and, computed independently in
//! Rust from the same id, the document each row must become in Meilisearch.

use serde_json::{json, Value};

pub const CREATE_TABLE: &str = "CREATE TABLE products (
    id bigint PRIMARY KEY,
    name text NOT NULL,
    description text,
    category text,
    price numeric(10,2),
    in_stock boolean,
    tags text[],
    meta jsonb,
    updated_at timestamptz,
    version int NOT NULL DEFAULT 1
)";

const CATEGORIES: [&str; 4] = ["kitchen", "office", "outdoor", "garden"];
const COLORS: [&str; 3] = ["red", "blue", "green"];

/// INSERTs rows `from..=to`.
pub fn insert_sql(from: i64, to: i64) -> String {
    format!(
        "INSERT INTO products (id, name, description, category, price, in_stock, tags, meta, updated_at, version)
         SELECT i,
                'Product ' || i,
                CASE WHEN i % 10 = 0 THEN NULL ELSE 'Déscription \"' || i || E'\"\\\\ with ünïcødé ✓\\tand tab' END,
                (ARRAY['kitchen','office','outdoor','garden'])[1 + i % 4],
                ((i % 1000) * 137 + 99) / 100.0,
                i % 3 <> 0,
                CASE WHEN i % 7 = 0 THEN ARRAY[]::text[] ELSE ARRAY['t' || (i % 5), 'u' || (i % 11)] END,
                jsonb_build_object('color', (ARRAY['red','blue','green'])[1 + i % 3], 'size', i % 10,
                                   'nested', jsonb_build_object('k', i, 'list', jsonb_build_array(1, 'a', null))),
                timestamptz '2024-01-01 00:00:00+00' + i * interval '1 minute',
                1
           FROM generate_series({from}, {to}) AS i"
    )
}

/// The document row `id` must become (with `version` as stored).
pub fn expected_document(id: i64, version: i64) -> Value {
    let cents = (id % 1000) * 137 + 99;
    let price: f64 = format!("{}.{:02}", cents / 100, cents % 100)
        .parse()
        .unwrap_or_default();
    let description = if id % 10 == 0 {
        Value::Null
    } else {
        json!(format!("Déscription \"{id}\"\\ with ünïcødé ✓\tand tab"))
    };
    let tags = if id % 7 == 0 {
        json!([])
    } else {
        json!([format!("t{}", id % 5), format!("u{}", id % 11)])
    };
    json!({
        "id": id,
        "name": format!("Product {id}"),
        "description": description,
        "category": CATEGORIES[(id % 4) as usize],
        "price": price,
        "in_stock": id % 3 != 0,
        "tags": tags,
        "meta": {"color": COLORS[(id % 3) as usize], "size": id % 10, "nested": {"k": id, "list": [1, "a", null]}},
        "updated_at": timestamp_after_2024(id),
        "version": version,
    })
}

/// 2024-01-01T00:00:00Z plus `minutes`, in the encoder's ISO 8601 form.
pub fn timestamp_after_2024(minutes: i64) -> String {
    let days = minutes / 1440;
    let (hour, minute) = ((minutes % 1440) / 60, minutes % 60);
    let (year, month, day) = civil_from_days(days_from_civil(2024, 1, 1) + days);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:00Z")
}

// Howard Hinnant's date algorithms.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Compares the index with the documents of rows `1..=rows` (all at `version`): every id present
/// once, no extra id, every body equal. Returns a description of the first differences.
pub fn diff_index(documents: &[Value], rows: i64, version: i64) -> Result<(), String> {
    let mut by_id = std::collections::BTreeMap::new();
    for document in documents {
        let Some(id) = document["id"].as_i64() else {
            return Err(format!("document without integer id: {document}"));
        };
        if by_id.insert(id, document).is_some() {
            return Err(format!("id {id} twice"));
        }
    }
    let mut problems = Vec::new();
    for id in 1..=rows {
        match by_id.remove(&id) {
            None => problems.push(format!("missing id {id}")),
            Some(document) => {
                let expected = expected_document(id, version);
                if !same_json(document, &expected) {
                    problems.push(format!(
                        "id {id} differs:\n  got      {document}\n  expected {expected}"
                    ));
                }
            }
        }
        if problems.len() >= 5 {
            break;
        }
    }
    if let Some((id, _)) = by_id.iter().next() {
        problems.push(format!("{} extra documents, e.g. id {id}", by_id.len()));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "index has {} documents, table {rows} rows:\n{}",
            documents.len(),
            problems.join("\n")
        ))
    }
}

/// JSON equality with numbers compared as f64 (Meilisearch may print 12.3 as 12.3 or 12.30).
fn same_json(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_json(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        _ => a == b,
    }
}

/// The table's rows as Postgres itself turns them into JSON (`to_jsonb`), keyed by id: an oracle
/// that does not share code with the extension's encoder. Timestamps are written the way the
/// encoder documents them (`Z` for UTC).
pub fn table_documents(
    cluster: &crate::cluster::Cluster,
    table: &str,
) -> std::collections::BTreeMap<i64, Value> {
    let rows = cluster.psql(&format!(
        "SET TimeZone = 'UTC'; SELECT to_jsonb(t)::text FROM {table} t ORDER BY id"
    ));
    rows.lines()
        .filter(|line| !line.is_empty() && *line != "SET")
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter_map(|document| {
            document["id"]
                .as_i64()
                .map(|id| (id, normalize_timestamps(document)))
        })
        .collect()
}

fn normalize_timestamps(value: Value) -> Value {
    match value {
        Value::String(text)
            if text.len() >= 25
                && text.ends_with("+00:00")
                && text.as_bytes().get(10) == Some(&b'T') =>
        {
            Value::String(format!("{}Z", &text[..text.len() - 6]))
        }
        Value::Array(items) => Value::Array(items.into_iter().map(normalize_timestamps).collect()),
        Value::Object(fields) => Value::Object(
            fields
                .into_iter()
                .map(|(k, v)| (k, normalize_timestamps(v)))
                .collect(),
        ),
        other => other,
    }
}

/// Compares index documents with the table's rows (from `table_documents`); None when equal.
pub fn diff_documents(
    documents: &[Value],
    table: &std::collections::BTreeMap<i64, Value>,
) -> Option<String> {
    let mut index = std::collections::BTreeMap::new();
    for document in documents {
        match document["id"].as_i64() {
            Some(id) => {
                index.insert(id, document.clone());
            }
            None => return Some(format!("document without integer id: {document}")),
        }
    }
    let mut problems = Vec::new();
    for (id, row) in table {
        match index.get(id) {
            None => problems.push(format!("missing id {id}")),
            Some(document) if !same_json(document, row) => problems.push(format!(
                "id {id} differs:\n  index {document}\n  table {row}"
            )),
            _ => {}
        }
    }
    for id in index.keys().filter(|id| !table.contains_key(id)) {
        problems.push(format!("extra id {id}"));
    }
    if problems.is_empty() {
        None
    } else {
        let count = problems.len();
        problems.truncate(5);
        Some(format!(
            "{count} differences (index {} docs, table {} rows):\n{}",
            documents.len(),
            table.len(),
            problems.join("\n")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_cross_months_and_the_leap_day() {
        assert_eq!(timestamp_after_2024(0), "2024-01-01T00:00:00Z");
        assert_eq!(timestamp_after_2024(59 * 1440 + 61), "2024-02-29T01:01:00Z");
        assert_eq!(timestamp_after_2024(366 * 1440), "2025-01-01T00:00:00Z");
    }
}
