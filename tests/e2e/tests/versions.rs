//! End to end: what differs between the PostgreSQL majors the extension supports (15 to 18), run
//! against whichever major's `pg_config` is first on PATH (scripts/test-major.sh sets it).

use std::time::Duration;

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{products, start_task, wait_for, wait_index_matches_table};
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

fn server_version(cluster: &Cluster) -> u32 {
    cluster
        .psql("SHOW server_version_num")
        .parse()
        .expect("server_version_num")
}

/// A primary with a physical standby, two tasks streaming (one on its own slot, one shared). From
/// PostgreSQL 17 on, with the standby named in `synchronized_standby_slots`: while the standby
/// receives nothing, nothing written on the primary reaches Meilisearch; the primary then dies
/// with those changes, the standby is promoted, and both tasks go on from their synced slots on
/// the new primary without a new copy, so that each index equals the new primary's table. Before
/// 17 there are no failover slots: after the promotion both tasks stop, asking for a new copy.
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

    // The standby stops receiving WAL (its walreceiver is frozen), then the primary dies.
    let receiver: i64 = standby
        .psql("SELECT pid FROM pg_catalog.pg_stat_wal_receiver")
        .parse()
        .expect("the standby's walreceiver");
    standby.kill(receiver, "STOP");
    primary.psql(&products::insert_sql(151, 180));
    primary.psql("UPDATE products SET name = 'lost' WHERE id <= 3");
    primary.psql("DELETE FROM products WHERE id BETWEEN 90 AND 99");
    if failover_slots {
        // Long enough for many rounds of both decoders, which read nothing past the standby.
        std::thread::sleep(Duration::from_secs(5));
        for index in indexes {
            let documents = meili.all_documents(index);
            assert_eq!(
                documents.len(),
                150,
                "index {index}: nothing the standby lacks is sent"
            );
            let lost: Vec<_> = documents
                .iter()
                .filter(|document| document["name"] == json!("lost"))
                .collect();
            assert!(
                lost.is_empty(),
                "index {index} got updates the standby lacks: {lost:?}"
            );
        }
    }
    primary.kill(primary.postmaster_pid(), "KILL");
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
    standby.psql(&products::insert_sql(181, 220));
    standby.psql("UPDATE products SET name = 'after' WHERE id BETWEEN 100 AND 110");
    standby.psql("DELETE FROM products WHERE id IN (2, 3)");
    for index in indexes {
        wait_index_matches_table(&standby, &meili, index, "products", CONVERGE);
    }
    assert_eq!(
        rows_copied(&standby),
        copied,
        "no task copied its table again"
    );
    let states = standby.psql("SELECT string_agg(state, ',' ORDER BY task) FROM meili_sync_status");
    assert_eq!(states, "streaming,streaming");
}
