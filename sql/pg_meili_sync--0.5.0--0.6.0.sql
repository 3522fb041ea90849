-- pg_meili_sync 0.5.0 -> 0.6.0, run by ALTER EXTENSION pg_meili_sync UPDATE. A fresh 0.6.0 install
-- and an updated 0.1.0 to 0.5.0 one have the same objects (tests/pg_regress/sql/upgrade.sql checks
-- it).
\echo Use "ALTER EXTENSION pg_meili_sync UPDATE" to load this file. \quit

-- Nothing in this script may bind an operator or function a user planted (a lookalike with an
-- exact type match in the extension's schema beats pg_catalog's): only pg_catalog is on the path.
-- SET LOCAL ends with the script.
SET LOCAL search_path = pg_catalog, pg_temp;

-- The shape each task's documents were copied in (sql/bootstrap.sql says why). Those of 0.5.0
-- are recorded as their sources are when the launcher first looks.
ALTER TABLE meili_sync.tasks ADD COLUMN shape text, ADD COLUMN shape_through smallint;

-- The publications this install made (sql/bootstrap.sql says why). Those of 0.5.0 are recorded as
-- the workers next find them, if they are as 0.6.0 makes them.
CREATE TABLE meili_sync.publications (
    name text PRIMARY KEY,
    publication oid NOT NULL
);
REVOKE ALL ON meili_sync.publications FROM PUBLIC;
GRANT SELECT ON meili_sync.publications TO meili_sync_admin;

-- The one rule of who may read a task's error (sql/views.sql says why).
CREATE FUNCTION @extschema@.meili_sync_readable_error(source pg_catalog.oid, error text) RETURNS text
STABLE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'meili_sync_readable_error_wrapper';
-- As every function of the extension (sql/views.sql): a fixed search_path, no PUBLIC grant.
ALTER FUNCTION @extschema@.meili_sync_readable_error(pg_catalog.oid, text) SET search_path = pg_catalog, pg_temp;
REVOKE ALL ON FUNCTION @extschema@.meili_sync_readable_error(pg_catalog.oid, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.meili_sync_readable_error(pg_catalog.oid, text) TO meili_sync_admin, pg_monitor;

-- The workers' state tells when each task last progressed (meili_sync_status's progressing).
DROP VIEW @extschema@.meili_sync_status;
DROP FUNCTION @extschema@.meili_sync_worker_state();
CREATE FUNCTION @extschema@.meili_sync_worker_state() RETURNS TABLE (
	"task" bigint,
	"pid" INT,
	"phase" TEXT,
	"rows_copied" bigint,
	"documents_confirmed" bigint,
	"documents_deleted" bigint,
	"batches_in_flight" INT,
	"retries" bigint,
	"bytes_before_gzip" bigint,
	"bytes_sent" bigint,
	"documents_sent" bigint,
	"failed_tasks" bigint,
	"documents_per_second" double precision,
	"received_lsn" TEXT,
	"confirmed_lsn" TEXT,
	"oldest_unconfirmed_commit" timestamp with time zone,
	"last_sent_at" timestamp with time zone,
	"last_confirmed_at" timestamp with time zone,
	"last_error" TEXT,
	"last_error_at" timestamp with time zone,
	"progressed_at" timestamp with time zone
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'meili_sync_worker_state_wrapper';
ALTER FUNCTION @extschema@.meili_sync_worker_state() SET search_path = pg_catalog, pg_temp;
REVOKE ALL ON FUNCTION @extschema@.meili_sync_worker_state() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.meili_sync_worker_state() TO meili_sync_admin, pg_monitor;

-- meili_sync_status shows last_error through that rule, and whether each task progresses.
CREATE VIEW @extschema@.meili_sync_status AS
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
       -- An error may quote row values (a refused document's id): it is shown as the one rule of
       -- meili_sync_readable_error allows (the workers' errors are already, by meili_sync_worker_state).
       @extschema@.meili_sync_readable_error(t.source::pg_catalog.oid,
           CASE WHEN t.state = 'error' OR w.last_error IS NULL THEN t.last_error ELSE w.last_error END) AS last_error,
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
       END AS decoding,
       -- On a replica (option replicas): the task it is a replica of. The task's own row is its
       -- first replica; each other server has a row of its own, with its own position and state.
       t.replica_of,
       -- On a shard (option shards): its name. Each shard's row holds the documents whose id
       -- hashes to it; the task's own row is its first shard.
       t.shard,
       -- When the task's position last moved, or it last had everything it had read confirmed.
       w.progressed_at AS last_progress_at,
       -- Streaming (or retrying), and its position moved within meili_sync.stuck_after or it had
       -- nothing left to read: false is a task that is stuck, not one that is slow but moving.
       -- NULL while it does not stream.
       CASE WHEN t.state NOT IN ('paused', 'stopped', 'error', 'swapping') AND w.pid IS NOT NULL
                 AND w.phase IN ('streaming', 'retrying')
            THEN coalesce(w.progressed_at > pg_catalog.clock_timestamp()
                              - coalesce(pg_catalog.current_setting('meili_sync.stuck_after', true), '2min')::interval,
                          false)
       END AS progressing
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
REVOKE ALL ON @extschema@.meili_sync_status FROM PUBLIC;
GRANT SELECT ON @extschema@.meili_sync_status TO pg_monitor, meili_sync_admin;
