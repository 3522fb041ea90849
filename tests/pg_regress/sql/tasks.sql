-- The task functions (stop, pause, resume, snapshot, alter, drop): NULL and unknown task ids,
-- and meili_sync_alter refusing bad changes while the task stays as it was.
\set SHOW_CONTEXT never

-- NULL arguments.
SELECT meili_sync_stop(NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_pause(NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_resume(NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_snapshot(NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(NULL, '{}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_drop(NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- Tasks that do not exist.
SELECT meili_sync_stop(-1);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_pause(9223372036854775807);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_resume(0);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_snapshot(42);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(42, '{"batch_size": 10}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_drop(42, true);
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- A task to alter.
SELECT meili_sync_start('"Weird ""Table""; DROP TABLE products; --"', 'weird', '{"url": "http://127.0.0.1:1", "columns": ["id", "select"]}') AS task \gset
SELECT meili_sync_alter(:task, '{"primary_key": "select"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(:task, '{"columns": ["id"]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- The task is in the shared decoding pass (the default): there is no way back to a slot of its
-- own, which would start at the present and skip what the shared slot holds for it.
SELECT meili_sync_alter(:task, '{"decoding": "own"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(:task, '{"decoding": "shared"}');
SELECT meili_sync_alter(:task, '{"batch_size": -5}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(:task, '{"url": "ftp://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(:task, '"batch_size"');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(:task, NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_drop(:task, NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- Replicas: the task's own server stays in the list.
SELECT meili_sync_alter(:task, '{"replicas": [{"url": "http://127.0.0.1:2"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(:task, '{"url": "http://127.0.0.1:1", "replicas": [{"url": "http://127.0.0.1:2"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- Unchanged by all of the above.
SELECT url, options FROM meili_sync.tasks WHERE id = :task;

-- One more server is a replica row, which takes its options from its task, and goes with it.
SELECT meili_sync_alter(:task, '{"replicas": [{"url": "http://127.0.0.1:1"}, {"url": "http://127.0.0.1:2"}]}');
SELECT url, replica_of OPERATOR(pg_catalog.=) :task AS replica, options FROM meili_sync.tasks ORDER BY id;
SELECT id AS replica FROM meili_sync.tasks WHERE replica_of = :task \gset
SELECT meili_sync_alter(:replica, '{"batch_size": 10}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_resync(:task);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_resync(:replica);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(:task, '{"batch_size": 20}');
SELECT url, options ->> 'batch_size' AS batch_size FROM meili_sync.tasks ORDER BY id;

-- Dropping it removes everything it made.
SELECT meili_sync_drop(:task);
SELECT * FROM leftovers;

-- Shards: one row per shard, each with its name and every shard's names; the task's own row first.
SELECT meili_sync_start('products', 'sharded', '{"shards": [{"name": "s0", "url": "http://127.0.0.1:1"}, {"name": "s1", "url": "http://127.0.0.1:2", "api_key": "k1"}, {"name": "s2", "url": "http://127.0.0.1:3"}]}') AS sharded \gset
SELECT url, shard, shard_names, replica_of OPERATOR(pg_catalog.=) :sharded AS member FROM meili_sync.tasks ORDER BY id;
SELECT id AS shard_row FROM meili_sync.tasks WHERE replica_of = :sharded ORDER BY id LIMIT 1 \gset
-- A sharded task's servers are its shards; one shard's row is not dropped or altered alone.
SELECT meili_sync_alter(:sharded, '{"shards": [{"name": "s0", "url": "http://127.0.0.1:1"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(:sharded, '{"url": "http://127.0.0.1:4"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(:sharded, '{"replicas": [{"url": "http://127.0.0.1:4"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(:shard_row, '{"batch_size": 10}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_drop(:shard_row);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_resync(:sharded);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_alter(:sharded, '{"batch_size": 20}');
SELECT shard, options ->> 'batch_size' AS batch_size FROM meili_sync.tasks ORDER BY id;
-- A shard added after the others: its row has the new list; the others keep theirs until it has
-- its documents (the rebalance worker moves them all to the new list then).
SELECT meili_sync_alter(:sharded, '{"shards": [{"name": "s0", "url": "http://127.0.0.1:1"}, {"name": "s1", "url": "http://127.0.0.1:2"}, {"name": "s2", "url": "http://127.0.0.1:3"}, {"name": "s3", "url": "http://127.0.0.1:4"}]}');
SELECT url, shard, shard_names, state FROM meili_sync.tasks ORDER BY id;
SELECT meili_sync_alter(:sharded, '{"shards": [{"name": "s0", "url": "http://127.0.0.1:1"}, {"name": "s1", "url": "http://127.0.0.1:2"}, {"name": "s2", "url": "http://127.0.0.1:3"}, {"name": "s3", "url": "http://127.0.0.1:4"}, {"name": "s4", "url": "http://127.0.0.1:5"}]}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_drop(:sharded);
SELECT * FROM leftovers;
