-- pg_meili_sync 0.6.0 -> 0.7.0, run by ALTER EXTENSION pg_meili_sync UPDATE. A fresh 0.7.0 install
-- and an updated 0.1.0 to 0.6.0 one have the same objects (tests/pg_regress/sql/upgrade.sql checks
-- it).
\echo Use "ALTER EXTENSION pg_meili_sync UPDATE" to load this file. \quit

-- Nothing in this script may bind an operator or function a user planted (a lookalike with an
-- exact type match in the extension's schema beats pg_catalog's): only pg_catalog is on the path.
-- SET LOCAL ends with the script.
SET LOCAL search_path = pg_catalog, pg_temp;

-- meili_sync_wait takes a publisher's WAL position (publisher_lsn), for a search replica: the
-- function and its engine get a fifth argument (sql/views.sql says how it waits).
DROP FUNCTION @extschema@.meili_sync_wait(bigint, pg_catalog.pg_lsn, interval, text);
DROP FUNCTION @extschema@.meili_sync_wait_at(bigint, bigint, double precision, text);
CREATE FUNCTION @extschema@.meili_sync_wait_at(
	"task" bigint,
	"lsn" bigint,
	"timeout_ms" double precision,
	"replicas" TEXT,
	"publisher_lsn" bigint
) RETURNS bool
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'meili_sync_wait_at_wrapper';
CREATE FUNCTION @extschema@.meili_sync_wait(task bigint,
                                           lsn pg_catalog.pg_lsn DEFAULT pg_catalog.pg_current_wal_lsn(),
                                           timeout interval DEFAULT '30 seconds',
                                           replicas text DEFAULT 'all',
                                           publisher_lsn pg_catalog.pg_lsn DEFAULT NULL)
RETURNS boolean LANGUAGE sql VOLATILE
AS $$
    SELECT @extschema@.meili_sync_wait_at($1, pg_catalog.pg_wal_lsn_diff($2, '0/0')::bigint,
                                          pg_catalog.date_part('epoch', $3) OPERATOR(pg_catalog.*) 1000, $4,
                                          pg_catalog.pg_wal_lsn_diff($5, '0/0')::bigint)
$$;
-- As every function of the extension (sql/views.sql): a fixed search_path; these two are for every
-- role (they check SELECT on the task's table inside).
ALTER FUNCTION @extschema@.meili_sync_wait_at(bigint, bigint, double precision, text, bigint) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION @extschema@.meili_sync_wait(bigint, pg_catalog.pg_lsn, interval, text, pg_catalog.pg_lsn) SET search_path = pg_catalog, pg_temp;
REVOKE ALL ON FUNCTION @extschema@.meili_sync_wait_at(bigint, bigint, double precision, text, bigint),
                       @extschema@.meili_sync_wait(bigint, pg_catalog.pg_lsn, interval, text, pg_catalog.pg_lsn) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.meili_sync_wait_at(bigint, bigint, double precision, text, bigint),
                          @extschema@.meili_sync_wait(bigint, pg_catalog.pg_lsn, interval, text, pg_catalog.pg_lsn) TO meili_sync_admin;
GRANT EXECUTE ON FUNCTION @extschema@.meili_sync_wait_at(bigint, bigint, double precision, text, bigint),
                          @extschema@.meili_sync_wait(bigint, pg_catalog.pg_lsn, interval, text, pg_catalog.pg_lsn) TO PUBLIC;
