//! Planning a task's reads: which columns become document fields (and which form the key), the
//! document shape of the table or of a Relation message, the keyset page queries, and how many
//! rows a page holds. Shared by the copy, the stream and `meili_sync_verify`/`repair`.

use std::time::Duration;

use pgrx::prelude::*;

use crate::batch::BatchLimits;
use crate::catalog::{self, TaskRecord};
use crate::changes::RelationShape;
use crate::encode::{Column, DocumentShape};
use crate::error::{ErrorKind, SyncError};
use crate::options::TaskOptions;
use crate::pgoutput::Relation;

/// Which columns of the table become document fields, and which form the key.
pub struct ColumnRules {
    pub relation_name: String,
    pub key: Vec<String>,
    pub columns: Option<Vec<String>>,
    pub exclude_columns: Vec<String>,
}

impl ColumnRules {
    pub fn new(relation_name: &str, key: &[String], options: &TaskOptions) -> Self {
        ColumnRules {
            relation_name: relation_name.to_owned(),
            key: key.to_vec(),
            columns: options.columns.clone(),
            exclude_columns: options.exclude_columns.clone(),
        }
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
    pub fn relation_shape(&self, relation: &Relation) -> Result<RelationShape, String> {
        let mut columns = Vec::new();
        let mut source_columns = Vec::new();
        for (position, column) in relation.columns.iter().enumerate() {
            if self.includes(&column.name) {
                let kind = catalog::value_kind(pg_sys::Oid::from(column.type_oid))
                    .map_err(|error| error.message)?;
                columns.push(Column {
                    name: column.name.clone(),
                    kind,
                });
                source_columns.push(position);
            }
        }
        let mut key_columns = Vec::new();
        for name in &self.key {
            let position = columns.iter().position(|column| &column.name == name).ok_or_else(|| {
                format!(
                    "key column \"{name}\" of table {} was dropped or renamed; the task stopped so as not to corrupt the index (drop it and start a new one)",
                    self.relation_name
                )
            })?;
            key_columns.push(position);
        }
        let shape = DocumentShape::new(columns, key_columns).map_err(|error| error.to_string())?;
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
    /// Key ranges, to read a batch of the copy again (see `catalog::PageQueries`).
    pub first_range_query: String,
    pub next_range_query: String,
    /// Rows per page at most (pages of wide rows hold fewer, see [`PageSizer`]).
    pub page_rows: usize,
    pub shape: DocumentShape,
    pub limits: BatchLimits,
    /// The table's owner: pages are read with its rights (see `security::as_table_owner`).
    pub table_owner: pgrx::pg_sys::Oid,
}

pub fn build_plan(task: &TaskRecord, options: &TaskOptions) -> Result<SnapshotPlan, SyncError> {
    let info = catalog::relation_info(task.relid)?;
    let mut columns = Vec::new();
    let mut column_names = Vec::new();
    let mut key_types = Vec::new();
    let rules = ColumnRules::new(&task.relation, &task.primary_key, options);
    for column in info.columns.iter().filter(|column| !column.generated) {
        if rules.includes(&column.name) {
            columns.push(Column {
                name: column.name.clone(),
                kind: catalog::value_kind(column.type_oid)?,
            });
            column_names.push(column.name.clone());
        }
    }
    let mut key_columns = Vec::new();
    for name in &task.primary_key {
        let Some(position) = column_names.iter().position(|column| column == name) else {
            return Err(SyncError::new(
                ErrorKind::UndefinedColumn,
                format!(
                    "key column \"{name}\" is no longer in table {}",
                    task.relation
                ),
            ));
        };
        key_columns.push(position);
        key_types.push((name.clone(), info.type_name_of(name)));
    }
    let shape = DocumentShape::new(columns, key_columns).map_err(|error| {
        SyncError::new(
            ErrorKind::InvalidParameter,
            format!("cannot build documents of table {}: {error}", task.relation),
        )
    })?;
    let page_rows = options.batch_size.clamp(100, 10_000);
    let queries = catalog::page_queries(&info.qualified_name, &column_names, &key_types);
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
