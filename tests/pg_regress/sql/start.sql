-- meili_sync_start: every wrong, NULL and hostile argument is a clear ERROR with a SQLSTATE and
-- a HINT, and nothing is left behind. Each failing statement is followed by the SQLSTATE it raised.
\set SHOW_CONTEXT never

-- NULL arguments are errors, not silent NULL results.
SELECT meili_sync_start(NULL, 'x', '{}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', NULL, '{}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- Tables: missing, hostile names, no key, not a table.
SELECT meili_sync_start('missing', 'x', '{}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products; DROP TABLE products', 'x', '{}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('no_key', 'x', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('leftovers', 'x', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('pg_catalog.pg_class', 'x', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- Keys Meilisearch cannot take, tables whose changes cannot be streamed.
SELECT meili_sync_start('float_key', 'x', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('json_key', 'x', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('scratch', 'x', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products_view', 'x', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- A unique key that is not the replica identity: DELETEs would not carry it.
SELECT meili_sync_start('unique_code', 'codes', '{"url": "http://127.0.0.1:1", "primary_key": "code"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- Index uids: Meilisearch's rules, checked before anything is created.
SELECT meili_sync_start('products', '', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x''; DROP TABLE products; --', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', '../indexes', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'produçts', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', repeat('a', 401), '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- Options: not an object, unknown, wrong types, out of range, hostile strings.
SELECT meili_sync_start('products', 'x', '[]');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', 'null');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "batchsize": 10}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "batch_size": "1000"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "batch_size": 0}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "batch_size": 1e12}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- A batch is one request body: never above the payload limit Meilisearch enforces.
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "max_payload_bytes": 1000000, "batch_bytes": 3000000}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "batch_bytes": 200000000}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "max_inflight": -1}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "gzip": "yes"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "columns": ["nope"]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "write_mode": "merge"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "decoding": "both"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "api_key": 42}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "settings": "searchable"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "columns": ["id\"; DROP TABLE products; --"]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "exclude_columns": ["id"]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "name); DROP TABLE products; --"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "name"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- URLs.
SELECT meili_sync_start('products', 'x', '{}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "127.0.0.1:7700"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "javascript:alert(1)"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:99999"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://a b/"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- Replicas: a non-empty list of servers, each with a good URL, each once, in place of url.
SELECT meili_sync_start('products', 'x', '{"replicas": []}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"replicas": ["http://127.0.0.1:1"]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"replicas": [{"api_key": "k"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"replicas": [{"url": "http://127.0.0.1:1", "key": "k"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"replicas": [{"url": "javascript:alert(1)"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"replicas": [{"url": "http://127.0.0.1:1"}, {"url": "http://127.0.0.1:1/"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"url": "http://127.0.0.1:1", "replicas": [{"url": "http://127.0.0.1:2"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- Shards: named servers, each name and URL once, in place of url and replicas.
SELECT meili_sync_start('products', 'x', '{"shards": []}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"shards": [{"url": "http://127.0.0.1:1"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"shards": [{"name": "a b", "url": "http://127.0.0.1:1"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"shards": [{"name": "a", "url": "http://127.0.0.1:1"}, {"name": "a", "url": "http://127.0.0.1:2"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"shards": [{"name": "a", "url": "http://127.0.0.1:1"}, {"name": "b", "url": "http://127.0.0.1:1/"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"shards": [{"name": "a", "url": "http://127.0.0.1:1", "weight": 2}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"shards": [{"name": "a", "url": "http://127.0.0.1:1"}], "replicas": [{"url": "http://127.0.0.1:2"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('products', 'x', '{"api_key": "k", "shards": [{"name": "a", "url": "http://127.0.0.1:1"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- Nothing of the above was created.
SELECT * FROM leftovers;

-- A table whose name is itself an injection attempt syncs like any other: every identifier the
-- extension writes into SQL is quoted (here into a publication of the task's own).
SELECT meili_sync_start('"Weird ""Table""; DROP TABLE products; --"', 'weird', '{"url": "http://127.0.0.1:1", "columns": ["id", "select"], "decoding": "own"}') AS task \gset
SELECT pubname ~ '^meili_sync_[0-9]+_[0-9]+$' AS our_name, schemaname, tablename
  FROM pg_catalog.pg_publication_tables WHERE pubname LIKE 'meili\_sync\_%';
SELECT to_regclass('products') IS NOT NULL AS products_still_there;

-- A duplicate task.
SELECT meili_sync_start('"Weird ""Table""; DROP TABLE products; --"', 'weird', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- One index, one task: another table into the same index (trailing slash or not) is refused too.
SELECT meili_sync_start('products', 'weird', '{"url": "http://127.0.0.1:1/"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT url, options FROM meili_sync.tasks WHERE id = :task;

-- Dropping it removes everything it made.
SELECT meili_sync_drop(:task);
SELECT * FROM leftovers;
