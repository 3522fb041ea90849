//! End to end: the extension replaced in place, as a user upgrades (0.1.0, built from its last
//! commit by scripts/build-0.1.0.sh, to this build), and a database carried to another cluster
//! with pg_dump and pg_restore. The update runs on PostgreSQL 15 only (the 0.1.0 library is built
//! for it); the dump on every major.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{
    assert_no_crash, products, start_task, wait_for, wait_index_matches_table, StopOnDrop,
};
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(120);
const VIEW: &str = "product_names";

/// The 0.1.0 library: `PG_MEILI_SYNC_0_1_0_LIBRARY`, or where scripts/build-0.1.0.sh puts it.
fn library_0_1_0() -> PathBuf {
    let path = std::env::var_os("PG_MEILI_SYNC_0_1_0_LIBRARY")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/pg_meili_sync-0.1.0/pg_meili_sync.so")
        });
    assert!(
        path.is_file(),
        "no pg_meili_sync 0.1.0 library at {}: run scripts/build-0.1.0.sh",
        path.display()
    );
    path
}

/// A directory the server may read, holding a copy of the 0.1.0 library; it goes first in
/// `dynamic_library_path`, so that the server loads it instead of the installed one.
fn old_library_directory() -> PathBuf {
    let directory = std::env::temp_dir().join(format!(
        "pg_meili_sync_e2e_library_0_1_0_{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&directory).expect("the 0.1.0 library's directory");
    std::fs::copy(library_0_1_0(), directory.join("pg_meili_sync.so"))
        .expect("copy the 0.1.0 library");
    for path in [directory.clone(), directory.join("pg_meili_sync.so")] {
        let status = std::process::Command::new("chmod")
            .arg("755")
            .arg(&path)
            .status();
        assert!(
            status.map(|s| s.success()).unwrap_or(false),
            "chmod {path:?}"
        );
    }
    directory
}

/// The file of the pg_meili_sync library that the launcher has loaded.
fn launcher_library(cluster: &Cluster) -> String {
    let pid: i64 = wait_for("the launcher", CONVERGE, || {
        cluster
            .psql("SELECT pid FROM pg_catalog.pg_stat_activity WHERE backend_type = 'pg_meili_sync launcher'")
            .parse()
            .ok()
    });
    let maps = cluster.psql(&format!(
        "SELECT pg_catalog.pg_read_file('/proc/{pid}/maps')"
    ));
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|file| file.ends_with("/pg_meili_sync.so"))
        .unwrap_or_else(|| panic!("the launcher maps no pg_meili_sync.so:\n{maps}"))
        .to_owned()
}

/// Inserts one row a transaction from id `first` on, and renames an earlier row every tenth,
/// until `stop` is set; a failed statement (the server restarting) is tried again. `written` is
/// the next id to insert.
fn write_throughout(cluster: &Cluster, first: i64, written: &AtomicI64, stop: &AtomicBool) {
    let mut id = first;
    while !stop.load(Ordering::Relaxed) {
        let sql = if id % 10 == 0 {
            format!(
                "{}; UPDATE products SET name = 'renamed ' || id WHERE id = {}",
                products::insert_sql(id, id),
                id / 2
            )
        } else {
            products::insert_sql(id, id)
        };
        if cluster.try_psql(&sql).is_ok() {
            id += 1;
            written.store(id, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `index` holds a document of id `id` or above.
fn wait_for_id(meili: &Meili, index: &str, id: i64) {
    wait_for(&format!("id {id} in index {index}"), CONVERGE, || {
        meili
            .all_documents(index)
            .iter()
            .any(|document| document["id"].as_i64() >= Some(id))
            .then_some(())
    });
}

/// What a task's copy left: (rows_copied, snapshot_finished_at).
fn copy_of(cluster: &Cluster, task: i64) -> (String, String) {
    let status = cluster.status(task);
    let field = |name: &str| status.get(name).cloned().unwrap_or_default();
    (field("rows_copied"), field("snapshot_finished_at"))
}

/// 0.1.0 streams a table task on its own slot, one in the shared pass and a view task, under
/// steady writes. The server restarts on this build's library: before `ALTER EXTENSION … UPDATE`
/// no task runs and each says why, and nothing is lost; after it every task goes on from where it
/// stopped, without a new copy, and each index equals its table or view.
#[test]
fn an_update_in_place_keeps_every_task_streaming_without_a_new_copy() {
    let meili = Meili::from_env();
    let old_library = old_library_directory();
    let cluster = Cluster::start(&[&format!(
        "dynamic_library_path = '{}:$libdir'",
        old_library.display()
    )]);
    assert!(
        launcher_library(&cluster).starts_with(&*old_library.to_string_lossy()),
        "the server runs the 0.1.0 library"
    );
    cluster.psql("CREATE EXTENSION pg_meili_sync VERSION '0.1.0'");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 200));
    cluster.psql(&format!(
        "CREATE VIEW {VIEW} AS SELECT id, name, category, price FROM products"
    ));
    let (own_index, own) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({"decoding": "own"}),
    );
    let (shared_index, shared) = start_task(&cluster, &meili, None, "products", json!({}));
    let (view_index, view) = start_task(&cluster, &meili, None, VIEW, json!({"primary_key": "id"}));
    let tasks = [
        (own, &own_index, "products"),
        (shared, &shared_index, "products"),
        (view, &view_index, VIEW),
    ];
    for (task, _, _) in tasks {
        cluster.wait_snapshot_done(task, CONVERGE);
    }
    let copies: Vec<_> = tasks
        .iter()
        .map(|(task, _, _)| copy_of(&cluster, *task))
        .collect();

    let stop = AtomicBool::new(false);
    let written = AtomicI64::new(10_000);
    std::thread::scope(|scope| {
        scope.spawn(|| write_throughout(&cluster, 10_000, &written, &stop));
        let _stop_writer = StopOnDrop(&stop);
        for (_, index, _) in tasks {
            wait_for_id(&meili, index, 10_020);
        }

        // The new build: its library in place of the old one, and a restart.
        cluster.psql("ALTER SYSTEM SET dynamic_library_path = '$libdir'");
        cluster.pg_ctl_stop("fast");
        cluster.pg_ctl_start();
        assert!(
            !launcher_library(&cluster).starts_with(&*old_library.to_string_lossy()),
            "the server runs this build's library"
        );
        for (task, _, _) in tasks {
            let status = wait_for("the task to say it waits for the update", CONVERGE, || {
                let status = cluster.status(task);
                status
                    .get("last_error")
                    .is_some_and(|error| error.contains("ALTER EXTENSION pg_meili_sync UPDATE"))
                    .then_some(status)
            });
            assert_eq!(
                status.get("worker_pid").map(String::as_str),
                Some("null"),
                "{status:?}"
            );
        }
        let refused = cluster
            .try_psql(&format!("SELECT meili_sync_pause({own})"))
            .expect_err("managing a task before the update");
        assert!(
            refused.contains("ALTER EXTENSION pg_meili_sync UPDATE"),
            "{refused}"
        );

        let before_update = written.load(Ordering::Relaxed);
        cluster.psql("ALTER EXTENSION pg_meili_sync UPDATE");
        assert_eq!(
            cluster.psql(
                "SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'pg_meili_sync'"
            ),
            extension_version()
        );
        for (_, index, _) in tasks {
            wait_for_id(&meili, index, before_update + 20);
        }
    });

    for (task, index, source) in tasks {
        wait_index_matches_table(&cluster, &meili, index, source, CONVERGE);
        let status = cluster.status(task);
        assert_eq!(
            status.get("last_error").map(String::as_str),
            Some("null"),
            "{status:?}"
        );
    }
    let after: Vec<_> = tasks
        .iter()
        .map(|(task, _, _)| copy_of(&cluster, *task))
        .collect();
    assert_eq!(copies, after, "no task copied its table again");
    assert!(cluster.server_log().contains(&format!("no task runs: the pg_meili_sync library is version {}, but the extension's SQL objects in this database are version 0.1.0", extension_version())));
    assert_no_crash(&cluster);
    let _ = std::fs::remove_dir_all(old_library);
}

/// A database with two streaming tasks, dumped and restored into another cluster: the tasks,
/// their keys and their id sequence come back, but stopped, with a last_error that says what to
/// do; nothing streams from the other cluster's positions, and no task slot is made. Resumed, each
/// copies the table again and streams.
#[test]
fn a_restored_dump_brings_the_tasks_back_stopped_until_they_copy_again() {
    let meili = Meili::from_env();
    let source = Cluster::start(&[]);
    source.psql("CREATE EXTENSION pg_meili_sync");
    source.psql(products::CREATE_TABLE);
    source.psql(&products::insert_sql(1, 100));
    let (own_index, own) = start_task(
        &source,
        &meili,
        None,
        "products",
        json!({"decoding": "own"}),
    );
    let (shared_index, shared) = start_task(&source, &meili, None, "products", json!({}));
    for (task, index) in [(own, &own_index), (shared, &shared_index)] {
        source.wait_snapshot_done(task, CONVERGE);
        wait_index_matches_table(&source, &meili, index, "products", CONVERGE);
    }
    let secrets = source.psql("SELECT count(*) FROM meili_sync.task_secrets");
    // The partitions a task's index is in line with are OIDs of the dumped cluster.
    source.psql(&format!(
        "UPDATE meili_sync.tasks SET partitions = ARRAY[16384, 16385]::oid[] WHERE id = {own}"
    ));
    let dump = source.socket_dir.join("database.dump");
    let dumped = source
        .client_command("pg_dump")
        .args(["-Fc", "-d", "postgres", "-f"])
        .arg(&dump)
        .output()
        .expect("pg_dump");
    assert!(
        dumped.status.success(),
        "pg_dump: {}",
        String::from_utf8_lossy(&dumped.stderr)
    );
    source.pg_ctl_stop("fast");

    let target = Cluster::start(&[]);
    let restored = target
        .client_command("pg_restore")
        .args(["-d", "postgres"])
        .arg(&dump)
        .output()
        .expect("pg_restore");
    // The target's launcher may make the shared publication (named after the tasks table's OID,
    // the same in both fresh clusters) before pg_restore gets to the dumped one: those two errors
    // are harmless, as docs/operations.md says (the publication is ours either way). Any other
    // error fails the restore.
    let errors = String::from_utf8_lossy(&restored.stderr).into_owned();
    let other_errors: Vec<&str> = errors
        .lines()
        .filter(|line| line.contains("error:"))
        .filter(|line| !(line.contains("publication \"meili_sync_") && line.contains("_shared\"")))
        .collect();
    assert!(
        restored.status.success() || other_errors.is_empty(),
        "pg_restore: {errors}"
    );
    for task in [own, shared] {
        let status = target.wait_error(task, CONVERGE);
        let last_error = status.get("last_error").cloned().unwrap_or_default();
        assert!(
            last_error.starts_with("restored from a dump")
                && last_error.contains(&format!("meili_sync_resume({task})")),
            "{status:?}"
        );
    }
    assert_eq!(
        target.psql("SELECT count(*) FROM meili_sync.task_secrets"),
        secrets,
        "the tasks' keys came back with them"
    );
    assert_eq!(
        target.psql("SELECT count(*) FROM meili_sync.tasks WHERE partitions IS NOT NULL"),
        "0",
        "the other cluster's partition OIDs are forgotten"
    );
    target.psql(&products::insert_sql(101, 120));
    std::thread::sleep(Duration::from_secs(3));
    for index in [&own_index, &shared_index] {
        let documents = meili.all_documents(index);
        assert_eq!(
            documents.len(),
            100,
            "nothing streamed into {index} from the restored tasks"
        );
    }
    // The shared decoder may hold the shared slot (it runs while a task is of the shared pass).
    assert_eq!(
        target.psql(
            "SELECT count(*) FROM pg_catalog.pg_replication_slots WHERE slot_name !~ '_shared$'"
        ),
        "0",
        "no slot of its own for a restored task"
    );

    for task in [own, shared] {
        target.psql(&format!("SELECT meili_sync_resume({task})"));
    }
    for (task, index) in [(own, &own_index), (shared, &shared_index)] {
        target.wait_snapshot_done(task, CONVERGE);
        target.psql(&products::insert_sql(121 + task * 10, 121 + task * 10));
        wait_index_matches_table(&target, &meili, index, "products", CONVERGE);
        let rows_copied: i64 = target.status(task)["rows_copied"].parse().unwrap_or(0);
        assert!(
            rows_copied >= 120,
            "task {task} copied the table again: {rows_copied}"
        );
    }
    let (_, next) = start_task(&target, &meili, None, "products", json!({}));
    assert!(
        next > own.max(shared),
        "the task ids go on from the restored ones: {next}"
    );
    assert_no_crash(&target);
}

/// The version of the extension built from this tree (the workspace's package version).
fn extension_version() -> String {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml");
    let manifest = std::fs::read_to_string(&manifest).unwrap_or_default();
    manifest
        .lines()
        .find_map(|line| line.strip_prefix("version = "))
        .map(|version| version.trim_matches('"').to_owned())
        .unwrap_or_default()
}
