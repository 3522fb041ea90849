//! End to end: a real cluster with the extension preloaded, commits from a separate client, and a
//! check that the Meilisearch index holds exactly the table's rows (every id, every body).

use std::time::Duration;

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::products::{self, diff_index};
use pg_meili_sync_e2e::{wait_for, TaskStart};
use serde_json::json;

const ROWS: i64 = 200_000;
const LONG: Duration = Duration::from_secs(900);

fn setup(rows: i64) -> (Cluster, Meili) {
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, rows));
    (cluster, Meili::from_env())
}

fn assert_index_matches(cluster: &Cluster, meili: &Meili, index: &str, rows: i64) {
    meili.wait_idle(index, LONG);
    let documents = meili.all_documents(index);
    if let Err(problem) = diff_index(&documents, rows, 1) {
        panic!("{problem}\n--- server log tail ---\n{}", cluster.tail_log());
    }
}

#[test]
fn backfill_copies_every_row_exactly() {
    let (cluster, meili) = setup(ROWS);
    let (index, task) = TaskStart::on("products")
        .options(json!({"settings": {"filterableAttributes": ["category"]}}))
        .start(&cluster, &meili);
    cluster.wait_snapshot_done(task, LONG);
    assert_index_matches(&cluster, &meili, &index, ROWS);

    let status = cluster.status(task);
    assert_eq!(
        status.get("rows_copied").map(String::as_str),
        Some("200000"),
        "{status:?}"
    );
    let index_info = meili.index(&index).expect("index exists");
    assert_eq!(index_info["primaryKey"], json!("id"));
    let (_, settings) = meili.request(
        ureq::http::Method::GET,
        &format!("/indexes/{index}/settings"),
        None,
    );
    assert_eq!(settings["filterableAttributes"], json!(["category"]));
    // By default the task is in the database's shared decoding pass: one shared slot.
    let slot = cluster.psql("SELECT slot_name || ' ' || plugin FROM pg_replication_slots");
    assert!(
        slot.starts_with("meili_sync_") && slot.ends_with("_shared pgoutput"),
        "{slot}"
    );

    // The API key never reaches the server log.
    if let Some(key) = &meili.key {
        assert!(
            !cluster.server_log().contains(key.as_str()),
            "the API key appears in the server log"
        );
    }

    // Drop removes the task, its publication and (via the launcher) its slot, and the index on request.
    cluster.psql(&format!(
        "SELECT meili_sync_drop({task}, drop_index => true)"
    ));
    assert!(
        meili.index(&index).is_none(),
        "index still there after drop_index"
    );
    wait_for("the slot to be dropped", Duration::from_secs(60), || {
        (cluster.psql("SELECT count(*) FROM pg_replication_slots") == "0").then_some(())
    });
    assert_eq!(cluster.psql("SELECT count(*) FROM pg_publication"), "0");
}

/// Waits until the copy is under way but not finished, and returns the worker's pid.
fn mid_copy(cluster: &Cluster, task: i64) -> i64 {
    wait_for("the copy to be under way", LONG, || {
        let status = cluster.status(task);
        let copied: i64 = status
            .get("rows_copied")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let pid: Option<i64> = status.get("worker_pid").and_then(|v| v.parse().ok());
        (status.get("state").map(String::as_str) == Some("snapshot")
            && (20_000..ROWS / 2).contains(&copied))
        .then_some(pid)
        .flatten()
    })
}

fn documents_sent(meili: &Meili) -> Option<usize> {
    meili.test_server().map(|server| {
        server
            .request_log()
            .iter()
            .filter(|record| record.method == "POST" && record.path.contains("/documents"))
            .map(|record| record.body.iter().filter(|&&byte| byte == b'\n').count())
            .sum()
    })
}

#[test]
fn backfill_resumes_after_the_worker_is_killed() {
    let (cluster, meili) = setup(ROWS);
    let (index, task) = TaskStart::on("products")
        .index_named("products_kill")
        .options(json!({"batch_size": 2000, "max_inflight": 2}))
        .start(&cluster, &meili);
    let pid = mid_copy(&cluster, task);
    cluster.kill_worker(task, pid);
    cluster.wait_snapshot_done(task, LONG);
    assert_index_matches(&cluster, &meili, &index, ROWS);
    if let Some(sent) = documents_sent(&meili) {
        // Resumed from the saved key: far fewer than a second full copy was sent.
        assert!(
            sent < (ROWS as usize) * 3 / 2,
            "{sent} documents sent for {ROWS} rows: the copy started over"
        );
    }
}

#[test]
fn backfill_resumes_after_an_immediate_shutdown() {
    let (cluster, meili) = setup(ROWS);
    let (index, task) = TaskStart::on("products")
        .index_named("products_crash")
        .options(json!({"batch_size": 2000, "max_inflight": 2}))
        .start(&cluster, &meili);
    mid_copy(&cluster, task);
    cluster.pg_ctl_stop("immediate");
    cluster.pg_ctl_start();
    cluster.wait_snapshot_done(task, LONG);
    assert_index_matches(&cluster, &meili, &index, ROWS);
    if let Some(sent) = documents_sent(&meili) {
        assert!(
            sent < (ROWS as usize) * 3 / 2,
            "{sent} documents sent for {ROWS} rows: the copy started over"
        );
    }
}

/// A process's own memory now (`RssAnon`), in MiB.
fn private_mib(pid: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with("RssAnon:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

#[test]
fn copying_wide_rows_keeps_the_worker_memory_bounded() {
    // 300 rows of 1 MiB: before pages were sized by bytes, the copy asked for 10,000 rows at once
    // and held the whole 300 MiB table twice (the query's result and its text copies).
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql("CREATE TABLE wide (id int PRIMARY KEY, body text NOT NULL)");
    cluster.psql(
        "ALTER TABLE wide ALTER COLUMN body SET STORAGE EXTERNAL;
         INSERT INTO wide SELECT i, repeat(md5(i::text), 32768) FROM generate_series(1, 300) i",
    );
    let meili = Meili::from_env();
    let (index, task) = TaskStart::on("wide")
        .options(json!({"max_inflight": 2}))
        .start(&cluster, &meili);
    let pid = wait_for("the worker", LONG, || {
        cluster
            .status(task)
            .get("worker_pid")
            .filter(|pid| pid.as_str() != "null" && !pid.is_empty())
            .cloned()
    });
    let mut peak = 0;
    wait_for("the copy to finish", LONG, || {
        peak = peak.max(private_mib(&pid).unwrap_or(0));
        let status = cluster.status(task);
        (status.get("state").map(String::as_str) == Some("streaming")).then_some(())
    });
    println!("worker private memory peak while copying 300 rows of 1 MiB: {peak} MiB");
    assert!(
        peak < 250,
        "the worker held {peak} MiB while copying 300 MiB of rows"
    );
    wait_for("every document", LONG, || {
        (meili.document_count(&index) == Some(300)).then_some(())
    });
    let documents = meili.all_documents(&index);
    assert!(documents.iter().all(|document| {
        let id = document["id"].as_i64().unwrap_or(0);
        document["body"].as_str().map(str::len) == Some(32 * 32768) && (1..=300).contains(&id)
    }));
}
