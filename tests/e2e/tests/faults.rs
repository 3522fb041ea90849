//! Fault injection, end to end, while a backfill or the stream runs. Outages and stalls run on
//! both servers (a real Meilisearch of the test's own is killed and restarted, or stopped with
//! SIGSTOP); the other faults need the test server's knobs and are skipped against a real
//! Meilisearch. Every case ends with "the index holds exactly the table's rows" (poison rows
//! aside, which must be dead letters).

use std::time::Duration;

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::{Meili, Method};
use pg_meili_sync_e2e::{products, start_task, wait_for, wait_index_matches_table};
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(600);

/// Seconds Meilisearch stays unreachable in the outage cases (E2E_OUTAGE_SECONDS, default 60).
fn outage() -> Duration {
    Duration::from_secs(
        std::env::var("E2E_OUTAGE_SECONDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60),
    )
}

fn with_test_server() -> Option<(Cluster, Meili)> {
    with_meili(
        |meili| meili.test_server().is_some(),
        "fault knobs need the test server",
    )
}

/// A cluster and a Meilisearch this test may take down: the test server, or a real server of
/// its own.
fn with_outages() -> Option<(Cluster, Meili)> {
    with_meili(
        Meili::can_go_down,
        "the Meilisearch at MEILI_URL is not this test's to kill",
    )
}

/// A cluster with the extension and the `products` table, and the Meilisearch to sync into;
/// None (the test is skipped) when that Meilisearch cannot play the test's faults.
fn with_meili(fits: impl Fn(&Meili) -> bool, why_not: &str) -> Option<(Cluster, Meili)> {
    let meili = Meili::from_env();
    if !fits(&meili) {
        eprintln!("skipped: {why_not}");
        return None;
    }
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    Some((cluster, meili))
}

fn converge(cluster: &Cluster, meili: &Meili, index: &str) {
    wait_index_matches_table(cluster, meili, index, "products", CONVERGE);
}

fn faults(meili: &Meili) -> &meili_test_server::Faults {
    meili.test_server().expect("test server").faults()
}

/// Waits until more than `max_inflight` (2 in these tests) of the index's tasks wait in
/// Meilisearch's queue; returns how many.
fn wait_queue_fills(meili: &Meili, index: &str) -> usize {
    wait_for("Meilisearch's queue to fill", CONVERGE, || {
        let (_, tasks) = meili.request(
            Method::GET,
            &format!("/tasks?indexUids={index}&statuses=enqueued&limit=100"),
            None,
        );
        let waiting = tasks["results"].as_array().map_or(0, Vec::len);
        (waiting > 2).then_some(waiting)
    })
}

/// Nothing became a dead letter, and more than `max_inflight` (2) batches were `waiting` at once.
fn no_dead_letters_and_a_deep_queue(cluster: &Cluster, waiting: usize) {
    assert_eq!(
        cluster.psql("SELECT count(*) FROM meili_sync.dead_letters"),
        "0"
    );
    assert!(
        waiting > 2,
        "no more than max_inflight batches were ever enqueued"
    );
}

/// Waits until the task has counted at least `retries` retries (`what` names them).
fn wait_retries(cluster: &Cluster, task: i64, retries: i64, what: &str) {
    wait_for(what, CONVERGE, || {
        let counted: i64 = cluster
            .psql(&format!(
                "SELECT retries FROM pg_stat_meili_sync WHERE task = {task}"
            ))
            .parse()
            .unwrap_or(0);
        (counted >= retries).then_some(())
    });
}

#[test]
fn meilisearch_unreachable_during_backfill() {
    let Some((cluster, meili)) = with_outages() else {
        return;
    };
    // The copy must still be running when the outage begins. On the test server slow tasks see to
    // that: like Meilisearch, it indexes every task waiting in the queue as one batch, so the
    // whole copy (20 tasks at depth 32) may be two batches, and each must outlast the time from
    // the copy's first page to the outage (2 s; 300 ms let a fast copy finish first). A real
    // server indexes 20 small batches enqueued at once in well under a second, so it gets more
    // rows and a shallow queue (one Meilisearch batch per two of ours).
    let (rows, depth) = match meili.test_server() {
        Some(server) => {
            server.faults().set_task_delay(Duration::from_secs(2));
            (20_000, 32)
        }
        None => (100_000, 2),
    };
    cluster.psql(&products::insert_sql(1, rows));
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({"batch_size": 1000, "max_inflight": 2, "snapshot_depth": depth}),
    );
    wait_for("the copy to start", CONVERGE, || {
        let copied: i64 = cluster.status(task).get("rows_copied")?.parse().ok()?;
        (copied > 0).then_some(())
    });
    meili.go_down();
    std::thread::sleep(outage());
    let status = cluster.status(task);
    assert_eq!(
        status.get("snapshot_finished_at").map(String::as_str),
        Some("null"),
        "the copy finished before the outage began, so the test proved nothing: {status:?}"
    );
    assert_eq!(
        status.get("state").map(String::as_str),
        Some("retrying"),
        "{status:?}"
    );
    assert!(
        status
            .get("last_error")
            .is_some_and(|error| !error.is_empty()),
        "{status:?}"
    );
    meili.come_back();
    if let Some(server) = meili.test_server() {
        server.faults().clear();
    }
    cluster.wait_snapshot_done(task, CONVERGE);
    converge(&cluster, &meili, &index);
}

#[test]
fn meilisearch_unreachable_during_streaming() {
    let Some((cluster, meili)) = with_outages() else {
        return;
    };
    cluster.psql(&products::insert_sql(1, 1000));
    let (index, task) = start_task(&cluster, &meili, None, "products", json!({}));
    cluster.wait_snapshot_done(task, CONVERGE);
    meili.go_down();
    cluster.psql(&products::insert_sql(1001, 3000));
    cluster.psql("UPDATE products SET version = 2 WHERE id % 3 = 0");
    cluster.psql("DELETE FROM products WHERE id % 10 = 0");
    std::thread::sleep(outage());
    meili.come_back();
    converge(&cluster, &meili, &index);
    let retries: i64 = cluster
        .status(task)
        .get("retries")
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    assert!(retries > 0, "no retry recorded");
}

#[test]
fn storms_of_5xx_and_429_and_dropped_connections() {
    let Some((cluster, meili)) = with_test_server() else {
        return;
    };
    cluster.psql(&products::insert_sql(1, 5000));
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({"batch_size": 500}),
    );
    faults(&meili).fail_next_requests(15, 503);
    cluster.wait_snapshot_done(task, CONVERGE);
    converge(&cluster, &meili, &index);
    faults(&meili).fail_next_requests(15, 429);
    cluster.psql("UPDATE products SET version = 3 WHERE id % 2 = 0");
    converge(&cluster, &meili, &index);
    faults(&meili).drop_next_connections(15);
    cluster.psql("DELETE FROM products WHERE id % 7 = 0");
    cluster.psql(&products::insert_sql(5001, 6000));
    converge(&cluster, &meili, &index);
}

#[test]
fn slow_task_processing() {
    let Some((cluster, meili)) = with_test_server() else {
        return;
    };
    cluster.psql(&products::insert_sql(1, 20_000));
    faults(&meili).set_task_delay(Duration::from_millis(300));
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({"batch_size": 1000, "max_inflight": 4}),
    );
    cluster.psql("UPDATE products SET version = 5 WHERE id % 4 = 0");
    cluster.wait_snapshot_done(task, CONVERGE);
    converge(&cluster, &meili, &index);
}

#[test]
fn failed_tasks_are_resent_without_losing_documents() {
    let Some((cluster, meili)) = with_test_server() else {
        return;
    };
    cluster.psql(&products::insert_sql(1, 10_000));
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({"batch_size": 10000}),
    );
    faults(&meili).fail_next_tasks(3, "internal");
    cluster.wait_snapshot_done(task, CONVERGE);
    converge(&cluster, &meili, &index);
    assert_eq!(
        cluster.psql("SELECT count(*) FROM meili_sync.dead_letters"),
        "0"
    );
}

#[test]
fn a_deep_copy_queue_reads_failed_batches_again_from_the_table() {
    let Some((cluster, meili)) = with_test_server() else {
        return;
    };
    cluster.psql(&products::insert_sql(1, 20_000));
    // Slow tasks pile up in Meilisearch's queue, as behind a real server's indexing. The test
    // server takes every waiting task into its next batch, so the first batch must last long
    // enough for the copy to enqueue more than max_inflight behind it (at 100 ms a fast copy
    // could be indexed in a few batches that never left more than 2 waiting).
    faults(&meili).set_task_delay(Duration::from_secs(1));
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({"batch_size": 1000, "max_inflight": 2, "snapshot_depth": 16}),
    );
    let waiting = wait_queue_fills(&meili, &index);
    // Batches enqueued long ago, whose bodies the worker let go, now fail: first for the
    // server's reasons (resent whole), then as if for their documents (split).
    faults(&meili).fail_next_tasks(2, "internal");
    wait_retries(&cluster, task, 2, "the resends");
    // Rows change while their batches wait: a batch read again carries what the table holds now.
    cluster.psql("UPDATE products SET name = name || ' (changed)' WHERE id % 7 = 0");
    faults(&meili).fail_next_tasks(2, "invalid_document_fields");
    cluster.wait_snapshot_done(task, CONVERGE);
    converge(&cluster, &meili, &index);
    no_dead_letters_and_a_deep_queue(&cluster, waiting);
    // The failed batches were read again from the table: their bodies had been let go.
    let log = cluster.server_log();
    assert!(
        log.matches("were read again from the table").count() >= 2,
        "{}",
        cluster.tail_log()
    );
}

#[test]
fn a_deep_stream_queue_reads_failed_batches_again_from_its_own_slot() {
    deep_stream_queue_reads_failed_batches_again("own");
}

#[test]
fn a_deep_stream_queue_reads_failed_batches_again_from_the_shared_slot() {
    deep_stream_queue_reads_failed_batches_again("shared");
}

fn deep_stream_queue_reads_failed_batches_again(decoding: &str) {
    let Some((cluster, meili)) = with_test_server() else {
        return;
    };
    cluster.psql(&products::insert_sql(1, 1000));
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({"batch_size": 200, "max_inflight": 2, "stream_depth": 16, "decoding": decoding}),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    converge(&cluster, &meili, &index);
    // Slow tasks pile up in Meilisearch's queue behind the one being indexed, as behind a real
    // server's indexing: more than max_inflight batches are enqueued, their bodies let go.
    faults(&meili).set_task_delay(Duration::from_secs(1));
    for first in (1001..=5000).step_by(200) {
        cluster.psql(&products::insert_sql(first, first + 199));
    }
    let waiting = wait_queue_fills(&meili, &index);
    // Batches whose bodies the worker let go fail, and rows change meanwhile.
    faults(&meili).fail_next_tasks(2, "internal");
    cluster.psql("UPDATE products SET name = name || ' (changed)' WHERE id % 7 = 0");
    cluster.psql("DELETE FROM products WHERE id % 11 = 0");
    wait_retries(&cluster, task, 1, "the failures");
    faults(&meili).clear();
    converge(&cluster, &meili, &index);
    no_dead_letters_and_a_deep_queue(&cluster, waiting);
    let log = cluster.server_log();
    assert!(
        log.contains("Meilisearch failed a batch the worker no longer held; it reads again from"),
        "{}",
        cluster.tail_log()
    );
}

#[test]
fn a_server_failing_tasks_for_its_own_reasons_never_drains_the_stream_into_dead_letters() {
    let Some((cluster, meili)) = with_test_server() else {
        return;
    };
    cluster.psql(&products::insert_sql(1, 100));
    let (index, task) = start_task(&cluster, &meili, None, "products", json!({}));
    cluster.wait_snapshot_done(task, CONVERGE);
    converge(&cluster, &meili, &index);
    // Seven failures in a row: enough, before, for halves of halves of one 4-document batch to
    // end as 4 dead letters. A full disk is not the documents' fault.
    faults(&meili).fail_next_tasks_as(7, "no_space_left_on_device", "system");
    cluster.psql(&products::insert_sql(101, 104));
    wait_retries(&cluster, task, 7, "the failures to be retried");
    converge(&cluster, &meili, &index);
    assert_eq!(
        cluster.psql("SELECT count(*) FROM meili_sync.dead_letters"),
        "0"
    );
    // An error about the index is not retried either way: the task stops and says why.
    faults(&meili).fail_next_tasks(1, "index_not_found");
    cluster.psql(&products::insert_sql(105, 105));
    let status = cluster.wait_error(task, CONVERGE);
    assert!(
        status["last_error"].contains("index_not_found"),
        "{status:?}"
    );
    assert_eq!(
        cluster.psql("SELECT count(*) FROM meili_sync.dead_letters"),
        "0"
    );
}

#[test]
fn poison_documents_go_to_dead_letters_and_the_rest_flows() {
    let Some((cluster, meili)) = with_test_server() else {
        return;
    };
    cluster.psql("ALTER TABLE products ADD COLUMN _geo jsonb");
    cluster.psql(&products::insert_sql(1, 10_000));
    cluster.psql(r#"UPDATE products SET _geo = '{"lat": 48.85, "lng": 2.35}' WHERE id % 2 = 0"#);
    cluster.psql(
        r#"UPDATE products SET _geo = '{"lat": "north", "lng": 2}' WHERE id IN (17, 4242, 9999)"#,
    );
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({"batch_size": 10000, "settings": {"filterableAttributes": ["_geo"]}}),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    // Streamed poison too; and the slot keeps moving past it.
    cluster.psql(r#"UPDATE products SET _geo = '"somewhere"' WHERE id = 5000"#);
    cluster.psql(&products::insert_sql(10_001, 10_100));
    wait_for("the poison rows as dead letters", CONVERGE, || {
        let ids = cluster.psql("SELECT string_agg(document_id, ',' ORDER BY document_id::int) FROM meili_sync_dead_letters");
        (ids == "17,4242,5000,9999").then_some(())
    });
    let code =
        cluster.psql("SELECT string_agg(DISTINCT error_code, ',') FROM meili_sync_dead_letters");
    assert_eq!(code, "invalid_document_geo_field");
    // Everything but the poison rows is in the index, exactly.
    cluster.psql("CREATE VIEW good_products AS SELECT * FROM products WHERE id NOT IN (17, 4242, 5000, 9999)");
    wait_for("the index to hold every good row", CONVERGE, || {
        (meili.document_count(&index) == Some(10_100 - 4 + 1)).then_some(())
    });
    // id 5000 was good before its bad update: the index keeps its last good version.
    let documents = meili.all_documents(&index);
    let expected = products::table_documents(&cluster, "good_products");
    let without_5000: Vec<_> = documents
        .into_iter()
        .filter(|d| d["id"] != json!(5000))
        .collect();
    assert_eq!(products::diff_documents(&without_5000, &expected), None);
    // Fixing the rows, then retrying the dead letters re-sends their current state.
    cluster.psql(
        "UPDATE products SET _geo = '{\"lat\": 1, \"lng\": 2}' WHERE id IN (17, 4242, 5000, 9999)",
    );
    let retried = cluster.psql(&format!("SELECT meili_sync_retry_dead_letters({task})"));
    assert_eq!(retried, "4");
    assert_eq!(
        cluster.psql("SELECT count(*) FROM meili_sync_dead_letters"),
        "0"
    );
    converge(&cluster, &meili, &index);
}

#[test]
fn an_index_deleted_by_someone_else_stops_the_task_with_an_error() {
    // Works against a real server too: it only deletes the task's own index.
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 100));
    let (index, task) = start_task(&cluster, &meili, None, "products", json!({}));
    cluster.wait_snapshot_done(task, CONVERGE);
    meili.delete_index(&index);
    let status = cluster.wait_error(task, CONVERGE);
    let error = status.get("last_error").cloned().unwrap_or_default();
    assert!(
        error.contains("was deleted") && error.contains("meili_sync_snapshot"),
        "{status:?}"
    );
    // The documented way back: copy the table again.
    cluster.psql(&format!("SELECT meili_sync_snapshot({task})"));
    cluster.wait_snapshot_done(task, CONVERGE);
    converge(&cluster, &meili, &index);
}

#[test]
fn a_deletion_meilisearch_fails_is_an_error_and_drops_nothing() {
    let Some((cluster, meili)) = with_test_server() else {
        return;
    };
    cluster.psql(&products::insert_sql(1, 100));
    let (index, task) = start_task(&cluster, &meili, None, "products", json!({}));
    cluster.wait_snapshot_done(task, CONVERGE);
    // Before, the finished task's status was never read: the task was dropped and the index kept.
    faults(&meili).fail_next_tasks(1, "internal");
    let refused = pg_meili_sync_e2e::refusal(
        &cluster,
        &format!("SELECT meili_sync_drop({task}, drop_index => true)"),
    );
    assert_eq!(refused.sqlstate, "08006", "{refused:?}");
    assert!(
        refused
            .message
            .contains(&format!("could not delete Meilisearch index \"{index}\""))
            && refused.message.contains("Injected failure")
            && refused.message.contains("Nothing was dropped"),
        "{refused:?}"
    );
    assert!(refused.hint.contains("drop_index => false"), "{refused:?}");
    assert!(meili.index(&index).is_some(), "the index is gone");
    assert_eq!(
        cluster.psql(&format!(
            "SELECT count(*) FROM meili_sync.tasks WHERE id = {task}"
        )),
        "1",
        "the task was dropped although its index was not"
    );
    // Once Meilisearch deletes, the drop goes through.
    cluster.psql(&products::insert_sql(101, 110));
    converge(&cluster, &meili, &index);
    cluster.psql(&format!(
        "SELECT meili_sync_drop({task}, drop_index => true)"
    ));
    assert!(meili.index(&index).is_none(), "the index is still there");
    assert_eq!(cluster.psql("SELECT count(*) FROM meili_sync.tasks"), "0");
}

#[test]
fn a_deletion_that_finds_the_index_gone_is_done() {
    let Some((cluster, meili)) = with_test_server() else {
        return;
    };
    cluster.psql(&products::insert_sql(1, 100));
    let (index, task) = start_task(&cluster, &meili, None, "products", json!({}));
    cluster.wait_snapshot_done(task, CONVERGE);
    // Another deletion of the index waits in Meilisearch's queue (as one a worker enqueued before
    // it restarted does): the drop still sees the index, and its own deletion then fails with
    // index_not_found. The index is gone, as the drop asked: that is no error (the soak's resync
    // helpers stopped in error on it).
    faults(&meili).set_task_delay(Duration::from_millis(500));
    let (status, _) = meili.request(Method::DELETE, &format!("/indexes/{index}"), None);
    assert_eq!(status, 202, "the first deletion was not enqueued");
    cluster.psql(&format!(
        "SELECT meili_sync_drop({task}, drop_index => true)"
    ));
    assert!(meili.index(&index).is_none(), "the index is still there");
    assert_eq!(cluster.psql("SELECT count(*) FROM meili_sync.tasks"), "0");
    // The drop's own deletion ran, and found no index.
    let (_, tasks) = meili.request(
        Method::GET,
        &format!("/tasks?types=indexDeletion&indexUids={index}"),
        None,
    );
    let codes: Vec<&str> = tasks["results"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|task| task["error"]["code"].as_str().unwrap_or("none"))
        .collect();
    assert_eq!(codes.len(), 2, "{tasks}");
    assert!(codes.contains(&"index_not_found"), "{tasks}");
}

#[test]
fn a_wrong_key_waits_for_meili_sync_alter_and_loses_nothing() {
    // Works against a real server when it has a master key (a wrong key is then refused).
    let meili = Meili::from_env();
    if !meili.has_key() {
        eprintln!("skipped: Meilisearch runs without a master key, so no key is wrong");
        return;
    }
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 2000));
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({"api_key": "not-the-key"}),
    );
    let status = wait_for("the task to report the refused key", CONVERGE, || {
        let status = cluster.status(task);
        let error = status.get("last_error").cloned().unwrap_or_default();
        (status.get("state").map(String::as_str) == Some("retrying") && error.contains("key"))
            .then_some(status)
    });
    assert_eq!(
        status.get("rows_copied").map(String::as_str),
        Some("0"),
        "{status:?}"
    );
    // Rows written meanwhile must arrive too.
    cluster.psql(&products::insert_sql(2001, 2500));
    let key = meili.key().unwrap_or_default().replace('\'', "''");
    cluster.psql(&format!(
        "SELECT meili_sync_alter({task}, jsonb_build_object('api_key', '{key}'))"
    ));
    cluster.wait_snapshot_done(task, CONVERGE);
    cluster.psql("UPDATE products SET version = 7 WHERE id % 5 = 0");
    converge(&cluster, &meili, &index);
    assert!(
        !cluster.server_log().contains(&key),
        "the API key appears in the server log"
    );
}

#[test]
fn a_crash_loop_ends_in_state_error_with_the_last_error() {
    crash_loop_ends_in_state_error("own", "worker crashed 10 times");
}

#[test]
fn a_crash_loop_of_the_shared_decoder_stops_its_tasks_with_its_last_error() {
    crash_loop_ends_in_state_error("shared", "the shared decoder crashed 10 times");
}

/// Someone drops the publication a task's changes come from and keeps it from being made again
/// (an event trigger refuses CREATE PUBLICATION): each start of the worker (or the shared
/// decoder) fails, until the task stops with the error that says why.
/// The crash loop is the Postgres side's alone: it runs on the test server only (tier 4b, on a
/// real Meilisearch, skips it to keep CI within its time).
fn crash_loop_ends_in_state_error(decoding: &str, verdict: &str) {
    let meili = Meili::from_env();
    if meili.test_server().is_none() {
        eprintln!("skipped: a crash loop does not depend on the Meilisearch server");
        return;
    }
    let cluster = Cluster::start(&["meili_sync.restart_backoff=10ms"]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 100));
    let (_index, task) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({ "decoding": decoding }),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    let publication =
        cluster.psql("SELECT pubname FROM pg_publication WHERE pubname LIKE 'meili\\_sync\\_%'");
    cluster.psql(
        "CREATE FUNCTION no_publications() RETURNS event_trigger LANGUAGE plpgsql AS
         $$ BEGIN RAISE EXCEPTION 'no new publication here'; END $$",
    );
    cluster.psql(
        "CREATE EVENT TRIGGER no_publications ON ddl_command_start
         WHEN TAG IN ('CREATE PUBLICATION') EXECUTE FUNCTION no_publications()",
    );
    cluster.psql(&format!("DROP PUBLICATION {publication}"));
    cluster.psql(&products::insert_sql(101, 110));
    let status = wait_for("the crash loop to stop the task", CONVERGE, || {
        let status = cluster.status(task);
        (status.get("state").map(String::as_str) == Some("error")).then_some(status)
    });
    let error = status.get("last_error").cloned().unwrap_or_default();
    assert!(
        error.contains(verdict)
            && error.contains("no new publication here")
            && error.contains("meili_sync_resume"),
        "{status:?}"
    );
    // Stopped means stopped: no worker keeps restarting for the task.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        cluster.psql(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_meili_sync task'"
        ),
        "0"
    );
    assert_eq!(
        cluster.status(task).get("state").map(String::as_str),
        Some("error")
    );
}

#[test]
fn a_lock_timeout_while_streaming_is_retried_in_place_not_a_crash() {
    // Needs no fault knob: runs against the test server and a real Meilisearch alike.
    let Some((cluster, meili)) = with_meili(|_| true, "") else {
        return;
    };
    // Every new session of the database gives up on a lock after 100 ms: the task's worker too.
    let database = cluster.psql("SELECT current_database()");
    cluster.psql(&format!(
        "ALTER DATABASE \"{database}\" SET lock_timeout = '100ms'"
    ));
    cluster.psql("ALTER TABLE products ADD COLUMN _geo jsonb");
    cluster.psql(&products::insert_sql(1, 1000));
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({"settings": {"filterableAttributes": ["_geo"]}}),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    let pid = cluster.status(task)["worker_pid"].clone();
    // Another session holds the dead letters' table for 4 s, so storing one times out.
    let retrying = std::thread::scope(|scope| {
        let holder = scope.spawn(|| {
            cluster.psql(
                "SET lock_timeout = 0; BEGIN; \
                 LOCK TABLE meili_sync.dead_letters IN ACCESS EXCLUSIVE MODE; \
                 SELECT pg_sleep(4); COMMIT;",
            )
        });
        wait_for("the lock to be held", CONVERGE, || {
            let held = cluster.psql(
                "SELECT count(*) FROM pg_locks WHERE granted AND mode = 'AccessExclusiveLock' \
                 AND relation = 'meili_sync.dead_letters'::regclass",
            );
            (held == "1").then_some(())
        });
        cluster.psql(r#"UPDATE products SET _geo = '"somewhere"' WHERE id = 500"#);
        cluster.psql(&products::insert_sql(1001, 1100));
        let retrying = wait_for("the worker to retry the blocked write", CONVERGE, || {
            let status = cluster.status(task);
            let error = status.get("last_error").cloned().unwrap_or_default();
            error.contains("lock timeout").then_some(error)
        });
        holder.join().expect("the lock holder");
        retrying
    });
    assert!(
        retrying.contains("storing dead letters") && retrying.contains("tried again"),
        "{retrying}"
    );
    wait_for("the poison row as a dead letter", CONVERGE, || {
        let ids = cluster.psql("SELECT string_agg(document_id, ',') FROM meili_sync_dead_letters");
        (ids == "500").then_some(())
    });
    // Everything else is in the index; row 500 keeps its last good version.
    wait_for("the index to hold every row", CONVERGE, || {
        (meili.document_count(&index) == Some(1100)).then_some(())
    });
    cluster.psql("CREATE VIEW good_products AS SELECT * FROM products WHERE id <> 500");
    let documents: Vec<_> = meili
        .all_documents(&index)
        .into_iter()
        .filter(|d| d["id"] != json!(500))
        .collect();
    assert_eq!(
        products::diff_documents(
            &documents,
            &products::table_documents(&cluster, "good_products")
        ),
        None
    );
    // The same worker did it all: nothing crashed, nothing restarted.
    let status = cluster.status(task);
    assert_eq!(status["worker_pid"], pid, "{status:?}");
    assert_eq!(status["state"], "streaming", "{status:?}");
    assert!(
        !cluster.server_log().contains("exited with exit code 1"),
        "{}",
        cluster.tail_log()
    );
}

fn lag_seconds(status: &std::collections::HashMap<String, String>) -> Option<f64> {
    status.get("lag_seconds")?.parse().ok()
}

#[test]
fn lag_is_reported_while_meilisearch_stalls() {
    let meili = Meili::from_env();
    if !meili.can_go_down() {
        eprintln!("skipped: the Meilisearch at MEILI_URL is not this test's to stall");
        return;
    }
    let cluster = Cluster::start(&["meili_sync.lag_warning=2s"]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 1000));
    let (index, task) = start_task(&cluster, &meili, None, "products", json!({}));
    cluster.wait_snapshot_done(task, CONVERGE);
    converge(&cluster, &meili, &index);
    let quiet = cluster.status(task);
    assert_eq!(lag_seconds(&quiet), Some(0.0), "{quiet:?}");
    meili.freeze();
    cluster.psql(&products::insert_sql(1001, 1500));
    // A stopped real server shows as `retrying` once the request times out (30 s).
    let status = wait_for("the lag to be reported", CONVERGE, || {
        let status = cluster.status(task);
        let lag = lag_seconds(&status)?;
        (lag > 2.0
            && status.get("lag_warning").map(String::as_str) == Some("true")
            && status.get("state").map(String::as_str) == Some("retrying"))
        .then_some(status)
    });
    let lag_bytes: i64 = status
        .get("lag_bytes")
        .and_then(|bytes| bytes.parse().ok())
        .unwrap_or(0);
    assert!(lag_bytes > 0, "{status:?}");
    assert_eq!(
        status.get("state").map(String::as_str),
        Some("retrying"),
        "{status:?}"
    );
    wait_for("the lag WARNING in the server log", CONVERGE, || {
        cluster
            .server_log()
            .contains("more than meili_sync.lag_warning (2 s)")
            .then_some(())
    });
    meili.thaw();
    converge(&cluster, &meili, &index);
    let status = wait_for("the lag to clear", CONVERGE, || {
        let status = cluster.status(task);
        (lag_seconds(&status) == Some(0.0)
            && status.get("lag_warning").map(String::as_str) == Some("false"))
        .then_some(status)
    });
    let rate: f64 = status
        .get("documents_per_second")
        .and_then(|rate| rate.parse().ok())
        .unwrap_or(0.0);
    assert!(rate > 0.0, "{status:?}");
}

/// Meilisearch made the resync index, but its answer was lost: the request sent again fails with
/// `index_already_exists`, which used to stop the helper in error (a soak found it, with a real
/// server killed during a resync). Now the helper makes the index again and the resync finishes.
#[test]
fn a_resync_whose_index_was_made_by_a_lost_request_makes_it_again() {
    let Some((cluster, meili)) = with_test_server() else {
        return;
    };
    cluster.psql(&products::insert_sql(1, 500));
    let (index, task) = start_task(&cluster, &meili, None, "products", json!({}));
    cluster.wait_snapshot_done(task, CONVERGE);
    converge(&cluster, &meili, &index);
    faults(&meili).lose_next_answers(1, "POST", "/indexes");
    let helper: i64 = cluster
        .psql(&format!("SELECT meili_sync_resync({task})"))
        .parse()
        .expect("helper task id");
    wait_for("the helper to finish", CONVERGE, || {
        let left = cluster.psql(&format!(
            "SELECT coalesce((SELECT state || ' ' || coalesce(last_error, '') FROM meili_sync.tasks WHERE id = {helper}), 'gone')"
        ));
        assert!(!left.starts_with("error"), "the helper stopped: {left}");
        (left == "gone").then_some(())
    });
    cluster.psql("UPDATE products SET version = 9 WHERE id % 10 = 0");
    converge(&cluster, &meili, &index);
    assert!(
        cluster
            .server_log()
            .contains("the resync index was made meanwhile by an earlier request"),
        "the lost answer did not make the request go again"
    );
}

#[test]
fn a_resync_helper_killed_during_the_swap_finishes_it_after_the_restart() {
    let Some((cluster, meili)) = with_test_server() else {
        return;
    };
    cluster.psql(&products::insert_sql(1, 5000));
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({"batch_size": 1000}),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    converge(&cluster, &meili, &index);
    // A stray document: if the old index came back (a second swap), the check below would see it.
    use pg_meili_sync_e2e::meili::Method;
    meili.request(
        Method::POST,
        &format!("/indexes/{index}/documents"),
        Some(json!([{"id": 900001, "name": "stray"}])),
    );
    meili.wait_idle(&index, CONVERGE);
    // Slow tasks keep the swap task waiting long enough to kill the helper while it awaits it.
    faults(&meili).set_task_delay(Duration::from_millis(300));
    let helper: i64 = cluster
        .psql(&format!("SELECT meili_sync_resync({task})"))
        .parse()
        .expect("helper task id");
    let pid: i64 = wait_for("the helper to start its swap", CONVERGE, || {
        let phase = cluster.psql(&format!(
            "SELECT coalesce(resync_phase, '') FROM meili_sync.tasks WHERE id = {helper}"
        ));
        if phase != "swapping" {
            return None;
        }
        cluster.status(helper).get("worker_pid")?.parse().ok()
    });
    cluster.kill_worker(helper, pid);
    faults(&meili).set_task_delay(Duration::ZERO);
    wait_for("the helper to finish", CONVERGE, || {
        (cluster.psql(&format!(
            "SELECT count(*) FROM meili_sync.tasks WHERE id = {helper}"
        )) == "0")
            .then_some(())
    });
    cluster.psql("UPDATE products SET version = 9 WHERE id % 100 = 0");
    converge(&cluster, &meili, &index);
    assert_eq!(meili.index(&format!("{index}__resync")), None);
    let log = cluster.server_log();
    assert!(
        log.contains("the swap of the interrupted resync"),
        "the kill did not interrupt the swap"
    );
    let swaps = log.matches("resync swapped in the new index").count();
    assert_eq!(swaps, 1, "the swap was handed over {swaps} times");
}
