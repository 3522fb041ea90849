//! Ordered JSON output. serde_json's `Map` sorts keys, but Meilisearch responses have a fixed
//! key order, so responses are assembled from raw fragments instead.

use serde_json::Value;

/// Builds one JSON object with keys in insertion order.
pub(crate) struct Obj(String);

impl Obj {
    pub(crate) fn new() -> Self {
        Obj(String::from("{"))
    }

    fn key(&mut self, k: &str) {
        if self.0.len() > 1 {
            self.0.push(',');
        }
        self.0.push_str(&quote(k));
        self.0.push(':');
    }

    /// Adds an already serialized JSON fragment.
    pub(crate) fn raw(mut self, k: &str, raw: &str) -> Self {
        self.key(k);
        self.0.push_str(raw);
        self
    }

    pub(crate) fn val(self, k: &str, v: &Value) -> Self {
        self.raw(k, &v.to_string())
    }

    pub(crate) fn str(self, k: &str, s: &str) -> Self {
        self.raw(k, &quote(s))
    }

    pub(crate) fn opt_str(self, k: &str, s: Option<&str>) -> Self {
        match s {
            Some(s) => self.str(k, s),
            None => self.raw(k, "null"),
        }
    }

    pub(crate) fn num(self, k: &str, n: impl Into<u64>) -> Self {
        self.raw(k, &n.into().to_string())
    }

    pub(crate) fn opt_num(self, k: &str, n: Option<u64>) -> Self {
        match n {
            Some(n) => self.num(k, n),
            None => self.raw(k, "null"),
        }
    }

    pub(crate) fn end(mut self) -> String {
        self.0.push('}');
        self.0
    }
}

/// Joins serialized fragments into a JSON array.
pub(crate) fn array<I: IntoIterator<Item = String>>(items: I) -> String {
    let mut out = String::from("[");
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&item);
    }
    out.push(']');
    out
}

/// An object from ordered pairs of key and raw JSON.
pub(crate) fn object_of(pairs: &[(String, Value)]) -> String {
    pairs.iter().fold(Obj::new(), |o, (k, v)| o.val(k, v)).end()
}

pub(crate) fn quote(s: &str) -> String {
    Value::from(s).to_string()
}

/// How deserr describes a value in "Invalid value type" messages.
pub(crate) fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(_) => format!("a boolean: `{v}`"),
        Value::Number(n) if n.is_u64() => format!("a positive integer: `{v}`"),
        Value::Number(n) if n.is_i64() => format!("a negative integer: `{v}`"),
        Value::Number(_) => format!("a number: `{v}`"),
        Value::String(_) => format!("a string: `{v}`"),
        Value::Array(_) => format!("an array: `{v}`"),
        Value::Object(_) => format!("an object: `{v}`"),
    }
}
