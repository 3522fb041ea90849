//! Every `meili_sync.*` setting, registered once from `_PG_init`.

use std::ffi::CString;

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};

/// Room for this many tasks; `meili_sync.max_tasks` says how many may be used. A fixed array keeps
/// shared memory a constant size (about 700 bytes a task).
pub const TASK_ENTRIES: usize = 256;
/// Room for this many databases with tasks at once; `meili_sync.max_databases` says how many may
/// be used (a few dozen bytes each).
pub const DATABASE_ENTRIES: usize = 1024;

static URL: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static API_KEY: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static DATABASE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static RESTART_BACKOFF_MS: GucSetting<i32> = GucSetting::<i32>::new(1000);
static NAPTIME_MS: GucSetting<i32> = GucSetting::<i32>::new(1000);
static INDEX_CHECK_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(30_000);
static MAX_RETAINED_WAL_MB: GucSetting<i32> = GucSetting::<i32>::new(1024);
static LAG_WARNING_MS: GucSetting<i32> = GucSetting::<i32>::new(300_000);
/// Read by `meili_sync_status` only (its `progressing`).
static STUCK_AFTER_MS: GucSetting<i32> = GucSetting::<i32>::new(120_000);
static MAX_TASKS: GucSetting<i32> = GucSetting::<i32>::new(64);
static MAX_DATABASES: GucSetting<i32> = GucSetting::<i32>::new(64);
static DECODER_MEMORY_MB: GucSetting<i32> = GucSetting::<i32>::new(256);
static SEARCH_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(5_000);

pub fn init() {
    GucRegistry::define_string_guc(
        c"meili_sync.url",
        c"Default Meilisearch URL for tasks that do not set the url option.",
        c"For example http://127.0.0.1:7700.",
        &URL,
        GucContext::Suset,
        GucFlags::default(),
    );
    // Set by superusers only, absent from pg_settings and SHOW ALL, and masked in SHOW and
    // current_setting(): pg_read_all_settings (pg_monitor) would otherwise read it.
    // SAFETY: neither hook can panic: the check hook looks at the source and fills guc.c's error
    // strings, the show hook reads this setting and returns a static string.
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"meili_sync.api_key",
            c"Default Meilisearch API key for tasks that do not set the api_key option.",
            c"Never shown: SHOW prints ******** when it is set.",
            &API_KEY,
            GucContext::Suset,
            GucFlags::SUPERUSER_ONLY | GucFlags::NO_SHOW_ALL,
            Some(check_api_key_source),
            None,
            Some(show_api_key),
        );
    }
    GucRegistry::define_string_guc(
        c"meili_sync.database",
        c"Serve only this database's meili_sync tasks; empty serves every database.",
        c"Unset, the launcher runs the tasks of every database that has them.",
        &DATABASE,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"meili_sync.restart_backoff",
        c"First delay before the launcher restarts a crashed task worker; doubles per crash up to 60 s.",
        c"",
        &RESTART_BACKOFF_MS,
        10,
        60_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"meili_sync.naptime",
        c"How often the launcher rereads the task catalog when nothing wakes it.",
        c"",
        &NAPTIME_MS,
        10,
        600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"meili_sync.index_check_interval",
        c"How often a streaming task checks that nobody deleted or re-created its index.",
        c"",
        &INDEX_CHECK_INTERVAL_MS,
        100,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"meili_sync.search_timeout",
        c"How long meili_search and the other search functions wait for Meilisearch's answer.",
        c"A statement_timeout or a cancel ends the wait sooner.",
        &SEARCH_TIMEOUT_MS,
        1,
        3_600_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"meili_sync.decoder_memory",
        c"Memory the shared decoder may hold in documents not yet confirmed by Meilisearch, for all its tasks together.",
        c"Past it, each task sends its next request only once its earlier ones are confirmed; one request per task is always allowed.",
        &DECODER_MEMORY_MB,
        1,
        i32::MAX / 2,
        GucContext::Sighup,
        GucFlags::UNIT_MB,
    );
    GucRegistry::define_int_guc(
        c"meili_sync.max_retained_wal",
        c"WAL a task's slot may retain before a WARNING is logged and meili_sync_status.wal_warning turns true (0: never).",
        c"The slot keeps WAL that Meilisearch has not confirmed; see also max_slot_wal_keep_size.",
        &MAX_RETAINED_WAL_MB,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MB,
    );
    GucRegistry::define_int_guc(
        c"meili_sync.lag_warning",
        c"Age of the oldest unconfirmed change past which a WARNING is logged and meili_sync_status.lag_warning turns true (0: never).",
        c"",
        &LAG_WARNING_MS,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"meili_sync.stuck_after",
        c"How long a streaming task's position may stand still, while it has changes to read, before meili_sync_status.progressing turns false.",
        c"",
        &STUCK_AFTER_MS,
        1000,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"meili_sync.max_tasks",
        c"How many tasks (resync helpers included) may exist in all databases together; each running one uses a background worker.",
        c"Shared memory holds room for 256; raise max_worker_processes to match.",
        &MAX_TASKS,
        1,
        TASK_ENTRIES as i32,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"meili_sync.max_databases",
        c"How many databases may have tasks running at once; each runs a launcher, a background worker.",
        c"Only databases with the extension and tasks (or slots to clean up) count; a database waits while all are taken. At most 1024.",
        &MAX_DATABASES,
        1,
        DATABASE_ENTRIES as i32,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    // SAFETY: called from _PG_init after our settings are defined; warns about misspelled ones.
    #[cfg(not(any(feature = "pg13", feature = "pg14")))]
    unsafe {
        pgrx::pg_sys::MarkGUCPrefixReserved(c"meili_sync".as_ptr());
    }
    // SAFETY: the same, with the name these settings had before PostgreSQL 15.
    #[cfg(any(feature = "pg13", feature = "pg14"))]
    unsafe {
        pgrx::pg_sys::EmitWarningsOnPlaceholders(c"meili_sync".as_ptr());
    }
}

/// The key may come from the configuration files (postgresql.conf, ALTER SYSTEM) only: `SET`
/// would show it in pg_stat_activity, and `ALTER DATABASE/ROLE … SET` would store it in
/// pg_db_role_setting, which every role can read.
extern "C-unwind" fn check_api_key_source(
    _value: *mut *mut std::ffi::c_char,
    _extra: *mut *mut std::ffi::c_void,
    source: pgrx::pg_sys::GucSource::Type,
) -> bool {
    use pgrx::pg_sys::GucSource as Source;
    if matches!(
        source,
        Source::PGC_S_DEFAULT
            | Source::PGC_S_DYNAMIC_DEFAULT
            | Source::PGC_S_ENV_VAR
            | Source::PGC_S_FILE
            | Source::PGC_S_ARGV
    ) {
        return true;
    }
    // SAFETY: the check hook's error channel: set_config_option reports these strings (instead
    // of its default message, which would print the key) and frees them; pstrdup copies the
    // static text into the current memory context and cannot fail short of an out-of-memory
    // ERROR, which guc.c expects from a check hook.
    unsafe {
        pgrx::pg_sys::GUC_check_errcode(
            pgrx::PgSqlErrorCode::ERRCODE_CANT_CHANGE_RUNTIME_PARAM as std::ffi::c_int,
        );
        pgrx::pg_sys::GUC_check_errmsg_string = pgrx::pg_sys::pstrdup(
            c"meili_sync.api_key can be set in the configuration files only".as_ptr(),
        );
        pgrx::pg_sys::GUC_check_errhint_string = pgrx::pg_sys::pstrdup(
            c"Set it in postgresql.conf (or with ALTER SYSTEM) and reload, or pass \"api_key\" in the task's options.".as_ptr(),
        );
    }
    false
}

/// What SHOW, current_setting() and error messages print for `meili_sync.api_key`.
extern "C-unwind" fn show_api_key() -> *const std::ffi::c_char {
    if default_api_key().is_some() {
        c"********".as_ptr()
    } else {
        c"".as_ptr()
    }
}

fn string_setting(setting: &GucSetting<Option<CString>>) -> Option<String> {
    setting
        .get()
        .and_then(|value| value.into_string().ok())
        .filter(|value| !value.is_empty())
}

pub fn default_url() -> Option<String> {
    string_setting(&URL)
}

pub fn default_api_key() -> Option<String> {
    string_setting(&API_KEY)
}

/// The one database served, when `meili_sync.database` restricts the launcher to it.
pub fn database() -> Option<String> {
    string_setting(&DATABASE)
}

pub fn restart_backoff() -> std::time::Duration {
    std::time::Duration::from_millis(RESTART_BACKOFF_MS.get().max(10) as u64)
}

pub fn naptime() -> std::time::Duration {
    std::time::Duration::from_millis(NAPTIME_MS.get().max(10) as u64)
}

pub fn index_check_interval() -> std::time::Duration {
    std::time::Duration::from_millis(INDEX_CHECK_INTERVAL_MS.get().max(100) as u64)
}

/// Bytes of documents the shared decoder may hold for all its tasks (see `Dispatcher::set_squeezed`).
pub fn decoder_memory() -> usize {
    usize::try_from(DECODER_MEMORY_MB.get())
        .unwrap_or(1)
        .max(1)
        .saturating_mul(1024 * 1024)
}

pub fn max_tasks() -> usize {
    usize::try_from(MAX_TASKS.get())
        .unwrap_or(1)
        .clamp(1, TASK_ENTRIES)
}

pub fn max_databases() -> usize {
    usize::try_from(MAX_DATABASES.get())
        .unwrap_or(1)
        .clamp(1, DATABASE_ENTRIES)
}

/// None when the warning is off (0).
pub fn max_retained_wal_bytes() -> Option<i64> {
    let megabytes = MAX_RETAINED_WAL_MB.get();
    (megabytes > 0).then(|| i64::from(megabytes) * 1024 * 1024)
}

/// None when the warning is off (0).
/// How long a search waits for Meilisearch (`meili_sync.search_timeout`).
pub fn search_timeout() -> std::time::Duration {
    std::time::Duration::from_millis(SEARCH_TIMEOUT_MS.get().max(1) as u64)
}

pub fn lag_warning() -> Option<std::time::Duration> {
    let millis = LAG_WARNING_MS.get();
    (millis > 0).then(|| std::time::Duration::from_millis(millis as u64))
}
