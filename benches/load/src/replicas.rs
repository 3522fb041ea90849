//! Load mode `replicas`: a task writing to `servers` Meilisearch servers of its own (option
//! `replicas`), all on this machine. Prints the copy's and then a stream's throughput (documents
//! per second into every replica) against the same-run ceiling: the same documents posted straight
//! to every server at once, each server's tasks all enqueued at once.

use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{products, start_with_options, wait_for};
use serde_json::{json, Value};

use crate::ndjson_bodies;

const BATCH_SIZE: usize = 10_000;

/// Posts `documents` to every server at once, `BATCH_SIZE` per task; returns documents per second
/// (into each server) until every server has indexed them all.
fn ceiling_on_all(servers: &[Meili], documents: &[String]) -> f64 {
    let parts: Vec<&[String]> = servers.iter().map(|_| documents).collect();
    let seconds = post_parts_at_once(servers, &parts);
    let rate = documents.len() as f64 / seconds;
    println!(
        "ceiling           {rate:.0} docs/s (the same {} documents posted straight to each of the {} servers at once, in {seconds:.2} s)",
        documents.len(),
        servers.len()
    );
    rate
}

/// Posts `parts[i]` to `servers[i]`, every server at once, `BATCH_SIZE` per task, into a fresh
/// index; returns the seconds until every server has indexed its part.
pub fn post_parts_at_once(servers: &[Meili], parts: &[&[String]]) -> f64 {
    let index = servers[0].unique_index("ceiling");
    let bodies: Vec<Vec<Vec<u8>>> = parts
        .iter()
        .map(|part| ndjson_bodies(part, BATCH_SIZE))
        .collect();
    let started = Instant::now();
    std::thread::scope(|scope| {
        for (meili, bodies) in servers.iter().zip(&bodies) {
            let index = &index;
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
    seconds
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

/// A cluster with `rows` products and a task started on them with `options`: the cluster, the
/// task, its index (named after `prefix`), and when the task was started.
pub fn start_on_products(
    first: &Meili,
    rows: i64,
    prefix: &str,
    options: &Value,
) -> (Cluster, i64, String, Instant) {
    let cluster = Cluster::start(&["max_connections = 100"]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, rows));
    cluster.psql("VACUUM ANALYZE products");
    let index = first.unique_index(prefix);
    let started = Instant::now();
    let task = start_with_options(&cluster, None, "products", &index, &options.to_string());
    (cluster, task, index, started)
}

/// What the servers are, for the figures' labels.
pub fn kind_of(meili: &Meili) -> &'static str {
    if meili.test_server().is_some() {
        "test servers"
    } else {
        "real Meilisearch servers"
    }
}

/// A stream from a backlog: rows after `rows`, in 1000-row transactions, committed while the task
/// is paused; returns when the task was resumed, and the rows the table then has.
pub fn resume_after_backlog(
    cluster: &Cluster,
    task: i64,
    rows: i64,
    stream_rows: i64,
) -> (Instant, i64) {
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
    (started, rows + stream_rows / 1_000 * 1_000)
}

pub fn replicas(count: usize, rows: i64, stream_rows: i64) {
    let servers: Vec<Meili> = (0..count.max(1))
        .map(|_| Meili::own().expect("replicas need servers of their own: unset MEILI_URL"))
        .collect();
    let replicas: Vec<Value> = servers.iter().map(Meili::replica).collect();
    let (cluster, task, index, started) = start_on_products(
        &servers[0],
        rows,
        "replicas_load",
        &json!({ "replicas": replicas }),
    );
    every_server_has(&servers, &index, rows);
    let copy_seconds = started.elapsed().as_secs_f64();
    let target = kind_of(&servers[0]);
    println!(
        "copy of {rows} rows into {count} {target}: {copy_seconds:.2} s, {:.0} docs/s into each",
        rows as f64 / copy_seconds
    );
    let documents: Vec<String> = (1..=rows)
        .map(|id| products::expected_document(id, 1).to_string())
        .collect();
    let rate = ceiling_on_all(&servers, &documents);
    println!("copy/ceiling      {:.2}", rows as f64 / copy_seconds / rate);

    let (started, total) = resume_after_backlog(&cluster, task, rows, stream_rows);
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
