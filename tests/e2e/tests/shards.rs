//! End to end: a task with `shards` spreads one index over several servers by a rendezvous hash of
//! the document id. The union of the shards equals the table, each document is on exactly the
//! shard its hash names (checked with a hash computed here, not the extension's), key changes
//! move documents, TRUNCATE empties every shard, and `meili_search` on the task finds, through one
//! federated search, every row that direct searches of the shards find. Each test starts servers
//! of its own (the test server, or real ones with `E2E_MEILI=real`), so it skips with `MEILI_URL`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{
    assert_no_crash, owner_of, products, refusal, start_with_options, StopOnDrop,
};
use serde_json::{json, Value};

const CONVERGE: Duration = Duration::from_secs(300);
const NAMES: [&str; 3] = ["shard-a", "shard-b", "shard-c"];

fn id_text(document: &Value) -> String {
    match &document["id"] {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// What is wrong with the shards against the table, if anything: a document missing from their
/// union or different from its row, a document on two shards, or on another shard than its hash
/// names.
fn shards_problem(
    cluster: &Cluster,
    meilis: &[Meili],
    names: &[&str],
    index: &str,
) -> Option<String> {
    let expected = products::table_documents(cluster, "products");
    let mut union = Vec::new();
    let mut seen: BTreeMap<String, &str> = BTreeMap::new();
    for (meili, &name) in meilis.iter().zip(names) {
        for document in meili.all_documents(index) {
            let id = id_text(&document);
            if let Some(other) = seen.insert(id.clone(), name) {
                return Some(format!("document {id} is on {other} and on {name}"));
            }
            let owner = owner_of(&id, names);
            if owner != name {
                return Some(format!(
                    "document {id} is on {name}, but its hash names {owner}"
                ));
            }
            union.push(document);
        }
    }
    products::diff_documents(&union, &expected)
}

fn wait_shards_match_table(cluster: &Cluster, meilis: &[Meili], names: &[&str], index: &str) {
    let deadline = Instant::now() + CONVERGE;
    loop {
        let Some(problem) = shards_problem(cluster, meilis, names, index) else {
            assert_no_crash(cluster);
            return;
        };
        assert!(
            Instant::now() < deadline,
            "the shards do not match the table after {CONVERGE:?}: {problem}\n--- server log tail ---\n{}",
            cluster.tail_log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The ids a direct search of each shard finds for `query`, together.
fn direct_ids(meilis: &[Meili], index: &str, query: &str) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    for meili in meilis {
        let (status, answer) = meili.request(
            ureq::http::Method::POST,
            &format!("/indexes/{index}/search"),
            Some(json!({"q": query, "limit": 10_000, "attributesToRetrieve": ["id"]})),
        );
        assert_eq!(status, 200, "a direct search of a shard: {answer}");
        for hit in answer["hits"].as_array().into_iter().flatten() {
            ids.insert(id_text(hit));
        }
    }
    ids
}

fn sql_search_ids(cluster: &Cluster, task: i64, query: &str) -> BTreeSet<String> {
    search_ids_where(cluster, task, query, "")
}

/// The ids `meili_search` finds for `query`, with `filter` (a Meilisearch filter, or none); an id
/// found twice fails the test.
fn search_ids_where(cluster: &Cluster, task: i64, query: &str, filter: &str) -> BTreeSet<String> {
    let options = json!({"limit": 10_000, "filter": filter}).to_string();
    let mut ids = BTreeSet::new();
    for id in cluster
        .psql(&format!(
            "SELECT id FROM meili_search({task}, '{query}', '{options}')"
        ))
        .lines()
        .filter(|line| !line.is_empty())
    {
        assert!(
            ids.insert(id.to_owned()),
            "meili_search found id {id} twice"
        );
    }
    ids
}

#[test]
fn shards_split_the_table_follow_its_changes_and_search_as_one() {
    let Some(meilis) = (0..3)
        .map(|_| Meili::own_shard())
        .collect::<Option<Vec<Meili>>>()
    else {
        eprintln!("skipped: the one Meilisearch at MEILI_URL cannot be several shards");
        return;
    };
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 1_500));
    let index = meilis[0].unique_index("shards");
    let shards: Vec<Value> = meilis
        .iter()
        .zip(NAMES)
        .map(|(meili, name)| meili.shard(name))
        .collect();
    let options =
        json!({"shards": shards, "settings": {"filterableAttributes": ["id", "category"]}})
            .to_string();
    let task = start_with_options(&cluster, None, "products", &index, &options);
    let rows: Vec<(i64, String)> = cluster
        .psql(&format!(
            "SELECT task || ' ' || shard FROM meili_sync_status WHERE task = {task} OR replica_of = {task} ORDER BY task"
        ))
        .lines()
        .filter_map(|line| {
            let (row, shard) = line.split_once(' ')?;
            Some((row.parse().ok()?, shard.to_owned()))
        })
        .collect();
    assert_eq!(
        rows.iter()
            .map(|(_, shard)| shard.as_str())
            .collect::<Vec<_>>(),
        NAMES,
        "one row per shard, the task's own row first"
    );
    for (row, _) in &rows {
        cluster.wait_snapshot_done(*row, CONVERGE);
    }
    wait_shards_match_table(&cluster, &meilis, &NAMES, &index);
    for meili in &meilis {
        let count = meili.document_count(&index).unwrap_or(0);
        assert!(
            (250..=750).contains(&count),
            "each shard holds about a third of 1,500 documents, not {count}"
        );
    }

    // Updates, inserts, deletes, and key changes: a moved document leaves its old shard.
    cluster.psql("UPDATE products SET version = version + 1, name = name || ' v2' WHERE id <= 300");
    cluster.psql(&products::insert_sql(1_501, 1_800));
    cluster.psql("DELETE FROM products WHERE id BETWEEN 1000 AND 1100");
    cluster.psql("UPDATE products SET id = id + 100000 WHERE id BETWEEN 200 AND 260");
    wait_shards_match_table(&cluster, &meilis, &NAMES, &index);

    // One search through SQL finds what the shards find directly, merged.
    for query in ["", "Product 17", "v2"] {
        let direct = direct_ids(&meilis, &index, query);
        assert!(
            !direct.is_empty(),
            "the shards find something for '{query}'"
        );
        assert_eq!(
            sql_search_ids(&cluster, task, query),
            direct,
            "meili_search({task}, '{query}') against direct searches of every shard"
        );
    }
    let counted = cluster.psql(&format!(
        "SELECT string_agg(value || '=' || count, ',' ORDER BY value) FROM meili_facets({task}, '', ARRAY['category'])"
    ));
    let expected = cluster.psql(
        "SELECT string_agg(category || '=' || n, ',' ORDER BY category) FROM (SELECT category, count(*) AS n FROM products GROUP BY category) c",
    );
    assert_eq!(counted, expected, "facet counts over every shard");
    assert_eq!(
        cluster.psql(&format!(
            "SELECT missing || ',' || extra || ',' || different FROM meili_sync_verify({task})"
        )),
        "0,0,0",
        "verify compares each shard with the rows it keeps"
    );

    // What a sharded task refuses, and nothing changed after.
    let refusals = [
        (
            format!(
                "SELECT meili_sync_alter({task}, '{}')",
                json!({"shards": &shards[..2]})
            ),
            "0A000",
        ),
        (
            format!("SELECT meili_sync_alter({task}, '{{\"url\": \"http://127.0.0.1:1\"}}')"),
            "22023",
        ),
        (format!("SELECT meili_sync_drop({})", rows[1].0), "0A000"),
        (
            format!(
                "SELECT meili_sync_alter({}, '{{\"batch_size\": 100}}')",
                rows[1].0
            ),
            "22023",
        ),
        (
            format!("SELECT meili_sync_wait({task}, replicas => 'any')"),
            "22023",
        ),
    ];
    for (sql, sqlstate) in refusals {
        let refused = refusal(&cluster, &sql);
        assert_eq!(refused.sqlstate, sqlstate, "{sql}: {}", refused.stderr);
    }
    assert_eq!(
        cluster.psql(&format!(
            "SELECT count(*) FROM meili_sync_status WHERE task = {task} OR replica_of = {task}"
        )),
        "3"
    );

    // A resync rebuilds each shard's index with the documents of that shard, while rows change.
    let helper: i64 = cluster
        .psql(&format!("SELECT meili_sync_resync({task})"))
        .parse()
        .expect("a helper's id");
    assert_eq!(
        cluster.psql(
            "SELECT string_agg(shard, ',' ORDER BY resync_of) FROM meili_sync.tasks WHERE resync_of IS NOT NULL"
        ),
        NAMES.join(","),
        "one helper per shard, keeping that shard's ids"
    );
    cluster.psql(&products::insert_sql(2_001, 2_300));
    cluster.psql("UPDATE products SET id = id + 100000 WHERE id BETWEEN 400 AND 430");
    let deadline = Instant::now() + CONVERGE;
    while cluster.psql("SELECT count(*) FROM meili_sync.tasks WHERE resync_of IS NOT NULL") != "0" {
        assert!(
            Instant::now() < deadline,
            "resync helper {helper} and the others did not finish:\n{}",
            cluster.tail_log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    wait_shards_match_table(&cluster, &meilis, &NAMES, &index);
    for meili in &meilis {
        assert_eq!(meili.index(&format!("{index}__resync")), None);
    }

    // TRUNCATE reaches every shard.
    cluster.psql("TRUNCATE products");
    let deadline = Instant::now() + CONVERGE;
    while meilis
        .iter()
        .any(|meili| meili.document_count(&index) != Some(0))
    {
        assert!(
            Instant::now() < deadline,
            "TRUNCATE did not empty every shard"
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    cluster.psql(&format!(
        "SELECT meili_sync_drop({task}, drop_index => true)"
    ));
    for meili in &meilis {
        assert_eq!(
            meili.index(&index),
            None,
            "the index is deleted on every shard"
        );
    }
}

fn own_shards(count: usize) -> Option<Vec<Meili>> {
    let servers = (0..count)
        .map(|_| Meili::own_shard())
        .collect::<Option<Vec<Meili>>>();
    if servers.is_none() {
        eprintln!("skipped: the one Meilisearch at MEILI_URL cannot be several shards");
    }
    servers
}

#[test]
fn a_shard_added_under_writes_takes_its_documents_and_none_goes_missing() {
    let Some(meilis) = own_shards(4) else {
        return;
    };
    let names = [NAMES[0], NAMES[1], NAMES[2], "shard-d"];
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 1_500));
    let index = meilis[0].unique_index("shards_added");
    let entries: Vec<Value> = meilis
        .iter()
        .zip(names)
        .map(|(meili, name)| meili.shard(name))
        .collect();
    let options = |shards: &[Value]| {
        json!({"shards": shards, "settings": {"filterableAttributes": ["id"]}}).to_string()
    };
    let task = start_with_options(&cluster, None, "products", &index, &options(&entries[..3]));
    wait_shards_match_table(&cluster, &meilis[..3], &names[..3], &index);

    // Steady writes (updates of the first rows, inserts of new ones) while a fourth shard joins.
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        // A failed assertion below stops the writer too, or the scope would wait for it forever.
        let _stop_writer = StopOnDrop(&stop);
        scope.spawn(|| {
            let mut next = 5_001;
            while !stop.load(Ordering::Relaxed) {
                cluster.psql(&format!(
                    "UPDATE products SET version = version + 1 WHERE id = {}; {}",
                    1 + next % 1_500,
                    products::insert_sql(next, next + 4)
                ));
                next += 5;
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        cluster.psql(&format!(
            "SELECT meili_sync_alter({task}, '{}')",
            json!({"shards": entries})
        ));
        // Until the fourth shard has its documents and the others have dropped theirs that
        // moved, no row of the first 1,500 is ever missing from a search through SQL, and none
        // is found twice (on its old shard and its new one).
        let stable: BTreeSet<String> = (1..=1_500).map(|id| id.to_string()).collect();
        let deadline = Instant::now() + CONVERGE;
        let mut samples = 0;
        let mut steps = BTreeSet::new();
        loop {
            steps.extend(
                cluster
                    .psql("SELECT query FROM pg_stat_activity WHERE backend_type = 'pg_meili_sync rebalance'")
                    .lines()
                    .filter(|line| !line.is_empty())
                    .map(str::to_owned),
            );
            let found = search_ids_where(&cluster, task, "", "id <= 1500");
            let missing: Vec<&String> = stable.difference(&found).take(5).collect();
            assert!(
                missing.is_empty(),
                "sample {samples}: ids {missing:?} are missing from the merged search"
            );
            samples += 1;
            let done = cluster.psql(&format!(
                "SELECT count(DISTINCT shard_names) = 1 AND bool_and(shard_prune_after IS NULL) AND bool_and(snapshot_finished_at IS NOT NULL)
                   FROM meili_sync.tasks WHERE id = {task} OR replica_of = {task}"
            ));
            if done == "t" && samples >= 5 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the fourth shard did not join after {CONVERGE:?}\n{}",
                cluster.tail_log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // The rebalance worker says in pg_stat_activity which step it is at (when a sample
        // caught it: it may run between two).
        for step in &steps {
            assert!(
                step.starts_with(&format!("task {task}: ")) || step == "starting",
                "the rebalance worker's activity: {step}"
            );
        }
        eprintln!("rebalance steps seen: {steps:?}");
    });
    wait_shards_match_table(&cluster, &meilis, &names, &index);
    // The writer's rows count too: how many depends on how long the rebalance took.
    let on_the_new_shard = meilis[3].document_count(&index).unwrap_or(0);
    let total: u64 = meilis
        .iter()
        .map(|meili| meili.document_count(&index).unwrap_or(0))
        .sum();
    assert!(
        (total * 15..=total * 35).contains(&(on_the_new_shard * 100)),
        "the fourth shard holds about a quarter of the {total} documents, not {on_the_new_shard}"
    );
    let direct = direct_ids(&meilis, &index, "");
    assert_eq!(
        sql_search_ids(&cluster, task, ""),
        direct,
        "meili_search asks all four shards"
    );
    // Shards are only added, after the ones the task has.
    let refused = refusal(
        &cluster,
        &format!(
            "SELECT meili_sync_alter({task}, '{}')",
            json!({"shards": [entries[1].clone(), entries[0].clone()]})
        ),
    );
    assert_eq!(refused.sqlstate, "0A000", "{}", refused.stderr);
}

/// `"decoding": "own"`: each shard's or replica's row decodes on a replication slot of its own,
/// and each gets every change it keeps; dropping the task drops every slot.
#[test]
fn shards_and_replicas_on_slots_of_their_own_get_every_change() {
    let Some(meilis) = own_shards(2) else {
        return;
    };
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, 800));
    let names = &NAMES[..2];
    let sharded_index = meilis[0].unique_index("own_shards");
    let shards: Vec<Value> = meilis
        .iter()
        .zip(names)
        .map(|(meili, name)| meili.shard(name))
        .collect();
    let sharded = start_with_options(
        &cluster,
        None,
        "products",
        &sharded_index,
        &json!({"shards": shards, "decoding": "own"}).to_string(),
    );
    let replicated_index = meilis[0].unique_index("own_replicas");
    let replicas: Vec<Value> = meilis.iter().map(Meili::replica).collect();
    let replicated = start_with_options(
        &cluster,
        None,
        "products",
        &replicated_index,
        &json!({"replicas": replicas, "decoding": "own"}).to_string(),
    );
    let own_slots = || {
        cluster.psql(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'meili\\_sync\\_%' AND slot_name NOT LIKE '%\\_shared'",
        )
    };
    let decoding = cluster.psql(&format!(
        "SELECT string_agg(DISTINCT decoding, ',') FROM meili_sync_status WHERE {sharded} IN (task, replica_of) OR {replicated} IN (task, replica_of)"
    ));
    assert_eq!(decoding, "own");
    cluster.psql("UPDATE products SET version = version + 1, name = name || ' v2' WHERE id <= 200");
    cluster.psql(&products::insert_sql(801, 900));
    cluster.psql("DELETE FROM products WHERE id BETWEEN 500 AND 540");
    cluster.psql("UPDATE products SET id = id + 100000 WHERE id BETWEEN 300 AND 320");
    wait_shards_match_table(&cluster, &meilis, names, &sharded_index);
    for meili in &meilis {
        pg_meili_sync_e2e::wait_index_matches_table(
            &cluster,
            meili,
            &replicated_index,
            "products",
            CONVERGE,
        );
    }
    assert_eq!(own_slots(), "4", "one slot for each of the four rows");
    for task in [sharded, replicated] {
        cluster.psql(&format!(
            "SELECT meili_sync_drop({task}, drop_index => true)"
        ));
    }
    let deadline = Instant::now() + CONVERGE;
    while own_slots() != "0" {
        assert!(
            Instant::now() < deadline,
            "the rows' slots were not dropped"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_no_crash(&cluster);
}
