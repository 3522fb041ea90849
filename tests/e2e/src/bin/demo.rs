//! The demo: a throwaway cluster with pg_meili_sync preloaded, a `products` table synced into
//! Meilisearch, then what landed in the index and the status view. Set DEMO_ROWS to change the size.

use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::products;
use serde_json::json;

fn main() {
    let rows: i64 = std::env::var("DEMO_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let meili = Meili::from_env();
    match meili.test_server() {
        Some(_) => println!(
            "Meilisearch: the bundled test server at {} (set MEILI_URL to use a real one)",
            meili.url
        ),
        None => println!("Meilisearch: {}", meili.url),
    }
    let cluster = Cluster::start(&[]);
    println!(
        "PostgreSQL: throwaway cluster on port {} (socket {})",
        cluster.port,
        cluster.socket_dir.display()
    );

    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, rows));
    println!("\n{rows} rows in table products");

    let index = meili.unique_index("products_demo");
    let options =
        meili.options(json!({"settings": {"filterableAttributes": ["category", "in_stock"]}}));
    let sql = format!("SELECT meili_sync_start('products', '{index}', '{options}')");
    println!(
        "\n=> {}",
        sql.replace(meili.key.as_deref().unwrap_or("\u{0}"), "***")
    );
    let started = Instant::now();
    let task: i64 = cluster.psql(&sql).parse().expect("task id");
    cluster.wait_snapshot_done(task, Duration::from_secs(600));
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "snapshot finished in {elapsed:.2} s ({:.0} docs/s)",
        rows as f64 / elapsed
    );

    meili.wait_idle(&index, Duration::from_secs(600));
    let documents = meili.all_documents(&index);
    println!(
        "\nindex \"{index}\" holds {} documents; the first two:",
        documents.len()
    );
    for document in documents.iter().take(2) {
        println!(
            "{}",
            serde_json::to_string_pretty(document).unwrap_or_default()
        );
    }
    match products::diff_index(&documents, rows, 1) {
        Ok(()) => println!("every row of the table is in the index: every id, every document body"),
        Err(problem) => println!("MISMATCH: {problem}"),
    }

    let change = "UPDATE products SET name = 'Renamed kettle', version = 2 WHERE id = 1; DELETE FROM products WHERE id = 2";
    println!("\n=> {change}");
    let committed = Instant::now();
    cluster.psql(change);
    // Polled every 2 ms (not wait_for's 100 ms), so that the figure below is the latency.
    let deadline = committed + Duration::from_secs(60);
    let arrived = || {
        let (_, one) = meili.request(
            pg_meili_sync_e2e::meili::Method::GET,
            &format!("/indexes/{index}/documents/1"),
            None,
        );
        let (two, _) = meili.request(
            pg_meili_sync_e2e::meili::Method::GET,
            &format!("/indexes/{index}/documents/2"),
            None,
        );
        one["name"] == "Renamed kettle" && two == 404
    };
    while !arrived() {
        assert!(
            Instant::now() < deadline,
            "the change did not reach the index in 60 s"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    println!(
        "searchable {:.0} ms after COMMIT: document 1 renamed, document 2 gone",
        committed.elapsed().as_secs_f64() * 1000.0
    );

    println!("\n=> SELECT * FROM meili_sync_status;");
    let status = cluster.psql("SELECT row_to_json(s) FROM meili_sync_status s");
    let status: serde_json::Value = serde_json::from_str(&status).unwrap_or_default();
    println!(
        "{}",
        serde_json::to_string_pretty(&status).unwrap_or_default()
    );
    if std::env::var_os("DEMO_KEEP").is_some() {
        println!(
            "\nDEMO_KEEP is set: psql -h {} -p {} -U postgres; Ctrl-C to stop",
            cluster.socket_dir.display(),
            cluster.port
        );
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}
