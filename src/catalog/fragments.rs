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
         partitions = NULL, snapshot_started_at = NULL, snapshot_finished_at = NULL, shape = NULL, shape_through = NULL,
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

/// The SQL condition that column `a` (of `pg_attribute`) of task `t`'s source is sent: a key
/// column, or one that `columns` names (every one without it) and `exclude_columns` does not.
pub(super) const SENT_COLUMN_SQL: &str = "(a.attname::pg_catalog.text OPERATOR(pg_catalog.=) ANY (t.primary_key)
             OR ((NOT t.options OPERATOR(pg_catalog.?) 'columns'
                  OR a.attname::pg_catalog.text OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT pg_catalog.jsonb_array_elements_text(t.options OPERATOR(pg_catalog.->) 'columns'))))
                 AND NOT a.attname::pg_catalog.text OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT pg_catalog.jsonb_array_elements_text(coalesce(t.options OPERATOR(pg_catalog.->) 'exclude_columns', '[]'::pg_catalog.jsonb))))))";

/// The SQL expression of the highest column number task `t`'s source has used: the columns added
/// since are numbered after it (`tasks.shape_through`).
pub(super) const LAST_COLUMN_SQL: &str = "(SELECT pg_catalog.max(a.attnum) FROM pg_catalog.pg_attribute a
       WHERE a.attrelid OPERATOR(pg_catalog.=) t.source::pg_catalog.oid AND a.attnum OPERATOR(pg_catalog.>) 0)";

/// The SQL expression of the shape of task `t`'s documents as its source gives them now: each
/// column it sends (after `columns` or `exclude_columns`), with its name, its type, the labels of
/// an enum it is of and the attributes of a composite it is of (through a domain or an array);
/// and for a view, the rewrite rules of the view and of every view it reads. The catalog keeps
/// the shape each task's documents were copied in (`tasks.shape`); a DDL that changes what
/// documents look like without changing rows makes the two differ. With `through` (an SQL
/// expression of a column number), only the columns numbered up to it count: the shape of the
/// columns the source had then, which tells a change that only added columns.
pub(super) fn source_shape_sql(through: Option<&str>) -> String {
    let through = through.unwrap_or("32767");
    format!(
        "(SELECT pg_catalog.md5(
        coalesce(pg_catalog.string_agg(pg_catalog.format('%s %s [%s] [%s]', a.attname,
                     pg_catalog.format_type(a.atttypid, a.atttypmod),
                     (SELECT pg_catalog.string_agg(e.enumlabel::pg_catalog.text, ',' ORDER BY e.enumsortorder)
                        FROM pg_catalog.pg_enum e WHERE e.enumtypid OPERATOR(pg_catalog.=) b.base),
                     (SELECT pg_catalog.string_agg(pg_catalog.format('%s %s', c.attname, pg_catalog.format_type(c.atttypid, c.atttypmod)), ',' ORDER BY c.attnum)
                        FROM pg_catalog.pg_type ct
                        JOIN pg_catalog.pg_attribute c ON c.attrelid OPERATOR(pg_catalog.=) ct.typrelid
                       WHERE ct.oid OPERATOR(pg_catalog.=) b.base AND c.attnum OPERATOR(pg_catalog.>) 0 AND NOT c.attisdropped)),
                 ';' ORDER BY a.attnum), '')
        OPERATOR(pg_catalog.||) coalesce((
            WITH RECURSIVE read(relid) AS (
                SELECT t.source::pg_catalog.oid
                UNION
                SELECT d.refobjid
                  FROM read
                  JOIN pg_catalog.pg_rewrite r ON r.ev_class OPERATOR(pg_catalog.=) read.relid
                  JOIN pg_catalog.pg_depend d ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_rewrite'::pg_catalog.regclass
                       AND d.objid OPERATOR(pg_catalog.=) r.oid
                       AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
                       AND d.refobjid OPERATOR(pg_catalog.<>) read.relid)
            -- Where in the statement each node was written is no part of the view's shape.
            SELECT pg_catalog.string_agg(pg_catalog.regexp_replace(r.ev_action::pg_catalog.text,
                       ':(stmt_)?location -?[0-9]+|:stmt_len [0-9]+', '', 'g'), ';' ORDER BY r.ev_class)
              FROM read JOIN pg_catalog.pg_rewrite r ON r.ev_class OPERATOR(pg_catalog.=) read.relid), ''))
       FROM pg_catalog.pg_attribute a
       JOIN pg_catalog.pg_type ty ON ty.oid OPERATOR(pg_catalog.=) a.atttypid
       CROSS JOIN LATERAL (SELECT CASE WHEN ty.typtype OPERATOR(pg_catalog.=) 'd' THEN ty.typbasetype
                                       WHEN ty.typelem OPERATOR(pg_catalog.<>) 0 AND ty.typlen OPERATOR(pg_catalog.=) -1 THEN ty.typelem
                                       ELSE ty.oid END) b(base)
      WHERE a.attrelid OPERATOR(pg_catalog.=) t.source::pg_catalog.oid
        AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped
        AND a.attnum OPERATOR(pg_catalog.<=) {through}
        AND {SENT_COLUMN_SQL})"
    )
}

/// The SQL condition that task `t`'s source, a table, changed shape only by columns added (its
/// stream then sends each row's values of them as partial updates, `worker::columns_added`,
/// rather than the index being rebuilt), unless its option `"schema_changes"` is `"report"`.
pub(super) fn columns_added_sql() -> String {
    format!(
        "(t.shape_through IS NOT NULL
          AND coalesce(t.options OPERATOR(pg_catalog.->>) 'schema_changes', '') OPERATOR(pg_catalog.<>) 'report'
          AND (SELECT c.relkind FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) t.source::pg_catalog.oid)
              OPERATOR(pg_catalog.=) ANY ('{{r,p}}'::pg_catalog.\"char\"[])
          AND t.shape OPERATOR(pg_catalog.<>) {}
          AND t.shape OPERATOR(pg_catalog.=) {})",
        source_shape_sql(None),
        source_shape_sql(Some("t.shape_through"))
    )
}
