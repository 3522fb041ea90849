//! A throwaway Postgres cluster, run as the `postgres` OS user when we are root (Postgres refuses
//! to run as root), stopped and removed on drop, also when a test panics.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

pub struct Cluster {
    pub data_dir: PathBuf,
    pub socket_dir: PathBuf,
    pub port: u16,
    bin_dir: PathBuf,
    as_postgres: bool,
    settings: Vec<String>,
    /// The database psql connects to: `postgres` unless a test switches (`use_database`).
    database: std::sync::Mutex<String>,
}

fn pg_bin_dir() -> PathBuf {
    let output = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .expect("pg_config must be on PATH");
    PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).trim() == "0")
        .unwrap_or(false)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .expect("a free port")
}

impl Cluster {
    /// initdb + start with the extension preloaded and logical WAL; `extra` adds settings.
    pub fn start(extra: &[&str]) -> Cluster {
        let mut settings: Vec<String> = [
            "shared_preload_libraries=pg_meili_sync",
            "wal_level=logical",
            "max_worker_processes=32",
            "max_replication_slots=32",
            "meili_sync.naptime=200ms",
            "meili_sync.restart_backoff=200ms",
            "meili_sync.index_check_interval=500ms",
            "fsync=off",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        settings.extend(extra.iter().map(|s| s.to_string()));
        Self::start_from(pg_bin_dir(), settings)
    }

    /// A stock PostgreSQL from `bin_dir` (another major's, say), without the extension's library:
    /// a publisher as a managed service runs it, with logical WAL; `extra` adds settings.
    pub fn start_stock(bin_dir: PathBuf, extra: &[&str]) -> Cluster {
        let settings = ["wal_level=logical", "fsync=off"]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect();
        Self::start_from(bin_dir, settings)
    }

    fn start_from(bin_dir: PathBuf, settings: Vec<String>) -> Cluster {
        let as_postgres = running_as_root();
        let (data_dir, socket_dir) = new_directories(as_postgres);
        let cluster = Cluster {
            data_dir,
            socket_dir,
            port: free_port(),
            bin_dir,
            as_postgres,
            settings,
            database: std::sync::Mutex::new("postgres".to_owned()),
        };
        let initdb = cluster.run_pg(
            "initdb",
            &[
                "-D",
                path_str(&cluster.data_dir),
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
            ],
        );
        assert!(
            initdb.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&initdb.stderr)
        );
        cluster.write_settings();
        cluster.pg_ctl_start();
        cluster
    }

    /// A physical standby of `primary`, made with pg_basebackup, streaming through the physical
    /// slot `slot` (created here on the primary); `extra` adds settings to the primary's.
    pub fn standby_of(primary: &Cluster, slot: &str, extra: &[&str]) -> Cluster {
        primary.psql(&format!(
            "SELECT pg_catalog.pg_create_physical_replication_slot('{slot}')"
        ));
        let (data_dir, socket_dir) = new_directories(primary.as_postgres);
        let mut settings = primary.settings.clone();
        let conninfo = format!(
            "host={} port={} user=postgres dbname=postgres",
            path_str(&primary.socket_dir),
            primary.port
        );
        settings.extend([
            format!("primary_conninfo='{conninfo}'"),
            format!("primary_slot_name='{slot}'"),
            "hot_standby_feedback=on".to_owned(),
        ]);
        settings.extend(extra.iter().map(|s| s.to_string()));
        let standby = Cluster {
            data_dir,
            socket_dir,
            port: free_port(),
            bin_dir: primary.bin_dir.clone(),
            as_postgres: primary.as_postgres,
            settings,
            database: std::sync::Mutex::new("postgres".to_owned()),
        };
        let port = primary.port.to_string();
        let backup = standby.run_pg(
            "pg_basebackup",
            &[
                "-D",
                path_str(&standby.data_dir),
                "-h",
                path_str(&primary.socket_dir),
                "-p",
                &port,
                "-U",
                "postgres",
                "-X",
                "stream",
                "-S",
                slot,
            ],
        );
        assert!(
            backup.status.success(),
            "pg_basebackup failed: {}",
            String::from_utf8_lossy(&backup.stderr)
        );
        standby.write_settings();
        let signal = standby.data_dir.join("standby.signal");
        std::fs::write(&signal, "").expect("write standby.signal");
        standby.chown(&signal);
        standby.pg_ctl_start();
        standby
    }

    /// The postmaster's process id (the first line of postmaster.pid).
    pub fn postmaster_pid(&self) -> i64 {
        std::fs::read_to_string(self.data_dir.join("postmaster.pid"))
            .ok()
            .and_then(|pid_file| pid_file.lines().next()?.trim().parse().ok())
            .expect("a running postmaster's pid")
    }

    /// Promotes a standby and waits until it accepts writes.
    pub fn promote(&self) {
        let output = self.run_pg(
            "pg_ctl",
            &["-D", path_str(&self.data_dir), "-w", "-t", "120", "promote"],
        );
        assert!(
            output.status.success(),
            "pg_ctl promote failed: {}\n{}",
            String::from_utf8_lossy(&output.stderr),
            self.tail_log()
        );
    }

    /// postgresql.auto.conf holds the cluster's settings (one per line, later ones win).
    fn write_settings(&self) {
        let conf: String = self.settings.iter().map(|s| format!("{s}\n")).collect();
        let path = self.data_dir.join("postgresql.auto.conf");
        std::fs::write(&path, conf).expect("write settings");
        self.chown(&path);
    }

    fn chown(&self, path: &Path) {
        if self.as_postgres {
            let _ = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(path)
                .status();
        }
    }

    fn command(&self, program: &Path) -> Command {
        if self.as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(program);
            command
        } else {
            Command::new(program)
        }
    }

    /// Where the server's programs are (pg_dump, psql...).
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// A connection string to the cluster's database `postgres` as `user`, over its socket.
    pub fn conninfo(&self, user: &str) -> String {
        format!(
            "host={} port={} user={user} dbname=postgres",
            path_str(&self.socket_dir),
            self.port
        )
    }

    fn run_pg(&self, program: &str, args: &[&str]) -> Output {
        self.command(&self.bin_dir.join(program))
            .args(args)
            .output()
            .unwrap_or_else(|error| panic!("{program}: {error}"))
    }

    pub fn log_path(&self) -> PathBuf {
        self.data_dir.join("server.log")
    }

    pub fn pg_ctl_start(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=''",
            self.port,
            path_str(&self.socket_dir)
        );
        let output = self.run_pg(
            "pg_ctl",
            &[
                "-D",
                path_str(&self.data_dir),
                "-l",
                path_str(&self.log_path()),
                "-o",
                &options,
                "-w",
                "-t",
                "120",
                "start",
            ],
        );
        assert!(
            output.status.success(),
            "pg_ctl start failed: {}\n{}",
            String::from_utf8_lossy(&output.stderr),
            self.server_log()
        );
    }

    /// pg_ctl stop with the given mode (`fast`, `immediate`).
    pub fn pg_ctl_stop(&self, mode: &str) {
        let _ = self.run_pg(
            "pg_ctl",
            &[
                "-D",
                path_str(&self.data_dir),
                "-m",
                mode,
                "-w",
                "-t",
                "120",
                "stop",
            ],
        );
    }

    pub fn server_log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// A client program of the server's (pgbench, say) connected to database `postgres` over the
    /// cluster's socket, run as the `postgres` user when the tests run as root; extra arguments
    /// go after these.
    pub fn client_command(&self, program: &str) -> Command {
        let mut command = self.command(&self.bin_dir.join(program));
        command
            .args(["-h", path_str(&self.socket_dir), "-p"])
            .arg(self.port.to_string())
            .args(["-U", "postgres"]);
        command
    }

    /// Points psql (and every helper built on it) at database `name` from now on.
    pub fn use_database(&self, name: &str) {
        *self
            .database
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = name.to_owned();
    }

    /// psql connected to the current database (`postgres` unless [`Cluster::use_database`] switched),
    /// unaligned and tuples-only, stopping at the first error.
    pub fn psql_command(&self) -> Command {
        let mut command = self.command(&self.bin_dir.join("psql"));
        command
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                path_str(&self.socket_dir),
                "-p",
            ])
            .arg(self.port.to_string())
            .args(["-U", "postgres", "-d"])
            .arg(
                self.database
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .as_str(),
            );
        command
    }

    /// Runs SQL through psql in database `postgres`; Ok(stdout, unaligned and tuples-only) or
    /// Err(stderr). Several statements in `sql` run as one transaction (psql -c).
    pub fn try_psql(&self, sql: &str) -> Result<String, String> {
        let output = self
            .psql_command()
            .args(["-c", sql])
            .output()
            .map_err(|error| error.to_string())?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout)
                .trim_end()
                .to_owned())
        } else {
            Err(String::from_utf8_lossy(&output.stderr).into_owned())
        }
    }

    /// Runs a script on psql's standard input: each statement is its own transaction (unlike
    /// `psql`), and the script may be longer than a command-line argument.
    pub fn psql_script(&self, script: &str) {
        use std::io::Write;
        let mut child = self
            .psql_command()
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start psql");
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(script.as_bytes())
                .expect("write the script to psql");
        }
        let output = child.wait_with_output().expect("wait for psql");
        assert!(
            output.status.success(),
            "psql failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    pub fn psql(&self, sql: &str) -> String {
        self.try_psql(sql)
            .unwrap_or_else(|error| panic!("psql failed: {error}\nSQL: {sql}"))
    }

    /// One row of a task's status view, column → value.
    pub fn status(&self, task: i64) -> std::collections::HashMap<String, String> {
        // Empty while the server cannot answer, e.g. in crash recovery after a backend was killed.
        let json = self
            .try_psql(&format!(
                "SELECT row_to_json(s) FROM meili_sync_status s WHERE task = {task}"
            ))
            .unwrap_or_default();
        let value: serde_json::Value =
            serde_json::from_str(&json).unwrap_or(serde_json::Value::Null);
        value
            .as_object()
            .map(|object| {
                object
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.clone(),
                            v.as_str()
                                .map(str::to_owned)
                                .unwrap_or_else(|| v.to_string()),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits for a task's snapshot to finish (state leaves `snapshot`/`starting`), failing on `error`.
    pub fn wait_snapshot_done(&self, task: i64, timeout: Duration) {
        crate::wait_for("the snapshot to finish", timeout, || {
            let status = self.status(task);
            let state = status.get("state").cloned().unwrap_or_default();
            assert!(
                state != "error",
                "task {task} failed: {status:?}\n{}",
                self.tail_log()
            );
            (state == "streaming").then_some(())
        });
    }

    /// Waits for a task to stop in state `error`; returns its status row.
    pub fn wait_error(
        &self,
        task: i64,
        timeout: Duration,
    ) -> std::collections::HashMap<String, String> {
        crate::wait_for("the task to stop with an error", timeout, || {
            let status = self.status(task);
            (status.get("state").map(String::as_str) == Some("error")).then_some(status)
        })
    }

    pub fn tail_log(&self) -> String {
        let log = self.server_log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// SIGKILLs a task worker and waits until the server has gone through crash recovery and the
    /// launcher has started a new worker for the task.
    pub fn kill_worker(&self, task: i64, pid: i64) {
        self.kill(pid, "KILL");
        crate::wait_for(
            "a new worker after the crash",
            Duration::from_secs(300),
            || {
                let restarted: Option<i64> = self
                    .status(task)
                    .get("worker_pid")
                    .and_then(|v| v.parse().ok());
                restarted.filter(|new| *new != pid).map(|_| ())
            },
        );
    }

    /// Sends a signal to a process (as root this works for the postgres user's processes).
    pub fn kill(&self, pid: i64, signal: &str) {
        let status = Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status();
        assert!(
            status.map(|s| s.success()).unwrap_or(false),
            "kill -{signal} {pid} failed"
        );
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.pg_ctl_stop("immediate");
        if std::env::var_os("E2E_KEEP_CLUSTER").is_none() {
            if let Some(base) = self.data_dir.parent() {
                let _ = std::fs::remove_dir_all(base);
            }
        }
    }
}

/// A new cluster's data and socket directories (the data directory not yet made), owned by the
/// `postgres` user when the tests run as root.
fn new_directories(as_postgres: bool) -> (PathBuf, PathBuf) {
    let base = std::env::temp_dir().join(format!(
        "pg_meili_sync_e2e_{}_{}",
        std::process::id(),
        free_port()
    ));
    let socket_dir = base.join("sock");
    std::fs::create_dir_all(&socket_dir).expect("create cluster directories");
    if as_postgres {
        let status = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&base)
            .status();
        assert!(
            status.map(|s| s.success()).unwrap_or(false),
            "chown of {base:?} failed"
        );
    }
    (base.join("data"), socket_dir)
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("temporary paths are UTF-8")
}
