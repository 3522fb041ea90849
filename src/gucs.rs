//! Every `meili_sync.*` setting, registered once from `_PG_init`.

use std::ffi::CString;

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};

static URL: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static API_KEY: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static DATABASE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c"postgres"));
static RESTART_BACKOFF_MS: GucSetting<i32> = GucSetting::<i32>::new(1000);
static NAPTIME_MS: GucSetting<i32> = GucSetting::<i32>::new(1000);
static INDEX_CHECK_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(30_000);
static MAX_RETAINED_WAL_MB: GucSetting<i32> = GucSetting::<i32>::new(1024);
static LAG_WARNING_MS: GucSetting<i32> = GucSetting::<i32>::new(300_000);
static MAX_TASKS: GucSetting<i32> = GucSetting::<i32>::new(64);

pub fn init() {
    GucRegistry::define_string_guc(
        c"meili_sync.url",
        c"Default Meilisearch URL for tasks that do not set the url option.",
        c"For example http://127.0.0.1:7700.",
        &URL,
        GucContext::Suset,
        GucFlags::default(),
    );
    // Superuser-only and hidden from SHOW ALL so the key never reaches ordinary roles.
    GucRegistry::define_string_guc(
        c"meili_sync.api_key",
        c"Default Meilisearch API key for tasks that do not set the api_key option.",
        c"Readable by superusers only.",
        &API_KEY,
        GucContext::Suset,
        GucFlags::SUPERUSER_ONLY | GucFlags::NO_SHOW_ALL,
    );
    GucRegistry::define_string_guc(
        c"meili_sync.database",
        c"Database whose meili_sync tasks the launcher runs.",
        c"The extension must be created in this database.",
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
        c"meili_sync.max_tasks",
        c"How many tasks (resync helpers included) may exist; each running one uses a background worker.",
        c"Shared memory holds room for 256; raise max_worker_processes to match.",
        &MAX_TASKS,
        1,
        crate::shmem::TASK_SLOTS as i32,
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

pub fn database() -> String {
    string_setting(&DATABASE).unwrap_or_else(|| "postgres".to_owned())
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

pub fn max_tasks() -> usize {
    usize::try_from(MAX_TASKS.get())
        .unwrap_or(1)
        .clamp(1, crate::shmem::TASK_SLOTS)
}

/// None when the warning is off (0).
pub fn max_retained_wal_bytes() -> Option<i64> {
    let megabytes = MAX_RETAINED_WAL_MB.get();
    (megabytes > 0).then(|| i64::from(megabytes) * 1024 * 1024)
}

/// None when the warning is off (0).
pub fn lag_warning() -> Option<std::time::Duration> {
    let millis = LAG_WARNING_MS.get();
    (millis > 0).then(|| std::time::Duration::from_millis(millis as u64))
}
