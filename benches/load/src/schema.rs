//! Load mode `schema`: a column dropped from a synced table of `rows` rows, then one added. Prints
//! the copy's time and rate, then the time from the `DROP COLUMN` until every document is in the
//! new shape (the resync the launcher starts has swapped in the new index), the time from the
//! `ADD COLUMN … DEFAULT` until every document has the new field (the stream's partial updates),
//! and the ratio of each rate to the copy's.

use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{wait_for, TaskStart};

const HOUR: Duration = Duration::from_secs(3600);

pub fn drop_column(rows: i64) {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql_script(&format!(
        "CREATE TABLE items (id bigint PRIMARY KEY, name text, note text, price numeric, qty int);
         INSERT INTO items SELECT i, 'item number ' || i, 'a note to drop ' || i, i % 1000, i % 50
           FROM generate_series(1, {rows}) i;
         VACUUM ANALYZE items;"
    ));
    let started = Instant::now();
    let (index, task) = TaskStart::on("items")
        .index_named("schema_load")
        .start_copied(&cluster, &meili, HOUR);
    wait_for("the copy in the index", HOUR, || {
        (meili.document_count(&index) == Some(rows as u64)).then_some(())
    });
    let copy = started.elapsed().as_secs_f64();

    let reshape = until_in_shape(&cluster, task, "ALTER TABLE items DROP COLUMN note");
    let added = until_in_shape(
        &cluster,
        task,
        "ALTER TABLE items ADD COLUMN label text DEFAULT 'a label'",
    );
    println!(
        "schema change into {}",
        meili
            .test_server()
            .map_or_else(|| meili.url.clone(), |_| "test server".to_owned())
    );
    println!("rows              {rows}");
    println!(
        "copy              {copy:.2} s ({:.0} rows/s)",
        rows as f64 / copy
    );
    println!(
        "DROP COLUMN       {reshape:.2} s until every document is in the new shape ({:.0} rows/s)",
        rows as f64 / reshape
    );
    println!("reshape/copy      {:.2}", copy / reshape);
    println!(
        "ADD COLUMN        {added:.2} s until every document has the new field ({:.0} rows/s)",
        rows as f64 / added
    );
    println!("add/copy          {:.2}", copy / added);
    if std::env::var("LOAD_VERIFY").is_ok() {
        println!(
            "verify            {}",
            cluster.psql(&format!(
                "SELECT missing || ' missing, ' || extra || ' extra, ' || different || ' different' FROM meili_sync_verify({task})"
            ))
        );
    }
    if meili.test_server().is_none() {
        meili.delete_index(&index);
    }
}

/// Runs `ddl` and waits until the task's documents are in the source's new shape: the shape
/// recorded for the task changed (by a resync's swap, or the columns added sent) and nothing
/// says otherwise. Returns the seconds it took.
fn until_in_shape(cluster: &Cluster, task: i64, ddl: &str) -> f64 {
    let before = cluster.psql(&format!(
        "SELECT shape FROM meili_sync.tasks WHERE id = {task}"
    ));
    let started = Instant::now();
    cluster.psql(ddl);
    wait_for("every document in the new shape", HOUR, || {
        (cluster.psql(&format!(
            "SELECT shape IS DISTINCT FROM '{before}'
                    AND coalesce(last_error, '') NOT LIKE 'out of shape%'
                    AND coalesce(last_error, '') NOT LIKE 'adding columns%'
                    AND NOT EXISTS (SELECT 1 FROM meili_sync.tasks h WHERE h.resync_of = {task})
               FROM meili_sync.tasks WHERE id = {task}"
        )) == "t")
            .then_some(())
    });
    started.elapsed().as_secs_f64()
}
