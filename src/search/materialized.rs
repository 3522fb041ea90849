//! A set-returning function's rows handed to Postgres in one call (materialize mode).
//!
//! pgrx's own `TableIterator` returns one row per call. Every function of the extension has a
//! `SET search_path` clause, so Postgres calls it through `fmgr_security_definer`, which sets the
//! setting and restores it (a walk over every setting on PostgreSQL 15) on each of those calls:
//! eleven times for a search of ten hits. This `TableIterator` is written the same way in a
//! function's signature (pgrx reads the column names from it) and puts every row into the
//! tuplestore Postgres gives the function, in the one call.

use pgrx::callconv::{CallCx, RetAbi};
use pgrx::pg_sys;
use pgrx::pgrx_sql_entity_graph::metadata::{
    table_item_sql, ArgumentError, ReturnsError, ReturnsRef, SqlMappingRef, SqlTranslatable,
    TypeOrigin,
};
use pgrx::IntoDatum;

/// The rows of a set-returning function, all returned in its one call.
pub struct TableIterator<'a, Row> {
    rows: Box<dyn Iterator<Item = Row> + 'a>,
}

impl<'a, Row: 'a> TableIterator<'a, Row> {
    pub fn new(rows: impl IntoIterator<Item = Row> + 'a) -> Self {
        TableIterator {
            rows: Box::new(rows.into_iter()),
        }
    }
}

/// A row as the datums and null flags of its columns.
pub trait MaterializedRow {
    /// Fills `values` and `nulls` (one per column).
    fn fill(self, values: &mut Vec<pg_sys::Datum>, nulls: &mut Vec<bool>);
}

macro_rules! materialized_rows {
    ($($column:ident),+) => {
        #[allow(non_snake_case)]
        impl<$($column: IntoDatum),+> MaterializedRow for ($($column,)+) {
            fn fill(self, values: &mut Vec<pg_sys::Datum>, nulls: &mut Vec<bool>) {
                let ($($column,)+) = self;
                $(
                    match $column.into_datum() {
                        Some(datum) => {
                            values.push(datum);
                            nulls.push(false);
                        }
                        None => {
                            values.push(pg_sys::Datum::from(0));
                            nulls.push(true);
                        }
                    }
                )+
            }
        }

        #[allow(non_snake_case)]
        // SAFETY: the SQL of a function returning TABLE of these columns, as pgrx writes it for
        // its own TableIterator.
        unsafe impl<'a, $($column: SqlTranslatable + 'a),+> SqlTranslatable
            for TableIterator<'a, ($($column,)+)>
        {
            const TYPE_IDENT: &'static str = concat!(module_path!(), "::TableIterator");
            const TYPE_ORIGIN: TypeOrigin = TypeOrigin::ThisExtension;
            const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> = Err(ArgumentError::Table);
            const RETURN_SQL: Result<ReturnsRef, ReturnsError> =
                materialized_rows!(@columns [] ; $($column),+);
        }
    };
    (@columns [$($item:ident),*] ;) => {
        Ok(ReturnsRef::Table(&[$($item),*]))
    };
    (@columns [$($item:ident),*] ; $head:ident $(, $rest:ident)*) => {{
        match table_item_sql($head::RETURN_SQL) {
            Ok(item) => materialized_rows!(@columns [$($item,)* item] ; $($rest),*),
            Err(error) => Err(error),
        }
    }};
}

materialized_rows!(T0, T1, T2);
materialized_rows!(T0, T1, T2, T3, T4);

// SAFETY: the function runs in the caller's memory context (its short-lived one: the tuplestore
// copies each row), and returns its rows through the ReturnSetInfo of its one call.
unsafe impl<Row: MaterializedRow> RetAbi for TableIterator<'_, Row> {
    type Item = Row;
    type Ret = Self;

    // SAFETY (callers): pgrx calls it once per call, with the call's own fcinfo, unused here.
    unsafe fn check_fcinfo_and_prepare(_fcinfo: pg_sys::FunctionCallInfo) -> CallCx {
        // SAFETY: reads the backend's current memory context.
        CallCx::WrappedFn(unsafe { pg_sys::CurrentMemoryContext })
    }

    fn to_ret(self) -> Self::Ret {
        self
    }

    // SAFETY (callers): pgrx passes the fcinfo of the call whose rows these are.
    unsafe fn box_ret_in_fcinfo(fcinfo: pg_sys::FunctionCallInfo, ret: Self::Ret) -> pg_sys::Datum {
        // SAFETY: `fcinfo` is the call's own. InitMaterializedSRF raises an ERROR unless the
        // caller accepts a materialized set, then makes the tuplestore and the result's
        // descriptor (from the function's declared columns) in the query's memory; each row has
        // as many values as those columns, and tuplestore_putvalues copies them.
        unsafe {
            pg_sys::InitMaterializedSRF(fcinfo, 0);
            let result = (*fcinfo).resultinfo.cast::<pg_sys::ReturnSetInfo>();
            let mut values = Vec::new();
            let mut nulls = Vec::new();
            for row in ret.rows {
                values.clear();
                nulls.clear();
                row.fill(&mut values, &mut nulls);
                pg_sys::tuplestore_putvalues(
                    (*result).setResult,
                    (*result).setDesc,
                    values.as_mut_ptr(),
                    nulls.as_mut_ptr(),
                );
            }
            (*fcinfo).isnull = true;
        }
        pg_sys::Datum::from(0)
    }

    // SAFETY (callers): no per-call state is kept in fcinfo, so both do nothing.
    unsafe fn move_into_fcinfo_fcx(self, _fcinfo: pg_sys::FunctionCallInfo) {}

    unsafe fn fill_fcinfo_fcx(&self, _fcinfo: pg_sys::FunctionCallInfo) {}
}
