-- Views over the catalog and the workers' shared-memory state. Keys never appear here.
--
-- Operators and functions in a view are bound when it is created: with only pg_catalog on the
-- path, no operator planted in a user schema (an exact-type match such as ||(text, oid) beats
-- pg_catalog's) can be bound into a view that superusers read. SET LOCAL ends with the script.
SET LOCAL search_path = pg_catalog, pg_temp;

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

-- Backends waiting in meili_sync_wait with a place in shared memory (128 places; more wait by
-- polling). A backend's place is freed when its wait ends, also when it is terminated.
CREATE VIEW @extschema@.meili_sync_waits AS
SELECT w.pid, w.task, w.wait_for_lsn::pg_catalog.pg_lsn AS wait_for_lsn
  FROM @extschema@.meili_sync_waiting() w;

REVOKE ALL ON @extschema@.meili_sync_waits FROM PUBLIC;
GRANT SELECT ON @extschema@.meili_sync_waits TO pg_monitor, meili_sync_admin;

-- Dead letters hold document contents: readable by superusers and meili_sync_admin only.
CREATE VIEW @extschema@.meili_sync_dead_letters AS
SELECT d.task_id AS task,
       t.source AS source_table,
       t.index_uid,
       d.document_id,
       d.operation,
       d.document,
       d.error_code,
       d.error_message,
       d.meili_task_uid,
       d.lsn,
       d.first_seen,
       d.last_seen,
       d.attempts
  FROM meili_sync.dead_letters d
  JOIN meili_sync.tasks t ON t.id = d.task_id;

REVOKE ALL ON @extschema@.meili_sync_dead_letters FROM PUBLIC;
GRANT SELECT ON @extschema@.meili_sync_dead_letters TO meili_sync_admin;

-- Cumulative counters per task, like the pg_stat_* views (kept across worker restarts, zeroed by
-- pg_stat_meili_sync_reset(), lost at a server restart).
CREATE VIEW @extschema@.pg_stat_meili_sync AS
SELECT t.id AS task,
       t.source AS source_table,
       t.index_uid,
       coalesce(c.documents, 0) AS documents,
       coalesce(c.deletes, 0) AS deletes,
       coalesce(c.updates, 0) AS updates,
       coalesce(c.truncates, 0) AS truncates,
       coalesce(c.batches, 0) AS batches,
       coalesce(c.bytes_before_gzip, 0) AS bytes_before_gzip,
       coalesce(c.bytes_sent, 0) AS bytes_sent,
       coalesce(c.retries, 0) AS retries,
       coalesce(c.dead_letters, 0) AS dead_letters,
       c.last_confirmed_at,
       c.stats_reset
  FROM meili_sync.tasks t
  LEFT JOIN @extschema@.meili_sync_stats() c ON c.task = t.id;

REVOKE ALL ON @extschema@.pg_stat_meili_sync FROM PUBLIC;
GRANT SELECT ON @extschema@.pg_stat_meili_sync TO pg_monitor, meili_sync_admin;

-- Read-your-writes: true once Meilisearch confirmed, for the task, every change committed up to
-- lsn (by default: everything this session committed), false after timeout. With replicas: on
-- each of them ('all'), or on one ('any'; the session's searches then ask only those that have it).
-- On a search replica, publisher_lsn is a position in the publisher's WAL (its
-- pg_current_wal_lsn() after a commit there): true once that commit is searchable.
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

-- Every backend keeps the tasks it searched through (catalog::search_targets); these triggers
-- invalidate those copies, at commit, when a task's table, index, URL, key columns, keys or
-- replicas (rows inserted) change.
-- ENABLE ALWAYS: they fire under session_replication_role = replica too (a restore, a replica).
CREATE TRIGGER search_targets AFTER INSERT OR UPDATE OF source, index_uid, url, primary_key, shard_names OR DELETE OR TRUNCATE
    ON meili_sync.tasks FOR EACH STATEMENT
    EXECUTE FUNCTION @extschema@.meili_sync_invalidate_search_targets();
CREATE TRIGGER search_targets AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
    ON meili_sync.task_secrets FOR EACH STATEMENT
    EXECUTE FUNCTION @extschema@.meili_sync_invalidate_search_targets();
ALTER TABLE meili_sync.tasks ENABLE ALWAYS TRIGGER search_targets;
ALTER TABLE meili_sync.task_secrets ENABLE ALWAYS TRIGGER search_targets;

-- Every function of the extension runs with a fixed search_path, so that no schema a user can
-- write shadows an operator or function its SQL names, and none is executable by PUBLIC: the
-- management functions are for meili_sync_admin (they check the caller again), the live state
-- behind the views for the roles that read those views. The search functions and the wait are
-- granted to PUBLIC after this (they check SELECT on the task's table inside).
DO $$
DECLARE
    function_oid pg_catalog.regprocedure;
BEGIN
    FOR function_oid IN
        SELECT p.oid::pg_catalog.regprocedure
          FROM pg_catalog.pg_extension e
          JOIN pg_catalog.pg_depend d
            ON d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass AND d.refobjid = e.oid
          JOIN pg_catalog.pg_proc p
            ON d.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass AND p.oid = d.objid
         WHERE e.extname = 'pg_meili_sync' AND p.pronamespace = e.extnamespace
    LOOP
        EXECUTE pg_catalog.format('ALTER FUNCTION %s SET search_path = pg_catalog, pg_temp', function_oid);
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', function_oid);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO meili_sync_admin', function_oid);
    END LOOP;
END
$$;
GRANT EXECUTE ON FUNCTION @extschema@.meili_sync_worker_state(), @extschema@.meili_sync_stats(),
                          @extschema@.meili_sync_waiting(), @extschema@.meili_sync_readable_error(pg_catalog.oid, text) TO pg_monitor;
-- Searching through a task is for every role that may read the task's table (checked inside);
-- searching any index at any URL stays with meili_sync_admin (a backend must not become a way to
-- reach arbitrary hosts).
-- A search returns at most its limit, which is 20 unless the options say otherwise: the planner's
-- estimate (1,000 for a set-returning function without one), so that hits joined back to a table
-- probe its key's index instead of hashing the whole table.
ALTER FUNCTION @extschema@.meili_search(bigint, text, jsonb) ROWS 20;
ALTER FUNCTION @extschema@.meili_search(text, text, text, jsonb, text, text) ROWS 20;
GRANT EXECUTE ON FUNCTION @extschema@.meili_search(bigint, text, jsonb),
                          @extschema@.meili_facets(bigint, text, text[], jsonb),
                          @extschema@.meili_search_raw(bigint, jsonb),
                          @extschema@.meili_sync_wait(bigint, pg_catalog.pg_lsn, interval, text, pg_catalog.pg_lsn),
                          @extschema@.meili_sync_wait_at(bigint, bigint, double precision, text, bigint) TO PUBLIC;
