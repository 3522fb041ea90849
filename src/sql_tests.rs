//! SQL-level tests, run inside Postgres in a transaction that is rolled back (so no worker ever
//! sees these rows): what each function does to the catalog, and the refusals that depend on a
//! task's state or on the task limit, which need states no worker may see. Bad input (wrong, NULL
//! and hostile arguments) is in the golden files only: tests/pg_regress/sql/{start, tasks,
//! dead_letters, verify, resync}.sql.

#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    /// Runs `sql` and returns "SQLSTATE: message | hint", or "ok" (plpgsql's EXCEPTION block is a
    /// subtransaction, so an error leaves the test's transaction usable). Needs `products()` first.
    fn outcome(sql: &str) -> String {
        Spi::get_one_with_args::<String>("SELECT pg_temp.outcome($1)", &[sql.into()])
            .expect("run statement")
            .unwrap_or_default()
    }

    fn products() {
        Spi::run(
            "CREATE FUNCTION pg_temp.outcome(statement text) RETURNS text LANGUAGE plpgsql AS $$
             DECLARE state text; message text; hint text;
             BEGIN
                 EXECUTE statement;
                 RETURN 'ok';
             EXCEPTION WHEN OTHERS THEN
                 GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, message = MESSAGE_TEXT, hint = PG_EXCEPTION_HINT;
                 RETURN state || ': ' || message || ' | ' || hint;
             END $$;
             GRANT EXECUTE ON FUNCTION pg_temp.outcome(text) TO PUBLIC",
        )
        .expect("create helper");
        Spi::run(
            "CREATE TABLE products (id bigint PRIMARY KEY, name text, price numeric, tags text[], meta jsonb);
             CREATE TABLE unique_code (id int, code text NOT NULL UNIQUE);",
        )
        .expect("create tables");
    }

    #[pg_test]
    fn start_creates_task_and_publication() {
        products();
        // A task with a slot of its own has a publication of its own.
        let id = Spi::get_one::<i64>(
            "SELECT meili_sync_start('products', 'products', '{\"url\": \"http://127.0.0.1:7700\", \"api_key\": \"s3cret\", \"batch_size\": 500, \"decoding\": \"own\"}')",
        )
        .expect("start")
        .expect("task id");
        let row = Spi::get_three_with_args::<String, String, String>(
            "SELECT source::text, index_uid, primary_key::text FROM meili_sync.tasks WHERE id = $1",
            &[id.into()],
        )
        .expect("task row");
        assert_eq!(
            row,
            (
                Some("products".into()),
                Some("products".into()),
                Some("{id}".into())
            )
        );
        let options = Spi::get_one_with_args::<String>(
            "SELECT options->>'batch_size' || ',' || (options ? 'api_key')::text FROM meili_sync.tasks WHERE id = $1",
            &[id.into()],
        )
        .expect("options");
        assert_eq!(options.as_deref(), Some("500,false"));
        let key = Spi::get_one_with_args::<String>(
            "SELECT api_key FROM meili_sync.task_secrets WHERE task_id = $1",
            &[id.into()],
        )
        .expect("secret");
        assert_eq!(key.as_deref(), Some("s3cret"));
        let published = Spi::get_one_with_args::<String>(
            "SELECT tablename::text FROM pg_publication_tables
              WHERE pubname = 'meili_sync_' || 'meili_sync.tasks'::regclass::oid || '_' || $1",
            &[id.into()],
        )
        .expect("publication");
        assert_eq!(published.as_deref(), Some("products"));
        let status = Spi::get_two_with_args::<String, String>(
            "SELECT index_uid, state FROM meili_sync_status WHERE task = $1",
            &[id.into()],
        )
        .expect("status");
        assert_eq!(status, (Some("products".into()), Some("starting".into())));
    }

    #[pg_test]
    fn start_with_unique_key_option_and_replica_identity() {
        products();
        // Without the replica identity it is refused (tests/pg_regress/sql/start.sql).
        Spi::run("ALTER TABLE unique_code REPLICA IDENTITY USING INDEX unique_code_code_key")
            .expect("identity");
        let accepted = outcome(
            "SELECT meili_sync_start('unique_code', 'codes', '{\"url\": \"http://x:7700\", \"primary_key\": \"code\"}')",
        );
        assert_eq!(accepted, "ok");
    }

    #[pg_test]
    fn a_key_within_a_wider_replica_identity_is_accepted_and_one_outside_it_is_not() {
        // The old row of a DELETE carries (region, code): it holds the key (code), as the
        // worker's own check of the table has always accepted.
        products();
        Spi::run(
            "CREATE TABLE regional (region text, code text NOT NULL UNIQUE, name text,
                                    PRIMARY KEY (region, code))",
        )
        .expect("table");
        let start = |key: &str| {
            outcome(&format!(
                "SELECT meili_sync_start('regional', 'regional_{key}', '{{\"url\": \"http://x:7700\", \"primary_key\": \"{key}\"}}')"
            ))
        };
        assert_eq!(start("code"), "ok");
        Spi::run("CREATE UNIQUE INDEX regional_name ON regional (name)").expect("index");
        Spi::run("ALTER TABLE regional ALTER name SET NOT NULL").expect("not null");
        let refused = start("name");
        // 42P16: invalid_table_definition.
        assert!(
            refused.starts_with(
                "42P16: the replica identity of table public.regional does not carry the key (name)"
            ),
            "{refused}"
        );
    }

    #[pg_test]
    fn pause_and_resume_pick_up_where_the_task_was() {
        products();
        let id = Spi::get_one::<i64>("SELECT meili_sync_start('products', 'products', '{\"url\": \"http://127.0.0.1:7700\"}')")
            .expect("start")
            .expect("id");
        let state = |sql: &str| {
            Spi::run_with_args(sql, &[id.into()]).expect("call");
            Spi::get_one_with_args::<String>(
                "SELECT state FROM meili_sync.tasks WHERE id = $1",
                &[id.into()],
            )
            .expect("state")
            .unwrap_or_default()
        };
        assert_eq!(state("SELECT meili_sync_pause($1)"), "paused");
        assert_eq!(state("SELECT meili_sync_resume($1)"), "snapshot");
        assert_eq!(state("UPDATE meili_sync.tasks SET state = 'error', snapshot_finished_at = now() WHERE id = $1"), "error");
        assert_eq!(state("SELECT meili_sync_resume($1)"), "streaming");
    }

    #[pg_test]
    fn resync_creates_a_helper_and_guards_the_held_task() {
        products();
        // The error without its hint.
        let message = |sql: &str| {
            outcome(sql)
                .split(" | ")
                .next()
                .unwrap_or_default()
                .to_owned()
        };
        let id = Spi::get_one::<i64>("SELECT meili_sync_start('products', 'products', '{\"url\": \"http://127.0.0.1:7700\", \"batch_size\": 100, \"decoding\": \"own\"}')")
            .expect("start")
            .expect("id");
        // Still copying: nothing to rebuild yet.
        assert_eq!(
            message(&format!("SELECT meili_sync_resync({id})")),
            format!(
                "55000: task {id} is in state \"snapshot\"; only a streaming task can be resynced"
            )
        );
        Spi::run_with_args(
            "UPDATE meili_sync.tasks SET state = 'streaming', snapshot_finished_at = now() WHERE id = $1",
            &[id.into()],
        )
        .expect("streaming");
        let helper = Spi::get_one_with_args::<i64>("SELECT meili_sync_resync($1)", &[id.into()])
            .expect("resync")
            .expect("helper id");
        let row = Spi::get_one_with_args::<String>(
            "SELECT concat_ws(',', index_uid, state, resync_of, url, options->>'batch_size', primary_key::text)
               FROM meili_sync.tasks WHERE id = $1",
            &[helper.into()],
        )
        .expect("helper row")
        .unwrap_or_default();
        assert_eq!(
            row,
            format!("products__resync,snapshot,{id},http://127.0.0.1:7700,100,{{id}}")
        );
        let publications = Spi::get_one::<i64>(
            "SELECT count(*) FROM pg_catalog.pg_publication WHERE pubname LIKE 'meili\\_sync\\_%'",
        )
        .expect("count")
        .unwrap_or_default();
        assert_eq!(publications, 2);
        assert_eq!(
            message(&format!("SELECT meili_sync_resync({id})")),
            format!("42710: task {id} is already being resynced by helper task {helper}")
        );
        assert_eq!(
            message(&format!("SELECT meili_sync_resync({helper})")),
            format!("22023: task {helper} is the resync helper of task {id}")
        );
        // Held for the swap, the task refuses changes until the helper lets it go.
        Spi::run_with_args(
            "UPDATE meili_sync.tasks SET state = 'swapping' WHERE id = $1",
            &[id.into()],
        )
        .expect("hold");
        for call in [
            "meili_sync_pause",
            "meili_sync_resume",
            "meili_sync_snapshot",
        ] {
            assert_eq!(
                message(&format!("SELECT {call}({id})")),
                format!("55000: task {id} is held while its resync swaps in the new index")
            );
        }
        // Dropping the task drops its helper too.
        Spi::run_with_args("SELECT meili_sync_drop($1)", &[id.into()]).expect("drop");
        let left = Spi::get_one::<i64>("SELECT count(*) FROM meili_sync.tasks")
            .expect("count")
            .unwrap_or_default();
        assert_eq!(left, 0);
    }

    #[pg_test]
    fn a_shared_task_has_no_publication_of_its_own_and_its_resync_helper_has_a_slot_of_its_own() {
        products();
        // Shared decoding is the default, and the default is not stored.
        let id = Spi::get_one::<i64>(
            "SELECT meili_sync_start('products', 'products', '{\"url\": \"http://127.0.0.1:7700\"}')",
        )
        .expect("start")
        .expect("task id");
        let publications = "(SELECT count(*) FROM pg_catalog.pg_publication WHERE pubname LIKE 'meili\\_sync\\_%')";
        let row = Spi::get_one_with_args::<String>(
            &format!(
                "SELECT concat_ws(',', coalesce(t.options->>'decoding', 'default'), s.decoding, t.stream_position IS NULL, {publications})
                   FROM meili_sync.tasks t JOIN meili_sync_status s ON s.task = t.id WHERE t.id = $1"
            ),
            &[id.into()],
        )
        .expect("task row")
        .unwrap_or_default();
        // The shared decoder publishes the table and gives the position, once it sees the task.
        assert_eq!(row, "default,shared,t,0");
        Spi::run_with_args(
            "UPDATE meili_sync.tasks SET state = 'streaming', snapshot_finished_at = now() WHERE id = $1",
            &[id.into()],
        )
        .expect("streaming");
        // The helper copies and streams into the new index through a slot of its own.
        let helper = Spi::get_one_with_args::<i64>("SELECT meili_sync_resync($1)", &[id.into()])
            .expect("resync")
            .expect("helper id");
        let row = Spi::get_one_with_args::<String>(
            &format!(
                "SELECT concat_ws(',', s.decoding, {publications}) FROM meili_sync_status s WHERE s.task = $1"
            ),
            &[helper.into()],
        )
        .expect("helper row")
        .unwrap_or_default();
        assert_eq!(row, "own,1");
        assert_eq!(
            outcome(&format!(
                "SELECT meili_sync_alter({id}, '{{\"decoding\": \"own\"}}')"
            )),
            format!("0A000: task {id} is in the shared decoding pass and cannot move to a slot of its own | Start a new task with '{{\"decoding\": \"own\"}}' (meili_sync_drop, then meili_sync_start): it copies the table again.")
        );
    }

    #[pg_test]
    fn max_tasks_is_enforced() {
        products();
        Spi::run(
            "SELECT meili_sync_start('products', 'p' || i, '{\"url\": \"http://127.0.0.1:7700\"}')
               FROM generate_series(1, current_setting('meili_sync.max_tasks')::int) AS i",
        )
        .expect("as many tasks as allowed");
        let refused = outcome(
            "SELECT meili_sync_start('products', 'one_more', '{\"url\": \"http://127.0.0.1:7700\"}')",
        );
        assert!(
            refused.starts_with("53400: there are already 64 meili_sync tasks"),
            "{refused}"
        );
    }

    #[pg_test]
    fn alter_changes_options_url_and_key_in_place() {
        products();
        let id = Spi::get_one::<i64>(
            "SELECT meili_sync_start('products', 'products', '{\"url\": \"http://127.0.0.1:7700\", \"batch_size\": 100}')",
        )
        .expect("start")
        .expect("id");
        let altered = Spi::get_one_with_args::<bool>(
            "SELECT meili_sync_alter($1, '{\"batch_size\": 250, \"url\": \"http://meili:7700\", \"api_key\": \"new\"}')",
            &[id.into()],
        )
        .expect("alter");
        assert_eq!(altered, Some(true));
        let row = Spi::get_three_with_args::<String, String, String>(
            "SELECT t.options->>'batch_size', t.url, s.api_key
               FROM meili_sync.tasks t JOIN meili_sync.task_secrets s ON s.task_id = t.id WHERE t.id = $1",
            &[id.into()],
        )
        .expect("row");
        assert_eq!(
            row,
            (
                Some("250".into()),
                Some("http://meili:7700".into()),
                Some("new".into())
            )
        );
        let columns = Spi::get_one::<String>(
            "SELECT string_agg(attname, ',' ORDER BY attnum) FROM pg_attribute
              WHERE attrelid = 'meili_sync_status'::regclass AND attname IN ('lag_bytes', 'retained_wal_bytes', 'wal_status')",
        )
        .expect("columns");
        assert_eq!(
            columns.as_deref(),
            Some("lag_bytes,retained_wal_bytes,wal_status")
        );
    }

    #[pg_test]
    fn pg_stat_meili_sync_lists_tasks_with_counters() {
        products();
        Spi::run("SELECT meili_sync_start('products', 'products', '{\"url\": \"http://127.0.0.1:7700\"}')").expect("start");
        let row = Spi::get_two::<String, i64>("SELECT index_uid, documents + batches + bytes_sent + retries + dead_letters FROM pg_stat_meili_sync")
            .expect("row");
        assert_eq!(row, (Some("products".into()), Some(0)));
        assert_eq!(
            Spi::get_one::<bool>("SELECT pg_stat_meili_sync_reset()").expect("reset"),
            Some(true)
        );
        Spi::run("CREATE ROLE meili_sync_test_other").expect("role");
        Spi::run("SET ROLE meili_sync_test_other").expect("set role");
        let denied = outcome("SELECT pg_stat_meili_sync_reset()");
        assert!(denied.starts_with("42501"), "{denied}");
        Spi::run("RESET ROLE").expect("reset role");
    }

    #[pg_test]
    fn stop_snapshot_and_drop_change_the_catalog() {
        products();
        let id = Spi::get_one::<i64>("SELECT meili_sync_start('products', 'products', '{\"url\": \"http://127.0.0.1:7700\"}')")
            .expect("start")
            .expect("id");
        Spi::run_with_args(
            "UPDATE meili_sync.tasks SET snapshot_key = '{41}', rows_copied = 41 WHERE id = $1",
            &[id.into()],
        )
        .expect("fake progress");
        assert_eq!(
            Spi::get_one_with_args::<bool>("SELECT meili_sync_stop($1)", &[id.into()])
                .expect("stop"),
            Some(true)
        );
        let state = Spi::get_one_with_args::<String>(
            "SELECT state FROM meili_sync.tasks WHERE id = $1",
            &[id.into()],
        )
        .expect("state");
        assert_eq!(state.as_deref(), Some("stopped"));
        assert_eq!(
            Spi::get_one_with_args::<bool>("SELECT meili_sync_snapshot($1)", &[id.into()])
                .expect("snapshot"),
            Some(true)
        );
        let reset = Spi::get_two_with_args::<String, i64>(
            "SELECT state || coalesce(snapshot_key::text, '-'), rows_copied FROM meili_sync.tasks WHERE id = $1",
            &[id.into()],
        )
        .expect("reset");
        assert_eq!(reset, (Some("snapshot-".into()), Some(0)));
        assert_eq!(
            Spi::get_one_with_args::<bool>("SELECT meili_sync_drop($1)", &[id.into()])
                .expect("drop"),
            Some(true)
        );
        let left = Spi::get_two::<i64, i64>(
            "SELECT (SELECT count(*) FROM meili_sync.tasks), (SELECT count(*) FROM pg_publication WHERE pubname LIKE 'meili_sync_%')",
        )
        .expect("left");
        assert_eq!(left, (Some(0), Some(0)));
    }

    #[pg_test]
    fn keys_are_hidden_from_ordinary_roles() {
        products();
        Spi::run("SELECT meili_sync_start('products', 'products', '{\"url\": \"http://127.0.0.1:7700\", \"api_key\": \"s3cret\"}')")
            .expect("start");
        Spi::run("CREATE ROLE meili_sync_test_reader; CREATE ROLE meili_sync_test_monitor IN ROLE pg_monitor").expect("roles");
        Spi::run("SET ROLE meili_sync_test_reader").expect("set role");
        let denied = outcome("SELECT api_key FROM meili_sync.task_secrets");
        assert!(denied.starts_with("42501"), "{denied}");
        let start = outcome(
            "SELECT meili_sync_start('products', 'other', '{\"url\": \"http://127.0.0.1:7700\"}')",
        );
        // Not executable by PUBLIC at all (and the function checks again inside).
        assert!(
            start.starts_with("42501: permission denied for function meili_sync_start"),
            "{start}"
        );
        Spi::run("RESET ROLE; SET ROLE meili_sync_test_monitor").expect("set role");
        let visible =
            Spi::get_one::<i64>("SELECT count(*) FROM meili_sync_status").expect("status");
        assert_eq!(visible, Some(1));
        let denied = outcome("SELECT api_key FROM meili_sync.task_secrets");
        assert!(denied.starts_with("42501"), "{denied}");
        Spi::run("RESET ROLE").expect("reset");
    }

    /// A search's hits become jsonb without the text round trip: the datum equals what jsonb_in
    /// makes of the value's text, for every kind of JSON value and number.
    #[pg_test]
    fn jsonb_built_in_place_equals_jsonb_in() {
        let samples = [
            r#"{"id": 1, "name": "Kettle \"copper\" \u2615 é", "price": 18.027756377319943,
                "big": 18446744073709551615, "least": -9223372036854775808, "tiny": 1e-7,
                "huge": 1e300, "tags": ["a", [], {}, null, true, false],
                "nested": {"b": {"c": [1, 2.5, "x", {"d": null}]}}, "": "empty key",
                "escapes": "tab\tline\nslash\\"}"#,
            "[]",
            "{}",
            r#"[1, "two", null, [[]]]"#,
            r#""a scalar string""#,
            "42",
            "-0.0",
            "null",
            "true",
            "3.14",
        ];
        for sample in samples {
            let value: serde_json::Value = serde_json::from_str(sample).expect("sample");
            // What pgrx's JsonB sent to jsonb_in: serde_json's text of the value.
            let text = value.to_string();
            let same = Spi::get_one_with_args::<bool>(
                "SELECT $1::text = $2::jsonb::text AND $1 = $2::jsonb
                        AND pg_catalog.jsonb_typeof($1) = pg_catalog.jsonb_typeof($2::jsonb)",
                &[
                    crate::search::jsonb::DirectJsonb(value).into(),
                    text.as_str().into(),
                ],
            )
            .expect("compare");
            assert_eq!(same, Some(true), "{sample}");
        }
    }

    /// A NUL in a string is refused as jsonb_in refuses `\u0000`.
    #[pg_test]
    fn jsonb_built_in_place_refuses_nul() {
        let refused = PgTryBuilder::new(|| {
            let value = serde_json::json!({"name": "a\u{0}b"});
            crate::search::jsonb::DirectJsonb(value).into_datum();
            "built".to_owned()
        })
        .catch_when(
            PgSqlErrorCode::ERRCODE_UNTRANSLATABLE_CHARACTER,
            |error| match error {
                pg_sys::panic::CaughtError::PostgresError(report)
                | pg_sys::panic::CaughtError::ErrorReport(report) => {
                    format!("{:?}: {}", report.sql_error_code(), report.message())
                }
                _ => "another error".to_owned(),
            },
        )
        .execute();
        assert_eq!(
            refused,
            "ERRCODE_UNTRANSLATABLE_CHARACTER: unsupported Unicode escape sequence"
        );
        let by_jsonb_in = outcome_of_jsonb_in(r#"{"name": "a\u0000b"}"#);
        assert!(
            by_jsonb_in.starts_with("22P05: unsupported Unicode escape sequence"),
            "{by_jsonb_in}"
        );
    }

    fn outcome_of_jsonb_in(text: &str) -> String {
        products();
        outcome(&format!("SELECT '{text}'::jsonb"))
    }
}
