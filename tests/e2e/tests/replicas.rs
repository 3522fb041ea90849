//! End to end: a task with `replicas` writes every change to each server. A replica that is
//! frozen or crashed holds its own position (and the shared slot) while the others go on, and
//! catches up when it is back; searches through SQL fail over to a replica that answers; a
//! replica is added (copied while the others stream on) and removed by `meili_sync_alter`; a
//! resync rebuilds every replica, or one.
//! Each test starts servers of its own (the test server, or real ones with `E2E_MEILI=real`), so
//! it skips with `MEILI_URL`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{
    assert_no_crash, owner_of, products, refusal, start_with_options, wait_for,
    wait_index_matches_table, StopOnDrop,
};
use serde_json::{json, Value};

const CONVERGE: Duration = Duration::from_secs(300);

/// `count` Meilisearch servers of the test's own, or None (the test skips) with `MEILI_URL`.
fn servers(count: usize) -> Option<Vec<Meili>> {
    let servers: Option<Vec<Meili>> = (0..count).map(|_| Meili::own()).collect();
    if servers.is_none() {
        eprintln!("skipped: the one Meilisearch at MEILI_URL cannot be several replicas");
    }
    servers
}

fn cluster_with_products(rows: i64) -> Cluster {
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, rows));
    cluster
}

/// The options of a task writing to each of `servers` (ids filterable), SQL-quoted.
fn replicas_options(servers: &[&Meili]) -> String {
    let replicas: Vec<Value> = servers.iter().map(|meili| meili.replica()).collect();
    json!({ "replicas": replicas, "settings": {"filterableAttributes": ["id"]} })
        .to_string()
        .replace('\'', "''")
}

/// The rows of the task's other replicas in the status view, in their order.
fn replica_rows(cluster: &Cluster, task: i64) -> Vec<i64> {
    cluster
        .psql(&format!(
            "SELECT task FROM meili_sync_status WHERE replica_of = {task} ORDER BY task"
        ))
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

fn current_lsn(cluster: &Cluster) -> String {
    cluster
        .psql("SELECT pg_current_wal_lsn()")
        .trim()
        .to_owned()
}

/// Whether the SQL condition on pg_lsn values holds.
fn holds(cluster: &Cluster, condition: &str) -> bool {
    cluster.psql(&format!("SELECT ({condition})::text")).trim() == "true"
}

/// Runs `meili_sync_resync(row)` while rows are written, checks that it made `helpers` helpers
/// (one per server it rebuilds), and waits until every one has swapped and gone.
fn resync_under_writes(cluster: &Cluster, row: i64, helpers: usize) {
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let _stop_writer = StopOnDrop(&stop);
        let writer = scope.spawn(|| {
            let mut round = 0_i64;
            while !stop.load(Ordering::Relaxed) {
                let first = 500_000 + 100_000 * row + round * 10;
                cluster.psql(&products::insert_sql(first, first + 9));
                cluster.psql(&format!(
                    "UPDATE products SET version = version + 1 WHERE id % 89 = {}",
                    round % 89
                ));
                round += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let helper: i64 = cluster
            .psql(&format!("SELECT meili_sync_resync({row})"))
            .parse()
            .expect("a helper's id");
        let made =
            cluster.psql("SELECT count(*) FROM meili_sync.tasks WHERE resync_of IS NOT NULL");
        assert_eq!(made, helpers.to_string(), "one helper per server rebuilt");
        assert_eq!(
            cluster.psql(&format!(
                "SELECT resync_of FROM meili_sync.tasks WHERE id = {helper}"
            )),
            row.to_string(),
            "the id returned is the helper of the row called"
        );
        wait_for("every resync helper to swap and go", CONVERGE, || {
            let left =
                cluster.psql("SELECT count(*) FROM meili_sync.tasks WHERE resync_of IS NOT NULL");
            (left == "0").then_some(())
        });
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        writer.join().expect("the writer");
    });
}

#[test]
fn every_replica_gets_every_change_and_a_frozen_or_crashed_one_catches_up() {
    let Some(meilis) = servers(3) else {
        return;
    };
    let cluster = cluster_with_products(2_000);
    let index = meilis[0].unique_index("replicas");
    let all: Vec<&Meili> = meilis.iter().collect();
    let task = start_with_options(&cluster, None, "products", &index, &replicas_options(&all));
    let others = replica_rows(&cluster, task);
    assert_eq!(others.len(), 2, "one row per other replica: {others:?}");
    for row in std::iter::once(task).chain(others.iter().copied()) {
        cluster.wait_snapshot_done(row, CONVERGE);
    }
    for meili in &meilis {
        wait_index_matches_table(&cluster, meili, &index, "products", CONVERGE);
    }

    // The task's own server stops answering: the other two get every change; it keeps its
    // position, and so does the shared slot.
    meilis[0].freeze();
    cluster.psql("UPDATE products SET version = version + 1, name = name || ' v2' WHERE id <= 500");
    cluster.psql(&products::insert_sql(2_001, 2_500));
    cluster.psql("DELETE FROM products WHERE id BETWEEN 1000 AND 1100");
    let written = current_lsn(&cluster);
    for meili in &meilis[1..] {
        wait_index_matches_table(&cluster, meili, &index, "products", CONVERGE);
    }
    assert!(
        holds(
            &cluster,
            &format!(
                "(SELECT confirmed_lsn FROM meili_sync_status WHERE task = {task}) < '{written}'"
            )
        ),
        "the frozen replica cannot have confirmed the writes made while it was frozen: {:?}",
        cluster.status(task)
    );
    assert!(
        holds(
            &cluster,
            &format!(
                "(SELECT s.confirmed_flush_lsn FROM pg_replication_slots s WHERE s.slot_name LIKE 'meili_sync_%_shared')
                 <= (SELECT confirmed_lsn FROM meili_sync_status WHERE task = {task})"
            )
        ),
        "the shared slot went past the slowest replica's position"
    );
    // A search of a session that waited for nothing fails over to a replica that answers.
    let failed_over = cluster.psql(&format!(
        "SET meili_sync.search_timeout = '3s';
         SELECT string_agg(id, ',' ORDER BY id) FROM meili_search({task}, 'Product', '{{\"filter\": \"id IN [2001, 2002]\"}}')"
    ));
    assert_eq!(
        failed_over.lines().last().map(str::trim),
        Some("2001,2002"),
        "a search while the task's own server is frozen: {failed_over}"
    );
    // Waiting for every replica times out, for any one of them not; the session's searches then
    // ask only replicas that have the writes, and are answered while the task's own server is
    // frozen.
    let found = cluster.psql(&format!(
        "SET meili_sync.search_timeout = '3s';
         SELECT meili_sync_wait({task}, '{written}', '1 second')::text || ','
                || meili_sync_wait({task}, '{written}', '60 seconds', replicas => 'any')::text;
         SELECT string_agg(id, ',' ORDER BY id) FROM meili_search({task}, 'Product', '{{\"filter\": \"id IN [2001, 2002]\"}}')"
    ));
    let lines: Vec<&str> = found.lines().map(str::trim).collect();
    assert_eq!(
        lines[lines.len().saturating_sub(2)..],
        ["false,true", "2001,2002"],
        "waits and a search while the task's own server is frozen: {found}"
    );

    // The third one crashes (a real one is killed with SIGKILL and restarted on its data).
    meilis[2].go_down();
    cluster.psql("UPDATE products SET version = version + 1 WHERE id BETWEEN 501 AND 800");
    std::thread::sleep(Duration::from_secs(2));
    meilis[2].come_back();
    meilis[0].thaw();
    for meili in &meilis {
        wait_index_matches_table(&cluster, meili, &index, "products", CONVERGE);
    }
    for row in std::iter::once(task).chain(others.iter().copied()) {
        wait_for("each replica to confirm every write", CONVERGE, || {
            holds(
                &cluster,
                &format!(
                    "(SELECT confirmed_lsn FROM meili_sync_status WHERE task = {row}) >= '{written}'"
                ),
            )
            .then_some(())
        });
    }
    // Waiting for the task waits for all its replicas.
    cluster.psql("UPDATE products SET name = 'waited for' WHERE id = 1");
    assert_eq!(
        cluster
            .psql(&format!("SELECT meili_sync_wait({task})"))
            .trim(),
        "t"
    );
    for meili in &meilis {
        let (_, document) = meili.request(
            pg_meili_sync_e2e::meili::Method::GET,
            &format!("/indexes/{index}/documents/1"),
            None,
        );
        assert_eq!(document["name"], json!("waited for"), "at {}", meili.url);
    }
    assert_no_crash(&cluster);
}

#[test]
fn a_replica_is_added_mid_stream_and_removed_by_alter() {
    let Some(meilis) = servers(2) else {
        return;
    };
    let cluster = cluster_with_products(1_000);
    let index = meilis[0].unique_index("replicas");
    let task = start_with_options(
        &cluster,
        None,
        "products",
        &index,
        &replicas_options(&[&meilis[0]]),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    assert!(replica_rows(&cluster, task).is_empty());

    // Writes go on while the second server is added and copied.
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let _stop_writer = StopOnDrop(&stop);
        let writer = scope.spawn(|| {
            let mut next = 1_001;
            while !stop.load(Ordering::Relaxed) {
                cluster.psql(&products::insert_sql(next, next + 49));
                cluster.psql(&format!(
                    "UPDATE products SET version = version + 1 WHERE id % 97 = {}",
                    next % 97
                ));
                next += 50;
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        std::thread::sleep(Duration::from_secs(1));
        cluster.psql(&format!(
            "SELECT meili_sync_alter({task}, '{}')",
            replicas_options(&[&meilis[0], &meilis[1]])
        ));
        let added = wait_for("the new replica's row", CONVERGE, || {
            replica_rows(&cluster, task).first().copied()
        });
        cluster.wait_snapshot_done(added, CONVERGE);
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::Relaxed);
        writer.join().expect("the writer");
    });
    for meili in &meilis {
        wait_index_matches_table(&cluster, meili, &index, "products", CONVERGE);
    }
    let added = replica_rows(&cluster, task)[0];

    // What cannot be done, refused with a hint.
    let replica_alter = refusal(
        &cluster,
        &format!("SELECT meili_sync_alter({added}, '{{\"batch_size\": 10}}')"),
    );
    assert_eq!(replica_alter.sqlstate, "22023", "{replica_alter:?}");
    assert!(replica_alter
        .message
        .contains(&format!("is a replica of task {task}")));
    let own_left_out = refusal(
        &cluster,
        &format!(
            "SELECT meili_sync_alter({task}, '{}')",
            replicas_options(&[&meilis[1]])
        ),
    );
    assert_eq!(own_left_out.sqlstate, "0A000", "{own_left_out:?}");
    assert!(!own_left_out.hint.is_empty());
    let wait = refusal(
        &cluster,
        &format!("SELECT meili_sync_wait({task}, replicas => 'most')"),
    );
    assert_eq!(wait.sqlstate, "22023", "{wait:?}");
    let both = refusal(
        &cluster,
        &format!(
            "SELECT meili_sync_start('products', 'other', '{}')",
            json!({"url": meilis[0].url, "replicas": [meilis[1].replica()]})
        ),
    );
    assert_eq!(both.sqlstate, "22023", "{both:?}");
    let twice = refusal(
        &cluster,
        &format!(
            "SELECT meili_sync_start('products', 'other', '{}')",
            json!({"replicas": [meilis[1].replica(), meilis[1].replica()]})
        ),
    );
    assert_eq!(twice.sqlstate, "22023", "{twice:?}");

    // Verify compares every replica.
    let verified = cluster.psql(&format!(
        "SELECT missing || ',' || extra || ',' || different FROM meili_sync_verify({task})"
    ));
    assert_eq!(verified.trim(), "0,0,0");

    // Resetting the task's counters resets every replica's.
    let counted = |cluster: &Cluster| {
        cluster.psql(&format!(
            "SELECT string_agg((documents > 0)::text, ',' ORDER BY task) FROM pg_stat_meili_sync WHERE task IN ({task}, {added})"
        ))
    };
    assert_eq!(counted(&cluster), "true,true");
    cluster.psql(&format!("SELECT pg_stat_meili_sync_reset({task})"));
    assert_eq!(counted(&cluster), "false,false");

    // A resync of the task rebuilds the index on each replica, under writes; one of a replica's
    // row rebuilds that replica alone.
    let created_at = |meili: &Meili| meili.index(&index).map(|found| found["createdAt"].clone());
    let before: Vec<_> = meilis.iter().map(created_at).collect();
    resync_under_writes(&cluster, task, 2);
    for meili in &meilis {
        wait_index_matches_table(&cluster, meili, &index, "products", CONVERGE);
        assert_eq!(meili.index(&format!("{index}__resync")), None);
    }
    let after: Vec<_> = meilis.iter().map(created_at).collect();
    for (old, new) in before.iter().zip(&after) {
        assert_ne!(old, new, "every replica's index was swapped for a new one");
    }
    resync_under_writes(&cluster, added, 1);
    wait_index_matches_table(&cluster, &meilis[1], &index, "products", CONVERGE);
    assert_eq!(
        created_at(&meilis[0]),
        after[0],
        "the task's own server was left alone"
    );
    assert_ne!(
        created_at(&meilis[1]),
        after[1],
        "the replica's index was rebuilt"
    );
    let twice = refusal(
        &cluster,
        &format!("SELECT meili_sync_resync({task}), meili_sync_resync({added})"),
    );
    assert_eq!(twice.sqlstate, "42710", "{twice:?}");
    assert_eq!(
        cluster.psql("SELECT count(*) FROM meili_sync.tasks WHERE resync_of IS NOT NULL"),
        "0",
        "a refused resync leaves no helper behind"
    );

    // Removed: its row goes, and with it its hold on the WAL; the task streams on without it.
    let removed = cluster
        .psql_command()
        .args([
            "-c",
            &format!(
                "SELECT meili_sync_alter({task}, '{}')",
                replicas_options(&[&meilis[0]])
            ),
        ])
        .output()
        .expect("psql");
    let warnings = String::from_utf8_lossy(&removed.stderr);
    assert!(
        warnings.contains("is removed"),
        "a WARNING says the replica's index is no longer kept: {warnings}"
    );
    assert!(replica_rows(&cluster, task).is_empty());
    let kept = meilis[1].document_count(&index);
    cluster.psql(&products::insert_sql(900_001, 900_010));
    wait_index_matches_table(&cluster, &meilis[0], &index, "products", CONVERGE);
    assert_eq!(meilis[1].document_count(&index), kept);

    cluster.psql(&format!(
        "SELECT meili_sync_drop({task}, drop_index => true)"
    ));
    assert!(meilis[0].index(&index).is_none());
    assert_no_crash(&cluster);
}

/// A column dropped from the table reaches every document on every server: the task resyncs
/// each replica into the new shape on its own, while rows are written.
#[test]
fn a_dropped_column_leaves_every_document_on_every_replica() {
    let Some(meilis) = servers(2) else {
        return;
    };
    let cluster = cluster_with_products(500);
    let index = meilis[0].unique_index("replicas_shape");
    let all: Vec<&Meili> = meilis.iter().collect();
    let task = start_with_options(&cluster, None, "products", &index, &replicas_options(&all));
    let rows = std::iter::once(task).chain(replica_rows(&cluster, task));
    for row in rows {
        cluster.wait_snapshot_done(row, CONVERGE);
    }
    for meili in &meilis {
        wait_index_matches_table(&cluster, meili, &index, "products", CONVERGE);
    }
    cluster.psql("ALTER TABLE products DROP COLUMN category");
    cluster.psql("UPDATE products SET version = version + 1 WHERE id <= 20");
    cluster.psql("DELETE FROM products WHERE id BETWEEN 21 AND 30");
    for meili in &meilis {
        wait_index_matches_table(&cluster, meili, &index, "products", CONVERGE);
    }
    wait_for("every resync helper to swap and go", CONVERGE, || {
        let left =
            cluster.psql("SELECT count(*) FROM meili_sync.tasks WHERE resync_of IS NOT NULL");
        (left == "0").then_some(())
    });
    assert_no_crash(&cluster);
}

/// The longest a change may take to reach a healthy server while another server of the same
/// database hangs: the 2 s the issue allows a hung server to hold others up, plus the change's
/// normal latency (a real Meilisearch takes up to a second or so for a small batch here).
const HELD_UP_AT_MOST: Duration = Duration::from_secs(6);

/// One server stops answering (SIGSTOP, or the test server reading requests and answering none)
/// and another one is killed, while a task with replicas streams to the hung one and a healthy
/// one, a sharded task to the killed one and a healthy one, and an unrelated task to a fifth
/// server, all in the shared pass. Writes in rounds throughout the outage, enough to fill the
/// sick servers' queues: each round reaches the healthy replica, the healthy shard (the rows its
/// hash names) and the other task within `HELD_UP_AT_MOST`; the hung replica holds its position
/// (and the shared slot); both sick servers catch up once they are back. Index checks come every
/// second, so a look at a sick server's index on the decoder's own thread would hold everything
/// up too.
#[test]
fn a_server_that_stops_answering_holds_up_the_others_for_a_moment_only() {
    let Some(mut meilis) = servers(3) else {
        return;
    };
    // Shards may be remotes of each other (a real server allows that on 127.0.0.1 only if told).
    meilis.extend((0..2).filter_map(|_| Meili::own_shard()));
    let cluster = Cluster::start(&["meili_sync.index_check_interval=1s"]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 200));
    cluster.psql_script(
        "CREATE TABLE public.notes (id int PRIMARY KEY, body text);
         INSERT INTO public.notes SELECT g, 'note ' || g FROM generate_series(1, 100) g;
         CREATE TABLE public.parts (id int PRIMARY KEY, body text);
         INSERT INTO public.parts SELECT g, 'part ' || g FROM generate_series(1, 100) g;",
    );
    let index = meilis[0].unique_index("held_up");
    let replicas: Vec<Value> = meilis[..2].iter().map(Meili::replica).collect();
    // Small batches fill the sick servers' queues (their stream_depth) within a round or two.
    let options = json!({"replicas": replicas, "batch_size": 10}).to_string();
    let task = start_with_options(&cluster, None, "products", &index, &options);
    let notes_index = meilis[2].unique_index("unrelated");
    let notes = start_with_options(
        &cluster,
        None,
        "public.notes",
        &notes_index,
        &meilis[2].options(json!({})),
    );
    const SHARDS: [&str; 2] = ["shard-a", "shard-b"];
    let parts_index = meilis[3].unique_index("sharded");
    let shards: Vec<Value> = SHARDS
        .iter()
        .zip(&meilis[3..5])
        .map(|(name, meili)| meili.shard(name))
        .collect();
    let parts = start_with_options(
        &cluster,
        None,
        "public.parts",
        &parts_index,
        &json!({"shards": shards, "batch_size": 10}).to_string(),
    );
    let rows: Vec<i64> = [task, notes, parts]
        .into_iter()
        .chain(replica_rows(&cluster, task))
        .chain(replica_rows(&cluster, parts))
        .collect();
    for &row in &rows {
        cluster.wait_snapshot_done(row, CONVERGE);
    }
    wait_index_matches_table(&cluster, &meilis[1], &index, "products", CONVERGE);
    wait_index_matches_table(&cluster, &meilis[2], &notes_index, "public.notes", CONVERGE);

    meilis[0].hang();
    meilis[4].go_down();
    let has = |meili: &Meili, index: &str, id: i64| {
        let (status, _) = meili.request(
            ureq::http::Method::GET,
            &format!("/indexes/{index}/documents/{id}"),
            None,
        );
        status == 200
    };
    for round in 0..4_i64 {
        let first = 1_000 + round * 100;
        for part in 0..4 {
            cluster.psql(&products::insert_sql(
                first + part * 25,
                first + part * 25 + 24,
            ));
            cluster.psql(&format!(
                "INSERT INTO public.parts SELECT g, 'round {round}' FROM generate_series({}, {}) g",
                first + part * 25,
                first + part * 25 + 24
            ));
        }
        cluster.psql(&format!(
            "INSERT INTO public.notes VALUES ({}, 'round {round}')",
            1_000 + round
        ));
        let written = std::time::Instant::now();
        let last = first + 99;
        let healthy_parts: Vec<i64> = (first..=last)
            .filter(|id| owner_of(&id.to_string(), &SHARDS) == SHARDS[0])
            .collect();
        while !(has(&meilis[1], &index, last)
            && has(&meilis[2], &notes_index, 1_000 + round)
            && healthy_parts
                .iter()
                .all(|&id| has(&meilis[3], &parts_index, id)))
        {
            assert!(
                written.elapsed() < HELD_UP_AT_MOST,
                "round {round}: the healthy replica, the healthy shard or the other task is held up by the sick servers ({:?})\n{}",
                written.elapsed(),
                cluster.tail_log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let written = current_lsn(&cluster);
    assert!(
        holds(
            &cluster,
            &format!(
                "(SELECT confirmed_lsn FROM meili_sync_status WHERE task = {task}) < '{written}'
                 AND (SELECT s.confirmed_flush_lsn FROM pg_replication_slots s WHERE s.slot_name LIKE 'meili_sync_%_shared')
                     <= (SELECT confirmed_lsn FROM meili_sync_status WHERE task = {task})"
            )
        ),
        "the hung replica and the shared slot keep its position: {:?}",
        cluster.status(task)
    );
    meilis[0].unhang();
    meilis[4].come_back();
    for meili in &meilis[..2] {
        wait_index_matches_table(&cluster, meili, &index, "products", CONVERGE);
    }
    wait_index_matches_table(&cluster, &meilis[2], &notes_index, "public.notes", CONVERGE);
    for &row in &rows {
        wait_for(&format!("row {row} to match its source"), CONVERGE, || {
            (cluster.psql(&format!(
                "SELECT missing + extra + different FROM meili_sync_verify({row})"
            )) == "0")
                .then_some(())
        });
    }
    assert_no_crash(&cluster);
}
