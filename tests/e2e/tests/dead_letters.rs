//! End to end: a row the worker dead-letters (here for a `_geo` Meilisearch would refuse) is a
//! dead letter to every path that encodes rows. `meili_sync_verify` does not count it as missing
//! or different, `meili_sync_repair` does not send it, `meili_sync_preview` leaves it out, and
//! `meili_sync_retry_dead_letters` refuses it until the row is fixed. On both servers (the geo
//! check needs `_geo` filterable, as on a real Meilisearch).

use std::time::Duration;

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::{Meili, Method};
use pg_meili_sync_e2e::{products, refusal, start_task, wait_for, wait_index_matches_table};
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(300);

const GOOD_GEO: &str = r#"{"lat": 48.85, "lng": 2.35}"#;

#[test]
fn dead_lettered_rows_are_neither_missing_to_verify_nor_resent_by_repair() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql("ALTER TABLE products ADD COLUMN _geo jsonb");
    cluster.psql(&products::insert_sql(1, 200));
    cluster.psql(&format!(
        "UPDATE products SET _geo = '{GOOD_GEO}' WHERE id % 2 = 0"
    ));
    // Row 17 is poison when copied.
    cluster.psql(r#"UPDATE products SET _geo = '{"lat": "north", "lng": 2}' WHERE id = 17"#);
    let preview = cluster.psql("SELECT count(*) FROM meili_sync_preview('products', '{}', 20)");
    assert_eq!(preview, "19", "the preview leaves the poison row out");
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({"settings": {"filterableAttributes": ["_geo"]}}),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    // Streamed poison: row 42 was good (the index keeps that version), row 201 never was.
    cluster.psql(r#"UPDATE products SET _geo = '"somewhere"' WHERE id = 42"#);
    cluster.psql(
        r#"INSERT INTO products (id, name, _geo) VALUES (201, 'Poison 201', '{"lat": 1, "lng": 2, "alt": 3}')"#,
    );
    cluster.psql(&products::insert_sql(202, 210));
    let dead_letters = || {
        cluster.psql(
            "SELECT string_agg(document_id || ':' || error_code, ',' ORDER BY document_id::int) FROM meili_sync_dead_letters",
        )
    };
    let poison = "17:invalid_document_geo_field,42:invalid_document_geo_field,201:invalid_document_geo_field";
    wait_for("the poison rows as dead letters", CONVERGE, || {
        (dead_letters() == poison).then_some(())
    });
    // Rows 1–200 but 17, and 202–210.
    wait_for("the good rows in the index", CONVERGE, || {
        (meili.document_count(&index) == Some(208)).then_some(())
    });
    meili.wait_idle(&index, CONVERGE);
    cluster
        .psql("CREATE VIEW good_products AS SELECT * FROM products WHERE id NOT IN (17, 42, 201)");
    let documents = meili.all_documents(&index);
    let forty_two = documents
        .iter()
        .find(|document| document["id"] == json!(42));
    assert_eq!(
        forty_two.map(|document| document["_geo"].clone()),
        Some(json!({"lat": 48.85, "lng": 2.35})),
        "row 42's last good version stays"
    );
    let others: Vec<_> = documents
        .into_iter()
        .filter(|document| document["id"] != json!(42))
        .collect();
    assert_eq!(
        products::diff_documents(
            &others,
            &products::table_documents(&cluster, "good_products")
        ),
        None
    );

    // Real damage beside the dead letters: document 5 deleted behind the task's back.
    meili.request(
        Method::POST,
        &format!("/indexes/{index}/documents/delete-batch"),
        Some(json!([5])),
    );
    meili.wait_idle(&index, CONVERGE);
    let verify = || {
        cluster.psql(&format!(
            "SELECT rows_checked, documents_checked, missing, extra, different, sample_missing, sample_different
               FROM meili_sync_verify({task})"
        ))
    };
    assert_eq!(
        verify(),
        "210|207|1|0|0|{5}|{}",
        "only document 5 is missing: the dead letters are neither missing nor different"
    );
    let repaired = cluster.try_psql(&format!(
        "SELECT resent, deleted FROM meili_sync_repair({task})"
    ));
    assert_eq!(
        repaired,
        Ok("1|0".to_owned()),
        "repair re-sends document 5 alone"
    );
    assert_eq!(verify(), "210|208|0|0|0|{}|{}");
    assert_eq!(
        dead_letters(),
        poison,
        "repair leaves the dead letters alone"
    );

    // With the stream paused, a retry of rows still bad fails and clears nothing.
    cluster.psql(&format!("SELECT meili_sync_pause({task})"));
    let refused = refusal(
        &cluster,
        &format!("SELECT meili_sync_retry_dead_letters({task})"),
    );
    assert_eq!(refused.sqlstate, "55000", "{refused:?}");
    assert!(
        refused.message.contains("invalid_document_geo_field"),
        "{refused:?}"
    );
    assert_eq!(dead_letters(), poison);
    // Fixed, they are re-sent by the retry alone (the task is paused), and the index equals the table.
    cluster.psql(&format!(
        "UPDATE products SET _geo = '{GOOD_GEO}' WHERE id IN (17, 42, 201)"
    ));
    assert_eq!(
        cluster.psql(&format!("SELECT meili_sync_retry_dead_letters({task})")),
        "3"
    );
    assert_eq!(dead_letters(), "");
    wait_index_matches_table(&cluster, &meili, &index, "products", CONVERGE);
    cluster.psql(&format!("SELECT meili_sync_resume({task})"));
    cluster.psql(&products::insert_sql(211, 220));
    wait_index_matches_table(&cluster, &meili, &index, "products", CONVERGE);
    assert_eq!(verify(), "220|220|0|0|0|{}|{}");
}
