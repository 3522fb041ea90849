//! Load command: backfills a `products` table into Meilisearch (the test server, or the real one at
//! MEILI_URL with MEILI_MASTER_KEY) and prints rows, seconds, docs/s, the task worker's CPU seconds
//! and its peak RSS.
//!
//! cargo run --release -p pg_meili_sync_load -- [rows] [batch_size] [max_inflight]

use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::products;
use serde_json::json;

/// utime + stime of a process, in seconds (from /proc/PID/stat).
fn cpu_seconds(pid: i64) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
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

/// Peak resident set size in MiB (VmHWM).
fn peak_rss_mib(pid: i64) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|arg| arg.parse().ok())
        .collect();
    let rows = args.first().copied().unwrap_or(200_000) as i64;
    let batch_size = args.get(1).copied().unwrap_or(10_000);
    let max_inflight = args.get(2).copied().unwrap_or(8);

    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&products::insert_sql(1, rows));
    cluster.psql("VACUUM ANALYZE products");
    let index = meili.unique_index("products_load");
    let options = meili.options(json!({"batch_size": batch_size, "max_inflight": max_inflight}));

    let started = Instant::now();
    let task: i64 = cluster
        .psql(&format!(
            "SELECT meili_sync_start('products', '{index}', '{options}')"
        ))
        .parse()
        .expect("task id");
    cluster.wait_snapshot_done(task, Duration::from_secs(3600));
    let seconds = started.elapsed().as_secs_f64();
    let pid: i64 = cluster
        .status(task)
        .get("worker_pid")
        .and_then(|pid| pid.parse().ok())
        .unwrap_or(0);
    let cpu = cpu_seconds(pid);
    let rss = peak_rss_mib(pid);
    let target = if meili.test_server().is_some() {
        "test server"
    } else {
        meili.url.as_str()
    };

    println!("backfill into {target}: batch_size {batch_size}, max_inflight {max_inflight}");
    println!("rows              {rows}");
    println!("seconds           {seconds:.2}");
    println!("docs/s            {:.0}", rows as f64 / seconds);
    match cpu {
        Some(cpu) => println!(
            "worker CPU s      {cpu:.2} ({:.2} per 100k docs)",
            cpu * 100_000.0 / rows as f64
        ),
        None => println!("worker CPU s      unknown (worker pid {pid} not readable)"),
    }
    match rss {
        Some(rss) => println!("worker peak RSS   {rss:.1} MiB"),
        None => println!("worker peak RSS   unknown"),
    }
    if std::env::var_os("LOAD_VERIFY").is_some() {
        meili.wait_idle(&index, Duration::from_secs(3600));
        match products::diff_index(&meili.all_documents(&index), rows, 1) {
            Ok(()) => println!("verified: the index holds exactly the table's rows"),
            Err(problem) => println!("MISMATCH: {problem}"),
        }
    }
    if meili.test_server().is_none() {
        meili.delete_index(&index);
    }
}
