-- Searching from SQL and waiting for one's own writes: bad input, each with its SQLSTATE, and who
-- may search. (Hits, facets and the wait against a real index are end-to-end tests.)
\set SHOW_CONTEXT never
SELECT meili_sync_start('products', 'searchable', '{"url": "http://127.0.0.1:1", "search_api_key": "search-only-k3y"}') AS task \gset
SELECT * FROM meili_search(NULL, 'kettle');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_search(424242, 'kettle');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_search(:task, 'kettle', NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_search(:task, 'kettle', '[1, 2]');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- Meilisearch is not there: a connection failure, with the URL but never a key.
SELECT * FROM meili_search(:task, 'kettle');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_facets(:task, 'kettle', NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_search_raw(:task, NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- By URL and index: the same checks as meili_sync_start's.
SELECT * FROM meili_search('ftp://127.0.0.1:1', 'searchable', 'kettle');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_search('http://127.0.0.1:1', 'not a uid!', 'kettle');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_search('http://127.0.0.1:1', 'searchable', 'kettle', '{}', NULL, NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- Waiting: a task that confirmed nothing yet times out with false.
SELECT meili_sync_wait(:task, timeout => '0');
SELECT meili_sync_wait(NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_wait(424242);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_wait(:task, timeout => '-1 second');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_wait(:task, timeout => '2 days');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- A publisher's position is for a search replica, whose table a subscription fills: this one's
-- is filled by none.
SELECT meili_sync_wait(:task, timeout => '0', publisher_lsn => '0/1');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- The search key is a secret like the api_key: in task_secrets only.
SELECT count(*) AS search_keys FROM meili_sync.task_secrets WHERE search_api_key = 'search-only-k3y';
SELECT count(*) AS keys_in_options FROM meili_sync.tasks WHERE options::text LIKE '%search-only-k3y%';
-- A role that may not read the table may not search its copy, nor any URL, nor wait on it.
SET ROLE regress_reader;
SELECT * FROM meili_search(:task, 'kettle');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_facets(:task, 'kettle', ARRAY['category']);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_search_raw(:task, '{}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_search('http://127.0.0.1:1', 'searchable', 'kettle');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_wait(:task, timeout => '0');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
RESET ROLE;
-- The planner expects a search's limit of rows (20 by default), not 1,000: hits joined back to a
-- table of tens of thousands of rows probe its key's index instead of hashing the whole table.
SELECT p.oid::regprocedure AS search_function, p.prorows FROM pg_proc p
 WHERE p.proname = 'meili_search' ORDER BY 1::text;
CREATE TABLE catalog_items (id bigint PRIMARY KEY, name text);
INSERT INTO catalog_items SELECT i, 'item ' || i FROM generate_series(1, 20000) i;
ANALYZE catalog_items;
EXPLAIN (COSTS OFF) SELECT c.name FROM meili_search(:task, 'kettle') s
  JOIN catalog_items c ON c.id = s.key[1]::bigint;
DROP TABLE catalog_items;
SELECT meili_sync_drop(:task);
SELECT * FROM leftovers;
