-- pg_meili_sync 0.1.0 -> 0.2.0, run by ALTER EXTENSION pg_meili_sync UPDATE. A fresh 0.2.0 install
-- and an updated 0.1.0 one have the same objects (tests/pg_regress/sql/upgrade.sql checks it).
\echo Use "ALTER EXTENSION pg_meili_sync UPDATE" to load this file. \quit

-- Nothing in this script may bind an operator or function a user planted (a lookalike with an
-- exact type match in the extension's schema beats pg_catalog's): only pg_catalog is on the path.
-- SET LOCAL ends with the script.
SET LOCAL search_path = pg_catalog, pg_temp;

-- Logical decoding hands us values in the server encoding, and Meilisearch takes UTF-8 only: one
-- non-ASCII value of another encoding would stop the stream of every task. Refused up front.
DO $$
BEGIN
    IF pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.<>) 'UTF8' THEN
        RAISE EXCEPTION 'pg_meili_sync needs a UTF8 database; database "%" has encoding %',
                pg_catalog.current_database(), pg_catalog.getdatabaseencoding()
            USING ERRCODE = 'feature_not_supported',
                  HINT = 'Create the extension in a database made with ENCODING ''UTF8'' (CREATE DATABASE ... TEMPLATE template0 ENCODING ''UTF8''), and sync from there.';
    END IF;
END
$$;

-- This install of the extension, and the install each task was made in (sql/bootstrap.sql says
-- why). The tasks there are this install's own.
ALTER TABLE meili_sync.tasks ADD COLUMN install_token uuid;
CREATE TABLE meili_sync.install (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    token uuid NOT NULL DEFAULT pg_catalog.gen_random_uuid()
);
INSERT INTO meili_sync.install DEFAULT VALUES;
UPDATE meili_sync.tasks SET install_token = (SELECT i.token FROM meili_sync.install i);
REVOKE ALL ON meili_sync.install FROM PUBLIC;
GRANT SELECT ON meili_sync.install TO meili_sync_admin;
-- pg_dump reads the id sequences too (they are in a dump): an admin may dump the catalog.
GRANT SELECT ON SEQUENCE meili_sync.tasks_id_seq, meili_sync.dead_letters_id_seq TO meili_sync_admin;
SELECT pg_catalog.pg_extension_config_dump('meili_sync.tasks_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('meili_sync.dead_letters_id_seq', '');

CREATE FUNCTION @extschema@.meili_sync_waiting() RETURNS TABLE (
    "pid" INT,
    "task" bigint,
    "wait_for_lsn" TEXT
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'meili_sync_waiting_wrapper';
-- As every function of the extension (sql/views.sql): a fixed search_path, and no PUBLIC grant.
ALTER FUNCTION @extschema@.meili_sync_waiting() SET search_path = pg_catalog, pg_temp;
REVOKE ALL ON FUNCTION @extschema@.meili_sync_waiting() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.meili_sync_waiting() TO meili_sync_admin;

-- The status view: admins see a dropped table's task's error.
CREATE OR REPLACE VIEW @extschema@.meili_sync_status AS
SELECT t.id AS task,
       t.source AS source_table,
       t.index_uid,
       t.url,
       CASE
           WHEN t.state IN ('paused', 'stopped', 'error', 'swapping') THEN t.state
           WHEN w.pid IS NOT NULL THEN w.phase
           WHEN w.phase = 'error' THEN 'restarting'
           ELSE 'starting'
       END AS state,
       w.pid AS worker_pid,
       greatest(t.rows_copied, coalesce(w.rows_copied, 0)) AS rows_copied,
       -- The planner's row count, for the copy's progress; NULL once the copy is done.
       CASE WHEN t.snapshot_finished_at IS NULL THEN greatest(c.reltuples, 0)::bigint END AS rows_estimate,
       CASE WHEN t.snapshot_finished_at IS NULL AND c.reltuples > 0
            THEN least(100, round(100.0 * greatest(t.rows_copied, coalesce(w.rows_copied, 0)) / c.reltuples::numeric, 1))
       END AS snapshot_percent,
       coalesce(w.documents_sent, 0) AS documents_sent,
       coalesce(w.documents_confirmed, 0) AS documents_confirmed,
       coalesce(w.documents_deleted, 0) AS documents_deleted,
       round(coalesce(w.documents_per_second, 0)::numeric, 1) AS documents_per_second,
       coalesce(w.batches_in_flight, 0) AS batches_in_flight,
       coalesce(w.failed_tasks, 0) AS failed_tasks,
       coalesce(w.retries, 0) AS retries,
       coalesce(w.bytes_before_gzip, 0) AS bytes_before_gzip,
       coalesce(w.bytes_sent, 0) AS bytes_sent,
       w.received_lsn::pg_lsn AS received_lsn,
       -- A task of the shared decoding pass has a position of its own in the shared slot: the
       -- decoder's while it streams the task, the stored one otherwise. A moving task's is still
       -- its own slot's.
       coalesce(CASE WHEN w.pid IS NOT NULL AND t.stream_position IS NOT NULL THEN w.confirmed_lsn::pg_lsn END,
                CASE WHEN o.slot_name IS NULL THEN t.stream_position END, s.confirmed_flush_lsn) AS confirmed_lsn,
       pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(),
                coalesce(CASE WHEN w.pid IS NOT NULL AND t.stream_position IS NOT NULL THEN w.confirmed_lsn::pg_lsn END,
                         CASE WHEN o.slot_name IS NULL THEN t.stream_position END, s.confirmed_flush_lsn))::bigint AS lag_bytes,
       -- Age of the oldest commit Meilisearch has not confirmed; known while a worker streams.
       CASE WHEN w.pid IS NOT NULL AND w.phase IN ('streaming', 'retrying') AND t.snapshot_finished_at IS NOT NULL
            THEN round(coalesce(extract(epoch FROM pg_catalog.clock_timestamp() - w.oldest_unconfirmed_commit), 0), 3)
       END AS lag_seconds,
       pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), s.restart_lsn)::bigint AS retained_wal_bytes,
       s.wal_status,
       coalesce(pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), s.restart_lsn)
                > nullif(pg_catalog.pg_size_bytes(pg_catalog.current_setting('meili_sync.max_retained_wal', true)), 0),
                false) AS wal_warning,
       coalesce(pg_catalog.clock_timestamp() - w.oldest_unconfirmed_commit
                > nullif(pg_catalog.current_setting('meili_sync.lag_warning', true), '0')::interval,
                false) AS lag_warning,
       w.last_sent_at,
       w.last_confirmed_at,
       -- A stopped task's catalog error (e.g. the crash-loop verdict) outranks the last worker's.
       -- An error may quote row values (a refused document's id): only roles that may read the
       -- table see it.
       CASE WHEN (CASE WHEN t.state = 'error' OR w.last_error IS NULL THEN t.last_error ELSE w.last_error END) IS NULL
                 THEN NULL
            -- Once the table is dropped (has_table_privilege is then NULL), admins see why.
            WHEN coalesce(pg_catalog.has_table_privilege(t.source, 'SELECT'),
                          pg_catalog.pg_has_role('meili_sync_admin', 'MEMBER'))
                 THEN CASE WHEN t.state = 'error' OR w.last_error IS NULL THEN t.last_error ELSE w.last_error END
            ELSE 'hidden: reading this task''s errors needs SELECT on ' || t.source::text
       END AS last_error,
       CASE WHEN t.state = 'error' OR w.last_error IS NULL THEN t.last_error_at ELSE w.last_error_at END AS last_error_at,
       t.primary_key,
       t.snapshot_started_at,
       t.snapshot_finished_at,
       t.created_at,
       -- On a resync helper: the task whose index it rebuilds.
       t.resync_of,
       -- 'shared': the database's one decoding pass (slot and WAL shown are the shared slot's,
       -- held back by the slowest shared task); 'own': a slot of the task's own; 'moving': shared,
       -- but still streaming from its own slot until it hands over (slot and WAL are its own).
       CASE WHEN coalesce(t.options ->> 'decoding', 'shared') <> 'shared' OR t.resync_of IS NOT NULL THEN 'own'
            WHEN o.slot_name IS NOT NULL THEN 'moving'
            ELSE 'shared'
       END AS decoding
  FROM meili_sync.tasks t
  LEFT JOIN pg_catalog.pg_class c ON c.oid = t.source
  LEFT JOIN @extschema@.meili_sync_worker_state() w ON w.task = t.id
  LEFT JOIN pg_catalog.pg_replication_slots o
         ON o.slot_name = pg_catalog.format('meili_sync_%s_%s', 'meili_sync.tasks'::pg_catalog.regclass::pg_catalog.oid, t.id)
  LEFT JOIN pg_catalog.pg_replication_slots s
         ON s.slot_name = CASE WHEN o.slot_name IS NULL AND coalesce(t.options ->> 'decoding', 'shared') = 'shared' AND t.resync_of IS NULL
                               THEN pg_catalog.format('meili_sync_%s_shared', 'meili_sync.tasks'::pg_catalog.regclass::pg_catalog.oid)
                               ELSE pg_catalog.format('meili_sync_%s_%s', 'meili_sync.tasks'::pg_catalog.regclass::pg_catalog.oid, t.id)
                          END;

-- Backends waiting in meili_sync_wait with a place in shared memory (128 places; more wait by
-- polling). A backend's place is freed when its wait ends, also when it is terminated.
CREATE VIEW @extschema@.meili_sync_waits AS
SELECT w.pid, w.task, w.wait_for_lsn::pg_catalog.pg_lsn AS wait_for_lsn
  FROM @extschema@.meili_sync_waiting() w;

REVOKE ALL ON @extschema@.meili_sync_waits FROM PUBLIC;
GRANT SELECT ON @extschema@.meili_sync_waits TO pg_monitor, meili_sync_admin;

GRANT EXECUTE ON FUNCTION @extschema@.meili_sync_waiting() TO pg_monitor;

-- A search's row estimate is its default limit (sql/views.sql says why).
ALTER FUNCTION @extschema@.meili_search(bigint, text, jsonb) ROWS 20;
ALTER FUNCTION @extschema@.meili_search(text, text, text, jsonb, text, text) ROWS 20;
