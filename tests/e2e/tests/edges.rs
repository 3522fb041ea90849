//! End to end: the edges of issue "exact at every edge": primary keys with INCLUDE columns.

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
