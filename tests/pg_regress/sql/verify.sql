-- meili_sync_verify and meili_sync_repair: NULL and unknown task ids, a NULL sample size, and a
-- Meilisearch that cannot be reached (an ERROR saying so, not a report of everything missing).
\set SHOW_CONTEXT never

-- NULL arguments.
SELECT * FROM meili_sync_verify(NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_sync_repair(NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- Tasks that do not exist.
SELECT * FROM meili_sync_verify(42);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_sync_repair(42);
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- A task whose Meilisearch is unreachable.
SELECT meili_sync_start('"Weird ""Table""; DROP TABLE products; --"', 'weird', '{"url": "http://127.0.0.1:1", "columns": ["id", "select"]}') AS task \gset
SELECT * FROM meili_sync_verify(:task, NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_sync_verify(:task);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_sync_repair(:task);
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- Dropping it removes everything it made.
SELECT meili_sync_drop(:task);
SELECT * FROM leftovers;
