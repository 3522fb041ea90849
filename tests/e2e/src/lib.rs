//! End-to-end harness: a throwaway Postgres cluster with the installed pg_meili_sync preloaded,
//! a Meilisearch (the real one at `MEILI_URL`, or the project's test server), and the `products`
//! data set with the documents every row must become.

pub mod cluster;
pub mod meili;
pub mod products;

use std::time::{Duration, Instant};

/// Polls `check` until it returns Some, or panics with `what` after `timeout`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until the index holds exactly the table's rows (ids and bodies), or panics with the
/// differences after `timeout`.
pub fn wait_index_matches_table(
    cluster: &cluster::Cluster,
    meili: &meili::Meili,
    index: &str,
    table: &str,
    timeout: Duration,
) {
    let deadline = Instant::now() + timeout;
    loop {
        let rows: u64 = cluster
            .psql(&format!("SELECT count(*) FROM {table}"))
            .parse()
            .unwrap_or(0);
        if meili.document_count(index) != Some(rows) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(250));
            continue;
        }
        let expected = products::table_documents(cluster, table);
        let documents = meili.all_documents(index);
        let Some(problem) = products::diff_documents(&documents, &expected) else {
            assert_no_crash(cluster);
            return;
        };
        if Instant::now() >= deadline {
            panic!("index {index} does not match table {table} after {timeout:?}: {problem}\n--- server log tail ---\n{}", cluster.tail_log());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Fails if a server process died of anything but the SIGKILLs tests send on purpose (an abort or
/// a segfault makes the postmaster restart every connection: an outage for the user).
pub fn assert_no_crash(cluster: &cluster::Cluster) {
    let log = cluster.server_log();
    for sign in [
        "terminated by signal 6",
        "terminated by signal 7",
        "terminated by signal 11",
        "PANIC:",
    ] {
        assert!(
            !log.contains(sign),
            "the server log shows a crash ({sign}):\n{}",
            cluster.tail_log()
        );
    }
}

/// An ERROR as psql prints it with `VERBOSITY verbose`: `ERROR:  <SQLSTATE>: <message>`, then
/// DETAIL and HINT lines.
#[derive(Debug)]
pub struct Refusal {
    pub sqlstate: String,
    /// The message and its DETAIL.
    pub message: String,
    pub hint: String,
    pub stderr: String,
}

/// Runs `sql`, which must fail; returns the error's SQLSTATE, message and hint.
pub fn refusal(cluster: &cluster::Cluster, sql: &str) -> Refusal {
    let output = cluster
        .psql_command()
        .args(["-v", "VERBOSITY=verbose", "-c", sql])
        .output()
        .expect("run psql");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        !output.status.success(),
        "expected an error, but it ran: {sql}\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
    let field = |prefix: &str| {
        stderr
            .lines()
            .find_map(|line| line.split_once(prefix).map(|(_, rest)| rest.to_owned()))
    };
    let error = field("ERROR:  ").unwrap_or_else(|| panic!("no ERROR for {sql}: {stderr}"));
    let (sqlstate, message) = error
        .split_once(": ")
        .unwrap_or_else(|| panic!("no SQLSTATE in {error:?} (VERBOSITY verbose)"));
    Refusal {
        sqlstate: sqlstate.to_owned(),
        message: format!("{message} {}", field("DETAIL:  ").unwrap_or_default()),
        hint: field("HINT:  ").unwrap_or_default(),
        stderr,
    }
}

/// Starts a task on each view, and previews it, as each of `roles`: each must be refused with
/// `0A000` and a message that names the view and holds its `what`. Returns the refusals.
pub fn refused_views(
    cluster: &cluster::Cluster,
    meili: &meili::Meili,
    views: &[(&str, &str)],
    roles: &[&str],
) -> Vec<Refusal> {
    let options = meili.options(serde_json::json!({"primary_key": "id"}));
    let mut refusals = Vec::new();
    for (view, what) in views {
        for role in roles {
            let index = meili.unique_index("refused");
            for sql in [
                format!("SET ROLE {role}; SELECT meili_sync_start('{view}', '{index}', '{options}')"),
                format!("SET ROLE {role}; SELECT * FROM meili_sync_preview('{view}', '{{\"primary_key\": \"id\"}}')"),
            ] {
                let refused = refusal(cluster, &sql);
                assert_eq!(refused.sqlstate, "0A000", "{sql}: {}", refused.stderr);
                assert!(
                    refused.message.contains(&format!("view public.{view} cannot be synced"))
                        && refused.message.contains(what),
                    "{sql}: {}",
                    refused.message
                );
                refusals.push(refused);
            }
        }
    }
    refusals
}

/// Starts a task: the one way the suites and the load command get a task to work with (a start
/// that must be refused goes through [`refusal`] instead).
///
/// ```text
/// let (index, task) = TaskStart::on("products").options(json!({"decoding": "own"})).start(&cluster, &meili);
/// ```
///
/// The task syncs `source` into a new index of `meili` named after the source (or
/// [`index_named`](Self::index_named)'s prefix, or exactly [`into_index`](Self::into_index)'s), with
/// the server's url and key merged into the options, as [`as_role`](Self::as_role)'s role when given.
pub struct TaskStart<'a> {
    source: &'a str,
    index: Index<'a>,
    role: Option<&'a str>,
    extra: serde_json::Value,
}

enum Index<'a> {
    /// A new index: the prefix, then the process and a clock reading (`Meili::unique_index`).
    Unique(String),
    Exactly(&'a str),
}

impl<'a> TaskStart<'a> {
    pub fn on(source: &'a str) -> Self {
        TaskStart {
            source,
            index: Index::Unique(source.replace('.', "_")),
            role: None,
            extra: serde_json::json!({}),
        }
    }

    /// A new index whose uid starts with `prefix`.
    pub fn index_named(mut self, prefix: &str) -> Self {
        self.index = Index::Unique(prefix.to_owned());
        self
    }

    /// The index `uid` itself.
    pub fn into_index(mut self, uid: &'a str) -> Self {
        self.index = Index::Exactly(uid);
        self
    }

    /// Started by `role` (`SET ROLE`), when given.
    pub fn as_role(mut self, role: Option<&'a str>) -> Self {
        self.role = role;
        self
    }

    /// Options beside the server's url and key (a JSON object; its fields win).
    pub fn options(mut self, extra: serde_json::Value) -> Self {
        self.extra = extra;
        self
    }

    /// Starts the task; returns its index and id.
    pub fn start(self, cluster: &cluster::Cluster, meili: &meili::Meili) -> (String, i64) {
        let index = match self.index {
            Index::Unique(prefix) => meili.unique_index(&prefix),
            Index::Exactly(uid) => uid.to_owned(),
        };
        let options = meili.options(self.extra);
        let task = start_with_options(cluster, self.role, self.source, &index, &options);
        (index, task)
    }

    /// Starts the task and waits until its copy is done; returns its index and id.
    pub fn start_copied(
        self,
        cluster: &cluster::Cluster,
        meili: &meili::Meili,
        timeout: Duration,
    ) -> (String, i64) {
        let (index, task) = self.start(cluster, meili);
        cluster.wait_snapshot_done(task, timeout);
        (index, task)
    }
}

/// `TaskStart::on(source).as_role(role).options(extra).start(cluster, meili)`.
pub fn start_task(
    cluster: &cluster::Cluster,
    meili: &meili::Meili,
    role: Option<&str>,
    source: &str,
    extra: serde_json::Value,
) -> (String, i64) {
    TaskStart::on(source)
        .as_role(role)
        .options(extra)
        .start(cluster, meili)
}

/// `meili_sync_start(source, index, options)` (options as SQL-quoted JSON), as `role` when given;
/// returns the task id. [`TaskStart`] builds the options; this is for callers that hold them
/// already (one options text for many tasks).
pub fn start_with_options(
    cluster: &cluster::Cluster,
    role: Option<&str>,
    source: &str,
    index: &str,
    options: &str,
) -> i64 {
    let set_role = role
        .map(|role| format!("SET ROLE {role}; "))
        .unwrap_or_default();
    cluster
        .psql(&format!(
            "{set_role}SELECT meili_sync_start('{source}', '{index}', '{options}')"
        ))
        .lines()
        .last()
        .and_then(|line| line.parse().ok())
        .unwrap_or_else(|| panic!("no task id from meili_sync_start('{source}', …)"))
}

/// Asks for a new copy of the task and returns the `last_error` it stops with.
pub fn error_after_new_copy(cluster: &cluster::Cluster, task: i64, timeout: Duration) -> String {
    cluster.psql(&format!("SELECT meili_sync_snapshot({task})"));
    let status = cluster.wait_error(task, timeout);
    status.get("last_error").cloned().unwrap_or_default()
}

/// Sets its flag when dropped: a writer thread that loops until the flag is set stops when a
/// failed check ends the test, instead of keeping the test waiting for it.
pub struct StopOnDrop<'a>(pub &'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Starts a cluster with the PostgreSQL extension `name` (a type's extension: PostGIS, pgvector)
/// and pg_meili_sync created, or returns None after saying why the test skips: `name` is not
/// installed for this PostgreSQL (`installed_by` says where it would come from).
pub fn cluster_with_extension(name: &str, installed_by: &str) -> Option<cluster::Cluster> {
    let cluster = cluster::Cluster::start(&[]);
    let available = cluster
        .psql(&format!(
            "SELECT count(*) FROM pg_available_extensions WHERE name = '{name}'"
        ))
        .trim()
        == "1";
    if !available {
        eprintln!(
            "skipped: extension {name} is not installed for this PostgreSQL ({installed_by})"
        );
        return None;
    }
    cluster.psql(&format!("CREATE EXTENSION {name}"));
    cluster.psql("CREATE EXTENSION pg_meili_sync");
    Some(cluster)
}

/// The shard Meilisearch's own sharding gives a document id: the highest XXH3-64 (seed 0) of
/// Rust's hash of the tuple (name, id), each string followed by 0xFF; ties to the greatest name.
pub fn owner_of<'a>(id: &str, names: &[&'a str]) -> &'a str {
    names
        .iter()
        .copied()
        .max_by_key(|name| {
            let mut bytes = name.as_bytes().to_vec();
            bytes.push(0xFF);
            bytes.extend_from_slice(id.as_bytes());
            bytes.push(0xFF);
            (twox_hash::XxHash3_64::oneshot(&bytes), *name)
        })
        .unwrap_or_default()
}
