-- meili_sync_resync: NULL and unknown task ids, and a task that is still copying.
\set SHOW_CONTEXT never

-- NULL arguments.
SELECT meili_sync_resync(NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- Tasks that do not exist.
SELECT meili_sync_resync(42);
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- Still copying (its Meilisearch is unreachable): nothing to rebuild yet.
SELECT meili_sync_start('"Weird ""Table""; DROP TABLE products; --"', 'weird', '{"url": "http://127.0.0.1:1", "columns": ["id", "select"]}') AS task \gset
SELECT meili_sync_resync(:task);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT count(*) AS helpers FROM meili_sync.tasks WHERE resync_of = :task;

-- Dropping it removes everything it made.
SELECT meili_sync_drop(:task);
SELECT * FROM leftovers;
