//! Meilisearch filter expressions: parsing, the filterable-attribute check and evaluation
//! against a document.

use serde_json::Value;

use crate::docs::Doc;
use crate::settings::pattern_matches;

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Filter {
    And(Vec<Filter>),
    Or(Vec<Filter>),
    Not(Box<Filter>),
    Cond { attr: String, op: Op },
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Op {
    Eq(String),
    Ne(String),
    Gt(String),
    Ge(String),
    Lt(String),
    Le(String),
    Between(String, String),
    In(Vec<String>),
    Exists,
    Null,
    Empty,
    Contains(String),
    StartsWith(String),
}

/// A filter given as a string or as an array (outer AND of strings or inner OR arrays).
pub(crate) fn from_json(v: &Value) -> Result<Option<Filter>, String> {
    let invalid = |expected: &str, found: &Value| {
        format!("Invalid type for filter subexpression: expected: {expected}, found: {found}.")
    };
    match v {
        Value::Null => Ok(None),
        Value::String(s) => parse(s),
        Value::Array(items) => {
            let mut ands = Vec::new();
            for item in items {
                match item {
                    Value::String(s) => ands.extend(parse(s)?),
                    Value::Array(inner) => {
                        let mut ors = Vec::new();
                        for s in inner {
                            let Value::String(s) = s else {
                                return Err(invalid("String", s));
                            };
                            ors.extend(parse(s)?);
                        }
                        match ors.len() {
                            0 => {}
                            1 => ands.extend(ors),
                            _ => ands.push(Filter::Or(ors)),
                        }
                    }
                    other => return Err(invalid("String, [String]", other)),
                }
            }
            Ok(match ands.len() {
                0 => None,
                1 => ands.pop(),
                _ => Some(Filter::And(ands)),
            })
        }
        other => Err(invalid("String, Array", other)),
    }
}

pub(crate) fn parse(input: &str) -> Result<Option<Filter>, String> {
    if input.trim().is_empty() {
        return Ok(None);
    }
    let mut p = Parser {
        input,
        chars: input.chars().collect(),
        pos: 0,
    };
    let filter = p.parse_or()?;
    p.skip_ws();
    if p.pos < p.chars.len() {
        let rest = p.rest();
        return Err(p.error(
            format!("Found unexpected characters at the end of the filter: `{rest}`. You probably forgot an `OR` or an `AND` rule."),
            p.pos,
            p.chars.len(),
        ));
    }
    Ok(Some(filter))
}

struct Parser<'a> {
    input: &'a str,
    chars: Vec<char>,
    pos: usize,
}

const OPERATIONS: &str = "Was expecting an operation `=`, `!=`, `>=`, `>`, `<=`, `<`, `IN`, `NOT IN`, `TO`, `EXISTS`, `NOT EXISTS`, `IS NULL`, `IS NOT NULL`, `IS EMPTY`, `IS NOT EMPTY`, `CONTAINS`, `NOT CONTAINS`, `STARTS WITH`, `NOT STARTS WITH`, `_geoRadius`, or `_geoBoundingBox`";

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || matches!(c, '_' | '-' | '.')
}

impl Parser<'_> {
    fn error(&self, message: String, start: usize, end: usize) -> String {
        format!("{message}\n{}:{} {}", start + 1, end + 1, self.input)
    }

    fn rest(&self) -> String {
        self.chars[self.pos..].iter().collect()
    }

    fn skip_ws(&mut self) {
        while self.chars.get(self.pos).is_some_and(|c| c.is_whitespace()) {
            self.pos += 1;
        }
    }

    /// Consumes `kw` if it is the next whole word.
    fn keyword(&mut self, kw: &str) -> bool {
        self.skip_ws();
        let n = kw.chars().count();
        let matches = self.chars.len() >= self.pos + n
            && self.chars[self.pos..self.pos + n]
                .iter()
                .copied()
                .eq(kw.chars())
            && !self
                .chars
                .get(self.pos + n)
                .is_some_and(|c| is_word_char(*c));
        if matches {
            self.pos += n;
        }
        matches
    }

    fn symbol(&mut self, sym: &str) -> bool {
        self.skip_ws();
        let n = sym.chars().count();
        let matches = self.chars.len() >= self.pos + n
            && self.chars[self.pos..self.pos + n]
                .iter()
                .copied()
                .eq(sym.chars());
        if matches {
            self.pos += n;
        }
        matches
    }

    fn parse_or(&mut self) -> Result<Filter, String> {
        let mut items = vec![self.parse_and()?];
        while self.keyword("OR") {
            items.push(self.parse_and()?);
        }
        Ok(if items.len() == 1 {
            items.remove(0)
        } else {
            Filter::Or(items)
        })
    }

    fn parse_and(&mut self) -> Result<Filter, String> {
        let mut items = vec![self.parse_not()?];
        while self.keyword("AND") {
            items.push(self.parse_not()?);
        }
        Ok(if items.len() == 1 {
            items.remove(0)
        } else {
            Filter::And(items)
        })
    }

    fn parse_not(&mut self) -> Result<Filter, String> {
        if self.keyword("NOT") {
            return Ok(negate(self.parse_not()?));
        }
        self.parse_primary()
    }

    fn parse_primary(&mut self) -> Result<Filter, String> {
        let start = self.pos;
        if self.symbol("(") {
            let inner = self.parse_or()?;
            if !self.symbol(")") {
                let expr: String = self.chars[start..self.pos].iter().collect();
                return Err(self.error(
                    format!(
                        "Expression `{}` is missing the following closing delimiter: `)`.",
                        expr.trim()
                    ),
                    start,
                    self.pos,
                ));
            }
            return Ok(inner);
        }
        self.skip_ws();
        let value_start = self.pos;
        let Some(attr) = self.value() else {
            let rest = self.rest();
            return Err(self.error(
                format!("{OPERATIONS} at `{rest}`."),
                value_start,
                self.chars.len(),
            ));
        };
        if attr.starts_with("_geo") {
            return Err(self.error(
                format!("The `{attr}` filter is not supported by this test server."),
                value_start,
                self.pos,
            ));
        }
        let cond = |op| Filter::Cond {
            attr: attr.clone(),
            op,
        };
        type MakeOp = fn(String) -> Op;
        let ops: [(&str, MakeOp); 6] = [
            ("!=", Op::Ne),
            (">=", Op::Ge),
            ("<=", Op::Le),
            ("=", Op::Eq),
            (">", Op::Gt),
            ("<", Op::Lt),
        ];
        for (sym, make) in ops {
            if self.symbol(sym) {
                return Ok(cond(make(self.expect_value()?)));
            }
        }
        if self.keyword("IN") {
            return Ok(cond(Op::In(self.list()?)));
        }
        if self.keyword("EXISTS") {
            return Ok(cond(Op::Exists));
        }
        if self.keyword("IS") {
            let negated = self.keyword("NOT");
            let op = if self.keyword("NULL") {
                Op::Null
            } else if self.keyword("EMPTY") {
                Op::Empty
            } else {
                return Err(self.expected_operation(value_start));
            };
            return Ok(if negated { negate(cond(op)) } else { cond(op) });
        }
        if self.keyword("CONTAINS") {
            return Ok(cond(Op::Contains(self.expect_value()?)));
        }
        if self.keyword("STARTS") && self.keyword("WITH") {
            return Ok(cond(Op::StartsWith(self.expect_value()?)));
        }
        let before_not = self.pos;
        if self.keyword("NOT") {
            if self.keyword("IN") {
                return Ok(negate(cond(Op::In(self.list()?))));
            }
            if self.keyword("EXISTS") {
                return Ok(negate(cond(Op::Exists)));
            }
            if self.keyword("CONTAINS") {
                return Ok(negate(cond(Op::Contains(self.expect_value()?))));
            }
            if self.keyword("STARTS") && self.keyword("WITH") {
                return Ok(negate(cond(Op::StartsWith(self.expect_value()?))));
            }
            self.pos = before_not;
        }
        self.skip_ws();
        if let Some(from) = self.value() {
            if self.keyword("TO") {
                let to = self.expect_value()?;
                return Ok(cond(Op::Between(from, to)));
            }
        }
        Err(self.expected_operation(value_start))
    }

    fn expected_operation(&self, start: usize) -> String {
        let rest: String = self.chars[start..].iter().collect();
        self.error(
            format!("{OPERATIONS} at `{}`.", rest.trim()),
            start,
            self.chars.len(),
        )
    }

    fn expect_value(&mut self) -> Result<String, String> {
        self.skip_ws();
        let start = self.pos;
        self.value().ok_or_else(|| {
            let rest = self.rest();
            self.error(
                format!("Was expecting a value but instead got `{rest}`."),
                start,
                self.chars.len(),
            )
        })
    }

    /// A quoted string or a bare word.
    fn value(&mut self) -> Option<String> {
        self.skip_ws();
        let quote = *self.chars.get(self.pos)?;
        if quote == '"' || quote == '\'' {
            let mut out = String::new();
            let mut i = self.pos + 1;
            while let Some(&c) = self.chars.get(i) {
                match c {
                    '\\' if matches!(self.chars.get(i + 1), Some('"' | '\'' | '\\')) => {
                        out.push(self.chars[i + 1]);
                        i += 2;
                        continue;
                    }
                    c if c == quote => {
                        self.pos = i + 1;
                        return Some(out);
                    }
                    c => out.push(c),
                }
                i += 1;
            }
            return None;
        }
        let start = self.pos;
        while self.chars.get(self.pos).is_some_and(|c| is_word_char(*c)) {
            self.pos += 1;
        }
        (self.pos > start).then(|| self.chars[start..self.pos].iter().collect())
    }

    fn list(&mut self) -> Result<Vec<String>, String> {
        let start = self.pos;
        if !self.symbol("[") {
            return Err(self.error(
                "Expected `[` after `IN` keyword.".into(),
                start,
                self.chars.len(),
            ));
        }
        let mut items = Vec::new();
        loop {
            if self.symbol("]") {
                return Ok(items);
            }
            match self.value() {
                Some(v) => items.push(v),
                None => return Err(self.error(
                    "Expected only comma-separated field names inside `IN[..]` but instead found `"
                        .to_string()
                        + &self.rest()
                        + "`.",
                    self.pos,
                    self.chars.len(),
                )),
            }
            if self.symbol(",") {
                continue;
            }
            if self.symbol("]") {
                return Ok(items);
            }
            return Err(self.error(
                "Expected matching `]` after the list of field names given to `IN[`".into(),
                start,
                self.chars.len(),
            ));
        }
    }
}

fn negate(f: Filter) -> Filter {
    match f {
        Filter::Not(inner) => *inner,
        other => Filter::Not(Box::new(other)),
    }
}

fn quoted(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

impl Filter {
    fn attrs<'a>(&'a self, out: &mut Vec<&'a str>) {
        match self {
            Filter::And(items) | Filter::Or(items) => items.iter().for_each(|f| f.attrs(out)),
            Filter::Not(inner) => inner.attrs(out),
            Filter::Cond { attr, .. } => out.push(attr),
        }
    }

    /// Renders the normalized form the real server quotes in filter errors (`"name" = "x"`),
    /// recording the character span of the first occurrence of `target`.
    fn render(&self, out: &mut String, target: &str, span: &mut Option<(usize, usize)>) {
        match self {
            Filter::And(items) | Filter::Or(items) => {
                let sep = if matches!(self, Filter::And(_)) {
                    " AND "
                } else {
                    " OR "
                };
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(sep);
                    }
                    let wrap = matches!(self, Filter::And(_)) && matches!(item, Filter::Or(_));
                    if wrap {
                        out.push('(');
                    }
                    item.render(out, target, span);
                    if wrap {
                        out.push(')');
                    }
                }
            }
            Filter::Not(inner) => {
                out.push_str("NOT (");
                inner.render(out, target, span);
                out.push(')');
            }
            Filter::Cond { attr, op } => {
                if span.is_none() && attr == target {
                    let start = out.chars().count() + 1;
                    *span = Some((start, start + attr.chars().count()));
                }
                out.push_str(&quoted(attr));
                let rendered = match op {
                    Op::Eq(v) => format!(" = {}", quoted(v)),
                    Op::Ne(v) => format!(" != {}", quoted(v)),
                    Op::Gt(v) => format!(" > {}", quoted(v)),
                    Op::Ge(v) => format!(" >= {}", quoted(v)),
                    Op::Lt(v) => format!(" < {}", quoted(v)),
                    Op::Le(v) => format!(" <= {}", quoted(v)),
                    Op::Between(a, b) => format!(" {} TO {}", quoted(a), quoted(b)),
                    Op::In(vs) => {
                        let vs: Vec<String> = vs.iter().map(|v| quoted(v)).collect();
                        format!(" IN [{}]", vs.join(", "))
                    }
                    Op::Exists => " EXISTS".into(),
                    Op::Null => " IS NULL".into(),
                    Op::Empty => " IS EMPTY".into(),
                    Op::Contains(v) => format!(" CONTAINS {}", quoted(v)),
                    Op::StartsWith(v) => format!(" STARTS WITH {}", quoted(v)),
                };
                out.push_str(&rendered);
            }
        }
    }

    /// The first attribute not covered by `patterns`, as the real server's error message.
    pub(crate) fn check_filterable(&self, patterns: &[String]) -> Result<(), String> {
        let mut attrs = Vec::new();
        self.attrs(&mut attrs);
        let Some(bad) = attrs
            .into_iter()
            .find(|a| !patterns.iter().any(|p| pattern_matches(p, a)))
        else {
            return Ok(());
        };
        let mut message = format!("Attribute `{bad}` is not filterable.");
        if patterns.is_empty() {
            message.push_str(" This index does not have configured filterable attributes.");
        } else {
            let mut sorted: Vec<&String> = patterns.iter().collect();
            sorted.sort();
            sorted.dedup();
            let list: Vec<String> = sorted.iter().map(|p| format!("`{p}`")).collect();
            message.push_str(&format!(
                " Available filterable attribute patterns are: {}.",
                list.join(", ")
            ));
        }
        let (mut rendered, mut span) = (String::new(), None);
        self.render(&mut rendered, bad, &mut span);
        let (start, end) = span.unwrap_or((0, 0));
        Err(format!("{message}\n{}:{} {rendered}", start + 1, end + 1))
    }

    pub(crate) fn matches(&self, doc: &Doc) -> bool {
        match self {
            Filter::And(items) => items.iter().all(|f| f.matches(doc)),
            Filter::Or(items) => items.iter().any(|f| f.matches(doc)),
            Filter::Not(inner) => !inner.matches(doc),
            Filter::Cond { attr, op } => {
                let mut raw = Vec::new();
                values_at(doc, attr, &mut raw);
                eval(op, &raw)
            }
        }
    }
}

/// Raw values at a dotted path, descending through arrays of objects.
pub(crate) fn values_at<'a>(obj: &'a Doc, path: &str, out: &mut Vec<&'a Value>) {
    for (key, value) in obj {
        if key == path {
            out.push(value);
        } else if let Some(rest) = path
            .strip_prefix(key.as_str())
            .and_then(|r| r.strip_prefix('.'))
        {
            descend(value, rest, out);
        }
    }
}

fn descend<'a>(value: &'a Value, path: &str, out: &mut Vec<&'a Value>) {
    match value {
        Value::Object(inner) => values_at(inner, path, out),
        Value::Array(items) => items.iter().for_each(|v| descend(v, path, out)),
        _ => {}
    }
}

/// Scalars of raw values, arrays flattened: what the real server indexes as facet values.
pub(crate) fn facet_values<'a>(raw: &[&'a Value], out: &mut Vec<&'a Value>) {
    for v in raw {
        match v {
            Value::Array(items) => facet_values(&items.iter().collect::<Vec<_>>(), out),
            Value::Object(_) | Value::Null => {}
            scalar => out.push(scalar),
        }
    }
}

pub(crate) fn normalize(s: &str) -> String {
    s.trim().to_lowercase()
}

fn finite(s: &str) -> Option<f64> {
    s.trim().parse::<f64>().ok().filter(|f| f.is_finite())
}

fn equals(v: &Value, target: &str) -> bool {
    match v {
        Value::String(s) => normalize(s) == normalize(target),
        Value::Number(n) => finite(target).is_some_and(|t| n.as_f64() == Some(t)),
        Value::Bool(b) => normalize(target) == b.to_string(),
        _ => false,
    }
}

/// Compares a facet value with a filter operand: numbers numerically, strings lexically.
fn compare(v: &Value, target: &str) -> Option<std::cmp::Ordering> {
    match v {
        Value::Number(n) => n.as_f64()?.partial_cmp(&finite(target)?),
        Value::String(s) => Some(normalize(s).cmp(&normalize(target))),
        _ => None,
    }
}

fn eval(op: &Op, raw: &[&Value]) -> bool {
    use std::cmp::Ordering::*;
    let mut facets = Vec::new();
    facet_values(raw, &mut facets);
    let any = |f: &dyn Fn(&Value) -> bool| facets.iter().any(|v| f(v));
    match op {
        Op::Eq(t) => any(&|v| equals(v, t)),
        Op::Ne(t) => !any(&|v| equals(v, t)),
        Op::In(ts) => any(&|v| ts.iter().any(|t| equals(v, t))),
        Op::Gt(t) => any(&|v| compare(v, t) == Some(Greater)),
        Op::Ge(t) => any(&|v| matches!(compare(v, t), Some(Greater | Equal))),
        Op::Lt(t) => any(&|v| compare(v, t) == Some(Less)),
        Op::Le(t) => any(&|v| matches!(compare(v, t), Some(Less | Equal))),
        Op::Between(a, b) => any(&|v| {
            matches!(compare(v, a), Some(Greater | Equal))
                && matches!(compare(v, b), Some(Less | Equal))
        }),
        Op::Exists => !raw.is_empty(),
        Op::Null => raw.iter().any(|v| v.is_null()),
        Op::Empty => raw.iter().any(|v| match v {
            Value::String(s) => s.is_empty(),
            Value::Array(a) => a.is_empty(),
            Value::Object(o) => o.is_empty(),
            _ => false,
        }),
        Op::Contains(w) => any(&|v| {
            v.as_str()
                .is_some_and(|s| normalize(s).contains(&normalize(w)))
        }),
        Op::StartsWith(w) => any(&|v| {
            v.as_str()
                .is_some_and(|s| normalize(s).starts_with(&normalize(w)))
        }),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn doc(v: Value) -> Doc {
        match v {
            Value::Object(m) => m,
            _ => Doc::new(),
        }
    }

    fn check(filter: &str, d: &Value) -> bool {
        parse(filter)
            .ok()
            .flatten()
            .is_some_and(|f| f.matches(&doc(d.clone())))
    }

    #[test]
    fn evaluates() {
        let d = json!({"category": "Office", "price": 45.5, "in_stock": false,
            "tags": ["sale", "gift"], "meta": {"color": "blue"}, "name": null});
        assert!(check(
            "category = office AND in_stock = false AND price < 400",
            &d
        ));
        assert!(check("meta.color IN [red, blue]", &d));
        assert!(check("tags = gift", &d));
        assert!(check("name IS NULL", &d));
        assert!(check("price 40 TO 50", &d));
        assert!(check("NOT price > 100 OR category = x", &d));
        assert!(check("missing NOT EXISTS AND category != kitchen", &d));
        assert!(check(
            "(price >= 45.5 OR price = 1) AND meta.color = 'blue'",
            &d
        ));
        assert!(!check("price = 12.34", &d));
        assert!(!check("meta.color NOT IN [blue]", &d));
    }

    #[test]
    fn parse_errors() {
        assert!(parse("name =").is_err());
        assert!(parse("(a = 1").is_err());
        assert!(parse("a = 1 b = 2").is_err());
        assert!(parse("a").is_err());
        assert_eq!(parse("   ").ok(), Some(None));
    }

    #[test]
    fn not_filterable_message() {
        let f = parse("name = x").ok().flatten();
        let patterns = vec![
            "price".to_string(),
            "category".into(),
            "meta.color".into(),
            "in_stock".into(),
        ];
        let err = f.map(|f| f.check_filterable(&patterns));
        assert_eq!(
            err,
            Some(Err("Attribute `name` is not filterable. Available filterable attribute patterns are: `category`, `in_stock`, `meta.color`, `price`.\n2:6 \"name\" = \"x\"".into()))
        );
        let f = from_json(&json!(["price > 1", ["meta.color = red", "meta.size = M"]]))
            .ok()
            .flatten();
        assert!(f.is_some_and(|f| f.check_filterable(&["price".into(), "meta".into()]).is_ok()));
    }
}
