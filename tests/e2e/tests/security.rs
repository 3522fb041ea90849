//! End to end: attacks on the trust boundary, each run against real workers. Every test plants
//! something a role that is not superuser controls, drives the extension through it, and asserts
//! both that the attack got nowhere and that syncing still works.

use std::time::Duration;

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{
    assert_no_crash, products, refusal, refused_views, start_task, wait_for,
    wait_index_matches_table, TaskStart,
};
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(120);

/// A log every trap writes to: what ran, as whom, whether that role is a superuser, and from
/// which client (`psql` is the test's own harness; our workers have no application name, and
/// the test calls the extension's functions as `attack`).
const TRAP_LOG: &str = r#"
CREATE TABLE public.trap_log (what text, who name, superuser boolean, app text, backend_type text);
GRANT SELECT, INSERT ON public.trap_log TO PUBLIC;
CREATE FUNCTION public.trap(what text) RETURNS boolean LANGUAGE sql AS $$
    INSERT INTO public.trap_log (what, who, superuser, app, backend_type)
    SELECT what, current_user, r.rolsuper, pg_catalog.current_setting('application_name'),
           (SELECT a.backend_type FROM pg_catalog.pg_stat_activity a
             WHERE a.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid())
      FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) current_user;
    SELECT true
$$;
"#;

/// Look-alikes of every pg_catalog object the extension's SQL used unqualified, each an exact
/// type match (which beats pg_catalog's own candidate wherever the schema is on the path) or the
/// same signature (which wins once the schema comes before pg_catalog). Each logs, then does
/// what the original does, so nothing breaks and only the log tells.
const TRAPS: &str = r#"
CREATE FUNCTION public.trap_regex(name, name) RETURNS boolean LANGUAGE sql AS
    $$ SELECT public.trap('~(name,name)') AND $1::text OPERATOR(pg_catalog.~) $2::text $$;
CREATE OPERATOR public.~ (LEFTARG = name, RIGHTARG = name, FUNCTION = public.trap_regex);
CREATE FUNCTION public.trap_concat_oid(text, oid) RETURNS text LANGUAGE sql AS
    $$ SELECT CASE WHEN public.trap('||(text,oid)') THEN pg_catalog.textcat($1, $2::text) END $$;
CREATE OPERATOR public.|| (LEFTARG = text, RIGHTARG = oid, FUNCTION = public.trap_concat_oid);
CREATE FUNCTION public.trap_concat_oids(oid, oid) RETURNS text LANGUAGE sql AS
    $$ SELECT CASE WHEN public.trap('||(oid,oid)') THEN pg_catalog.textcat($1::text, $2::text) END $$;
CREATE OPERATOR public.|| (LEFTARG = oid, RIGHTARG = oid, FUNCTION = public.trap_concat_oids);
CREATE FUNCTION public.trap_concat_bigint(text, bigint) RETURNS text LANGUAGE sql AS
    $$ SELECT CASE WHEN public.trap('||(text,bigint)') THEN pg_catalog.textcat($1, $2::text) END $$;
CREATE OPERATOR public.|| (LEFTARG = text, RIGHTARG = bigint, FUNCTION = public.trap_concat_bigint);
CREATE FUNCTION public.unnest(int2vector) RETURNS SETOF smallint LANGUAGE sql AS
    $$ SELECT u FROM pg_catalog.unnest($1) u WHERE public.trap('unnest(int2vector)') $$;
CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql AS
    $$ SELECT CASE WHEN public.trap('now()') THEN pg_catalog.now() END $$;
CREATE FUNCTION public.trap_count(bigint) RETURNS bigint LANGUAGE sql AS
    $$ SELECT CASE WHEN public.trap('count(*)') THEN $1 + 1 END $$;
CREATE AGGREGATE public.count(*) (SFUNC = public.trap_count, STYPE = bigint, INITCOND = '0');
CREATE FUNCTION public.trap_eq(bigint, bigint) RETURNS boolean LANGUAGE sql AS
    $$ SELECT public.trap('=(bigint,bigint)') AND $1 OPERATOR(pg_catalog.=) $2 $$;
CREATE OPERATOR public.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = public.trap_eq);
"#;

/// Runs SQL as a client named `attack` (see `TRAP_LOG`).
fn as_attack_client(cluster: &Cluster, sql: &str) -> String {
    cluster.psql(&format!("SET application_name = 'attack'; {sql}"))
}

/// Trap log lines written with superuser rights, except by the client named `except_app`.
fn superuser_traps(cluster: &Cluster, except_app: Option<&str>) -> String {
    let except = except_app.unwrap_or_default();
    cluster.psql(&format!(
        "SELECT coalesce(pg_catalog.string_agg(DISTINCT what || ' in ' || coalesce(backend_type, '?') || ' (' || app || ')', '; '), '')
           FROM public.trap_log WHERE superuser AND ({} OR app OPERATOR(pg_catalog.<>) '{except}')",
        except_app.is_none()
    ))
}

#[test]
fn a_trap_schema_never_runs_as_superuser() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    // The database's owner, not a superuser, owns schema public (PostgreSQL 15) and plants the
    // traps there, then puts public before pg_catalog for every new session.
    cluster.psql("CREATE ROLE db_owner LOGIN");
    cluster.psql("ALTER DATABASE postgres OWNER TO db_owner");
    cluster.psql(&format!("SET ROLE db_owner; {TRAP_LOG}"));
    cluster.psql(&format!("SET ROLE db_owner; {TRAPS}"));
    cluster.psql("SET ROLE db_owner; ALTER DATABASE postgres SET search_path = public, pg_catalog");
    // Control: an unprotected superuser query in a new session does fall into the traps (so
    // this test can fail).
    cluster.psql("SELECT 'x'::text || 'pg_class'::regclass::oid, now()");
    let caught = cluster.psql(
        "SELECT pg_catalog.string_agg(DISTINCT what, ',' ORDER BY what) FROM public.trap_log WHERE superuser",
    );
    assert_eq!(
        caught, "now(),||(text,oid)",
        "the traps must catch an unqualified query"
    );
    cluster.psql("TRUNCATE public.trap_log");

    // From here on every session, our workers included, starts with public first.
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 3000));
    let index = meili.unique_index("trap");
    let options = meili.options(json!({"batch_size": 500}));
    let task: i64 = as_attack_client(
        &cluster,
        &format!("SELECT meili_sync_start('products', '{index}', '{options}')"),
    )
    .lines()
    .last()
    .and_then(|line| line.parse().ok())
    .expect("task id");
    cluster.wait_snapshot_done(task, CONVERGE);
    cluster.psql(&products::insert_sql(3001, 3500));
    cluster.psql("UPDATE products SET version = version + 1 WHERE id OPERATOR(pg_catalog.<=) 100");
    cluster.psql("DELETE FROM products WHERE id OPERATOR(pg_catalog.>) 3400");
    wait_index_matches_table(&cluster, &meili, &index, "products", CONVERGE);

    // Every function and view, called by a superuser whose session puts public first.
    for sql in [
        format!("SELECT meili_sync_pause({task})"),
        format!("SELECT meili_sync_resume({task})"),
        format!("SELECT meili_sync_alter({task}, '{{\"batch_size\": 400}}')"),
        format!("SELECT * FROM meili_sync_verify({task})"),
        format!("SELECT * FROM meili_sync_repair({task})"),
        format!("SELECT meili_sync_retry_dead_letters({task})"),
        format!("SELECT meili_sync_discard_dead_letters({task})"),
        format!("SELECT pg_stat_meili_sync_reset({task})"),
        "SELECT * FROM meili_sync_status".to_owned(),
        "SELECT * FROM pg_stat_meili_sync".to_owned(),
        "SELECT * FROM meili_sync_dead_letters".to_owned(),
        format!("SELECT meili_sync_snapshot({task})"),
    ] {
        as_attack_client(&cluster, &sql);
    }
    cluster.wait_snapshot_done(task, CONVERGE);
    cluster.psql(&products::insert_sql(5001, 5100));
    wait_index_matches_table(&cluster, &meili, &index, "products", CONVERGE);

    // A launcher that connects again meets the database's search_path anew; let it run rounds.
    let launcher = cluster.psql(
        "SELECT pid FROM pg_stat_activity WHERE backend_type OPERATOR(pg_catalog.=) 'pg_meili_sync launcher'",
    );
    cluster.psql(&format!("SELECT pg_terminate_backend({launcher})"));
    wait_for("a new launcher", CONVERGE, || {
        let now = cluster.psql(
            "SELECT pid FROM pg_stat_activity WHERE backend_type OPERATOR(pg_catalog.=) 'pg_meili_sync launcher'",
        );
        (!now.is_empty() && now != launcher).then_some(())
    });
    std::thread::sleep(Duration::from_secs(3));
    as_attack_client(
        &cluster,
        &format!("SELECT meili_sync_drop({task}, drop_index => true)"),
    );
    std::thread::sleep(Duration::from_secs(1));

    // The test's own psql sessions (the control above) are the only exception.
    assert_eq!(
        superuser_traps(&cluster, Some("psql")),
        "",
        "a trap ran as superuser"
    );
    assert_no_crash(&cluster);
}

#[test]
fn a_table_owners_code_runs_as_the_owner_never_as_superuser() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(TRAP_LOG);
    // pg_read_all_stats only so that the log can name the backend type of a superuser's process.
    cluster.psql(
        "CREATE ROLE shop LOGIN IN ROLE pg_read_all_stats; GRANT CREATE ON SCHEMA public TO shop",
    );
    // The owner's key type is a domain whose CHECK calls the owner's function, and the table has
    // the owner's UPDATE trigger: both log whoever runs them.
    cluster.psql(
        r#"SET ROLE shop;
        CREATE FUNCTION public.item_id_ok(bigint) RETURNS boolean LANGUAGE sql AS
            $$ SELECT public.trap('domain check') AND $1 > 0 $$;
        CREATE DOMAIN public.item_id AS bigint CHECK (public.item_id_ok(VALUE));
        CREATE TABLE public.items (id public.item_id PRIMARY KEY, name text NOT NULL, _geo jsonb);
        CREATE FUNCTION public.items_touched() RETURNS trigger LANGUAGE plpgsql AS
            $$ BEGIN PERFORM public.trap('update trigger'); RETURN NEW; END $$;
        CREATE TRIGGER items_touched AFTER UPDATE ON public.items FOR EACH ROW EXECUTE FUNCTION public.items_touched();
        INSERT INTO public.items SELECT g, 'item ' || g, '{"lat": 1, "lng": 2}' FROM generate_series(1, 2000) g;"#,
    );
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "items",
        json!({"batch_size": 300, "settings": {"filterableAttributes": ["_geo"]}}),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    wait_index_matches_table(&cluster, &meili, &index, "items", CONVERGE);
    // Verify and repair cast document ids to the key type, in the caller's backend.
    assert_eq!(
        cluster.psql(&format!(
            "SELECT missing, extra, different FROM meili_sync_verify({task})"
        )),
        "0|0|0"
    );
    assert_eq!(
        cluster.psql(&format!("SELECT * FROM meili_sync_repair({task})")),
        "0|0"
    );
    // Bad updates of rows 17 and 18 are streamed and dead-lettered.
    cluster
        .psql(r#"SET ROLE shop; UPDATE public.items SET _geo = '"nowhere"' WHERE id IN (17, 18)"#);
    wait_for("rows 17 and 18 as dead letters", CONVERGE, || {
        let ids = cluster.psql(
            "SELECT string_agg(document_id, ',' ORDER BY document_id) FROM meili_sync_dead_letters",
        );
        (ids == "17,18").then_some(())
    });

    // With the stream paused, the owner fixes row 17 and deletes row 18; a superuser retries the
    // dead letters, which go straight to Meilisearch without touching the table.
    cluster.psql(&format!("SELECT meili_sync_pause({task})"));
    cluster.psql(
        r#"SET ROLE shop; UPDATE public.items SET _geo = '{"lat": 3, "lng": 4}' WHERE id = 17;
           DELETE FROM public.items WHERE id = 18;"#,
    );
    let triggers_before =
        cluster.psql("SELECT count(*) FROM public.trap_log WHERE what = 'update trigger'");
    let retried = cluster.psql(&format!("SELECT meili_sync_retry_dead_letters({task})"));
    assert_eq!(retried, "2", "row 17 re-sent and row 18 deleted");
    assert_eq!(
        cluster.psql("SELECT count(*) FROM public.trap_log WHERE what = 'update trigger'"),
        triggers_before,
        "retrying dead letters must not fire the table's triggers"
    );
    assert_eq!(
        cluster.psql("SELECT count(*) FROM meili_sync_dead_letters"),
        "0"
    );
    let (_, seventeen) = meili.request(
        pg_meili_sync_e2e::meili::Method::GET,
        &format!("/indexes/{index}/documents/17"),
        None,
    );
    assert_eq!(
        seventeen["_geo"],
        json!({"lat": 3, "lng": 4}),
        "row 17's current state"
    );
    let (status, _) = meili.request(
        pg_meili_sync_e2e::meili::Method::GET,
        &format!("/indexes/{index}/documents/18"),
        None,
    );
    assert_eq!(status, 404, "the deleted row's document is gone");
    cluster.psql(&format!("SELECT meili_sync_resume({task})"));
    cluster.psql("SET ROLE shop; INSERT INTO public.items VALUES (5000, 'late', NULL)");
    wait_index_matches_table(&cluster, &meili, &index, "items", CONVERGE);

    assert_eq!(
        superuser_traps(&cluster, None),
        "",
        "the owner's code ran as superuser"
    );
    // The worker itself ran the owner's CHECK (its page and key casts), as the owner.
    assert_eq!(
        cluster.psql(
            "SELECT string_agg(DISTINCT who, ',') FROM public.trap_log
              WHERE what = 'domain check' AND backend_type = 'pg_meili_sync task'"
        ),
        "shop"
    );
    assert_no_crash(&cluster);
}

#[test]
fn the_worker_checks_again_that_the_tasks_owner_may_read_the_table() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 500));
    cluster.psql("CREATE ROLE ops IN ROLE meili_sync_admin; GRANT SELECT ON products TO ops");
    let (index, task) = TaskStart::on("products")
        .index_named("owner")
        .as_role(Some("ops"))
        .start_copied(&cluster, &meili, CONVERGE);
    assert_eq!(
        cluster.psql(&format!(
            "SELECT owner FROM meili_sync.tasks WHERE id = {task}"
        )),
        "ops"
    );
    // The grant goes; a superuser asks for a new copy: the worker refuses to read as ops.
    cluster.psql("REVOKE SELECT ON products FROM ops");
    cluster.psql(&products::insert_sql(501, 600));
    cluster.psql(&format!("SELECT meili_sync_snapshot({task})"));
    let status = cluster.wait_error(task, CONVERGE);
    let error = status.get("last_error").cloned().unwrap_or_default();
    assert!(
        error.contains("permission denied for table public.products: role ops may not read it")
            && error.contains("GRANT SELECT ON public.products TO ops"),
        "{error}"
    );
    // Granted again, the task resumes and catches up.
    cluster.psql("GRANT SELECT ON products TO ops");
    cluster.psql(&format!("SELECT meili_sync_resume({task})"));
    wait_index_matches_table(&cluster, &meili, &index, "products", CONVERGE);
}

#[test]
fn the_default_api_key_is_never_shown() {
    let key = "e2e-default-k3y";
    let cluster = Cluster::start(&[&format!("meili_sync.api_key='{key}'")]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql("CREATE ROLE watcher IN ROLE pg_monitor");
    for sql in [
        "SHOW meili_sync.api_key",
        "SELECT current_setting('meili_sync.api_key')",
    ] {
        assert_eq!(
            cluster.psql(&format!("SET ROLE watcher; {sql}")),
            "********"
        );
        assert_eq!(cluster.psql(sql), "********", "{sql} as superuser");
    }
    assert_eq!(
        cluster.psql(
            "SET ROLE watcher; SELECT count(*) FROM pg_settings WHERE name LIKE 'meili_sync.%' AND (setting LIKE '%k3y%' OR reset_val LIKE '%k3y%' OR boot_val LIKE '%k3y%')"
        ),
        "0"
    );
    assert_eq!(
        cluster.psql(
            "SET ROLE watcher; SELECT count(*) FROM pg_settings WHERE name = 'meili_sync.api_key'"
        ),
        "0"
    );
    let refused = cluster
        .try_psql("SET ROLE watcher; SELECT count(*) FROM pg_file_settings")
        .expect_err("pg_file_settings is for superusers");
    assert!(refused.contains("permission denied"), "{refused}");
    // Session and per-database settings would show the key (pg_stat_activity,
    // pg_db_role_setting): refused, without echoing the value.
    for sql in [
        "SET meili_sync.api_key = 'leaked-k3y'",
        "ALTER DATABASE postgres SET meili_sync.api_key = 'leaked-k3y'",
        "ALTER ROLE watcher SET meili_sync.api_key = 'leaked-k3y'",
    ] {
        let error = cluster.try_psql(sql).expect_err(sql);
        assert!(
            error.contains("meili_sync.api_key can be set in the configuration files only")
                && !error.contains("leaked"),
            "{sql}: {error}"
        );
    }
    assert_eq!(
        cluster.psql("SELECT count(*) FROM pg_db_role_setting WHERE array_to_string(setconfig, ',') LIKE '%k3y%'"),
        "0"
    );
}

#[cfg(target_os = "linux")]
#[test]
fn sigterm_to_each_thread_of_a_busy_worker_never_restarts_the_server() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 2000));
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "products",
        json!({"batch_size": 200}),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    let postmaster_start = cluster.psql("SELECT pg_postmaster_start_time()");
    let worker: i32 = cluster.status(task)["worker_pid"]
        .parse()
        .expect("worker pid");
    // Keep the worker busy while its threads are signalled.
    let writer = {
        let script: String = (0..200)
            .map(|round| {
                format!(
                    "UPDATE products SET version = version + 1 WHERE id % 200 = {};\n",
                    round % 200
                )
            })
            .collect();
        let cluster_psql = cluster.psql_command();
        std::thread::spawn(move || {
            let mut command = cluster_psql;
            let _ = command.args(["-c", &script]).output();
        })
    };
    let threads: Vec<i32> = std::fs::read_dir(format!("/proc/{worker}/task"))
        .expect("the worker's threads")
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .filter(|thread| *thread != worker)
        .collect();
    assert!(!threads.is_empty(), "a busy worker has HTTP threads");
    for thread in &threads {
        // SAFETY: tgkill sends a signal to one thread of a process; arguments are plain integers.
        let sent = unsafe { libc::syscall(libc::SYS_tgkill, worker, *thread, libc::SIGTERM) };
        assert!(
            sent == 0 || !std::path::Path::new(&format!("/proc/{worker}/task/{thread}")).exists()
        );
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            cluster.status(task).get("worker_pid").map(String::as_str),
            Some(worker.to_string().as_str()),
            "SIGTERM to thread {thread} (not the main one) must not end the worker"
        );
    }
    // The main thread takes SIGTERM as a request to stop: the launcher starts a new worker.
    // SAFETY: as above, for the worker's main thread.
    unsafe { libc::syscall(libc::SYS_tgkill, worker, worker, libc::SIGTERM) };
    wait_for("a new worker", CONVERGE, || {
        let pid = cluster
            .status(task)
            .get("worker_pid")
            .cloned()
            .unwrap_or_default();
        (!pid.is_empty() && pid != "null" && pid != worker.to_string()).then_some(())
    });
    let _ = writer.join();
    wait_index_matches_table(&cluster, &meili, &index, "products", CONVERGE);
    assert_eq!(
        cluster.psql("SELECT pg_postmaster_start_time()"),
        postmaster_start,
        "the server must not restart"
    );
    assert!(
        !cluster
            .server_log()
            .contains("terminating any other active server processes"),
        "the postmaster restarted the server:\n{}",
        cluster.tail_log()
    );
    assert_no_crash(&cluster);
}

/// The paths of a task on several servers, attacked at once: a trap schema first on every
/// session's search_path, and a table whose key type's CHECK is its owner's code. A sharded task
/// copies, streams, verifies, repairs, is resynced (a helper per shard) and gains a shard (the
/// rebalance worker moves and prunes documents); a replicated task streams, is searched with
/// read-your-writes and has one replica resynced. No trap runs as superuser, and the owner's
/// CHECK runs as the owner in the task workers and in the rebalance worker.
#[test]
fn shards_and_replicas_never_run_a_trap_or_the_owners_code_as_superuser() {
    let Some(meilis) = (0..3)
        .map(|_| Meili::own_shard())
        .collect::<Option<Vec<Meili>>>()
    else {
        eprintln!("skipped: the one Meilisearch at MEILI_URL cannot be several servers");
        return;
    };
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE ROLE db_owner LOGIN");
    cluster.psql("ALTER DATABASE postgres OWNER TO db_owner");
    cluster.psql(&format!("SET ROLE db_owner; {TRAP_LOG}"));
    cluster.psql(&format!("SET ROLE db_owner; {TRAPS}"));
    cluster.psql(
        "CREATE ROLE shop LOGIN IN ROLE pg_read_all_stats; GRANT CREATE ON SCHEMA public TO shop",
    );
    cluster.psql(
        r#"SET ROLE shop;
        CREATE FUNCTION public.item_id_ok(bigint) RETURNS boolean LANGUAGE sql AS
            $$ SELECT public.trap('domain check') AND $1 OPERATOR(pg_catalog.>) 0 $$;
        CREATE DOMAIN public.item_id AS bigint CHECK (public.item_id_ok(VALUE));
        CREATE TABLE public.items (id public.item_id PRIMARY KEY, name text NOT NULL);
        INSERT INTO public.items SELECT g, 'item ' || g FROM pg_catalog.generate_series(1, 1500) g;"#,
    );
    cluster.psql("SET ROLE db_owner; ALTER DATABASE postgres SET search_path = public, pg_catalog");
    // Control: a superuser's unqualified query in a new session is caught, so this test can fail.
    cluster.psql("SELECT now()");
    assert_eq!(
        superuser_traps(&cluster, None),
        "now() in client backend (psql)"
    );
    cluster.psql("TRUNCATE public.trap_log");
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    let settle = |task: i64| {
        wait_for("the task's rows to agree with the table", CONVERGE, || {
            let verified = cluster.psql(&format!(
                "SELECT missing OPERATOR(pg_catalog.+) extra OPERATOR(pg_catalog.+) different FROM meili_sync_verify({task})"
            ));
            (verified == "0").then_some(())
        })
    };
    let helpers_gone = || {
        wait_for("the resync helpers to swap and go", CONVERGE, || {
            let left = cluster.psql(
                "SELECT pg_catalog.count(*) FROM meili_sync.tasks WHERE resync_of IS NOT NULL",
            );
            (left == "0").then_some(())
        })
    };

    // Sharded: two shards, then a third.
    let names = ["trap-a", "trap-b", "trap-c"];
    let shards: Vec<serde_json::Value> = meilis
        .iter()
        .zip(names)
        .map(|(meili, name)| meili.shard(name))
        .collect();
    let sharded_index = meilis[0].unique_index("trap_shards");
    let sharded: i64 = as_attack_client(
        &cluster,
        &format!(
            "SELECT meili_sync_start('items', '{sharded_index}', '{}')",
            json!({"shards": &shards[..2], "batch_size": 300})
        ),
    )
    .lines()
    .last()
    .and_then(|line| line.parse().ok())
    .expect("task id");
    cluster.wait_snapshot_done(sharded, CONVERGE);
    cluster.psql(
        "SET ROLE shop; INSERT INTO public.items SELECT g, 'item ' || g FROM pg_catalog.generate_series(1501, 1600) g;
         UPDATE public.items SET id = id OPERATOR(pg_catalog.+) 10000 WHERE id OPERATOR(pg_catalog.<=) 40",
    );
    settle(sharded);
    as_attack_client(
        &cluster,
        &format!("SELECT * FROM meili_sync_repair({sharded})"),
    );
    as_attack_client(
        &cluster,
        &format!("SELECT * FROM meili_search({sharded}, 'item', '{{\"limit\": 5}}')"),
    );
    as_attack_client(&cluster, &format!("SELECT meili_sync_resync({sharded})"));
    helpers_gone();
    as_attack_client(
        &cluster,
        &format!(
            "SELECT meili_sync_alter({sharded}, '{}')",
            json!({"shards": shards})
        ),
    );
    wait_for(
        "the third shard to join and the moved documents to go",
        CONVERGE,
        || {
            let done = cluster.psql(&format!(
            "SELECT pg_catalog.count(DISTINCT shard_names) OPERATOR(pg_catalog.=) 1 AND pg_catalog.bool_and(shard_prune_after IS NULL) AND pg_catalog.bool_and(snapshot_finished_at IS NOT NULL)
               FROM meili_sync.tasks WHERE id OPERATOR(pg_catalog.=) {sharded} OR replica_of OPERATOR(pg_catalog.=) {sharded}"
        ));
            (done == "t").then_some(())
        },
    );
    cluster.psql("SET ROLE shop; DELETE FROM public.items WHERE id OPERATOR(pg_catalog.>) 1590");
    settle(sharded);

    // Replicated: two servers; one replica resynced alone.
    let replicated_index = meilis[0].unique_index("trap_replicas");
    let replicated: i64 = as_attack_client(
        &cluster,
        &format!(
            "SELECT meili_sync_start('items', '{replicated_index}', '{}')",
            json!({"replicas": [meilis[0].replica(), meilis[1].replica()]})
        ),
    )
    .lines()
    .last()
    .and_then(|line| line.parse().ok())
    .expect("task id");
    cluster.wait_snapshot_done(replicated, CONVERGE);
    let replica = cluster.psql(&format!(
        "SELECT task FROM meili_sync_status WHERE replica_of OPERATOR(pg_catalog.=) {replicated}"
    ));
    cluster.wait_snapshot_done(replica.parse().expect("the replica's row"), CONVERGE);
    cluster.psql("SET ROLE shop; UPDATE public.items SET name = name || ' v2' WHERE id OPERATOR(pg_catalog.<=) 100");
    as_attack_client(
        &cluster,
        &format!(
            "SELECT meili_sync_wait({replicated}); SELECT * FROM meili_search({replicated}, 'v2', '{{\"limit\": 5}}')"
        ),
    );
    as_attack_client(&cluster, &format!("SELECT meili_sync_resync({replica})"));
    helpers_gone();
    settle(replicated);
    for task in [sharded, replicated] {
        as_attack_client(
            &cluster,
            &format!("SELECT meili_sync_drop({task}, drop_index => true)"),
        );
    }

    assert_eq!(
        superuser_traps(&cluster, Some("psql")),
        "",
        "a trap or the owner's code ran as superuser"
    );
    // The check ran in the task workers and in the rebalance worker, as the table's owner only.
    assert_eq!(
        cluster.psql(
            "SELECT pg_catalog.string_agg(DISTINCT backend_type OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) who, ',' ORDER BY backend_type OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) who)
               FROM public.trap_log WHERE what OPERATOR(pg_catalog.=) 'domain check' AND backend_type OPERATOR(pg_catalog.~~) 'pg_meili_sync%'"
        ),
        "pg_meili_sync rebalance:shop,pg_meili_sync task:shop"
    );
    assert_no_crash(&cluster);
}

/// The OID that names this install's slots and publications (`meili_sync_<oid>_…`).
fn install_oid(cluster: &Cluster) -> String {
    cluster.psql("SELECT 'meili_sync.tasks'::regclass::oid")
}

#[test]
fn publications_claimed_first_are_never_adopted_and_changed_ones_are_mended() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    // A role that may create publications in the database (the database owner has that right).
    cluster.psql("CREATE ROLE claimer LOGIN");
    cluster.psql("GRANT CREATE ON DATABASE postgres TO claimer");
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    let install = install_oid(&cluster);
    // The names are predictable: the shared pass's, and the own publication of task 2.
    let shared = format!("meili_sync_{install}_shared");
    let own = format!("meili_sync_{install}_2");
    cluster.psql(&format!(
        "SET ROLE claimer; CREATE PUBLICATION {shared} WITH (publish = 'insert'); CREATE PUBLICATION {own} WITH (publish = 'insert')"
    ));
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 300));
    cluster.psql("CREATE TABLE products_own (LIKE products INCLUDING ALL)");
    cluster.psql("INSERT INTO products_own SELECT * FROM products");
    let (shared_index, shared_task) = start_task(&cluster, &meili, None, "products", json!({}));
    let (own_index, own_task) = start_task(
        &cluster,
        &meili,
        None,
        "products_own",
        json!({"decoding": "own"}),
    );
    assert_eq!(own_task, 2, "the claimed name is the second task's");
    cluster.wait_snapshot_done(shared_task, CONVERGE);
    cluster.wait_snapshot_done(own_task, CONVERGE);
    // Updates and deletes reach both indexes: neither insert-only publication was adopted.
    for table in ["products", "products_own"] {
        cluster.psql(&format!(
            "UPDATE {table} SET name = 'renamed ' || id, version = version + 1 WHERE id <= 40; DELETE FROM {table} WHERE id > 250"
        ));
    }
    wait_index_matches_table(&cluster, &meili, &shared_index, "products", CONVERGE);
    wait_index_matches_table(&cluster, &meili, &own_index, "products_own", CONVERGE);
    let owners = cluster.psql(&format!(
        "SELECT string_agg(pubname || ' ' || pubowner::regrole::text || ' ' || pubinsert || pubupdate || pubdelete || pubtruncate, ', ' ORDER BY pubname)
           FROM pg_publication WHERE pubname IN ('{shared}', '{own}')"
    ));
    assert_eq!(
        owners,
        format!("{own} postgres truetruetruetrue, {shared} postgres truetruetruetrue"),
        "both publications are the catalog owner's, with every operation"
    );
    // The claimer no longer owns them: it cannot drop them to stall the decoder.
    for name in [&shared, &own] {
        let refused = pg_meili_sync_e2e::refusal(
            &cluster,
            &format!("SET ROLE claimer; DROP PUBLICATION {name}"),
        );
        assert_eq!(refused.sqlstate, "42501", "{refused:?}");
    }

    // Changed and dropped later by someone who may (a superuser): each task reports it, the
    // publication is made again, and the table is copied again, so what went out wrongly
    // meanwhile (here: deletes) is put right.
    cluster.psql(&format!(
        "ALTER PUBLICATION {shared} SET (publish = 'insert')"
    ));
    cluster.psql("DELETE FROM products WHERE id <= 20");
    cluster.psql(&format!("DROP PUBLICATION {own}"));
    cluster.psql("DELETE FROM products_own WHERE id <= 20");
    for (task, name) in [(shared_task, &shared), (own_task, &own)] {
        let deadline = std::time::Instant::now() + CONVERGE;
        let error = wait_for("the task to report its publication", CONVERGE, || {
            let status = cluster.status(task);
            assert!(
                std::time::Instant::now() + Duration::from_secs(1) < deadline,
                "task {task} never reported its publication: {status:?}\n{}",
                cluster.tail_log()
            );
            let error = status.get("last_error").cloned().unwrap_or_default();
            (error.contains(name.as_str()) && error.contains("copies its table again"))
                .then_some(error)
        });
        assert!(
            error.contains("changes decoded with it may have gone to Meilisearch wrongly"),
            "task {task}: {error}"
        );
    }
    wait_index_matches_table(&cluster, &meili, &shared_index, "products", CONVERGE);
    wait_index_matches_table(&cluster, &meili, &own_index, "products_own", CONVERGE);
    // Streaming again, with the right options, on new slots.
    cluster.psql("UPDATE products SET version = version + 1 WHERE id = 30; DELETE FROM products WHERE id = 31");
    cluster.psql("UPDATE products_own SET version = version + 1 WHERE id = 30; DELETE FROM products_own WHERE id = 31");
    wait_index_matches_table(&cluster, &meili, &shared_index, "products", CONVERGE);
    wait_index_matches_table(&cluster, &meili, &own_index, "products_own", CONVERGE);
    let options = cluster.psql(&format!(
        "SELECT string_agg(pubname || ' ' || pubinsert || pubupdate || pubdelete || pubtruncate, ', ' ORDER BY pubname)
           FROM pg_publication WHERE pubname IN ('{shared}', '{own}')"
    ));
    assert_eq!(
        options,
        format!("{own} truetruetruetrue, {shared} truetruetruetrue")
    );
    // No crash loop: the shared decoder started a few times, not over and over.
    let decoder_starts = cluster
        .server_log()
        .matches("shared decoder started")
        .count();
    assert!(
        decoder_starts <= 4,
        "{decoder_starts} starts of the shared decoder"
    );
    assert_no_crash(&cluster);
}

#[test]
fn empty_databases_never_use_up_the_table_of_databases() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    // A role below superuser with CREATEDB makes as many empty databases as the table holds.
    cluster.psql("CREATE ROLE maker LOGIN CREATEDB");
    let script: String = std::iter::once("SET ROLE maker;\n".to_owned())
        .chain(
            (0..64).map(|number| format!("CREATE DATABASE empty_{number} STRATEGY = FILE_COPY;\n")),
        )
        .collect();
    cluster.psql_script(&script);
    assert_eq!(
        cluster.psql("SELECT count(*) FROM pg_database WHERE datname LIKE 'empty_%'"),
        "64"
    );
    // The cluster launcher looks into each of them (two at a time, every naptime).
    std::thread::sleep(Duration::from_secs(15));
    cluster.psql("CREATE DATABASE victim");
    cluster.use_database("victim");
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 200));
    let (index, task) = start_task(&cluster, &meili, None, "products", json!({}));
    cluster.wait_snapshot_done(task, Duration::from_secs(60));
    cluster.psql("DELETE FROM products WHERE id <= 10");
    wait_index_matches_table(&cluster, &meili, &index, "products", CONVERGE);
}

#[test]
fn a_database_waits_for_a_place_with_a_warning_and_a_reason_then_streams() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&["meili_sync.max_databases=1"]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 100));
    let (_, first) = start_task(&cluster, &meili, None, "products", json!({}));
    cluster.wait_snapshot_done(first, CONVERGE);
    cluster.psql("CREATE DATABASE second");
    cluster.use_database("second");
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 100));
    let (index, waiting) = start_task(&cluster, &meili, None, "products", json!({}));
    let status = wait_for("the waiting task to say why", CONVERGE, || {
        let status = cluster.status(waiting);
        status
            .get("last_error")
            .is_some_and(|error| error.contains("waiting for a place"))
            .then_some(status)
    });
    assert_eq!(status.get("state").map(String::as_str), Some("starting"));
    assert!(
        status["last_error"].contains("meili_sync.max_databases is 1"),
        "{status:?}"
    );
    assert!(
        cluster
            .server_log()
            .contains("WARNING:  pg_meili_sync: the tasks of database \"second\" wait"),
        "{}",
        cluster.tail_log()
    );
    // Once the first database has no task left, its place goes to the second.
    cluster.use_database("postgres");
    cluster.psql(&format!("SELECT meili_sync_drop({first})"));
    cluster.use_database("second");
    cluster.wait_snapshot_done(waiting, CONVERGE);
    wait_index_matches_table(&cluster, &meili, &index, "products", CONVERGE);
    let status = cluster.status(waiting);
    assert_eq!(
        status.get("last_error").map(String::as_str),
        Some("null"),
        "{status:?}"
    );
}

#[test]
fn an_errors_text_is_shown_only_as_the_one_rule_allows() {
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql("CREATE TABLE payroll (id bigint PRIMARY KEY, ssn text)");
    cluster.psql("INSERT INTO payroll VALUES (1, 'SSN-123-45-6789')");
    // A server that is not there: the worker retries, and its live error is in shared memory.
    let task: i64 = cluster
        .psql("SELECT meili_sync_start('payroll', 'payroll', '{\"url\": \"http://127.0.0.1:9\"}')")
        .parse()
        .expect("task id");
    cluster.psql("CREATE ROLE watcher LOGIN IN ROLE pg_monitor");
    cluster.psql("CREATE ROLE reader LOGIN IN ROLE pg_monitor");
    cluster.psql("GRANT SELECT ON payroll TO reader");
    cluster.psql("CREATE ROLE admin LOGIN IN ROLE meili_sync_admin");
    let live_error = wait_for("the worker's live error", CONVERGE, || {
        let error = cluster.psql(&format!(
            "SELECT last_error FROM meili_sync_worker_state() WHERE task = {task}"
        ));
        (!error.is_empty()).then_some(error)
    });
    assert!(!live_error.starts_with("hidden"), "{live_error}");
    let hidden = "hidden: reading this task's errors needs SELECT on its table or view, or membership in meili_sync_admin";
    for (role, sees) in [
        ("watcher", hidden),
        ("reader", live_error.as_str()),
        ("admin", live_error.as_str()),
    ] {
        for query in [
            format!("SELECT last_error FROM meili_sync_worker_state() WHERE task = {task}"),
            format!("SELECT last_error FROM meili_sync_status WHERE task = {task}"),
        ] {
            // The live error can change (a retry's count); what matters is hidden or not.
            let shown = cluster.psql(&format!("SET ROLE {role}; {query}"));
            assert_eq!(
                shown == hidden,
                sees == hidden,
                "{role} through {query}: {shown}"
            );
        }
    }
    // A stopped task's catalog error, which quotes a row's value, goes by the same rule.
    cluster.psql(&format!("SELECT meili_sync_pause({task})"));
    cluster.psql(&format!(
        "UPDATE meili_sync.tasks SET state = 'error', last_error = 'invalid input syntax for type integer: \"SSN-123-45-6789\"' WHERE id = {task}"
    ));
    for (role, shows_value) in [("watcher", false), ("reader", true), ("admin", true)] {
        for query in [
            format!("SELECT coalesce(last_error, '') FROM meili_sync_worker_state() WHERE task = {task}"),
            format!("SELECT last_error FROM meili_sync_status WHERE task = {task}"),
        ] {
            let shown = cluster.psql(&format!("SET ROLE {role}; {query}"));
            assert!(
                !shown.contains("SSN-") || shows_value,
                "{role} read a row's value through {query}: {shown}"
            );
        }
        let status = cluster.psql(&format!(
            "SET ROLE {role}; SELECT last_error FROM meili_sync_status WHERE task = {task}"
        ));
        assert_eq!(
            status.contains("SSN-123-45-6789"),
            shows_value,
            "{role}: {status}"
        );
    }
}

#[test]
fn an_admin_role_made_by_someone_else_before_the_extension_is_never_taken() {
    let cluster = Cluster::start(&[]);
    let version: u32 = cluster
        .psql("SHOW server_version_num")
        .parse()
        .expect("server_version_num");
    cluster.psql("CREATE ROLE mallory LOGIN CREATEROLE");
    // A role mallory can log in as.
    cluster.psql("SET ROLE mallory; CREATE ROLE meili_sync_admin LOGIN PASSWORD 'known'");
    let refused = pg_meili_sync_e2e::refusal(&cluster, "CREATE EXTENSION pg_meili_sync");
    assert_eq!(refused.sqlstate, "55000", "{refused:?}");
    assert!(refused.message.contains("it can log in"), "{refused:?}");
    assert!(
        refused.hint.contains("DROP ROLE meili_sync_admin"),
        "{refused:?}"
    );
    assert_eq!(
        cluster.psql("SELECT count(*) FROM pg_namespace WHERE nspname = 'meili_sync'"),
        "0",
        "nothing is left half-created"
    );
    // A role mallory let herself into (on 16 and later she also holds ADMIN OPTION on it).
    cluster.psql("DROP ROLE meili_sync_admin");
    cluster.psql("SET ROLE mallory; CREATE ROLE meili_sync_admin NOLOGIN");
    cluster.psql("SET ROLE mallory; GRANT meili_sync_admin TO mallory");
    let refused = pg_meili_sync_e2e::refusal(&cluster, "CREATE EXTENSION pg_meili_sync");
    assert_eq!(refused.sqlstate, "55000", "{refused:?}");
    assert!(
        refused
            .message
            .contains("role mallory was made a member of it by role mallory"),
        "{refused:?}"
    );
    if version >= 160000 {
        assert!(
            refused
                .message
                .contains("role mallory, which is not a superuser, holds ADMIN OPTION on it"),
            "{refused:?}"
        );
    }
    // Made by the extension: mallory can neither let herself in nor read a key.
    cluster.psql("DROP ROLE meili_sync_admin");
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    if version >= 160000 {
        let refused = pg_meili_sync_e2e::refusal(
            &cluster,
            "SET ROLE mallory; GRANT meili_sync_admin TO mallory",
        );
        assert_eq!(refused.sqlstate, "42501", "{refused:?}");
    }
    let refused = pg_meili_sync_e2e::refusal(
        &cluster,
        "SET ROLE mallory; SELECT api_key FROM meili_sync.task_secrets",
    );
    assert_eq!(refused.sqlstate, "42501", "{refused:?}");
    // A role the extension made in another database, with members a superuser granted, is taken.
    cluster.psql("CREATE ROLE alice LOGIN");
    cluster.psql("GRANT meili_sync_admin TO alice");
    cluster.psql("CREATE DATABASE other");
    cluster.use_database("other");
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    assert_eq!(
        cluster.psql(
            "SELECT extversion IS NOT NULL FROM pg_extension WHERE extname = 'pg_meili_sync'"
        ),
        "t"
    );
}

/// Views whose rows depend on the reader one function (or more) deeper than the view: a view
/// task renders as the view's owner, so each would hand every searcher the owner's rows.
const READER_VIEWS: &str = r#"
CREATE ROLE view_owner IN ROLE meili_sync_admin;
CREATE ROLE ops IN ROLE meili_sync_admin;
GRANT CREATE ON SCHEMA public TO view_owner;
SET ROLE view_owner;
CREATE TABLE public.docs (id int PRIMARY KEY, body text, tenant text);
INSERT INTO public.docs SELECT g, 'doc ' || g, CASE WHEN g % 2 = 0 THEN 'ops' ELSE 'view_owner' END
  FROM generate_series(1, 10) g;
-- A function that calls another that reads current_user.
CREATE FUNCTION public.who() RETURNS text LANGUAGE sql STABLE AS 'SELECT current_user::text';
CREATE FUNCTION public.whose() RETURNS text LANGUAGE sql STABLE AS 'SELECT public.who()';
CREATE VIEW public.two_deep AS SELECT id, body FROM public.docs WHERE tenant = public.whose();
-- A function whose body is SELECT USER.
CREATE FUNCTION public.plain_user() RETURNS text LANGUAGE sql STABLE AS 'SELECT USER';
CREATE VIEW public.by_user AS SELECT id, body FROM public.docs WHERE tenant = public.plain_user();
-- PL/pgSQL reading a setting through dynamic SQL.
CREATE FUNCTION public.tenant() RETURNS text LANGUAGE plpgsql STABLE AS $$
DECLARE t text;
BEGIN
    EXECUTE 'SELECT pg_catalog.current_setting(''app.tenant'', true)' INTO t;
    RETURN coalesce(nullif(t, ''), 'view_owner');
END $$;
CREATE VIEW public.by_setting AS SELECT id, body FROM public.docs WHERE tenant = public.tenant();
-- Three deep through a BEGIN ATOMIC body and an operator of the owner's.
CREATE FUNCTION public.tenant_eq(text, text) RETURNS boolean LANGUAGE sql STABLE
    AS $$ SELECT $1 = pg_catalog.current_setting('app.tenant', true) $$;
CREATE OPERATOR public.=~= (LEFTARG = text, RIGHTARG = text, FUNCTION = public.tenant_eq);
CREATE FUNCTION public.visible(t text) RETURNS boolean LANGUAGE sql STABLE
    BEGIN ATOMIC SELECT t OPERATOR(public.=~=) 'x'; END;
CREATE VIEW public.by_operator AS SELECT id, body FROM public.docs WHERE public.visible(tenant);
-- An aggregate whose transition function reads the role, and an argument's default that does.
CREATE FUNCTION public.pick(state text, value text) RETURNS text LANGUAGE sql STABLE
    AS 'SELECT value || SESSION_USER';
CREATE AGGREGATE public.picked(text) (SFUNC = public.pick, STYPE = text);
CREATE VIEW public.by_aggregate AS
SELECT d.id, (SELECT public.picked(e.body) FROM public.docs e WHERE e.id = d.id) AS body FROM public.docs d;
CREATE FUNCTION public.stamp(body text, who text DEFAULT current_user) RETURNS text LANGUAGE sql
    IMMUTABLE AS 'SELECT body || who';
CREATE VIEW public.by_default AS SELECT id, public.stamp(body) AS body FROM public.docs;
-- A system view that shows the session's settings, and a name PostgreSQL cuts to 63 bytes.
CREATE FUNCTION public.app_name() RETURNS text LANGUAGE sql STABLE
    AS 'SELECT s.setting FROM pg_catalog.pg_settings s WHERE s.name = ''application_name''';
CREATE VIEW public.by_settings AS SELECT id, body FROM public.docs WHERE tenant = public.app_name();
CREATE FUNCTION public.aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa() RETURNS text LANGUAGE sql STABLE AS 'SELECT current_user::text';
CREATE FUNCTION public.long_caller() RETURNS text LANGUAGE sql STABLE
    AS 'SELECT public.aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa_and_more()';
CREATE VIEW public.by_long_name AS SELECT id, body FROM public.docs WHERE tenant = public.long_caller();
-- Attribute notation: d.owner_of calls public.owner_of(d).
CREATE FUNCTION public.owner_of(d public.docs) RETURNS text LANGUAGE sql STABLE AS 'SELECT current_user::text';
CREATE FUNCTION public.via_attribute(d public.docs) RETURNS text LANGUAGE sql STABLE AS 'SELECT d.owner_of';
CREATE VIEW public.by_attribute AS SELECT d.id, d.body FROM public.docs d WHERE d.tenant = public.via_attribute(d);
-- An operator whose negator reads the role: the planner turns NOT (a === b) into a !== b.
CREATE FUNCTION public.same(text, text) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT $1 = $2';
CREATE FUNCTION public.not_mine(text, text) RETURNS boolean LANGUAGE sql STABLE AS 'SELECT $1 <> current_user';
CREATE OPERATOR public.!== (LEFTARG = text, RIGHTARG = text, FUNCTION = public.not_mine);
CREATE OPERATOR public.=== (LEFTARG = text, RIGHTARG = text, FUNCTION = public.same, NEGATOR = OPERATOR(public.!==));
CREATE VIEW public.by_negator AS SELECT id, body FROM public.docs WHERE NOT (tenant OPERATOR(public.===) 'x');
-- A table whose row security policy reads the role (current_user there is the reader).
CREATE TABLE public.secrets (id int PRIMARY KEY, body text, tenant text);
ALTER TABLE public.secrets ENABLE ROW LEVEL SECURITY, FORCE ROW LEVEL SECURITY;
CREATE POLICY mine ON public.secrets USING (tenant = current_user);
CREATE VIEW public.by_policy AS SELECT id, body FROM public.secrets;
-- A function that writes: a trigger and a column default of the table it writes read the role.
CREATE TABLE public.visits (id int, who text);
CREATE FUNCTION public.stamp_who() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN NEW.who := current_user; RETURN NEW; END $$;
CREATE TRIGGER stamp BEFORE INSERT ON public.visits FOR EACH ROW EXECUTE FUNCTION public.stamp_who();
CREATE FUNCTION public.visit(i int) RETURNS text LANGUAGE sql VOLATILE AS 'INSERT INTO public.visits (id) VALUES (i) RETURNING who';
CREATE VIEW public.by_trigger AS SELECT id, public.visit(id) AS body FROM public.docs;
CREATE TABLE public.marks (id int, who text DEFAULT current_user);
CREATE FUNCTION public.mark(i int) RETURNS text LANGUAGE plpgsql VOLATILE
    AS $$ DECLARE w text; BEGIN INSERT INTO public.marks (id) VALUES (i) RETURNING who INTO w; RETURN w; END $$;
CREATE VIEW public.by_write_default AS SELECT id, public.mark(id) AS body FROM public.docs;
-- A domain whose CHECK constraint reads the role.
CREATE DOMAIN public.own_text AS text CHECK (VALUE <> current_user);
CREATE VIEW public.by_domain AS SELECT id, body::public.own_text AS body FROM public.docs;
-- Harmless: functions that read data only, two deep.
CREATE FUNCTION public.shout(t text) RETURNS text LANGUAGE sql IMMUTABLE AS 'SELECT pg_catalog.upper(t)';
CREATE FUNCTION public.headline(t text) RETURNS text LANGUAGE plpgsql STABLE
    AS $$ BEGIN RETURN public.shout(t) || '!'; END $$;
CREATE VIEW public.headlines AS SELECT id, public.headline(body) AS body FROM public.docs;
GRANT SELECT ON public.two_deep, public.by_user, public.by_setting, public.by_operator,
                public.by_aggregate, public.by_default, public.by_settings, public.by_long_name,
                public.by_attribute, public.by_negator, public.by_policy, public.by_trigger,
                public.by_write_default, public.by_domain, public.headlines TO ops;
RESET ROLE;
"#;

#[test]
fn views_that_reach_the_reader_through_functions_at_any_depth_are_refused() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql_script(READER_VIEWS);
    let views = [
        (
            "two_deep",
            "calls public.whose(), which calls public.who(), which uses CURRENT_USER",
        ),
        ("by_user", "calls public.plain_user(), which uses USER"),
        (
            "by_operator",
            "calls public.visible(text), which calls public.tenant_eq(text,text), which calls current_setting(",
        ),
        (
            "by_setting",
            "calls public.tenant(), which cannot be followed: it runs SQL built at run time (EXECUTE)",
        ),
        (
            "by_aggregate",
            "calls public.picked(text), which calls public.pick(text,text), which uses SESSION_USER",
        ),
        ("by_default", "calls public.stamp(text,text) (an argument's default), which"),
        ("by_settings", "calls pg_show_all_settings()"),
        (
            "by_long_name",
            "calls public.long_caller(), which calls public.aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa(), which uses CURRENT_USER",
        ),
        (
            "by_attribute",
            "which calls public.owner_of(public.docs), which uses CURRENT_USER",
        ),
        (
            "by_negator",
            "view public.by_negator calls public.not_mine(text,text), which uses CURRENT_USER",
        ),
        (
            "by_policy",
            "view public.by_policy meets policy mine on public.secrets, which uses CURRENT_USER",
        ),
        (
            "by_trigger",
            "calls public.visit(integer), which sets off trigger stamp on public.visits, which calls public.stamp_who(), which uses CURRENT_USER",
        ),
        (
            "by_write_default",
            "calls public.mark(integer), which meets the default of column who of public.marks, which uses CURRENT_USER",
        ),
        (
            "by_domain",
            "view public.by_domain meets constraint own_text_check of domain public.own_text, which uses CURRENT_USER",
        ),
    ];
    let refusals = refused_views(&cluster, &meili, &views, &["postgres", "ops"]);
    assert!(
        refusals
            .iter()
            .any(|refused| refused.hint.contains("\"reader_independent\": true")),
        "the hint for what cannot be followed names the declaration"
    );
    let options = meili.options(json!({"primary_key": "id"}));
    // Only the view's owner may declare it reader-independent.
    let declared = meili.options(json!({"primary_key": "id", "reader_independent": true}));
    let index = meili.unique_index("reader");
    let refused = refusal(
        &cluster,
        &format!("SET ROLE ops; SELECT meili_sync_start('by_setting', '{index}', '{declared}')"),
    );
    assert_eq!(refused.sqlstate, "42501", "{}", refused.stderr);
    assert!(
        refused.message.contains("reader_independent"),
        "{}",
        refused.message
    );
    assert_eq!(
        cluster.psql("SELECT count(*) FROM meili_sync.tasks"),
        "0",
        "nothing was started"
    );
    // The owner's declaration stands in for the check: the view syncs, as its owner reads it.
    let task: i64 = cluster
        .psql(&format!(
            "SET ROLE view_owner; SELECT meili_sync_start('by_setting', '{index}', '{declared}')"
        ))
        .parse()
        .expect("task id");
    cluster.wait_snapshot_done(task, CONVERGE);
    wait_index_matches_table(&cluster, &meili, &index, "public.by_setting", CONVERGE);
    // A view that reads data only, through two functions, syncs; a function it reaches that is
    // replaced to read the role stops the task at its next render, before any document of it.
    let headlines = meili.unique_index("reader");
    let task: i64 = cluster
        .psql(&format!(
            "SET ROLE ops; SELECT meili_sync_start('headlines', '{headlines}', '{options}')"
        ))
        .parse()
        .expect("task id");
    cluster.wait_snapshot_done(task, CONVERGE);
    wait_index_matches_table(&cluster, &meili, &headlines, "public.headlines", CONVERGE);
    cluster.psql_script(
        "SET ROLE view_owner;
         CREATE OR REPLACE FUNCTION public.shout(t text) RETURNS text LANGUAGE sql IMMUTABLE
             AS 'SELECT pg_catalog.upper(t) || current_user';
         RESET ROLE;
         UPDATE public.docs SET body = 'changed' WHERE id = 1;",
    );
    let status = cluster.wait_error(task, CONVERGE);
    let error = status.get("last_error").cloned().unwrap_or_default();
    assert!(
        error.contains("depend on who reads it") && error.contains("public.shout(text)"),
        "{error}"
    );
    let rendered: Vec<String> = meili
        .all_documents(&headlines)
        .iter()
        .filter_map(|document| document["body"].as_str().map(str::to_owned))
        .collect();
    assert!(
        rendered
            .iter()
            .all(|body| !body.contains("VIEW_OWNER") && !body.contains("view_owner")),
        "{rendered:?}"
    );
    assert!(rendered.contains(&"DOC 1!".to_owned()), "{rendered:?}");
    // What PostgreSQL applies anywhere without its being written: an `=` of the owner's that
    // `IN` picks, and a cast to JSON. Each in a database of its own, as it reaches every view.
    for (database, script, view, what) in [
        (
            "reader_in",
            "CREATE TYPE public.tag AS (v text);
             CREATE FUNCTION public.tag_eq(public.tag, public.tag) RETURNS boolean LANGUAGE sql STABLE
                 AS 'SELECT ($1).v OPERATOR(pg_catalog.=) current_user';
             CREATE OPERATOR public.= (LEFTARG = public.tag, RIGHTARG = public.tag, FUNCTION = public.tag_eq);
             CREATE FUNCTION public.tagged(t public.tag) RETURNS boolean LANGUAGE sql STABLE
                 AS 'SELECT t IN (ROW(''x'')::public.tag)';
             CREATE VIEW public.by_in AS SELECT id, body FROM public.docs WHERE public.tagged(ROW(tenant)::public.tag);",
            "by_in",
            "calls public.tag_eq(public.tag,public.tag), which uses CURRENT_USER",
        ),
        (
            "reader_json",
            "CREATE TYPE public.tag AS (v text);
             CREATE FUNCTION public.tag_json(public.tag) RETURNS json LANGUAGE sql STABLE
                 AS 'SELECT pg_catalog.to_json(current_user::text)';
             CREATE CAST (public.tag AS json) WITH FUNCTION public.tag_json(public.tag);
             CREATE VIEW public.by_json_cast AS SELECT id, ROW(body)::public.tag AS body FROM public.docs;",
            "by_json_cast",
            "a cast PostgreSQL may apply without its being written (implicit, on assignment, or to JSON) calls public.tag_json(public.tag), which uses CURRENT_USER",
        ),
    ] {
        cluster.psql(&format!("CREATE DATABASE {database}"));
        cluster.use_database(database);
        cluster.psql_script(&format!(
            "CREATE EXTENSION pg_meili_sync;
             GRANT CREATE ON SCHEMA public TO view_owner;
             SET ROLE view_owner;
             CREATE TABLE public.docs (id int PRIMARY KEY, body text, tenant text);
             {script}
             RESET ROLE;"
        ));
        refused_views(&cluster, &meili, &[(view, what)], &["postgres"]);
    }
    assert_no_crash(&cluster);
}
