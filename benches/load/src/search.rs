//! The `search` mode: searching through SQL (`meili_search`, driven by pgbench) against searching
//! Meilisearch directly over HTTP (the same bodies, from wrk with kept-alive connections), with the
//! same concurrency for the same time, in one run; then the latency of
//! `meili_sync_wait` from an INSERT's COMMIT to its return.

use std::path::Path;
use std::time::Duration;

use crate::{children_cpu_seconds, cpu_seconds};
use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{products, wait_for, TaskStart};
use serde_json::json;

/// The query mix of an autocomplete benchmark, over the `products` data set.
const QUERIES: [(&str, &str); 5] = [
    ("one letter", "p"),
    ("a word that matches", "kitchen"),
    ("a word that matches nothing", "zzyzxq"),
    ("two words, the second a prefix", "product 12"),
    ("two words that match nothing", "zzyzxq qwvutz"),
];

/// A statement of the same shape that calls nothing outside Postgres: what Postgres itself costs
/// a call.
const BARE_STATEMENT: &str = "SELECT count(*) FROM generate_series(1, 10);\n";

/// The postmaster of a cluster (the first line of its postmaster.pid).
fn postmaster_pid(cluster: &Cluster) -> i64 {
    std::fs::read_to_string(cluster.data_dir.join("postmaster.pid"))
        .ok()
        .and_then(|text| text.lines().next()?.trim().parse().ok())
        .expect("the postmaster's pid")
}

/// The Meilisearch process listening at `url`, when it is a process of this machine started with
/// `--http-addr` (a real server; the test server runs inside this process).
fn meilisearch_pid(url: &str) -> Option<i64> {
    let address = url.trim_start_matches("http://").trim_end_matches('/');
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: i64 = entry.file_name().to_str()?.parse().ok()?;
            let command = std::fs::read(entry.path().join("cmdline")).ok()?;
            let arguments: Vec<&[u8]> = command.split(|byte| *byte == 0).collect();
            arguments
                .windows(2)
                .any(|pair| pair[0] == b"--http-addr" && pair[1] == address.as_bytes())
                .then_some(pid)
        })
}

/// Pins Meilisearch's threads to CPU 0, and the postmaster with every backend, this process and the
/// clients it starts (pgbench, wrk) to the other CPUs: Meilisearch on a host of its own, as it runs
/// in production, so that the ratio measures what a search through SQL adds to Meilisearch's work,
/// not which processes win a shared core. Panics when the machine has one CPU or `taskset` fails.
fn split_cores(postmaster: i64, meilisearch: i64) {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    assert!(cpus >= 2, "split cores needs at least two CPUs");
    let others = format!("1-{}", cpus - 1);
    let pin = |cpu_list: &str, pid: i64| {
        let status = std::process::Command::new("taskset")
            .args(["-a", "-p", "-c", cpu_list, &pid.to_string()])
            .stdout(std::process::Stdio::null())
            .status()
            .expect("taskset");
        assert!(status.success(), "taskset -c {cpu_list} {pid}");
    };
    pin("0", meilisearch);
    pin(&others, i64::from(std::process::id()));
    pin(&others, postmaster);
    // Backends already running (the launcher, the workers); new ones inherit the postmaster's.
    for pid in children(postmaster) {
        pin(&others, pid);
    }
}

/// The processes whose parent is `pid`.
fn children(pid: i64) -> Vec<i64> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let child: i64 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let parent: i64 = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            (parent == pid).then_some(child)
        })
        .collect()
}

/// The pgbench script of one search through SQL.
fn search_script(task: i64, query: &str) -> String {
    format!("SELECT count(*) FROM meili_search({task}, '{query}', '{{\"limit\": 10}}');\n")
}

/// Requests per second and latencies (ms) of one side, and how many calls it made.
pub struct Side {
    pub per_second: f64,
    pub p50: f64,
    pub p99: f64,
    pub calls: usize,
}

impl Side {
    fn from_latencies(per_second: f64, latencies: &[f64]) -> Side {
        let percentile = |p: f64| {
            if latencies.is_empty() {
                return f64::NAN;
            }
            latencies[((latencies.len() - 1) as f64 * p).round() as usize]
        };
        Side {
            per_second,
            p50: percentile(0.5),
            p99: percentile(0.99),
            calls: latencies.len(),
        }
    }
}

/// `clients` connections searching straight over HTTP for `seconds`, measured by wrk (a C
/// client faster than the server, which asks for no compressed answers): its requests per
/// second and its latency distribution.
fn direct(meili: &Meili, index: &str, query: &str, clients: usize, seconds: u64) -> Side {
    let body = json!({"q": query, "limit": 10});
    direct_post(
        meili,
        &format!("/indexes/{index}/search"),
        &body,
        clients,
        seconds,
    )
}

/// `clients` connections posting `body` to `path` for `seconds`, measured by wrk.
pub fn direct_post(
    meili: &Meili,
    path: &str,
    body: &serde_json::Value,
    clients: usize,
    seconds: u64,
) -> Side {
    let dir = std::env::temp_dir().join(format!("pg_meili_sync_wrk_{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("wrk directory");
    let script = dir.join("search.lua");
    let body = body.to_string();
    let mut lua = format!(
        "wrk.method = \"POST\"\nwrk.body = {body:?}\nwrk.headers[\"Content-Type\"] = \"application/json\"\n"
    );
    if let Some(key) = meili.key() {
        lua.push_str(&format!(
            "wrk.headers[\"Authorization\"] = \"Bearer {key}\"\n"
        ));
    }
    std::fs::write(&script, lua).expect("wrk script");
    let output = std::process::Command::new("wrk")
        .arg("-t")
        .arg(clients.min(2).to_string())
        .arg("-c")
        .arg(clients.to_string())
        .arg("-d")
        .arg(format!("{seconds}s"))
        .arg("--latency")
        .arg("-s")
        .arg(&script)
        .arg(format!("{}{path}", meili.url))
        .output()
        .expect("run wrk (apt-get install wrk)");
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && !stdout.contains("Non-2xx"),
        "wrk failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let field = |prefix: &str| {
        stdout
            .lines()
            .find_map(|line| line.trim().strip_prefix(prefix))
            .map(str::trim)
            .unwrap_or_default()
            .to_owned()
    };
    Side {
        per_second: field("Requests/sec:").parse().unwrap_or(0.0),
        p50: wrk_millis(&field("50%")),
        p99: wrk_millis(&field("99%")),
        // "12345 requests in 5.00s, …"
        calls: stdout
            .lines()
            .find_map(|line| line.trim().split_once(" requests in "))
            .and_then(|(count, _)| count.parse().ok())
            .unwrap_or(0),
    }
}

/// A wrk duration (`812.00us`, `1.23ms`, `1.02s`) in milliseconds.
fn wrk_millis(text: &str) -> f64 {
    let (number, scale) = if let Some(micros) = text.strip_suffix("us") {
        (micros, 0.001)
    } else if let Some(millis) = text.strip_suffix("ms") {
        (millis, 1.0)
    } else if let Some(seconds) = text.strip_suffix('s') {
        (seconds, 1000.0)
    } else {
        (text, f64::NAN)
    };
    number
        .parse::<f64>()
        .map_or(f64::NAN, |value| value * scale)
}

/// Runs a pgbench script and returns its transactions per second and latencies from its
/// per-transaction log.
pub fn pgbench(cluster: &Cluster, script: &str, args: &[&str]) -> Side {
    let dir = std::env::temp_dir().join(format!("pg_meili_sync_pgbench_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("pgbench directory");
    let _ = std::process::Command::new("chmod")
        .arg("777")
        .arg(&dir)
        .status();
    let file = dir.join("script.sql");
    std::fs::write(&file, script).expect("pgbench script");
    let prefix = dir.join("log");
    let output = cluster
        .client_command("pgbench")
        .args(["-n", "-l", "--log-prefix"])
        .arg(&prefix)
        .arg("-f")
        .arg(&file)
        .args(args)
        .arg("postgres")
        .output()
        .expect("run pgbench");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "pgbench failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let per_second = stdout
        .lines()
        .find_map(|line| line.strip_prefix("tps = "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|tps| tps.parse().ok())
        .unwrap_or(0.0);
    let latencies = read_logs(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    Side::from_latencies(per_second, &latencies)
}

/// pgbench's per-transaction logs: the third field is the latency in microseconds.
fn read_logs(dir: &Path) -> Vec<f64> {
    let mut latencies: Vec<f64> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("log"))
        .filter_map(|entry| std::fs::read_to_string(entry.path()).ok())
        .flat_map(|text| {
            text.lines()
                .filter_map(|line| line.split_whitespace().nth(2)?.parse::<f64>().ok())
                .map(|micros| micros / 1000.0)
                .collect::<Vec<_>>()
        })
        .collect();
    latencies.sort_by(f64::total_cmp);
    latencies
}

/// With `split`, Meilisearch gets CPU 0 to itself and everything else shares the others (see
/// [`split_cores`]); a real server only.
pub fn search(rows: i64, seconds: u64, clients: usize, split: bool) {
    let meili = Meili::from_env();
    assert!(
        !split || meili.test_server().is_none(),
        "split cores needs a real Meilisearch (E2E_MEILI=real): the test server runs in this process"
    );
    let cluster = Cluster::start(&["max_connections = 100"]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, rows));
    let (index, task) = TaskStart::on("products")
        .index_named("search_load")
        .start_copied(&cluster, &meili, Duration::from_secs(3600));
    wait_for("every row in the index", Duration::from_secs(3600), || {
        (meili.document_count(&index) == Some(rows as u64)).then_some(())
    });
    meili.wait_idle(&index, Duration::from_secs(3600));
    let target = if meili.test_server().is_some() {
        "test server".to_owned()
    } else {
        meili.url.clone()
    };
    let postmaster = postmaster_pid(&cluster);
    let meilisearch = meilisearch_pid(&meili.url);
    let cores = if split {
        split_cores(
            postmaster,
            meilisearch.expect("the real Meilisearch's process, started with --http-addr"),
        );
        "Meilisearch alone on CPU 0, Postgres and the clients on the others"
    } else {
        "every process on every CPU"
    };
    println!(
        "search into {target}: {rows} products, {clients} clients, {seconds} s per query and side, limit 10, {cores}"
    );
    cluster.psql("ANALYZE products");
    // The test server searches 200,000 documents slowly under 10 clients: no request should time
    // out in the measurement (a real server answers in milliseconds).
    cluster.psql("ALTER DATABASE postgres SET meili_sync.search_timeout = '120s'");
    println!(
        "EXPLAIN (COSTS OFF) of a search joined back to the table:\n{}",
        cluster.psql(&format!(
            "EXPLAIN (COSTS OFF) SELECT p.name, s.score FROM meili_search({task}, 'kettle', '{{\"limit\": 20}}') s JOIN products p ON p.id = s.key[1]::bigint"
        ))
    );
    // Prepared statements (pgbench -M prepared), as drivers use them, and the simple protocol,
    // which parses and plans every call.
    println!("| query | direct req/s | SQL req/s, prepared | SQL/direct | SQL req/s, simple | SQL/direct | direct p50 / p99 ms | SQL p50 / p99 ms, prepared | added p50 / p99 ms |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let clients_arg = clients.to_string();
    let threads_arg = clients.min(2).to_string();
    let seconds_arg = seconds.to_string();
    for (what, query) in QUERIES {
        let http = direct(&meili, &index, query, clients, seconds);
        let script = search_script(task, query);
        let run_sql = |protocol: &str| {
            pgbench(
                &cluster,
                &script,
                &[
                    "-M",
                    protocol,
                    "-c",
                    &clients_arg,
                    "-j",
                    &threads_arg,
                    "-T",
                    &seconds_arg,
                ],
            )
        };
        let prepared = run_sql("prepared");
        let simple = run_sql("simple");
        println!(
            "| {what} (`{query}`) | {:.0} | {:.0} | {:.2} | {:.0} | {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | {:+.2} / {:+.2} |",
            http.per_second,
            prepared.per_second,
            prepared.per_second / http.per_second,
            simple.per_second,
            simple.per_second / http.per_second,
            http.p50,
            http.p99,
            prepared.p50,
            prepared.p99,
            prepared.p50 - http.p50,
            prepared.p99 - http.p99,
        );
    }
    // One client on each side: what a search through SQL adds to one call, without the queueing
    // of ten clients on the machine's cores.
    // With the CPU each call costs: the backend's (the postmaster's exited children, pgbench's
    // one backend among them) and Meilisearch's (a real server's process), per call.
    println!("one client, {seconds} s per query and side:");
    println!("| query | direct p50 / p99 ms | SQL p50 / p99 ms, prepared | added p50 / p99 ms | backend CPU µs a call | Meilisearch CPU µs a call | backend / Meilisearch |");
    println!("|---|---|---|---|---|---|---|");
    let one_client = |script: &str| {
        let cpu = || {
            (
                children_cpu_seconds(postmaster).unwrap_or(f64::NAN),
                meilisearch.and_then(cpu_seconds).unwrap_or(f64::NAN),
            )
        };
        let before = cpu();
        let sql = pgbench(
            &cluster,
            script,
            &["-M", "prepared", "-c", "1", "-T", &seconds_arg],
        );
        // The postmaster counts a backend's CPU once it has reaped it.
        std::thread::sleep(Duration::from_millis(500));
        let after = cpu();
        let calls = sql.calls.max(1) as f64;
        let per_call = |seconds: f64| seconds * 1e6 / calls;
        (
            sql,
            per_call(after.0 - before.0),
            per_call(after.1 - before.1),
        )
    };
    for (what, query) in QUERIES {
        let http = direct(&meili, &index, query, 1, seconds);
        let (sql, backend, meilisearch) = one_client(&search_script(task, query));
        println!(
            "| {what} (`{query}`) | {:.2} / {:.2} | {:.2} / {:.2} | {:+.2} / {:+.2} | {backend:.0} | {meilisearch:.0} | {:.2} |",
            http.p50,
            http.p99,
            sql.p50,
            sql.p99,
            sql.p50 - http.p50,
            sql.p99 - http.p99,
            backend / meilisearch,
        );
    }
    let (bare, backend, _) = one_client(BARE_STATEMENT);
    println!(
        "| a bare statement (`{}`) | | {:.2} / {:.2} | | {backend:.0} | | |",
        BARE_STATEMENT.trim_end().trim_end_matches(';'),
        bare.p50,
        bare.p99,
    );
    // Read-your-writes: an INSERT (its own transaction), then meili_sync_wait, one client.
    let script = format!(
        "\\set id random(100000000, 900000000)\n\
         INSERT INTO products (id, name) VALUES (:id, 'waited ' || :id) ON CONFLICT DO NOTHING;\n\
         SELECT meili_sync_wait({task});\n"
    );
    let waits = pgbench(&cluster, &script, &["-c", "1", "-t", "200"]);
    println!(
        "meili_sync_wait   INSERT's COMMIT → searchable, 200 one-row transactions one after another: p50 {:.1} ms, p99 {:.1} ms (pgbench transaction latency: the INSERT and the wait)",
        waits.p50,
        waits.p99
    );
    if meili.test_server().is_none() {
        meili.delete_index(&index);
    }
}
