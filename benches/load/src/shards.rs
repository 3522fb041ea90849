//! Load mode `shards`: a task spreading its index over `servers` Meilisearch servers of its own
//! (option `shards`), all on this machine. Prints the copy's and a stream's throughput (documents
//! per second into all shards together) against the same-run ceiling: the same documents, each
//! posted straight to its shard, every shard at once. Then the search throughput of `meili_search`
//! on the sharded task (pgbench) against the same federated search posted straight to one shard
//! (wrk), with the same clients for the same time.

use std::time::Duration;

use pg_meili_sync_core::document::shard::shard_of;
use pg_meili_sync_core::meili::network::federated_search_body;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{products, wait_for};
use serde_json::{json, Value};

use crate::replicas::{kind_of, post_parts_at_once, resume_after_backlog, start_on_products};
use crate::search::{direct_post, pgbench};

/// The documents of rows `from..=to`, each in the part of its shard.
fn parts_by_shard(names: &[String], from: i64, to: i64) -> Vec<Vec<String>> {
    let mut parts = vec![Vec::new(); names.len()];
    for id in from..=to {
        let shard = shard_of(&id.to_string(), names).unwrap_or(0);
        parts[shard].push(products::expected_document(id, 1).to_string());
    }
    parts
}

/// Documents per second into all shards together when each part is posted straight to its shard.
fn ceiling(servers: &[Meili], parts: &[Vec<String>]) -> f64 {
    let slices: Vec<&[String]> = parts.iter().map(Vec::as_slice).collect();
    let seconds = post_parts_at_once(servers, &slices);
    let total: usize = parts.iter().map(Vec::len).sum();
    let rate = total as f64 / seconds;
    println!(
        "ceiling           {rate:.0} docs/s (the same {total} documents, each posted straight to its shard, every shard at once, in {seconds:.2} s)"
    );
    rate
}

fn all_shards_hold(servers: &[Meili], index: &str, rows: i64) {
    wait_for("every row on its shard", Duration::from_secs(3600), || {
        let held: u64 = servers
            .iter()
            .map(|meili| meili.document_count(index).unwrap_or(0))
            .sum();
        (held == rows as u64).then_some(())
    });
}

pub fn shards(count: usize, rows: i64, stream_rows: i64, search_seconds: u64) {
    let servers: Vec<Meili> = (0..count.max(1))
        .map(|_| Meili::own_shard().expect("shards need servers of their own: unset MEILI_URL"))
        .collect();
    let names: Vec<String> = (0..servers.len()).map(|n| format!("ms-{n}")).collect();
    let shards: Vec<Value> = servers
        .iter()
        .zip(&names)
        .map(|(meili, name)| meili.shard(name))
        .collect();
    let (cluster, task, index, started) = start_on_products(
        &servers[0],
        rows,
        "shards_load",
        &json!({ "shards": shards }),
    );
    all_shards_hold(&servers, &index, rows);
    let copy_seconds = started.elapsed().as_secs_f64();
    let target = kind_of(&servers[0]);
    println!(
        "copy of {rows} rows into {count} shards on {target}: {copy_seconds:.2} s, {:.0} docs/s into all",
        rows as f64 / copy_seconds
    );
    let rate = ceiling(&servers, &parts_by_shard(&names, 1, rows));
    println!("copy/ceiling      {:.2}", rows as f64 / copy_seconds / rate);

    let (started, total) = resume_after_backlog(&cluster, task, rows, stream_rows);
    all_shards_hold(&servers, &index, total);
    let stream_seconds = started.elapsed().as_secs_f64();
    let streamed = total - rows;
    println!(
        "stream of {streamed} rows (1000-row transactions, from a backlog): {stream_seconds:.2} s, {:.0} docs/s into all",
        streamed as f64 / stream_seconds
    );
    let rate = ceiling(&servers, &parts_by_shard(&names, rows + 1, total));
    println!(
        "stream/ceiling    {:.2}",
        streamed as f64 / stream_seconds / rate
    );

    // Searching: meili_search through SQL against the same federated search posted straight to
    // the first shard, which asks the others as its remotes.
    let clients = 10;
    println!("search, {clients} clients, {search_seconds} s per query and side, limit 10:");
    println!("| query | direct federated req/s | meili_search req/s, prepared | SQL/direct | direct p50 / p99 ms | SQL p50 / p99 ms |");
    println!("|---|---|---|---|---|---|");
    let name_refs: Vec<&str> = names.iter().map(String::as_str).collect();
    for query in ["kitchen", "product 12"] {
        let body = federated_search_body(&index, &json!({"q": query, "limit": 10}), &name_refs)
            .expect("a federated search body");
        let http = direct_post(&servers[0], "/multi-search", &body, clients, search_seconds);
        let script =
            format!("SELECT count(*) FROM meili_search({task}, '{query}', '{{\"limit\": 10}}');\n");
        let sql = pgbench(
            &cluster,
            &script,
            &[
                "-M",
                "prepared",
                "-c",
                &clients.to_string(),
                "-j",
                "2",
                "-T",
                &search_seconds.to_string(),
            ],
        );
        println!(
            "| `{query}` | {:.0} | {:.0} | {:.2} | {:.2} / {:.2} | {:.2} / {:.2} |",
            http.per_second,
            sql.per_second,
            sql.per_second / http.per_second,
            http.p50,
            http.p99,
            sql.p50,
            sql.p99
        );
    }
}
