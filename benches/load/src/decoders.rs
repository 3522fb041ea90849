//! `decoders` mode: Postgres's own decoders on the same WAL as the task worker, rows/s and CPU.
//!
//!   cargo run --release -p pg_meili_sync_load -- decoders [rows] [rows_per_transaction]
//!
//! One cluster; before any row exists it gets a publication, three logical slots (pgoutput,
//! test_decoding, wal2json) and two pg_meili_sync tasks on the empty `products` table: task A
//! streams while the rows are inserted (the normal case: wall time from the first insert until
//! Meilisearch confirmed the last document), task B is paused during the inserts and resumed after
//! the SQL decoders ran, so it decodes the same WAL as a backlog, like the SQL functions do. Then
//! each slot is read once with its SQL function (`count(*)` over `pg_logical_slot_get_*changes`)
//! in its own psql session, whose backend's CPU (utime + stime from /proc) and wall time are
//! measured around that one query. The task workers' CPU includes building the JSON documents and
//! sending them over HTTP; the SQL functions only decode (and pgoutput/wal2json/test_decoding
//! format) the changes into a tuplestore.

use crate::cpu_seconds;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};
use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{products, TaskStart};

const PUBLICATION: &str = "bench_decoders_pub";
const MARKER: &str = "--decoders-bench-done--";
const PLUGINS: &str = "'pgoutput', 'test_decoding', 'wal2json'";
const TIMEOUT: Duration = Duration::from_secs(3600);

/// One psql process kept open, so that several statements run in the same backend: we learn the
/// backend's pid first and can sample its /proc entry between statements.
struct Session {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    backend_pid: i64,
}

impl Session {
    fn open(cluster: &Cluster) -> Session {
        let mut child = cluster
            .psql_command()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start psql");
        let stdin = child.stdin.take().expect("psql's stdin");
        let stdout = BufReader::new(child.stdout.take().expect("psql's stdout"));
        let mut session = Session {
            child,
            stdin,
            stdout,
            backend_pid: 0,
        };
        session.backend_pid = session
            .query("SELECT pg_backend_pid()")
            .first()
            .and_then(|line| line.parse().ok())
            .expect("pg_backend_pid() of the psql session");
        session
    }

    /// Runs SQL (one statement or a script) and returns psql's output lines. psql stops at the
    /// first error (ON_ERROR_STOP), which it prints on our stderr; then this panics.
    fn query(&mut self, sql: &str) -> Vec<String> {
        let sql = sql.trim_end().trim_end_matches(';');
        write!(self.stdin, "{sql};\n\\echo {MARKER}\n")
            .and_then(|()| self.stdin.flush())
            .expect("write to psql");
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            let read = self.stdout.read_line(&mut line).expect("read psql output");
            assert!(
                read > 0,
                "psql ended (its error is printed above) while running: {}",
                sql.chars().take(300).collect::<String>()
            );
            let line = line.trim_end_matches('\n');
            if line == MARKER {
                return lines;
            }
            lines.push(line.to_owned());
        }
    }

    /// The first row of a query's result, split into columns.
    fn row(&mut self, sql: &str) -> Vec<String> {
        self.query(sql)
            .first()
            .map(|line| line.split('|').map(str::to_owned).collect())
            .unwrap_or_default()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One decoder's run over the WAL of the inserts.
struct Measurement {
    decoder: String,
    /// INSERTs of `products` the decoder emitted (documents confirmed, for the task workers).
    inserts: i64,
    /// Every row (message) the SQL function returned, BEGIN/COMMIT and other tables included.
    output_rows: i64,
    /// BEGIN messages (transactions) it returned.
    transactions: Option<i64>,
    /// Bytes of output (for the task workers: JSON before gzip).
    bytes: i64,
    wall: f64,
    cpu: Option<f64>,
}

impl Measurement {
    fn rows_per_second(&self) -> f64 {
        self.inserts as f64 / self.wall
    }

    fn rows_per_cpu_second(&self) -> Option<f64> {
        self.cpu
            .filter(|cpu| *cpu > 0.0)
            .map(|cpu| self.inserts as f64 / cpu)
    }
}

/// Reads a slot with its SQL function in a fresh session, measuring that backend around the query.
/// `inserts` and `begins` are SQL predicates on the output column `data` (text or bytea).
fn measure_sql(
    cluster: &Cluster,
    decoder: &str,
    call: &str,
    inserts: &str,
    begins: &str,
) -> Measurement {
    let mut session = Session::open(cluster);
    let pid = session.backend_pid;
    let cpu_before = cpu_seconds(pid);
    let started = Instant::now();
    let row = session.row(&format!(
        "SELECT count(*), count(*) FILTER (WHERE {inserts}), count(*) FILTER (WHERE {begins}), \
                coalesce(sum(octet_length(data)), 0) \
           FROM {call}"
    ));
    let wall = started.elapsed().as_secs_f64();
    let cpu_after = cpu_seconds(pid);
    let number = |index: usize| -> i64 {
        row.get(index)
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("{decoder}: unexpected result {row:?}"))
    };
    Measurement {
        decoder: decoder.to_owned(),
        inserts: number(1),
        output_rows: number(0),
        transactions: Some(number(2)),
        bytes: number(3),
        wall,
        cpu: cpu_before
            .zip(cpu_after)
            .map(|(before, after)| after - before),
    }
}

/// A task's live status: (state, worker pid, documents confirmed, JSON bytes before gzip).
fn task_status(session: &mut Session, task: i64) -> (String, i64, i64, i64) {
    let row = session.row(&format!(
        "SELECT state, coalesce(worker_pid, 0), documents_confirmed, bytes_before_gzip \
           FROM meili_sync_status WHERE task = {task}"
    ));
    let number = |index: usize| -> i64 {
        row.get(index)
            .and_then(|value| value.parse().ok())
            .unwrap_or(0)
    };
    (
        row.first().cloned().unwrap_or_default(),
        number(1),
        number(2),
        number(3),
    )
}

/// Polls a task until its worker confirmed `rows` documents; returns when that was seen, with the
/// worker's pid and the JSON bytes it built. Panics when the task fails or time runs out.
fn wait_confirmed(
    cluster: &Cluster,
    session: &mut Session,
    task: i64,
    rows: i64,
) -> (Instant, i64, i64) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let (state, pid, confirmed, bytes) = task_status(session, task);
        assert!(
            state != "error",
            "task {task} failed\n{}",
            cluster.tail_log()
        );
        if confirmed >= rows {
            return (Instant::now(), pid, bytes);
        }
        assert!(
            Instant::now() < deadline,
            "task {task}: {confirmed} of {rows} documents confirmed after {TIMEOUT:?}\n{}",
            cluster.tail_log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn wait_state(cluster: &Cluster, session: &mut Session, task: i64, wanted: &str, worker: bool) {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let (state, pid, _, _) = task_status(session, task);
        assert!(
            state != "error",
            "task {task} failed\n{}",
            cluster.tail_log()
        );
        if state == wanted && (pid != 0) == worker {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "task {task} is {state} (worker pid {pid}), waiting for {wanted}\n{}",
            cluster.tail_log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Lets the wal2json slot be created where PostgreSQL restricts output plugins to a list.
fn allow_plugins(cluster: &Cluster) -> String {
    let context = cluster
        .psql("SELECT context FROM pg_settings WHERE name = 'output_plugin_libraries'")
        .trim()
        .to_owned();
    if context.is_empty() {
        return "(no output_plugin_libraries in this PostgreSQL: any installed plugin may be used)"
            .to_owned();
    }
    cluster.psql(&format!(
        "ALTER SYSTEM SET output_plugin_libraries = {PLUGINS}"
    ));
    if context == "postmaster" {
        cluster.pg_ctl_stop("fast");
        cluster.pg_ctl_start();
    } else {
        cluster.psql("SELECT pg_reload_conf()");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let setting = cluster.psql("SHOW output_plugin_libraries");
        if setting.contains("wal2json") || Instant::now() > deadline {
            return setting;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn ratio(ours: Option<f64>, theirs: Option<f64>) -> Option<f64> {
    ours.zip(theirs)
        .filter(|(_, theirs)| *theirs > 0.0)
        .map(|(ours, theirs)| ours / theirs)
}

fn verdict(value: Option<f64>, target: f64) -> String {
    match value {
        Some(value) if value >= target => format!("{value:.2} (target ≥ {target}: met)"),
        Some(value) => format!("{value:.2} (target ≥ {target}: NOT met)"),
        None => "n/a".to_owned(),
    }
}

pub fn run(rows: i64, per_transaction: i64) {
    let per_transaction = per_transaction.max(1);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let meili = Meili::from_env();
    let cluster = Cluster::start(&[]);
    let plugins = allow_plugins(&cluster);
    let version = cluster.psql("SHOW server_version");
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql(products::CREATE_TABLE);
    cluster.psql(&format!(
        "CREATE PUBLICATION {PUBLICATION} FOR TABLE products"
    ));
    cluster.psql("SELECT pg_create_logical_replication_slot('bench_pgoutput', 'pgoutput')");
    cluster
        .psql("SELECT pg_create_logical_replication_slot('bench_test_decoding', 'test_decoding')");
    let wal2json = cluster
        .try_psql("SELECT pg_create_logical_replication_slot('bench_wal2json', 'wal2json')")
        .map_err(|error| error.trim().to_owned());
    if let Err(error) = &wal2json {
        println!("wal2json skipped: {error}");
    }

    let streaming_index = meili.unique_index("products_decoders_stream");
    let backlog_index = meili.unique_index("products_decoders_backlog");
    let (_, streaming) = TaskStart::on("products")
        .into_index(&streaming_index)
        .start(&cluster, &meili);
    let (_, backlog) = TaskStart::on("products")
        .into_index(&backlog_index)
        .start(&cluster, &meili);
    let mut monitor = Session::open(&cluster);
    wait_state(&cluster, &mut monitor, streaming, "streaming", true);
    wait_state(&cluster, &mut monitor, backlog, "streaming", true);
    cluster.psql(&format!("SELECT meili_sync_pause({backlog})"));
    wait_state(&cluster, &mut monitor, backlog, "paused", false);

    // The inserts, one transaction per statement (psql sends a script's statements one by one).
    let (_, streaming_pid, _, _) = task_status(&mut monitor, streaming);
    let streaming_cpu_before = cpu_seconds(streaming_pid);
    let script: String = (0..(rows + per_transaction - 1) / per_transaction)
        .map(|n| {
            let from = n * per_transaction + 1;
            format!(
                "{};\n",
                products::insert_sql(from, (from + per_transaction - 1).min(rows))
            )
        })
        .collect();
    let mut writer = Session::open(&cluster);
    let started = Instant::now();
    writer.query(&script);
    let committed = started.elapsed().as_secs_f64();
    drop(writer);
    let (done, pid, bytes) = wait_confirmed(&cluster, &mut monitor, streaming, rows);
    let ours_cpu = cpu_seconds(pid)
        .zip(streaming_cpu_before)
        .map(|(after, before)| after - before);
    if pid != streaming_pid {
        println!("NOTE: task A's worker changed from pid {streaming_pid} to {pid} during the run: its CPU figure is incomplete");
    }
    let ours = Measurement {
        decoder: "ours, streaming (task A)".to_owned(),
        inserts: rows,
        output_rows: rows,
        transactions: None,
        bytes,
        wall: done.duration_since(started).as_secs_f64(),
        cpu: ours_cpu,
    };

    let wal_bytes = cluster.psql(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint \
           FROM pg_replication_slots WHERE slot_name = 'bench_pgoutput'",
    );

    let mut measurements = vec![measure_sql(
        &cluster,
        "pgoutput (pg_logical_slot_get_binary_changes)",
        &format!(
            "pg_logical_slot_get_binary_changes('bench_pgoutput', NULL, NULL, \
             'proto_version', '1', 'publication_names', '{PUBLICATION}')"
        ),
        "get_byte(data, 0) = 73", // 'I'
        "get_byte(data, 0) = 66", // 'B'
    )];
    measurements.push(measure_sql(
        &cluster,
        "test_decoding (pg_logical_slot_get_changes)",
        "pg_logical_slot_get_changes('bench_test_decoding', NULL, NULL)",
        "data LIKE 'table public.products: INSERT:%'",
        "data LIKE 'BEGIN%'",
    ));
    if wal2json.is_ok() {
        measurements.push(measure_sql(
            &cluster,
            "wal2json v2 (pg_logical_slot_get_changes)",
            "pg_logical_slot_get_changes('bench_wal2json', NULL, NULL, 'format-version', '2')",
            r#"data LIKE '{"action":"I","schema":"public","table":"products",%'"#,
            r#"data = '{"action":"B"}'"#,
        ));
    }

    // Task B decodes the same WAL as a backlog, after the SQL functions.
    let resumed = Instant::now();
    cluster.psql(&format!("SELECT meili_sync_resume({backlog})"));
    let (done, pid, bytes) = wait_confirmed(&cluster, &mut monitor, backlog, rows);
    let backlog_run = Measurement {
        decoder: "ours, backlog (task B)".to_owned(),
        inserts: rows,
        output_rows: rows,
        transactions: None,
        bytes,
        wall: done.duration_since(resumed).as_secs_f64(),
        // The whole life of the new worker: its start-up is part of catching up.
        cpu: cpu_seconds(pid),
    };
    measurements.push(ours);
    measurements.push(backlog_run);

    let target = if meili.test_server().is_some() {
        "the test server (in this process)".to_owned()
    } else {
        meili.url.clone()
    };
    println!("decoders on the same WAL: PostgreSQL {version}, output_plugin_libraries = {plugins}");
    println!(
        "{rows} rows in {per_transaction}-row transactions, committed by one client in {committed:.2} s; \
         WAL from the slots' start: {:.1} MiB; documents sent to {target}",
        wal_bytes.parse::<f64>().unwrap_or(0.0) / 1_048_576.0
    );
    println!("load average before the run: {}", load.trim());
    println!();
    println!(
        "| decoder | rows decoded | rows returned | transactions | output MiB | wall s | CPU s | rows/s (wall) | rows per CPU-second | CPU µs per row |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for m in &measurements {
        println!(
            "| {} | {} | {} | {} | {:.1} | {:.2} | {} | {:.0} | {} | {} |",
            m.decoder,
            m.inserts,
            m.output_rows,
            m.transactions
                .map_or_else(|| "–".to_owned(), |t| t.to_string()),
            m.bytes as f64 / 1_048_576.0,
            m.wall,
            m.cpu
                .map_or_else(|| "?".to_owned(), |cpu| format!("{cpu:.2}")),
            m.rows_per_second(),
            m.rows_per_cpu_second()
                .map_or_else(|| "?".to_owned(), |rate| format!("{rate:.0}")),
            m.cpu.map_or_else(
                || "?".to_owned(),
                |cpu| format!("{:.2}", cpu * 1e6 / m.inserts.max(1) as f64)
            ),
        );
    }
    println!();
    let find = |prefix: &str| measurements.iter().find(|m| m.decoder.starts_with(prefix));
    let pgoutput = find("pgoutput");
    let wal2json = find("wal2json");
    for ours in [find("ours, streaming"), find("ours, backlog")]
        .into_iter()
        .flatten()
    {
        println!("{}:", ours.decoder);
        for (name, theirs, target) in [("pgoutput", pgoutput, 0.8), ("wal2json", wal2json, 1.2)] {
            let per_cpu = ratio(
                ours.rows_per_cpu_second(),
                theirs.and_then(Measurement::rows_per_cpu_second),
            );
            let per_wall = ratio(
                Some(ours.rows_per_second()),
                theirs.map(Measurement::rows_per_second),
            );
            println!(
                "  / {name:<9} rows per CPU-second {}; rows/s (wall) {}",
                verdict(per_cpu, target),
                verdict(per_wall, target)
            );
        }
    }
    println!(
        "(ours = decode + JSON encode + HTTP send in the task worker; the SQL functions only decode into a \
         tuplestore. Task A's wall time runs from the first insert, so it is bound by the inserts.)"
    );
    for found in [find("pgoutput"), find("test_decoding"), find("wal2json")]
        .into_iter()
        .flatten()
    {
        if found.inserts != rows {
            println!(
                "WARNING: {} returned {} inserts of products, expected {rows}",
                found.decoder, found.inserts
            );
        }
    }
    if meili.test_server().is_none() {
        meili.delete_index(&streaming_index);
        meili.delete_index(&backlog_index);
    }
}
