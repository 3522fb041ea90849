//! End to end: changes committed from a separate client after the backfill reach the index in
//! commit order, through crashes; every test ends with "the index holds exactly the table's rows".

use std::time::Duration;

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{
    assert_no_crash, products, start_task, wait_for, wait_index_matches_table, TaskStart,
};
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(300);

fn streaming_task(rows: i64, extra: serde_json::Value) -> (Cluster, Meili, String, i64) {
    streaming_task_with(&[], rows, extra)
}

/// A streaming task on a cluster with extra server settings.
fn streaming_task_with(
    settings: &[&str],
    rows: i64,
    extra: serde_json::Value,
) -> (Cluster, Meili, String, i64) {
    let cluster = Cluster::start(settings);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, rows));
    let meili = Meili::from_env();
    let (index, task) = start_copied_task(&cluster, &meili, extra);
    (cluster, meili, index, task)
}

/// Starts a task on `products` and waits for its copy.
fn start_copied_task(cluster: &Cluster, meili: &Meili, extra: serde_json::Value) -> (String, i64) {
    TaskStart::on("products")
        .index_named("stream")
        .options(extra)
        .start_copied(cluster, meili, CONVERGE)
}

fn converge(cluster: &Cluster, meili: &Meili, index: &str) {
    wait_index_matches_table(cluster, meili, index, "products", CONVERGE);
}

#[test]
fn inserts_updates_deletes_and_key_changes() {
    let (cluster, meili, index, task) = streaming_task(1000, json!({}));
    cluster.psql(&products::insert_sql(1001, 1500));
    cluster.psql(
        "UPDATE products SET name = 'renamed ' || id, version = version + 1 WHERE id % 3 = 0",
    );
    cluster.psql("DELETE FROM products WHERE id % 5 = 0");
    cluster.psql("UPDATE products SET id = id + 100000 WHERE id BETWEEN 10 AND 30");
    cluster
        .psql("BEGIN; INSERT INTO products (id, name) VALUES (900000, 'rolled back'); ROLLBACK;");
    cluster.psql(
        "BEGIN; INSERT INTO products (id, name) VALUES (900001, 'kept'); SAVEPOINT s; \
         INSERT INTO products (id, name) VALUES (900002, 'undone'); ROLLBACK TO s; \
         UPDATE products SET meta = '{\"nested\": {\"deep\": [1, {\"x\": null}]}}' WHERE id = 900001; COMMIT;",
    );
    converge(&cluster, &meili, &index);
    // 300 deleted rows and 16 key changes (each deletes the old id).
    wait_for("the delete counters", CONVERGE, || {
        let counted = cluster.psql(&format!(
            "SELECT s.documents_deleted || ',' || p.deletes FROM meili_sync_status s JOIN pg_stat_meili_sync p USING (task) WHERE task = {task}"
        ));
        (counted == "316,316").then_some(())
    });
    let times = cluster.psql(&format!(
        "SELECT last_sent_at <= now() AND last_confirmed_at >= last_sent_at - interval '1 minute' FROM meili_sync_status WHERE task = {task}"
    ));
    assert_eq!(times, "t");
}

#[test]
fn a_row_updated_500_times_in_one_transaction_is_sent_once() {
    let (cluster, meili, index, task) = streaming_task(100, json!({}));
    converge(&cluster, &meili, &index);
    let sent = || -> i64 {
        cluster
            .status(task)
            .get("documents_sent")
            .and_then(|sent| sent.parse().ok())
            .expect("documents_sent")
    };
    let before = sent();
    cluster.psql(
        "DO $$ BEGIN FOR v IN 1..500 LOOP UPDATE products SET version = v WHERE id = 7; END LOOP; END $$",
    );
    cluster.psql("UPDATE products SET name = 'last' WHERE id = 8");
    // The index holds version 500 of row 7 (and every other row as it is).
    converge(&cluster, &meili, &index);
    // The status view is published at most once a second for a task with nothing in flight.
    wait_for("the documents sent to be counted", CONVERGE, || {
        (sent() - before >= 2).then_some(())
    });
    std::thread::sleep(Duration::from_millis(1500));
    let documents = sent() - before;
    assert!(
        documents <= 3,
        "{documents} documents sent for two changed rows (500 versions of one)"
    );
}

#[test]
fn unchanged_toast_columns_keep_their_value() {
    let (cluster, meili, index, task) = streaming_task(10, json!({}));
    cluster.psql("ALTER TABLE products ALTER COLUMN description SET STORAGE EXTERNAL");
    cluster.psql("UPDATE products SET description = repeat('long text ✓ ', 1000) WHERE id <= 5");
    converge(&cluster, &meili, &index);
    // Only `version` changes: pgoutput sends the TOASTed description as "unchanged".
    cluster.psql("UPDATE products SET version = version + 10 WHERE id <= 5");
    converge(&cluster, &meili, &index);
    // Those 5 went as partial updates, counted apart.
    wait_for("the update counter", CONVERGE, || {
        let updates = cluster.psql(&format!(
            "SELECT updates FROM pg_stat_meili_sync WHERE task = {task}"
        ));
        (updates == "5").then_some(())
    });
}

#[test]
fn truncate_empties_the_index_and_later_rows_arrive() {
    let (cluster, meili, index, task) = streaming_task(500, json!({}));
    cluster.psql("TRUNCATE products");
    cluster.psql(&products::insert_sql(2000, 2010));
    converge(&cluster, &meili, &index);
    wait_for("the truncate counter", CONVERGE, || {
        let counted = cluster.psql(&format!(
            "SELECT truncates || ',' || deletes FROM pg_stat_meili_sync WHERE task = {task}"
        ));
        (counted == "1,0").then_some(())
    });
}

#[test]
fn columns_added_and_dropped_while_streaming() {
    let (cluster, meili, index, _) = streaming_task(100, json!({}));
    cluster.psql("ALTER TABLE products ADD COLUMN rating int DEFAULT 3");
    cluster.psql("UPDATE products SET rating = 5 WHERE id <= 10");
    cluster.psql(&products::insert_sql(101, 110));
    cluster.psql("ALTER TABLE products DROP COLUMN category");
    cluster.psql("ALTER TABLE products ALTER COLUMN version TYPE bigint");
    cluster.psql("UPDATE products SET version = 7");
    converge(&cluster, &meili, &index);
}

#[test]
fn a_dropped_key_column_stops_the_task_with_an_error() {
    let (cluster, _meili, _index, task) = streaming_task(10, json!({}));
    cluster.psql("ALTER TABLE products RENAME COLUMN id TO product_id");
    cluster.psql("UPDATE products SET version = 2 WHERE product_id = 1");
    let status = cluster.wait_error(task, CONVERGE);
    let error = status.get("last_error").cloned().unwrap_or_default();
    assert!(
        error.contains("key column \"id\"") && error.contains("dropped or renamed"),
        "{status:?}"
    );
}

#[test]
fn randomized_workload_converges() {
    let (cluster, meili, index, _) =
        streaming_task(2000, json!({"batch_size": 50, "max_inflight": 4}));
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for round in 0..60 {
        let mut statements = Vec::new();
        for _ in 0..(1 + next() % 6) {
            let id = 1 + (next() % 2500) as i64;
            statements.push(match next() % 4 {
                0 => format!("INSERT INTO products (id, name, price) VALUES ({id}, 'random {round}', {}) ON CONFLICT (id) DO UPDATE SET name = EXCLUDED.name", next() % 1000),
                1 => format!("UPDATE products SET version = version + 1, tags = ARRAY['r{round}'] WHERE id = {id}"),
                2 => format!("DELETE FROM products WHERE id = {id}"),
                _ => format!("UPDATE products SET in_stock = NOT coalesce(in_stock, false) WHERE id BETWEEN {id} AND {}", id + 20),
            });
        }
        let ending = match next() % 5 {
            0 => "ROLLBACK",
            _ => "COMMIT",
        };
        let body = if next() % 3 == 0 && statements.len() > 1 {
            let last = statements.pop().unwrap_or_default();
            format!(
                "{}; SAVEPOINT s; {last}; ROLLBACK TO s",
                statements.join("; ")
            )
        } else {
            statements.join("; ")
        };
        cluster.psql(&format!("BEGIN; {body}; {ending};"));
    }
    converge(&cluster, &meili, &index);
}

#[test]
fn streaming_survives_a_killed_worker() {
    let (cluster, meili, index, task) = streaming_task(1000, json!({"batch_size": 100}));
    for round in 0..5 {
        cluster.psql(&format!(
            "UPDATE products SET version = version + 1 WHERE id % 5 = {round}"
        ));
    }
    let pid: i64 = cluster
        .status(task)
        .get("worker_pid")
        .and_then(|pid| pid.parse().ok())
        .expect("worker pid");
    cluster.kill_worker(task, pid);
    for round in 0..5 {
        cluster.psql(&format!(
            "UPDATE products SET name = 'after kill {round}' WHERE id % 7 = {round}"
        ));
    }
    converge(&cluster, &meili, &index);
}

#[test]
fn streaming_survives_an_immediate_shutdown() {
    let (cluster, meili, index, _) = streaming_task(1000, json!({"batch_size": 100}));
    cluster.psql(&products::insert_sql(1001, 3000));
    cluster.psql("UPDATE products SET version = version + 1 WHERE id % 2 = 0");
    cluster.pg_ctl_stop("immediate");
    cluster.pg_ctl_start();
    cluster.psql("DELETE FROM products WHERE id % 9 = 0");
    converge(&cluster, &meili, &index);
}

#[test]
fn a_million_row_transaction_streams_through() {
    let (cluster, meili, index, task) = streaming_task(1, json!({}));
    cluster.psql(&products::insert_sql(2, 1_000_000));
    wait_for("a million documents", Duration::from_secs(1800), || {
        (meili.document_count(&index) == Some(1_000_000)).then_some(())
    });
    meili.wait_idle(&index, CONVERGE);
    if let Err(problem) = products::diff_index(&meili.all_documents(&index), 1_000_000, 1) {
        panic!("{problem}");
    }
    let status = cluster.status(task);
    assert_eq!(
        status.get("state").map(String::as_str),
        Some("streaming"),
        "{status:?}"
    );
}

#[test]
fn an_idle_task_does_not_hold_wal_written_by_other_tables() {
    for decoding in ["shared", "own"] {
        let (cluster, _meili, _index, task) = streaming_task(10, json!({ "decoding": decoding }));
        cluster.psql("CREATE TABLE other_table (id int PRIMARY KEY, payload text)");
        // The task's position (its own slot's, or its position in the shared slot), and the
        // one slot there is (its own, or the shared one).
        let positions = || -> Option<(i64, i64)> {
            let row = cluster.psql(&format!(
                "SELECT (confirmed_lsn - '0/0')::bigint || ',' || (SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots)
                   FROM meili_sync_status WHERE task = {task}"
            ));
            let (task_position, slot) = row.split_once(',')?;
            Some((task_position.parse().ok()?, slot.parse().ok()?))
        };
        let (before, _) = positions().expect("positions");
        cluster.psql(
            "INSERT INTO other_table SELECT i, repeat('x', 200) FROM generate_series(1, 20000) i",
        );
        let written: i64 = cluster
            .psql("SELECT pg_current_wal_lsn() - '0/0'")
            .parse()
            .expect("lsn");
        wait_for(
            &format!(
                "the idle task ({decoding}) and its slot to confirm past the other table's WAL"
            ),
            CONVERGE,
            || {
                let (task_position, slot) = positions()?;
                (task_position >= written && slot >= written && task_position > before)
                    .then_some(())
            },
        );
    }
}

#[test]
fn a_paused_task_retaining_wal_is_flagged() {
    let (cluster, meili, index, task) =
        streaming_task_with(&["meili_sync.max_retained_wal=1MB"], 100, json!({}));
    cluster.psql(&format!("SELECT meili_sync_pause({task})"));
    cluster.psql(&products::insert_sql(101, 20_000));
    let status = wait_for("the retained-WAL flag", CONVERGE, || {
        let status = cluster.status(task);
        (status.get("wal_warning").map(String::as_str) == Some("true")).then_some(status)
    });
    assert_eq!(
        status.get("state").map(String::as_str),
        Some("paused"),
        "{status:?}"
    );
    // The launcher says it in the server log too, with a hint.
    wait_for(
        "the retained-WAL WARNING in the server log",
        CONVERGE,
        || {
            let log = cluster.server_log();
            (log.contains(&format!(
                "WARNING:  pg_meili_sync task {task}: replication slot"
            )) && log.contains("more than meili_sync.max_retained_wal (1 MB)")
                && log.contains("HINT:  Meilisearch has not confirmed"))
            .then_some(())
        },
    );
    // Nothing was lost while paused.
    cluster.psql(&format!("SELECT meili_sync_resume({task})"));
    wait_index_matches_table(&cluster, &meili, &index, "products", CONVERGE);
}

#[test]
fn an_invalidated_slot_stops_the_task_until_a_new_snapshot() {
    invalidated_slot_stops_the_task_until_a_new_snapshot("own");
}

#[test]
fn an_invalidated_shared_slot_stops_its_tasks_until_a_new_snapshot() {
    invalidated_slot_stops_the_task_until_a_new_snapshot("shared");
}

fn invalidated_slot_stops_the_task_until_a_new_snapshot(decoding: &str) {
    let (cluster, meili, index, task) = streaming_task_with(
        &["max_slot_wal_keep_size=32MB"],
        1000,
        json!({ "decoding": decoding }),
    );
    cluster.psql(&format!("SELECT meili_sync_pause({task})"));
    // Changes the paused task will never decode: the slot loses them.
    cluster.psql("UPDATE products SET version = 9 WHERE id % 2 = 0");
    cluster.psql("DELETE FROM products WHERE id % 7 = 0");
    cluster.psql("CREATE TABLE filler (payload text)");
    let status = wait_for("the slot to be invalidated", CONVERGE, || {
        cluster.psql(
            "INSERT INTO filler SELECT repeat(md5(i::text), 40) FROM generate_series(1, 20000) i",
        );
        cluster.psql("SELECT pg_switch_wal(); CHECKPOINT");
        let status = cluster.status(task);
        // The shared decoder may have replaced the lost slot already, having stopped the task.
        let replaced =
            decoding == "shared" && status.get("state").map(String::as_str) == Some("error");
        (status.get("wal_status").map(String::as_str) == Some("lost") || replaced).then_some(status)
    });
    // A paused task with a slot of its own finds out when it resumes; the shared decoder finds
    // out at once (it reads the slot for the other tasks) and stops the task, paused or not.
    let states: &[&str] = if decoding == "own" {
        &["paused"]
    } else {
        &["paused", "error"]
    };
    assert!(
        states.contains(&status.get("state").map(String::as_str).unwrap_or_default()),
        "{status:?}"
    );
    // Resuming cannot stream what is gone: the task stops and says what to do.
    cluster.psql(&format!("SELECT meili_sync_resume({task})"));
    let status = cluster.wait_error(task, CONVERGE);
    let error = status.get("last_error").cloned().unwrap_or_default();
    assert!(
        error.contains("lost") && error.contains(&format!("meili_sync_snapshot({task})")),
        "{status:?}"
    );
    // A new snapshot replaces the slot and brings the index back to the table.
    cluster.psql(&format!("SELECT meili_sync_snapshot({task})"));
    cluster.wait_snapshot_done(task, CONVERGE);
    cluster.psql("UPDATE products SET version = 10 WHERE id % 5 = 0");
    converge(&cluster, &meili, &index);
    assert_ne!(
        cluster.status(task).get("wal_status").map(String::as_str),
        Some("lost")
    );
}

#[test]
fn a_vanished_slot_stops_the_task_instead_of_starting_afresh() {
    // A failover, a restore, pg_upgrade or a manual drop: the slot and the changes it kept are gone.
    let (cluster, meili, index, task) = streaming_task(1000, json!({"decoding": "own"}));
    cluster.psql(&format!("SELECT meili_sync_stop({task})"));
    wait_for("the worker to let go of its slot", CONVERGE, || {
        let active = cluster.psql(&format!(
            "SELECT count(*) FROM pg_replication_slots WHERE active AND slot_name LIKE 'meili\\_sync\\_%\\_{task}'"
        ));
        (active == "0").then_some(())
    });
    cluster.psql("UPDATE products SET version = 9 WHERE id % 2 = 0");
    cluster.psql("DELETE FROM products WHERE id % 7 = 0");
    cluster.psql(&format!(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name LIKE 'meili\\_sync\\_%\\_{task}'"
    ));
    cluster.psql(&format!("SELECT meili_sync_resume({task})"));
    let status = cluster.wait_error(task, CONVERGE);
    let error = status.get("last_error").cloned().unwrap_or_default();
    assert!(
        error.contains("is missing") && error.contains(&format!("meili_sync_snapshot({task})")),
        "{status:?}"
    );
    // Before this was an error, a new slot at the current position skipped those changes for good.
    cluster.psql(&format!("SELECT meili_sync_snapshot({task})"));
    cluster.wait_snapshot_done(task, CONVERGE);
    converge(&cluster, &meili, &index);
}

#[test]
fn drop_extension_leaves_nothing_running_and_nothing_retaining_wal() {
    let (cluster, meili, _index, _task) = streaming_task(200, json!({}));
    cluster.psql("DROP EXTENSION pg_meili_sync CASCADE");
    cluster.psql(&products::insert_sql(201, 300));
    wait_for("workers, slots and publications to go", CONVERGE, || {
        let left = cluster.psql(
            "SELECT (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_meili_sync task')
                 || ',' || (SELECT count(*) FROM pg_replication_slots)
                 || ',' || (SELECT count(*) FROM pg_publication)",
        );
        (left == "0,0,0").then_some(())
    });
    // Rounds without the extension (longer than the WAL guard's 5 s) are quiet.
    let logged_before = cluster.server_log().len();
    std::thread::sleep(Duration::from_secs(6));
    assert!(
        !cluster.server_log()[logged_before..].contains("a round failed"),
        "{}",
        cluster.tail_log()
    );
    // The extension comes back empty, and a new task works.
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    assert_eq!(cluster.psql("SELECT count(*) FROM meili_sync_status"), "0");
    let (index, _) = start_copied_task(&cluster, &meili, json!({}));
    converge(&cluster, &meili, &index);
}

/// DROP and CREATE EXTENSION in one transaction, within one launcher round: task ids start again
/// at 1 in the new install. The old install's workers stop, its slots and publications go (no WAL
/// kept for them), and a new task streams, also after a restart.
#[test]
fn drop_and_create_extension_at_once_leaves_nothing_of_the_old_install() {
    let (cluster, meili, _index, old_task) = streaming_task(200, json!({}));
    let old_install = cluster.psql("SELECT 'meili_sync.tasks'::regclass::oid");
    cluster.psql("DROP EXTENSION pg_meili_sync CASCADE; CREATE EXTENSION pg_meili_sync");
    let install = cluster.psql("SELECT 'meili_sync.tasks'::regclass::oid");
    assert_ne!(install, old_install);
    let (index, task) = start_copied_task(&cluster, &meili, json!({}));
    assert_eq!(
        task, old_task,
        "the new install numbers its tasks from 1 again"
    );
    cluster.psql(&products::insert_sql(201, 300));
    converge(&cluster, &meili, &index);
    let of_old_install = format!(
        "SELECT coalesce(string_agg(name, ','), '') FROM (
            SELECT slot_name::text AS name FROM pg_replication_slots
            UNION ALL SELECT pubname::text FROM pg_publication) o
          WHERE name LIKE 'meili\\_sync\\_{old_install}\\_%'"
    );
    wait_for(
        "no slot or publication of the old install",
        CONVERGE,
        || cluster.psql(&of_old_install).is_empty().then_some(()),
    );
    cluster.pg_ctl_stop("fast");
    cluster.pg_ctl_start();
    cluster.psql(&products::insert_sql(301, 400));
    converge(&cluster, &meili, &index);
    let status = cluster.status(task);
    assert_eq!(
        status.get("state").map(String::as_str),
        Some("streaming"),
        "{status:?}"
    );
    assert_no_crash(&cluster);
}

/// Terminates the launcher and waits for the postmaster to start a new one; returns its pid.
fn restart_launcher(cluster: &Cluster) -> String {
    let launcher_pid = || {
        cluster
            .psql("SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_meili_sync launcher'")
    };
    let old = launcher_pid();
    cluster.psql(&format!("SELECT pg_terminate_backend({old})"));
    wait_for("a new launcher", CONVERGE, || {
        let new = launcher_pid();
        (!new.is_empty() && new != old).then_some(new)
    })
}

fn task_workers(cluster: &Cluster) -> String {
    cluster.psql(
        "SELECT coalesce(string_agg(pid::text, ','), '') FROM pg_stat_activity WHERE backend_type = 'pg_meili_sync task'",
    )
}

#[test]
fn a_restarted_launcher_follows_the_running_workers() {
    // A task worker of its own; the shared decoder is followed the same way (it is the pseudo-task
    // -1 in shared memory).
    let (cluster, meili, index, task) = streaming_task(500, json!({"decoding": "own"}));
    let worker = cluster.status(task)["worker_pid"].clone();
    restart_launcher(&cluster);
    // Several rounds of the new launcher: no second worker for the task, and the first streams on.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(task_workers(&cluster), worker);
    cluster.psql(&products::insert_sql(501, 700));
    converge(&cluster, &meili, &index);
    assert_eq!(task_workers(&cluster), worker);
    assert!(cluster.server_log().contains(&format!(
        "the worker of task {task} (pid {worker}) still runs; following it"
    )));
    // meili_sync_stop reaches the worker the new launcher did not start.
    cluster.psql(&format!("SELECT meili_sync_stop({task})"));
    wait_for("the worker to stop", CONVERGE, || {
        task_workers(&cluster).is_empty().then_some(())
    });
    assert_eq!(cluster.status(task)["state"], "stopped");
}

#[test]
fn an_error_in_a_launcher_round_is_logged_and_the_launcher_goes_on() {
    let (cluster, meili, index, task) = streaming_task(100, json!({"decoding": "own"}));
    let worker = cluster.status(task)["worker_pid"].clone();
    // A launcher that connects from now on gives up on a lock after 100 ms.
    cluster.psql("ALTER ROLE postgres SET lock_timeout = '100ms'");
    let launcher = restart_launcher(&cluster);
    cluster.psql(
        "SET lock_timeout = 0; BEGIN; LOCK TABLE meili_sync.tasks IN ACCESS EXCLUSIVE MODE; SELECT pg_sleep(2); COMMIT",
    );
    cluster.psql("ALTER ROLE postgres RESET lock_timeout");
    assert!(
        cluster
            .server_log()
            .contains("pg_meili_sync launcher: a round failed and is tried again: canceling statement due to lock timeout"),
        "{}",
        cluster.tail_log()
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        cluster
            .psql("SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_meili_sync launcher'"),
        launcher,
        "the launcher must not have exited"
    );
    assert_eq!(task_workers(&cluster), worker);
    cluster.psql(&products::insert_sql(101, 200));
    converge(&cluster, &meili, &index);
}

#[test]
fn a_replica_identity_that_drops_the_key_stops_the_task() {
    let (cluster, _meili, _index, task) = streaming_task(100, json!({}));
    // The replica identity moves to another unique index: a DELETE's old row no longer says
    // which document to delete.
    cluster.psql(
        "ALTER TABLE products ADD COLUMN code bigint; UPDATE products SET code = id + 1000000;
         ALTER TABLE products ALTER COLUMN code SET NOT NULL;
         CREATE UNIQUE INDEX products_code ON products (code);
         ALTER TABLE products REPLICA IDENTITY USING INDEX products_code",
    );
    cluster.psql("DELETE FROM products WHERE id = 5");
    let status = cluster.wait_error(task, CONVERGE);
    let error = status.get("last_error").cloned().unwrap_or_default();
    assert!(
        error.contains("a DELETE on public.products came without the old key")
            && error.contains("REPLICA IDENTITY FULL"),
        "{status:?}"
    );
    assert_eq!(
        cluster.psql("SELECT count(*) FROM meili_sync.dead_letters"),
        "0"
    );
}

#[test]
fn verify_finds_a_damaged_index_and_repair_fixes_exactly_that() {
    let (cluster, meili, index, task) = streaming_task(2000, json!({}));
    converge(&cluster, &meili, &index);
    let clean = cluster.psql(&format!(
        "SELECT rows_checked || ',' || documents_checked || ',' || missing || ',' || extra || ',' || different FROM meili_sync_verify({task})"
    ));
    assert_eq!(clean, "2000,2000,0,0,0");
    // Damage the index behind the task's back: two documents deleted, two changed, three added.
    let documents = |path: &str| format!("/indexes/{index}/documents{path}");
    use pg_meili_sync_e2e::meili::Method;
    meili.request(
        Method::POST,
        &documents("/delete-batch"),
        Some(json!([5, 6])),
    );
    meili.request(
        Method::PUT,
        &documents(""),
        Some(json!([{"id": 10, "name": "tampered"}, {"id": 11, "price": -1}])),
    );
    meili.request(
        Method::POST,
        &documents(""),
        Some(json!([{"id": 100001, "name": "ghost"}, {"id": 100002}, {"id": "not-a-number"}])),
    );
    meili.wait_idle(&index, CONVERGE);
    let report = cluster.psql(&format!(
        "SELECT rows_checked || ',' || documents_checked || ',' || missing || ',' || extra || ',' || different
                || ' ' || array_to_string(sample_missing, '/') || ' ' || array_to_string(sample_extra, '/')
                || ' ' || array_to_string(sample_different, '/')
           FROM meili_sync_verify({task})"
    ));
    assert_eq!(
        report,
        "2000,2001,2,3,2 5/6 100001/100002/not-a-number 10/11"
    );
    // The repair fixes exactly the damage, and the stream goes on after it.
    let repaired = cluster.psql(&format!(
        "SELECT resent || ',' || deleted FROM meili_sync_repair({task})"
    ));
    assert_eq!(repaired, "4,3");
    cluster.psql("UPDATE products SET version = 3 WHERE id % 50 = 0");
    converge(&cluster, &meili, &index);
    let clean = cluster.psql(&format!(
        "SELECT missing + extra + different FROM meili_sync_verify({task})"
    ));
    assert_eq!(clean, "0");
}

#[test]
fn resync_rebuilds_the_index_while_writes_continue() {
    use pg_meili_sync_e2e::meili::Method;
    use std::sync::atomic::{AtomicBool, Ordering};
    let (cluster, meili, index, task) = streaming_task(
        20_000,
        json!({"batch_size": 2000, "settings": {"filterableAttributes": ["category"]}}),
    );
    // A setting changed in Meilisearch directly must survive the rebuild; the damage must not.
    let (_, answer) = meili.request(
        Method::PATCH,
        &format!("/indexes/{index}/settings"),
        Some(json!({"sortableAttributes": ["price"]})),
    );
    meili.wait_task(answer["taskUid"].as_u64().expect("task uid"), CONVERGE);
    meili.request(
        Method::POST,
        &format!("/indexes/{index}/documents/delete-batch"),
        Some(json!([5, 6])),
    );
    meili.request(
        Method::POST,
        &format!("/indexes/{index}/documents"),
        Some(json!([{"id": 900001, "name": "stray"}])),
    );
    meili.wait_idle(&index, CONVERGE);
    assert_eq!(meili.document_count(&index), Some(19_999));

    let writing = AtomicBool::new(true);
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            let mut round = 0_i64;
            while writing.load(Ordering::Relaxed) {
                let first = 30_000 + round * 20;
                cluster.psql_script(&format!(
                    "BEGIN;\n{};\nUPDATE products SET version = version + 1, name = 'during resync {round}' WHERE id % 997 = {};\nDELETE FROM products WHERE id = {};\nCOMMIT;\n",
                    products::insert_sql(first, first + 19).trim_end_matches(';'),
                    round % 997,
                    100 + round,
                ));
                round += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            round
        });
        // A failed assertion below must stop the writer, or the scope would wait for it forever.
        struct StopWriter<'a>(&'a AtomicBool);
        impl Drop for StopWriter<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Relaxed);
            }
        }
        let stop_writer = StopWriter(&writing);
        let helper: i64 = cluster
            .psql(&format!("SELECT meili_sync_resync({task})"))
            .parse()
            .expect("helper task id");
        let shown = cluster.psql(&format!(
            "SELECT index_uid || ',' || resync_of FROM meili_sync_status WHERE task = {helper}"
        ));
        assert_eq!(shown, format!("{index}__resync,{task}"));
        // The live index answers searches, with its documents, all along the rebuild.
        wait_for("the resync to swap and finish", CONVERGE, || {
            let count = meili.document_count(&index).unwrap_or(0);
            assert!(
                count >= 19_000,
                "the live index held {count} documents during the resync"
            );
            let (status, _) = meili.request(
                Method::POST,
                &format!("/indexes/{index}/search"),
                Some(json!({"q": "product", "limit": 1})),
            );
            assert_eq!(status, 200, "search during the resync");
            let left = cluster.psql(&format!(
                "SELECT count(*) FROM meili_sync.tasks WHERE id = {helper}"
            ));
            (left == "0").then_some(())
        });
        // Writes go on after the swap, into the new index.
        std::thread::sleep(Duration::from_millis(500));
        drop(stop_writer);
        let rounds = writer.join().expect("writer thread");
        assert!(rounds > 0, "no writes during the resync");
    });
    cluster.psql("UPDATE products SET price = 1.5 WHERE id = 7");
    converge(&cluster, &meili, &index);
    assert_eq!(meili.index(&format!("{index}__resync")), None);
    let (_, settings) = meili.request(Method::GET, &format!("/indexes/{index}/settings"), None);
    assert_eq!(settings["sortableAttributes"], json!(["price"]));
    assert_eq!(settings["filterableAttributes"], json!(["category"]));
    let state = cluster.psql(&format!(
        "SELECT state || ',' || (SELECT count(*) FROM meili_sync_status) FROM meili_sync_status WHERE task = {task}"
    ));
    assert_eq!(state, "streaming,1");
    let clean = cluster.psql(&format!(
        "SELECT missing + extra + different FROM meili_sync_verify({task})"
    ));
    assert_eq!(clean, "0");
}

#[test]
fn a_resync_waits_for_a_paused_task_and_can_be_cancelled() {
    let (cluster, meili, index, task) = streaming_task(2000, json!({}));
    // Paused in the same transaction, so the helper can never hold the task for its swap.
    cluster.psql(&format!(
        "SELECT meili_sync_resync({task}); SELECT meili_sync_pause({task})"
    ));
    let helper: i64 = cluster
        .psql(&format!(
            "SELECT id FROM meili_sync.tasks WHERE resync_of = {task}"
        ))
        .parse()
        .expect("helper task id");
    let fresh = format!("{index}__resync");
    wait_for("the helper to copy and stream", CONVERGE, || {
        let state = cluster.status(helper).get("state").cloned();
        (state.as_deref() == Some("streaming") && meili.document_count(&fresh) == Some(2000))
            .then_some(())
    });
    // The helper waits: the task stays paused and the live index keeps its uid and documents.
    std::thread::sleep(Duration::from_secs(2));
    let state = cluster.psql(&format!(
        "SELECT state FROM meili_sync_status WHERE task = {task}"
    ));
    assert_eq!(state, "paused");
    cluster.psql(&format!(
        "SELECT meili_sync_drop({helper}, drop_index => true)"
    ));
    wait_for("the helper's slot to go", CONVERGE, || {
        (cluster.psql("SELECT count(*) FROM pg_replication_slots") == "1").then_some(())
    });
    assert_eq!(meili.index(&fresh), None);
    cluster.psql(&products::insert_sql(3000, 3100));
    cluster.psql(&format!("SELECT meili_sync_resume({task})"));
    converge(&cluster, &meili, &index);
    let state = cluster.psql(&format!(
        "SELECT state FROM meili_sync_status WHERE task = {task}"
    ));
    assert_eq!(state, "streaming");
}

#[test]
fn stopping_a_busy_worker_never_takes_the_server_down() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (cluster, meili, index, task) = streaming_task(1000, json!({}));
    let writing = AtomicBool::new(true);
    std::thread::scope(|scope| {
        // Small commits back to back: each wakes the worker with a signal, the moment a SIGTERM
        // could land on one of its HTTP threads if those did not block signals.
        let writer = scope.spawn(|| {
            let mut id = 100_000_i64;
            while writing.load(Ordering::Relaxed) {
                let _ = cluster.try_psql(&products::insert_sql(id, id + 4));
                id += 5;
            }
        });
        for _ in 0..20 {
            cluster.psql(&format!("SELECT meili_sync_pause({task})"));
            wait_for("the worker to stop", CONVERGE, || {
                let pid = cluster.status(task).get("worker_pid").cloned();
                (pid.as_deref() == Some("null")).then_some(())
            });
            cluster.psql(&format!("SELECT meili_sync_resume({task})"));
            wait_for("the worker to stream again", CONVERGE, || {
                let state = cluster.status(task).get("state").cloned();
                (state.as_deref() == Some("streaming")).then_some(())
            });
            std::thread::sleep(Duration::from_millis(100));
        }
        writing.store(false, Ordering::Relaxed);
        writer.join().expect("writer thread");
    });
    // The check at the end of converge: no process aborted (the postmaster would have restarted
    // the server). The test sends no SIGKILL, so any crash recovery is a failure too.
    assert!(
        !cluster
            .server_log()
            .contains("all server processes terminated"),
        "a worker took the server down:\n{}",
        cluster.tail_log()
    );
    converge(&cluster, &meili, &index);
}

/// A DDL that changes what the documents look like without changing rows (a column dropped,
/// added with a default, renamed or retyped, an enum value renamed) shows the task out of shape,
/// and a resync of its own brings every document in line while writes go on: then every document
/// equals its row, with no field of a dropped or renamed column left. With `"schema_changes":
/// "report"` the task only shows it, with the call to make; a column outside `columns` is no
/// part of the documents and changes nothing.
#[test]
fn a_ddl_that_changes_the_documents_resyncs_the_task_into_the_new_shape() {
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql_script(
        "CREATE TYPE public.mood AS ENUM ('sad', 'glad');
         CREATE TABLE public.t (id int PRIMARY KEY, a text, b int, c int, m public.mood);
         INSERT INTO public.t SELECT g, 'a' || g, g, g, 'sad' FROM generate_series(1, 100) g;
         CREATE TABLE public.reported (id int PRIMARY KEY, a text, b int);
         INSERT INTO public.reported SELECT g, 'r' || g, g FROM generate_series(1, 10) g;
         CREATE TABLE public.narrow (id int PRIMARY KEY, a text);
         INSERT INTO public.narrow SELECT g, 'n' || g FROM generate_series(1, 10) g;",
    );
    let meili = Meili::from_env();
    let (index, task) = start_task(&cluster, &meili, None, "public.t", json!({}));
    let (reported_index, reported) = start_task(
        &cluster,
        &meili,
        None,
        "public.reported",
        json!({"schema_changes": "report"}),
    );
    let (_, narrow) = start_task(
        &cluster,
        &meili,
        None,
        "public.narrow",
        json!({"columns": ["id", "a"]}),
    );
    for each in [task, reported, narrow] {
        cluster.wait_snapshot_done(each, CONVERGE);
    }
    wait_index_matches_table(&cluster, &meili, &index, "public.t", CONVERGE);
    let reported_in_line = || {
        wait_index_matches_table(
            &cluster,
            &meili,
            &reported_index,
            "public.reported",
            CONVERGE,
        )
    };
    reported_in_line();
    let helpers = |task: i64| {
        cluster.psql(&format!(
            "SELECT count(*) FROM meili_sync.tasks WHERE resync_of = {task}"
        ))
    };
    let last_error = |task: i64| {
        cluster
            .status(task)
            .get("last_error")
            .cloned()
            .unwrap_or_default()
    };
    cluster.psql("ALTER TABLE public.narrow ADD COLUMN z text DEFAULT 'z'");
    cluster.psql("ALTER TABLE public.reported DROP COLUMN b");
    cluster.psql_script(
        "ALTER TABLE public.t DROP COLUMN b;
         ALTER TABLE public.t ADD COLUMN d text DEFAULT 'dflt';
         ALTER TABLE public.t RENAME COLUMN a TO a2;
         ALTER TABLE public.t ALTER COLUMN c TYPE text USING 'c' || c;
         ALTER TYPE public.mood RENAME VALUE 'sad' TO 'blue';
         UPDATE public.t SET a2 = a2 || '!' WHERE id = 1;",
    );
    // Writes go on while the resync copies.
    for round in 0..5 {
        cluster.psql(&format!(
            "UPDATE public.t SET a2 = a2 || '{round}' WHERE id BETWEEN 10 AND 20;
             INSERT INTO public.t (id, a2, c, m) VALUES ({}, 'new', 'c', 'glad');",
            200 + round
        ));
    }
    cluster.psql("DELETE FROM public.t WHERE id = 2");
    wait_index_matches_table(&cluster, &meili, &index, "public.t", CONVERGE);
    assert_eq!(
        cluster.psql(&format!(
            "SELECT missing || ' ' || extra || ' ' || different FROM meili_sync_verify({task})"
        )),
        "0 0 0"
    );
    wait_for("the task back in shape", CONVERGE, || {
        (!last_error(task).starts_with("out of shape") && helpers(task) == "0").then_some(())
    });
    assert!(
        cluster.server_log().contains(&format!(
            "pg_meili_sync task {task}: a DDL changed what its documents look like"
        )),
        "{}",
        cluster.tail_log()
    );
    // The task that only reports shows it, with the call; it was not resynced.
    let shown = wait_for("the reporting task shown out of shape", CONVERGE, || {
        Some(last_error(reported)).filter(|error| error.starts_with("out of shape"))
    });
    assert!(
        shown.contains(&format!("SELECT meili_sync_resync({reported})")),
        "{shown}"
    );
    assert_eq!(helpers(reported), "0");
    let stale = meili
        .all_documents(&reported_index)
        .into_iter()
        .find(|document| document["id"] == json!(5))
        .unwrap_or_default();
    assert_eq!(stale["b"], json!(5), "{stale}");
    assert!(
        !last_error(narrow).starts_with("out of shape"),
        "{}",
        last_error(narrow)
    );
    assert_eq!(helpers(narrow), "0");
    cluster.psql(&format!("SELECT meili_sync_resync({reported})"));
    reported_in_line();
    wait_for("the reporting task back in shape", CONVERGE, || {
        (!last_error(reported).starts_with("out of shape")).then_some(())
    });
    assert_no_crash(&cluster);
}

/// Columns added, and nothing else changed: each row's values of them go to every document as
/// partial updates from the task's stream, after what it read before, while writes go on. No
/// resync: no helper task, no second index. With a constant default, a volatile one (each row's
/// own value), and no default (null), on a plain table and on a partitioned one.
#[test]
fn columns_added_reach_every_document_as_partial_updates_without_a_resync() {
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql_script(
        "CREATE TABLE public.t (id int PRIMARY KEY, a text);
         INSERT INTO public.t SELECT g, 'a' || g FROM generate_series(1, 3000) g;
         CREATE TABLE public.p (id int PRIMARY KEY, a text) PARTITION BY RANGE (id);
         CREATE TABLE public.p_low PARTITION OF public.p FOR VALUES FROM (1) TO (200);
         CREATE TABLE public.p_high PARTITION OF public.p FOR VALUES FROM (200) TO (1000);
         INSERT INTO public.p SELECT g, 'p' || g FROM generate_series(1, 400) g;",
    );
    let meili = Meili::from_env();
    let (index, task) = start_task(&cluster, &meili, None, "public.t", json!({}));
    let (parted_index, parted) = start_task(&cluster, &meili, None, "public.p", json!({}));
    for each in [task, parted] {
        cluster.wait_snapshot_done(each, CONVERGE);
    }
    wait_index_matches_table(&cluster, &meili, &index, "public.t", CONVERGE);
    cluster.psql_script(
        "ALTER TABLE public.t ADD COLUMN d text DEFAULT 'dflt';
         ALTER TABLE public.t ADD COLUMN r double precision DEFAULT random();
         ALTER TABLE public.t ADD COLUMN n int;
         ALTER TABLE public.p ADD COLUMN d text DEFAULT 'pd';",
    );
    // Writes go on while the columns are sent.
    for round in 0..5 {
        cluster.psql(&format!(
            "UPDATE public.t SET a = a || '{round}', d = 'set {round}' WHERE id BETWEEN 10 AND 20;
             INSERT INTO public.t (id, a, n) VALUES ({}, 'new', {round});
             UPDATE public.p SET d = 'set {round}' WHERE id = 7;",
            5000 + round
        ));
    }
    cluster.psql("DELETE FROM public.t WHERE id = 2");
    wait_index_matches_table(&cluster, &meili, &index, "public.t", CONVERGE);
    wait_index_matches_table(&cluster, &meili, &parted_index, "public.p", CONVERGE);
    let document = |id: i64| {
        meili
            .all_documents(&index)
            .into_iter()
            .find(|document| document["id"] == json!(id))
            .unwrap_or_default()
    };
    assert_eq!(
        (document(100)["d"].clone(), document(100)["n"].clone()),
        (json!("dflt"), json!(null))
    );
    assert!(document(100)["r"].is_f64(), "{}", document(100));
    let settled = |task: i64| {
        cluster.psql(&format!(
            "SELECT coalesce(last_error, '') || (SELECT count(*) FROM meili_sync.tasks WHERE resync_of = {task})
                    || ' ' || (missing + extra + different)
               FROM meili_sync_status, meili_sync_verify({task}) WHERE task = {task}"
        ))
    };
    for each in [task, parted] {
        wait_for("the task in shape", CONVERGE, || {
            (settled(each) == "0 0").then_some(())
        });
    }
    let log = cluster.server_log();
    for each in [task, parted] {
        assert!(
            log.contains(&format!(
                "pg_meili_sync task {each}: sent the columns added"
            )),
            "{}",
            cluster.tail_log()
        );
        assert!(
            !log.contains(&format!("pg_meili_sync task {each}: a DDL changed what")),
            "no resync: {}",
            cluster.tail_log()
        );
    }
    assert_no_crash(&cluster);
}

/// A composite type that a sent column uses gains an attribute, or has one renamed: every
/// document's value of that column is its row's (the text of the composite, which now has one
/// more field), through the resync the change starts, not only those of rows that change.
#[test]
fn an_attribute_added_to_a_composite_type_reaches_every_document() {
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql_script(
        "CREATE TYPE public.pair AS (x int, y text);
         CREATE TABLE public.ct (id int PRIMARY KEY, c public.pair);
         INSERT INTO public.ct SELECT g, ROW(g, 'y' || g)::public.pair FROM generate_series(1, 200) g;",
    );
    let meili = Meili::from_env();
    let (index, task) = start_task(&cluster, &meili, None, "public.ct", json!({}));
    cluster.wait_snapshot_done(task, CONVERGE);
    let values = || {
        let mut values: Vec<(i64, String)> = meili
            .all_documents(&index)
            .into_iter()
            .filter_map(|document| {
                Some((document["id"].as_i64()?, document["c"].as_str()?.to_owned()))
            })
            .collect();
        values.sort();
        values
    };
    let rows = || {
        let mut rows: Vec<(i64, String)> = cluster
            .psql("SELECT id || ' ' || c::text FROM public.ct")
            .lines()
            .filter_map(|line| {
                let (id, value) = line.split_once(' ')?;
                Some((id.parse().ok()?, value.to_owned()))
            })
            .collect();
        rows.sort();
        rows
    };
    wait_for("the copy in the index", CONVERGE, || {
        (values() == rows()).then_some(())
    });
    cluster.psql_script(
        "ALTER TYPE public.pair ADD ATTRIBUTE z int;
         ALTER TYPE public.pair RENAME ATTRIBUTE y TO label;
         UPDATE public.ct SET c = ROW(1, 'one', 1)::public.pair WHERE id = 1;",
    );
    let expected = rows();
    assert_eq!(
        expected.get(4).map(|(_, value)| value.as_str()),
        Some("(5,y5,)")
    );
    wait_for("every document with the new attribute", CONVERGE, || {
        (values() == expected).then_some(())
    });
    wait_for("the task back in shape", CONVERGE, || {
        (cluster.psql(&format!(
            "SELECT coalesce(last_error, '') || (SELECT count(*) FROM meili_sync.tasks WHERE resync_of = {task})
               FROM meili_sync_status WHERE task = {task}"
        )) == "0")
            .then_some(())
    });
    assert_eq!(
        cluster.psql(&format!(
            "SELECT missing + extra + different FROM meili_sync_verify({task})"
        )),
        "0"
    );
    assert_no_crash(&cluster);
}
