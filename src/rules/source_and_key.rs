//! A task's source and key: the table or view may be synced by the caller, the columns its
//! options name exist and suit them (`geo`, `vectors`), its key identifies rows, and a view's
//! tables can be followed. Start and preview check these before anything is created or read;
//! alter checks what it changes.

use pgrx::prelude::*;

use pg_meili_sync_core::document::{geo, vectors};
use pg_meili_sync_core::task::options::{TaskOptions, WriteMode};

use crate::catalog::{self, source::RelationInfo};
use crate::error::{ErrorKind, SyncError};
use crate::{plan, security};

/// Chooses the key columns: the `primary_key` option, else the table's primary key; checks that
/// they identify rows and that the old key of a DELETE will be in the WAL.
fn resolve_key(
    info: &RelationInfo,
    requested: Option<&Vec<String>>,
) -> Result<Vec<String>, SyncError> {
    let table = &info.qualified_name;
    let key = match requested {
        Some(names) => {
            for name in names {
                let column = info.columns.iter().find(|column| &column.name == name).ok_or_else(|| {
                    SyncError::new(
                        ErrorKind::UndefinedColumn,
                        format!("column \"{name}\" of option \"primary_key\" does not exist in table {table}"),
                    )
                    .hint("Name columns of the table, as in its definition.")
                })?;
                if !column.not_null || column.generated {
                    return Err(SyncError::new(
                        ErrorKind::NoKey,
                        format!("key column \"{name}\" of table {table} must be NOT NULL and not generated"),
                    )
                    .hint("Meilisearch needs an id for every document."));
                }
            }
            let mut wanted = names.clone();
            wanted.sort();
            let unique = info.unique_keys.iter().any(|index| {
                let mut columns = index.clone();
                columns.sort();
                columns == wanted
            });
            if !unique {
                return Err(SyncError::new(
                    ErrorKind::NoKey,
                    format!("no unique index of table {table} is on exactly ({})", names.join(", ")),
                )
                .hint("Create a unique index on those columns, or name the columns of an existing one."));
            }
            names.clone()
        }
        None => info.primary_key.clone().ok_or_else(|| {
            SyncError::new(ErrorKind::NoKey, format!("table {table} has no primary key"))
                .hint("Add a primary key, or pass the columns of a unique NOT NULL index as the \"primary_key\" option.")
        })?,
    };
    plan::check_key_identity(info, &key)?;
    for name in &key {
        let Some(column) = info.columns.iter().find(|column| &column.name == name) else {
            continue;
        };
        let kind = catalog::source::value_kind(column.type_oid)?;
        if !kind.can_be_document_id() {
            return Err(SyncError::new(
                ErrorKind::UnsupportedType,
                format!("key column \"{name}\" has type {}, which cannot be a Meilisearch document id", column.type_name),
            )
            .hint("Use an integer, text, uuid, numeric, date or time key, or pass other columns as \"primary_key\"."));
        }
    }
    Ok(key)
}

/// What start and preview check of the source the caller names, before anything is created or
/// read: a syncable table or view that the caller may read, the option's column names, its key
/// and the tables its publication would hold (`source_plan`).
pub fn checked_source(
    relid: pg_sys::Oid,
    options: &TaskOptions,
) -> Result<(RelationInfo, Vec<String>, Vec<String>), SyncError> {
    let info = catalog::source::syncable_source(relid, security::current_role())?;
    if let Some(columns) = &options.columns {
        check_column_names(&info, "columns", columns)?;
    }
    check_column_names(&info, "exclude_columns", &options.exclude_columns)?;
    let (key, published) = source_plan(&info, relid, options)?;
    if let Some(geo) = &options.geo {
        check_geo_column(&info, &key, options, geo)?;
    }
    check_vector_columns(&info, &key, options)?;
    Ok((info, key, published))
}

/// The column an option names to become a field of its own kind (`geo`, `vectors`): it exists,
/// is synced, is not a key column (a document id), and its type suits the option
/// (`ColumnRules::document_column`).
fn option_column<'a>(
    info: &'a RelationInfo,
    key: &[String],
    rules: &plan::ColumnRules,
    option: &str,
    name: &str,
) -> Result<&'a catalog::source::ColumnInfo, SyncError> {
    let table = &info.qualified_name;
    let column = info
        .columns
        .iter()
        .find(|column| column.name == name)
        .ok_or_else(|| {
            SyncError::new(
                ErrorKind::UndefinedColumn,
                format!("column \"{name}\" of option \"{option}\" does not exist in table {table}"),
            )
            .hint("Name columns of the table, as in its definition.")
        })?;
    if key.iter().any(|column| column == name) {
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!("column \"{name}\" of option \"{option}\" is a key column of {table}"),
        )
        .hint("A key column makes the document id: name another column, or another key with \"primary_key\"."));
    }
    if !rules.includes(name) {
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!("column \"{name}\" of option \"{option}\" is not among the synced columns of {table}"),
        )
        .hint("Add it to \"columns\", or take it out of \"exclude_columns\"."));
    }
    rules.document_column(name, column.type_oid)?;
    Ok(column)
}

/// A synced column named like a field an option writes (`_geo`, `_geojson`, `_vectors`) would
/// make two fields of one name.
fn refuse_field_clash(
    info: &RelationInfo,
    rules: &plan::ColumnRules,
    option: &str,
    fields: &[&str],
    option_column: Option<&str>,
) -> Result<(), SyncError> {
    let Some(clash) = info.columns.iter().find(|column| {
        Some(column.name.as_str()) != option_column
            && fields.contains(&column.name.as_str())
            && rules.includes(&column.name)
    }) else {
        return Ok(());
    };
    Err(SyncError::new(
        ErrorKind::InvalidParameter,
        format!(
            "column \"{}\" of {} clashes with the field the \"{option}\" option writes",
            clash.name, info.qualified_name
        ),
    )
    .hint(format!(
        "Leave that column out with \"exclude_columns\", or sync it without the \"{option}\" option."
    )))
}

/// Each column of the `vectors` option is a synced pgvector column with declared dimensions (the
/// embedder is set up with them), not a key column, not also the `geo` column, and no other
/// synced column is called `_vectors`.
fn check_vector_columns(
    info: &RelationInfo,
    key: &[String],
    options: &TaskOptions,
) -> Result<(), SyncError> {
    if options.vectors.is_empty() {
        return Ok(());
    }
    let table = &info.qualified_name;
    let rules = plan::ColumnRules::new(table, key, options);
    refuse_field_clash(info, &rules, "vectors", &[vectors::VECTORS_FIELD], None)?;
    for (embedder, name) in &options.vectors {
        if options.geo.as_ref() == Some(name) {
            return Err(SyncError::new(
                ErrorKind::InvalidParameter,
                format!("column \"{name}\" is named by both options \"vectors\" and \"geo\""),
            )
            .hint("An embedding can only be an embedding: name another column."));
        }
        let column = option_column(info, key, &rules, "vectors", name)?;
        if vectors::declared_dimensions(&column.type_name).is_none() {
            return Err(SyncError::new(
                ErrorKind::UnsupportedType,
                format!(
                    "column \"{name}\" of {table} (embedder \"{embedder}\") has type {}, without dimensions",
                    column.type_name
                ),
            )
            .hint("Declare the column with its dimensions, for example ALTER TABLE … ALTER COLUMN … TYPE vector(768): the task sets the embedder up with them."));
        }
    }
    Ok(())
}

/// The `geo` option names a synced PostGIS column, not a key column, and no other synced column
/// is called `_geo` or `_geojson`.
fn check_geo_column(
    info: &RelationInfo,
    key: &[String],
    options: &TaskOptions,
    geo: &str,
) -> Result<(), SyncError> {
    let rules = plan::ColumnRules::new(&info.qualified_name, key, options);
    option_column(info, key, &rules, "geo", geo)?;
    refuse_field_clash(
        info,
        &rules,
        "geo",
        &[geo::POINT_FIELD, geo::SHAPE_FIELD],
        Some(geo),
    )?;
    check_geo_write_mode(info, options)
}

/// Upsert mode with a `geo` column that may hold more than points is refused: a row whose value
/// turns from a shape into a point must lose its `_geojson` field, which only replacing the whole
/// document does.
pub fn check_geo_write_mode(info: &RelationInfo, options: &TaskOptions) -> Result<(), SyncError> {
    let Some(geo) = &options.geo else {
        return Ok(());
    };
    let declared = info.type_name_of(geo);
    if options.write_mode == WriteMode::Upsert && !geo::declared_points_only(&declared) {
        return Err(SyncError::new(
            ErrorKind::InvalidParameter,
            format!(
                "column \"{geo}\" of option \"geo\" has type {declared}, which holds more than points, and \"write_mode\" is \"upsert\""
            ),
        )
        .hint("Use \"write_mode\": \"replace\" (a row whose value turns from a shape into a point must lose its _geojson field), or declare the column geometry(Point, 4326) or geography(Point)."));
    }
    Ok(())
}

/// The key of a task's documents and the tables its publication holds: for a table, its key
/// (see `resolve_key`) and itself; for a view, the `primary_key` option (required) and the tables
/// it reads, once `plan::view_plan` found how to follow each.
fn source_plan(
    info: &RelationInfo,
    relid: pg_sys::Oid,
    options: &TaskOptions,
) -> Result<(Vec<String>, Vec<String>), SyncError> {
    if !info.is_view() {
        let key = resolve_key(info, options.primary_key.as_ref())?;
        return Ok((key, vec![info.qualified_name.clone()]));
    }
    let key = options.primary_key.clone().ok_or_else(|| {
        SyncError::new(
            ErrorKind::InvalidParameter,
            format!("option \"primary_key\" is required to sync view {}", info.qualified_name),
        )
        .hint("Name the view's key column or columns, unique by construction: {\"primary_key\": \"id\"}.")
    })?;
    let plan = plan::view_plan(info, relid, &key, options, security::current_role(), true)?;
    Ok((key, plan.published_tables()))
}

/// The `mappings` option as stored: each table by its schema-qualified name, so that workers,
/// whose search_path holds only pg_catalog, find the same tables.
pub fn stored_mappings(
    info: &RelationInfo,
    relid: pg_sys::Oid,
    key: &[String],
    options: &TaskOptions,
) -> Result<Vec<(String, String)>, SyncError> {
    if !info.is_view() {
        return Ok(Vec::new());
    }
    let plan = plan::view_plan(info, relid, key, options, security::current_role(), false)?;
    Ok(plan
        .mappings
        .into_iter()
        .map(|mapping| (mapping.table, mapping.query))
        .collect())
}

fn check_column_names(
    info: &RelationInfo,
    option: &str,
    names: &[String],
) -> Result<(), SyncError> {
    for name in names {
        if !info.columns.iter().any(|column| &column.name == name) {
            return Err(SyncError::new(
                ErrorKind::UndefinedColumn,
                format!(
                    "column \"{name}\" of option \"{option}\" does not exist in table {}",
                    info.qualified_name
                ),
            )
            .hint("Name columns of the table, as in its definition."));
        }
    }
    Ok(())
}
