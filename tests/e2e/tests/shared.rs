//! End to end: shared tasks (the default) share one slot and one decoding process, each task gets
//! the changes of its own table only, tasks that join, pause, resume, leave or are killed
//! mid-stream lose nothing, and tasks with a slot of their own move in without a copy; every test
//! ends with "each index holds exactly its table".

use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{products, wait_for, wait_index_matches_table, TaskStart};
use serde_json::{json, Value};

const CONVERGE: Duration = Duration::from_secs(300);

const CREATE_NOTES: &str = "CREATE TABLE notes (id bigint PRIMARY KEY, body text, n int)";

fn insert_notes(from: i64, to: i64) -> String {
    format!(
        "INSERT INTO notes SELECT i, 'note ' || i, i % 7 FROM generate_series({from}, {to}) AS i"
    )
}

fn setup() -> (Cluster, Meili) {
    setup_with(&[])
}

fn setup_with(settings: &[&str]) -> (Cluster, Meili) {
    let cluster = Cluster::start(settings);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(CREATE_NOTES);
    cluster.psql(&products::insert_sql(1, 2000));
    cluster.psql(&insert_notes(1, 2000));
    (cluster, Meili::from_env())
}

/// Starts a shared task on `table` and waits for its copy; returns its index and id.
fn start_shared(cluster: &Cluster, meili: &Meili, table: &str) -> (String, i64) {
    start_copied(
        cluster,
        meili,
        table,
        json!({"decoding": "shared", "batch_size": 500}),
    )
}

/// Starts a task on `table` with `options` and waits for its copy; returns its index and id.
fn start_copied(cluster: &Cluster, meili: &Meili, table: &str, options: Value) -> (String, i64) {
    let decoding = options["decoding"].as_str().unwrap_or("shared");
    TaskStart::on(table)
        .index_named(&format!("{decoding}_{table}"))
        .options(options)
        .start_copied(cluster, meili, CONVERGE)
}

fn converge(cluster: &Cluster, meili: &Meili, index: &str, table: &str) {
    wait_index_matches_table(cluster, meili, index, table, CONVERGE);
}

fn decoder_pids(cluster: &Cluster) -> Vec<i64> {
    cluster
        .psql(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_meili_sync shared decoder'",
        )
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

fn one_decoder(cluster: &Cluster) -> i64 {
    wait_for("exactly one shared decoder", CONVERGE, || {
        let pids = decoder_pids(cluster);
        (pids.len() == 1).then(|| pids[0])
    })
}

/// Pauses a task and waits until the decoder has let it go.
fn pause(cluster: &Cluster, task: i64) {
    cluster.psql(&format!("SELECT meili_sync_pause({task})"));
    wait_for(
        "the task to leave the shared pass",
        Duration::from_secs(20),
        || {
            (cluster.status(task).get("worker_pid").map(String::as_str) == Some("null"))
                .then_some(())
        },
    );
}

#[test]
fn tasks_share_one_slot_and_each_gets_only_its_table() {
    let (cluster, meili) = setup();
    let (products_index, products_task) = start_shared(&cluster, &meili, "products");
    let (notes_index, notes_task) = start_shared(&cluster, &meili, "notes");
    // A second task on the same table, into another index.
    let (copy_index, copy_task) = start_shared(&cluster, &meili, "products");
    // And beside them a task with a slot and a worker of its own.
    let own_index = meili.unique_index("own_notes");
    let own_options = meili.options(json!({"decoding": "own"}));
    let own_task: i64 = cluster
        .psql(&format!(
            "SELECT meili_sync_start('notes', '{own_index}', '{own_options}')"
        ))
        .parse()
        .expect("task id");
    cluster.wait_snapshot_done(own_task, CONVERGE);
    let decoder = one_decoder(&cluster);
    assert_eq!(
        cluster.psql("SELECT count(*) FROM pg_replication_slots"),
        "2",
        "one slot for all shared tasks, one for the task with its own"
    );
    assert_eq!(
        cluster.psql(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_meili_sync task'"
        ),
        "1",
        "no task worker for the shared tasks once their copies are done"
    );
    assert_eq!(
        cluster.status(own_task).get("decoding").map(String::as_str),
        Some("own")
    );
    for task in [products_task, notes_task, copy_task] {
        let status = cluster.status(task);
        assert_eq!(
            status.get("worker_pid").map(String::as_str),
            Some(decoder.to_string().as_str()),
            "{status:?}"
        );
        assert_eq!(status.get("decoding").map(String::as_str), Some("shared"));
    }

    cluster.psql(&products::insert_sql(2001, 3000));
    cluster.psql("UPDATE products SET version = 2 WHERE id % 3 = 0");
    cluster.psql("DELETE FROM products WHERE id % 10 = 0");
    cluster.psql(&insert_notes(2001, 2500));
    cluster.psql("UPDATE notes SET body = 'changed ' || id WHERE id % 4 = 0");
    cluster.psql("DELETE FROM notes WHERE id % 9 = 0");
    converge(&cluster, &meili, &products_index, "products");
    converge(&cluster, &meili, &copy_index, "products");
    converge(&cluster, &meili, &notes_index, "notes");
    converge(&cluster, &meili, &own_index, "notes");
    // Each index holds its own table's documents only (the counts differ, and the oracle above
    // compares bodies): no note reached a products index or the other way round.
    assert_eq!(
        meili.document_count(&notes_index),
        cluster.psql("SELECT count(*) FROM notes").parse().ok()
    );

    // The slot moves on once everything is confirmed: it does not retain the WAL written above.
    wait_for("the shared slot to be confirmed", CONVERGE, || {
        let lag: i64 = cluster
            .psql("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn) FROM pg_replication_slots WHERE slot_name LIKE '%shared'")
            .parse()
            .ok()?;
        (lag < 1_000_000).then_some(())
    });
}

#[test]
fn tasks_join_pause_resume_and_leave_while_others_stream() {
    let (cluster, meili) = setup();
    let (products_index, products_task) = start_shared(&cluster, &meili, "products");
    let (notes_index, notes_task) = start_shared(&cluster, &meili, "notes");
    let decoder = one_decoder(&cluster);

    // A paused task keeps its position; the other streams on.
    pause(&cluster, notes_task);
    let notes_before = meili.document_count(&notes_index);
    cluster.psql(&insert_notes(2001, 4000));
    cluster.psql("UPDATE notes SET n = n + 100 WHERE id % 2 = 0");
    cluster.psql(&products::insert_sql(2001, 2500));
    converge(&cluster, &meili, &products_index, "products");
    assert_eq!(
        meili.document_count(&notes_index),
        notes_before,
        "a paused task received changes"
    );
    // Resumed, it reads again from its own position and catches up; the products task, which is
    // ahead, skips what it has (its index still matches: nothing was sent twice out of order).
    cluster.psql(&format!("SELECT meili_sync_resume({notes_task})"));
    cluster.psql(&products::insert_sql(2501, 3000));
    converge(&cluster, &meili, &notes_index, "notes");
    converge(&cluster, &meili, &products_index, "products");

    // A task that joins while the others stream gets its copy, then every change after it.
    let (late_index, late_task) = start_shared(&cluster, &meili, "notes");
    cluster.psql(&insert_notes(4001, 4500));
    cluster.psql("DELETE FROM notes WHERE id % 11 = 0");
    converge(&cluster, &meili, &late_index, "notes");
    converge(&cluster, &meili, &notes_index, "notes");
    assert_eq!(one_decoder(&cluster), decoder, "the decoder was restarted");

    // A dropped task leaves; the others go on, and its table stays published for the other
    // task on it.
    cluster.psql(&format!("SELECT meili_sync_drop({late_task})"));
    cluster.psql(&insert_notes(4501, 5000));
    converge(&cluster, &meili, &notes_index, "notes");
    assert_eq!(
        cluster
            .status(products_task)
            .get("state")
            .map(String::as_str),
        Some("streaming")
    );

    // No task left: no decoder, no slot, no publication.
    cluster.psql(&format!("SELECT meili_sync_drop({notes_task})"));
    cluster.psql(&format!("SELECT meili_sync_drop({products_task})"));
    wait_for("the shared slot and publication to go", CONVERGE, || {
        let left = cluster.psql(
            "SELECT (SELECT count(*) FROM pg_replication_slots) + (SELECT count(*) FROM pg_publication)",
        );
        (left == "0" && decoder_pids(&cluster).is_empty()).then_some(())
    });
}

#[test]
fn tasks_over_the_decoders_memory_budget_send_one_request_at_a_time_and_lose_nothing() {
    let (cluster, meili) = setup_with(&["meili_sync.decoder_memory=1MB"]);
    // Slow confirmations, as behind a real Meilisearch's indexing, so that requests pile up.
    if let Some(server) = meili.test_server() {
        server.faults().set_task_delay(Duration::from_millis(100));
    }
    // One enqueued request at a time in Meilisearch: the next ones wait in the tasks' queues for
    // the slow confirmations, so that the documents held surely pass the budget (with a deep
    // queue the test server enqueues them all at once, and the budget is reached or not by luck).
    let options = json!({"decoding": "shared", "batch_size": 500, "stream_depth": 1});
    let (products_index, _) = start_copied(&cluster, &meili, "products", options.clone());
    let (notes_index, _) = start_copied(&cluster, &meili, "notes", options);
    // 40 requests of 500 rows, about 3 MB of products alone: over the budget, the two tasks
    // go on one request each at a time.
    std::thread::scope(|scope| {
        scope.spawn(|| cluster.psql(&products::insert_sql(2001, 12_000)));
        scope.spawn(|| cluster.psql(&insert_notes(2001, 12_000)));
    });
    cluster.psql("UPDATE products SET price = price + 1 WHERE id % 5 = 0");
    cluster.psql("DELETE FROM notes WHERE id % 3 = 0");
    converge(&cluster, &meili, &products_index, "products");
    converge(&cluster, &meili, &notes_index, "notes");
    // Only the test server's slow tasks make the pile-up certain: a real Meilisearch may confirm
    // fast enough that the decoder never sees more than 1 MB held (one CI run on it did not).
    if let Some(server) = meili.test_server() {
        assert!(
            cluster
                .server_log()
                .contains("more than meili_sync.decoder_memory (1024 kB)"),
            "the budget was never reached: {}",
            cluster.tail_log()
        );
        server.faults().set_task_delay(Duration::ZERO);
    }
}

#[test]
fn a_killed_decoder_and_an_immediate_shutdown_during_a_catch_up_lose_nothing() {
    let (cluster, meili) = setup();
    let (products_index, _) = start_shared(&cluster, &meili, "products");
    let (notes_index, notes_task) = start_shared(&cluster, &meili, "notes");

    // Killed while both stream.
    let decoder = one_decoder(&cluster);
    cluster.psql(&products::insert_sql(2001, 12_000));
    cluster.kill(decoder, "KILL");
    // The postmaster restarts every backend after a SIGKILL: wait for a new decoder.
    wait_for("a new shared decoder", CONVERGE, || {
        let pids = cluster
            .try_psql("SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_meili_sync shared decoder'")
            .ok()?;
        let pid: i64 = pids.trim().parse().ok()?;
        (pid != decoder).then_some(())
    });
    cluster.psql("UPDATE products SET version = 3 WHERE id % 5 = 0");
    cluster.psql(&insert_notes(2001, 3000));
    converge(&cluster, &meili, &products_index, "products");
    converge(&cluster, &meili, &notes_index, "notes");

    // An immediate shutdown while a resumed task catches up from far behind the other.
    pause(&cluster, notes_task);
    cluster.psql(&insert_notes(3001, 30_000));
    cluster.psql(&products::insert_sql(12_001, 14_000));
    cluster.psql(&format!("SELECT meili_sync_resume({notes_task})"));
    std::thread::sleep(Duration::from_millis(700));
    cluster.pg_ctl_stop("immediate");
    cluster.pg_ctl_start();
    cluster.psql("DELETE FROM notes WHERE id % 13 = 0");
    converge(&cluster, &meili, &notes_index, "notes");
    converge(&cluster, &meili, &products_index, "products");
}

#[test]
fn a_task_whose_meilisearch_is_down_leaves_the_stream_and_the_others_go_on() {
    let (cluster, meili) = setup();
    // The notes go to a Meilisearch of their own, which fails.
    let failing = Meili::from_env();
    if !failing.can_go_down() {
        eprintln!("skipped: the Meilisearch at MEILI_URL is not this test's to kill");
        return;
    }
    let (products_index, products_task) = start_shared(&cluster, &meili, "products");
    let (notes_index, notes_task) = start_shared(&cluster, &failing, "notes");
    failing.go_down();
    // More note changes than its queue takes (36 batches of 500, 8 in flight): the decoder
    // waits for it, then lets it go; the products committed after them flow meanwhile.
    cluster.psql(&insert_notes(2001, 20_000));
    cluster.psql(&products::insert_sql(2001, 3000));
    converge(&cluster, &meili, &products_index, "products");
    wait_for("the stalled task to leave the stream", CONVERGE, || {
        cluster
            .server_log()
            .contains(&format!(
                "pg_meili_sync task {notes_task}: Meilisearch answered none of its requests"
            ))
            .then_some(())
    });
    // Its position holds the shared slot back, the other task's moves on (once the decoder has
    // heard of the products' confirmation, a moment after the documents are in the index).
    wait_for(
        "the other task's position to pass the stalled one's",
        CONVERGE,
        || {
            let positions = cluster.psql(&format!(
                "SELECT (SELECT confirmed_lsn FROM meili_sync_status WHERE task = {notes_task})
                    < (SELECT confirmed_lsn FROM meili_sync_status WHERE task = {products_task})"
            ));
            (positions == "t").then_some(())
        },
    );
    failing.come_back();
    converge(&cluster, &failing, &notes_index, "notes");
    cluster.psql(&products::insert_sql(3001, 3500));
    cluster.psql("UPDATE notes SET n = -1 WHERE id % 3 = 0");
    converge(&cluster, &meili, &products_index, "products");
    converge(&cluster, &failing, &notes_index, "notes");
}

#[test]
fn a_shared_task_is_resynced_while_writes_continue_and_the_other_streams_on() {
    use pg_meili_sync_e2e::meili::Method;
    let (cluster, meili) = setup();
    let (products_index, products_task) = start_shared(&cluster, &meili, "products");
    let (notes_index, _) = start_shared(&cluster, &meili, "notes");
    // Damage the index the resync must repair (no write below touches these rows).
    meili.request(
        Method::POST,
        &format!("/indexes/{products_index}/documents/delete-batch"),
        Some(json!([5, 6])),
    );
    meili.wait_idle(&products_index, CONVERGE);
    let helper: i64 = cluster
        .psql(&format!("SELECT meili_sync_resync({products_task})"))
        .parse()
        .expect("helper task id");
    let mut round = 0_i64;
    loop {
        let first = 100_000 + round * 20;
        cluster.psql(&products::insert_sql(first, first + 19));
        cluster.psql(&format!(
            "UPDATE products SET version = version + 1 WHERE id % 97 = {} AND id > 1500",
            round % 97
        ));
        cluster.psql(&insert_notes(10_000 + round * 5, 10_000 + round * 5 + 4));
        round += 1;
        let left = cluster.psql(&format!(
            "SELECT count(*) FROM meili_sync.tasks WHERE id = {helper}"
        ));
        if left == "0" {
            break;
        }
        assert!(round < 3000, "the resync did not finish");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Writes after the swap go into the new index, through the shared pass again.
    cluster.psql(&products::insert_sql(900_000, 900_100));
    converge(&cluster, &meili, &products_index, "products");
    converge(&cluster, &meili, &notes_index, "notes");
    assert_eq!(meili.index(&format!("{products_index}__resync")), None);
    let status = cluster.status(products_task);
    assert_eq!(
        (
            status.get("state").map(String::as_str),
            status.get("decoding").map(String::as_str)
        ),
        (Some("streaming"), Some("shared")),
        "{status:?}"
    );
    assert_eq!(
        cluster.psql("SELECT count(*) FROM pg_replication_slots"),
        "1",
        "the helper's slot is gone"
    );
}

#[test]
fn a_paused_shared_task_holding_the_slot_back_is_named_in_the_wal_warning() {
    let (cluster, meili) = setup_with(&["meili_sync.max_retained_wal=1MB"]);
    let (products_index, _) = start_shared(&cluster, &meili, "products");
    let (notes_index, notes_task) = start_shared(&cluster, &meili, "notes");
    pause(&cluster, notes_task);
    // The products stream on; the paused task's position keeps their WAL.
    cluster.psql(&products::insert_sql(2001, 20_000));
    converge(&cluster, &meili, &products_index, "products");
    let status = wait_for("the retained-WAL flag", CONVERGE, || {
        let status = cluster.status(notes_task);
        (status.get("wal_warning").map(String::as_str) == Some("true")).then_some(status)
    });
    assert_eq!(status.get("state").map(String::as_str), Some("paused"));
    wait_for("the WARNING naming the paused task", CONVERGE, || {
        let log = cluster.server_log();
        (log.contains(&format!(
            "WARNING:  pg_meili_sync task {notes_task}: replication slot \"meili_sync_"
        )) && log.contains("_shared\" retains"))
        .then_some(())
    });
    cluster.psql(&format!("SELECT meili_sync_resume({notes_task})"));
    cluster.psql(&insert_notes(2001, 2100));
    converge(&cluster, &meili, &notes_index, "notes");
    // Once it caught up, the slot lets the WAL go.
    wait_for("the flag to clear", CONVERGE, || {
        (cluster
            .status(notes_task)
            .get("wal_warning")
            .map(String::as_str)
            == Some("false"))
        .then_some(())
    });
}

/// Starts a task with a slot of its own on `table` and waits until it streams.
fn start_own(cluster: &Cluster, meili: &Meili, table: &str) -> (String, i64) {
    start_copied(
        cluster,
        meili,
        table,
        json!({"decoding": "own", "batch_size": 500}),
    )
}

fn own_slot_exists(cluster: &Cluster, task: i64) -> bool {
    cluster.psql(&format!(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'meili\\_sync\\_%\\_{task}'"
    )) == "1"
}

/// Waits until a task has moved into the shared pass: its own slot is gone and the decoder
/// streams it.
fn wait_moved(cluster: &Cluster, task: i64) {
    wait_for("the task to move into the shared pass", CONVERGE, || {
        let status = cluster.status(task);
        (status.get("decoding").map(String::as_str) == Some("shared")
            && status.get("state").map(String::as_str) == Some("streaming")
            && !own_slot_exists(cluster, task))
        .then_some(())
    });
}

#[test]
fn tasks_with_their_own_slot_move_into_the_shared_pass_while_writes_go_on() {
    let (cluster, meili) = setup();
    let (products_index, products_task) = start_own(&cluster, &meili, "products");
    let (notes_index, notes_task) = start_own(&cluster, &meili, "notes");
    assert_eq!(
        cluster
            .status(products_task)
            .get("decoding")
            .map(String::as_str),
        Some("own")
    );
    assert!(own_slot_exists(&cluster, products_task));

    std::thread::scope(|scope| {
        // Writes on both tables all through the move: each statement is its own transaction, so
        // transactions commit before, at and after every hand-over.
        // A statement refused while the server restarts after the kill below is tried again.
        // It may have committed before its connection was cut, so inserts skip rows already
        // there rather than fail on the key forever.
        let write = |sql: &str| {
            let deadline = Instant::now() + CONVERGE;
            while let Err(refused) = cluster.try_psql(sql) {
                assert!(
                    Instant::now() < deadline,
                    "a write refused for {CONVERGE:?}, last with: {refused}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        };
        let insert = move |sql: String| write(&format!("{sql} ON CONFLICT (id) DO NOTHING"));
        let writer = scope.spawn(move || {
            for round in 0..60i64 {
                let first = 2001 + round * 50;
                insert(products::insert_sql(first, first + 49));
                insert(insert_notes(first, first + 49));
                write(&format!(
                    "UPDATE products SET version = version + 1 WHERE id % 60 = {}",
                    round % 60
                ));
                write(&format!("DELETE FROM notes WHERE id = {}", first - 1000));
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        // Altered from own: moves by a hand-over from its own slot.
        cluster.psql(&format!(
            "SELECT meili_sync_alter({products_task}, '{{\"decoding\": \"shared\"}}')"
        ));
        // Created before shared decoding was the default (no "decoding" stored): moves by itself
        // once its worker starts again, as after an upgrade of the library.
        cluster.psql(&format!(
            "UPDATE meili_sync.tasks SET options = options - 'decoding', generation = generation + 1 WHERE id = {notes_task}"
        ));
        // Killed mid-move: the worker starts again and still hands over.
        std::thread::sleep(Duration::from_millis(300));
        if let Some(pid) = cluster
            .status(notes_task)
            .get("worker_pid")
            .and_then(|pid| pid.parse::<i64>().ok())
        {
            if own_slot_exists(&cluster, notes_task) {
                cluster.kill_worker(notes_task, pid);
            }
        }
        wait_moved(&cluster, products_task);
        wait_moved(&cluster, notes_task);
        writer.join().expect("writer");
    });
    cluster.psql("UPDATE notes SET n = n + 1 WHERE id % 3 = 0");
    cluster.psql(&products::insert_sql(6001, 6500));
    converge(&cluster, &meili, &products_index, "products");
    converge(&cluster, &meili, &notes_index, "notes");
    assert_eq!(
        cluster.psql("SELECT string_agg(slot_name, ',') FROM pg_replication_slots"),
        cluster.psql("SELECT format('meili_sync_%s_shared', 'meili_sync.tasks'::regclass::oid)"),
        "only the shared slot is left"
    );
    assert_eq!(
        cluster.psql("SELECT string_agg(pubname, ',') FROM pg_publication"),
        cluster.psql("SELECT format('meili_sync_%s_shared', 'meili_sync.tasks'::regclass::oid)"),
        "only the shared publication is left"
    );
    assert_eq!(
        cluster.psql(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_meili_sync task'"
        ),
        "0",
        "no task worker once both moved"
    );
    // The way back is refused: a new slot of its own would skip what the shared slot holds.
    let refused = cluster
        .try_psql(&format!(
            "SELECT meili_sync_alter({products_task}, '{{\"decoding\": \"own\"}}')"
        ))
        .expect_err("moving back to a slot of its own");
    assert!(
        refused.contains("cannot move to a slot of its own"),
        "{refused}"
    );
}
