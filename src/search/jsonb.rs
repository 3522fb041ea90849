//! JSON returned as `jsonb`, built in place with Postgres's own jsonb builder (`pushJsonbValue`,
//! `JsonbValueToJsonb`): from a `serde_json::Value` ([`DirectJsonb`]), or straight from the events
//! of a search answer's text as it is read ([`JsonbBuilder`]). pgrx's `JsonB` goes through the
//! text form: it prints the value and `jsonb_in` parses it again, which was the largest cost of
//! turning a search's hits into rows. The result is the same datum `jsonb_in` makes of the value's
//! text, with the same refusals: a `\u0000` (`22P05`) and a string over jsonb's length limit
//! (`54000`).

use std::ffi::CString;

use pg_sys::JsonbIteratorToken::{
    WJB_BEGIN_ARRAY, WJB_BEGIN_OBJECT, WJB_ELEM, WJB_END_ARRAY, WJB_END_OBJECT, WJB_KEY, WJB_VALUE,
};
use pgrx::callconv::{BoxRet, FcInfo};
use pgrx::pg_sys;
use pgrx::prelude::*;
use serde_json::{Number, Value};

use pg_meili_sync_core::meili::search::DocumentBuilder;

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
    // SAFETY (callers): pgrx passes the FcInfo of the call this value is the result of.
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

/// A `jsonb` datum made in the current memory context.
pub struct BuiltJsonb(pg_sys::Datum);

impl_sql_translatable!(BuiltJsonb, "jsonb");

impl IntoDatum for BuiltJsonb {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(self.0)
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

/// Builds one `jsonb` from the events of a JSON text as it is read (a search answer's document),
/// in the current memory context.
pub struct JsonbBuilder {
    state: *mut pg_sys::JsonbParseState,
    /// For each open container, whether it is an object (a scalar in it is a key's value) or an
    /// array (a scalar in it is an element).
    open_objects: Vec<bool>,
    /// The finished value, once the root is closed (or a root scalar pushed).
    root: *mut pg_sys::JsonbValue,
}

impl JsonbBuilder {
    pub fn new() -> JsonbBuilder {
        JsonbBuilder {
            state: std::ptr::null_mut(),
            open_objects: Vec::new(),
            root: std::ptr::null_mut(),
        }
    }

    /// Opens (`Some(true)` an object, `Some(false)` an array) or closes (`None`) a container.
    fn container(&mut self, token: pg_sys::JsonbIteratorToken::Type, object: Option<bool>) {
        match object {
            Some(object) => self.open_objects.push(object),
            None => {
                self.open_objects.pop();
            }
        }
        // SAFETY: the builder's own state; a null value opens or closes a container, and events
        // come in document order, so each close matches its open. The last close returns the
        // finished root.
        let pushed =
            unsafe { pg_sys::pushJsonbValue(&mut self.state, token, std::ptr::null_mut()) };
        if object.is_none() && self.open_objects.is_empty() {
            self.root = pushed;
        }
    }

    /// Pushes a scalar as the open container's member, or as the root (in jsonb's one-element
    /// raw-scalar array, as `JsonbValueToJsonb` would wrap it).
    fn scalar(&mut self, mut value: pg_sys::JsonbValue) {
        // SAFETY: the builder's own state, with a scalar whose string (if any) is palloc'd in
        // the current context and outlives the datum's making; the builder copies the value.
        unsafe {
            match self.open_objects.last() {
                Some(&object) => {
                    let token = if object { WJB_VALUE } else { WJB_ELEM };
                    pg_sys::pushJsonbValue(&mut self.state, token, &mut value);
                }
                None => {
                    let mut raw_scalar_array = typed(pg_sys::jbvType::jbvArray);
                    raw_scalar_array.val.array.rawScalar = true;
                    pg_sys::pushJsonbValue(&mut self.state, WJB_BEGIN_ARRAY, &mut raw_scalar_array);
                    pg_sys::pushJsonbValue(&mut self.state, WJB_ELEM, &mut value);
                    self.root = pg_sys::pushJsonbValue(
                        &mut self.state,
                        WJB_END_ARRAY,
                        std::ptr::null_mut(),
                    );
                }
            }
        }
    }
}

impl DocumentBuilder for JsonbBuilder {
    type Document = BuiltJsonb;

    fn begin_object(&mut self) {
        self.container(WJB_BEGIN_OBJECT, Some(true));
    }

    fn key(&mut self, key: &str) {
        let mut key = palloc_string_value(key);
        // SAFETY: a key inside the open object, palloc'd in the current context.
        unsafe { pg_sys::pushJsonbValue(&mut self.state, WJB_KEY, &mut key) };
    }

    fn end_object(&mut self) {
        self.container(WJB_END_OBJECT, None);
    }

    fn begin_array(&mut self) {
        self.container(WJB_BEGIN_ARRAY, Some(false));
    }

    fn end_array(&mut self) {
        self.container(WJB_END_ARRAY, None);
    }

    fn null(&mut self) {
        self.scalar(typed(pg_sys::jbvType::jbvNull));
    }

    fn boolean(&mut self, value: bool) {
        let mut scalar = typed(pg_sys::jbvType::jbvBool);
        scalar.val.boolean = value;
        self.scalar(scalar);
    }

    fn number(&mut self, value: &Number) {
        let mut scalar = typed(pg_sys::jbvType::jbvNumeric);
        scalar.val.numeric = numeric(value);
        self.scalar(scalar);
    }

    fn string(&mut self, value: &str) {
        self.scalar(palloc_string_value(value));
    }

    fn finish(self) -> BuiltJsonb {
        if self.root.is_null() {
            error!("a JSON value ended before it was complete");
        }
        // SAFETY: the finished root of this builder, whose strings live in the current context.
        BuiltJsonb(pg_sys::Datum::from(unsafe {
            pg_sys::JsonbValueToJsonb(self.root)
        }))
    }
}

/// A string as a builder value, copied into the current memory context (the text it comes from
/// may be gone before the datum is made), refused as `jsonb_in` refuses it.
fn palloc_string_value(text: &str) -> pg_sys::JsonbValue {
    let mut string = string_value(text);
    // SAFETY: a palloc of the string's length (at most MAX_STRING_BYTES, checked above), and a
    // copy of exactly that many bytes into it.
    unsafe {
        let copy = pg_sys::palloc(text.len().max(1)).cast::<u8>();
        std::ptr::copy_nonoverlapping(text.as_ptr(), copy, text.len());
        string.val.string.val = copy.cast();
    }
    string
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
