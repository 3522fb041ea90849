//! A JSON value returned as `jsonb`, built in place with Postgres's own jsonb builder
//! (`pushJsonbValue`, `JsonbValueToJsonb`). pgrx's `JsonB` goes through the text form: it prints
//! the value and `jsonb_in` parses it again, which was the largest cost of turning a search's hits
//! into rows. The result is the same datum `jsonb_in` makes of the value's text, with the same
//! refusals: a `\u0000` (`22P05`) and a string over jsonb's length limit (`54000`).

use std::ffi::CString;

use pg_sys::JsonbIteratorToken::{
    WJB_BEGIN_ARRAY, WJB_BEGIN_OBJECT, WJB_ELEM, WJB_END_ARRAY, WJB_END_OBJECT, WJB_KEY, WJB_VALUE,
};
use pgrx::callconv::{BoxRet, FcInfo};
use pgrx::pg_sys;
use pgrx::prelude::*;
use serde_json::Value;

/// The longest string jsonb can hold (`JENTRY_OFFLENMASK`).
const MAX_STRING_BYTES: usize = 0x0FFF_FFFF;

/// A JSON value that becomes a `jsonb` datum without the text round trip.
pub struct DirectJsonb(pub Value);

impl_sql_translatable!(DirectJsonb, "jsonb");

impl IntoDatum for DirectJsonb {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(jsonb_datum(&self.0))
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

// SAFETY: returns the datum into_datum made, as pgrx returns its own JsonB.
unsafe impl BoxRet for DirectJsonb {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> pgrx::datum::Datum<'fcx> {
        match self.into_datum() {
            // SAFETY: a jsonb datum of the current memory context, the function's result.
            Some(datum) => unsafe { fcinfo.return_raw_datum(datum) },
            None => fcinfo.return_null(),
        }
    }
}

/// The value as a jsonb datum in the current memory context.
fn jsonb_datum(value: &Value) -> pg_sys::Datum {
    let mut state: *mut pg_sys::JsonbParseState = std::ptr::null_mut();
    // SAFETY: `state` starts empty and every container opened is closed, so the last push returns
    // the finished root. A scalar at the root goes into jsonb's one-element raw-scalar array, as
    // JsonbValueToJsonb would wrap it. Every string pointer points into `value`, which outlives
    // JsonbValueToJsonb (that copies the strings into the datum).
    let jsonb = unsafe {
        let root = match value {
            Value::Object(_) | Value::Array(_) => push(&mut state, value, WJB_ELEM),
            scalar => {
                let mut raw_scalar_array: pg_sys::JsonbValue = std::mem::zeroed();
                raw_scalar_array.type_ = pg_sys::jbvType::jbvArray;
                raw_scalar_array.val.array.rawScalar = true;
                pg_sys::pushJsonbValue(&mut state, WJB_BEGIN_ARRAY, &mut raw_scalar_array);
                push(&mut state, scalar, WJB_ELEM);
                pg_sys::pushJsonbValue(&mut state, WJB_END_ARRAY, std::ptr::null_mut())
            }
        };
        pg_sys::JsonbValueToJsonb(root)
    };
    pg_sys::Datum::from(jsonb)
}

/// Pushes `value` into the builder: a container opens, takes its members and closes (returning
/// it, finished, once it is the root); a scalar goes in as `token` (a key's value or an element).
///
/// # Safety
/// `state` is a builder state that `pushJsonbValue` made (or null for a new root container), a
/// scalar is pushed only inside an open container, and `value` outlives the finished datum.
unsafe fn push(
    state: *mut *mut pg_sys::JsonbParseState,
    value: &Value,
    token: pg_sys::JsonbIteratorToken::Type,
) -> *mut pg_sys::JsonbValue {
    // SAFETY (every push below): as the function's contract; a null value opens or closes a
    // container, and the builder copies the key or scalar it is given.
    unsafe {
        match value {
            Value::Object(members) => {
                pg_sys::pushJsonbValue(state, WJB_BEGIN_OBJECT, std::ptr::null_mut());
                for (key, member) in members {
                    let mut key = string_value(key);
                    pg_sys::pushJsonbValue(state, WJB_KEY, &mut key);
                    push(state, member, WJB_VALUE);
                }
                pg_sys::pushJsonbValue(state, WJB_END_OBJECT, std::ptr::null_mut())
            }
            Value::Array(items) => {
                pg_sys::pushJsonbValue(state, WJB_BEGIN_ARRAY, std::ptr::null_mut());
                for item in items {
                    push(state, item, WJB_ELEM);
                }
                pg_sys::pushJsonbValue(state, WJB_END_ARRAY, std::ptr::null_mut())
            }
            Value::Null => {
                pg_sys::pushJsonbValue(state, token, &mut typed(pg_sys::jbvType::jbvNull))
            }
            Value::Bool(flag) => {
                let mut scalar = typed(pg_sys::jbvType::jbvBool);
                scalar.val.boolean = *flag;
                pg_sys::pushJsonbValue(state, token, &mut scalar)
            }
            Value::Number(number) => {
                let mut scalar = typed(pg_sys::jbvType::jbvNumeric);
                scalar.val.numeric = numeric(number);
                pg_sys::pushJsonbValue(state, token, &mut scalar)
            }
            Value::String(text) => pg_sys::pushJsonbValue(state, token, &mut string_value(text)),
        }
    }
}

/// An empty builder value of this type.
fn typed(kind: pg_sys::jbvType::Type) -> pg_sys::JsonbValue {
    // SAFETY: an all-zero JsonbValue is a valid plain-old-data value (a null pointer, a zero
    // length); its type is set here and its payload by the caller.
    let mut value: pg_sys::JsonbValue = unsafe { std::mem::zeroed() };
    value.type_ = kind;
    value
}

/// A string as a builder value whose bytes stay where they are, refused as `jsonb_in` refuses it.
fn string_value(text: &str) -> pg_sys::JsonbValue {
    if text.contains('\0') {
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_UNTRANSLATABLE_CHARACTER,
            "unsupported Unicode escape sequence",
            "\\u0000 cannot be converted to text."
        );
    }
    if text.len() > MAX_STRING_BYTES {
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            "string too long to represent as jsonb string",
            format!(
                "Due to an implementation restriction, jsonb strings cannot exceed {MAX_STRING_BYTES} bytes."
            )
        );
    }
    let mut string = typed(pg_sys::jbvType::jbvString);
    // At most MAX_STRING_BYTES, so it fits.
    string.val.string.len = text.len() as i32;
    string.val.string.val = text.as_ptr() as *mut std::ffi::c_char;
    string
}

/// A JSON number as the numeric `jsonb_in` makes of its text.
fn numeric(number: &serde_json::Number) -> pg_sys::Numeric {
    if let Some(integer) = number.as_i64() {
        // SAFETY: a plain conversion into a palloc'd numeric.
        return unsafe { pg_sys::int64_to_numeric(integer) };
    }
    // A number's text never holds a NUL.
    let text = CString::new(number.to_string()).unwrap_or_default();
    // SAFETY: numeric_in with a valid C string and no type modifier, on the backend's thread; it
    // raises an ERROR for bad input, which a serde_json number's text never is.
    let datum = unsafe {
        pgrx::fcinfo::direct_function_call_as_datum(
            pg_sys::numeric_in,
            &[
                Some(pg_sys::Datum::from(text.as_ptr())),
                Some(pg_sys::Datum::from(pg_sys::InvalidOid)),
                Some(pg_sys::Datum::from(-1i32)),
            ],
        )
    };
    match datum {
        Some(datum) => datum.cast_mut_ptr(),
        None => error!("numeric_in returned NULL for {text:?}"),
    }
}
