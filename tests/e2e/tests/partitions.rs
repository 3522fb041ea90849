//! End to end: a partitioned table syncs into one index through its partitions (sub-partitions,
//! a default partition, partitions created while it streams), on a slot of its own and in the
//! shared pass; a row that moves between partitions stays one document; a TRUNCATE of the whole
//! table empties the index, and a TRUNCATE of some partitions deletes exactly their documents. Each step ends with "the index equals SELECT * FROM events".
//! A view over the partitioned table follows its partitions the same way.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{assert_no_crash, refusal, start_task, wait_for};
use serde_json::{json, Value};

const CONVERGE: Duration = Duration::from_secs(300);

/// Monthly range partitions, February split again by hash, and a default partition.
const CREATE_EVENTS: &str = "
CREATE TABLE events (id bigint NOT NULL, at date NOT NULL, body text, PRIMARY KEY (id, at))
  PARTITION BY RANGE (at);
CREATE TABLE events_2026_01 PARTITION OF events FOR VALUES FROM ('2026-01-01') TO ('2026-02-01');
CREATE TABLE events_2026_02 PARTITION OF events FOR VALUES FROM ('2026-02-01') TO ('2026-03-01')
  PARTITION BY HASH (id);
CREATE TABLE events_2026_02_h0 PARTITION OF events_2026_02 FOR VALUES WITH (MODULUS 2, REMAINDER 0);
CREATE TABLE events_2026_02_h1 PARTITION OF events_2026_02 FOR VALUES WITH (MODULUS 2, REMAINDER 1);
CREATE TABLE events_default PARTITION OF events DEFAULT;";

/// Rows `from..=to`, spread over January, February and (by default) 2027.
fn insert_events(from: i64, to: i64) -> String {
    format!(
        "INSERT INTO events SELECT i, CASE i % 3 WHEN 0 THEN date '2026-01-05' WHEN 1 THEN date '2026-02-07' ELSE date '2027-06-01' END + (i % 20), 'event ' || i
           FROM generate_series({from}, {to}) AS i"
    )
}

/// The documents the table's rows must be, by document id (`_pk`: the key's components joined
/// by `__`; digits and `-` need no escaping).
fn expected(cluster: &Cluster) -> BTreeMap<String, Value> {
    cluster
        .psql("SELECT jsonb_build_object('_pk', id || '__' || at, 'id', id, 'at', at, 'body', body)::text FROM events")
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .map(|document| (document["_pk"].as_str().unwrap_or_default().to_owned(), document))
        .collect()
}

fn indexed(meili: &Meili, index: &str) -> BTreeMap<String, Value> {
    meili
        .all_documents(index)
        .into_iter()
        .map(|document| {
            (
                document["_pk"].as_str().unwrap_or_default().to_owned(),
                document,
            )
        })
        .collect()
}

/// Waits until the index holds exactly the table's rows, ids and bodies.
fn wait_index_matches_events(cluster: &Cluster, meili: &Meili, index: &str) {
    wait_until_equal(
        cluster,
        &format!("index {index} to equal events"),
        || expected(cluster),
        || indexed(meili, index),
    );
}

/// Waits until `have` returns what `want` returns (documents by id), failing with samples of
/// what differs after `CONVERGE`.
fn wait_until_equal(
    cluster: &Cluster,
    what: &str,
    want: impl Fn() -> BTreeMap<String, Value>,
    have: impl Fn() -> BTreeMap<String, Value>,
) {
    let deadline = Instant::now() + CONVERGE;
    loop {
        let (want, have) = (want(), have());
        if want == have {
            assert_no_crash(cluster);
            return;
        }
        if Instant::now() >= deadline {
            let missing: Vec<&String> = want
                .keys()
                .filter(|id| !have.contains_key(*id))
                .take(5)
                .collect();
            let extra: Vec<&String> = have
                .keys()
                .filter(|id| !want.contains_key(*id))
                .take(5)
                .collect();
            let different: Vec<&String> = want
                .iter()
                .filter(|(id, body)| have.get(*id).is_some_and(|other| other != *body))
                .map(|(id, _)| id)
                .take(5)
                .collect();
            panic!(
                "waited {CONVERGE:?} for {what}: {} rows, {} documents; missing {missing:?}, extra {extra:?}, different {different:?}\n{}",
                want.len(),
                have.len(),
                cluster.tail_log()
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Waits until the task's catalog row holds `partition` among the partitions its index is in
/// line with: the worker records them once Meilisearch has confirmed the repair, a moment after
/// the index is seen in line.
fn wait_partitions_recorded(cluster: &Cluster, task: i64, partition: &str) {
    wait_for(
        "the catalog row to hold the partitions the index is in line with",
        CONVERGE,
        || {
            (cluster.psql(&format!(
                "SELECT count(*) FROM meili_sync.tasks t, unnest(t.partitions) p WHERE t.id = {task} AND p = '{partition}'::regclass"
            )) == "1")
                .then_some(())
        },
    );
}

/// The rows a task logged as sent for partitions attached, the last time.
/// The rows sent for each attach the log tells of ("sent N rows of the partitions attached"), in
/// order. (A partition created empty is an attach of 0 rows.)
fn rows_sent_for_partitions_attached(log: &str) -> Vec<u64> {
    log.lines()
        .filter_map(|line| {
            let (_, after) = line.split_once(": sent ")?;
            let (count, rest) = after.split_once(' ')?;
            rest.starts_with("rows of the partitions attached")
                .then(|| count.parse().ok())
                .flatten()
        })
        .collect()
}

/// A view whose documents are events with the label of their kind (a lookup table, followed by
/// a mapping), keyed by the event's id alone: a row moved to another partition stays one
/// document.
const CREATE_EVENT_DOCUMENTS: &str = "
CREATE TABLE kinds (id int PRIMARY KEY, label text NOT NULL);
INSERT INTO kinds VALUES (0, 'zero'), (1, 'one'), (2, 'two');
CREATE VIEW event_documents AS
  SELECT e.id, e.at, e.body, k.label FROM events e JOIN kinds k ON k.id = e.id % 3;";

/// The view's documents, by id.
fn expected_view(cluster: &Cluster) -> BTreeMap<String, Value> {
    cluster
        .psql("SELECT jsonb_build_object('id', id, 'at', at, 'body', body, 'label', label)::text FROM event_documents")
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .map(|document| (document["id"].to_string(), document))
        .collect()
}

fn indexed_by_id(meili: &Meili, index: &str) -> BTreeMap<String, Value> {
    meili
        .all_documents(index)
        .into_iter()
        .map(|document| (document["id"].to_string(), document))
        .collect()
}

/// Waits until the index holds exactly the view's rows, ids and bodies.
fn wait_index_matches_view(cluster: &Cluster, meili: &Meili, index: &str) {
    wait_until_equal(
        cluster,
        &format!("index {index} to equal event_documents"),
        || expected_view(cluster),
        || indexed_by_id(meili, index),
    );
}

/// A view over the partitioned table: changes come from its partitions (and the lookup table's
/// through its mapping); a TRUNCATE of one partition renders the view again; a partition
/// detached, dropped or attached with rows has the index repaired, while writes go on.
fn a_view_follows_the_partitions_of_its_table(decoding: &str) {
    let cluster = Cluster::start(&[]);
    let meili = Meili::from_env();
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(CREATE_EVENTS);
    cluster.psql(CREATE_EVENT_DOCUMENTS);
    cluster.psql(&insert_events(1, 300));
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "event_documents",
        json!({
            "primary_key": "id",
            "decoding": decoding,
            "mappings": {"kinds": "SELECT e.id FROM public.events e WHERE e.id % 3 = ANY($1::int[])"},
        }),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    wait_index_matches_view(&cluster, &meili, &index);
    assert_eq!(indexed_by_id(&meili, &index).len(), 300);

    // Changes in every partition, a row moved from January to February (the same document, its
    // date changed), a partition created while the task streams, and a label changed.
    cluster.psql(&insert_events(301, 400));
    cluster.psql("UPDATE events SET body = 'changed ' || id WHERE id % 10 = 1");
    cluster.psql("UPDATE events SET at = date '2026-02-15' WHERE id = 3");
    cluster.psql("DELETE FROM events WHERE id % 10 = 2");
    cluster.psql(
        "CREATE TABLE events_2026_03 PARTITION OF events FOR VALUES FROM ('2026-03-01') TO ('2026-04-01');
         INSERT INTO events SELECT i, date '2026-03-03', 'march ' || i FROM generate_series(901, 950) AS i;
         UPDATE kinds SET label = 'ONE' WHERE id = 1",
    );
    wait_index_matches_view(&cluster, &meili, &index);
    let documents = indexed_by_id(&meili, &index);
    assert_eq!(documents["3"]["at"], "2026-02-15");
    assert_eq!(documents["904"]["label"], "ONE");

    // TRUNCATE of one partition: the view is rendered again.
    cluster.psql("TRUNCATE events_2026_01");
    cluster.psql("INSERT INTO events VALUES (5001, '2026-01-11', 'after the truncate')");
    wait_index_matches_view(&cluster, &meili, &index);
    assert!(indexed_by_id(&meili, &index).contains_key("5001"));

    // DETACH and DROP of partitions, with no row change in the WAL: their rows leave the view.
    cluster.psql("ALTER TABLE events DETACH PARTITION events_2026_03");
    cluster.psql("DROP TABLE events_2026_02_h1");
    cluster.psql("INSERT INTO events VALUES (7001, '2026-01-04', 'still the table''s')");
    wait_index_matches_view(&cluster, &meili, &index);
    let documents = indexed_by_id(&meili, &index);
    assert!(!documents.contains_key("904") && documents.contains_key("7001"));

    // ATTACH of a table with rows: they come into the view's index while writes go on.
    cluster.psql("ALTER TABLE events ATTACH PARTITION events_2026_03 FOR VALUES FROM ('2026-03-01') TO ('2026-04-01')");
    cluster.psql("INSERT INTO events VALUES (7002, '2026-03-05', 'after the attach')");
    wait_index_matches_view(&cluster, &meili, &index);
    let documents = indexed_by_id(&meili, &index);
    assert!(documents.contains_key("904") && documents.contains_key("7002"));
    assert_eq!(
        cluster.status(task).get("state").map(String::as_str),
        Some("streaming")
    );
    wait_partitions_recorded(&cluster, task, "events_2026_03");
}

#[test]
fn a_view_over_a_partitioned_table_follows_its_partitions_on_its_own_slot() {
    a_view_follows_the_partitions_of_its_table("own");
}

#[test]
fn a_view_over_a_partitioned_table_follows_its_partitions_in_the_shared_pass() {
    a_view_follows_the_partitions_of_its_table("shared");
}

fn streams_through_every_partition(decoding: &str) {
    let cluster = Cluster::start(&[]);
    let meili = Meili::from_env();
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(CREATE_EVENTS);
    cluster.psql(&insert_events(1, 600));
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "events",
        json!({"decoding": decoding}),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    wait_index_matches_events(&cluster, &meili, &index);
    assert_eq!(
        indexed(&meili, &index).len(),
        600,
        "the copy reads every partition"
    );

    // Changes in every partition, a row moved from January to February (one document under its
    // new id, the old one deleted), and a partition created while the task streams.
    cluster.psql(&insert_events(601, 900));
    cluster.psql("UPDATE events SET body = 'changed ' || id WHERE id % 10 = 1");
    cluster.psql("UPDATE events SET at = date '2026-02-15' WHERE id = 3");
    cluster.psql("DELETE FROM events WHERE id % 10 = 2");
    cluster.psql(
        "CREATE TABLE events_2026_03 PARTITION OF events FOR VALUES FROM ('2026-03-01') TO ('2026-04-01');
         INSERT INTO events SELECT i, date '2026-03-03', 'march ' || i FROM generate_series(901, 950) AS i",
    );
    wait_index_matches_events(&cluster, &meili, &index);
    let documents = indexed(&meili, &index);
    assert!(documents.contains_key("3__2026-02-15") && !documents.contains_key("3__2026-01-08"));
    assert_eq!(documents["905__2026-03-03"]["body"], "march 905");

    // TRUNCATE of the table: every partition, so the whole index.
    cluster.psql("TRUNCATE events");
    cluster.psql(&insert_events(2001, 2030));
    wait_index_matches_events(&cluster, &meili, &index);
    assert_eq!(indexed(&meili, &index).len(), 30);

    // TRUNCATE of one partition, between writes to it in the same transaction: exactly that
    // partition's documents go (pruned once everything before it is in the index), the row
    // written after it stays, and the task streams on.
    cluster.psql(
        "BEGIN;
         INSERT INTO events VALUES (5000, '2026-01-10', 'before the truncate');
         TRUNCATE events_2026_01;
         INSERT INTO events VALUES (5001, '2026-01-11', 'after the truncate');
         COMMIT",
    );
    cluster.psql(&insert_events(3001, 3010));
    wait_index_matches_events(&cluster, &meili, &index);
    let documents = indexed(&meili, &index);
    assert_eq!(
        documents.len(),
        31,
        "20 rows outside January, 1 after the truncate, 10 new"
    );
    assert!(
        documents.contains_key("5001__2026-01-11") && !documents.contains_key("5000__2026-01-10")
    );
    assert_eq!(
        cluster.status(task).get("state").map(String::as_str),
        Some("streaming")
    );
    assert!(
        !cluster.server_log().contains("stopped"),
        "{}",
        cluster.tail_log()
    );
    // DETACH, DETACH CONCURRENTLY and DROP of a partition: no row change in the WAL, but their
    // rows are no longer the table's, so their documents go; the detached tables' later writes
    // are not the table's either.
    cluster.psql("INSERT INTO events SELECT i, date '2026-03-03', 'march ' || i FROM generate_series(6001, 6040) AS i");
    wait_index_matches_events(&cluster, &meili, &index);
    cluster.psql("ALTER TABLE events DETACH PARTITION events_default");
    cluster.psql("ALTER TABLE events DETACH PARTITION events_2026_03 CONCURRENTLY");
    cluster.psql("DROP TABLE events_2026_02_h1");
    cluster.psql("INSERT INTO events_2026_03 VALUES (7000, '2026-03-04', 'detached')");
    cluster.psql("INSERT INTO events VALUES (7001, '2026-01-04', 'still the table''s')");
    wait_index_matches_events(&cluster, &meili, &index);
    let documents = indexed(&meili, &index);
    assert!(documents
        .keys()
        .all(|id| !id.ends_with("2026-03-03") && !id.starts_with("7000__")));
    assert!(documents.contains_key("7001__2026-01-04"));
    assert_eq!(
        cluster.status(task).get("state").map(String::as_str),
        Some("streaming")
    );

    // ATTACH of a table with rows: they were never changes, so the task sends them once the index
    // has everything before the ATTACH, while writes to the table go on.
    let attaches_before = rows_sent_for_partitions_attached(&cluster.server_log()).len();
    cluster.psql("ALTER TABLE events ATTACH PARTITION events_2026_03 FOR VALUES FROM ('2026-03-01') TO ('2026-04-01')");
    cluster.psql("INSERT INTO events VALUES (7002, '2026-03-05', 'after the attach')");
    cluster.psql("UPDATE events SET body = 'updated after the attach' WHERE id = 6001");
    wait_index_matches_events(&cluster, &meili, &index);
    let documents = indexed(&meili, &index);
    assert!(
        documents.contains_key("7000__2026-03-04")
            && documents.contains_key("6040__2026-03-03")
            && documents.contains_key("7002__2026-03-05"),
        "the attached partition's rows are in the index"
    );
    // Only the attached partition was read: its 41 rows, and the row inserted after the ATTACH
    // if it was there first.
    // The documents are readable a moment before the worker notices their confirmation and logs.
    let sent = wait_for("the log of the rows attached", CONVERGE, || {
        rows_sent_for_partitions_attached(&cluster.server_log())
            .get(attaches_before)
            .copied()
    });
    assert!((41..=42).contains(&sent), "{sent} rows sent");
    assert!(
        !cluster.server_log().contains("rows the index lacked"),
        "no repair of the whole table"
    );
    assert_eq!(
        cluster.status(task).get("state").map(String::as_str),
        Some("streaming")
    );

    // A partition attached whose replica identity cannot carry the key is refused as
    // meili_sync_start refuses it: the task stops, naming it, and a new copy takes it in once it
    // is fixed.
    cluster.psql(
        "CREATE TABLE events_2026_04 (LIKE events INCLUDING ALL);
         INSERT INTO events_2026_04 VALUES (8000, '2026-04-01', 'april');
         ALTER TABLE events_2026_04 REPLICA IDENTITY NOTHING;
         ALTER TABLE events ATTACH PARTITION events_2026_04 FOR VALUES FROM ('2026-04-01') TO ('2026-05-01')",
    );
    let status = cluster.wait_error(task, CONVERGE);
    let last_error = status.get("last_error").cloned().unwrap_or_default();
    assert!(
        last_error.contains("public.events_2026_04")
            && last_error.contains("REPLICA IDENTITY")
            && last_error.contains(&format!("meili_sync_snapshot({task})")),
        "{last_error}"
    );
    cluster.psql("ALTER TABLE events_2026_04 REPLICA IDENTITY DEFAULT");
    cluster.psql(&format!("SELECT meili_sync_snapshot({task})"));
    cluster.wait_snapshot_done(task, CONVERGE);
    cluster.psql("INSERT INTO events VALUES (8001, '2026-04-02', 'after the copy')");
    wait_index_matches_events(&cluster, &meili, &index);
    assert!(indexed(&meili, &index).contains_key("8000__2026-04-01"));
}

/// What changes of the partitions while no worker looks (the task paused) is brought in or pruned
/// when it resumes: the task keeps the partitions its index is in line with in its catalog row.
#[test]
fn partitions_attached_detached_or_dropped_while_the_task_is_paused_are_followed_on_resume() {
    let (cluster, meili, index, task) = synced_events();
    cluster.psql(&format!("SELECT meili_sync_pause({task})"));
    wait_for("the task to pause", CONVERGE, || {
        (cluster.status(task).get("state").map(String::as_str) == Some("paused")).then_some(())
    });
    // Past the stream's own next look at the partitions, had it still been running.
    std::thread::sleep(Duration::from_secs(3));
    cluster.psql(
        "CREATE TABLE events_2026_03 (LIKE events INCLUDING ALL);
         INSERT INTO events_2026_03 SELECT i, date '2026-03-02', 'march ' || i FROM generate_series(9001, 9020) AS i;
         ALTER TABLE events ATTACH PARTITION events_2026_03 FOR VALUES FROM ('2026-03-01') TO ('2026-04-01');
         ALTER TABLE events DETACH PARTITION events_default;
         DROP TABLE events_2026_02_h1;
         INSERT INTO events VALUES (9100, '2026-01-20', 'while paused')",
    );
    assert!(indexed(&meili, &index)
        .keys()
        .any(|id| id.contains("2027-")));
    cluster.psql(&format!("SELECT meili_sync_resume({task})"));
    wait_index_matches_events(&cluster, &meili, &index);
    let documents = indexed(&meili, &index);
    assert!(
        documents.contains_key("9001__2026-03-02") && documents.contains_key("9100__2026-01-20")
    );
    assert!(documents.keys().all(|id| !id.contains("2027-")));
    wait_partitions_recorded(&cluster, task, "events_2026_03");
}

/// A column added on the parent (with a volatile default, each row's own value) and a column
/// dropped reach every document of every partition: the task resyncs into the new shape, and
/// then each document is its whole row, with no field of the dropped column left.
#[test]
fn a_column_added_and_one_dropped_on_the_parent_reach_every_document() {
    let (cluster, meili, index, _) = synced_events();
    cluster.psql_script(
        "ALTER TABLE events ADD COLUMN stamp text DEFAULT md5(random()::text);
         ALTER TABLE events DROP COLUMN body;",
    );
    cluster.psql(&insert_events(301, 320).replace(", 'event ' || i", ""));
    let whole_rows = || {
        cluster
            .psql("SELECT (to_jsonb(e) || jsonb_build_object('_pk', id || '__' || at))::text FROM events e")
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .map(|document| (document["_pk"].as_str().unwrap_or_default().to_owned(), document))
            .collect::<BTreeMap<String, Value>>()
    };
    wait_until_equal(
        &cluster,
        "every document to be its whole row",
        whole_rows,
        || indexed(&meili, &index),
    );
    let stamps: std::collections::BTreeSet<String> = indexed(&meili, &index)
        .values()
        .filter_map(|document| document["stamp"].as_str().map(str::to_owned))
        .collect();
    assert!(
        stamps.len() > 300,
        "each row's own default: {}",
        stamps.len()
    );
    assert_no_crash(&cluster);
}

/// `events` with 300 rows, synced by a task whose copy is in the index.
fn synced_events() -> (Cluster, Meili, String, i64) {
    let cluster = Cluster::start(&[]);
    let meili = Meili::from_env();
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(CREATE_EVENTS);
    cluster.psql(&insert_events(1, 300));
    let (index, task) = start_task(&cluster, &meili, None, "events", json!({}));
    cluster.wait_snapshot_done(task, CONVERGE);
    wait_index_matches_events(&cluster, &meili, &index);
    (cluster, meili, index, task)
}

/// Every path that encodes rows reads a partitioned table through its partitions: the preview
/// (in key order, a dead letter left out), dead letters from the copy and the stream (in two
/// partitions) and their retry once fixed, verify, and a resync into a new index.
#[test]
fn preview_dead_letters_verify_and_resync_of_a_partitioned_table() {
    let cluster = Cluster::start(&[]);
    let meili = Meili::from_env();
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(CREATE_EVENTS);
    cluster.psql("ALTER TABLE events ADD COLUMN _geo jsonb");
    cluster.psql(&insert_events(1, 300));
    // Row 17 is in the default partition, row 42 in January.
    cluster.psql(r#"UPDATE events SET _geo = '{"lat": "north", "lng": 2}' WHERE id = 17"#);
    let preview = cluster
        .psql("SELECT string_agg(d->>'id', ',') FROM meili_sync_preview('events', '{}', 20) d");
    // The first 20 rows, less the poison row.
    let want: Vec<String> = (1..=20)
        .filter(|id| *id != 17)
        .map(|id: i64| id.to_string())
        .collect();
    assert_eq!(
        preview,
        want.join(","),
        "key order across partitions, the poison row left out"
    );
    let (index, task) = start_task(
        &cluster,
        &meili,
        None,
        "events",
        json!({"settings": {"filterableAttributes": ["_geo"]}}),
    );
    cluster.wait_snapshot_done(task, CONVERGE);
    cluster.psql(r#"UPDATE events SET _geo = '"somewhere"' WHERE id = 42"#);
    let poison = cluster.psql(
        "SELECT string_agg(id || '__' || at || ':invalid_document_geo_field', ',' ORDER BY id) FROM events WHERE id IN (17, 42)",
    );
    let dead_letters = || {
        cluster.psql(
            "SELECT string_agg(document_id || ':' || error_code, ',' ORDER BY split_part(document_id, '__', 1)::int) FROM meili_sync_dead_letters",
        )
    };
    wait_for("the poison rows as dead letters", CONVERGE, || {
        (dead_letters() == poison).then_some(())
    });
    cluster.psql("UPDATE events SET _geo = NULL WHERE id IN (17, 42)");
    assert_eq!(
        cluster.psql(&format!("SELECT meili_sync_retry_dead_letters({task})")),
        "2"
    );
    assert_eq!(dead_letters(), "");
    let ids = |index: &str| -> Vec<String> {
        let mut ids: Vec<String> = indexed(&meili, index).into_keys().collect();
        ids.sort();
        ids
    };
    let table_ids = || -> Vec<String> {
        let mut ids: Vec<String> = expected(&cluster).into_keys().collect();
        ids.sort();
        ids
    };
    wait_for("every row in the index", CONVERGE, || {
        (ids(&index) == table_ids()).then_some(())
    });
    let verify = || {
        cluster.psql(&format!(
            "SELECT rows_checked || ':' || missing + extra + different FROM meili_sync_verify({task})"
        ))
    };
    wait_for("verify to find the index equal", CONVERGE, || {
        (verify() == "300:0").then_some(())
    });

    // A resync copies the partitions into a new index and swaps it in.
    let helper: i64 = cluster
        .psql(&format!("SELECT meili_sync_resync({task})"))
        .parse()
        .expect("helper task id");
    cluster.psql("INSERT INTO events VALUES (9000, '2026-01-09', 'during the resync', NULL)");
    wait_for("the resync to finish", CONVERGE, || {
        (cluster.psql(&format!(
            "SELECT count(*) FROM meili_sync.tasks WHERE id = {helper}"
        )) == "0")
            .then_some(())
    });
    wait_for("every row in the resynced index", CONVERGE, || {
        (ids(&index) == table_ids()).then_some(())
    });
    assert!(ids(&index).contains(&"9000__2026-01-09".to_owned()));
    assert!(cluster
        .server_log()
        .contains("resync swapped in the new index"));
    wait_for("verify to find the resynced index equal", CONVERGE, || {
        (verify() == "301:0").then_some(())
    });
    assert_no_crash(&cluster);
}

#[test]
fn a_partitioned_table_streams_through_every_partition_on_its_own_slot() {
    streams_through_every_partition("own");
}

#[test]
fn a_partitioned_table_streams_through_every_partition_in_the_shared_pass() {
    streams_through_every_partition("shared");
}

#[test]
fn a_partitioned_table_and_one_of_its_partitions_are_synced_side_by_side_in_the_shared_pass() {
    let cluster = Cluster::start(&[]);
    let meili = Meili::from_env();
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(CREATE_EVENTS);
    cluster.psql(&insert_events(1, 300));
    let (whole, whole_task) = start_task(&cluster, &meili, None, "events", json!({}));
    let (january, january_task) = start_task(&cluster, &meili, None, "events_2026_01", json!({}));
    cluster.wait_snapshot_done(whole_task, CONVERGE);
    cluster.wait_snapshot_done(january_task, CONVERGE);
    cluster.psql(&insert_events(301, 600));
    cluster.psql("DELETE FROM events WHERE id % 7 = 0");
    wait_index_matches_events(&cluster, &meili, &whole);
    let want: Vec<String> = cluster
        .psql("SELECT id || '__' || at FROM events_2026_01 ORDER BY 1")
        .lines()
        .map(str::to_owned)
        .collect();
    let deadline = Instant::now() + CONVERGE;
    loop {
        let have: Vec<String> = indexed(&meili, &january).into_keys().collect();
        if have == want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the partition's index has {} documents, the partition {} rows",
            have.len(),
            want.len()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(
        want.len(),
        172,
        "January's rows: a third of 600, less every 7th"
    );
}

#[test]
fn a_partition_whose_changes_cannot_be_followed_is_refused_by_name() {
    let cluster = Cluster::start(&[]);
    let meili = Meili::from_env();
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(CREATE_EVENTS);
    let options = meili.options(json!({}));
    cluster.psql("ALTER TABLE events_2026_02_h1 REPLICA IDENTITY NOTHING");
    let start = format!("SELECT meili_sync_start('events', 'events', '{options}')");
    let refused = refusal(&cluster, &start);
    assert_eq!(refused.sqlstate, "42P16", "{refused:?}");
    assert!(
        refused
            .message
            .contains("partition public.events_2026_02_h1 of table public.events"),
        "{refused:?}"
    );
    assert!(refused
        .hint
        .contains("ALTER TABLE public.events_2026_02_h1 REPLICA IDENTITY"));
    // A view over the table is refused the same way, naming the partition.
    cluster.psql(CREATE_EVENT_DOCUMENTS);
    let view_options = meili.options(json!({
        "primary_key": "id",
        "mappings": {"kinds": "SELECT e.id FROM public.events e WHERE e.id % 3 = ANY($1::int[])"},
    }));
    let start_view =
        format!("SELECT meili_sync_start('event_documents', 'event_documents', '{view_options}')");
    let refused = refusal(&cluster, &start_view);
    assert_eq!(refused.sqlstate, "55000", "{refused:?}");
    assert!(
        refused
            .message
            .contains("public.events_2026_02_h1 (partition of public.events) (id)"),
        "{refused:?}"
    );
    cluster.psql("ALTER TABLE events_2026_02_h1 REPLICA IDENTITY DEFAULT");
    cluster.psql(
        "CREATE UNLOGGED TABLE events_2028 (id bigint NOT NULL, at date NOT NULL, body text, PRIMARY KEY (id, at));
         ALTER TABLE events DETACH PARTITION events_default;
         ALTER TABLE events ATTACH PARTITION events_2028 FOR VALUES FROM ('2028-01-01') TO ('2029-01-01')",
    );
    for sql in [&start, &start_view] {
        let refused = refusal(&cluster, sql);
        assert_eq!(refused.sqlstate, "22023", "{refused:?}");
        assert!(refused.message.contains("events_2028"), "{refused:?}");
    }
    assert_eq!(
        cluster.psql("SELECT count(*) FROM meili_sync.tasks"),
        "0",
        "nothing is left half-created"
    );
}

/// Monthly partitions of 2026 kept the way pg_partman keeps them, while a client writes into
/// the current month: each step creates a month ahead, moves the writes on, then detaches the
/// oldest month (once CONCURRENTLY) and drops it. After each step the index equals the table.
#[test]
fn monthly_partitions_created_ahead_detached_and_dropped_while_writes_go_on() {
    use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

    let cluster = Cluster::start(&[]);
    let meili = Meili::from_env();
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    let month = |m: i64| {
        format!(
            "CREATE TABLE events_m{m:02} PARTITION OF events FOR VALUES FROM ('2026-{m:02}-01') TO ('2026-{:02}-01')",
            m + 1
        )
    };
    cluster.psql(
        "CREATE TABLE events (id bigint NOT NULL, at date NOT NULL, body text, PRIMARY KEY (id, at))
           PARTITION BY RANGE (at);
         CREATE TABLE events_default PARTITION OF events DEFAULT",
    );
    for m in 1..=3 {
        cluster.psql(&month(m));
    }
    cluster.psql("INSERT INTO events SELECT i, date '2026-01-01' + (i % 28), 'old ' || i FROM generate_series(1, 200) AS i");
    let (index, task) = start_task(&cluster, &meili, None, "events", json!({}));
    cluster.wait_snapshot_done(task, CONVERGE);

    let current = AtomicI64::new(1);
    let pause = AtomicBool::new(false);
    let paused = AtomicBool::new(false);
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let _stop = pg_meili_sync_e2e::StopOnDrop(&stop);
            let mut id = 1000;
            while !stop.load(Ordering::Relaxed) {
                if pause.load(Ordering::Relaxed) {
                    paused.store(true, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                paused.store(false, Ordering::Relaxed);
                let m = current.load(Ordering::Relaxed);
                let sql = format!(
                    "INSERT INTO events VALUES ({id}, '2026-{m:02}-{:02}', 'written {id}');
                     UPDATE events SET body = 'updated ' || id WHERE id = {};
                     DELETE FROM events WHERE id = {} AND id % 7 = 0",
                    id % 28 + 1,
                    id - 3,
                    id - 5
                );
                if cluster.try_psql(&sql).is_ok() {
                    id += 1;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let _stop = pg_meili_sync_e2e::StopOnDrop(&stop);
        for step in 1..=3 {
            std::thread::sleep(Duration::from_millis(800));
            cluster.psql(&month(step + 3));
            current.store(step + 1, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(800));
            // CONCURRENTLY is refused while a default partition exists: it goes first.
            let concurrently = if step == 2 {
                cluster.psql(
                    "ALTER TABLE events DETACH PARTITION events_default; DROP TABLE events_default",
                );
                " CONCURRENTLY"
            } else {
                ""
            };
            cluster.psql(&format!(
                "ALTER TABLE events DETACH PARTITION events_m{step:02}{concurrently}"
            ));
            cluster.psql(&format!("DROP TABLE events_m{step:02}"));
            std::thread::sleep(Duration::from_millis(500));
            pause.store(true, Ordering::Relaxed);
            wait_for("the writer to pause", CONVERGE, || {
                paused.load(Ordering::Relaxed).then_some(())
            });
            wait_index_matches_events(&cluster, &meili, &index);
            let documents = indexed(&meili, &index);
            let gone = format!("2026-{step:02}-");
            assert!(
                documents.keys().all(|id| !id.contains(&gone)),
                "step {step}: documents of the dropped month remain"
            );
            assert!(
                !documents.is_empty(),
                "step {step}: the current months are in the index"
            );
            assert_eq!(
                cluster.status(task).get("state").map(String::as_str),
                Some("streaming")
            );
            pause.store(false, Ordering::Relaxed);
        }
        stop.store(true, Ordering::Relaxed);
    });
}
