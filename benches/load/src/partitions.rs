//! Load mode `attach`: a partition with rows attached to a synced partitioned table, the way a
//! bulk load is often done (fill a table of its own, then ATTACH it). Prints the time from the
//! ATTACH until every attached row is in the index and until the task's slot is past the ATTACH,
//! against the same-run ceiling of the attached rows' documents posted straight.

use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{wait_for, TaskStart};

use crate::ceiling_of;

/// Twelve monthly partitions of 2026, filled by `rows` rows spread over them.
fn create_events(rows: i64) -> String {
    let months: String = (1..=12)
        .map(|month| {
            let next = if month == 12 {
                "2027-01-01".to_owned()
            } else {
                format!("2026-{:02}-01", month + 1)
            };
            format!(
                "CREATE TABLE events_2026_{month:02} PARTITION OF events FOR VALUES FROM ('2026-{month:02}-01') TO ('{next}');\n"
            )
        })
        .collect();
    format!(
        "CREATE TABLE events (id bigint NOT NULL, at date NOT NULL, body text, PRIMARY KEY (id, at)) PARTITION BY RANGE (at);
         {months}
         INSERT INTO events SELECT i, date '2026-01-01' + (i % 365)::int, 'event number ' || i FROM generate_series(1, {rows}) i;"
    )
}

pub fn attach(rows: i64, attached: i64) {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql_script(&create_events(rows));
    cluster.psql("VACUUM ANALYZE");
    let (index, task) = TaskStart::on("events")
        .index_named("attach_load")
        .start_copied(&cluster, &meili, Duration::from_secs(3600));
    wait_for("the copy in the index", Duration::from_secs(3600), || {
        (meili.document_count(&index) == Some(rows as u64)).then_some(())
    });

    // A table of its own, filled apart, then attached: its rows were never the table's changes.
    cluster.psql_script(&format!(
        "CREATE TABLE events_2027_01 (LIKE events INCLUDING ALL);
         INSERT INTO events_2027_01 SELECT i, date '2027-01-01' + (i % 31)::int, 'event number ' || i
           FROM generate_series({}, {}) i;
         VACUUM ANALYZE events_2027_01;",
        rows + 1,
        rows + attached
    ));
    let started = Instant::now();
    cluster.psql(
        "ALTER TABLE events ATTACH PARTITION events_2027_01 FOR VALUES FROM ('2027-01-01') TO ('2027-02-01')",
    );
    let attach_position = cluster.psql("SELECT pg_current_wal_insert_lsn()");
    let total = (rows + attached) as u64;
    wait_for(
        "the attached rows in the index",
        Duration::from_secs(3600),
        || (meili.document_count(&index) == Some(total)).then_some(()),
    );
    let in_index = started.elapsed().as_secs_f64();
    wait_for(
        "the slot past the ATTACH",
        Duration::from_secs(3600),
        || {
            (cluster.psql(&format!(
            "SELECT coalesce(confirmed_lsn::pg_lsn >= '{attach_position}'::pg_lsn, false) FROM meili_sync_status WHERE task = {task}"
        )) == "t")
            .then_some(())
        },
    );
    let confirmed = started.elapsed().as_secs_f64();
    println!(
        "attach into {}",
        meili
            .test_server()
            .map_or_else(|| meili.url.clone(), |_| "test server".to_owned())
    );
    println!("table rows        {rows} in 12 partitions");
    println!("attached rows     {attached}");
    println!(
        "in the index      {in_index:.2} s after the ATTACH ({:.0} rows/s)",
        attached as f64 / in_index
    );
    println!("slot past it      {confirmed:.2} s after the ATTACH");
    let documents: Vec<String> = cluster
        .psql(
            "SELECT jsonb_build_object('_pk', id || '__' || at, 'id', id, 'at', at, 'body', body)::text FROM events_2027_01",
        )
        .lines()
        .map(str::to_owned)
        .collect();
    let rate = ceiling_of(&meili, &documents, 10_000, "attach_ceiling");
    println!("attach/ceiling    {:.2}", attached as f64 / in_index / rate);
    if meili.test_server().is_none() {
        meili.delete_index(&index);
    }
}
