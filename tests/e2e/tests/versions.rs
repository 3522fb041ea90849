//! End to end: what differs between the PostgreSQL majors the extension supports (15 to 18), run
//! against whichever major's `pg_config` is first on PATH (scripts/test-major.sh sets it).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{products, start_task, wait_for, wait_index_matches_table, StopOnDrop};
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(120);

/// From PostgreSQL 17 on, every slot the extension creates (a task's own and the shared one) is
/// a failover slot, which a standby with `sync_replication_slots` keeps a copy of; before 17
/// there are no failover slots. Either way both tasks stream.
#[test]
fn the_slots_are_failover_slots_from_postgresql_17_on() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 50));
    let (own_index, _, shared_index, _) = start_own_and_shared(&cluster, &meili);
    cluster.psql(&products::insert_sql(51, 80));
    cluster.psql("UPDATE products SET name = 'renamed' WHERE id <= 10");
    wait_index_matches_table(&cluster, &meili, &own_index, "products", CONVERGE);
    wait_index_matches_table(&cluster, &meili, &shared_index, "products", CONVERGE);

    let slots = cluster.psql(
        "SELECT count(*) FROM pg_catalog.pg_replication_slots WHERE slot_name ~ '^meili_sync_'",
    );
    assert_eq!(slots, "2", "a task's own slot and the shared slot");
    if server_version(&cluster) >= 170_000 {
        let failover = cluster.psql(
            "SELECT string_agg(DISTINCT failover::text, ',') FROM pg_catalog.pg_replication_slots WHERE slot_name ~ '^meili_sync_'",
        );
        assert_eq!(
            failover, "true",
            "every slot of the extension is a failover slot"
        );
    }
}

/// Starts two tasks on the table `products`, one on a slot of its own and one in the shared pass,
/// and waits for both copies: (own index, own task, shared index, shared task).
fn start_own_and_shared(cluster: &Cluster, meili: &Meili) -> (String, i64, String, i64) {
    let (own_index, own) = start_task(cluster, meili, None, "products", json!({"decoding": "own"}));
    let (shared_index, shared) = start_task(cluster, meili, None, "products", json!({}));
    cluster.wait_snapshot_done(own, CONVERGE);
    cluster.wait_snapshot_done(shared, CONVERGE);
    (own_index, own, shared_index, shared)
}

/// Inserts one row a transaction into `cluster`'s products, from id `first` on, until `stop` is
/// set or the server stops answering; returns how many rows it committed.
fn write_steadily(cluster: &Cluster, first: i64, stop: &AtomicBool) -> i64 {
    let mut id = first;
    while !stop.load(Ordering::Relaxed) {
        if cluster.try_psql(&products::insert_sql(id, id)).is_err() {
            break;
        }
        id += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    id - first
}

fn server_version(cluster: &Cluster) -> u32 {
    cluster
        .psql("SHOW server_version_num")
        .parse()
        .expect("server_version_num")
}

/// A primary with a physical standby, two tasks streaming (one on its own slot, one shared) under
/// steady writes. From PostgreSQL 17 on, with the standby named in `synchronized_standby_slots`:
/// while the standby receives nothing, nothing it lacks reaches Meilisearch; the primary is then
/// killed with those changes, the standby is promoted, writes go on on it, and both tasks follow
/// from their synced slots without a new copy, so that each index equals the new primary's table.
/// Before 17 there are no failover slots: after the promotion both tasks stop, asking for a new
/// copy.
#[test]
fn a_failover_loses_nothing_and_the_index_never_holds_what_the_standby_lacks() {
    let meili = Meili::from_env();
    let primary = Cluster::start(&[]);
    let failover_slots = server_version(&primary) >= 170_000;
    primary.psql("CREATE EXTENSION pg_meili_sync");
    primary.psql(products::CREATE_TABLE);
    primary.psql(&products::insert_sql(1, 100));
    let standby_settings: &[&str] = if failover_slots {
        &["sync_replication_slots=on"]
    } else {
        &[]
    };
    let standby = Cluster::standby_of(&primary, "standby1", standby_settings);
    if failover_slots {
        primary.psql("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'");
        primary.psql("SELECT pg_catalog.pg_reload_conf()");
    }
    let (own_index, own, shared_index, shared) = start_own_and_shared(&primary, &meili);
    let indexes = [own_index.as_str(), shared_index.as_str()];
    primary.psql(&products::insert_sql(101, 150));
    primary.psql("UPDATE products SET name = 'seen' WHERE id <= 3");
    for index in indexes {
        wait_index_matches_table(&primary, &meili, index, "products", CONVERGE);
    }
    let rows_copied = |cluster: &Cluster| {
        [own, shared].map(|task| cluster.status(task).get("rows_copied").cloned())
    };
    let copied = rows_copied(&primary);
    if failover_slots {
        wait_for("both slots synced to the standby", CONVERGE, || {
            (standby.psql(
                "SELECT count(*) FROM pg_catalog.pg_replication_slots WHERE synced AND NOT temporary AND slot_name ~ '^meili_sync_'",
            ) == "2")
                .then_some(())
        });
    }

    // Steady writes from here on. The standby stops receiving WAL (its walreceiver is frozen),
    // then the primary dies.
    let stop = AtomicBool::new(false);
    let receiver: i64 = standby
        .psql("SELECT pid FROM pg_catalog.pg_stat_wal_receiver")
        .parse()
        .expect("the standby's walreceiver");
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| write_steadily(&primary, 10_000, &stop));
        let _stop_writer = StopOnDrop(&stop);
        for index in indexes {
            wait_for("the steady writes in the index", CONVERGE, || {
                let written = meili
                    .all_documents(index)
                    .iter()
                    .filter(|document| document["id"].as_i64() >= Some(10_000))
                    .count();
                (written >= 20).then_some(())
            });
        }
        standby.kill(receiver, "STOP");
        primary.psql(&products::insert_sql(151, 180));
        primary.psql("UPDATE products SET name = 'lost' WHERE id <= 3");
        primary.psql("DELETE FROM products WHERE id BETWEEN 90 AND 99");
        if failover_slots {
            // Long enough for many rounds of both decoders, which read nothing past the standby.
            std::thread::sleep(Duration::from_secs(5));
            let on_standby: HashSet<i64> = standby
                .psql("SELECT id FROM products")
                .lines()
                .filter_map(|id| id.parse().ok())
                .collect();
            for index in indexes {
                let documents = meili.all_documents(index);
                let ahead: Vec<_> = documents
                    .iter()
                    .filter(|document| {
                        document["name"] == json!("lost")
                            || document["id"]
                                .as_i64()
                                .is_none_or(|id| !on_standby.contains(&id))
                    })
                    .collect();
                assert!(
                    ahead.is_empty(),
                    "index {index} got changes the standby lacks: {ahead:?}"
                );
                assert!(
                    documents.len() >= 170,
                    "index {index} has the steady writes the standby got"
                );
            }
        }
        primary.kill(primary.postmaster_pid(), "KILL");
        let written = writer.join().expect("the writer on the primary");
        assert!(
            written >= 20,
            "the primary took steady writes until it died"
        );
    });
    standby.kill(receiver, "CONT");
    standby.promote();

    if !failover_slots {
        for task in [own, shared] {
            let status = standby.wait_error(task, CONVERGE);
            let last_error = status.get("last_error").cloned().unwrap_or_default();
            assert!(
                last_error.contains(&format!("meili_sync_snapshot({task})")),
                "task {task} asks for a new copy: {last_error}"
            );
        }
        return;
    }
    // The new primary: writes go on, and both tasks follow them from their synced slots.
    stop.store(false, Ordering::Relaxed);
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| write_steadily(&standby, 20_000, &stop));
        let _stop_writer = StopOnDrop(&stop);
        standby.psql(&products::insert_sql(181, 220));
        standby.psql("UPDATE products SET name = 'after' WHERE id BETWEEN 100 AND 110");
        standby.psql("DELETE FROM products WHERE id IN (2, 3)");
        std::thread::sleep(Duration::from_secs(3));
        stop.store(true, Ordering::Relaxed);
        let written = writer.join().expect("the writer on the new primary");
        assert!(written > 0, "the new primary took steady writes");
    });
    for index in indexes {
        wait_index_matches_table(&standby, &meili, index, "products", CONVERGE);
    }
    assert_eq!(
        rows_copied(&standby),
        copied,
        "no task copied its table again"
    );
    // Both tasks stream, one row each. (Once, on PostgreSQL 17 in CI, the view showed a third
    // row, `starting`, right after the promotion: it is given time to settle, and the test
    // still fails if it does not.)
    let mut states = String::new();
    let settled = (0..300).any(|_| {
        states = standby.psql("SELECT string_agg(state, ',' ORDER BY task) FROM meili_sync_status");
        let done = states == "streaming,streaming";
        if !done {
            std::thread::sleep(Duration::from_millis(100));
        }
        done
    });
    assert!(settled, "both tasks stream, one row each: {states}");
}
