//! End to end: searching from SQL. Hits, scores and facets come from the Meilisearch the task
//! fills and are checked against what the table says they must be; privileges are attacked (a
//! role without SELECT, a wrong search key, row-level security); a search stuck on a server that
//! never answers is cancelled by statement_timeout.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{assert_no_crash, products, refusal, wait_for, TaskStart};
use serde_json::{json, Value};

const CONVERGE: Duration = Duration::from_secs(300);
const ROWS: i64 = 400;

/// A cluster with `products` synced into an index where category and id filter and id sorts.
fn searchable(extra: Value) -> (Cluster, Meili, String, i64) {
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, ROWS));
    let meili = Meili::from_env();
    let mut options = json!({"settings": {
        "filterableAttributes": ["category", "id"],
        "sortableAttributes": ["id"],
    }});
    if let (Some(target), Some(source)) = (options.as_object_mut(), extra.as_object()) {
        for (name, value) in source {
            target.insert(name.clone(), value.clone());
        }
    }
    let (index, task) = TaskStart::on("products")
        .index_named("search")
        .options(options)
        .start_copied(&cluster, &meili, CONVERGE);
    wait_for("every row in the index", CONVERGE, || {
        (meili.document_count(&index) == Some(ROWS as u64)).then_some(())
    });
    (cluster, meili, index, task)
}

fn lines(text: &str) -> Vec<String> {
    text.lines().map(str::to_owned).collect()
}

#[test]
fn hits_facets_and_raw_answers_match_the_table() {
    let (cluster, meili, _index, task) = searchable(json!({}));
    // A filtered, sorted search: exactly the garden products under 50, in id order.
    let found = cluster.psql(&format!(
        "SELECT id FROM meili_search({task}, NULL, '{{\"filter\": \"category = garden AND id < 50\", \"sort\": [\"id:asc\"], \"limit\": 100}}')"
    ));
    let expected =
        cluster.psql("SELECT id FROM products WHERE category = 'garden' AND id < 50 ORDER BY id");
    assert_eq!(lines(&found), lines(&expected));
    assert!(lines(&found).len() > 5);
    // Joined back to the table through the key, with no string juggling beyond a cast.
    let joined = cluster.psql(&format!(
        "SELECT p.id || ':' || p.name || ':' || (s.document->>'name')
           FROM meili_search({task}, NULL, '{{\"filter\": \"id = 42\"}}') s
           JOIN products p ON p.id = s.key[1]::bigint"
    ));
    assert_eq!(joined, "42:Product 42:Product 42");
    // Every hit's document is its row's document, body for body (each built from the answer's
    // text as it is read), and its key is its id.
    let documents = cluster.psql(&format!(
        "SELECT id || '|' || key[1] || '|' || document::text FROM meili_search({task}, NULL, '{{\"sort\": [\"id:asc\"], \"limit\": {ROWS}}}')"
    ));
    let documents = lines(&documents);
    assert_eq!(documents.len(), ROWS as usize);
    for (line, expected_id) in documents.iter().zip(1..) {
        let mut fields = line.splitn(3, '|');
        let (id, key, document) = (fields.next(), fields.next(), fields.next());
        assert_eq!(id, Some(expected_id.to_string().as_str()), "{line}");
        assert_eq!(key, id, "{line}");
        let document: Value = serde_json::from_str(document.unwrap_or_default()).expect("jsonb");
        assert_eq!(
            document,
            products::expected_document(expected_id, 1),
            "{line}"
        );
    }
    // The same rows from a call in the select list, and from a call once per outer row.
    let listed = cluster.psql(&format!(
        "SELECT (meili_search({task}, NULL, '{{\"filter\": \"id = 42\"}}')).document->>'name'"
    ));
    assert_eq!(listed, "Product 42");
    let lateral = cluster.psql(&format!(
        "SELECT x || ':' || s.id FROM generate_series(41, 43) x,
                LATERAL meili_search({task}, NULL, pg_catalog.jsonb_build_object('filter', 'id = ' || x)) s
          ORDER BY x"
    ));
    assert_eq!(lines(&lateral), ["41:41", "42:42", "43:43"]);
    // Scores and highlights when asked for.
    let scored = cluster.psql(&format!(
        "SELECT (score IS NOT NULL AND score <= 1) || ',' || (formatted->>'name')
           FROM meili_search({task}, 'Product', '{{\"filter\": \"id = 7\", \"showRankingScore\": true, \"attributesToHighlight\": [\"name\"]}}')"
    ));
    let (score_ok, highlighted) = scored.split_once(',').unwrap_or_default();
    assert_eq!(score_ok, "true", "{scored}");
    assert_eq!(
        highlighted.replace("<em>", "").replace("</em>", ""),
        "Product 7",
        "{scored}"
    );
    if meili.test_server().is_none() {
        // The test server returns _formatted without highlighting; a real Meilisearch marks it.
        assert!(highlighted.contains("<em>"), "{scored}");
    }
    // Facets: the distribution of category equals the table's counts.
    let facets = cluster.psql(&format!(
        "SELECT facet || '=' || value || ':' || count FROM meili_facets({task}, NULL, ARRAY['category']) ORDER BY value"
    ));
    let counts = cluster.psql(
        "SELECT 'category=' || category || ':' || count(*) FROM products GROUP BY category ORDER BY category",
    );
    assert_eq!(lines(&facets), lines(&counts));
    // The raw answer, for what the functions do not cover.
    let total = cluster.psql(&format!(
        "SELECT meili_search_raw({task}, '{{\"q\": \"\", \"limit\": 1}}')->>'estimatedTotalHits'"
    ));
    assert_eq!(total, ROWS.to_string());
    // Meilisearch's refusal comes back with its own message and code.
    let refused = refusal(
        &cluster,
        &format!("SELECT * FROM meili_search({task}, 'x', '{{\"limit\": \"ten\"}}')"),
    );
    assert_eq!(refused.sqlstate, "22023", "{}", refused.stderr);
    assert!(
        refused.message.contains("invalid_search_limit"),
        "{}",
        refused.stderr
    );
    let refused = refusal(&cluster, "SELECT * FROM meili_search(NULL, 'x')");
    assert_eq!(refused.sqlstate, "22004", "{}", refused.stderr);
    let refused = refusal(&cluster, "SELECT * FROM meili_search(9999, 'x')");
    assert_eq!(refused.sqlstate, "42704", "{}", refused.stderr);
    assert_no_crash(&cluster);
}

#[test]
fn search_needs_select_on_the_table_and_row_level_security_applies_to_the_join() {
    let (cluster, _meili, _index, task) = searchable(json!({}));
    cluster.psql_script(
        "CREATE ROLE outsider;
         CREATE ROLE shopper;
         GRANT SELECT ON products TO shopper;
         ALTER TABLE products ENABLE ROW LEVEL SECURITY;
         CREATE POLICY in_stock_only ON products FOR SELECT TO shopper USING (in_stock);",
    );
    // Without SELECT on the table, its copies in the index are out of reach too.
    for sql in [
        format!("SET ROLE outsider; SELECT * FROM meili_search({task}, 'Product')"),
        format!("SET ROLE outsider; SELECT * FROM meili_facets({task}, NULL, ARRAY['category'])"),
        format!("SET ROLE outsider; SELECT meili_search_raw({task}, '{{}}')"),
        "SET ROLE outsider; SELECT * FROM meili_search('http://127.0.0.1:1', 'x', 'q')".to_owned(),
    ] {
        let refused = refusal(&cluster, &sql);
        assert_eq!(refused.sqlstate, "42501", "{sql}: {}", refused.stderr);
        // A role that may not read the table is not told which table it is.
        assert!(
            !refused.stderr.contains("products"),
            "{sql}: {}",
            refused.stderr
        );
    }
    // With SELECT, search works; hits are the index's (no row-level security there), and joining
    // back to the table applies the policies.
    let hits = cluster.psql(&format!(
        "SET ROLE shopper; SELECT count(*) FROM meili_search({task}, NULL, '{{\"limit\": 1000}}')"
    ));
    assert_eq!(hits, ROWS.to_string());
    let joined = cluster.psql(&format!(
        "SET ROLE shopper; SELECT count(*) FROM meili_search({task}, NULL, '{{\"limit\": 1000}}') s
           JOIN products p ON p.id = s.key[1]::bigint"
    ));
    let visible = cluster.psql("SELECT count(*) FROM products WHERE in_stock");
    assert_eq!(joined, visible);
    assert_ne!(joined, ROWS.to_string(), "the policy hides some rows");
}

#[test]
fn a_search_key_is_used_instead_of_the_admin_key() {
    let meili = Meili::from_env();
    if !meili.has_key() {
        eprintln!("skipped: this Meilisearch has no master key, so every key is accepted");
        return;
    }
    let (cluster, _meili, _index, task) =
        searchable(json!({"search_api_key": "not-a-key-of-this-server"}));
    let refused = refusal(
        &cluster,
        &format!("SELECT * FROM meili_search({task}, 'Product')"),
    );
    assert_eq!(refused.sqlstate, "42501", "{}", refused.stderr);
    assert!(
        refused.message.contains("Meilisearch"),
        "{}",
        refused.stderr
    );
    // The key never shows, in the error or anywhere a role could read it.
    assert!(!refused.stderr.contains("not-a-key-of-this-server"));
    // With the right key (the master key may search), searches work again.
    let key = meili.key().unwrap_or_default().to_owned();
    cluster.psql(&format!(
        "SELECT meili_sync_alter({task}, '{{\"search_api_key\": \"{key}\"}}')"
    ));
    cluster.wait_snapshot_done(task, CONVERGE);
    let found = cluster.psql(&format!(
        "SELECT id FROM meili_search({task}, NULL, '{{\"filter\": \"id = 9\"}}')"
    ));
    assert_eq!(found, "9");
}

/// A backend keeps the tasks it searched through: a change committed by another backend (through
/// the functions, or straight into the catalog) must reach it before its next search.
#[test]
fn a_backend_searches_a_task_as_another_backend_changed_it() {
    let meili = Meili::from_env();
    let (cluster, _meili, _index, task) = if meili.has_key() {
        searchable(json!({"search_api_key": "not-a-key-of-this-server"}))
    } else {
        searchable(json!({}))
    };
    cluster.psql("CREATE EXTENSION dblink");
    let other = format!(
        "host={} port={} dbname=postgres user=postgres",
        cluster.socket_dir.display(),
        cluster.port
    );
    // Each script is one backend: the wait reads the task (and caches it), then another backend
    // commits a change, then the same backend searches.
    let in_one_backend = |change: &str, search: &str| {
        format!(
            "SELECT meili_sync_wait({task}, '0/0', '0 seconds');
             SELECT dblink_exec('{other}', $change${change}$change$);
             {search}"
        )
    };
    let search_id_9 =
        format!("SELECT id FROM meili_search({task}, NULL, '{{\"filter\": \"id = 9\"}}')");
    if meili.has_key() {
        let refused = refusal(&cluster, &search_id_9);
        assert_eq!(refused.sqlstate, "42501", "{}", refused.stderr);
        let key = meili.key().unwrap_or_default().to_owned();
        let found = cluster.psql(&in_one_backend(
            &format!(
                "DO $$ BEGIN PERFORM meili_sync_alter({task}, '{{\"search_api_key\": \"{key}\"}}'); END $$"
            ),
            &search_id_9,
        ));
        assert_eq!(
            found.lines().last(),
            Some("9"),
            "the new search key is used at once"
        );
    }
    // Straight into the catalog, by a superuser: the triggers see it too.
    let refused = refusal(
        &cluster,
        &in_one_backend(
            &format!("UPDATE meili_sync.tasks SET url = 'http://127.0.0.1:1' WHERE id = {task}"),
            &search_id_9,
        ),
    );
    assert_eq!(refused.sqlstate, "08006", "{}", refused.stderr);
    assert!(
        refused.message.contains("127.0.0.1:1"),
        "{}",
        refused.stderr
    );
    // A dropped task is not searched through any more.
    let refused = refusal(
        &cluster,
        &in_one_backend(
            &format!("DO $$ BEGIN PERFORM meili_sync_drop({task}); END $$"),
            &search_id_9,
        ),
    );
    assert_eq!(refused.sqlstate, "42704", "{}", refused.stderr);
    assert_no_crash(&cluster);
}

/// After DROP and CREATE EXTENSION a backend follows the new catalog tables as it followed the
/// old ones: a change to the new install's task 1 reaches its next search.
#[test]
fn a_backend_follows_the_catalog_of_an_extension_created_again() {
    let (cluster, meili, _index, task) = searchable(json!({}));
    assert_eq!(task, 1);
    cluster.psql("CREATE EXTENSION dblink");
    let other = format!(
        "host={} port={} dbname=postgres user=postgres",
        cluster.socket_dir.display(),
        cluster.port
    );
    let index = meili.unique_index("search_again");
    let options = meili.options(json!({}));
    let refused = refusal(
        &cluster,
        &format!(
            "SELECT meili_sync_wait(1, '0/0', '0 seconds');
             COMMIT; -- (the DROP waits for this transaction's lock on the catalog)
             SELECT dblink_exec('{other}', $c$DROP EXTENSION pg_meili_sync CASCADE;
                 CREATE EXTENSION pg_meili_sync;
                 DO $$ BEGIN PERFORM meili_sync_start('products', '{index}', '{options}'); END $$$c$);
             SELECT meili_sync_wait(1, '0/0', '0 seconds');
             SELECT dblink_exec('{other}', $c$UPDATE meili_sync.tasks SET url = 'http://127.0.0.1:1' WHERE id = 1$c$);
             SELECT * FROM meili_search(1, 'anything')"
        ),
    );
    assert_eq!(refused.sqlstate, "08006", "{}", refused.stderr);
    assert!(
        refused.message.contains("127.0.0.1:1"),
        "{}",
        refused.stderr
    );
    assert_no_crash(&cluster);
}

#[test]
fn a_search_cancelled_mid_answer_raises_the_cancel_alone() {
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    // A server that starts an answer and never finishes it.
    let halting = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = halting.local_addr().expect("address").port();
    let held = std::thread::spawn(move || {
        let mut connections = Vec::new();
        for stream in halting.incoming().take(1).flatten() {
            let mut stream = stream;
            let mut buffer = [0u8; 4096];
            let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
            let _ = stream.read(&mut buffer);
            let _ = stream.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n{\"hits\": [",
            );
            connections.push(stream);
        }
        std::thread::sleep(Duration::from_secs(5));
        drop(connections);
    });
    let refused = refusal(
        &cluster,
        &format!(
            "SET meili_sync.search_timeout = '60s'; SET statement_timeout = '700ms';
             SELECT * FROM meili_search('http://127.0.0.1:{port}', 'halting', 'anything')"
        ),
    );
    assert_eq!(refused.sqlstate, "57014", "{}", refused.stderr);
    assert!(
        !refused.stderr.contains("DETAIL") && !refused.stderr.contains("backtrace"),
        "the cancel carries nothing but its own message: {}",
        refused.stderr
    );
    let _ = held.join();
    assert_eq!(cluster.psql("SELECT 1"), "1");
}

#[test]
fn statement_timeout_cancels_a_search_that_gets_no_answer() {
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    // A server that accepts connections and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = silent.local_addr().expect("address").port();
    let held = std::thread::spawn(move || {
        let mut connections = Vec::new();
        for stream in silent.incoming().take(2).flatten() {
            let mut stream = stream;
            let mut buffer = [0u8; 1024];
            let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
            let _ = stream.read(&mut buffer);
            connections.push(stream);
        }
        std::thread::sleep(Duration::from_secs(20));
        drop(connections);
    });
    let started = Instant::now();
    let refused = refusal(
        &cluster,
        &format!(
            "SET meili_sync.search_timeout = '60s'; SET statement_timeout = '500ms';
             SELECT * FROM meili_search('http://127.0.0.1:{port}', 'silent', 'anything')"
        ),
    );
    let took = started.elapsed();
    assert_eq!(refused.sqlstate, "57014", "{}", refused.stderr);
    assert!(took < Duration::from_secs(10), "the cancel took {took:?}");
    // No backend is left waiting on the silent server, and the next search is cancelled the
    // same way.
    wait_for(
        "no backend left in meili_search",
        Duration::from_secs(10),
        || {
            (cluster.psql(
                "SELECT count(*) FROM pg_stat_activity
              WHERE query LIKE '%meili_search(%silent%' AND pid <> pg_backend_pid()",
            ) == "0")
                .then_some(())
        },
    );
    let again = refusal(
        &cluster,
        &format!(
            "SET statement_timeout = '300ms';
             SELECT * FROM meili_search('http://127.0.0.1:{port}', 'silent', 'anything');"
        ),
    );
    assert_eq!(again.sqlstate, "57014", "{}", again.stderr);
    // search_timeout alone bounds the wait too, with a connection error.
    let timed_out = refusal(
        &cluster,
        &format!(
            "SET meili_sync.search_timeout = '300ms';
             SELECT * FROM meili_search('http://127.0.0.1:{port}', 'silent', 'anything')"
        ),
    );
    assert_eq!(timed_out.sqlstate, "08006", "{}", timed_out.stderr);
    assert_eq!(cluster.psql("SELECT 1"), "1");
    assert_no_crash(&cluster);
    drop(held);
}

#[test]
fn an_insert_is_searchable_once_meili_sync_wait_returns() {
    let (cluster, _meili, _index, task) = searchable(json!({}));
    for n in 1..=20 {
        let id = 10_000 + n;
        cluster.psql(&products::insert_sql(id, id));
        assert_eq!(
            cluster.psql(&format!("SELECT meili_sync_wait({task})")),
            "t",
            "the wait for row {id} timed out"
        );
        assert_eq!(
            cluster.psql(&format!(
                "SELECT count(*) FROM meili_search({task}, NULL, '{{\"filter\": \"id = {id}\"}}')"
            )),
            "1",
            "row {id} is not searchable after meili_sync_wait returned"
        );
    }
    // A paused task confirms nothing: the wait ends at its timeout with false.
    cluster.psql(&format!("SELECT meili_sync_pause({task})"));
    // The shared decoder lets the task go at its next look at the catalog (a change committed
    // before that is still synced and confirmed); then no worker streams it.
    wait_for("the task to leave the shared pass", CONVERGE, || {
        (cluster.status(task).get("worker_pid").map(String::as_str) == Some("null")).then_some(())
    });
    cluster.psql(&products::insert_sql(20_001, 20_001));
    let started = Instant::now();
    assert_eq!(
        cluster.psql(&format!(
            "SELECT meili_sync_wait({task}, timeout => '300 milliseconds')"
        )),
        "f"
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "{took:?}"
    );
    // Resumed, it confirms the row and the wait returns true.
    cluster.psql(&format!("SELECT meili_sync_resume({task})"));
    assert_eq!(
        cluster.psql(&format!(
            "SELECT meili_sync_wait({task}, timeout => '60 seconds')"
        )),
        "t"
    );
    for (sql, sqlstate) in [
        ("SELECT meili_sync_wait(NULL)", "22004"),
        ("SELECT meili_sync_wait(9999)", "42704"),
        (
            &*format!("SELECT meili_sync_wait({task}, timeout => '-1 second')"),
            "22023",
        ),
    ] {
        let refused = refusal(&cluster, sql);
        assert_eq!(refused.sqlstate, sqlstate, "{sql}: {}", refused.stderr);
    }
}
