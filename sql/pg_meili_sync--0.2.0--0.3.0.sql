-- pg_meili_sync 0.2.0 -> 0.3.0, run by ALTER EXTENSION pg_meili_sync UPDATE. A fresh 0.3.0 install
-- and an updated 0.1.0 or 0.2.0 one have the same objects (tests/pg_regress/sql/upgrade.sql checks
-- it).
\echo Use "ALTER EXTENSION pg_meili_sync UPDATE" to load this file. \quit

-- Nothing in this script may bind an operator or function a user planted (a lookalike with an
-- exact type match in the extension's schema beats pg_catalog's): only pg_catalog is on the path.
-- SET LOCAL ends with the script.
SET LOCAL search_path = pg_catalog, pg_temp;

-- A partitioned table's leaf partitions that the task's index is in line with (sql/bootstrap.sql
-- says why). NULL for the tasks of 0.2.0: their workers take the partitions as they find them.
ALTER TABLE meili_sync.tasks ADD COLUMN partitions oid[];

-- The database the install was made in (sql/bootstrap.sql says why): this one, as 0.2.0 ran only
-- in the database meili_sync.database named.
ALTER TABLE meili_sync.install ADD COLUMN database oid;
UPDATE meili_sync.install SET database = (SELECT d.oid FROM pg_catalog.pg_database d
                                           WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database());
ALTER TABLE meili_sync.install ALTER COLUMN database SET NOT NULL;
