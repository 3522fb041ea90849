//! Load modes for documents from several tables (views) and for hot documents:
//! - `view`: backfill and streaming of a products-with-brand-tags-and-reviews view, each against
//!   the same-run ceiling (the view's own documents, read with `to_jsonb`, posted straight);
//! - `fanout`: parents × children, children updated in large transactions: documents rendered
//!   per child change, and a hot parent whose children change many times in one window;
//! - `hotrow`: a plain table whose rows are each updated many times in a burst, against posting
//!   every change's document straight (what a sync that sends every change would have to do).

use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::{Meili, Method};
use pg_meili_sync_e2e::{products, wait_for, TaskStart};
use serde_json::json;

use crate::{ceiling_of, ceiling_over, meili_batches};

const SHOP: &str = r#"
CREATE TABLE brands (id int PRIMARY KEY, name text);
CREATE TABLE products (id int PRIMARY KEY, name text, brand_id int REFERENCES brands, price numeric,
                       deleted bool NOT NULL DEFAULT false,
                       created_at timestamptz NOT NULL DEFAULT '2024-01-01 00:00:00+00');
CREATE TABLE tags (id int PRIMARY KEY, label text);
CREATE TABLE product_tags (product_id int REFERENCES products ON DELETE CASCADE,
                           tag_id int REFERENCES tags ON DELETE CASCADE, PRIMARY KEY (product_id, tag_id));
CREATE INDEX ON product_tags (tag_id);
CREATE TABLE reviews (id bigint PRIMARY KEY, product_id int NOT NULL REFERENCES products ON DELETE CASCADE,
                      stars int);
CREATE INDEX ON reviews (product_id);
ALTER TABLE reviews REPLICA IDENTITY FULL;
CREATE INDEX ON products (brand_id);
CREATE VIEW product_documents AS
SELECT p.id, p.name, b.name AS brand, p.price,
       extract(epoch FROM p.created_at)::bigint AS created_unix,
       (SELECT coalesce(json_agg(t.label ORDER BY t.label), '[]'::json)
          FROM product_tags pt JOIN tags t ON t.id = pt.tag_id WHERE pt.product_id = p.id) AS tags,
       (SELECT count(*) FROM reviews r WHERE r.product_id = p.id) AS review_count,
       (SELECT round(avg(r.stars), 2) FROM reviews r WHERE r.product_id = p.id) AS stars
  FROM products p LEFT JOIN brands b ON b.id = p.brand_id
 WHERE NOT p.deleted;
INSERT INTO brands SELECT i, 'Brand ' || i FROM generate_series(1, 100) i;
INSERT INTO tags SELECT i, 'tag-' || i FROM generate_series(1, 200) i;
"#;

/// Products `from..=to`, each with 3 tags and 2 reviews.
fn shop_rows(from: i64, to: i64) -> String {
    format!(
        "INSERT INTO products (id, name, brand_id, price, created_at)
         SELECT i, 'Product ' || i, 1 + i % 100, (i % 1000) / 10.0,
                timestamptz '2024-01-01 00:00:00+00' + i * interval '1 minute'
           FROM generate_series({from}, {to}) i;
         INSERT INTO product_tags SELECT i, 1 + (i + k * 67) % 200 FROM generate_series({from}, {to}) i, generate_series(0, 2) k;
         INSERT INTO reviews SELECT 2 * i + k, i, 1 + (i + k) % 5 FROM generate_series({from}, {to}) i, generate_series(0, 1) k;"
    )
}

const MAPPINGS: &str = r#"{
    "brands": "SELECT p.id FROM public.products p WHERE p.brand_id = ANY($1::int[])",
    "tags": "SELECT pt.product_id FROM public.product_tags pt WHERE pt.tag_id = ANY($1::int[])"
}"#;

fn start(
    cluster: &Cluster,
    meili: &Meili,
    source: &str,
    options: serde_json::Value,
) -> (String, i64) {
    TaskStart::on(source)
        .index_named("view_load")
        .options(options)
        .start(cluster, meili)
}

fn target(meili: &Meili) -> String {
    if meili.test_server().is_some() {
        "test server".to_owned()
    } else {
        meili.url.clone()
    }
}

/// The view's rows as Postgres writes them (`to_jsonb`), the documents of the ceiling.
fn view_documents(cluster: &Cluster, view: &str, condition: &str) -> Vec<String> {
    cluster
        .psql(&format!(
            "SELECT to_jsonb(v)::text FROM {view} v WHERE {condition} ORDER BY id"
        ))
        .lines()
        .map(str::to_owned)
        .collect()
}

/// A counter of the task's status row.
fn status_number(cluster: &Cluster, task: i64, column: &str) -> i64 {
    cluster
        .status(task)
        .get(column)
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
}

/// Waits until the task confirmed every change committed so far (its confirmed position passed
/// the WAL insert position taken now, which is the end of the last commit when nothing else was
/// written since): the time the extension needed, without the cost of checking.
fn wait_confirmed(cluster: &Cluster, task: i64) {
    let flushed = cluster.psql("SELECT pg_current_wal_insert_lsn()");
    wait_for(
        "the task to confirm every change",
        Duration::from_secs(3600),
        || {
            (cluster.psql(&format!(
            "SELECT coalesce(confirmed_lsn::pg_lsn >= '{flushed}'::pg_lsn, false) FROM meili_sync_status WHERE task = {task}"
        )) == "t")
            .then_some(())
        },
    );
}

/// Waits until `meili_sync_verify` finds the index equal to the source.
fn wait_equal(cluster: &Cluster, task: i64) {
    wait_for(
        "the index to equal the view",
        Duration::from_secs(3600),
        || {
            (cluster.psql(&format!(
                "SELECT missing + extra + different FROM meili_sync_verify({task})"
            )) == "0")
                .then_some(())
        },
    );
}

pub fn view(rows: i64, new_rows: i64) {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql_script(SHOP);
    cluster.psql_script(&shop_rows(1, rows));
    cluster.psql("VACUUM ANALYZE");
    let mappings: serde_json::Value = serde_json::from_str(MAPPINGS).expect("mappings JSON");
    let (index, task) = start(
        &cluster,
        &meili,
        "product_documents",
        json!({"primary_key": "id", "mappings": mappings}),
    );
    cluster.wait_snapshot_done(task, Duration::from_secs(3600));
    let seconds: f64 = cluster
        .psql(&format!(
            "SELECT extract(epoch FROM snapshot_finished_at - created_at) FROM meili_sync.tasks WHERE id = {task}"
        ))
        .parse()
        .unwrap_or(0.0);
    println!("view backfill into {}", target(&meili));
    println!("documents         {rows} (products with brand, 3 tags and 2 reviews each)");
    println!("seconds           {seconds:.2}");
    println!("docs/s            {:.0}", rows as f64 / seconds);
    if let Some(batches) = meili_batches(&meili, &index) {
        println!("{batches}");
    }
    let documents = view_documents(&cluster, "product_documents", "true");
    let rate = ceiling_of(&meili, &documents, 10_000, "view_ceiling");
    println!("view backfill/ceiling {:.2}", rows as f64 / seconds / rate);

    // Streaming: new products with their children, 500 a transaction.
    let script: String = (0..new_rows / 500)
        .map(|n| {
            let from = rows + 1 + n * 500;
            format!("BEGIN;\n{}\nCOMMIT;\n", shop_rows(from, from + 499))
        })
        .collect();
    let total = rows + new_rows / 500 * 500;
    let batches_before = meili_batches(&meili, &index);
    let started = Instant::now();
    cluster.psql_script(&script);
    let committed = started.elapsed().as_secs_f64();
    wait_for("every new document", Duration::from_secs(3600), || {
        (meili.document_count(&index) == Some(total as u64)).then_some(())
    });
    let seconds = started.elapsed().as_secs_f64();
    let streamed = total - rows;
    println!("view stream       {streamed} new products with children in 500-product transactions: {seconds:.2} s, {:.0} docs/s (the client committed them in {committed:.2} s)", streamed as f64 / seconds);
    if let (Some(before), Some(after)) = (batches_before, meili_batches(&meili, &index)) {
        println!("before the stream {before}\nafter the stream  {after}");
    }
    let documents = view_documents(&cluster, "product_documents", &format!("id > {rows}"));
    let rate = ceiling_of(&meili, &documents, 10_000, "view_stream_ceiling");
    println!(
        "view stream/ceiling {:.2}",
        streamed as f64 / seconds / rate
    );
    wait_equal(&cluster, task);
    println!("verified: meili_sync_verify finds the index equal to the view");
    if meili.test_server().is_none() {
        meili.delete_index(&index);
    }
}

pub fn fanout(parents: i64, children: i64, per_transaction: i64) {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql_script(&format!(
        "CREATE TABLE parents (id int PRIMARY KEY, name text);
         CREATE TABLE children (id int PRIMARY KEY, parent_id int NOT NULL REFERENCES parents, value int NOT NULL);
         CREATE INDEX ON children (parent_id);
         ALTER TABLE children REPLICA IDENTITY FULL;
         CREATE VIEW parent_documents AS
         SELECT p.id, p.name, (SELECT count(*) FROM children c WHERE c.parent_id = p.id) AS children,
                (SELECT sum(c.value) FROM children c WHERE c.parent_id = p.id) AS total
           FROM parents p;
         INSERT INTO parents SELECT i, 'Parent ' || i FROM generate_series(1, {parents}) i;
         INSERT INTO children SELECT i, 1 + (i - 1) / {children}, 0 FROM generate_series(1, {}) i;
         VACUUM ANALYZE;",
        parents * children
    ));
    let (index, task) = start(
        &cluster,
        &meili,
        "parent_documents",
        json!({"primary_key": "id"}),
    );
    cluster.wait_snapshot_done(task, Duration::from_secs(3600));
    wait_equal(&cluster, task);
    println!("fan-out into {}", target(&meili));

    // Every child updated once, in transactions of `per_transaction` consecutive children.
    let changes = parents * children;
    let sent_before = status_number(&cluster, task, "documents_sent");
    let script: String = (0..changes / per_transaction)
        .map(|n| {
            format!(
                "UPDATE children SET value = value + 1 WHERE id BETWEEN {} AND {};\n",
                n * per_transaction + 1,
                (n + 1) * per_transaction
            )
        })
        .collect();
    let started = Instant::now();
    cluster.psql_script(&script);
    wait_confirmed(&cluster, task);
    let seconds = started.elapsed().as_secs_f64();
    wait_equal(&cluster, task);
    let sent = status_number(&cluster, task, "documents_sent") - sent_before;
    println!(
        "child changes     {changes} ({parents} parents x {children} children, {per_transaction}-row transactions) in {seconds:.2} s"
    );
    println!(
        "documents sent    {sent}: {:.4} per child change, {:.2} per parent",
        sent as f64 / changes as f64,
        sent as f64 / parents as f64
    );

    // A hot parent: its children changed 500 times in one transaction, then 100 transactions of
    // one change each, committed back to back.
    let sent_before = status_number(&cluster, task, "documents_sent");
    let hot: String = (0..500)
        .map(|n| {
            format!(
                "UPDATE children SET value = value + 1 WHERE id = {};",
                1 + n % children
            )
        })
        .collect();
    cluster.psql(&format!("BEGIN; {hot} COMMIT;"));
    wait_equal(&cluster, task);
    let one_transaction = status_number(&cluster, task, "documents_sent") - sent_before;
    let sent_before = status_number(&cluster, task, "documents_sent");
    let started = Instant::now();
    let script: String = (0..100)
        .map(|n| {
            format!(
                "UPDATE children SET value = value + 1 WHERE id = {};\n",
                1 + n % children
            )
        })
        .collect();
    cluster.psql_script(&script);
    let committed = started.elapsed().as_secs_f64();
    wait_equal(&cluster, task);
    let many_transactions = status_number(&cluster, task, "documents_sent") - sent_before;
    println!("hot parent        500 child changes in one transaction: {one_transaction} document(s) sent");
    println!(
        "hot parent        100 one-change transactions in {committed:.2} s (flush interval 200 ms: at most {:.0} windows): {many_transactions} document(s) sent",
        (committed / 0.2).ceil() + 1.0
    );
    if meili.test_server().is_none() {
        meili.delete_index(&index);
    }
}

pub fn hot_rows(ids: i64, rounds: i64) {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, ids));
    let (index, task) = start(&cluster, &meili, "products", json!({}));
    cluster.wait_snapshot_done(task, Duration::from_secs(3600));
    wait_equal(&cluster, task);
    let sent_before = status_number(&cluster, task, "documents_sent");
    // Each round updates every row once, in transactions of 100 rows: each row changes `rounds`
    // times in the burst.
    let script: String = (0..rounds)
        .flat_map(|_| {
            (0..ids / 100).map(|n| {
                format!(
                    "UPDATE products SET version = version + 1 WHERE id BETWEEN {} AND {};\n",
                    n * 100 + 1,
                    (n + 1) * 100
                )
            })
        })
        .collect();
    let changes = ids / 100 * 100 * rounds;
    let started = Instant::now();
    cluster.psql_script(&script);
    let committed = started.elapsed().as_secs_f64();
    let last_version = rounds + 1;
    wait_for(
        "every row's last version",
        Duration::from_secs(3600),
        || {
            meili
                .all_documents(&index)
                .iter()
                .all(|document| document["version"].as_i64() == Some(last_version))
                .then_some(())
        },
    );
    let seconds = started.elapsed().as_secs_f64();
    wait_equal(&cluster, task);
    let sent = status_number(&cluster, task, "documents_sent") - sent_before;
    println!("hot rows into {}", target(&meili));
    println!(
        "row changes       {changes} ({ids} rows x {rounds} updates each, 100-row transactions; the client committed them in {committed:.2} s, {:.1} updates per row per second)",
        rounds as f64 / committed
    );
    println!(
        "extension         {seconds:.2} s to an index equal to the table, {:.0} changes/s, {sent} documents sent ({:.3} per change)",
        changes as f64 / seconds,
        sent as f64 / changes as f64
    );
    // What sending every change costs: each change's document, in commit order, posted straight.
    let documents: Vec<String> = (2..=rounds + 1)
        .flat_map(|version| {
            (1..=ids / 100 * 100)
                .map(move |id| products::expected_document(id, version).to_string())
        })
        .collect();
    let rate = ceiling_of(&meili, &documents, 10_000, "hotrow_every_change");
    println!(
        "extension/every-change {:.2} (changes/s of the extension over changes/s of posting every change straight)",
        changes as f64 / seconds / rate
    );
    if meili.test_server().is_none() {
        meili.delete_index(&index);
    }
}

/// A view of `items` items over `categories` categories, each renamed category mapping to every
/// item of it (`items / categories` documents). The task is paused while `transactions`
/// transactions rename a category (in turn) and retitle 10 random items each, then resumed: the
/// catch-up's documents rendered per second against the same-run ceiling (the view's documents
/// posted straight), and how many times each document was rendered.
pub fn lookup(items: i64, categories: i64, transactions: i64) {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql_script(&format!(
        "CREATE TABLE categories (id int PRIMARY KEY, name text NOT NULL);
         CREATE TABLE items (id int PRIMARY KEY, category_id int NOT NULL REFERENCES categories, title text NOT NULL,
                             price int NOT NULL);
         CREATE INDEX ON items (category_id);
         CREATE VIEW item_documents AS
         SELECT i.id, i.title, i.price, c.name AS category
           FROM items i JOIN categories c ON c.id = i.category_id;
         INSERT INTO categories SELECT g, 'category ' || g FROM generate_series(1, {categories}) g;
         INSERT INTO items SELECT g, 1 + g % {categories}, 'item ' || g, g % 1000 FROM generate_series(1, {items}) g;
         VACUUM ANALYZE;"
    ));
    let (index, task) = start(
        &cluster,
        &meili,
        "item_documents",
        json!({"primary_key": "id", "mappings": {
            "categories": "SELECT i.id FROM public.items i WHERE i.category_id = ANY($1::int[])"
        }}),
    );
    cluster.wait_snapshot_done(task, Duration::from_secs(3600));
    wait_equal(&cluster, task);
    let copied = view_documents(&cluster, "item_documents", "true");
    println!("lookup fan-out into {}", target(&meili));
    cluster.psql(&format!("SELECT meili_sync_pause({task})"));
    let script: String = (0..transactions)
        .map(|n| {
            format!(
                "BEGIN; UPDATE categories SET name = 'category {} v{n}' WHERE id = {};
                 UPDATE items SET price = price + 1 WHERE id = ANY (ARRAY(SELECT 1 + (random() * {})::int FROM generate_series(1, 10)));
                 COMMIT;\n",
                n % categories + 1,
                n % categories + 1,
                items - 1
            )
        })
        .collect();
    cluster.psql_script(&script);
    let sent_before = status_number(&cluster, task, "documents_sent");
    let tasks_before = meili_task_uids(&meili, &index).into_iter().max();
    let resumed_at =
        cluster.psql("SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'HH24:MI:SS.US')");
    let started = Instant::now();
    cluster.psql(&format!("SELECT meili_sync_resume({task})"));
    wait_confirmed(&cluster, task);
    let seconds = started.elapsed().as_secs_f64();
    wait_equal(&cluster, task);
    let sent = status_number(&cluster, task, "documents_sent") - sent_before;
    let rate = sent as f64 / seconds;
    println!(
        "catch-up          {transactions} transactions (a category renamed and 10 items changed in each) in {seconds:.2} s"
    );
    println!(
        "documents sent    {sent}: {:.2} per document of the view, {rate:.0} per second",
        sent as f64 / items as f64
    );
    if let Some(batches) = meili_batches(&meili, &index) {
        println!("{batches} (the copy's first)");
    }
    print_timeline(&meili, &index, tasks_before, &resumed_at);
    let documents = view_documents(&cluster, "item_documents", "true");
    // The catch-up updates documents that are in the index: so does its ceiling.
    let ceiling = ceiling_over(&meili, &copied, &documents, 10_000, "lookup_ceiling");
    let into_empty = ceiling_of(&meili, &documents, 10_000, "lookup_ceiling_empty");
    println!(
        "ratio             {:.2} of the ceiling ({:.2} of the ceiling into an empty index)",
        rate / ceiling,
        rate / into_empty
    );
    if meili.test_server().is_none() {
        meili.delete_index(&index);
    }
}

/// The uids of an index's tasks in Meilisearch.
fn meili_task_uids(meili: &Meili, index: &str) -> Vec<u64> {
    let (_, answer) = meili.request(
        Method::GET,
        &format!("/tasks?indexUids={index}&limit=1000"),
        None,
    );
    answer["results"]
        .as_array()
        .map(|tasks| {
            tasks
                .iter()
                .filter_map(|task| task["uid"].as_u64())
                .collect()
        })
        .unwrap_or_default()
}

/// When each of the index's tasks after `after` was enqueued, started and finished, in seconds
/// from `since` (a UTC time of day, HH:MM:SS.ffffff): where a catch-up's time went. Nothing on
/// the test server, which keeps no such times.
fn print_timeline(meili: &Meili, index: &str, after: Option<u64>, since: &str) {
    let (_, answer) = meili.request(
        Method::GET,
        &format!("/tasks?indexUids={index}&limit=1000"),
        None,
    );
    let Some(since) = seconds_of_day(since) else {
        return;
    };
    let at = |task: &serde_json::Value, field: &str| {
        task[field]
            .as_str()
            .and_then(|time| time.split_once('T'))
            .and_then(|(_, time)| seconds_of_day(time.trim_end_matches('Z')))
            .map_or("-".to_owned(), |seconds| format!("{:.2}", seconds - since))
    };
    let mut lines: Vec<String> = answer["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|task| task["uid"].as_u64() > after)
        .map(|task| {
            format!(
                "  task {} ({} documents): enqueued {}, started {}, finished {}",
                task["uid"],
                task["details"]["receivedDocuments"],
                at(task, "enqueuedAt"),
                at(task, "startedAt"),
                at(task, "finishedAt")
            )
        })
        .collect();
    lines.reverse();
    if !lines.is_empty() {
        println!("timeline (s from the resume):\n{}", lines.join("\n"));
    }
}

/// Seconds since midnight of a time of day `HH:MM:SS[.fraction]`.
fn seconds_of_day(time: &str) -> Option<f64> {
    let mut parts = time.splitn(3, ':');
    let hours: f64 = parts.next()?.parse().ok()?;
    let minutes: f64 = parts.next()?.parse().ok()?;
    let seconds: f64 = parts.next()?.parse().ok()?;
    Some(hours * 3600.0 + minutes * 60.0 + seconds)
}
