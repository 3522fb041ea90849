//! Load mode `replicas`: a task writing to `servers` Meilisearch servers of its own (option
//! `replicas`), all on this machine. Prints the copy's and then a stream's throughput (documents
//! per second into every replica) against the same-run ceiling: the same documents posted straight
//! to every server at once, each server's tasks all enqueued at once.

use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{products, wait_for};
use serde_json::{json, Value};

use crate::ndjson_bodies;

const BATCH_SIZE: usize = 10_000;

/// Posts `documents` to every server at once, `BATCH_SIZE` per task; returns documents per second
/// (into each server) until every server has indexed them all.
fn ceiling_on_all(servers: &[Meili], documents: &[String]) -> f64 {
    let bodies = ndjson_bodies(documents, BATCH_SIZE);
    let index = servers[0].unique_index("replicas_ceiling");
    let started = Instant::now();
    std::thread::scope(|scope| {
        for meili in servers {
            let (bodies, index) = (&bodies, &index);
            scope.spawn(move || {
                let enqueued: Vec<u64> = bodies
                    .iter()
                    .map(|body| {
                        meili
                            .post_ndjson(index, body.clone())
                            .expect("post a batch")
                    })
                    .collect();
                for uid in enqueued {
                    meili.wait_task(uid, Duration::from_secs(3600));
                }
            });
        }
    });
    let seconds = started.elapsed().as_secs_f64();
    for meili in servers {
        meili.delete_index(&index);
    }
    let rate = documents.len() as f64 / seconds;
    println!(
        "ceiling           {rate:.0} docs/s (the same {} documents posted straight to each of the {} servers at once, in {seconds:.2} s)",
        documents.len(),
        servers.len()
    );
    rate
}

fn every_server_has(servers: &[Meili], index: &str, rows: i64) {
    wait_for(
        "every row on every server",
        Duration::from_secs(3600),
        || {
            servers
                .iter()
                .all(|meili| meili.document_count(index) == Some(rows as u64))
                .then_some(())
        },
    );
}

pub fn replicas(count: usize, rows: i64, stream_rows: i64) {
    let servers: Vec<Meili> = (0..count.max(1))
        .map(|_| Meili::own().expect("replicas need servers of their own: unset MEILI_URL"))
        .collect();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, rows));
    cluster.psql("VACUUM ANALYZE products");
    let index = servers[0].unique_index("replicas_load");
    let replicas: Vec<Value> = servers.iter().map(Meili::replica).collect();
    let options = json!({ "replicas": replicas }).to_string();
    let started = Instant::now();
    let task: i64 = cluster
        .psql(&format!(
            "SELECT meili_sync_start('products', '{index}', '{options}')"
        ))
        .parse()
        .expect("task id");
    every_server_has(&servers, &index, rows);
    let copy_seconds = started.elapsed().as_secs_f64();
    let target = if servers[0].test_server().is_some() {
        "test servers"
    } else {
        "real Meilisearch servers"
    };
    println!(
        "copy of {rows} rows into {count} {target}: {copy_seconds:.2} s, {:.0} docs/s into each",
        rows as f64 / copy_seconds
    );
    let documents: Vec<String> = (1..=rows)
        .map(|id| products::expected_document(id, 1).to_string())
        .collect();
    let rate = ceiling_on_all(&servers, &documents);
    println!("copy/ceiling      {:.2}", rows as f64 / copy_seconds / rate);

    // A stream from a backlog: committed while the task is paused, timed from its resume.
    cluster.psql(&format!("SELECT meili_sync_pause({task})"));
    let script: String = (0..stream_rows / 1_000)
        .map(|n| {
            format!(
                "{};\n",
                products::insert_sql(rows + n * 1_000 + 1, rows + (n + 1) * 1_000)
            )
        })
        .collect();
    cluster.psql_script(&script);
    let started = Instant::now();
    cluster.psql(&format!("SELECT meili_sync_resume({task})"));
    let total = rows + stream_rows / 1_000 * 1_000;
    every_server_has(&servers, &index, total);
    let stream_seconds = started.elapsed().as_secs_f64();
    let streamed = total - rows;
    println!("stream of {streamed} rows (1000-row transactions, from a backlog): {stream_seconds:.2} s, {:.0} docs/s into each", streamed as f64 / stream_seconds);
    let documents: Vec<String> = (rows + 1..=total)
        .map(|id| products::expected_document(id, 1).to_string())
        .collect();
    let rate = ceiling_on_all(&servers, &documents);
    println!(
        "stream/ceiling    {:.2}",
        streamed as f64 / stream_seconds / rate
    );
}
