//! Load command: measures pg_meili_sync against Meilisearch (the test server, or the real one at
//! MEILI_URL with MEILI_MASTER_KEY) and prints throughput, the task worker's CPU seconds and peak RSS.
//!
//!   cargo run --release -p pg_meili_sync_load -- backfill [rows] [batch_size] [max_inflight] [gzip 0|1] [snapshot_depth]
//!   cargo run --release -p pg_meili_sync_load -- stream [rows] [rows_per_transaction] [max_inflight] [stream_depth] [backlog 0/1]
//!   cargo run --release -p pg_meili_sync_load -- latency [transactions] [per_second]
//!   cargo run --release -p pg_meili_sync_load -- decoders [rows] [rows_per_transaction]
//!   cargo run --release -p pg_meili_sync_load -- tasks [idle_tasks] [rows] [shared 0|1]
//!   cargo run --release -p pg_meili_sync_load -- busy [busy_tasks] [rows] [decoder_memory MB]
//!   cargo run --release -p pg_meili_sync_load -- view [products] [new_products]
//!   cargo run --release -p pg_meili_sync_load -- fanout [parents] [children_per_parent] [rows_per_transaction]
//!   cargo run --release -p pg_meili_sync_load -- lookup [items] [categories] [transactions]
//!   cargo run --release -p pg_meili_sync_load -- hotrow [ids] [rounds]
//!   cargo run --release -p pg_meili_sync_load -- attach [table_rows] [attached_rows]
//!   cargo run --release -p pg_meili_sync_load -- schema [rows]
//!   cargo run --release -p pg_meili_sync_load -- search [rows] [seconds per query] [clients] [split cores 0|1]
//!   cargo run --release -p pg_meili_sync_load -- replicas [servers] [rows] [stream_rows]
//!   cargo run --release -p pg_meili_sync_load -- shards [servers] [rows] [stream_rows] [search_seconds]
//!
//! Set LOAD_VERIFY=1 to also check that the index holds exactly the table's rows afterwards.

mod decoders;
mod partitions;
mod replicas;
mod schema;
mod search;
mod shards;
mod views;

use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::{Meili, Method};
use pg_meili_sync_e2e::{products, start_with_options, wait_for, TaskStart};
use serde_json::json;

/// utime + stime of a process, in seconds (from /proc/PID/stat).
fn cpu_seconds(pid: i64) -> Option<f64> {
    stat_seconds(pid, 11)
}

/// cutime + cstime of a process, in seconds: the CPU of its children that have exited (for the
/// postmaster, of every backend gone since it started).
fn children_cpu_seconds(pid: i64) -> Option<f64> {
    stat_seconds(pid, 13)
}

/// Two adjacent tick counts of /proc/PID/stat, from the field `first` after the process name, in
/// seconds.
fn stat_seconds(pid: i64, first: usize) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: f64 =
        fields.get(first)?.parse::<f64>().ok()? + fields.get(first + 1)?.parse::<f64>().ok()?;
    let per_second = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()?;
    let per_second: f64 = String::from_utf8_lossy(&per_second.stdout)
        .trim()
        .parse()
        .ok()?;
    Some(ticks / per_second)
}

/// A memory figure of /proc/PID/status in MiB: VmHWM is the peak resident set (it includes the
/// shared buffers the backend touched), RssAnon the process's own memory now.
fn memory_mib(pid: i64, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with(field))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

struct Setup {
    meili: Meili,
    cluster: Cluster,
    index: String,
    task: i64,
}

fn setup(rows: i64, options: serde_json::Value) -> Setup {
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    if rows > 0 {
        cluster.psql(&products::insert_sql(1, rows));
    }
    cluster.psql("VACUUM ANALYZE products");
    let (index, task) = TaskStart::on("products")
        .index_named("products_load")
        .options(options)
        .start(&cluster, &meili);
    Setup {
        meili,
        cluster,
        index,
        task,
    }
}

fn worker_pid(setup: &Setup) -> i64 {
    setup
        .cluster
        .status(setup.task)
        .get("worker_pid")
        .and_then(|pid| pid.parse().ok())
        .unwrap_or(0)
}

fn report(setup: &Setup, what: &str, rows: i64, seconds: f64, cpu_before: f64) {
    let pid = worker_pid(setup);
    let target = if setup.meili.test_server().is_some() {
        "test server".to_owned()
    } else {
        setup.meili.url.clone()
    };
    println!("{what} into {target}");
    println!("rows              {rows}");
    println!("seconds           {seconds:.2}");
    println!("docs/s            {:.0}", rows as f64 / seconds);
    match cpu_seconds(pid) {
        Some(cpu) => {
            let cpu = cpu - cpu_before;
            println!(
                "worker CPU s      {cpu:.2} ({:.2} per 100k docs)",
                cpu * 100_000.0 / rows as f64
            );
        }
        None => println!("worker CPU s      unknown (worker pid {pid} not readable)"),
    }
    match (memory_mib(pid, "VmHWM:"), memory_mib(pid, "RssAnon:")) {
        (Some(peak), Some(anon)) => {
            println!("worker peak RSS   {peak:.1} MiB (incl. shared buffers; private memory now {anon:.1} MiB)")
        }
        _ => println!("worker peak RSS   unknown"),
    }
    if std::env::var_os("LOAD_VERIFY").is_some() {
        setup
            .meili
            .wait_idle(&setup.index, Duration::from_secs(3600));
        match products::diff_index(&setup.meili.all_documents(&setup.index), rows, 1) {
            Ok(()) => println!("verified: the index holds exactly the table's rows"),
            Err(problem) => println!("MISMATCH: {problem}"),
        }
    }
    if let Some(batches) = meili_batches(&setup.meili, &setup.index) {
        println!("{batches}");
    }
    if setup.meili.test_server().is_none() {
        setup.meili.delete_index(&setup.index);
    }
}

/// How Meilisearch indexed an index's tasks, from its own `GET /batches`: the number of batches,
/// the seconds they took between them, and the largest. None where the server has no batches
/// route (the test server).
fn meili_batches(meili: &Meili, index: &str) -> Option<String> {
    let (status, answer) = meili.request(
        Method::GET,
        &format!("/batches?indexUids={index}&limit=1000"),
        None,
    );
    let batches = answer["results"].as_array().filter(|_| status == 200)?;
    let document_batches: Vec<&serde_json::Value> = batches
        .iter()
        .filter(|batch| batch["stats"]["types"]["documentAdditionOrUpdate"].is_number())
        .collect();
    let seconds: f64 = document_batches
        .iter()
        .filter_map(|batch| batch["duration"].as_str())
        .filter_map(iso_duration_seconds)
        .sum();
    let largest = document_batches
        .iter()
        .filter_map(|batch| batch["stats"]["totalNbTasks"].as_u64())
        .max()
        .unwrap_or(0);
    // Oldest first: tasks, documents and seconds of each, to show how the auto-batcher was fed.
    let each: Vec<String> = document_batches
        .iter()
        .rev()
        .map(|batch| {
            format!(
                "{}x{} {:.1}s",
                batch["stats"]["totalNbTasks"].as_u64().unwrap_or(0),
                batch["details"]["receivedDocuments"].as_u64().unwrap_or(0),
                batch["duration"]
                    .as_str()
                    .and_then(iso_duration_seconds)
                    .unwrap_or(0.0)
            )
        })
        .collect();
    Some(format!(
        "meilisearch       {} document batches, {seconds:.1} s indexing between them, the largest of {largest} tasks (GET /batches; tasks x documents: {})",
        document_batches.len(),
        each.join(", ")
    ))
}

/// Seconds of an ISO 8601 duration as Meilisearch writes them (`PT1.234S`, `PT1M2.5S`).
fn iso_duration_seconds(text: &str) -> Option<f64> {
    let rest = text.strip_prefix("PT")?;
    let (minutes, rest) = match rest.split_once('M') {
        Some((minutes, rest)) => (minutes.parse::<f64>().ok()?, rest),
        None => (0.0, rest),
    };
    let seconds = match rest.strip_suffix('S') {
        Some(seconds) if !seconds.is_empty() => seconds.parse::<f64>().ok()?,
        _ => 0.0,
    };
    Some(minutes * 60.0 + seconds)
}

/// Meilisearch's own ingest ceiling in this run: the same documents (built by the data generator,
/// not the extension) posted straight to the same server as NDJSON, `batch_size` per task, all
/// enqueued at once (so that its auto-batcher makes the largest batches it can). Prints docs/s
/// and Meilisearch's batches, and returns the rate.
fn ceiling(meili: &Meili, rows: i64, batch_size: usize) -> f64 {
    let documents: Vec<String> = (1..=rows)
        .map(|id| products::expected_document(id, 1).to_string())
        .collect();
    ceiling_of(meili, &documents, batch_size, "products_ceiling")
}

/// Posts these documents (JSON lines) straight to Meilisearch, `batch_size` per task, all
/// enqueued at once; prints and returns docs/s.
fn ceiling_of(meili: &Meili, documents: &[String], batch_size: usize, prefix: &str) -> f64 {
    ceiling_over(meili, &[], documents, batch_size, prefix)
}

/// [`ceiling_of`] into an index that holds `earlier` first (posted and indexed before the clock
/// starts): the ceiling of updating documents that exist, which costs Meilisearch more than
/// adding them to an empty index.
fn ceiling_over(
    meili: &Meili,
    earlier: &[String],
    documents: &[String],
    batch_size: usize,
    prefix: &str,
) -> f64 {
    let index = meili.unique_index(prefix);
    let primed: Vec<u64> = ndjson_bodies(earlier, batch_size)
        .into_iter()
        .map(|body| meili.post_ndjson(&index, body).expect("post a batch"))
        .collect();
    for uid in primed {
        meili.wait_task(uid, Duration::from_secs(3600));
    }
    let bodies = ndjson_bodies(documents, batch_size);
    let started = Instant::now();
    let mut enqueued = Vec::new();
    for body in bodies {
        enqueued.push(meili.post_ndjson(&index, body).expect("post a batch"));
    }
    let count = documents.len();
    let over = if earlier.is_empty() {
        String::new()
    } else {
        format!(", into an index holding {} earlier ones", earlier.len())
    };
    finish_direct_feed(meili, &index, enqueued, started, count, "ceiling", &format!(
        "the same {count} documents posted straight to the same server, {batch_size} per task, all enqueued at once{over}"
    ))
}

/// These documents (JSON texts) as NDJSON request bodies of `batch_size` each.
fn ndjson_bodies(documents: &[String], batch_size: usize) -> Vec<Vec<u8>> {
    documents
        .chunks(batch_size.max(1))
        .map(|chunk| {
            let mut body = Vec::new();
            for document in chunk {
                body.extend_from_slice(document.as_bytes());
                body.push(b'\n');
            }
            body
        })
        .collect()
}

/// Waits for Meilisearch to finish the tasks of a feed that bypasses the extension, prints its
/// rate and batches under `label`, deletes its index, and returns documents per second.
fn finish_direct_feed(
    meili: &Meili,
    index: &str,
    enqueued: Vec<u64>,
    started: Instant,
    documents: usize,
    label: &str,
    what: &str,
) -> f64 {
    for uid in enqueued {
        meili.wait_task(uid, Duration::from_secs(3600));
    }
    let seconds = started.elapsed().as_secs_f64();
    let rate = documents as f64 / seconds;
    println!("{label:<17} {rate:.0} docs/s ({what}, in {seconds:.2} s)");
    if let Some(batches) = meili_batches(meili, index) {
        println!("{label} {batches}");
    }
    meili.delete_index(index);
    rate
}

fn backfill(rows: i64, batch_size: usize, max_inflight: usize, gzip: bool, depth: usize) {
    let setup = setup(
        rows,
        json!({"batch_size": batch_size, "max_inflight": max_inflight, "gzip": gzip, "snapshot_depth": depth}),
    );
    let started = Instant::now();
    // The worker's own memory (anonymous pages: not the shared buffers it reads), sampled while
    // it copies, since the kernel keeps a peak only for the whole resident set.
    // The status view is asked once a second only: each ask is a psql process and a backend,
    // CPU taken from Meilisearch on a small machine. The copy's own timestamps time it.
    let mut peak_private = 0.0f64;
    let mut pid = None;
    let mut last_status = Instant::now() - Duration::from_secs(1);
    wait_for("the copy to finish", Duration::from_secs(3600), || {
        if let Some(pid) = pid {
            peak_private = peak_private.max(memory_mib(pid, "RssAnon:").unwrap_or(0.0));
        }
        if last_status.elapsed() < Duration::from_secs(1) {
            return None;
        }
        last_status = Instant::now();
        let status = setup.cluster.status(setup.task);
        pid = status.get("worker_pid").and_then(|pid| pid.parse().ok());
        assert_ne!(
            status.get("state").map(String::as_str),
            Some("error"),
            "{status:?}"
        );
        (status.get("state").map(String::as_str) == Some("streaming")).then_some(())
    });
    // From meili_sync_start to the copy's end, by the catalog's clock (not the polling's).
    let seconds: f64 = setup
        .cluster
        .psql(&format!(
            "SELECT extract(epoch FROM snapshot_finished_at - created_at) FROM meili_sync.tasks WHERE id = {}",
            setup.task
        ))
        .parse()
        .unwrap_or_else(|_| started.elapsed().as_secs_f64());
    println!("worker private memory peak {peak_private:.1} MiB (RssAnon sampled every 100 ms)");
    report(
        &setup,
        &format!("backfill (batch_size {batch_size}, max_inflight {max_inflight}, gzip {gzip}, snapshot_depth {depth})"),
        rows,
        seconds,
        0.0,
    );
    // The copy alone, without the worker's start and the index creation before it.
    let copy_seconds: f64 = setup
        .cluster
        .psql(&format!(
            "SELECT extract(epoch FROM snapshot_finished_at - snapshot_started_at) FROM meili_sync.tasks WHERE id = {}",
            setup.task
        ))
        .parse()
        .unwrap_or(seconds);
    println!(
        "copy phase        {copy_seconds:.2} s, {:.0} docs/s (snapshot_started_at → snapshot_finished_at)",
        rows as f64 / copy_seconds
    );
    let rate = ceiling(&setup.meili, rows, batch_size);
    println!(
        "backfill/ceiling  {:.2} (copy phase/ceiling {:.2})",
        rows as f64 / seconds / rate,
        rows as f64 / copy_seconds / rate
    );
}

/// With `backlog`, the task is paused while the client commits and resumed after, and the time
/// counts from the resume: the whole burst is in the WAL at the start, as the ceiling's documents
/// are, so the stream is not paced by the client's commits.
fn stream(
    rows: i64,
    per_transaction: i64,
    max_inflight: usize,
    stream_depth: usize,
    backlog: bool,
) {
    let setup = setup(
        0,
        json!({"max_inflight": max_inflight, "stream_depth": stream_depth}),
    );
    setup
        .cluster
        .wait_snapshot_done(setup.task, Duration::from_secs(600));
    if backlog {
        setup
            .cluster
            .psql(&format!("SELECT meili_sync_pause({})", setup.task));
    }
    let mut cpu_before = cpu_seconds(worker_pid(&setup)).unwrap_or(0.0);
    let script: String = (0..rows / per_transaction)
        .map(|n| {
            format!(
                "{};\n",
                products::insert_sql(n * per_transaction + 1, (n + 1) * per_transaction)
            )
        })
        .collect();
    let mut started = Instant::now();
    setup.cluster.psql_script(&script);
    let committed = started.elapsed().as_secs_f64();
    if backlog {
        started = Instant::now();
        setup
            .cluster
            .psql(&format!("SELECT meili_sync_resume({})", setup.task));
        cpu_before = cpu_seconds(worker_pid(&setup)).unwrap_or(0.0);
    }
    wait_for("every row in the index", Duration::from_secs(3600), || {
        (setup.meili.document_count(&setup.index) == Some(rows as u64)).then_some(())
    });
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "(the client committed its {} transactions in {committed:.2} s)",
        rows / per_transaction
    );
    report(
        &setup,
        &format!(
            "stream ({per_transaction}-row transactions, max_inflight {max_inflight}, stream_depth {stream_depth}{})",
            if backlog { ", from a backlog" } else { "" }
        ),
        rows,
        seconds,
        cpu_before,
    );
    // The worker coalesces consecutive transactions into batches of up to batch_size (10,000).
    let rate = ceiling(&setup.meili, rows, 10_000);
    println!("stream/ceiling    {:.2}", rows as f64 / seconds / rate);
    if !backlog {
        let poster_rate = per_commit_poster(&setup, rows, per_transaction);
        println!(
            "stream/poster     {:.2}",
            rows as f64 / seconds / poster_rate
        );
    }
}

/// A live burst fed to Meilisearch without the extension, for comparison (not a ceiling: it does
/// not coalesce): the same client commits the same transactions into a
/// table with no task, and each transaction's documents (built by the data generator) are posted
/// the moment psql reports its commit, one task per transaction. The time counts from the
/// client's start to the last document indexed, as the stream's does, so the source's pace and
/// its inserts' CPU on the same cores are in both; what differs is only what the extension does.
fn per_commit_poster(setup: &Setup, rows: i64, per_transaction: i64) -> f64 {
    use std::io::BufRead;
    let meili = &setup.meili;
    let index = meili.unique_index("products_poster");
    setup
        .cluster
        .psql("CREATE TABLE products_live (LIKE products INCLUDING ALL)");
    let transactions = rows / per_transaction;
    let bodies: Vec<Vec<u8>> = (0..transactions)
        .map(|n| {
            let mut body = Vec::new();
            for id in n * per_transaction + 1..=(n + 1) * per_transaction {
                body.extend_from_slice(products::expected_document(id, 1).to_string().as_bytes());
                body.push(b'\n');
            }
            body
        })
        .collect();
    let script: String = (0..transactions)
        .map(|n| {
            let insert = products::insert_sql(n * per_transaction + 1, (n + 1) * per_transaction)
                .replacen("INSERT INTO products ", "INSERT INTO products_live ", 1);
            format!("{insert};\n\\echo {n}\n")
        })
        .collect();
    let started = Instant::now();
    let mut child = setup
        .cluster
        .psql_command()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start psql");
    let mut stdin = child.stdin.take().expect("psql's stdin");
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        stdin
            .write_all(script.as_bytes())
            .expect("write the script to psql");
    });
    let stdout = child.stdout.take().expect("psql's stdout");
    let mut enqueued = Vec::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.expect("read psql's output");
        let n: usize = line.trim().parse().expect("a transaction number");
        enqueued.push(
            meili
                .post_ndjson(&index, bodies[n].clone())
                .expect("post a transaction's documents"),
        );
    }
    writer.join().expect("the script writer");
    assert!(
        child.wait().expect("wait for psql").success(),
        "psql failed"
    );
    finish_direct_feed(meili, &index, enqueued, started, rows as usize, "per-commit poster", &format!(
        "the same client's {transactions} transactions into a table with no task, each posted straight to the same server as psql reported its commit"
    ))
}

/// Creates `count` tables `{prefix}_{n}` (with `create(n)`) and a task on each, into an index of
/// its own; returns the task ids and the indexes.
fn start_on_tables(
    cluster: &Cluster,
    meili: &Meili,
    options: &str,
    prefix: &str,
    count: usize,
    create: impl Fn(usize) -> String,
) -> (Vec<i64>, Vec<String>) {
    let mut tasks = Vec::new();
    let mut indexes = Vec::new();
    for n in 0..count {
        cluster.psql(&create(n));
        let index = meili.unique_index(&format!("{prefix}{n}"));
        let task = start_with_options(cluster, None, &format!("{prefix}_{n}"), &index, options);
        tasks.push(task);
        indexes.push(index);
    }
    (tasks, indexes)
}

/// One busy table beside `idle` tasks on tables nobody writes (with `views`, on views of such
/// tables), all with their own slot or all in the shared decoding pass: one transaction of `rows`
/// rows into the busy table, then the catch-up time (commit → every document in the busy index),
/// the CPU the busy worker and the idle workers spent on it (until every slot confirmed past the
/// commit), and the WAL the slots retain at the end. With their own slots the idle workers' CPU is
/// the price of one decoding pass per task.
fn tasks(idle: usize, rows: i64, shared: bool, views: bool) {
    let meili = Meili::from_env();
    let slots = format!("max_replication_slots={}", idle + 8);
    let workers = format!("max_worker_processes={}", idle + 8);
    let cluster = Cluster::start(&[&slots, &workers]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    let decoding = if shared { "shared" } else { "own" };
    let options = meili.options(json!({"decoding": decoding}));
    let (idle_tasks, mut indexes) = if views {
        let view_options = meili.options(json!({"decoding": decoding, "primary_key": "id"}));
        start_on_tables(&cluster, &meili, &view_options, "idle_view", idle, |n| {
            format!("CREATE TABLE idle_{n} (id int PRIMARY KEY, v text); INSERT INTO idle_{n} VALUES (1, 'x'); CREATE VIEW idle_view_{n} AS SELECT id, v FROM idle_{n}")
        })
    } else {
        start_on_tables(&cluster, &meili, &options, "idle", idle, |n| {
            format!("CREATE TABLE idle_{n} (id int PRIMARY KEY, v text); INSERT INTO idle_{n} VALUES (1, 'x')")
        })
    };
    let busy_index = meili.unique_index("busy");
    let busy: i64 = cluster
        .psql(&format!(
            "SELECT meili_sync_start('products', '{busy_index}', '{options}')"
        ))
        .parse()
        .expect("task id");
    indexes.push(busy_index.clone());
    for task in idle_tasks.iter().chain([&busy]) {
        cluster.wait_snapshot_done(*task, Duration::from_secs(600));
    }
    let pid_of = |task: i64| -> i64 {
        cluster
            .status(task)
            .get("worker_pid")
            .and_then(|pid| pid.parse().ok())
            .unwrap_or(0)
    };
    let busy_pid = pid_of(busy);
    // With shared decoding every task has the decoder's pid: the idle tasks have no process.
    let idle_pids: Vec<i64> = idle_tasks
        .iter()
        .map(|task| pid_of(*task))
        .filter(|pid| *pid != busy_pid)
        .collect();
    let cpu = |pids: &[i64]| -> f64 { pids.iter().filter_map(|pid| cpu_seconds(*pid)).sum() };
    let (busy_before, idle_before) = (cpu(&[busy_pid]), cpu(&idle_pids));
    let started = Instant::now();
    cluster.psql(&products::insert_sql(1, rows));
    let commit_lsn = cluster.psql("SELECT pg_current_wal_lsn()");
    wait_for(
        "every row in the busy index",
        Duration::from_secs(3600),
        || (meili.document_count(&busy_index) == Some(rows as u64)).then_some(()),
    );
    let catch_up = started.elapsed().as_secs_f64();
    wait_for(
        "every slot past the commit",
        Duration::from_secs(3600),
        || {
            let behind = cluster.psql(&format!(
            "SELECT count(*) FROM pg_replication_slots WHERE confirmed_flush_lsn < '{commit_lsn}'"
        ));
            (behind == "0").then_some(())
        },
    );
    let all_done = started.elapsed().as_secs_f64();
    let busy_cpu = cpu(&[busy_pid]) - busy_before;
    let idle_cpu = cpu(&idle_pids) - idle_before;
    let retained = cluster.psql(
        "SELECT pg_size_pretty(max(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn))) FROM pg_replication_slots",
    );
    let slots = cluster.psql("SELECT count(*) FROM pg_replication_slots");
    let target = if meili.test_server().is_some() {
        "test server".to_owned()
    } else {
        meili.url.clone()
    };
    let idle_kind = if views { "view" } else { "table" };
    println!("tasks: {idle} idle {idle_kind} tasks + 1 busy, decoding {decoding} ({slots} slots), one transaction of {rows} rows, into {target}");
    println!("catch-up          {catch_up:.2} s (commit → every document in the busy index)");
    println!("all slots past it {all_done:.2} s");
    println!("busy worker CPU   {busy_cpu:.2} s (the shared decoder's, idle tasks included, when shared)");
    println!(
        "idle workers CPU  {idle_cpu:.2} s in all ({:.0}% of the busy worker's)",
        100.0 * idle_cpu / busy_cpu.max(0.001)
    );
    println!("extension CPU     {:.2} s in all", busy_cpu + idle_cpu);
    println!("retained WAL      {retained} (the largest of the slots, after the catch-up)");
    if meili.test_server().is_none() {
        for index in &indexes {
            meili.delete_index(index);
        }
    }
}

/// `busy` shared tasks, each on a table of its own that gets one transaction of `rows` rows at the
/// same moment: the shared decoder's private memory (sampled while they catch up) against
/// `meili_sync.decoder_memory`, and the catch-up time. Without the budget, memory grows with the
/// number of busy tasks (each keeps up to `max_inflight` requests for a resend).
fn busy(tasks: usize, rows: i64, decoder_memory_mb: i64) {
    let meili = Meili::from_env();
    let budget = format!("meili_sync.decoder_memory={decoder_memory_mb}MB");
    // Postgres's reorder buffer (64 MB by default, in the same process) would hide ours.
    let cluster = Cluster::start(&[&budget, "logical_decoding_work_mem=4MB"]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, rows));
    let options = meili.options(json!({}));
    let (task_ids, indexes) = start_on_tables(&cluster, &meili, &options, "busy", tasks, |n| {
        format!("CREATE TABLE busy_{n} (LIKE products INCLUDING ALL)")
    });
    for task in &task_ids {
        cluster.wait_snapshot_done(*task, Duration::from_secs(600));
    }
    let pid: i64 = cluster
        .status(task_ids[0])
        .get("worker_pid")
        .and_then(|pid| pid.parse().ok())
        .unwrap_or(0);
    let cpu_before = cpu_seconds(pid).unwrap_or(0.0);
    let started = Instant::now();
    std::thread::scope(|scope| {
        for n in 0..tasks {
            let cluster = &cluster;
            scope.spawn(move || {
                cluster.psql(&format!("INSERT INTO busy_{n} SELECT * FROM products"))
            });
        }
    });
    let committed = started.elapsed().as_secs_f64();
    let mut peak = 0.0f64;
    let mut last_count = Instant::now() - Duration::from_secs(1);
    wait_for(
        "every row in every index",
        Duration::from_secs(3600),
        || {
            peak = peak.max(memory_mib(pid, "RssAnon:").unwrap_or(0.0));
            if last_count.elapsed() < Duration::from_secs(1) {
                return None;
            }
            last_count = Instant::now();
            indexes
                .iter()
                .all(|index| meili.document_count(index) == Some(rows as u64))
                .then_some(())
        },
    );
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pid).unwrap_or(0.0) - cpu_before;
    let target = if meili.test_server().is_some() {
        "test server".to_owned()
    } else {
        meili.url.clone()
    };
    println!("busy: {tasks} shared tasks, one transaction of {rows} rows each (committed in {committed:.2} s), meili_sync.decoder_memory {decoder_memory_mb} MB, logical_decoding_work_mem 4 MB, into {target}");
    println!("catch-up          {seconds:.2} s (first commit → every document in every index, counted once a second)");
    println!("decoder memory    private peak {peak:.1} MiB (RssAnon sampled every 100 ms)");
    println!("decoder CPU       {cpu:.2} s");
    for index in &indexes {
        if let Some(batches) = meili_batches(&meili, index) {
            println!("{index}: {batches}");
        }
    }
    if meili.test_server().is_none() {
        for index in &indexes {
            meili.delete_index(index);
        }
    }
}

fn latency(transactions: usize, per_second: u64) {
    let setup = setup(0, json!({}));
    setup
        .cluster
        .wait_snapshot_done(setup.task, Duration::from_secs(600));
    let interval = Duration::from_millis(1000 / per_second.max(1));
    // One session stays open, as an application's connection does: a sample's clock starts when
    // the INSERT is sent, not when a psql starts.
    let mut session = Session::open(&setup.cluster);
    let mut samples = Vec::with_capacity(transactions);
    for n in 1..=transactions as i64 {
        let started = Instant::now();
        session.run(&products::insert_sql(n, n));
        wait_searchable(&setup, n);
        let took = started.elapsed();
        samples.push(took);
        std::thread::sleep(interval.saturating_sub(took));
    }
    // From the INSERT to meili_sync_wait returning (confirmation noticed and published), in the
    // same session: the INSERT (its own transaction), then the wait.
    let mut waited = Vec::with_capacity(transactions);
    let offset = 2_000_000;
    for n in offset..offset + transactions as i64 {
        let started = Instant::now();
        session.run(&products::insert_sql(n, n));
        session.run(&format!("SELECT meili_sync_wait({})", setup.task));
        let took = started.elapsed();
        if took > Duration::from_secs(2) {
            // A wait far past the others: what the task and the server said meanwhile.
            eprintln!(
                "wait {n} took {took:?}; status: {}\n--- server log tail ---\n{}",
                setup.cluster.psql(&format!(
                    "SELECT row_to_json(s) FROM pg_stat_meili_sync s WHERE task = {}",
                    setup.task
                )),
                setup.cluster.tail_log()
            );
        }
        waited.push(took);
        std::thread::sleep(interval.saturating_sub(took));
    }
    // The server's own time from a one-document POST to the document being readable, for the
    // same documents: what no sync tool can go below.
    let mut direct = Vec::with_capacity(transactions);
    let base = transactions as i64 + 1_000_000;
    for n in base..base + transactions as i64 {
        let started = Instant::now();
        let body = format!("{}\n", products::expected_document(n, 1)).into_bytes();
        setup
            .meili
            .post_ndjson(&setup.index, body)
            .expect("post a document");
        wait_searchable(&setup, n);
        let took = started.elapsed();
        direct.push(took);
        std::thread::sleep(interval.saturating_sub(took));
    }
    let ours = percentiles(samples);
    let waits = percentiles(waited);
    let server = percentiles(direct);
    println!(
        "commit → searchable latency over {transactions} one-row transactions at {per_second}/s"
    );
    println!("                  pg_meili_sync   meili_sync_wait returned   server alone (POST → readable)");
    for (label, index) in [("p50 ms", 0), ("p99 ms", 1), ("max ms", 2)] {
        println!(
            "{label:<17} {:>13.1}   {:>24.1}   {:>13.1}",
            ours[index], waits[index], server[index]
        );
    }
    println!(
        "p50 above the server's own: {:.1} ms (flush_interval_ms is 200; a caught-up worker sends at once)",
        ours[0] - server[0]
    );
    println!("(ours from the INSERT sent on an open session, its COMMIT included)");
}

/// A psql session kept open; each statement runs in a transaction of its own (autocommit).
struct Session {
    child: std::process::Child,
    input: std::process::ChildStdin,
    output: std::io::BufReader<std::process::ChildStdout>,
}

impl Session {
    fn open(cluster: &Cluster) -> Session {
        let mut child = cluster
            .psql_command()
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start psql");
        let input = child.stdin.take().expect("psql's stdin");
        let output = std::io::BufReader::new(child.stdout.take().expect("psql's stdout"));
        Session {
            child,
            input,
            output,
        }
    }

    /// Runs `sql` and returns once psql has its answer (a marker echoed after it).
    fn run(&mut self, sql: &str) {
        use std::io::{BufRead, Write};
        writeln!(self.input, "{sql};\n\\echo statement-done").expect("write to psql");
        self.input.flush().expect("flush psql's stdin");
        let mut line = String::new();
        loop {
            line.clear();
            let read = self
                .output
                .read_line(&mut line)
                .expect("read psql's answer");
            assert!(read > 0, "psql ended (ON_ERROR_STOP) running: {sql}");
            if line.trim_end() == "statement-done" {
                return;
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_searchable(setup: &Setup, id: i64) {
    loop {
        let (status, _) = setup.meili.request(
            Method::GET,
            &format!("/indexes/{}/documents/{id}", setup.index),
            None,
        );
        if status == 200 {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// p50, p99 and max in milliseconds.
fn percentiles(mut samples: Vec<Duration>) -> [f64; 3] {
    samples.sort();
    let at = |p: f64| {
        samples
            .get(((samples.len() as f64 * p) as usize).min(samples.len().saturating_sub(1)))
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    [at(0.50), at(0.99), at(1.0)]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "backfill".to_owned());
    let numbers: Vec<i64> = args.filter_map(|arg| arg.parse().ok()).collect();
    let arg = |index: usize, default: i64| numbers.get(index).copied().unwrap_or(default);
    match mode.as_str() {
        "backfill" => backfill(
            arg(0, 200_000),
            arg(1, 10_000) as usize,
            arg(2, 8) as usize,
            arg(3, 0) != 0,
            arg(4, 32) as usize,
        ),
        "stream" => stream(
            arg(0, 50_000),
            arg(1, 500),
            arg(2, 8) as usize,
            arg(3, 32) as usize,
            arg(4, 0) != 0,
        ),
        "latency" => latency(arg(0, 200) as usize, arg(1, 10) as u64),
        "decoders" => decoders::run(arg(0, 200_000), arg(1, 500)),
        "tasks" => tasks(
            arg(0, 10) as usize,
            arg(1, 200_000),
            arg(2, 0) != 0,
            arg(3, 0) != 0,
        ),
        "busy" => busy(arg(0, 4) as usize, arg(1, 100_000), arg(2, 256)),
        "view" => views::view(arg(0, 100_000), arg(1, 20_000)),
        "fanout" => views::fanout(arg(0, 1000), arg(1, 20), arg(2, 500)),
        "lookup" => views::lookup(arg(0, 400_000), arg(1, 50), arg(2, 2000)),
        "hotrow" => views::hot_rows(arg(0, 1000), arg(1, 100)),
        "attach" => partitions::attach(arg(0, 500_000), arg(1, 20_000)),
        "schema" => schema::drop_column(arg(0, 200_000)),
        "replicas" => replicas::replicas(arg(0, 3) as usize, arg(1, 200_000), arg(2, 100_000)),
        "shards" => shards::shards(
            arg(0, 3) as usize,
            arg(1, 200_000),
            arg(2, 100_000),
            arg(3, 10) as u64,
        ),
        "search" => search::search(
            arg(0, 200_000),
            arg(1, 10) as u64,
            arg(2, 10) as usize,
            arg(3, 0) != 0,
        ),
        other => {
            eprintln!(
                "unknown mode {other}: use backfill, stream, latency, decoders, tasks, busy, view, fanout, lookup, hotrow, attach, schema, search, replicas or shards"
            );
            std::process::exit(2);
        }
    }
}
