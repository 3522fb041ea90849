//! The source tables: what a table is (columns, key, owner), whether a task may sync it, how its
//! types become JSON, and reading it: keyset pages, keys that are gone, rows locked for repair.
//!
//! A column's type becomes a `ValueKind` in one place, `value_kind`: domains resolve to their base
//! type, arrays to their element's kind, enums to `Text`, and `builtin_kind` maps the built-in
//! OIDs; a type it does not know is sent as its text output, a JSON string (`ValueKind::Other`).

use std::ffi::CStr;

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::submodules::ffi::pg_guard_ffi_boundary;
use pgrx::prelude::*;
use pgrx::spi::quote_identifier;

use pg_meili_sync_core::document::encode::ValueKind;
use pg_meili_sync_core::task::pg_catalog::{RelationKind, ReplicaIdentity};

use super::{may_select, names_from, role_name, select_one, CatalogResult};
use crate::error::{ErrorKind, SyncError};

/// A column of the source table as the catalog describes it.
#[derive(Debug, Clone)]
pub struct ColumnInfo {
    pub name: String,
    pub type_oid: pg_sys::Oid,
    pub type_name: String,
    pub not_null: bool,
    pub generated: bool,
}

#[derive(Debug, Clone)]
pub struct RelationInfo {
    pub qualified_name: String,
    /// The table's owner: work on its rows runs with this role's rights.
    pub owner: pg_sys::Oid,
    pub relkind: RelationKind,
    pub persistence: String,
    pub replica_identity: ReplicaIdentity,
    pub columns: Vec<ColumnInfo>,
    pub primary_key: Option<Vec<String>>,
    pub replica_identity_index: Option<Vec<String>>,
    pub unique_keys: Vec<Vec<String>>,
    /// A partitioned table's leaf partitions at any depth (filled by `syncable_source`): their
    /// changes are in the WAL under their own OIDs, each with its own replica identity.
    pub partitions: Vec<RelationInfo>,
}

pub fn relation_info(relid: pg_sys::Oid) -> CatalogResult<RelationInfo> {
    Spi::connect(|client| {
        let mut header = client.select(
            "SELECT c.relkind::text, c.relpersistence::text, c.relreplident::text,
                    pg_catalog.format('%I.%I', n.nspname, c.relname), c.relowner
               FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
              WHERE c.oid OPERATOR(pg_catalog.=) $1",
            Some(1),
            &[relid.into()],
        )?;
        let Some(row) = header.next() else {
            return Err(SyncError::new(
                ErrorKind::UndefinedTable,
                format!("relation with OID {relid} does not exist"),
            ));
        };
        let relkind = RelationKind::from_code(&row.get::<String>(1)?.unwrap_or_default());
        let persistence: String = row.get(2)?.unwrap_or_default();
        let replica_identity =
            ReplicaIdentity::from_code(&row.get::<String>(3)?.unwrap_or_default());
        let qualified_name: String = row.get(4)?.unwrap_or_default();
        let owner: pg_sys::Oid = row.get(5)?.unwrap_or(pg_sys::InvalidOid);

        let mut columns = Vec::new();
        let rows = client.select(
            "SELECT a.attname::text, a.atttypid, pg_catalog.format_type(a.atttypid, a.atttypmod),
                    a.attnotnull, a.attgenerated OPERATOR(pg_catalog.<>) ''
               FROM pg_catalog.pg_attribute a
              WHERE a.attrelid OPERATOR(pg_catalog.=) $1 AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped
              ORDER BY a.attnum",
            None,
            &[relid.into()],
        )?;
        for row in rows {
            columns.push(ColumnInfo {
                name: row.get(1)?.unwrap_or_default(),
                type_oid: row.get(2)?.unwrap_or(pg_sys::InvalidOid),
                type_name: row.get(3)?.unwrap_or_default(),
                not_null: row.get(4)?.unwrap_or(false),
                generated: row.get(5)?.unwrap_or(false),
            });
        }

        let mut primary_key = None;
        let mut replica_identity_index = None;
        let mut unique_keys = Vec::new();
        let indexes = client.select(
            "SELECT i.indisprimary, i.indisreplident,
                    ARRAY(SELECT a.attname::text
                            FROM pg_catalog.unnest(i.indkey) WITH ORDINALITY k(attnum, ord)
                            JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) i.indrelid AND a.attnum OPERATOR(pg_catalog.=) k.attnum
                           -- Key columns only: INCLUDE columns follow them and are no part of the key.
                           WHERE k.ord OPERATOR(pg_catalog.<=) i.indnkeyatts
                           ORDER BY k.ord)
               FROM pg_catalog.pg_index i
              WHERE i.indrelid OPERATOR(pg_catalog.=) $1 AND i.indisunique AND i.indisvalid AND i.indpred IS NULL
                AND i.indexprs IS NULL AND i.indimmediate",
            None,
            &[relid.into()],
        )?;
        for row in indexes {
            let is_primary: bool = row.get(1)?.unwrap_or(false);
            let is_replica_identity: bool = row.get(2)?.unwrap_or(false);
            let Some(names) = names_from(row.get::<Vec<Option<String>>>(3)?) else {
                continue;
            };
            if is_primary {
                primary_key = Some(names.clone());
            }
            if is_replica_identity {
                replica_identity_index = Some(names.clone());
            }
            unique_keys.push(names);
        }
        Ok(RelationInfo {
            qualified_name,
            owner,
            relkind,
            persistence,
            replica_identity,
            columns,
            primary_key,
            replica_identity_index,
            unique_keys,
            partitions: Vec::new(),
        })
    })
}

/// Holds `relid` against ALTER TABLE until the transaction ends, as a query on it would, and
/// before its columns are read: a DROP COLUMN committed meanwhile is then seen by the reads
/// that follow (taking the lock processes its invalidations), and one not yet committed waits
/// for this transaction, so that the columns read stay the table's for the queries built on them.
pub fn hold_against_alter(relid: pg_sys::Oid) {
    // SAFETY: a heavyweight lock by OID inside a transaction, released at its end; an OID of a
    // relation dropped meanwhile is locked harmlessly.
    unsafe { pg_sys::LockRelationOid(relid, pg_sys::AccessShareLock as pg_sys::LOCKMODE) };
}

/// The leaf partitions of the partitioned table `root` now, each with whether it has pages on
/// disk (`pg_relation_size`). One that has none holds no row, so a partition new to a task
/// (created ahead, or attached empty) needs nothing but its later changes; one that has may hold
/// rows the WAL never carried as the table's changes (an ATTACH, or rows written in the very
/// transaction that created and attached it).
pub fn partition_leaves_now(root: pg_sys::Oid) -> CatalogResult<Vec<(u32, bool)>> {
    // pg_partition_tree locks the partitions but not the table: locked first here, as a query
    // on the table locks it, so that an ALTER TABLE … DETACH PARTITION (which holds the table and
    // waits for the partition) never waits for us in a cycle while we wait for the table.
    // SAFETY: a heavyweight lock by OID inside a transaction, released at its end; an OID of a
    // relation dropped meanwhile is locked harmlessly.
    unsafe { pg_sys::LockRelationOid(root, pg_sys::AccessShareLock as pg_sys::LOCKMODE) };
    Spi::connect(|client| {
        let rows = client.select(
            "SELECT t.relid, pg_catalog.pg_relation_size(t.relid) OPERATOR(pg_catalog.>) 0
               FROM pg_catalog.pg_partition_tree($1) t
              WHERE t.isleaf",
            None,
            &[root.into()],
        )?;
        let mut leaves = Vec::new();
        for row in rows {
            if let Some(relid) = row.get::<pg_sys::Oid>(1)? {
                leaves.push((relid.to_u32(), row.get::<bool>(2)?.unwrap_or(true)));
            }
        }
        leaves.sort_unstable();
        Ok(leaves)
    })
}

/// The leaf partitions of the partitioned tables `roots` now, each with whether it has pages on
/// disk (see `partition_leaves_now`), in OID order and once each.
pub fn leaves_of(roots: &[u32]) -> CatalogResult<Vec<(u32, bool)>> {
    let mut leaves = Vec::new();
    for &root in roots {
        leaves.extend(partition_leaves_now(pg_sys::Oid::from(root))?);
    }
    leaves.sort_unstable();
    leaves.dedup();
    Ok(leaves)
}

/// Where the WAL is being written now: every transaction that committed before this call is
/// before it.
pub fn wal_insert_position() -> CatalogResult<u64> {
    let position: Option<i64> = select_one(
        "SELECT (pg_catalog.pg_current_wal_insert_lsn() OPERATOR(pg_catalog.-) '0/0'::pg_catalog.pg_lsn)::bigint",
        &[],
    )?;
    Ok(position
        .and_then(|p| u64::try_from(p).ok())
        .unwrap_or_default())
}

/// The leaf partitions of a partitioned table, at any depth, as the catalog has them now.
fn leaf_partitions(root: pg_sys::Oid) -> CatalogResult<Vec<RelationInfo>> {
    partition_leaves_now(root)?
        .into_iter()
        .map(|(leaf, _)| relation_info(pg_sys::Oid::from(leaf)))
        .collect()
}

/// The leaf partitions of the partitioned table `root` (named `table`), refused when one is
/// foreign, temporary or unlogged: its changes are not in the WAL.
pub fn logged_partitions(root: pg_sys::Oid, table: &str) -> CatalogResult<Vec<RelationInfo>> {
    let partitions = leaf_partitions(root)?;
    if let Some(leaf) = partitions
        .iter()
        .find(|leaf| leaf.relkind != RelationKind::Table || leaf.persistence != "p")
    {
        let name = &leaf.qualified_name;
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!("partition {name} of table {table} is foreign, temporary or unlogged, so its changes are not in the WAL"),
        )
        .hint(format!("Run ALTER TABLE {name} SET LOGGED, or detach the partition.")));
    }
    Ok(partitions)
}

/// The table or view a task syncs, checked as `meili_sync_start` checks it and as the worker
/// checks it again before each copy: an ordinary, permanent user table, or a view, that `role`
/// may read. (What a view reads is checked by `plan::view_plan`.)
pub fn syncable_source(relid: pg_sys::Oid, role: pg_sys::Oid) -> CatalogResult<RelationInfo> {
    let mut info = relation_info(relid)?;
    let table = &info.qualified_name;
    if !matches!(
        info.relkind,
        RelationKind::Table | RelationKind::View | RelationKind::PartitionedTable
    ) {
        return Err(SyncError::new(ErrorKind::InvalidParameter, format!("{table} is not a table or a view"))
            .hint("Sync an ordinary or partitioned table, or a view; materialized views and foreign tables have no row changes in the WAL."));
    }
    if u32::from(relid) < pg_sys::FirstNormalObjectId {
        return Err(SyncError::new(
            ErrorKind::UnsupportedType,
            format!("{table} is a system catalog"),
        )
        .hint("Sync a user table; system catalogs cannot be published for logical decoding."));
    }
    if info.persistence != "p" {
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!("table {table} is temporary or unlogged, so its changes are not in the WAL"),
        )
        .hint(format!(
            "Run ALTER TABLE {table} SET LOGGED, or sync a permanent table."
        )));
    }
    if info.relkind == RelationKind::PartitionedTable {
        let partitions = logged_partitions(relid, table)?;
        info.partitions = partitions;
    }
    let table = &info.qualified_name;
    if !may_select(role, relid)? {
        let role = role_name(role)?;
        return Err(SyncError::new(
            ErrorKind::Privilege,
            format!("permission denied for table {table}: role {role} may not read it"),
        )
        .hint(format!(
            "A task copies the table's rows out of the database, so it needs SELECT on it: GRANT SELECT ON {table} TO {role}."
        )));
    }
    Ok(info)
}

impl RelationInfo {
    pub fn is_view(&self) -> bool {
        self.relkind == RelationKind::View
    }

    pub fn is_partitioned(&self) -> bool {
        self.relkind == RelationKind::PartitionedTable
    }

    /// How queries name it: `ONLY t` for a table (not its inheritance children), a partitioned
    /// table with its partitions, the view itself.
    pub fn query_name(&self) -> String {
        if self.is_view() || self.is_partitioned() {
            self.qualified_name.clone()
        } else {
            format!("ONLY {}", self.qualified_name)
        }
    }

    /// The SQL type of a column (as `format_type` prints it), for casts in generated queries.
    pub fn type_name_of(&self, column: &str) -> String {
        self.columns
            .iter()
            .find(|c| c.name == column)
            .map(|c| c.type_name.clone())
            .unwrap_or_default()
    }
}

// Not bound by pgrx 0.18; called through the FFI boundary guard, like pgrx's own wrappers.
extern "C-unwind" {
    fn get_partition_ancestors(relid: pg_sys::Oid) -> *mut pg_sys::List;
    fn find_all_inheritors(
        parent: pg_sys::Oid,
        lockmode: std::ffi::c_int,
        parents: *mut *mut pg_sys::List,
    ) -> *mut pg_sys::List;
}

/// The OIDs of an OID list (NIL: none).
///
/// # Safety
/// `list` is NIL or a valid `T_OidList` in a memory context that outlives this call.
unsafe fn oid_list(list: *mut pg_sys::List) -> Vec<u32> {
    // SAFETY: as the caller promises, `list` is NIL or an OID list, which PgList reads as is.
    unsafe { pgrx::PgList::<pg_sys::Oid>::from_pg(list) }
        .iter_oid()
        .map(|oid| oid.to_u32())
        .collect()
}

/// The partitioned tables `relid` is a partition of, nearest first; empty for a relation that is
/// no partition. Reads `pg_inherits` through the catalog snapshot, so inside a decoding callback
/// it answers as of the decoded change, as pgoutput's own lookup does (a partition whose DETACH
/// is pending has no ancestors any more).
pub fn partition_ancestors(relid: u32) -> Vec<u32> {
    let oid = pg_sys::Oid::from(relid);
    // SAFETY: syscache and pg_inherits lookups by OID inside a transaction (a decoding callback,
    // or the worker's own); get_partition_ancestors returns a fresh OID list (NIL when none),
    // and raises an ERROR only on a broken catalog, which the guard turns into a panic.
    unsafe {
        if !pg_sys::get_rel_relispartition(oid) {
            return Vec::new();
        }
        oid_list(pg_guard_ffi_boundary(|| get_partition_ancestors(oid)))
    }
}

/// The leaf partitions (ordinary tables, at any depth) of the partitioned table `root`, as the
/// catalog snapshot sees them (inside a decoding callback: as of the decoded change).
pub fn partition_leaves(root: u32) -> Vec<u32> {
    let oid = pg_sys::Oid::from(root);
    // SAFETY: find_all_inheritors with NoLock (0) and no parents list only scans pg_inherits and
    // returns a fresh OID list holding `root` and everything below it; get_rel_relkind is a
    // syscache lookup that answers 0 for a relation gone meanwhile.
    unsafe {
        let all = oid_list(pg_guard_ffi_boundary(|| {
            find_all_inheritors(oid, 0, std::ptr::null_mut())
        }));
        all.into_iter()
            .filter(|&relid| pg_sys::get_rel_relkind(pg_sys::Oid::from(relid)) as u8 == b'r')
            .collect()
    }
}

/// Resolves how values of a type become JSON: domains to their base type, enums to text,
/// arrays to their element kind. Uses the syscache, not SPI, so that it also works inside a
/// decoding callback (where the catalog is read as of the decoded change).
pub fn value_kind(type_oid: pg_sys::Oid) -> CatalogResult<ValueKind> {
    // SAFETY: lsyscache lookups by OID; they raise an ERROR for a missing type, which pgrx turns
    // into a panic handled by the caller's error path.
    let (base, element, typtype) = unsafe {
        let base = pg_sys::getBaseType(type_oid);
        (
            base,
            pg_sys::get_element_type(base),
            pg_sys::get_typtype(base) as u8,
        )
    };
    if element != pg_sys::InvalidOid {
        return Ok(ValueKind::Array(Box::new(value_kind(element)?)));
    }
    match typtype {
        b'e' => Ok(ValueKind::Text),
        0 => Err(SyncError::new(
            ErrorKind::Internal,
            format!("type with OID {type_oid} does not exist"),
        )),
        _ => Ok(builtin_kind(base)),
    }
}

/// Whether values of a type are PostGIS geometries or geographies (also through a domain): the
/// type whose output function is PostGIS's `geometry_out` or `geography_out`, in whatever schema
/// PostGIS was installed.
pub fn is_postgis_type(type_oid: pg_sys::Oid) -> bool {
    matches!(
        output_function(type_oid).as_deref(),
        Some("geometry_out" | "geography_out")
    )
}

/// Whether values of a type are pgvector embeddings (`vector`, `halfvec`), also through a domain.
pub fn is_pgvector_type(type_oid: pg_sys::Oid) -> bool {
    matches!(
        output_function(type_oid).as_deref(),
        Some("vector_out" | "halfvec_out")
    )
}

/// The name of a type's output function (of its base type, for a domain), which tells an
/// extension's types whatever schema the extension is in. Uses the syscache, as [`value_kind`]
/// does, so that it also works inside a decoding callback.
fn output_function(type_oid: pg_sys::Oid) -> Option<String> {
    // SAFETY: lsyscache lookups by OID. getBaseType answers the OID itself for a non-domain;
    // get_typtype answers 0 for a missing type, checked first; getTypeOutputInfo then finds a
    // defined type's output function (it raises only for a shell type, which no column has);
    // get_func_name returns a palloc'd copy of the name, or NULL for a missing function.
    unsafe {
        let base = pg_sys::getBaseType(type_oid);
        if pg_sys::get_typtype(base) == 0 {
            return None;
        }
        let mut output = pg_sys::InvalidOid;
        let mut varlena = false;
        pg_sys::getTypeOutputInfo(base, &mut output, &mut varlena);
        let name = pg_sys::get_func_name(output);
        (!name.is_null()).then(|| CStr::from_ptr(name).to_string_lossy().into_owned())
    }
}

fn builtin_kind(oid: pg_sys::Oid) -> ValueKind {
    use pg_sys::BuiltinOid as B;
    match B::from_u32(oid.to_u32()) {
        Ok(B::INT2OID | B::INT4OID | B::INT8OID | B::OIDOID) => ValueKind::Integer,
        Ok(B::FLOAT4OID | B::FLOAT8OID) => ValueKind::Float,
        Ok(B::NUMERICOID) => ValueKind::Numeric,
        Ok(B::BOOLOID) => ValueKind::Bool,
        Ok(B::TEXTOID | B::VARCHAROID | B::BPCHAROID | B::NAMEOID | B::UUIDOID | B::CHAROID) => {
            ValueKind::Text
        }
        Ok(B::JSONOID | B::JSONBOID) => ValueKind::Json,
        Ok(B::TIMESTAMPOID) => ValueKind::Timestamp,
        Ok(B::TIMESTAMPTZOID) => ValueKind::TimestampTz,
        Ok(B::DATEOID) => ValueKind::Date,
        Ok(B::TIMEOID) => ValueKind::Time,
        Ok(B::TIMETZOID) => ValueKind::TimeTz,
        Ok(B::BYTEAOID) => ValueKind::Bytea,
        _ => ValueKind::Other,
    }
}

/// How a key column is matched against document ids from the index: through the key's type
/// (uses the key's index; the text must be valid input for the type) or through its text output
/// (always valid, but scans).
pub enum KeyMatch {
    Typed,
    AsText,
}

/// The key columns of one key tuple per position, as `text[]` arguments (one per column).
pub(super) fn key_arrays(keys: &[Vec<String>], columns: usize) -> Vec<DatumWithOid<'static>> {
    (0..columns)
        .map(|column| {
            let values: Vec<String> = keys
                .iter()
                .map(|key| key.get(column).cloned().unwrap_or_default())
                .collect();
            values.into()
        })
        .collect()
}

fn key_condition(key: &[(String, String)], matching: &KeyMatch, alias: &str) -> String {
    key.iter()
        .enumerate()
        .map(|(index, (name, type_name))| match matching {
            KeyMatch::Typed => format!(
                "{alias}.{} = (${}::text[])[i]::{type_name}",
                quote_identifier(name),
                index + 1
            ),
            KeyMatch::AsText => format!(
                "{alias}.{}::text = (${}::text[])[i]",
                quote_identifier(name),
                index + 1
            ),
        })
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// Positions (0-based) of the key tuples that no row of `from` (`RelationInfo::query_name`) has.
pub fn absent_keys(
    from: &str,
    key: &[(String, String)],
    keys: &[Vec<String>],
    matching: &KeyMatch,
) -> CatalogResult<Vec<usize>> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let condition = key_condition(key, matching, "t");
    Spi::connect(|client| {
        let rows = client.select(
            &format!(
                "SELECT i FROM pg_catalog.generate_subscripts($1::text[], 1) i
                  WHERE NOT EXISTS (SELECT 1 FROM {from} t WHERE {condition})
                  ORDER BY i"
            ),
            None,
            &key_arrays(keys, key.len()),
        )?;
        let mut absent = Vec::new();
        for row in rows {
            if let Some(position) = row.get::<i32>(1)? {
                absent.push(usize::try_from(position - 1).unwrap_or_default());
            }
        }
        Ok(absent)
    })
}

/// The `columns` of the rows of `from` (`RelationInfo::query_name`) with these keys, locked until
/// the end of the transaction so that they cannot change meanwhile: FOR UPDATE in a table; in a
/// view, whose rows may be aggregates, by blocking writes to every table it reads.
pub fn lock_rows(
    from: &str,
    is_view: bool,
    columns: &[String],
    key: &[(String, String)],
    keys: &[Vec<String>],
) -> CatalogResult<Vec<Vec<Option<String>>>> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let select: Vec<String> = columns
        .iter()
        .map(|name| format!("t.{}", quote_identifier(name)))
        .collect();
    let condition = key_condition(key, &KeyMatch::Typed, "t");
    if is_view {
        lock_table_against_writes(from)?;
    }
    Spi::connect_mut(|client| {
        let table = client.update(
            &format!(
                "SELECT {} FROM {from} t
                  WHERE EXISTS (SELECT 1 FROM pg_catalog.generate_subscripts($1::text[], 1) i WHERE {condition})
                  {}",
                select.join(", "),
                if is_view { "" } else { "FOR UPDATE OF t" }
            ),
            None,
            &key_arrays(keys, key.len()),
        )?;
        Ok(page_text_values(&table, select.len()))
    })
}

/// Blocks writes to `from` (`RelationInfo::query_name`; for a view, every table it reads) until
/// the end of the transaction (reads go on).
pub fn lock_table_against_writes(from: &str) -> CatalogResult<()> {
    Spi::run(&format!("LOCK TABLE {from} IN SHARE MODE"))?;
    Ok(())
}

/// Sets the session so that every type's text output is the one the encoder expects, in the
/// snapshot and in the decoded stream alike.
pub fn set_output_formats(transaction_only: bool) -> CatalogResult<()> {
    for (name, value) in [
        ("DateStyle", "ISO, YMD"),
        ("TimeZone", "UTC"),
        ("IntervalStyle", "iso_8601"),
        ("extra_float_digits", "1"),
        ("bytea_output", "hex"),
    ] {
        select_one::<String>(
            "SELECT pg_catalog.set_config($1, $2, $3)",
            &[name.into(), value.into(), transaction_only.into()],
        )?;
    }
    Ok(())
}

/// One page of the source table in key order after `after`, at most `limit` rows, each value as
/// its type's text output (what pgoutput sends), or None for NULL.
pub fn read_page(
    query: &str,
    after: Option<&[String]>,
    limit: usize,
    column_count: usize,
) -> CatalogResult<Vec<Vec<Option<String>>>> {
    Spi::connect(|client| {
        let mut args: Vec<DatumWithOid> = after
            .map(|key| key.iter().map(|value| value.as_str().into()).collect())
            .unwrap_or_default();
        args.push(i64::try_from(limit).unwrap_or(i64::MAX).into());
        let table = client.select(query, None, &args)?;
        Ok(page_text_values(&table, column_count))
    })
}

pub(super) fn page_text_values(
    table: &pgrx::spi::SpiTupleTable<'_>,
    column_count: usize,
) -> Vec<Vec<Option<String>>> {
    let mut rows = Vec::with_capacity(table.len());
    // SAFETY: `client.select` just filled SPI_tuptable and we are still inside its SPI connection,
    // so the tuple table, its tuple descriptor and its `table.len()` tuples are valid; SPI_getvalue
    // calls the column type's output function and returns a palloc'd C string or NULL for NULL.
    unsafe {
        let tuptable = pg_sys::SPI_tuptable;
        if tuptable.is_null() {
            return rows;
        }
        let tupdesc = (*tuptable).tupdesc;
        let tuples = std::slice::from_raw_parts((*tuptable).vals, table.len());
        for &tuple in tuples {
            let mut values = Vec::with_capacity(column_count);
            for column in 1..=column_count {
                let text = pg_sys::SPI_getvalue(tuple, tupdesc, column as i32);
                if text.is_null() {
                    values.push(None);
                } else {
                    values.push(Some(CStr::from_ptr(text).to_string_lossy().into_owned()));
                    pg_sys::pfree(text.cast());
                }
            }
            rows.push(values);
        }
    }
    rows
}

/// The keyset queries of the copy (see [`PageQueries`]) over `from` (`RelationInfo::query_name`):
/// the document columns, then the key columns, in key order. The row limit is the last parameter, so that each page can be sized
/// by the bytes of the rows before it.
pub fn page_queries(from: &str, columns: &[String], key: &[(String, String)]) -> PageQueries {
    let select: Vec<String> = columns
        .iter()
        .chain(key.iter().map(|(name, _)| name))
        .map(quote_identifier)
        .collect();
    let key_names = key
        .iter()
        .map(|(name, _)| quote_identifier(name))
        .collect::<Vec<_>>()
        .join(", ");
    // The key's values as parameters $from, $from+1, …, cast to the key columns' types.
    let key_params = |from: usize| {
        key.iter()
            .enumerate()
            .map(|(index, (_, type_name))| format!("${}::{}", from + index, type_name))
            .collect::<Vec<_>>()
            .join(", ")
    };
    // The comparisons stay unqualified: the key's type may be one whose operators live outside
    // pg_catalog. These queries run as the table's owner, with search_path restricted.
    let head = format!("SELECT {} FROM {from}", select.join(", "));
    let order = format!("ORDER BY {key_names}");
    let width = key.len();
    PageQueries {
        first_page: format!("{head} {order} LIMIT $1"),
        next_page: format!(
            "{head} WHERE ({key_names}) > ({}) {order} LIMIT ${}",
            key_params(1),
            width + 1
        ),
        first_range: format!("{head} WHERE ({key_names}) <= ({}) {order}", key_params(1)),
        next_range: format!(
            "{head} WHERE ({key_names}) > ({}) AND ({key_names}) <= ({}) {order}",
            key_params(1),
            key_params(width + 1)
        ),
    }
}

/// The keyset queries of a table's copy, each reading the columns then the key columns in key
/// order: pages (`LIMIT $n`, after a key or from the start) and key ranges (through a key, after
/// a key or from the start), the latter to read a batch again.
pub struct PageQueries {
    pub first_page: String,
    pub next_page: String,
    pub first_range: String,
    pub next_range: String,
}

/// Reads the rows with keys after `after` (from the start when None) through `through`, with
/// `PageQueries::next_range` or `first_range`, as text.
pub fn read_range(
    query: &str,
    after: Option<&[String]>,
    through: &[String],
    column_count: usize,
) -> CatalogResult<Vec<Vec<Option<String>>>> {
    Spi::connect(|client| {
        let args: Vec<DatumWithOid> = after
            .unwrap_or_default()
            .iter()
            .chain(through)
            .map(|value| value.as_str().into())
            .collect();
        let table = client.select(query, None, &args)?;
        Ok(page_text_values(&table, column_count))
    })
}
