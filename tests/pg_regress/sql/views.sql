-- Views as sources: what meili_sync_start and meili_sync_preview refuse, each with its SQLSTATE,
-- and that a refusal leaves nothing behind.
\set SHOW_CONTEXT never
CREATE TABLE v_brands (id int PRIMARY KEY, name text);
CREATE TABLE v_items (id int PRIMARY KEY, name text, brand_id int REFERENCES v_brands, hidden bool NOT NULL DEFAULT false);
CREATE TABLE v_notes (id int PRIMARY KEY, item_id int NOT NULL REFERENCES v_items, body text);
CREATE VIEW v_docs AS
SELECT i.id, i.name, b.name AS brand, (SELECT count(*) FROM v_notes n WHERE n.item_id = i.id) AS notes
  FROM v_items i LEFT JOIN v_brands b ON b.id = i.brand_id
 WHERE NOT i.hidden;
INSERT INTO v_brands VALUES (1, 'Acme'), (2, 'Globex');
INSERT INTO v_items VALUES (1, 'anvil', 1, false), (2, 'rocket', 1, true), (3, 'lamp', 2, false);
INSERT INTO v_notes VALUES (1, 1, 'heavy'), (2, 1, 'sturdy'), (3, 3, 'bright');

-- A view names its key.
SELECT meili_sync_start('v_docs', 'x', '{"url": "http://127.0.0.1:1"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('v_docs', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "sku"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- v_brands is neither the root (v_items) nor points at it: it needs a mapping.
SELECT meili_sync_start('v_docs', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "id"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- Mappings: only of tables the view reads, schema-qualified inside, one column per key column.
SELECT meili_sync_start('v_docs', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "id", "mappings": {"products": "SELECT 1"}}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('v_docs', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "id", "mappings": {"v_brands": "SELECT i.id, i.name FROM public.v_items i WHERE i.brand_id = ANY($1::int[])"}}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('v_docs', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "id", "mappings": {"v_brands": "SELECT i.id FROM v_items i WHERE i.brand_id = ANY($1::int[])"}}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('v_docs', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "id", "mappings": {"v_brands": "SELECT FROM"}}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- v_notes points at v_items, but its default replica identity does not carry item_id.
SELECT meili_sync_start('v_docs', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "id", "mappings": {"v_brands": "SELECT i.id FROM public.v_items i WHERE i.brand_id = ANY($1::int[])"}}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- Mappings are for views; views are not in the shared decoding pass.
SELECT meili_sync_start('v_items', 'x', '{"url": "http://127.0.0.1:1", "mappings": {"v_brands": "SELECT 1"}}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
ALTER TABLE v_notes REPLICA IDENTITY FULL;
-- Views whose rows depend on other rows, or that multiply rows.
CREATE VIEW v_limited AS SELECT i.id, i.name FROM v_items i ORDER BY i.id LIMIT 2;
CREATE VIEW v_ranked AS SELECT i.id, rank() OVER (ORDER BY i.name) AS rank FROM v_items i;
CREATE VIEW v_series AS SELECT i.id, pg_catalog.generate_series(1, 2) AS n FROM v_items i;
CREATE VIEW v_distinct AS SELECT DISTINCT ON (i.brand_id) i.id, i.brand_id FROM v_items i;
CREATE MATERIALIZED VIEW v_frozen AS SELECT * FROM v_items;
CREATE VIEW v_of_frozen AS SELECT f.id, f.name FROM v_frozen f;
SELECT meili_sync_start('v_limited', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "id"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('v_ranked', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "id"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('v_series', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "id"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('v_distinct', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "id"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_start('v_of_frozen', 'x', '{"url": "http://127.0.0.1:1", "primary_key": "id"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM leftovers;

-- Preview: the documents as they would be sent, in key order; it creates nothing.
SELECT * FROM meili_sync_preview('v_docs', '{"primary_key": "id", "mappings": {"v_brands": "SELECT i.id FROM public.v_items i WHERE i.brand_id = ANY($1::int[])"}}');
SELECT * FROM meili_sync_preview('v_items', '{"exclude_columns": ["hidden"]}', 2);
SELECT * FROM meili_sync_preview('v_docs', '{}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_sync_preview(NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_sync_preview('v_items', '{}', -1);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM meili_sync_preview('v_items', '{"batch_size": 0}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM leftovers;
DROP MATERIALIZED VIEW v_frozen CASCADE;
DROP VIEW v_docs, v_limited, v_ranked, v_series, v_distinct;
DROP TABLE v_notes, v_items, v_brands;
