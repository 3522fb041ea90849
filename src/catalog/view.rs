//! Views as sources: what a view reads (its base tables, and which table column its key comes
//! from), the foreign keys that point at that column, and the reads a view task makes at render
//! time (mapping queries, the canonical form of keys, the rows of given keys).

use pgrx::prelude::*;
use pgrx::spi::quote_identifier;
use pgrx::PgList;

use pg_meili_sync_core::task::pg_catalog::RelationKind;

use super::fragments::RELATIONS_READ_SQL;
use super::{
    source::{key_arrays, page_text_values},
    CatalogResult,
};
use crate::error::{ErrorKind, SyncError};

/// A table the view reads, directly or through other views.
#[derive(Debug, Clone)]
pub struct BaseTable {
    pub relid: pg_sys::Oid,
    /// The table's own name, unqualified.
    pub name: String,
    pub qualified_name: String,
    pub relkind: RelationKind,
}

/// The tables a view reads, following the views it reads (from the dependencies of their rewrite
/// rules, so tables named only in subqueries and sublinks count too; composite types are not
/// tables and are left out). Materialized views,
/// foreign and partitioned tables are returned as they are, for the caller to refuse.
pub fn base_tables(view: pg_sys::Oid) -> CatalogResult<Vec<BaseTable>> {
    Spi::connect(|client| {
        let rows = client.select(
            &format!(
                "{RELATIONS_READ_SQL}
             SELECT c.oid, pg_catalog.format('%I.%I', n.nspname, c.relname), c.relkind::text, c.relname::text
               FROM read JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) read.relid
               JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
              WHERE c.oid OPERATOR(pg_catalog.<>) $1 AND c.relkind OPERATOR(pg_catalog.<>) 'v'
                -- A field of a composite type (relkind 'c') is a dependency, not a table read.
                AND c.relkind OPERATOR(pg_catalog.<>) 'c'
              ORDER BY 2"
            ),
            None,
            &[view.into()],
        )?;
        let mut tables = Vec::new();
        for row in rows {
            tables.push(BaseTable {
                relid: row.get(1)?.unwrap_or(pg_sys::InvalidOid),
                qualified_name: row.get(2)?.unwrap_or_default(),
                relkind: RelationKind::from_code(&row.get::<String>(3)?.unwrap_or_default()),
                name: row.get(4)?.unwrap_or_default(),
            });
        }
        Ok(tables)
    })
}

/// What the view's query says about following it.
#[derive(Debug, Clone)]
pub struct ViewQuery {
    /// The table and its columns (in key order) that the view's key columns are, when every key
    /// column is a plain column of one table of the view's top-level query.
    pub root: Option<(pg_sys::Oid, Vec<String>)>,
}

fn unsupported(view: &str, what: &str) -> SyncError {
    SyncError::new(
        ErrorKind::UnsupportedType,
        format!("view {view} cannot be synced: {what}"),
    )
    .hint("A view task renders each document by its key alone, so every row of the view must depend only on its own key's rows: remove it from the view, or sync a view without it.")
}

/// Reads the view's query tree: refuses what a task cannot follow (rows or values that depend on
/// other rows of the view: LIMIT, window functions, set-returning functions, DISTINCT ON not by
/// the key), and finds the table column each key column comes from.
pub fn view_query(view: pg_sys::Oid, name: &str, key: &[String]) -> CatalogResult<ViewQuery> {
    // SAFETY: the view is opened with a lock held to the end of the transaction (closing it
    // keeps the lock), get_view_query returns its rule's query tree, which stays valid while the
    // relation is open; we only read the tree and never keep pointers beyond this function.
    unsafe {
        let relation = pg_sys::relation_open(view, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let query = pg_sys::get_view_query(relation);
        let result = read_view_query(query, name, key);
        pg_sys::relation_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
        result
    }
}

/// # Safety
/// `query` is a valid query tree (see `view_query`).
// SAFETY: every dereference below stays inside that query tree, whose node types are checked
// before their fields are read.
unsafe fn read_view_query(
    query: *mut pg_sys::Query,
    name: &str,
    key: &[String],
) -> CatalogResult<ViewQuery> {
    let query = &*query;
    if !query.limitCount.is_null() || !query.limitOffset.is_null() {
        return Err(unsupported(name, "it has LIMIT or OFFSET"));
    }
    if query.hasWindowFuncs {
        return Err(unsupported(name, "it uses window functions"));
    }
    if query.hasTargetSRFs {
        return Err(unsupported(
            name,
            "it has a set-returning function in its select list",
        ));
    }
    let rtable = PgList::<pg_sys::RangeTblEntry>::from_pg(query.rtable);
    for rte in rtable.iter_ptr() {
        if matches!(
            (*rte).rtekind,
            pg_sys::RTEKind::RTE_FUNCTION | pg_sys::RTEKind::RTE_TABLEFUNC
        ) {
            return Err(unsupported(
                name,
                "it reads from a set-returning function in FROM",
            ));
        }
    }
    let targets = PgList::<pg_sys::TargetEntry>::from_pg(query.targetList);
    let mut key_targets = Vec::new();
    for column in key {
        let target = targets.iter_ptr().find(|&target| {
            !(*target).resjunk
                && !(*target).resname.is_null()
                && std::ffi::CStr::from_ptr((*target).resname).to_bytes() == column.as_bytes()
        });
        match target {
            Some(target) => key_targets.push(target),
            None => {
                return Err(SyncError::new(
                    ErrorKind::UndefinedColumn,
                    format!(
                    "column \"{column}\" of option \"primary_key\" does not exist in view {name}"
                ),
                )
                .hint("Name the view's key columns, as its select list names them."))
            }
        }
    }
    if query.hasDistinctOn {
        let distinct = PgList::<pg_sys::SortGroupClause>::from_pg(query.distinctClause);
        let by_key = key_targets.iter().all(|&target| {
            distinct
                .iter_ptr()
                .any(|clause| (*clause).tleSortGroupRef == (*target).ressortgroupref)
        });
        if !by_key {
            return Err(unsupported(name, "it has DISTINCT ON without its key"));
        }
    }
    if !query.setOperations.is_null() {
        // A UNION: no one table is the root; every table needs a mapping.
        return Ok(ViewQuery { root: None });
    }
    let mut root: Option<pg_sys::Oid> = None;
    let mut columns = Vec::new();
    for &target in &key_targets {
        let Some((relid, attnum)) = column_origin(&rtable, (*target).expr.cast()) else {
            return Ok(ViewQuery { root: None });
        };
        if root.is_some_and(|root| root != relid) {
            return Ok(ViewQuery { root: None });
        }
        root = Some(relid);
        let attname = pg_sys::get_attname(relid, attnum, true);
        if attname.is_null() {
            return Ok(ViewQuery { root: None });
        }
        columns.push(
            std::ffi::CStr::from_ptr(attname)
                .to_string_lossy()
                .into_owned(),
        );
    }
    Ok(ViewQuery {
        root: root.map(|relid| (relid, columns)),
    })
}

/// The (table, attribute) a target expression is, when it is a plain column of a table in the
/// query's range table, through join alias columns.
///
/// # Safety
/// `rtable` and `node` belong to a valid query tree.
// SAFETY: every dereference below stays inside that query tree: a node is read as a Var only
// after its tag says so, and range-table entries are read only at indexes the list holds.
unsafe fn column_origin(
    rtable: &PgList<pg_sys::RangeTblEntry>,
    mut node: *mut pg_sys::Node,
) -> Option<(pg_sys::Oid, pg_sys::AttrNumber)> {
    // Join alias columns point at the join's inputs; a few levels are plenty.
    for _ in 0..16 {
        if node.is_null() || (*node).type_ != pg_sys::NodeTag::T_Var {
            return None;
        }
        let var = &*node.cast::<pg_sys::Var>();
        if var.varlevelsup != 0 || var.varattno <= 0 {
            return None;
        }
        let rte = rtable.get_ptr(usize::try_from(var.varno).ok()?.checked_sub(1)?)?;
        match (*rte).rtekind {
            // An ordinary or partitioned table.
            pg_sys::RTEKind::RTE_RELATION if matches!((*rte).relkind as u8, b'r' | b'p') => {
                return Some(((*rte).relid, var.varattno))
            }
            pg_sys::RTEKind::RTE_JOIN => {
                let aliases = PgList::<pg_sys::Node>::from_pg((*rte).joinaliasvars);
                node = aliases.get_ptr(usize::try_from(var.varattno - 1).ok()?)?;
            }
            _ => return None,
        }
    }
    None
}

/// The foreign keys of `child` that reference exactly `root_columns` of `root`: for each, the
/// child's columns in the order of `root_columns`.
pub fn foreign_keys_to(
    child: pg_sys::Oid,
    root: pg_sys::Oid,
    root_columns: &[String],
) -> CatalogResult<Vec<Vec<String>>> {
    Spi::connect(|client| {
        let rows = client.select(
            "SELECT ARRAY(SELECT ca.attname::text FROM pg_catalog.unnest(c.conkey) WITH ORDINALITY k(attnum, ord)
                            JOIN pg_catalog.pg_attribute ca ON ca.attrelid OPERATOR(pg_catalog.=) c.conrelid AND ca.attnum OPERATOR(pg_catalog.=) k.attnum
                           ORDER BY k.ord),
                    ARRAY(SELECT ra.attname::text FROM pg_catalog.unnest(c.confkey) WITH ORDINALITY k(attnum, ord)
                            JOIN pg_catalog.pg_attribute ra ON ra.attrelid OPERATOR(pg_catalog.=) c.confrelid AND ra.attnum OPERATOR(pg_catalog.=) k.attnum
                           ORDER BY k.ord)
               FROM pg_catalog.pg_constraint c
              WHERE c.contype OPERATOR(pg_catalog.=) 'f' AND c.conrelid OPERATOR(pg_catalog.=) $1 AND c.confrelid OPERATOR(pg_catalog.=) $2
              ORDER BY c.conname",
            None,
            &[child.into(), root.into()],
        )?;
        let mut keys = Vec::new();
        for row in rows {
            let child_columns: Vec<String> = row
                .get::<Vec<Option<String>>>(1)?
                .unwrap_or_default()
                .into_iter()
                .flatten()
                .collect();
            let referenced: Vec<String> = row
                .get::<Vec<Option<String>>>(2)?
                .unwrap_or_default()
                .into_iter()
                .flatten()
                .collect();
            if referenced.len() != root_columns.len() {
                continue;
            }
            let ordered: Option<Vec<String>> = root_columns
                .iter()
                .map(|column| {
                    referenced
                        .iter()
                        .position(|name| name == column)
                        .and_then(|position| child_columns.get(position).cloned())
                })
                .collect();
            if let Some(ordered) = ordered {
                keys.push(ordered);
            }
        }
        Ok(keys)
    })
}

/// Runs a mapping query with the changed rows' keys (one `text[]` per key column) and returns the
/// document keys it produced, as text, one value per view key column. Errors if its width is not
/// `width` (then `keys` may be empty: a check that the query runs at all).
pub fn run_mapping(
    table: &str,
    query: &str,
    params: usize,
    keys: &[Vec<String>],
    width: usize,
) -> CatalogResult<Vec<Vec<String>>> {
    Spi::connect(|client| {
        let result = client.select(query, None, &key_arrays(keys, params))?;
        let columns = result.columns()?;
        if columns != width {
            return Err(SyncError::new(
                ErrorKind::InvalidParameter,
                format!("the mapping of table {table} returns {columns} columns, but the view's key has {width}"),
            )
            .hint("A mapping returns the keys of the documents a change affects: one column per key column of the view, in the order of \"primary_key\"."));
        }
        let rows = page_text_values(&result, width);
        Ok(rows
            .into_iter()
            .filter_map(|row| row.into_iter().collect::<Option<Vec<String>>>())
            .collect())
    })
}

/// Keys as the view's key columns print them (each value cast to its column's type and back),
/// without duplicates, so that they compare with the keys of rendered rows.
pub fn canonical_keys(
    key: &[(String, String)],
    keys: &[Vec<String>],
) -> CatalogResult<Vec<Vec<String>>> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let columns: Vec<String> = (1..=key.len()).map(|index| format!("k{index}")).collect();
    let select: Vec<String> = key
        .iter()
        .zip(&columns)
        .map(|((_, type_name), column)| format!("(u.{column})::{type_name}::pg_catalog.text"))
        .collect();
    let arrays: Vec<String> = (1..=key.len())
        .map(|index| format!("${index}::pg_catalog.text[]"))
        .collect();
    let query = format!(
        "SELECT DISTINCT {} FROM pg_catalog.unnest({}) AS u({})",
        select.join(", "),
        arrays.join(", "),
        columns.join(", ")
    );
    Spi::connect(|client| {
        let result = client.select(&query, None, &key_arrays(keys, key.len()))?;
        Ok(page_text_values(&result, key.len())
            .into_iter()
            .filter_map(|row| row.into_iter().collect::<Option<Vec<String>>>())
            .collect())
    })
}

/// The rows of the view with these keys (canonical, see `canonical_keys`): the values of
/// `columns` (which hold the key columns), as text.
pub fn render_rows(
    view: &str,
    columns: &[String],
    key: &[(String, String)],
    keys: &[Vec<String>],
) -> CatalogResult<Vec<Vec<Option<String>>>> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let select: Vec<String> = columns
        .iter()
        .map(|name| format!("v.{}", quote_identifier(name)))
        .collect();
    let condition = if let [(name, type_name)] = key {
        // One column: `= ANY` lets the planner push the condition into the view's query.
        format!(
            "v.{} = ANY ($1::pg_catalog.text[]::{type_name}[])",
            quote_identifier(name)
        )
    } else {
        let names: Vec<String> = key
            .iter()
            .map(|(name, _)| format!("v.{}", quote_identifier(name)))
            .collect();
        let casts: Vec<String> = key
            .iter()
            .enumerate()
            .map(|(index, (_, type_name))| format!("(u.k{})::{type_name}", index + 1))
            .collect();
        let arrays: Vec<String> = (1..=key.len())
            .map(|index| format!("${index}::pg_catalog.text[]"))
            .collect();
        let aliases: Vec<String> = (1..=key.len()).map(|index| format!("k{index}")).collect();
        format!(
            "({}) IN (SELECT {} FROM pg_catalog.unnest({}) AS u({}))",
            names.join(", "),
            casts.join(", "),
            arrays.join(", "),
            aliases.join(", ")
        )
    };
    let query = format!(
        "SELECT {} FROM {view} v WHERE {condition}",
        select.join(", ")
    );
    Spi::connect(|client| {
        let result = client.select(&query, None, &key_arrays(keys, key.len()))?;
        Ok(page_text_values(&result, select.len()))
    })
}

/// Waits until none of these transactions is still in progress, so that a snapshot taken after
/// this sees their changes: a commit record is decoded a moment before the transaction becomes
/// visible. False if `should_stop` said so first.
pub fn wait_for_transactions(xids: &[u32], should_stop: impl Fn() -> bool) -> bool {
    for &xid in xids {
        // SAFETY: TransactionIdIsInProgress reads the shared proc array; any xid is valid input
        // (old ones return false at once).
        while unsafe { pg_sys::TransactionIdIsInProgress(xid.into()) } {
            if should_stop() {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    true
}

/// The relation a name (as written in a query, resolved on the current search path) stands for.
pub fn regclass_of(name: &str) -> CatalogResult<Option<pg_sys::Oid>> {
    super::select_one::<pg_sys::Oid>(
        "SELECT pg_catalog.to_regclass($1)::pg_catalog.oid",
        &[name.into()],
    )
}
