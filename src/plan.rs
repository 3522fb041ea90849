//! Planning a task's reads: which columns become document fields (and which form the key), the
//! document shape of the table or of a Relation message, the keyset page queries, and how many
//! rows a page holds. Shared by the copy, the stream and `meili_sync_verify`/`repair`.

use std::time::Duration;

use pgrx::prelude::*;

use pg_meili_sync_core::document::encode::{Column, DocumentShape, ValueKind};
use pg_meili_sync_core::pipeline::batch::BatchLimits;
use pg_meili_sync_core::task::failure::{Failure, FailureKind};
use pg_meili_sync_core::task::options::TaskOptions;
use pg_meili_sync_core::task::pg_catalog::{RelationKind, ReplicaIdentity};
use pg_meili_sync_core::wal::affected::{KeyRoute, KeySource, TableRoutes};
use pg_meili_sync_core::wal::changes::RelationShape;
use pg_meili_sync_core::wal::pgoutput::Relation;

use crate::catalog::{self, source::RelationInfo, tasks::TaskRecord};
use crate::error::{ErrorKind, SyncError};
use crate::security;

/// Which columns of the table become document fields, and which form the key.
pub struct ColumnRules {
    pub relation_name: String,
    pub key: Vec<String>,
    pub columns: Option<Vec<String>>,
    pub exclude_columns: Vec<String>,
    /// The PostGIS column of the `geo` option.
    pub geo: Option<String>,
    /// Embedder → pgvector column, of the `vectors` option.
    pub vectors: Vec<(String, String)>,
}

impl ColumnRules {
    pub fn new(relation_name: &str, key: &[String], options: &TaskOptions) -> Self {
        ColumnRules {
            relation_name: relation_name.to_owned(),
            key: key.to_vec(),
            columns: options.columns.clone(),
            exclude_columns: options.exclude_columns.clone(),
            geo: options.geo.clone(),
            vectors: options.vectors.clone(),
        }
    }

    /// How a synced column appears in the documents: by its name and its type's rule, except the
    /// `geo` option's column, which becomes `_geo` (or `_geojson`, by value), and the `vectors`
    /// option's columns, which become entries of `_vectors`.
    pub fn document_column(&self, name: &str, type_oid: pg_sys::Oid) -> Result<Column, SyncError> {
        if let Some((embedder, _)) = self.vectors.iter().find(|(_, column)| column == name) {
            if !catalog::source::is_pgvector_type(type_oid) {
                return Err(SyncError::new(
                    ErrorKind::UnsupportedType,
                    format!(
                        "column \"{name}\" of table {}, named for embedder \"{embedder}\" by option \"vectors\", is not a pgvector vector or halfvec",
                        self.relation_name
                    ),
                )
                .hint("Name a column of type vector(n) or halfvec(n) (pgvector)."));
            }
            return Ok(Column {
                name: name.to_owned(),
                kind: ValueKind::Vector(embedder.clone()),
            });
        }
        if self.geo.as_deref() != Some(name) {
            return Ok(Column {
                name: name.to_owned(),
                kind: catalog::source::value_kind(type_oid)?,
            });
        }
        if !catalog::source::is_postgis_type(type_oid) {
            return Err(SyncError::new(
                ErrorKind::UnsupportedType,
                format!(
                    "column \"{name}\" of table {}, named by option \"geo\", is not a PostGIS geometry or geography",
                    self.relation_name
                ),
            )
            .hint("Name a column of type geometry or geography (PostGIS), for example geography(Point) or geometry(Point, 4326)."));
        }
        Ok(Column {
            name: pg_meili_sync_core::document::geo::POINT_FIELD.to_owned(),
            kind: ValueKind::Geometry,
        })
    }

    pub fn includes(&self, name: &str) -> bool {
        self.key.iter().any(|key| key == name)
            || (self
                .columns
                .as_ref()
                .is_none_or(|names| names.iter().any(|n| n == name))
                && !self.exclude_columns.iter().any(|n| n == name))
    }

    /// The document shape of a Relation message; a missing key column stops the task.
    pub fn relation_shape(&self, relation: &Relation) -> Result<RelationShape, Failure> {
        let mut columns = Vec::new();
        let mut source_columns = Vec::new();
        for (position, column) in relation.columns.iter().enumerate() {
            if self.includes(&column.name) {
                columns.push(
                    self.document_column(&column.name, pg_sys::Oid::from(column.type_oid))
                        .map_err(Failure::from)?,
                );
                source_columns.push(position);
            }
        }
        let mut key_columns = Vec::new();
        for name in &self.key {
            let position = columns.iter().position(|column| &column.name == name).ok_or_else(|| {
                Failure::new(
                    FailureKind::Source,
                    format!(
                        "key column \"{name}\" of table {} was dropped or renamed; the task stopped so as not to corrupt the index",
                        self.relation_name
                    ),
                )
                .hint("drop the task and start a new one")
            })?;
            key_columns.push(position);
        }
        let shape = DocumentShape::new(columns, key_columns)
            .map_err(|error| Failure::new(FailureKind::Source, error.to_string()))?;
        Ok(RelationShape {
            table: self.relation_name.clone(),
            shape,
            source_columns,
        })
    }
}

/// What the copy reads: the page queries and how rows become documents.
pub struct SnapshotPlan {
    pub first_page_query: String,
    pub next_page_query: String,
    /// Batches of the copy enqueued in Meilisearch at once (the `snapshot_depth` option).
    pub depth: usize,
    /// Key ranges, to read a batch of the copy again (see `catalog::source::PageQueries`).
    pub first_range_query: String,
    pub next_range_query: String,
    /// Rows per page at most (pages of wide rows hold fewer, see [`PageSizer`]).
    pub page_rows: usize,
    pub shape: DocumentShape,
    pub limits: BatchLimits,
    /// The table's owner: pages are read with its rights (see `security::as_table_owner`).
    pub table_owner: pgrx::pg_sys::Oid,
    /// The partitioned tables whose partitions the task follows: its table when that is
    /// partitioned, or the partitioned tables its view reads. Filled by `build_plan` (a worker's
    /// copy and stream), left empty by `source_plan` (a render, a preview).
    pub partitioned_roots: Vec<u32>,
    /// Their leaf partitions when planned, in OID order.
    pub partitions: Vec<u32>,
    /// The source's columns the page queries read, in the order of `shape`'s columns (whose
    /// names are the documents' fields: a `geo` column's is `_geo`).
    pub source_columns: Vec<String>,
}

/// The plan of a task's copy and stream: `source_plan`, with the partitioned tables whose
/// partitions the task follows.
pub fn build_plan(task: &TaskRecord, options: &TaskOptions) -> Result<SnapshotPlan, SyncError> {
    let mut plan = source_plan(task.relid, &task.primary_key, options)?;
    let info = catalog::source::relation_info(task.relid)?;
    plan.partitioned_roots = if info.is_view() {
        catalog::view::base_tables(task.relid)?
            .into_iter()
            .filter(|table| table.relkind == RelationKind::PartitionedTable)
            .map(|table| table.relid.to_u32())
            .collect()
    } else if info.is_partitioned() {
        vec![task.relid.to_u32()]
    } else {
        Vec::new()
    };
    plan.partitions = catalog::source::leaves_of(&plan.partitioned_roots)?
        .into_iter()
        .map(|(leaf, _)| leaf)
        .collect();
    Ok(plan)
}

/// What a worker checks again before it copies or streams a task, since `meili_sync_start`
/// checked it: the table or view is still there and readable by the task's owner, and a view
/// can still be followed (its plan: the tables it reads and where its key comes from). The plan
/// of a view, None for a table.
pub fn recheck_source(
    task: &TaskRecord,
    options: &TaskOptions,
) -> Result<Option<ViewPlan>, SyncError> {
    let checked = check_task_source(task, options).map(|(_, view)| view);
    checked.map_err(|error| match error.hint {
        Some(ref hint) => {
            let hint = format!("{hint} Then run SELECT meili_sync_resume({}).", task.id);
            error.hint(hint)
        }
        None => error,
    })
}

/// The tables a task's publication holds: its table, or every table its view reads.
pub fn published_tables(
    record: &TaskRecord,
    options: &TaskOptions,
) -> Result<Vec<String>, SyncError> {
    Ok(match check_task_source(record, options)? {
        (_, Some(view)) => view.published_tables(),
        (info, None) => vec![info.qualified_name],
    })
}

/// What is checked of an existing task's table or view before work on it (a worker's copy or
/// stream, a resync): an ordinary table or a view that the task's owner may read, and a view
/// that can still be followed. Its catalog facts, and the plan of a view (None for a table).
pub fn check_task_source(
    task: &TaskRecord,
    options: &TaskOptions,
) -> Result<(RelationInfo, Option<ViewPlan>), SyncError> {
    let info = catalog::source::syncable_source(task.relid, task.owner)?;
    // The table's replica identity may have changed since the start, and a partition attached
    // since must carry the key in its old rows too.
    check_key_identity(&info, &task.primary_key)?;
    if !info.is_view() {
        return Ok((info, None));
    }
    let view = view_plan(
        &info,
        task.relid,
        &task.primary_key,
        options,
        task.owner,
        false,
    )?;
    Ok((info, Some(view)))
}

/// The copy's plan of a table or view (`relid`) by its document key `key`.
pub fn source_plan(
    relid: pg_sys::Oid,
    key: &[String],
    options: &TaskOptions,
) -> Result<SnapshotPlan, SyncError> {
    let info = catalog::source::relation_info(relid)?;
    let relation = &info.qualified_name;
    if options.reader_independent && !info.is_view() {
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!("option \"reader_independent\" is for views, and {relation} is not one"),
        )
        .hint("A table's rows are the same for every reader: leave the option out."));
    }
    let mut columns = Vec::new();
    let mut column_names = Vec::new();
    let mut key_types = Vec::new();
    let rules = ColumnRules::new(relation, key, options);
    for column in info.columns.iter().filter(|column| !column.generated) {
        if rules.includes(&column.name) {
            columns.push(rules.document_column(&column.name, column.type_oid)?);
            column_names.push(column.name.clone());
        }
    }
    let mut key_columns = Vec::new();
    for name in key {
        let Some(position) = column_names.iter().position(|column| column == name) else {
            return Err(SyncError::new(
                ErrorKind::UndefinedColumn,
                format!("key column \"{name}\" is no longer in {relation}"),
            )
            .hint("A task's key columns cannot change: drop the task and start a new one."));
        };
        key_columns.push(position);
        key_types.push((name.clone(), info.type_name_of(name)));
    }
    let shape = DocumentShape::new(columns, key_columns).map_err(|error| {
        SyncError::new(
            ErrorKind::InvalidParameter,
            format!("cannot build documents of {relation}: {error}"),
        )
    })?;
    let page_rows = options.batch_size.clamp(100, 10_000);
    let queries = catalog::source::page_queries(&info.query_name(), &column_names, &key_types);
    Ok(SnapshotPlan {
        first_page_query: queries.first_page,
        next_page_query: queries.next_page,
        depth: options.snapshot_depth,
        first_range_query: queries.first_range,
        next_range_query: queries.next_range,
        page_rows,
        shape,
        limits: BatchLimits {
            max_docs: options.batch_size,
            max_bytes: options.batch_bytes,
            max_age: Duration::from_millis(options.flush_interval_ms),
        },
        table_owner: info.owner,
        partitioned_roots: Vec::new(),
        partitions: Vec::new(),
        source_columns: column_names,
    })
}

/// A mapping query of a view task (the `mappings` option): it gets the changed rows' key columns
/// of `table` as `text[]` parameters `$1`…`$params` and returns the keys of affected documents.
#[derive(Debug, Clone)]
pub struct Mapping {
    pub table: String,
    pub query: String,
    pub params: usize,
}

/// How a view task follows its view: the tables it publishes and, for each, which columns of a
/// changed row name the documents it affects (see `affected`), and the mapping queries.
#[derive(Debug, Clone)]
pub struct ViewPlan {
    /// The view, schema-qualified and quoted.
    pub view: String,
    /// The view's key columns and their SQL types.
    pub key: Vec<(String, String)>,
    /// Base tables by relation OID, with their routes.
    pub tables: Vec<(pg_sys::Oid, TableRoutes)>,
    pub mappings: Vec<Mapping>,
    /// The role mapping queries run as (the task's owner, who wrote them).
    pub mapping_role: pg_sys::Oid,
}

impl ViewPlan {
    /// The tables the task's publication must hold.
    pub fn published_tables(&self) -> Vec<String> {
        self.tables
            .iter()
            .map(|(_, routes)| routes.table.clone())
            .collect()
    }

    /// The tables the view reads now that this plan does not follow (a `CREATE OR REPLACE VIEW`
    /// since the plan was made), schema-qualified: their changes do not reach the task until a
    /// new plan follows them (`catalog::tasks::follow_new_tables`).
    pub fn unfollowed_tables(&self, view: pg_sys::Oid) -> Result<Vec<String>, SyncError> {
        Ok(catalog::view::base_tables(view)?
            .into_iter()
            .filter(|table| !self.tables.iter().any(|(relid, _)| *relid == table.relid))
            .map(|table| table.qualified_name)
            .collect())
    }
}

const MAPPING_SHAPE: &str = "{\"mappings\": {\"<table>\": \"SELECT <document key> FROM ... WHERE <column> = ANY($1::<key type>[])\"}}";

/// The replica identity of `which` (a table, or a partition of one: `table` is its name) does
/// not carry the document key.
pub fn identity_error(which: &str, table: &str, key: &[String]) -> SyncError {
    SyncError::new(
        ErrorKind::NoKey,
        format!("the replica identity of {which} does not carry the key ({})", key.join(", ")),
    )
    .detail("Deleted rows are found by their old key, which logical decoding takes from the replica identity.")
    .hint(format!(
        "Run ALTER TABLE {table} REPLICA IDENTITY USING INDEX <unique index on the key>, or REPLICA IDENTITY FULL."
    ))
}

/// Checks that the old row of every UPDATE or DELETE of a table task's table carries `key`, so
/// that a deleted row's document is found (see [`identity_carries`]): the table's own, or each
/// partition's for a partitioned table, whose changes are its partitions'. A view has none.
pub fn check_key_identity(info: &RelationInfo, key: &[String]) -> Result<(), SyncError> {
    let table = &info.qualified_name;
    let tables: Vec<&RelationInfo> = if info.is_partitioned() {
        info.partitions.iter().collect()
    } else if info.is_view() {
        Vec::new()
    } else {
        vec![info]
    };
    match tables
        .into_iter()
        .find(|table| !identity_carries(table, key))
    {
        Some(uncovered) => {
            let name = &uncovered.qualified_name;
            let which = if info.is_partitioned() {
                format!("partition {name} of table {table}")
            } else {
                format!("table {table}")
            };
            Err(identity_error(&which, name, key))
        }
        None => Ok(()),
    }
}

/// Whether the old row of an UPDATE or DELETE on the table carries `columns`: its replica
/// identity holds each of them (it may hold more).
pub fn identity_carries(info: &RelationInfo, columns: &[String]) -> bool {
    let within = |index: &Option<Vec<String>>| {
        index
            .as_ref()
            .is_some_and(|index| columns.iter().all(|column| index.contains(column)))
    };
    match info.replica_identity {
        ReplicaIdentity::Full => true,
        ReplicaIdentity::Default => within(&info.primary_key),
        ReplicaIdentity::Index => within(&info.replica_identity_index),
        ReplicaIdentity::Nothing => false,
    }
}

/// Runs a mapping query once, with no keys, as the task's owner under
/// `SECURITY_RESTRICTED_OPERATION`: it must parse, its tables must be readable, and it must
/// return one column per key column. A failure is re-raised with a hint (in a backend, where the
/// ERROR then aborts the caller's transaction).
fn check_mapping(
    mapping: &Mapping,
    width: usize,
    task_owner: pg_sys::Oid,
) -> Result<(), SyncError> {
    PgTryBuilder::new(|| {
        security::as_table_owner(task_owner, || {
            catalog::view::run_mapping(&mapping.table, &mapping.query, mapping.params, &[], width)
        })
        .map(|_| ())
    })
    .catch_others(|error| {
        Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!("the mapping of table {} fails: {}", mapping.table, crate::error::caught_message(&error)),
        )
        .hint("A mapping runs with search_path pg_catalog, pg_temp, as the task's owner: schema-qualify its tables and functions (public.products), and cast its text-array parameters ($1::int[])."))
    })
    .execute()
}

/// Checks that a view can be followed and plans how: its key (`key`, required), what its query
/// does, and every table it reads, each mapped by identity (the root table, whose column the key
/// is), by a foreign key to the root, or by a mapping of the `mappings` option. Mapping queries
/// are tried once, as `task_owner` under `SECURITY_RESTRICTED_OPERATION`.
pub fn view_plan(
    info: &RelationInfo,
    relid: pg_sys::Oid,
    key: &[String],
    options: &TaskOptions,
    task_owner: pg_sys::Oid,
    check_mappings: bool,
) -> Result<ViewPlan, SyncError> {
    let view = &info.qualified_name;
    let mut typed_key = Vec::new();
    for name in key {
        let Some(column) = info.columns.iter().find(|column| &column.name == name) else {
            return Err(SyncError::new(
                ErrorKind::UndefinedColumn,
                format!(
                    "column \"{name}\" of option \"primary_key\" does not exist in view {view}"
                ),
            )
            .hint("Name the view's key columns, as its select list names them."));
        };
        if !catalog::source::value_kind(column.type_oid)?.can_be_document_id() {
            return Err(SyncError::new(
                ErrorKind::UnsupportedType,
                format!("key column \"{name}\" of view {view} has type {}, which cannot be a Meilisearch document id", column.type_name),
            )
            .hint("Use an integer, text, uuid, numeric, date or time key column."));
        }
        typed_key.push((name.clone(), column.type_name.clone()));
    }
    let query = catalog::view::view_query(relid, view, key)?;
    catalog::reader_dependence::refuse_rows_by_who_asks(
        relid,
        view,
        options.reader_independent.then_some(task_owner),
    )?;
    let tables = catalog::view::base_tables(relid)?;
    if let Some(table) = tables.iter().find(|table| {
        !matches!(
            table.relkind,
            RelationKind::Table | RelationKind::PartitionedTable
        )
    }) {
        return Err(SyncError::new(
            ErrorKind::UnsupportedType,
            format!("view {view} reads {}, which is not an ordinary or partitioned table (relkind '{}')", table.qualified_name, table.relkind.code()),
        )
        .hint("A view task follows the changes of ordinary and partitioned tables only: materialized views and foreign tables have no row changes in the WAL it could follow."));
    }
    let mut mapped: Vec<(pg_sys::Oid, String)> = Vec::new();
    let listed = || {
        tables
            .iter()
            .map(|table| table.qualified_name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (name, sql) in &options.mappings {
        // A plain name is one of the view's tables by name; a qualified one is resolved.
        let relid = if name.contains('.') {
            catalog::view::regclass_of(name)?
        } else {
            let mut named = tables.iter().filter(|table| &table.name == name);
            match (named.next(), named.next()) {
                (Some(table), None) => Some(table.relid),
                (Some(_), Some(_)) => {
                    return Err(SyncError::new(
                        ErrorKind::InvalidParameter,
                        format!("view {view} reads more than one table named \"{name}\" (option \"mappings\")"),
                    )
                    .hint(format!("Schema-qualify it: one of {}.", listed())))
                }
                (None, _) => None,
            }
        };
        let Some(relid) = relid.filter(|relid| tables.iter().any(|table| table.relid == *relid))
        else {
            return Err(SyncError::new(
                ErrorKind::InvalidParameter,
                format!("view {view} does not read table \"{name}\" of option \"mappings\""),
            )
            .hint(format!("Map only tables the view reads: {}.", listed())));
        };
        // A mapping gets the changed keys of its table, so its author must be allowed to read
        // that table, whether or not the mapping's SQL reads it.
        if !catalog::may_select(task_owner, relid)? {
            let table = catalog::source::relation_info(relid)?.qualified_name;
            let role = catalog::role_name(task_owner)?;
            return Err(SyncError::new(
                ErrorKind::Privilege,
                format!("permission denied for table {table}: role {role} may not read it, so it may not map its changes (option \"mappings\")"),
            )
            .hint(format!("A mapping receives the changed rows' keys of its table: GRANT SELECT ON {table} TO {role}, or remove the mapping.")));
        }
        mapped.push((relid, sql.clone()));
    }
    let mut planned = Vec::new();
    let mut mappings = Vec::new();
    let mut unmapped = Vec::new();
    let mut without_identity = Vec::new();
    for table in &tables {
        let table_info = catalog::source::relation_info(table.relid)?;
        let name = table.qualified_name.clone();
        // A partitioned table's changes are its partitions', each with its own replica identity.
        let partitions = if table_info.is_partitioned() {
            catalog::source::logged_partitions(table.relid, &name)?
        } else {
            Vec::new()
        };
        let mut routes = Vec::new();
        if let Some((_, sql)) = mapped.iter().find(|(relid, _)| *relid == table.relid) {
            let own_key = match table_info.replica_identity {
                ReplicaIdentity::Index => table_info.replica_identity_index.clone(),
                ReplicaIdentity::Default | ReplicaIdentity::Full => table_info.primary_key.clone(),
                ReplicaIdentity::Nothing => None,
            };
            let Some(own_key) = own_key else {
                return Err(SyncError::new(
                    ErrorKind::Prerequisite,
                    format!("table {name} has no key to hand to its mapping: it has no primary key, or its replica identity is NOTHING"),
                )
                .hint(format!("Add a primary key to {name} (its key columns are the mapping's $1, $2, ...), or set REPLICA IDENTITY USING INDEX on a unique index.")));
            };
            let mapping = Mapping {
                table: name.clone(),
                query: sql.clone(),
                params: own_key.len(),
            };
            if check_mappings {
                check_mapping(&mapping, key.len(), task_owner)?;
            }
            routes.push(KeyRoute {
                source: KeySource::Mapping(mappings.len()),
                columns: own_key,
            });
            mappings.push(mapping);
        } else if let Some((root, root_columns)) = &query.root {
            let mut by_columns = Vec::new();
            if *root == table.relid {
                by_columns.push(root_columns.clone());
            }
            by_columns.extend(catalog::view::foreign_keys_to(
                table.relid,
                *root,
                root_columns,
            )?);
            for columns in by_columns {
                if partitions.is_empty() && !identity_carries(&table_info, &columns) {
                    without_identity.push(format!("{name} ({})", columns.join(", ")));
                }
                routes.push(KeyRoute {
                    source: KeySource::Document,
                    columns,
                });
            }
        }
        for route in &routes {
            for partition in partitions
                .iter()
                .filter(|partition| !identity_carries(partition, &route.columns))
            {
                without_identity.push(format!(
                    "{} (partition of {name}) ({})",
                    partition.qualified_name,
                    route.columns.join(", ")
                ));
            }
        }
        if routes.is_empty() {
            unmapped.push(name.clone());
        }
        planned.push((
            table.relid,
            TableRoutes {
                table: name,
                routes,
            },
        ));
    }
    if !unmapped.is_empty() {
        let root = match &query.root {
            Some((root, _)) => format!(
                "Its key comes from table {}; these tables have no foreign key to that key column.",
                catalog::source::relation_info(*root)?.qualified_name
            ),
            None => "Its key is not a plain column of one table (a UNION, an expression or a subquery), so every table it reads needs a mapping.".to_owned(),
        };
        return Err(SyncError::new(
            ErrorKind::UnsupportedType,
            format!("view {view} reads tables whose changes cannot be mapped to its documents: {}", unmapped.join(", ")),
        )
        .detail(root)
        .hint(format!("Declare a mapping for each in the options: {MAPPING_SHAPE}. Its query gets the changed rows' primary key columns as text arrays $1, $2, ... and returns the keys of the documents they affect.")));
    }
    if !without_identity.is_empty() {
        return Err(SyncError::new(
            ErrorKind::Prerequisite,
            format!("the replica identity of {} does not carry the columns that point to the view's documents", without_identity.join(", ")),
        )
        .detail("A DELETE, or an UPDATE that moves a row to another document, is found by its old row, which logical decoding takes from the replica identity.")
        .hint(format!("Run ALTER TABLE <table> REPLICA IDENTITY FULL on each, or declare a mapping for it: {MAPPING_SHAPE}.")));
    }
    Ok(ViewPlan {
        view: view.clone(),
        key: typed_key,
        tables: planned,
        mappings,
        mapping_role: task_owner,
    })
}

/// Bytes of row values one page may hold, about: 10,000 rows of 1 MB must not be read at once.
const PAGE_BYTES: usize = 32 << 20;

/// Sizes each page of the copy by the bytes of the rows read so far, so that a page of wide rows
/// stays near [`PAGE_BYTES`] while narrow rows still come `max_rows` at a time. The first page is
/// small, since nothing is known of the rows yet.
pub struct PageSizer {
    max_rows: usize,
    next_rows: usize,
}

impl PageSizer {
    pub fn new(max_rows: usize) -> Self {
        let max_rows = max_rows.max(1);
        PageSizer {
            max_rows,
            next_rows: max_rows.min(100),
        }
    }

    /// Rows to ask for next.
    pub fn rows(&self) -> usize {
        self.next_rows
    }

    /// A page came back with these rows (each a row of values).
    pub fn read(&mut self, rows: &[Vec<Option<String>>]) {
        let bytes: usize = rows
            .iter()
            .flatten()
            .map(|value| value.as_ref().map_or(1, String::len))
            .sum();
        let Some(average) = bytes.checked_div(rows.len()) else {
            return;
        };
        self.next_rows = (PAGE_BYTES / average.max(1)).clamp(1, self.max_rows);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(count: usize, bytes: usize) -> Vec<Vec<Option<String>>> {
        (0..count)
            .map(|_| vec![Some("x".repeat(bytes)), None])
            .collect()
    }

    #[test]
    fn pages_of_wide_rows_stay_near_the_byte_budget() {
        let mut pages = PageSizer::new(10_000);
        assert_eq!(pages.rows(), 100, "the first page is small");
        pages.read(&rows(100, 1 << 20));
        assert_eq!(pages.rows(), PAGE_BYTES / ((1 << 20) + 1));
        pages.read(&rows(1, 200 << 20));
        assert_eq!(pages.rows(), 1, "a row over the budget comes alone");
        pages.read(&rows(10, 10));
        assert_eq!(pages.rows(), 10_000, "narrow rows come max_rows at a time");
        pages.read(&[]);
        assert_eq!(pages.rows(), 10_000, "an empty page changes nothing");
    }
}
