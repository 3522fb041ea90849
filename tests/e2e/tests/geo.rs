//! End to end: the `geo` option turns a PostGIS column into Meilisearch's geo fields. Points
//! (`geography(Point)`) become `_geo {lat, lng}`, other geometries `_geojson`, through the copy
//! and the stream, and the index equals what SQL computes from the table (PostGIS's own
//! `ST_X`/`ST_Y` and `ST_AsGeoJSON`). A value Meilisearch cannot read (another SRID, a latitude
//! beyond 90°) is a dead letter with its reason, and the rest lands. On a real Meilisearch,
//! `_geoRadius` filters through `meili_search` return exactly the rows `ST_DWithin` returns (the
//! test server has no geo filters). Skips, saying so, where PostGIS is not installed.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::{Meili, Method};
use pg_meili_sync_e2e::{assert_no_crash, cluster_with_extension, refusal, start_task, wait_for};
use serde_json::{json, Value};

const CONVERGE: Duration = Duration::from_secs(300);

/// Whether two JSON values are equal, numbers compared as floats (PostGIS prints `2`, we send
/// `2.0`; both are the same coordinate).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_f64(), y.as_f64()) {
            (Some(x), Some(y)) => (x - y).abs() <= 1e-9 * x.abs().max(1.0),
            _ => false,
        },
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(key, value)| y.get(key).is_some_and(|other| same(value, other)))
        }
        _ => a == b,
    }
}

/// `query` returns one JSON document per row; they are what the index must hold, by id.
fn expected(cluster: &Cluster, query: &str) -> BTreeMap<i64, Value> {
    cluster
        .psql(query)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .map(|document| (document["id"].as_i64().unwrap_or(-1), document))
        .collect()
}

fn indexed(meili: &Meili, index: &str) -> BTreeMap<i64, Value> {
    meili
        .all_documents(index)
        .into_iter()
        .map(|document| (document["id"].as_i64().unwrap_or(-1), document))
        .collect()
}

/// Waits until the index holds exactly the documents `query` computes, ids and bodies.
fn wait_index_matches(cluster: &Cluster, meili: &Meili, index: &str, query: &str) {
    let deadline = Instant::now() + CONVERGE;
    loop {
        let want = expected(cluster, query);
        let have = indexed(meili, index);
        let differs = want.len() != have.len()
            || want
                .iter()
                .any(|(id, document)| !have.get(id).is_some_and(|other| same(document, other)));
        if !differs {
            assert_no_crash(cluster);
            return;
        }
        if Instant::now() >= deadline {
            let wrong: Vec<String> = want
                .iter()
                .filter(|(id, document)| !have.get(id).is_some_and(|other| same(document, other)))
                .take(3)
                .map(|(id, document)| format!("{id}: want {document}, have {:?}", have.get(id)))
                .collect();
            panic!(
                "index {index} does not match after {CONVERGE:?} ({} rows, {} documents): {wrong:?}\n{}",
                want.len(),
                have.len(),
                cluster.tail_log()
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

const PLACES: &str = "SELECT jsonb_build_object('id', id, 'name', name, '_geo',
        CASE WHEN spot IS NULL THEN NULL
             ELSE jsonb_build_object('lat', ST_Y(spot::geometry), 'lng', ST_X(spot::geometry)) END)::text
   FROM places";

/// Points scattered over central Paris (about 8 × 6 km), none within 50 m of the 2 km circle the
/// search uses, so that the sphere Meilisearch measures on and PostGIS's cannot disagree on one.
const INSERT_PLACES: &str = "INSERT INTO places
  SELECT i, 'place ' || i,
         ST_MakePoint(2.30 + ((i * 7919) % 1000) / 9000.0, 48.83 + ((i * 104729) % 1000) / 18000.0)::geography
    FROM generate_series(FROM_ID, TO_ID) AS i";

fn insert_places(from: i64, to: i64) -> String {
    INSERT_PLACES
        .replace("FROM_ID", &from.to_string())
        .replace("TO_ID", &to.to_string())
}

const NEAR_BOUNDARY: &str = "DELETE FROM places
  WHERE abs(ST_Distance(spot, ST_MakePoint(2.3522, 48.8566)::geography, false) - 2000) < 50";

#[test]
fn points_become_geo_and_a_radius_search_returns_what_st_dwithin_returns() {
    let Some(cluster) = cluster_with_extension(
        "postgis",
        "scripts/setup.sh installs postgresql-15-postgis-3",
    ) else {
        return;
    };
    let meili = Meili::from_env();
    cluster.psql("CREATE TABLE places (id int PRIMARY KEY, name text, spot geography(Point))");
    cluster.psql(&insert_places(1, 400));
    cluster.psql("INSERT INTO places VALUES (401, 'nowhere', NULL)");
    cluster.psql(NEAR_BOUNDARY);

    // What cannot work is refused at the start, with the reason and a fitting SQLSTATE.
    let options = meili.options(json!({"geo": "name"}));
    let wrong_type = refusal(
        &cluster,
        &format!("SELECT meili_sync_start('places', 'places_name', '{options}')"),
    );
    assert_eq!(wrong_type.sqlstate, "0A000", "{wrong_type:?}");
    assert!(
        wrong_type.message.contains("not a PostGIS geometry"),
        "{wrong_type:?}"
    );
    let options = meili.options(json!({"geo": "spot", "exclude_columns": ["spot"]}));
    let excluded = refusal(
        &cluster,
        &format!("SELECT meili_sync_start('places', 'places_excluded', '{options}')"),
    );
    assert_eq!(excluded.sqlstate, "22023", "{excluded:?}");
    let options = meili.options(json!({"geo": "where"}));
    let missing = refusal(
        &cluster,
        &format!("SELECT meili_sync_start('places', 'places_missing', '{options}')"),
    );
    assert_eq!(missing.sqlstate, "42703", "{missing:?}");
    assert_eq!(
        cluster.psql("SELECT count(*) FROM meili_sync.tasks"),
        "0",
        "a refused start leaves nothing behind"
    );

    let (index, task) = start_task(&cluster, &meili, None, "places", json!({"geo": "spot"}));
    cluster.wait_snapshot_done(task, CONVERGE);
    wait_index_matches(&cluster, &meili, &index, PLACES);
    let settings = meili.request(Method::GET, &format!("/indexes/{index}/settings"), None);
    assert!(
        settings.1["filterableAttributes"]
            .as_array()
            .is_some_and(|fields| fields.contains(&json!("_geo"))),
        "{settings:?}"
    );

    // Streamed: inserts, a moved point, a point cleared, a deleted row.
    cluster.psql(&insert_places(402, 600));
    cluster.psql(NEAR_BOUNDARY);
    cluster.psql(
        "UPDATE places SET spot = ST_MakePoint(2.3530, 48.8570)::geography WHERE id = 5;
         UPDATE places SET spot = NULL WHERE id = 6;
         DELETE FROM places WHERE id = 7",
    );
    wait_index_matches(&cluster, &meili, &index, PLACES);
    assert_eq!(
        cluster.psql(&format!(
            "SELECT count(*) FROM meili_sync_dead_letters WHERE task = {task}"
        )),
        "0"
    );

    if meili.test_server().is_some() {
        eprintln!("radius searches skipped: the test server has no geo filters (they run on a real Meilisearch)");
        return;
    }
    for (lat, lng, meters) in [
        (48.8566, 2.3522, 2000),
        (48.86, 2.33, 800),
        (48.84, 2.36, 3500),
    ] {
        let want: Vec<i64> = cluster
            .psql(&format!(
                "SELECT id FROM places
                  WHERE ST_DWithin(spot, ST_MakePoint({lng}, {lat})::geography, {meters}, false)
                  ORDER BY id"
            ))
            .lines()
            .filter_map(|line| line.parse().ok())
            .collect();
        let have: Vec<i64> = cluster
            .psql(&format!(
                "SELECT (document->>'id')::int FROM meili_search({task}, '',
                   '{{\"filter\": \"_geoRadius({lat}, {lng}, {meters})\", \"limit\": 1000}}')
                  ORDER BY 1"
            ))
            .lines()
            .filter_map(|line| line.parse().ok())
            .collect();
        assert!(!want.is_empty(), "the query around {lat},{lng} finds rows");
        if meters == 2000 {
            assert_eq!(want, have, "_geoRadius({lat}, {lng}, {meters})");
        } else {
            // No margin was cut around these circles: allow a point on the boundary.
            let differ = want.iter().filter(|id| !have.contains(id)).count()
                + have.iter().filter(|id| !want.contains(id)).count();
            assert!(
                differ <= 1,
                "_geoRadius({lat}, {lng}, {meters}): want {want:?}, have {have:?}"
            );
        }
    }
}

const SHAPES: &str = "SELECT jsonb_build_object('id', id, 'name', name,
        CASE WHEN GeometryType(shape) = 'POINT' OR shape IS NULL THEN '_geo' ELSE '_geojson' END,
        CASE WHEN shape IS NULL THEN NULL
             WHEN GeometryType(shape) = 'POINT' THEN jsonb_build_object('lat', ST_Y(shape), 'lng', ST_X(shape))
             ELSE ST_AsGeoJSON(shape, 15)::jsonb END)::text
   FROM shapes WHERE ST_SRID(shape) = 4326 AND ST_YMax(shape) <= 90";

#[test]
fn other_geometries_become_geojson_and_unreadable_ones_are_dead_letters() {
    let Some(cluster) = cluster_with_extension(
        "postgis",
        "scripts/setup.sh installs postgresql-15-postgis-3",
    ) else {
        return;
    };
    let meili = Meili::from_env();
    cluster.psql("CREATE TABLE shapes (id int PRIMARY KEY, name text, shape geometry)");
    cluster.psql(
        "INSERT INTO shapes VALUES
           (1, 'square', 'SRID=4326;POLYGON((2.3 48.8, 2.4 48.8, 2.4 48.9, 2.3 48.9, 2.3 48.8))'),
           (2, 'route', 'SRID=4326;LINESTRING(2.29 48.85, 2.35 48.86, 2.37 48.84)'),
           (3, 'point', 'SRID=4326;POINT(2.2945 48.8584)'),
           (4, 'islands', 'SRID=4326;MULTIPOLYGON(((0 0, 1 0, 1 1, 0 0)), ((5 5, 6 5, 6 6, 5 5)))'),
           (5, 'mercator', 'SRID=3857;POINT(261600 6250000)'),
           (6, 'beyond the pole', 'SRID=4326;POINT(2.35 95)')",
    );

    // Upsert mode cannot clear `_geojson` when a shape becomes a point: refused for this column.
    let options = meili.options(json!({"geo": "shape", "write_mode": "upsert"}));
    let upsert = refusal(
        &cluster,
        &format!("SELECT meili_sync_start('shapes', 'shapes_upsert', '{options}')"),
    );
    assert_eq!(upsert.sqlstate, "22023", "{upsert:?}");
    assert!(upsert.hint.contains("replace"), "{upsert:?}");

    let (index, task) = start_task(&cluster, &meili, None, "shapes", json!({"geo": "shape"}));
    let to_upsert = refusal(
        &cluster,
        &format!("SELECT meili_sync_alter({task}, '{{\"write_mode\": \"upsert\"}}')"),
    );
    assert_eq!(to_upsert.sqlstate, "22023", "{to_upsert:?}");
    let other_column = refusal(
        &cluster,
        &format!("SELECT meili_sync_alter({task}, '{{\"geo\": \"name\"}}')"),
    );
    assert_eq!(other_column.sqlstate, "0A000", "{other_column:?}");
    cluster.wait_snapshot_done(task, CONVERGE);
    wait_index_matches(&cluster, &meili, &index, SHAPES);

    // Streamed: a shape becomes a point and a point a shape (replace mode drops the old field),
    // and a new row in another SRID is a dead letter too.
    cluster.psql(
        "UPDATE shapes SET shape = 'SRID=4326;POINT(2.35 48.85)' WHERE id = 1;
         UPDATE shapes SET shape = 'SRID=4326;POLYGON((2.2 48.8, 2.3 48.8, 2.3 48.9, 2.2 48.8))' WHERE id = 3;
         INSERT INTO shapes VALUES (7, 'lambert', 'SRID=2154;POINT(652000 6862000)'),
                                   (8, 'later', 'SRID=4326;POINT(-73.98 40.75)')",
    );
    wait_index_matches(&cluster, &meili, &index, SHAPES);
    let documents = indexed(&meili, &index);
    assert!(
        documents[&1].get("_geojson").is_none() && documents[&1]["_geo"]["lat"] == json!(48.85)
    );
    assert!(documents[&3].get("_geo").is_none() && documents[&3]["_geojson"]["type"] == "Polygon");

    let dead = wait_for("the dead letters of rows 5, 6 and 7", CONVERGE, || {
        let rows = cluster.psql(&format!(
            "SELECT document_id || ' ' || error_code || ' ' || error_message FROM meili_sync_dead_letters
              WHERE task = {task} ORDER BY document_id::int"
        ));
        (rows.lines().count() == 3).then_some(rows)
    });
    let lines: Vec<&str> = dead.lines().collect();
    assert!(
        lines[0].starts_with("5 invalid_document_geo_field") && lines[0].contains("SRID 3857"),
        "{dead}"
    );
    assert!(
        lines[1].starts_with("6 invalid_document_geo_field") && lines[1].contains("latitude 95"),
        "{dead}"
    );
    assert!(
        lines[2].starts_with("7 ") && lines[2].contains("SRID 2154"),
        "{dead}"
    );
    assert_eq!(
        cluster.status(task).get("state").map(String::as_str),
        Some("streaming")
    );
    // verify encodes the rows as the worker does: nothing missing or different, and the dead
    // letters are neither.
    assert_eq!(
        cluster.psql(&format!(
            "SELECT rows_checked || ' ' || missing || ' ' || extra || ' ' || different FROM meili_sync_verify({task})"
        )),
        "8 0 0 0"
    );

    // A retry while one row is still out of range is refused, naming it, and clears nothing;
    // once every row is fixed, the retry sends them all and the dead letters are gone.
    cluster.psql("UPDATE shapes SET shape = ST_Transform(shape, 4326) WHERE id IN (5, 7)");
    let still_bad = refusal(
        &cluster,
        &format!("SELECT meili_sync_retry_dead_letters({task})"),
    );
    assert_eq!(still_bad.sqlstate, "55000", "{still_bad:?}");
    assert!(still_bad.message.contains("latitude 95"), "{still_bad:?}");
    let dead_letters = || {
        cluster.psql(&format!(
            "SELECT count(*) FROM meili_sync_dead_letters WHERE task = {task}"
        ))
    };
    assert_eq!(dead_letters(), "3", "a refused retry clears nothing");
    cluster.psql("UPDATE shapes SET shape = 'SRID=4326;POINT(2.35 85)' WHERE id = 6");
    wait_index_matches(&cluster, &meili, &index, SHAPES);
    // The updates above streamed: the rows are in the index, and the retry sends them again.
    assert_eq!(
        cluster.psql(&format!("SELECT meili_sync_retry_dead_letters({task})")),
        "3"
    );
    assert_eq!(dead_letters(), "0");
    wait_index_matches(&cluster, &meili, &index, SHAPES);
    assert_eq!(indexed(&meili, &index).len(), 8);
}

/// A `geometry(Point, 4326)` column of a partitioned table: points become `_geo` through the
/// copy and the stream of every partition, a point beyond the pole is a dead letter of its
/// partition, and the rest lands.
#[test]
fn a_typed_point_column_of_a_partitioned_table_becomes_geo() {
    let Some(cluster) = cluster_with_extension(
        "postgis",
        "scripts/setup.sh installs postgresql-15-postgis-3",
    ) else {
        return;
    };
    let meili = Meili::from_env();
    cluster.psql(
        "CREATE TABLE stops (id int NOT NULL, line int NOT NULL, at geometry(Point, 4326),
                             PRIMARY KEY (id, line)) PARTITION BY LIST (line);
         CREATE TABLE stops_1 PARTITION OF stops FOR VALUES IN (1);
         CREATE TABLE stops_other PARTITION OF stops DEFAULT;
         INSERT INTO stops SELECT i, 1 + i % 3, ST_SetSRID(ST_MakePoint(2.3 + i / 1000.0, 48.8 + i / 2000.0), 4326)
           FROM generate_series(1, 60) i",
    );
    let query = "SELECT jsonb_build_object('_pk', id || '__' || line, 'id', id, 'line', line,
                        '_geo', jsonb_build_object('lat', ST_Y(at), 'lng', ST_X(at)))::text
                   FROM stops WHERE ST_Y(at) <= 90";
    let by_key = |documents: Vec<Value>| -> BTreeMap<String, Value> {
        documents
            .into_iter()
            .map(|document| {
                (
                    document["_pk"].as_str().unwrap_or_default().to_owned(),
                    document,
                )
            })
            .collect()
    };
    let (index, task) = start_task(&cluster, &meili, None, "stops", json!({"geo": "at"}));
    cluster.wait_snapshot_done(task, CONVERGE);
    cluster.psql(
        "INSERT INTO stops VALUES (61, 1, 'SRID=4326;POINT(2.35 48.86)'), (62, 2, 'SRID=4326;POINT(2.35 95)');
         UPDATE stops SET at = 'SRID=4326;POINT(-73.98 40.75)' WHERE id = 3",
    );
    let deadline = Instant::now() + CONVERGE;
    loop {
        let want = by_key(
            cluster
                .psql(query)
                .lines()
                .filter_map(|line| serde_json::from_str::<Value>(line).ok())
                .collect(),
        );
        let have = by_key(meili.all_documents(&index));
        let same_points = want.len() == have.len()
            && want.iter().all(|(key, document)| {
                have.get(key).is_some_and(|found| {
                    same(&found["_geo"], &document["_geo"]) && found.get("at").is_none()
                })
            });
        if same_points {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} rows, {} documents\n{}",
            want.len(),
            have.len(),
            cluster.tail_log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let dead = wait_for("the dead letter of row 62", CONVERGE, || {
        let rows = cluster.psql(&format!(
            "SELECT document_id || ' ' || error_code FROM meili_sync_dead_letters WHERE task = {task}"
        ));
        (!rows.is_empty()).then_some(rows)
    });
    assert_eq!(dead, "62__2 invalid_document_geo_field");

    // A partition attached with rows is read alone; its points come in as `_geo` too.
    cluster.psql(
        "CREATE TABLE stops_9 (LIKE stops INCLUDING ALL);
         INSERT INTO stops_9 VALUES (900, 9, 'SRID=4326;POINT(2.1 48.7)');
         ALTER TABLE stops ATTACH PARTITION stops_9 FOR VALUES IN (9)",
    );
    let geo_of = |index: &str, key: &str| {
        by_key(meili.all_documents(index))
            .get(key)
            .map(|document| document["_geo"].clone())
    };
    wait_for("the attached stop in the index", CONVERGE, || {
        geo_of(&index, "900__9")
            .filter(|geo| same(geo, &json!({"lat": 48.7, "lng": 2.1})))
            .map(|_| ())
    });

    // A view of the partitioned table with the option renders the view's point column as
    // `_geo`, in the copy and after a change.
    cluster.psql("CREATE VIEW line_one AS SELECT s.id, s.at FROM stops s WHERE s.line = 1");
    let (view_index, view_task) = start_task(
        &cluster,
        &meili,
        None,
        "line_one",
        json!({"primary_key": "id", "geo": "at"}),
    );
    cluster.wait_snapshot_done(view_task, CONVERGE);
    cluster.psql("UPDATE stops SET at = 'SRID=4326;POINT(2.2 48.9)' WHERE id = 3 AND line = 1");
    wait_for("the view's changed point", CONVERGE, || {
        let documents = meili.all_documents(&view_index);
        let three = documents
            .iter()
            .find(|document| document["id"] == json!(3))?;
        (same(&three["_geo"], &json!({"lat": 48.9, "lng": 2.2})) && three.get("at").is_none())
            .then_some(())
    });
    assert_eq!(
        meili.all_documents(&view_index).len().to_string(),
        cluster.psql("SELECT count(*) FROM line_one")
    );
    assert_no_crash(&cluster);
}
