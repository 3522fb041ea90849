-- Who may do what. A key never shows to roles outside meili_sync_admin, in tables, views or
-- function results; only superusers and meili_sync_admin members manage tasks; pg_monitor members
-- read the monitoring views.
\set SHOW_CONTEXT never
SELECT meili_sync_start('products', 'secure', '{"url": "http://127.0.0.1:1", "api_key": "k3y-never-shown"}') AS task \gset

-- An ordinary role sees nothing and changes nothing.
SET ROLE regress_reader;
SELECT count(*) FROM meili_sync.tasks;
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT api_key FROM meili_sync.task_secrets;
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT count(*) FROM meili_sync_status;
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT count(*) FROM pg_stat_meili_sync;
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT count(*) FROM meili_sync_dead_letters;
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'mine', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_stop(:task);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(:task, '{"url": "http://attacker:7700"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_drop(:task);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT pg_stat_meili_sync_reset();
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_sync_verify(:task);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_sync_repair(:task);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
RESET ROLE;

-- A pg_monitor member reads the monitoring views, never a key, and changes nothing.
SET ROLE regress_monitor;
SELECT task, source_table, index_uid, url FROM meili_sync_status;
SELECT count(*) AS rows_with_the_key FROM meili_sync_status s WHERE row_to_json(s)::text LIKE '%k3y-never-shown%';
SELECT task, index_uid FROM pg_stat_meili_sync;
SELECT count(*) AS tasks_rows_with_the_key FROM meili_sync.tasks t WHERE row_to_json(t)::text LIKE '%k3y-never-shown%';
SELECT api_key FROM meili_sync.task_secrets;
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT count(*) FROM meili_sync_dead_letters;
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_pause(:task);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
RESET ROLE;

-- A meili_sync_admin member manages tasks and may read keys.
SET ROLE regress_admin;
SELECT meili_sync_alter(:task, '{"api_key": "rotated-k3y", "batch_size": 500}');
SELECT api_key FROM meili_sync.task_secrets WHERE task_id = :task;
SELECT options FROM meili_sync.tasks WHERE id = :task;
SELECT meili_sync_pause(:task), meili_sync_resume(:task);
RESET ROLE;

-- The key is not in the options the catalog keeps (it lives in meili_sync.task_secrets only).
SELECT count(*) AS catalog_rows_with_a_key FROM meili_sync.tasks t
 WHERE row_to_json(t)::text LIKE '%k3y%';
SELECT meili_sync_drop(:task);
SELECT * FROM leftovers;
