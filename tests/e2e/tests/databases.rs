//! End to end: one cluster, several databases, each with `CREATE EXTENSION pg_meili_sync` and
//! tasks of its own, served with no setting that lists them. A database whose Meilisearch is down,
//! one that is dropped while its task streams, and one whose extension is dropped stop no other:
//! the others' indexes equal their tables, exactly. `DROP DATABASE`, `ALTER DATABASE … RENAME`
//! and `CREATE DATABASE … TEMPLATE` of a served database work without `FORCE` (our processes
//! leave it first), leave no slot or worker behind, and a role that may not drop the database
//! stops nothing. A copy made with `TEMPLATE` runs none of the original's tasks.

use std::time::Duration;

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{assert_no_crash, refusal, start_task, wait_for, wait_index_matches_table};
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(120);

/// Creates database `name` with the extension and a table `items` of `rows` rows, and leaves
/// psql pointed at it.
fn make_database(cluster: &Cluster, name: &str, rows: i64) {
    cluster.use_database("postgres");
    cluster.psql(&format!("CREATE DATABASE {name}"));
    cluster.use_database(name);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(&format!(
        "CREATE TABLE items (id bigint PRIMARY KEY, name text, n integer);
         INSERT INTO items SELECT g, '{name} ' || g, g FROM generate_series(1, {rows}) g"
    ));
}

/// Inserts, updates and deletes in database `name`'s `items`, in separate transactions.
fn write(cluster: &Cluster, name: &str, round: i64) {
    cluster.use_database(name);
    let base = 10_000 * round;
    cluster.psql(&format!(
        "INSERT INTO items SELECT g, '{name} new ' || g, g FROM generate_series({base}, {base} + 99) g"
    ));
    cluster.psql(&format!(
        "UPDATE items SET name = name || ' changed', n = n + {round} WHERE id % 7 = 0"
    ));
    cluster.psql(&format!("DELETE FROM items WHERE id % 11 = {}", round % 11));
}

fn database_oid(cluster: &Cluster, name: &str) -> String {
    cluster.use_database("postgres");
    cluster.psql(&format!(
        "SELECT oid FROM pg_database WHERE datname = '{name}'"
    ))
}

/// Slots of database `oid`, and our processes connected to it.
fn leftovers(cluster: &Cluster, oid: &str) -> (i64, i64) {
    cluster.use_database("postgres");
    let count = |sql: String| cluster.psql(&sql).parse::<i64>().unwrap_or(-1);
    (
        count(format!(
            "SELECT count(*) FROM pg_replication_slots WHERE datoid = {oid}"
        )),
        count(format!(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datid = {oid} AND backend_type LIKE 'pg_meili_sync%'"
        )),
    )
}

/// Runs `sql` as role mallory, which must fail; returns psql's verbose error.
fn as_mallory(cluster: &Cluster, sql: &str) -> String {
    let output = cluster
        .psql_command()
        .args(["-U", "mallory", "-v", "VERBOSITY=verbose", "-c", sql])
        .output()
        .expect("run psql");
    assert!(!output.status.success(), "mallory ran: {sql}");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn every_database_is_served_and_a_failing_dropped_or_uninstalled_one_stops_no_other() {
    let cluster = Cluster::start(&[]);
    let meili = Meili::from_env();
    // Database beta's own Meilisearch, which goes down.
    let beta_meili = Meili::from_env();

    make_database(&cluster, "alpha", 300);
    let (alpha_index, alpha_task) = start_task(&cluster, &meili, None, "items", json!({}));
    make_database(&cluster, "beta", 200);
    let (beta_index, beta_task) = start_task(&cluster, &beta_meili, None, "items", json!({}));
    make_database(&cluster, "gamma", 250);
    let (gamma_index, gamma_task) =
        start_task(&cluster, &meili, None, "items", json!({"decoding": "own"}));
    // Task ids start at 1 in each database: live state must be told apart by database.
    assert_eq!((alpha_task, beta_task, gamma_task), (1, 1, 1));
    for (name, index, server) in [
        ("alpha", &alpha_index, &meili),
        ("beta", &beta_index, &beta_meili),
        ("gamma", &gamma_index, &meili),
    ] {
        cluster.use_database(name);
        wait_index_matches_table(&cluster, server, index, "items", CONVERGE);
        wait_for(
            &format!("database {name}'s task to stream"),
            CONVERGE,
            || {
                Some(cluster.status(1))
                    .filter(|status| status.get("state").map(String::as_str) == Some("streaming"))
            },
        );
    }

    // beta's Meilisearch goes down, gamma is dropped while its task streams.
    let beta_down = beta_meili.can_go_down();
    if beta_down {
        beta_meili.go_down();
    }
    for name in ["alpha", "beta", "gamma"] {
        write(&cluster, name, 1);
    }
    let gamma_oid = database_oid(&cluster, "gamma");
    cluster.use_database("postgres");
    cluster.psql("DROP DATABASE gamma");
    assert_eq!(
        wait_for("gamma's slot and processes to be gone", CONVERGE, || {
            Some(leftovers(&cluster, &gamma_oid)).filter(|left| *left == (0, 0))
        }),
        (0, 0)
    );

    // alpha streams on, exactly.
    for round in 2..4 {
        write(&cluster, "alpha", round);
    }
    cluster.use_database("alpha");
    wait_index_matches_table(&cluster, &meili, &alpha_index, "items", CONVERGE);

    if beta_down {
        // beta shows its failure and keeps its changes, and catches up when its server is back.
        cluster.use_database("beta");
        let status = wait_for("beta's task to show its failure", CONVERGE, || {
            Some(cluster.status(1)).filter(|status| {
                status
                    .get("last_error")
                    .is_some_and(|error| !error.is_empty())
            })
        });
        assert_ne!(status.get("state").map(String::as_str), Some("error"));
        beta_meili.come_back();
    }
    cluster.use_database("beta");
    wait_index_matches_table(&cluster, &beta_meili, &beta_index, "items", CONVERGE);

    // The extension is dropped in beta: its workers and slot go, alpha streams on.
    let beta_oid = database_oid(&cluster, "beta");
    cluster.use_database("beta");
    cluster.psql("DROP EXTENSION pg_meili_sync CASCADE");
    wait_for("beta's slot and processes to be gone", CONVERGE, || {
        Some(leftovers(&cluster, &beta_oid)).filter(|left| *left == (0, 0))
    });
    write(&cluster, "alpha", 4);
    cluster.use_database("alpha");
    wait_index_matches_table(&cluster, &meili, &alpha_index, "items", CONVERGE);
    assert_no_crash(&cluster);
}

#[test]
fn rename_and_template_copy_work_while_a_task_streams_and_a_copy_runs_none_of_its_tasks() {
    let cluster = Cluster::start(&[]);
    let meili = Meili::from_env();
    make_database(&cluster, "alpha", 300);
    let (index, task) = start_task(&cluster, &meili, None, "items", json!({}));
    wait_index_matches_table(&cluster, &meili, &index, "items", CONVERGE);

    // A role that may not drop the database stops nothing of ours in it: the launcher and the
    // shared decoder run on (the task's own worker exits by itself once its copy is done).
    wait_for("the task to stream", CONVERGE, || {
        Some(cluster.status(task))
            .filter(|status| status.get("state").map(String::as_str) == Some("streaming"))
    });
    let worker_pids = |cluster: &Cluster| {
        cluster.use_database("postgres");
        cluster.psql(
            "SELECT string_agg(pid::text, ',' ORDER BY pid) FROM pg_stat_activity
              WHERE datname = 'alpha'
                AND backend_type IN ('pg_meili_sync launcher', 'pg_meili_sync shared decoder')",
        )
    };
    let before = worker_pids(&cluster);
    assert_eq!(
        before.split(',').count(),
        2,
        "alpha's launcher and decoder: {before}"
    );
    cluster.psql("CREATE ROLE mallory LOGIN CREATEDB");
    for attack in [
        "DROP DATABASE alpha",
        "ALTER DATABASE alpha RENAME TO stolen",
        "CREATE DATABASE stolen TEMPLATE alpha",
    ] {
        let stderr = as_mallory(&cluster, attack);
        assert!(stderr.contains("42501"), "{attack}: {stderr}");
    }
    assert_eq!(
        worker_pids(&cluster),
        before,
        "a refused command stopped our processes"
    );

    // The owner's rename and copy need the database to themselves; they get it, and the task
    // streams on afterwards.
    cluster.psql("ALTER DATABASE alpha RENAME TO renamed");
    cluster.psql("CREATE DATABASE copy TEMPLATE renamed");
    write(&cluster, "renamed", 1);
    wait_index_matches_table(&cluster, &meili, &index, "items", CONVERGE);

    // The copy holds the task, but runs none: it is the original's, and so is its slot name.
    cluster.use_database("copy");
    cluster.psql("INSERT INTO items VALUES (999999, 'only in the copy', 0)");
    let status = wait_for(
        "the copy's task to say why it does not run",
        CONVERGE,
        || {
            Some(cluster.status(task)).filter(|status| {
                status
                    .get("last_error")
                    .is_some_and(|error| error.contains("is a copy"))
            })
        },
    );
    assert!(
        status.get("pid").is_none_or(|pid| pid.is_empty()),
        "{status:?}"
    );
    let refused = refusal(
        &cluster,
        "SELECT meili_sync_start('items', 'copy_items', '{}')",
    );
    assert_eq!(refused.sqlstate, "55000", "{refused:?}");
    assert!(refused.hint.contains("DROP EXTENSION"), "{refused:?}");
    let copy_oid = database_oid(&cluster, "copy");
    assert_eq!(leftovers(&cluster, &copy_oid).0, 0, "the copy made a slot");
    // The original's index never saw the copy's row.
    cluster.use_database("renamed");
    write(&cluster, "renamed", 2);
    wait_index_matches_table(&cluster, &meili, &index, "items", CONVERGE);

    // Made again, the copy's extension is its own: its task copies its table into its own index.
    cluster.use_database("copy");
    cluster.psql("DROP EXTENSION pg_meili_sync CASCADE");
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    let (copy_index, _) = start_task(&cluster, &meili, None, "items", json!({}));
    wait_index_matches_table(&cluster, &meili, &copy_index, "items", CONVERGE);
    cluster.use_database("renamed");
    wait_index_matches_table(&cluster, &meili, &index, "items", CONVERGE);
    assert_no_crash(&cluster);
}
