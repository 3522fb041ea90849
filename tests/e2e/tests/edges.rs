//! End to end: the edges of issue "exact at every edge": primary keys with INCLUDE columns, and
//! state changes that apply from their commit.

use std::time::Duration;

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{assert_no_crash, start_task, wait_index_matches_table};
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(300);

#[test]
fn include_columns_are_no_part_of_the_key() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(
        "CREATE TABLE public.shapes (id int, area box, name text, CONSTRAINT shapes_pkey PRIMARY KEY (id) INCLUDE (area));
         INSERT INTO public.shapes SELECT g, box(point(0, 0), point(g, g)), 'shape ' || g FROM generate_series(1, 300) g",
    );
    let (index, task) = start_task(&cluster, &meili, None, "shapes", json!({"batch_size": 100}));
    cluster.wait_snapshot_done(task, CONVERGE);
    cluster.psql("UPDATE public.shapes SET name = 'renamed' WHERE id OPERATOR(pg_catalog.<=) 10");
    cluster.psql("DELETE FROM public.shapes WHERE id OPERATOR(pg_catalog.>) 290");
    cluster.psql("INSERT INTO public.shapes VALUES (1000, box(point(1, 1), point(2, 2)), 'late')");
    wait_index_matches_table(&cluster, &meili, &index, "public.shapes", CONVERGE);
    assert_eq!(
        cluster.psql(&format!(
            "SELECT primary_key::text FROM meili_sync_status WHERE task = {task}"
        )),
        "{id}"
    );
    assert_eq!(
        cluster
            .psql(&format!("SELECT * FROM meili_sync_verify({task})"))
            .split('|')
            .skip(2)
            .take(3)
            .collect::<Vec<_>>(),
        ["0", "0", "0"]
    );
    assert_no_crash(&cluster);
}

/// The ids in the index, sorted.
fn ids_in(meili: &Meili, index: &str) -> Vec<i64> {
    let mut ids: Vec<i64> = meili
        .all_documents(index)
        .iter()
        .filter_map(|document| document["id"].as_i64())
        .collect();
    ids.sort_unstable();
    ids
}

/// Waits until the decoder that streams `task` has read everything committed so far: for a
/// shared task, a beacon row of another shared task behind it is confirmed; a task with a slot
/// of its own has no worker left.
fn wait_decoded_past(cluster: &Cluster, task: i64, beacon: Option<(i64, i64)>) {
    match beacon {
        Some((beacon_task, id)) => {
            cluster.psql(&format!("INSERT INTO public.beacon VALUES ({id})"));
            assert_eq!(
                cluster.psql(&format!(
                    "SELECT meili_sync_wait({beacon_task}, timeout => '60 seconds')"
                )),
                "t"
            );
        }
        None => pg_meili_sync_e2e::wait_for("the paused task's worker to exit", CONVERGE, || {
            (cluster.status(task).get("worker_pid").map(String::as_str) == Some("null"))
                .then_some(())
        }),
    }
}

/// Pauses, then inserts in the next statement of the same session and in another session, again
/// and again: nothing committed after a pause reaches the index, and everything does after the
/// resume, once. Then a drop: nothing committed after it reaches the index either.
fn a_state_change_applies_from_its_commit(decoding: &str) {
    let rounds: i64 = std::env::var("E2E_PAUSE_ROUNDS")
        .ok()
        .and_then(|rounds| rounds.parse().ok())
        .unwrap_or(25);
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(
        "CREATE TABLE public.held (id bigint PRIMARY KEY, note text);
         CREATE TABLE public.beacon (id bigint PRIMARY KEY);
         INSERT INTO public.held VALUES (0, 'before')",
    );
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "held",
        json!({"decoding": decoding}),
    );
    let beacon = (decoding == "shared").then(|| {
        let (_, beacon_task) = start_task(&cluster, &meili, None, "beacon", json!({}));
        cluster.wait_snapshot_done(beacon_task, CONVERGE);
        beacon_task
    });
    cluster.wait_snapshot_done(task, CONVERGE);
    let mut expected = vec![0];
    for round in 0..rounds {
        pg_meili_sync_e2e::wait_for("the task to stream", CONVERGE, || {
            (cluster.status(task).get("state").map(String::as_str) == Some("streaming"))
                .then_some(())
        });
        let first = 1000 * (round + 1);
        // The pause and the inserts are statements of their own: each commits by itself.
        cluster.psql_script(&format!(
            "SELECT meili_sync_pause({task});\n\
             INSERT INTO public.held SELECT g, 'same session' FROM generate_series({first}, {first} + 99) g;\n"
        ));
        cluster.psql(&format!(
            "INSERT INTO public.held VALUES ({first} + 500, 'another session')"
        ));
        wait_decoded_past(&cluster, task, beacon.map(|beacon| (beacon, round)));
        meili.wait_idle(&index, CONVERGE);
        assert_eq!(
            ids_in(&meili, &index),
            expected,
            "round {round}: rows committed after the pause reached the index"
        );
        cluster.psql(&format!("SELECT meili_sync_resume({task})"));
        expected.extend(first..first + 100);
        expected.push(first + 500);
        pg_meili_sync_e2e::wait_for("the held rows after the resume", CONVERGE, || {
            (ids_in(&meili, &index) == expected).then_some(())
        });
    }
    wait_index_matches_table(&cluster, &meili, &index, "public.held", CONVERGE);
    // Dropped, the index kept: what commits after the drop never reaches it.
    cluster.psql_script(&format!(
        "SELECT meili_sync_drop({task});\n\
         INSERT INTO public.held VALUES (999999, 'after the drop');\n"
    ));
    match beacon {
        Some(beacon) => wait_decoded_past(&cluster, task, Some((beacon, rounds))),
        None => pg_meili_sync_e2e::wait_for("the dropped task's worker to exit", CONVERGE, || {
            (cluster.psql(&format!(
                "SELECT count(*) FROM meili_sync_worker_state() WHERE task = {task} AND pid IS NOT NULL"
            )) == "0")
                .then_some(())
        }),
    }
    meili.wait_idle(&index, CONVERGE);
    assert_eq!(
        ids_in(&meili, &index),
        expected,
        "a row committed after the drop reached the index"
    );
    assert_no_crash(&cluster);
}

#[test]
fn a_pause_or_drop_of_a_shared_task_applies_from_its_commit() {
    a_state_change_applies_from_its_commit("shared");
}

#[test]
fn a_pause_or_drop_of_a_task_with_its_own_slot_applies_from_its_commit() {
    a_state_change_applies_from_its_commit("own");
}

/// Moves a task to another server, and inserts in the next statement: those rows go to the new
/// server only, never to the old one.
fn an_alter_applies_from_its_commit(decoding: &str) {
    let old = Meili::from_env();
    let new = Meili::from_env();
    if old.url == new.url {
        eprintln!("skipped: MEILI_URL names one server, and the move needs two");
        return;
    }
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(
        "CREATE TABLE public.moved (id bigint PRIMARY KEY, note text);
         INSERT INTO public.moved SELECT g, 'copied' FROM generate_series(1, 50) g",
    );
    let (index, task) = start_task(&cluster, &old, None, "moved", json!({"decoding": decoding}));
    cluster.wait_snapshot_done(task, CONVERGE);
    cluster.psql("INSERT INTO public.moved VALUES (51, 'streamed')");
    pg_meili_sync_e2e::wait_for("the streamed row on the old server", CONVERGE, || {
        (ids_in(&old, &index).len() == 51).then_some(())
    });
    cluster.psql_script(&format!(
        "SELECT meili_sync_alter({task}, '{}');\n\
         INSERT INTO public.moved SELECT g, 'after the move' FROM generate_series(1000, 1099) g;\n",
        new.options(json!({}))
    ));
    // The new server may also get rows the old one had not confirmed yet (at least once).
    pg_meili_sync_e2e::wait_for(
        "the rows after the move on the new server",
        CONVERGE,
        || {
            let ids = ids_in(&new, &index);
            (ids.iter().filter(|id| **id >= 1000).count() == 100).then_some(())
        },
    );
    old.wait_idle(&index, CONVERGE);
    assert_eq!(
        ids_in(&old, &index),
        (1..=51).collect::<Vec<i64>>(),
        "rows committed after the alter reached the old server"
    );
    assert_no_crash(&cluster);
}

#[test]
fn an_alter_of_a_shared_task_applies_from_its_commit() {
    an_alter_applies_from_its_commit("shared");
}

#[test]
fn an_alter_of_a_task_with_its_own_slot_applies_from_its_commit() {
    an_alter_applies_from_its_commit("own");
}

/// A copy whose every read fails the same way (a row-security policy that divides by zero, forced
/// on the table's owner) stops the task at once with that error, not after ten crashes.
#[test]
fn an_error_that_fails_every_time_stops_the_task_at_once() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    // The owner is no superuser: a superuser is never subject to row security.
    cluster.psql(
        "CREATE ROLE keeper;
         CREATE TABLE public.guarded (id int PRIMARY KEY, note text);
         INSERT INTO public.guarded SELECT g, 'row ' || g FROM generate_series(1, 20) g;
         ALTER TABLE public.guarded OWNER TO keeper;
         ALTER TABLE public.guarded ENABLE ROW LEVEL SECURITY;
         ALTER TABLE public.guarded FORCE ROW LEVEL SECURITY;
         CREATE POLICY broken ON public.guarded USING (pg_catalog.int4div(id, 0) OPERATOR(pg_catalog.=) 1)",
    );
    let (_, task) = start_task(&cluster, &meili, None, "guarded", json!({}));
    let status = cluster.wait_error(task, CONVERGE);
    let last_error = status.get("last_error").cloned().unwrap_or_default();
    assert!(last_error.contains("division by zero"), "{last_error}");
    assert!(last_error.contains("meili_sync_resume"), "{last_error}");
    assert!(!last_error.contains("crashed"), "{last_error}");
    assert_no_crash(&cluster);
}

/// A delete-batch over the server's payload limit (3,000 keys of 450 bytes, 1.36 MB, to a server
/// that takes 1 MB) is split until it fits, and the limit learned is logged once: the deleted
/// rows leave the index instead of being retried unchanged forever.
#[test]
fn a_delete_batch_over_the_servers_limit_is_split() {
    let Some(meili) = Meili::with_one_megabyte_limit() else {
        eprintln!("skipped: MEILI_URL names a shared server, and this test needs its own");
        return;
    };
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql("CREATE TABLE public.long_keys (k text PRIMARY KEY, v int)");
    // A window closes by age only after a minute: the 3,000 deletes go as one request, over the
    // limit, even on a machine so busy that replaying their transaction takes longer than the
    // default 200 ms (then the window closed by age part way, each part under the limit, and
    // nothing taught the task the limit).
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "long_keys",
        json!({"gzip": false, "flush_interval_ms": 60000}),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    // Added in requests under the limit: nothing has taught the task the limit before the delete.
    for part in 0..3 {
        cluster.psql(&format!(
            "INSERT INTO public.long_keys SELECT pg_catalog.lpad(g::text, 450, 'k'), g FROM generate_series({} + 1, {} + 1000) g",
            part * 1000,
            part * 1000
        ));
        assert_eq!(
            cluster.psql(&format!(
                "SELECT meili_sync_wait({task}, timeout => '120 seconds')"
            )),
            "t"
        );
    }
    assert_eq!(meili.document_count(&index), Some(3000));
    cluster.psql("DELETE FROM public.long_keys");
    pg_meili_sync_e2e::wait_for("the deleted rows to leave the index", CONVERGE, || {
        (meili.document_count(&index) == Some(0)).then_some(())
    });
    // A real server names its limit in the refusal, and the task logs it once, when the decoder
    // next takes in its progress. (The test server may close the connection before the client
    // reads its answer: a refusal without the number, split all the same.)
    if meili.test_server().is_none() {
        const LEARNED: &str = "Meilisearch refuses request bodies over 1000000 bytes";
        pg_meili_sync_e2e::wait_for("the limit learned in the server log", CONVERGE, || {
            cluster.server_log().contains(LEARNED).then_some(())
        });
        assert_eq!(cluster.server_log().matches(LEARNED).count(), 1);
    }
    assert_no_crash(&cluster);
}

/// The launcher runs its catalog queries every round, and on a busy catalog their estimates can
/// pass `jit_above_cost`: compiling each one cost a launcher a third of a core. Our processes pin
/// `jit = off`. With every query's plan logged (auto_explain) and JIT made to compile everything,
/// no plan of a pg_meili_sync process says `JIT:`, while a client's does.
#[test]
fn our_processes_never_compile_their_queries_with_jit() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[
        "shared_preload_libraries='pg_meili_sync,auto_explain'",
        "jit=on",
        "jit_above_cost=0",
        "jit_inline_above_cost=0",
        "jit_optimize_above_cost=0",
        "auto_explain.log_min_duration=0",
        "auto_explain.log_analyze=on",
        "auto_explain.log_nested_statements=on",
        "log_line_prefix='%m [%p] %b: '",
    ]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(
        "CREATE TABLE public.items (id int PRIMARY KEY, name text);
         INSERT INTO public.items SELECT g, 'item ' || g FROM generate_series(1, 500) g",
    );
    let (index, task) = start_task(&cluster, &meili, None, "items", json!({"batch_size": 100}));
    cluster.wait_snapshot_done(task, CONVERGE);
    cluster.psql("UPDATE public.items SET name = 'renamed' WHERE id OPERATOR(pg_catalog.<=) 10");
    wait_index_matches_table(&cluster, &meili, &index, "public.items", CONVERGE);
    // Several launcher rounds (meili_sync.naptime is 200 ms here).
    std::thread::sleep(Duration::from_secs(2));
    // Control: a client's query is compiled, so JIT works here and the log shows it.
    cluster.psql("SELECT pg_catalog.count(*) FROM meili_sync.tasks");

    // Each plan is a prefixed line followed by unprefixed ones: credit `JIT:` to the backend
    // type of the last prefixed line.
    let mut compiled_by = std::collections::BTreeSet::new();
    let mut backend_type = String::new();
    for line in cluster.server_log().lines() {
        if let Some((_, rest)) = line.split_once("] ") {
            if line.starts_with("20") {
                backend_type = rest.split(": ").next().unwrap_or_default().to_owned();
            }
        }
        if line.trim_start().starts_with("JIT:") {
            compiled_by.insert(backend_type.clone());
        }
    }
    assert!(
        compiled_by.contains("client backend"),
        "the control: a client's plan shows JIT ({compiled_by:?})"
    );
    let ours: Vec<&String> = compiled_by
        .iter()
        .filter(|kind| kind.starts_with("pg_meili_sync"))
        .collect();
    assert!(ours.is_empty(), "these compiled queries with JIT: {ours:?}");
    assert_no_crash(&cluster);
}
