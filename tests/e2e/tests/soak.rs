//! End to end: a soak. Four tasks stream while a writer changes their sources all the time: a
//! table in the shared pass, a table on a slot of its own, a partitioned table whose partitions
//! rotate, and a view with a mapping over a lookup table the writer renames. Meanwhile faults
//! come at random: immediate and fast restarts, a client backend and the shared decoder killed
//! (crash restarts), Meilisearch stopped for 15 s or killed and started again, a pause, a resync
//! and an ADD COLUMN. At the end every index equals its source (ids and bodies), no task is in
//! error, there is no dead letter, no crash or Rust panic is in the log, and each slot retains
//! less than a WAL segment.
//!
//! `SOAK_MINUTES` sets how long faults come (2 minutes unless set; CI runs that); `SOAK_SEED`
//! replays a run (the seed is printed first, and in every failure).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pg_meili_sync_e2e::cluster::Cluster;
use pg_meili_sync_e2e::meili::Meili;
use pg_meili_sync_e2e::{assert_no_crash, wait_for, wait_index_matches_table, TaskStart};
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(600);

/// Ids per partition of `readings`; the writer inserts into the newest.
const PARTITION_IDS: i64 = 100_000;

const SCHEMA: &str = "
CREATE TABLE public.orders (id int PRIMARY KEY, customer text NOT NULL, amount int NOT NULL);
INSERT INTO public.orders SELECT g, 'customer ' || g % 97, g % 1000 FROM generate_series(1, 5000) g;
CREATE TABLE public.events (id int PRIMARY KEY, kind text NOT NULL, payload text);
INSERT INTO public.events SELECT g, 'kind ' || g % 7, repeat('x', g % 50) FROM generate_series(1, 5000) g;
CREATE TABLE public.readings (id int PRIMARY KEY, body text) PARTITION BY RANGE (id);
CREATE TABLE public.readings_p0 PARTITION OF public.readings FOR VALUES FROM (0) TO (100000);
CREATE TABLE public.readings_p1 PARTITION OF public.readings FOR VALUES FROM (100000) TO (200000);
INSERT INTO public.readings SELECT g, 'reading ' || g FROM generate_series(1, 3000) g;
INSERT INTO public.readings SELECT 100000 + g, 'reading ' || g FROM generate_series(1, 3000) g;
CREATE TABLE public.categories (id int PRIMARY KEY, name text NOT NULL);
CREATE TABLE public.items (id int PRIMARY KEY, category_id int NOT NULL REFERENCES public.categories,
                           title text NOT NULL);
CREATE INDEX ON public.items (category_id);
CREATE VIEW public.item_documents AS
SELECT i.id, i.title, c.name AS category FROM public.items i JOIN public.categories c ON c.id = i.category_id;
INSERT INTO public.categories SELECT g, 'category ' || g FROM generate_series(1, 20) g;
INSERT INTO public.items SELECT g, 1 + g % 20, 'item ' || g FROM generate_series(1, 10000) g;
";

/// xorshift64: the whole run follows from its seed.
struct Prng(u64);

impl Prng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound.max(1)
    }
}

/// One transaction of the writer, on one source (chosen by `prng`); `newest` is the first id of
/// the newest partition of `readings`.
fn write_sql(prng: &mut Prng, round: u64, newest: i64) -> String {
    let id = 1 + prng.below(8000) as i64;
    match prng.below(8) {
        0 => format!(
            "INSERT INTO public.orders VALUES ({}, 'customer {round}', {round} % 1000) ON CONFLICT (id) DO UPDATE SET amount = excluded.amount",
            id
        ),
        1 => format!("UPDATE public.orders SET amount = amount + 1, customer = 'round {round}' WHERE id BETWEEN {id} AND {id} + 20"),
        2 => format!("DELETE FROM public.orders WHERE id = {id}"),
        3 => format!(
            "INSERT INTO public.events VALUES ({id}, 'kind {round}', 'p') ON CONFLICT (id) DO UPDATE SET payload = excluded.payload || 'q'"
        ),
        4 => format!("DELETE FROM public.events WHERE id BETWEEN {id} AND {id} + 3"),
        5 => format!(
            "INSERT INTO public.readings SELECT {newest} + {} + g, 'round {round}' FROM generate_series(0, 9) g ON CONFLICT (id) DO UPDATE SET body = excluded.body",
            prng.below(PARTITION_IDS as u64 - 10)
        ),
        6 => format!(
            "UPDATE public.items SET title = 'round {round}' WHERE id = ANY (ARRAY(SELECT 1 + (random() * 9999)::int FROM generate_series(1, 10)))"
        ),
        _ => format!(
            "UPDATE public.categories SET name = 'category {} round {round}' WHERE id = {}",
            round % 20 + 1,
            round % 20 + 1
        ),
    }
}

/// The faults, by name (the figures count them by name).
const FAULTS: [&str; 11] = [
    "immediate restart",
    "fast restart",
    "client backend killed",
    "decoder killed",
    "meilisearch stopped 15 s",
    "meilisearch killed and restarted",
    "pause and resume",
    "resync",
    "add column",
    "partition rotation",
    "partition rotation",
];

/// Raises its flag when dropped, on the way out of a scope whether it returns or unwinds.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

struct Soak<'a> {
    cluster: &'a Cluster,
    meili: &'a Meili,
    seed: u64,
    tasks: BTreeMap<&'static str, i64>,
    /// The first id of the newest partition of `readings`.
    newest: Arc<AtomicI64>,
    /// Columns added to `orders` so far.
    added: u32,
}

impl Soak<'_> {
    fn pid_of(&self, backend_type: &str) -> Option<i64> {
        self.cluster
            .try_psql(&format!(
                "SELECT pid FROM pg_stat_activity WHERE backend_type = '{backend_type}' LIMIT 1"
            ))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Waits until the server answers again (after a restart or crash recovery).
    fn wait_up(&self) {
        wait_for(
            &format!("the server to answer again (seed {})", self.seed),
            Duration::from_secs(120),
            || self.cluster.try_psql("SELECT 1").ok().map(|_| ()),
        );
    }

    fn play(&mut self, fault: &str, prng: &mut Prng) {
        let task_names: Vec<&'static str> = self.tasks.keys().copied().collect();
        let task_name = task_names[prng.below(task_names.len() as u64) as usize];
        let task = self.tasks[task_name];
        match fault {
            "immediate restart" | "fast restart" => {
                let mode = if fault == "fast restart" {
                    "fast"
                } else {
                    "immediate"
                };
                self.cluster.pg_ctl_stop(mode);
                self.cluster.pg_ctl_start();
            }
            "client backend killed" => {
                let mut sleeper = self
                    .cluster
                    .psql_command()
                    .args([
                        "-c",
                        "SET application_name = 'soak_victim'; SELECT pg_sleep(60)",
                    ])
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .expect("start the victim's psql");
                let pid: Option<i64> = (0..50).find_map(|_| {
                    std::thread::sleep(Duration::from_millis(100));
                    self.cluster
                        .try_psql("SELECT pid FROM pg_stat_activity WHERE application_name = 'soak_victim'")
                        .ok()?
                        .trim()
                        .parse()
                        .ok()
                });
                if let Some(pid) = pid {
                    self.cluster.kill(pid, "KILL");
                }
                let _ = sleeper.wait();
            }
            "decoder killed" => {
                if let Some(pid) = self.pid_of("pg_meili_sync shared decoder") {
                    self.cluster.kill(pid, "KILL");
                }
            }
            "meilisearch stopped 15 s" => {
                self.meili.freeze();
                std::thread::sleep(Duration::from_secs(15));
                self.meili.thaw();
            }
            "meilisearch killed and restarted" => {
                self.meili.go_down();
                std::thread::sleep(Duration::from_secs(2));
                self.meili.come_back();
            }
            "pause and resume" => {
                let paused = self
                    .cluster
                    .try_psql(&format!("SELECT meili_sync_pause({task})"))
                    .is_ok();
                std::thread::sleep(Duration::from_secs(1 + prng.below(5)));
                self.wait_up();
                match self
                    .cluster
                    .try_psql(&format!("SELECT meili_sync_resume({task})"))
                {
                    Ok(_) => {}
                    // A task held for its resync's swap refuses a pause and a resume alike (a
                    // paused task is never held): it was not paused, and streams on after the swap.
                    Err(error) if !paused && error.contains("is held while its resync swaps") => {}
                    Err(error) => panic!("resuming task {task}: {error}"),
                }
            }
            "resync" => {
                // A view task, or a resync already running, may refuse: that is no fault.
                let _ = self
                    .cluster
                    .try_psql(&format!("SELECT meili_sync_resync({task})"));
            }
            "add column" => {
                self.added += 1;
                let _ = self.cluster.try_psql(&format!(
                    "ALTER TABLE public.orders ADD COLUMN extra_{} int NOT NULL DEFAULT {}",
                    self.added, self.added
                ));
            }
            _ => {
                // Partition rotation: a new newest partition, and the oldest dropped (its rows'
                // documents go with it).
                let newest = self.newest.load(Ordering::Relaxed);
                let next = newest + PARTITION_IDS;
                let oldest = newest - PARTITION_IDS;
                if self
                    .cluster
                    .try_psql(&format!(
                        "CREATE TABLE public.readings_p{} PARTITION OF public.readings FOR VALUES FROM ({next}) TO ({})",
                        next / PARTITION_IDS,
                        next + PARTITION_IDS
                    ))
                    .is_ok()
                {
                    self.newest.store(next, Ordering::Relaxed);
                    let _ = self.cluster.try_psql(&format!(
                        "DROP TABLE IF EXISTS public.readings_p{}",
                        oldest / PARTITION_IDS
                    ));
                }
            }
        }
        self.wait_up();
    }
}

#[test]
fn a_soak_with_random_faults_loses_nothing_and_every_task_catches_up() {
    let meili = Meili::from_env();
    if !meili.can_go_down() {
        eprintln!("skipped: MEILI_URL's server cannot be stopped by the test");
        return;
    }
    let seed = std::env::var("SOAK_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |since| since.as_nanos() as u64)
                | 1
        });
    let minutes: f64 = std::env::var("SOAK_MINUTES")
        .ok()
        .and_then(|minutes| minutes.parse().ok())
        .unwrap_or(2.0);
    eprintln!("soak: seed {seed} (SOAK_SEED={seed} replays it), {minutes} minutes of faults");
    let cluster = Cluster::start(&["meili_sync.index_check_interval=2s"]);
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    cluster.psql_script(SCHEMA);
    let mut tasks = BTreeMap::new();
    for (name, source, options) in [
        ("orders", "public.orders", json!({})),
        ("events", "public.events", json!({"decoding": "own"})),
        ("readings", "public.readings", json!({})),
        (
            "item_documents",
            "public.item_documents",
            json!({"primary_key": "id", "mappings": {"categories": "SELECT i.id FROM public.items i WHERE i.category_id = ANY($1::int[])"}}),
        ),
    ] {
        let index = format!("soak_{name}_{}", seed % 1_000_000);
        let (_, task) = TaskStart::on(source)
            .into_index(&index)
            .options(options)
            .start(&cluster, &meili);
        tasks.insert(name, task);
    }
    for task in tasks.values() {
        cluster.wait_snapshot_done(*task, CONVERGE);
    }

    let stop = Arc::new(AtomicBool::new(false));
    let newest = Arc::new(AtomicI64::new(PARTITION_IDS));
    let committed = Arc::new(AtomicU64::new(0));
    let writer = {
        let (stop, newest, committed) = (stop.clone(), newest.clone(), committed.clone());
        let cluster = &cluster;
        let mut prng = Prng(seed ^ 0x9E37_79B9_7F4A_7C15);
        move || {
            let mut round = 0_u64;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                let sql = write_sql(&mut prng, round, newest.load(Ordering::Relaxed));
                if cluster.try_psql(&sql).is_ok() {
                    committed.fetch_add(1, Ordering::Relaxed);
                } else {
                    // Restarting, or a partition just dropped: the next one goes on.
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    };
    let mut soak = Soak {
        cluster: &cluster,
        meili: &meili,
        seed,
        tasks: tasks.clone(),
        newest,
        added: 0,
    };
    let mut played: BTreeMap<&str, u32> = BTreeMap::new();
    let started = Instant::now();
    std::thread::scope(|scope| {
        let writing = scope.spawn(writer);
        // A fault that fails the soak unwinds through here: the writer stops, so that the scope
        // can end and the failure be reported, instead of writing on for ever.
        let _stop_writer = StopOnDrop(&stop);
        let mut prng = Prng(seed);
        while started.elapsed().as_secs_f64() < minutes * 60.0 {
            std::thread::sleep(Duration::from_secs(3 + prng.below(6)));
            let fault = FAULTS[prng.below(FAULTS.len() as u64) as usize];
            eprintln!("soak: {:>5.1} s: {fault}", started.elapsed().as_secs_f64());
            soak.play(fault, &mut prng);
            *played.entry(fault).or_default() += 1;
        }
        stop.store(true, Ordering::Relaxed);
        writing.join().expect("the writer");
    });

    let written = Instant::now();
    for (name, task) in &tasks {
        let index: String = cluster.psql(&format!(
            "SELECT index_uid FROM meili_sync_status WHERE task = {task}"
        ));
        let source = format!("public.{name}");
        wait_index_matches_table(&cluster, &meili, &index, &source, CONVERGE);
    }
    let catch_up = written.elapsed();
    let transactions = committed.load(Ordering::Relaxed);
    eprintln!(
        "soak: seed {seed}: {transactions} transactions in {:.0} s, faults {played:?}; every index matched its source {:.1} s after the last write",
        started.elapsed().as_secs_f64() - catch_up.as_secs_f64(),
        catch_up.as_secs_f64()
    );
    let context = format!("(seed {seed}, faults {played:?})");
    // A restart may have come just before the writes stopped: the workers are then starting (the
    // index already matched, as nothing was left to send). A task in error never streams again.
    let not_streaming = || {
        cluster.psql(
            "SELECT count(*) FROM meili_sync_status WHERE state NOT IN ('streaming', 'retrying')",
        )
    };
    let settled = Instant::now() + Duration::from_secs(60);
    while not_streaming() != "0" && Instant::now() < settled {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        not_streaming(),
        "0",
        "a task does not stream {context}: {}",
        cluster.psql("SELECT string_agg(task || ' ' || state || ' ' || coalesce(last_error, ''), '; ') FROM meili_sync_status")
    );
    assert_eq!(
        cluster.psql("SELECT count(*) FROM meili_sync_dead_letters"),
        "0",
        "dead letters {context}"
    );
    assert_no_crash(&cluster);
    let log = cluster.server_log();
    assert!(
        !log.contains("panicked"),
        "a Rust panic is in the log {context}:\n{}",
        cluster.tail_log()
    );
    // Each slot lets go of the WAL it kept (restart_lsn moves at checkpoints).
    wait_for(
        &format!("every slot to retain less than a WAL segment {context}"),
        CONVERGE,
        || {
            cluster.psql("CHECKPOINT");
            let retained = cluster.psql(
                "SELECT coalesce(max(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)), 0)
                     < pg_size_bytes(current_setting('wal_segment_size'))
                   FROM pg_replication_slots",
            );
            (retained == "t").then_some(())
        },
    );
}
