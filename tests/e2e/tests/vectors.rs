//! End to end: the `vectors` option sends pgvector columns as user-provided embeddings in
//! `_vectors`, through the copy and the stream (a new embedding, one set to NULL, a row deleted,
//! and an UPDATE that leaves a TOASTed embedding alone, which must keep it), and the index equals
//! what SQL computes from the table (embeddings compared within a 32-bit float's precision, as
//! Meilisearch stores them). `meili_sync_verify` agrees. On a real Meilisearch, a vector search
//! through `meili_search` with a vector computed in SQL returns the rows pgvector's `<=>` orders
//! first (the test server has no vector search). Skips, saying so, without pgvector.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::{Meili, Method};
use pg_meili_sync_e2e::{assert_no_crash, cluster_with_extension, refusal, start_task};
use serde_json::{json, Value};

const CONVERGE: Duration = Duration::from_secs(300);

/// A document as compared: its fields, with each `_vectors` entry reduced to the one embedding it
/// holds (None for none), since Meilisearch returns `{"embeddings": [[...]]}` for the
/// `{"embeddings": [...]}` sent, and `{"embeddings": []}` for null.
#[derive(Debug)]
struct Compared {
    fields: Value,
    vectors: BTreeMap<String, Option<Vec<f64>>>,
}

fn compared(mut document: Value) -> Compared {
    let vectors = document
        .as_object_mut()
        .and_then(|fields| fields.remove("_vectors"))
        .and_then(|vectors| vectors.as_object().cloned())
        .unwrap_or_default()
        .into_iter()
        .map(|(embedder, entry)| {
            let embeddings = entry.get("embeddings").cloned().unwrap_or(Value::Null);
            let list = match embeddings.as_array() {
                Some(items) if items.first().is_some_and(Value::is_array) => items[0].clone(),
                _ => embeddings,
            };
            let numbers: Option<Vec<f64>> = list
                .as_array()
                .filter(|items| !items.is_empty())
                .map(|items| items.iter().filter_map(Value::as_f64).collect());
            (embedder, numbers)
        })
        .collect();
    Compared {
        fields: document,
        vectors,
    }
}

fn same(want: &Compared, have: &Compared) -> bool {
    want.fields == have.fields
        && want.vectors.len() == have.vectors.len()
        && want.vectors.iter().all(|(embedder, numbers)| {
            match (numbers, have.vectors.get(embedder).cloned().flatten()) {
                (None, None) => true,
                (Some(a), Some(b)) => {
                    a.len() == b.len()
                        && a.iter()
                            .zip(&b)
                            .all(|(a, b)| (a - b).abs() <= 1e-6 * a.abs().max(1e-6))
                }
                _ => false,
            }
        })
}

const ITEMS: &str = "SELECT jsonb_build_object('id', id, 'name', name, '_vectors', jsonb_build_object(
           'default', CASE WHEN embedding IS NULL THEN NULL ELSE jsonb_build_object('embeddings', embedding::text::jsonb, 'regenerate', false) END,
           'big', CASE WHEN big IS NULL THEN NULL ELSE jsonb_build_object('embeddings', big::text::jsonb, 'regenerate', false) END,
           'half', CASE WHEN half IS NULL THEN NULL ELSE jsonb_build_object('embeddings', half::text::jsonb, 'regenerate', false) END))::text
   FROM items";

fn expected(cluster: &Cluster) -> BTreeMap<i64, Compared> {
    cluster
        .psql(ITEMS)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .map(|document| (document["id"].as_i64().unwrap_or(-1), compared(document)))
        .collect()
}

/// Every document of the index, with its `_vectors` (Meilisearch leaves them out unless asked).
fn indexed(meili: &Meili, index: &str) -> BTreeMap<i64, Compared> {
    let mut documents = BTreeMap::new();
    loop {
        let (status, answer) = meili.request(
            Method::POST,
            &format!("/indexes/{index}/documents/fetch"),
            Some(json!({"offset": documents.len(), "limit": 1000, "retrieveVectors": true})),
        );
        assert_eq!(status, 200, "{answer}");
        let page = answer["results"].as_array().cloned().unwrap_or_default();
        let done = page.len() < 1000;
        for document in page {
            documents.insert(document["id"].as_i64().unwrap_or(-1), compared(document));
        }
        if done {
            return documents;
        }
    }
}

fn wait_index_matches(cluster: &Cluster, meili: &Meili, index: &str) {
    let deadline = Instant::now() + CONVERGE;
    loop {
        let want = expected(cluster);
        let have = indexed(meili, index);
        let wrong: Vec<String> = want
            .iter()
            .filter(|(id, document)| !have.get(id).is_some_and(|other| same(document, other)))
            .take(2)
            .map(|(id, document)| format!("{id}: want {document:?}, have {:?}", have.get(id)))
            .collect();
        if wrong.is_empty() && want.len() == have.len() {
            assert_no_crash(cluster);
            return;
        }
        assert!(
            Instant::now() < deadline,
            "index {index} does not match after {CONVERGE:?} ({} rows, {} documents): {wrong:?}\n{}",
            want.len(),
            have.len(),
            cluster.tail_log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Unit vectors at `i` degrees; rows with `i % 40 = 0` also get a 1,000-dimension embedding of
/// random numbers, which PostgreSQL stores out of line (TOAST); every row a half-precision
/// `halfvec(3)` (1/3 is rounded to 16 bits: the index must hold what pgvector prints).
fn insert_items(from: i64, to: i64) -> String {
    format!(
        "INSERT INTO items
           SELECT i, 'item ' || i, ARRAY[cos(radians(i)), sin(radians(i))]::vector,
                  CASE WHEN i % 40 = 0 THEN ARRAY(SELECT random() FROM generate_series(1, 1000) WHERE i > 0)::vector END,
                  ARRAY[i % 7 + 1, 1.0 / 3, i / 3.0]::halfvec
             FROM generate_series({from}, {to}) AS i"
    )
}

#[test]
fn embeddings_stream_into_vectors_and_a_vector_search_orders_as_pgvector_does() {
    let Some(cluster) = cluster_with_extension(
        "vector",
        "scripts/setup.sh builds pgvector for PostgreSQL 15",
    ) else {
        return;
    };
    let meili = Meili::from_env();
    cluster.psql(
        "CREATE TABLE items (id int PRIMARY KEY, name text, embedding vector(2), big vector(1000), half halfvec(3), loose vector)",
    );
    cluster.psql(&insert_items(1, 300));

    let start = |vectors: Value| {
        let options = meili.options(json!({ "vectors": vectors }));
        refusal(
            &cluster,
            &format!("SELECT meili_sync_start('items', 'items_refused', '{options}')"),
        )
    };
    let not_vector = start(json!({"default": "name"}));
    assert_eq!(not_vector.sqlstate, "0A000", "{not_vector:?}");
    assert!(
        not_vector.message.contains("not a pgvector"),
        "{not_vector:?}"
    );
    let no_dimensions = start(json!({"default": "loose"}));
    assert_eq!(no_dimensions.sqlstate, "0A000", "{no_dimensions:?}");
    assert!(
        no_dimensions.hint.contains("vector(768)"),
        "{no_dimensions:?}"
    );
    assert_eq!(start(json!({"default": "nothing"})).sqlstate, "42703");
    assert_eq!(start(json!({"default": "id"})).sqlstate, "22023");
    assert_eq!(cluster.psql("SELECT count(*) FROM meili_sync.tasks"), "0");

    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "items",
        json!({"vectors": {"default": "embedding", "big": "big", "half": "half"}, "exclude_columns": ["loose"]}),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    wait_index_matches(&cluster, &meili, &index);
    let (_, settings) = meili.request(Method::GET, &format!("/indexes/{index}/settings"), None);
    assert_eq!(
        settings["embedders"]["default"]["source"], "userProvided",
        "{settings}"
    );
    assert_eq!(
        settings["embedders"]["big"]["dimensions"], 1000,
        "{settings}"
    );
    assert_eq!(settings["embedders"]["half"]["dimensions"], 3, "{settings}");

    // Streamed: new rows, a changed embedding, one set to NULL, a row deleted, and rows whose
    // out-of-line embedding an UPDATE leaves alone (pgoutput sends no value for it).
    cluster.psql(&insert_items(301, 360));
    cluster.psql(
        "UPDATE items SET embedding = '[0.6,0.8]', half = '[0.1,0.2,0.3]' WHERE id = 5;
         UPDATE items SET embedding = NULL WHERE id = 6;
         DELETE FROM items WHERE id = 7;
         UPDATE items SET name = 'renamed ' || id WHERE id IN (40, 80, 120)",
    );
    wait_index_matches(&cluster, &meili, &index);
    assert_eq!(
        cluster.psql(&format!(
            "SELECT rows_checked || ' ' || missing || ' ' || extra || ' ' || different FROM meili_sync_verify({task})"
        )),
        "359 0 0 0"
    );
    assert_eq!(
        cluster.psql(&format!(
            "SELECT count(*) FROM meili_sync_dead_letters WHERE task = {task}"
        )),
        "0"
    );

    if meili.test_server().is_some() {
        eprintln!("vector searches skipped: the test server has no vector search (they run on a real Meilisearch)");
        return;
    }
    for degrees in [45.3, 200.6, 359.2] {
        let query = format!("ARRAY[cos(radians({degrees})), sin(radians({degrees}))]::vector");
        let want = cluster.psql(&format!(
            "SELECT string_agg(id::text, ',') FROM (SELECT id FROM items WHERE embedding IS NOT NULL
               ORDER BY embedding <=> {query} LIMIT 3) nearest"
        ));
        let have = cluster.psql(&format!(
            "SELECT string_agg(id, ',') FROM meili_search({task}, '', jsonb_build_object(
               'vector', ({query})::text::jsonb, 'limit', 3,
               'hybrid', jsonb_build_object('embedder', 'default', 'semanticRatio', 1.0)))"
        ));
        assert_eq!(have, want, "the 3 nearest to {degrees}°");
    }
}
