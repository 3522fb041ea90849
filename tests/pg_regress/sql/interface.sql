-- The extension's interface as a user sees it: functions, view columns and settings. A change
-- here is a change to the documented API (docs/reference).
SELECT p.proname AS function, pg_catalog.pg_get_function_arguments(p.oid) AS arguments,
       pg_catalog.pg_get_function_result(p.oid) AS result
  FROM pg_catalog.pg_proc p
  JOIN pg_catalog.pg_depend d ON d.objid = p.oid AND d.deptype = 'e'
  JOIN pg_catalog.pg_extension e ON e.oid = d.refobjid AND e.extname = 'pg_meili_sync'
 ORDER BY 1, 2;

SELECT table_name AS view, column_name AS column, data_type AS type
  FROM information_schema.columns
 WHERE table_name IN ('meili_sync_status', 'pg_stat_meili_sync', 'meili_sync_dead_letters')
 ORDER BY table_name, ordinal_position;

SELECT name, vartype, unit, boot_val AS default, context, short_desc
  FROM pg_catalog.pg_settings WHERE name LIKE 'meili\_sync.%' ORDER BY name;
