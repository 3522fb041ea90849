//! End to end: the trust boundary against code that table owners, view owners and
//! `meili_sync_admin` members plant. Each test attacks the way a review did, asserts that the
//! attack got nowhere (no superuser, no row read without the right, no setting that survives an
//! identity switch), and that the tasks that were not attacked still sync.

use std::collections::BTreeSet;
use std::time::Duration;

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{
    assert_no_crash, error_after_new_copy, refusal, refused_views, start_task, start_with_options,
    wait_for, wait_index_matches_table,
};
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(300);

/// The attacker's kit, owned by role `shop` (a table owner who is not superuser):
/// - `evil.escalate(what)` logs who runs it and, when that is a superuser, makes `shop` one;
/// - lookalikes of `=(bigint,bigint)`, `=(oid,oid)`, `=(text,text)` and `=(name,name)` in schema
///   `evil` that call it: any of our SQL that runs with `evil` first on its path falls in;
/// - `public.meddle(place)` logs who runs it, then tries to set `search_path` (to put `evil`
///   first), `role`, `session_authorization` and a custom setting, for the rest of the session.
///   It does nothing in the test's own `psql` sessions, so that only the extension's processes
///   and the victim's session are attacked.
const KIT: &str = r#"
CREATE TABLE public.meddle_log (place text, who name, superuser boolean, app text, backend_type text,
                                refused text);
GRANT SELECT, INSERT ON public.meddle_log TO PUBLIC;
CREATE TABLE public.trap_log (what text, who name, superuser boolean, app text, backend_type text);
GRANT SELECT, INSERT ON public.trap_log TO PUBLIC;
CREATE SCHEMA evil AUTHORIZATION shop;
SET ROLE shop;
CREATE FUNCTION evil.escalate(what text) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    super boolean := (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) current_user);
BEGIN
    INSERT INTO public.trap_log VALUES (what, current_user, super, pg_catalog.current_setting('application_name'),
        (SELECT a.backend_type FROM pg_catalog.pg_stat_activity a WHERE a.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()));
    IF super THEN
        EXECUTE 'ALTER ROLE shop SUPERUSER';
    END IF;
END $$;
CREATE FUNCTION evil.eq_bigint(bigint, bigint) RETURNS boolean LANGUAGE plpgsql AS
    $$ BEGIN PERFORM evil.escalate('=(bigint,bigint)'); RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
CREATE OPERATOR evil.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = evil.eq_bigint);
CREATE FUNCTION evil.eq_oid(oid, oid) RETURNS boolean LANGUAGE plpgsql AS
    $$ BEGIN PERFORM evil.escalate('=(oid,oid)'); RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
CREATE OPERATOR evil.= (LEFTARG = oid, RIGHTARG = oid, FUNCTION = evil.eq_oid);
CREATE FUNCTION evil.eq_text(text, text) RETURNS boolean LANGUAGE plpgsql AS
    $$ BEGIN PERFORM evil.escalate('=(text,text)'); RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.eq_text);
CREATE FUNCTION evil.eq_name(name, name) RETURNS boolean LANGUAGE plpgsql AS
    $$ BEGIN PERFORM evil.escalate('=(name,name)'); RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
CREATE OPERATOR evil.= (LEFTARG = name, RIGHTARG = name, FUNCTION = evil.eq_name);
CREATE FUNCTION public.meddle(place text) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    refused text := '';
BEGIN
    IF pg_catalog.current_setting('application_name') OPERATOR(pg_catalog.=) 'psql' THEN
        RETURN true;
    END IF;
    BEGIN
        PERFORM pg_catalog.set_config('role', 'postgres', false);
    EXCEPTION WHEN OTHERS THEN refused := refused OPERATOR(pg_catalog.||) 'role ';
    END;
    BEGIN
        PERFORM pg_catalog.set_config('session_authorization', 'postgres', false);
    EXCEPTION WHEN OTHERS THEN refused := refused OPERATOR(pg_catalog.||) 'session_authorization ';
    END;
    INSERT INTO public.meddle_log VALUES (place, current_user,
        (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) current_user),
        pg_catalog.current_setting('application_name'),
        (SELECT a.backend_type FROM pg_catalog.pg_stat_activity a WHERE a.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()),
        refused);
    PERFORM pg_catalog.set_config('search_path', 'evil, pg_catalog', false);
    PERFORM pg_catalog.set_config('meddle.planted', 'yes', false);
    RETURN true;
END $$;
CREATE FUNCTION public.meddle_text(place text, value text) RETURNS text LANGUAGE sql AS
    $$ SELECT CASE WHEN public.meddle(place) THEN value END $$;
CREATE FUNCTION public.meddle_eq(text, text) RETURNS boolean LANGUAGE sql AS
    $$ SELECT public.meddle('operator') AND $1 OPERATOR(pg_catalog.=) $2 $$;
CREATE OPERATOR public.=== (LEFTARG = text, RIGHTARG = text, FUNCTION = public.meddle_eq);
CREATE TYPE public.label AS (value text);
CREATE FUNCTION public.to_label(text) RETURNS public.label LANGUAGE sql AS
    $$ SELECT CASE WHEN public.meddle('cast') THEN ROW($1)::public.label END $$;
CREATE CAST (text AS public.label) WITH FUNCTION public.to_label(text);
CREATE FUNCTION public.item_id_ok(bigint) RETURNS boolean LANGUAGE sql AS
    $$ SELECT public.meddle('domain check') AND $1 OPERATOR(pg_catalog.>) 0 $$;
CREATE DOMAIN public.item_id AS bigint CHECK (public.item_id_ok(VALUE));
CREATE TABLE public.items (id public.item_id PRIMARY KEY, name text NOT NULL, _geo jsonb);
ALTER TABLE public.items ENABLE ROW LEVEL SECURITY;
ALTER TABLE public.items FORCE ROW LEVEL SECURITY;
CREATE POLICY everyone ON public.items USING (public.meddle('policy') AND name OPERATOR(public.===) name);
CREATE VIEW public.item_docs AS
SELECT i.id, public.meddle_text('view function', i.name) AS name, (i.name::public.label).value AS label
  FROM public.items i;
RESET ROLE;
"#;

/// The places whose code ran in `backend_type`, from the meddling log.
fn places_in(cluster: &Cluster, backend_type: &str) -> BTreeSet<String> {
    cluster
        .psql(&format!(
            "SELECT DISTINCT place FROM public.meddle_log WHERE backend_type = '{backend_type}' ORDER BY 1"
        ))
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Runs `sql` in a session named `victim` as superuser, then reads that session's settings:
/// search_path, the custom setting, the role and the session user.
fn as_victim(cluster: &Cluster, label: &str, sql: &str) -> String {
    let out = cluster.psql(&format!(
        "SET application_name = 'victim {label}'; {sql}; SELECT pg_catalog.concat_ws('|', pg_catalog.current_setting('search_path'), coalesce(pg_catalog.current_setting('meddle.planted', true), ''), current_user, session_user, pg_catalog.current_setting('role'))"
    ));
    out.lines().last().unwrap_or_default().to_owned()
}

/// What the owner's code planted on `places` ran during the victim's call `label`.
fn places_during(cluster: &Cluster, label: &str) -> BTreeSet<String> {
    cluster
        .psql(&format!(
            "SELECT DISTINCT place FROM public.meddle_log WHERE app = 'victim {label}' ORDER BY 1"
        ))
        .lines()
        .map(str::to_owned)
        .collect()
}

/// A cluster with the extension and `script` run (each statement its own transaction), and a
/// Meilisearch.
fn with_schema(script: &str) -> (Meili, Cluster) {
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql_script(script);
    (Meili::from_env(), cluster)
}

#[test]
fn settings_that_user_code_changes_never_outlive_the_identity_switch() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(
        "CREATE ROLE shop LOGIN IN ROLE pg_read_all_stats; GRANT CREATE ON SCHEMA public TO shop;
         CREATE ROLE ops IN ROLE meili_sync_admin, pg_read_all_stats, shop",
    );
    cluster.psql_script(KIT);
    cluster.psql(
        "GRANT SELECT ON public.items, public.item_docs TO ops;
         INSERT INTO public.items SELECT g, 'item ' || g, NULL FROM generate_series(1, 300) g",
    );
    let baseline = cluster.psql(
        "SELECT pg_catalog.concat_ws('|', pg_catalog.current_setting('search_path'), '', current_user, session_user, pg_catalog.current_setting('role'))",
    );
    // A table task (its copy reads through the policy, its operator and the domain's casts), and
    // a view task (the view's function and cast, the base table's policy) with an admin's mapping
    // query that calls the meddling function too. The meddling function reads the role, so the
    // view is declared reader-independent by ops, which has its owner's privileges.
    let (table_index, table_task) = start_task(
        &cluster,
        &meili,
        Some("ops"),
        "items",
        json!({"batch_size": 100}),
    );
    let (view_index, view_task) = start_task(
        &cluster,
        &meili,
        Some("ops"),
        "item_docs",
        json!({"primary_key": "id", "reader_independent": true, "mappings": {"items":
            "SELECT k::bigint FROM pg_catalog.unnest($1::text[]) k WHERE public.meddle('mapping')"}}),
    );
    cluster.wait_snapshot_done(table_task, CONVERGE);
    cluster.wait_snapshot_done(view_task, CONVERGE);
    // Streaming: the view task renders the changed rows (view, cast, policy, mapping).
    cluster.psql(
        "INSERT INTO public.items SELECT g, 'item ' || g, NULL FROM generate_series(301, 350) g",
    );
    cluster
        .psql("UPDATE public.items SET name = name || ' v2' WHERE id OPERATOR(pg_catalog.<=) 20");
    cluster.psql("DELETE FROM public.items WHERE id OPERATOR(pg_catalog.>) 340");
    // A dead letter for the resend: a _geo Meilisearch refuses.
    cluster.psql(r#"UPDATE public.items SET _geo = '"nowhere"' WHERE id = 7"#);
    wait_index_matches_table(&cluster, &meili, &view_index, "public.item_docs", CONVERGE);
    wait_for("row 7 as a dead letter", CONVERGE, || {
        (cluster.psql(&format!(
            "SELECT count(*) FROM meili_sync_dead_letters WHERE task = {table_task} AND document_id = '7'"
        )) == "1")
            .then_some(())
    });
    cluster.psql(r#"UPDATE public.items SET _geo = NULL WHERE id = 7"#);
    cluster.psql(&format!("SELECT meili_sync_pause({table_task})"));

    // In the victim's own session: each function that runs the owner's code leaves it as it was,
    // and each ran the vehicles it reads through (search runs none of the owner's code).
    let table_reads = ["domain check", "operator", "policy"];
    let view_reads = ["cast", "operator", "policy", "view function"];
    for (label, sql, expected) in [
        (
            "verify table",
            format!("SELECT * FROM meili_sync_verify({table_task})"),
            &table_reads[..],
        ),
        (
            "repair table",
            format!("SELECT * FROM meili_sync_repair({table_task})"),
            &table_reads[..2],
        ),
        (
            "verify view",
            format!("SELECT * FROM meili_sync_verify({view_task})"),
            &view_reads[..],
        ),
        (
            "repair view",
            format!("SELECT * FROM meili_sync_repair({view_task})"),
            &view_reads[..],
        ),
        (
            "resend",
            format!("SELECT meili_sync_retry_dead_letters({table_task})"),
            &table_reads[1..],
        ),
        (
            "preview table",
            "SELECT * FROM meili_sync_preview('public.items', '{}', 5)".to_owned(),
            &table_reads[1..],
        ),
        (
            "preview view",
            "SELECT * FROM meili_sync_preview('public.item_docs', '{\"primary_key\": \"id\", \"reader_independent\": true}', 5)"
                .to_owned(),
            &view_reads[..],
        ),
        (
            "search table",
            format!("SELECT count(*) FROM meili_search({table_task}, 'item')"),
            &[][..],
        ),
        (
            "search view",
            format!("SELECT count(*) FROM meili_search({view_task}, 'item')"),
            &[][..],
        ),
    ] {
        assert_eq!(
            as_victim(&cluster, label, &sql),
            baseline,
            "{sql} left the session changed"
        );
        let ran = places_during(&cluster, label);
        for place in expected {
            assert!(
                ran.contains(*place),
                "{label} did not run the {place}: {ran:?}"
            );
        }
    }
    cluster.psql(&format!("SELECT meili_sync_resume({table_task})"));
    cluster.psql("UPDATE public.items SET name = name || ' v3' WHERE id OPERATOR(pg_catalog.<=) 5");
    wait_index_matches_table(&cluster, &meili, &table_index, "public.items", CONVERGE);
    wait_index_matches_table(&cluster, &meili, &view_index, "public.item_docs", CONVERGE);

    // The attack reached every place (so this test can fail) ... The copies run in the task
    // workers; the view task's renders (view, cast, policy, mapping), in the shared decoder.
    let mut in_workers = places_in(&cluster, "pg_meili_sync task");
    in_workers.extend(places_in(&cluster, "pg_meili_sync shared decoder"));
    assert!(
        places_in(&cluster, "pg_meili_sync shared decoder").contains("mapping"),
        "the shared decoder never rendered the view task"
    );
    for place in [
        "policy",
        "operator",
        "domain check",
        "view function",
        "cast",
        "mapping",
    ] {
        assert!(
            in_workers.contains(place),
            "the workers never ran the {place}: {in_workers:?}"
        );
    }
    let in_backend = places_in(&cluster, "client backend");
    assert!(
        places_during(&cluster, "search table").is_empty(),
        "a search runs none of the owner's code"
    );
    for place in [
        "policy",
        "operator",
        "domain check",
        "view function",
        "cast",
    ] {
        assert!(
            in_backend.contains(place),
            "the victim's functions never ran the {place}: {in_backend:?}"
        );
    }
    // ... always as the owner (or the admin, for its mapping), never as superuser, and neither
    // role nor session_authorization could be set ...
    assert_eq!(
        cluster.psql(
            "SELECT string_agg(DISTINCT who || ':' || superuser || ':' || rtrim(refused), ',' ORDER BY who || ':' || superuser || ':' || rtrim(refused))
               FROM public.meddle_log"
        ),
        "ops:false:role session_authorization,shop:false:role session_authorization"
    );
    // ... and the planted search_path never reached our own SQL as superuser.
    assert_eq!(
        cluster.psql(
            "SELECT coalesce(string_agg(DISTINCT what || ' in ' || coalesce(backend_type, '?'), '; '), '') FROM public.trap_log WHERE superuser"
        ),
        ""
    );
    assert_eq!(
        cluster.psql("SELECT string_agg(rolname || ':' || rolsuper, ',' ORDER BY rolname) FROM pg_roles WHERE rolname IN ('shop', 'ops')"),
        "ops:false,shop:false"
    );
    assert_no_crash(&cluster);
}

#[test]
fn a_resync_helper_acts_as_the_task_owner_not_as_whoever_resyncs() {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql("CREATE ROLE ops IN ROLE meili_sync_admin");
    cluster.psql_script(
        r#"CREATE TABLE public.who_ran (who name, superuser boolean);
        GRANT INSERT ON public.who_ran TO PUBLIC;
        CREATE TABLE public.products (id bigint PRIMARY KEY, name text);
        CREATE TABLE public.notes (id bigint PRIMARY KEY, product_id bigint, body text);
        CREATE VIEW public.product_notes AS
        SELECT p.id, p.name, (SELECT count(*) FROM public.notes n WHERE n.product_id OPERATOR(pg_catalog.=) p.id) AS notes
          FROM public.products p;
        -- The admin's mapping: it becomes superuser if it ever runs as one.
        CREATE FUNCTION public.note_owner_hook() RETURNS boolean LANGUAGE plpgsql AS $$
        DECLARE super boolean := (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) current_user);
        BEGIN
            INSERT INTO public.who_ran VALUES (current_user, super);
            IF super THEN EXECUTE 'ALTER ROLE ops SUPERUSER'; END IF;
            RETURN true;
        END $$;
        GRANT SELECT ON public.products, public.notes, public.product_notes TO ops;
        INSERT INTO public.products SELECT g, 'product ' || g FROM generate_series(1, 200) g;"#,
    );
    let index = meili.unique_index("resync_owner");
    let options = meili.options(json!({"primary_key": "id", "mappings": {"notes":
        "SELECT n.product_id FROM public.notes n WHERE public.note_owner_hook() AND n.id OPERATOR(pg_catalog.=) ANY ($1::bigint[])"}}));
    let task = start_with_options(&cluster, Some("ops"), "product_notes", &index, &options);
    cluster.wait_snapshot_done(task, CONVERGE);
    // A superuser resyncs; notes keep changing, so both the task and the helper run the mapping.
    let helper = cluster.psql(&format!("SELECT meili_sync_resync({task})"));
    assert_eq!(
        cluster.psql(&format!(
            "SELECT owner FROM meili_sync.tasks WHERE id = {helper}"
        )),
        "ops",
        "the helper acts for the task's owner"
    );
    for round in 0..40 {
        cluster.psql(&format!(
            "INSERT INTO public.notes VALUES ({round}, {}, 'note')",
            round % 200 + 1
        ));
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_for("the resync to finish", CONVERGE, || {
        (cluster.psql(&format!(
            "SELECT count(*) FROM meili_sync.tasks WHERE id = {helper}"
        )) == "0")
            .then_some(())
    });
    cluster.psql("INSERT INTO public.notes VALUES (1000, 3, 'after')");
    wait_index_matches_table(&cluster, &meili, &index, "public.product_notes", CONVERGE);
    assert_eq!(
        cluster
            .psql("SELECT string_agg(DISTINCT who || ':' || superuser, ',') FROM public.who_ran"),
        "ops:false",
        "the mapping ran as its author only"
    );
    assert_eq!(
        cluster.psql("SELECT rolsuper FROM pg_roles WHERE rolname = 'ops'"),
        "f"
    );
    assert_no_crash(&cluster);
}

#[test]
fn views_whose_rows_depend_on_who_reads_them_are_refused() {
    let (meili, cluster) = with_schema(
        r#"CREATE ROLE ops IN ROLE meili_sync_admin;
        CREATE ROLE shopper;
        CREATE SCHEMA hr;
        CREATE TABLE hr.salaries (id int PRIMARY KEY, name text, salary int, customer name);
        INSERT INTO hr.salaries VALUES (1, 'ann', 100000, 'ops'), (2, 'bob', 90000, 'shopper');
        CREATE VIEW public.salary_docs WITH (security_invoker = true) AS SELECT id, name, salary FROM hr.salaries;
        CREATE VIEW public.my_rows AS SELECT id, name FROM hr.salaries WHERE customer = current_user;
        CREATE VIEW public.my_rows_session AS SELECT id, name FROM hr.salaries WHERE customer = session_user;
        CREATE FUNCTION public.me() RETURNS name LANGUAGE sql STABLE AS 'SELECT current_user';
        CREATE VIEW public.my_rows_by_function AS SELECT id, name FROM hr.salaries WHERE customer = public.me();
        CREATE VIEW public.tenant_rows AS SELECT id, name FROM hr.salaries WHERE customer = current_setting('app.tenant')::name;
        CREATE VIEW public.privileged_rows AS SELECT id, name FROM hr.salaries WHERE has_table_privilege('hr.salaries', 'SELECT');
        CREATE VIEW public.inner_rows AS SELECT * FROM public.my_rows;
        CREATE VIEW public.plain_rows AS SELECT id, lower(name) AS name FROM hr.salaries;
        GRANT SELECT ON public.salary_docs, public.my_rows, public.my_rows_session, public.my_rows_by_function,
                        public.tenant_rows, public.privileged_rows, public.inner_rows, public.plain_rows TO ops, shopper;"#,
    );
    let views = [
        ("salary_docs", "it is security_invoker"),
        ("my_rows", "uses CURRENT_USER"),
        ("my_rows_session", "uses SESSION_USER"),
        (
            "my_rows_by_function",
            "calls public.me(), which uses CURRENT_USER",
        ),
        ("tenant_rows", "calls current_setting(text)"),
        ("privileged_rows", "calls has_table_privilege(text,text)"),
        ("inner_rows", "view public.my_rows uses CURRENT_USER"),
    ];
    let options = meili.options(json!({"primary_key": "id"}));
    for refused in refused_views(&cluster, &meili, &views, &["postgres", "ops"]) {
        assert!(
            refused.hint.contains("as the view's owner"),
            "{}",
            refused.hint
        );
    }
    assert_eq!(
        cluster.psql("SELECT count(*) FROM meili_sync.tasks"),
        "0",
        "nothing was created"
    );
    // A view that reads data only is served; made security_invoker later, it stops at the next
    // start of its worker, and nobody can search it by a role's rights it never checked.
    let index = meili.unique_index("plain");
    let task = start_with_options(&cluster, None, "plain_rows", &index, &options);
    cluster.wait_snapshot_done(task, CONVERGE);
    wait_index_matches_table(&cluster, &meili, &index, "public.plain_rows", CONVERGE);
    // A backend that searched through the task sees the change at once (in one transaction here,
    // so the ALTER is rolled back with the refusal).
    let search = format!("SET ROLE shopper; SELECT count(*) FROM meili_search({task}, 'ann')");
    let refused = refusal(
        &cluster,
        &format!(
            "{search}; RESET ROLE; ALTER VIEW public.plain_rows SET (security_invoker = true); {search}"
        ),
    );
    assert_eq!(refused.sqlstate, "0A000", "{}", refused.stderr);
    assert!(
        refused
            .message
            .contains(&format!("task {task} cannot be searched"))
            && refused.message.contains("security_invoker"),
        "{}",
        refused.message
    );
    assert_eq!(cluster.psql(&search).lines().last(), Some("1"));
    cluster.psql("ALTER VIEW public.plain_rows SET (security_invoker = true)");
    let refused = refusal(&cluster, &search);
    assert_eq!(refused.sqlstate, "0A000", "{}", refused.stderr);
    let error = error_after_new_copy(&cluster, task, CONVERGE);
    assert!(error.contains("security_invoker"), "{error}");
    assert_no_crash(&cluster);
}

#[test]
fn a_mapping_needs_select_on_the_table_whose_keys_it_receives() {
    let (meili, cluster) = with_schema(
        r#"CREATE ROLE ops IN ROLE meili_sync_admin;
        CREATE SCHEMA hr;
        GRANT USAGE ON SCHEMA hr TO ops;
        CREATE TABLE public.persons (id int PRIMARY KEY, name text);
        CREATE TABLE hr.ssn (ssn text PRIMARY KEY, person_id int REFERENCES public.persons);
        ALTER TABLE hr.ssn REPLICA IDENTITY FULL;
        CREATE VIEW public.people AS
        SELECT p.id, p.name, EXISTS (SELECT 1 FROM hr.ssn s WHERE s.person_id = p.id) AS registered
          FROM public.persons p;
        CREATE TABLE public.collected (value text);
        GRANT INSERT ON public.collected TO ops;
        GRANT SELECT ON public.people, public.persons TO ops;
        INSERT INTO public.persons SELECT g, 'person ' || g FROM generate_series(1, 20) g;"#,
    );
    // The admin may read the view (its owner reads hr.ssn), but not hr.ssn: a mapping declared
    // for hr.ssn would hand it every changed SSN.
    let index = meili.unique_index("mapping");
    let options = meili.options(json!({"primary_key": "id", "mappings": {"hr.ssn":
        "SELECT NULL::int FROM (SELECT 1) x WHERE false"}}));
    let refused = refusal(
        &cluster,
        &format!("SET ROLE ops; SELECT meili_sync_start('people', '{index}', '{options}')"),
    );
    assert_eq!(refused.sqlstate, "42501", "{}", refused.stderr);
    assert!(
        refused.message.contains("hr.ssn") && refused.message.contains("role ops may not read it"),
        "{}",
        refused.message
    );
    assert!(
        refused.hint.contains("GRANT SELECT ON hr.ssn TO ops"),
        "{}",
        refused.hint
    );
    assert_eq!(cluster.psql("SELECT count(*) FROM meili_sync.tasks"), "0");
    // Granted, the task runs; revoked, the worker refuses at its next start.
    cluster.psql("GRANT SELECT ON hr.ssn TO ops");
    let task = start_with_options(&cluster, Some("ops"), "people", &index, &options);
    cluster.wait_snapshot_done(task, CONVERGE);
    cluster.psql("REVOKE SELECT ON hr.ssn FROM ops");
    let error = error_after_new_copy(&cluster, task, CONVERGE);
    assert!(error.contains("GRANT SELECT ON hr.ssn TO ops"), "{error}");
    assert_no_crash(&cluster);
}

#[test]
fn a_dropped_table_fails_its_own_task_and_no_other() {
    let (meili, cluster) = with_schema(
        r#"CREATE TABLE public.doomed (id bigint PRIMARY KEY, name text);
        CREATE TABLE public.doomed_own (id bigint PRIMARY KEY, name text);
        CREATE TABLE public.kept (id bigint PRIMARY KEY, name text);
        INSERT INTO public.doomed SELECT g, 'd' || g FROM generate_series(1, 50) g;
        INSERT INTO public.doomed_own SELECT g, 'o' || g FROM generate_series(1, 50) g;
        INSERT INTO public.kept SELECT g, 'k' || g FROM generate_series(1, 50) g;"#,
    );
    let (_, doomed) = start_task(&cluster, &meili, None, "doomed", json!({}));
    let (_, doomed_own) = start_task(
        &cluster,
        &meili,
        None,
        "doomed_own",
        json!({"decoding": "own"}),
    );
    let (kept_index, kept) = start_task(&cluster, &meili, None, "kept", json!({}));
    for task in [doomed, doomed_own, kept] {
        cluster.wait_snapshot_done(task, CONVERGE);
    }
    cluster.psql("DROP TABLE public.doomed; DROP TABLE public.doomed_own");
    cluster.psql("INSERT INTO public.kept SELECT g, 'k' || g FROM generate_series(51, 80) g");
    for task in [doomed, doomed_own] {
        let status = cluster.wait_error(task, CONVERGE);
        let error = status.get("last_error").cloned().unwrap_or_default();
        assert!(
            error.contains("was dropped") && error.contains(&format!("meili_sync_drop({task})")),
            "task {task}: {error}"
        );
        wait_for("no process serving the task", CONVERGE, || {
            (cluster.status(task).get("worker_pid").map(String::as_str) == Some("null"))
                .then_some(())
        });
    }
    // An admin who is not superuser reads why, too.
    cluster.psql("CREATE ROLE ops IN ROLE meili_sync_admin");
    assert!(cluster
        .psql(&format!(
            "SET ROLE ops; SELECT last_error FROM meili_sync_status WHERE task = {doomed}"
        ))
        .contains("was dropped"));
    wait_index_matches_table(&cluster, &meili, &kept_index, "public.kept", CONVERGE);
    // The shared pass goes on, with one decoder: no crash loop.
    let decoder = cluster.psql(
        "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_meili_sync shared decoder'",
    );
    cluster.psql("UPDATE public.kept SET name = name || '!' WHERE id OPERATOR(pg_catalog.<=) 10");
    wait_index_matches_table(&cluster, &meili, &kept_index, "public.kept", CONVERGE);
    assert_eq!(
        cluster.psql(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_meili_sync shared decoder'"
        ),
        decoder
    );
    assert_eq!(
        cluster.status(kept).get("state").map(String::as_str),
        Some("streaming")
    );
    assert!(
        !cluster.server_log().contains("syntax error"),
        "{}",
        cluster.tail_log()
    );
    assert_no_crash(&cluster);
}

#[test]
fn a_database_that_is_not_utf8_is_refused_at_create_extension() {
    let cluster = Cluster::start(&[]);
    cluster.psql(
        "CREATE DATABASE latin TEMPLATE template0 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C'",
    );
    let output = cluster
        .client_command("psql")
        .args([
            "-X",
            "-v",
            "VERBOSITY=verbose",
            "-d",
            "latin",
            "-c",
            "CREATE EXTENSION pg_meili_sync",
        ])
        .output()
        .expect("run psql");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("0A000") && stderr.contains("needs a UTF8 database"),
        "{stderr}"
    );
    assert!(stderr.contains("ENCODING 'UTF8'"), "{stderr}");
    let leftovers = cluster
        .client_command("psql")
        .args([
            "-X",
            "-A",
            "-t",
            "-d",
            "latin",
            "-c",
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'meili_sync'",
        ])
        .output()
        .expect("run psql");
    assert_eq!(String::from_utf8_lossy(&leftovers.stdout).trim(), "0");
}

/// A view replaced to read a table it did not read is followed from then on, by a task of the
/// shared pass and by one with a slot of its own, without a stop: changes of the new table alone
/// reach the documents, and the documents of rows that did not change get the new field (the
/// task resyncs, since the changes of the new table before it was followed were not).
#[test]
fn a_replaced_view_that_reads_a_new_table_follows_it_and_brings_every_document_in_line() {
    let (meili, cluster) = with_schema(
        r#"CREATE TABLE public.products (id int PRIMARY KEY, name text);
        CREATE TABLE public.reviews (id int PRIMARY KEY, product_id int NOT NULL REFERENCES public.products, stars int);
        ALTER TABLE public.reviews REPLICA IDENTITY FULL;
        CREATE VIEW public.product_docs AS SELECT p.id, p.name FROM public.products p;
        INSERT INTO public.products SELECT g, 'product ' || g FROM generate_series(1, 100) g;"#,
    );
    let mut tasks = Vec::new();
    for decoding in ["shared", "own"] {
        let index = meili.unique_index(&format!("replaced_{decoding}"));
        let options = meili.options(json!({"primary_key": "id", "decoding": decoding}));
        let task = start_with_options(&cluster, None, "product_docs", &index, &options);
        cluster.wait_snapshot_done(task, CONVERGE);
        tasks.push((task, index));
    }
    cluster.psql("INSERT INTO public.reviews VALUES (1, 1, 5)");
    cluster.psql(
        "CREATE OR REPLACE VIEW public.product_docs AS
         SELECT p.id, p.name, (SELECT count(*) FROM public.reviews r WHERE r.product_id = p.id) AS reviews
           FROM public.products p",
    );
    // Writes to the new table alone, and to the old one, while the tasks catch up.
    for round in 0..5 {
        cluster.psql(&format!(
            "INSERT INTO public.reviews VALUES ({}, {}, 4)",
            10 + round,
            40 + round
        ));
    }
    cluster.psql("UPDATE public.products SET name = 'renamed' WHERE id = 2");
    // No error, and no resync left to do.
    let settled = |task: i64| {
        cluster.psql(&format!(
            "SELECT coalesce(last_error, '') || (SELECT count(*) FROM meili_sync.tasks WHERE resync_of = {task})
               FROM meili_sync_status WHERE task = {task}"
        ))
    };
    for (task, index) in &tasks {
        wait_index_matches_table(&cluster, &meili, index, "public.product_docs", CONVERGE);
        wait_for("the task in shape, its resync done", CONVERGE, || {
            (settled(*task) == "0").then_some(())
        });
    }
    // The new table alone changes: its changes are followed.
    cluster.psql("INSERT INTO public.reviews VALUES (2, 1, 4), (3, 50, 3)");
    cluster.psql("DELETE FROM public.reviews WHERE id = 10");
    for (task, index) in &tasks {
        wait_index_matches_table(&cluster, &meili, index, "public.product_docs", CONVERGE);
        let documents = meili.all_documents(index);
        let reviews_of = |id: i64| {
            documents
                .iter()
                .find(|document| document["id"] == json!(id))
                .map(|document| document["reviews"].clone())
        };
        assert_eq!(
            (
                reviews_of(1),
                reviews_of(40),
                reviews_of(50),
                reviews_of(99)
            ),
            (
                Some(json!(2)),
                Some(json!(0)),
                Some(json!(1)),
                Some(json!(0))
            ),
            "task {task}"
        );
        assert_eq!(
            cluster.psql(&format!(
                "SELECT state || ' ' || (missing + extra + different) FROM meili_sync_status, meili_sync_verify({task}) WHERE task = {task}"
            )),
            "streaming 0",
            "task {task}"
        );
    }
    assert!(
        cluster
            .server_log()
            .contains("now reads public.reviews, which the task follows from here on"),
        "{}",
        cluster.tail_log()
    );
    assert_no_crash(&cluster);
}

#[test]
fn a_terminated_wait_gives_its_place_back() {
    let (meili, cluster) = with_schema(
        r#"CREATE TABLE public.notes (id bigint PRIMARY KEY, body text);
        INSERT INTO public.notes SELECT g, 'note ' || g FROM generate_series(1, 10) g;
        CREATE ROLE reader LOGIN;
        GRANT SELECT ON public.notes TO reader;"#,
    );
    let index = meili.unique_index("waits");
    let options = meili.options(json!({}));
    let task = start_with_options(&cluster, None, "notes", &index, &options);
    cluster.wait_snapshot_done(task, CONVERGE);
    // A role that may only read the table waits for positions that will not come soon, several
    // times over, and terminates each wait: a FATAL that unwinds nothing.
    for _round in 0..3 {
        let waiters: Vec<_> = (0..6)
            .map(|_| {
                let mut command = cluster.psql_command();
                command.args([
                    "-c",
                    &format!("SET ROLE reader; SELECT meili_sync_wait({task}, 'FFFF/0', '5 min')"),
                ]);
                std::thread::spawn(move || command.output())
            })
            .collect();
        wait_for("six waiting backends", CONVERGE, || {
            (cluster.psql("SELECT count(*) FROM meili_sync_waits") == "6").then_some(())
        });
        assert_eq!(
            cluster.psql("SELECT count(DISTINCT task) FROM meili_sync_waits"),
            "1"
        );
        cluster.psql("SELECT pg_terminate_backend(pid) FROM meili_sync_waits");
        for waiter in waiters {
            let _ = waiter.join();
        }
        wait_for("every place freed", Duration::from_secs(10), || {
            (cluster.psql("SELECT count(*) FROM meili_sync_waits") == "0").then_some(())
        });
    }
    // A wait still works, woken by the confirmation.
    cluster.psql("INSERT INTO public.notes VALUES (11, 'late')");
    assert_eq!(
        cluster.psql(&format!(
            "SELECT meili_sync_wait({task}, pg_current_wal_lsn(), '60 s')"
        )),
        "t"
    );
    assert_no_crash(&cluster);
}
