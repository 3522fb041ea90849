//! SQL fragments that more than one module of the catalog writes into its queries. They name
//! only PostgreSQL's catalog and ours, so this module imports nothing: the others depend on it.

/// The SQL expression of the catalog's owner (the owner of `meili_sync.tasks`): the role our
/// replication objects belong to. By name in the system catalogs, not by a regclass cast: that
/// would need USAGE on the schema, which roles that may only search do not have.
pub(super) const CATALOG_OWNER_SQL: &str =
    "(SELECT c.relowner FROM pg_catalog.pg_class c
        JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
       WHERE n.nspname OPERATOR(pg_catalog.=) 'meili_sync' AND c.relname OPERATOR(pg_catalog.=) 'tasks')";

/// The SQL condition that a row `t` of `meili_sync.tasks` belongs to the shared pass, never NULL
/// (a NULL inside the launcher's NOT would stop every other task). Shared is the default: only
/// `"decoding": "own"` keeps a slot of the task's own. Resync helpers always have one.
pub(super) const SHARED_TASK_SQL: &str =
    "COALESCE(t.options OPERATOR(pg_catalog.->>) 'decoding', 'shared') OPERATOR(pg_catalog.=) 'shared' AND t.resync_of IS NULL";

/// The SQL condition that task `t` still has a slot of its own. A shared task with one is moving
/// into the shared pass: it streams from its own slot until it hands over (see
/// `worker::handover`), and the slot is dropped in the hand-over's transaction.
pub(super) const OWN_SLOT_SQL: &str =
    "EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots o
              WHERE o.slot_name OPERATOR(pg_catalog.=) pg_catalog.format('meili_sync_%s_%s', 'meili_sync.tasks'::pg_catalog.regclass::pg_catalog.oid, t.id))";

/// The SQL expression of the shared slot's and publication's name.
pub(super) const SHARED_NAME_SQL: &str =
    "pg_catalog.format('meili_sync_%s_shared', 'meili_sync.tasks'::pg_catalog.regclass::pg_catalog.oid)";

/// The SET clause that makes task `t` copy its table again from the start, with the last error
/// in parameter `message` (`$2`, say).
pub(super) fn copy_again_sql(message: &str) -> String {
    format!(
        "state = CASE WHEN t.state OPERATOR(pg_catalog.=) ANY ('{{snapshot,streaming}}'::pg_catalog.text[]) THEN 'snapshot' ELSE t.state END,
         generation = t.generation OPERATOR(pg_catalog.+) 1, snapshot_key = NULL, rows_copied = 0, stream_position = NULL,
         partitions = NULL, snapshot_started_at = NULL, snapshot_finished_at = NULL,
         last_error = {message}, last_error_at = pg_catalog.now()"
    )
}

/// `read(relid)`: the view `$1` and every relation its rewrite rule depends on, following the
/// views among them.
pub(super) const RELATIONS_READ_SQL: &str = "WITH RECURSIVE read(relid) AS (
                 SELECT $1::pg_catalog.oid
                 UNION
                 SELECT d.refobjid
                   FROM read
                   JOIN pg_catalog.pg_class v ON v.oid OPERATOR(pg_catalog.=) read.relid AND v.relkind OPERATOR(pg_catalog.=) 'v'
                   JOIN pg_catalog.pg_rewrite r ON r.ev_class OPERATOR(pg_catalog.=) v.oid
                   JOIN pg_catalog.pg_depend d ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_rewrite'::pg_catalog.regclass
                        AND d.objid OPERATOR(pg_catalog.=) r.oid
                        AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
                        AND d.refobjid OPERATOR(pg_catalog.<>) v.oid)";

/// `UPDATE meili_sync.tasks <alias> SET <set> WHERE <condition> <returning>`, taking the rows'
/// locks in the order of their ids first. Every statement and transaction that writes several
/// rows of the catalog locks them in that order (see `lock_task_rows`), so that two of them never
/// wait for each other: in the order of the heap, a decoder assigning positions and a drop of a
/// sharded task deadlocked.
pub(super) fn update_in_id_order_sql(
    alias: &str,
    set: &str,
    condition: &str,
    returning: &str,
) -> String {
    format!(
        "UPDATE meili_sync.tasks {alias} SET {set}
           FROM (SELECT {alias}.id AS locked_id FROM meili_sync.tasks {alias} WHERE {condition}
                  ORDER BY {alias}.id FOR UPDATE OF {alias}) AS in_id_order
          WHERE {alias}.id OPERATOR(pg_catalog.=) in_id_order.locked_id {returning}"
    )
}
