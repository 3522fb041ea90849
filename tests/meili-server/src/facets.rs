//! Facets of a federated search, as Meilisearch 1.50 computes them
//! (crates/meilisearch/src/search/federated/{perform,types}.rs and `compute_facet_distribution_stats`
//! in search/mod.rs): `federation.facetsByIndex` over all the queries of an index, remote
//! answers added up, and `federation.mergeFacets` for one top-level distribution.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value};

use crate::docs::Doc;
use crate::error::ApiError;
use crate::index::Index;
use crate::json::Obj;
use crate::search::{count_facets, counts_json, stats_json, type_error, Counts};
use crate::settings::{filterable_patterns, pattern_matches};

/// `federation.facetsByIndex` and `federation.mergeFacets`.
pub(crate) struct Options {
    /// Patterns by index; `null` asks for nothing.
    pub(crate) by_index: BTreeMap<String, Option<Vec<String>>>,
    /// `Some(maxValuesPerFacet)` when facets are merged.
    pub(crate) merge: Option<Option<usize>>,
}

pub(crate) fn parse_options(federation: &Value) -> Result<Options, ApiError> {
    let field = |k: &str| federation.get(k).filter(|v| !v.is_null());
    let mut by_index = BTreeMap::new();
    let code = "invalid_multi_search_facets_by_index";
    match field("facetsByIndex") {
        None => {}
        Some(Value::Object(o)) => {
            for (uid, patterns) in o {
                let at = format!(".federation.facetsByIndex.{uid}");
                let patterns = match patterns {
                    Value::Null => None,
                    Value::Array(items) => Some(
                        items
                            .iter()
                            .enumerate()
                            .map(|(i, v)| {
                                v.as_str().map(String::from).ok_or_else(|| {
                                    type_error(code, &format!("{at}[{i}]"), "a string", v)
                                })
                            })
                            .collect::<Result<Vec<_>, _>>()?,
                    ),
                    v => return Err(type_error(code, &at, "an array", v)),
                };
                by_index.insert(uid.clone(), patterns);
            }
        }
        Some(v) => {
            return Err(type_error(
                code,
                ".federation.facetsByIndex",
                "an object",
                v,
            ))
        }
    }
    let code = "invalid_multi_search_merge_facets";
    let merge = match field("mergeFacets") {
        None => None,
        Some(Value::Object(o)) => {
            if let Some(k) = o.keys().find(|k| *k != "maxValuesPerFacet") {
                return Err(ApiError::new(
                    code,
                    format!("Unknown field `{k}` inside `.federation.mergeFacets`: expected one of `maxValuesPerFacet`"),
                ));
            }
            match o.get("maxValuesPerFacet").filter(|v| !v.is_null()) {
                None => Some(None),
                Some(v) => match v.as_u64() {
                    Some(n) => Some(Some(n as usize)),
                    None => {
                        return Err(type_error(
                            "invalid_multi_search_max_values_per_facet",
                            ".federation.mergeFacets.maxValuesPerFacet",
                            "a positive integer",
                            v,
                        ))
                    }
                },
            }
        }
        Some(v) => return Err(type_error(code, ".federation.mergeFacets", "an object", v)),
    };
    Ok(Options { by_index, merge })
}

/// `facets` inside a federated query.
pub(crate) fn facets_in_query(uid: &str, facets: &[String]) -> ApiError {
    ApiError::new(
        "invalid_multi_search_query_facets",
        format!("Using facet options is not allowed in federated queries.\n - Hint: remove `facets` from the query or remove `federation` from the request\n - Hint: pass `federation.facetsByIndex.{uid}: {facets:?}` for facets in federated search"),
    )
}

/// Distribution and stats of one index.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct IndexFacets {
    distribution: BTreeMap<String, Counts>,
    stats: BTreeMap<String, (f64, f64)>,
}

/// Facets by index uid, as `facetsByIndex` answers them.
#[derive(Debug, Default)]
pub(crate) struct ByIndex(pub(crate) BTreeMap<String, IndexFacets>);

/// Meilisearch's `match_pattern` giving a match: `*`, `*x*`, `*x`, `x*` or the name itself.
fn matches(pattern: &str, name: &str) -> bool {
    if pattern == "*" || pattern == name {
        return true;
    }
    match (pattern.strip_prefix('*'), pattern.strip_suffix('*')) {
        (Some(rest), Some(_)) if pattern.len() >= 2 => name.contains(&rest[..rest.len() - 1]),
        (Some(suffix), None) => name.ends_with(suffix),
        (None, Some(prefix)) => name.starts_with(prefix),
        _ => false,
    }
}

/// Dotted paths of the scalar fields of a document, through objects and arrays of objects.
fn leaf_fields(prefix: &str, v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(o) => {
            for (k, v) in o {
                leaf_fields(&format!("{prefix}.{k}"), v, out);
            }
        }
        Value::Array(items) if items.iter().any(Value::is_object) => {
            for v in items.iter().filter(|v| v.is_object()) {
                leaf_fields(prefix, v, out);
            }
            if items.iter().any(|v| !v.is_object()) {
                out.insert(prefix.to_string());
            }
        }
        _ => {
            out.insert(prefix.to_string());
        }
    }
}

/// The filterable fields of `idx` matched by `patterns`, checking each pattern first as
/// `compute_facet_distribution_stats` does.
fn selected_fields(idx: &Index, patterns: &[String]) -> Result<Vec<String>, ApiError> {
    let filterable = filterable_patterns(&idx.settings);
    for p in patterns {
        let ok = filterable
            .iter()
            .any(|f| p == "*" || f == "*" || pattern_matches(f, p) || pattern_matches(p, f));
        if !ok {
            let valid: BTreeSet<&str> = filterable.iter().map(String::as_str).collect();
            let hint = if valid.is_empty() {
                "This index does not have configured filterable attributes.".to_string()
            } else {
                let list: Vec<&str> = valid.into_iter().collect();
                format!(
                    "Available filterable attributes patterns are: `{}`.",
                    list.join(", ")
                )
            };
            return Err(ApiError::new(
                "invalid_search_facets",
                format!("Invalid facet distribution: Pattern `{p}` is not filterable. {hint}"),
            ));
        }
    }
    let mut fields = BTreeSet::new();
    for stored in idx.iter() {
        for (k, v) in &stored.parse() {
            leaf_fields(k, v, &mut fields);
        }
    }
    Ok(fields
        .into_iter()
        .filter(|f| patterns.iter().any(|p| matches(p, f)))
        .filter(|f| filterable.iter().any(|p| pattern_matches(p, f)))
        .collect())
}

/// Facets of `idx` over the documents at `positions` (in `Index::iter`).
pub(crate) fn compute(
    idx: &Index,
    patterns: &[String],
    positions: &BTreeSet<usize>,
) -> Result<IndexFacets, ApiError> {
    let fields = selected_fields(idx, patterns)?;
    let docs: Vec<Doc> = idx
        .iter()
        .enumerate()
        .filter(|(pos, _)| positions.contains(pos))
        .map(|(_, d)| d.parse())
        .collect();
    let refs: Vec<&Doc> = docs.iter().collect();
    let mut out = IndexFacets::default();
    for (field, counts, range) in count_facets(idx, &fields, &refs) {
        if let Some(range) = range {
            out.stats.insert(field.clone(), range);
        }
        out.distribution.insert(field, counts);
    }
    Ok(out)
}

/// `faceting.sortFacetValuesBy` of a field: `true` for `count`.
fn by_count(idx: &Index, field: &str) -> bool {
    let orders = &idx.settings["faceting"]["sortFacetValuesBy"];
    orders
        .get(field)
        .or_else(|| orders.get("*"))
        .and_then(Value::as_str)
        == Some("count")
}

fn order_name(count: bool) -> &'static str {
    if count {
        "by count"
    } else {
        "alphabetically"
    }
}

/// How values are ordered after merging: by facet with `mergeFacets`, by index with remotes.
pub(crate) enum Order {
    /// Facet name to the first index that has it and its order.
    ByFacet(BTreeMap<String, (String, bool)>),
    /// Index uid to its orders and `maxValuesPerFacet`.
    ByIndex(BTreeMap<String, (Map<String, Value>, usize)>),
    None,
}

impl Order {
    pub(crate) fn new(merge: bool, has_remote: bool) -> Self {
        match (merge, has_remote) {
            (true, _) => Order::ByFacet(BTreeMap::new()),
            (false, true) => Order::ByIndex(BTreeMap::new()),
            (false, false) => Order::None,
        }
    }

    /// Records the order of `idx`; with `mergeFacets`, refuses a facet ordered differently.
    pub(crate) fn check(
        &mut self,
        idx: &Index,
        patterns: Option<&[String]>,
    ) -> Result<(), ApiError> {
        match self {
            Order::ByFacet(seen) => {
                let Some(patterns) = patterns else {
                    return Ok(());
                };
                let Ok(fields) = selected_fields(idx, patterns) else {
                    // Left for the facet computation to report.
                    return Ok(());
                };
                for field in fields {
                    let count = by_count(idx, &field);
                    let (first, order) = seen
                        .entry(field.clone())
                        .or_insert_with(|| (idx.uid.clone(), count));
                    if *order != count {
                        return Err(ApiError::new(
                            "invalid_multi_search_facet_order",
                            format!("Inconsistent order for values in facet `{field}`: index `{first}` orders {}, but index `{}` orders {}.\n - Hint: Remove `federation.mergeFacets` or change `faceting.sortFacetValuesBy` to be consistent in settings.", order_name(*order), idx.uid, order_name(count)),
                        ));
                    }
                }
            }
            Order::ByIndex(by_index) => {
                let faceting = &idx.settings["faceting"];
                let orders = faceting["sortFacetValuesBy"]
                    .as_object()
                    .cloned()
                    .unwrap_or_default();
                let max = faceting["maxValuesPerFacet"].as_u64().unwrap_or(100) as usize;
                by_index.insert(idx.uid.clone(), (orders, max));
            }
            Order::None => {}
        }
        Ok(())
    }
}

fn sort(values: &mut Counts, count: bool) {
    if count {
        values.sort_by_key(|v| std::cmp::Reverse(v.1));
    } else {
        values.sort_by(|a, b| a.0.cmp(&b.0));
    }
}

fn add_counts(into: &mut Counts, from: Counts) {
    for (value, n) in from {
        match into.iter_mut().find(|(v, _)| *v == value) {
            Some((_, total)) => *total += n,
            None => into.push((value, n)),
        }
    }
}

fn add_stats(into: &mut BTreeMap<String, (f64, f64)>, from: BTreeMap<String, (f64, f64)>) {
    for (field, (min, max)) in from {
        let range = into.entry(field).or_insert((min, max));
        *range = (range.0.min(min), range.1.max(max));
    }
}

impl ByIndex {
    /// Adds up a remote's facets, index by index.
    pub(crate) fn append(&mut self, other: ByIndex) {
        for (uid, facets) in other.0 {
            let mine = self.0.entry(uid).or_default();
            add_stats(&mut mine.stats, facets.stats);
            for (field, counts) in facets.distribution {
                add_counts(mine.distribution.entry(field).or_default(), counts);
            }
        }
    }

    /// `facetDistribution` and `facetStats` over all indexes, `None` without any facet asked.
    fn merge(
        self,
        max: Option<usize>,
        order: &BTreeMap<String, (String, bool)>,
    ) -> Option<IndexFacets> {
        if self.0.is_empty() {
            return None;
        }
        let mut out = IndexFacets::default();
        for facets in self.0.into_values() {
            add_stats(&mut out.stats, facets.stats);
            for (field, counts) in facets.distribution {
                add_counts(out.distribution.entry(field).or_default(), counts);
            }
        }
        for (field, values) in &mut out.distribution {
            sort(values, order.get(field).is_some_and(|(_, count)| *count));
            if let Some(max) = max {
                values.truncate(max);
            }
        }
        Some(out)
    }

    /// Orders and truncates each index's values as its local settings say.
    fn sort_and_truncate(&mut self, by_index: &BTreeMap<String, (Map<String, Value>, usize)>) {
        for (uid, facets) in &mut self.0 {
            let Some((orders, max)) = by_index.get(uid) else {
                continue;
            };
            for (field, values) in &mut facets.distribution {
                let order = orders.get(field).or_else(|| orders.get("*"));
                sort(values, order.and_then(Value::as_str) == Some("count"));
                values.truncate(*max);
            }
        }
    }

    /// Reads a remote's `facetsByIndex`; `None` when it is not shaped as Meilisearch's.
    pub(crate) fn from_json(v: Option<&Value>) -> Option<ByIndex> {
        let Some(v) = v else {
            return Some(ByIndex::default());
        };
        let mut out = ByIndex::default();
        for (uid, facets) in v.as_object()? {
            let mut f = IndexFacets::default();
            for (field, counts) in facets.get("distribution")?.as_object()? {
                let counts = counts
                    .as_object()?
                    .iter()
                    .map(|(value, n)| n.as_u64().map(|n| (value.clone(), n)))
                    .collect::<Option<Counts>>()?;
                f.distribution.insert(field.clone(), counts);
            }
            for (field, range) in facets.get("stats")?.as_object()? {
                let (min, max) = (range.get("min")?.as_f64()?, range.get("max")?.as_f64()?);
                f.stats.insert(field.clone(), (min, max));
            }
            out.0.insert(uid.clone(), f);
        }
        Some(out)
    }
}

fn distribution_json(d: &BTreeMap<String, Counts>) -> String {
    d.iter()
        .fold(Obj::new(), |o, (k, c)| o.raw(k, &counts_json(c)))
        .end()
}

fn stats_map_json(s: &BTreeMap<String, (f64, f64)>) -> String {
    s.iter()
        .fold(Obj::new(), |o, (k, r)| o.raw(k, &stats_json(*r)))
        .end()
}

/// The facet members of a federated answer, as JSON.
#[derive(Default)]
pub(crate) struct Rendered {
    /// `facetDistribution` and `facetStats`.
    pub(crate) merged: Option<(String, String)>,
    pub(crate) by_index: Option<String>,
}

/// Adds the remotes' facets to the local ones and renders them as `order` and `merge` say.
pub(crate) fn finish(
    order: Order,
    merge: Option<Option<usize>>,
    mut local: ByIndex,
    remote: Vec<ByIndex>,
) -> Rendered {
    match (order, merge) {
        (Order::ByFacet(order), Some(max)) => {
            remote.into_iter().for_each(|r| local.append(r));
            Rendered {
                merged: local
                    .merge(max, &order)
                    .map(|f| (distribution_json(&f.distribution), stats_map_json(&f.stats))),
                by_index: None,
            }
        }
        (order, _) => {
            if let Order::ByIndex(by_index) = order {
                remote.into_iter().for_each(|r| local.append(r));
                local.sort_and_truncate(&by_index);
            }
            let by_index = (!local.0.is_empty()).then(|| {
                local
                    .0
                    .iter()
                    .fold(Obj::new(), |o, (uid, f)| {
                        o.raw(
                            uid,
                            &Obj::new()
                                .raw("distribution", &distribution_json(&f.distribution))
                                .raw("stats", &stats_map_json(&f.stats))
                                .end(),
                        )
                    })
                    .end()
            });
            Rendered {
                merged: None,
                by_index,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_like_meilisearch() {
        assert!(matches("*", "a.b"));
        assert!(matches("cat*", "category"));
        assert!(matches("*gory", "category"));
        assert!(matches("*ego*", "category"));
        assert!(!matches("cat", "category"));
        assert!(!matches("dog", "dog.age"));
    }

    #[test]
    fn merged_counts_add_up_and_sort() {
        let one = |pairs: &[(&str, u64)]| {
            let mut f = IndexFacets::default();
            f.distribution.insert(
                "c".into(),
                pairs.iter().map(|(k, n)| (k.to_string(), *n)).collect(),
            );
            f
        };
        let mut a = ByIndex::default();
        a.0.insert("i".into(), one(&[("b", 1), ("a", 2)]));
        let mut b = ByIndex::default();
        b.0.insert("i".into(), one(&[("c", 5), ("a", 1)]));
        a.append(b);
        let merged = a.merge(Some(2), &BTreeMap::new()).unwrap();
        assert_eq!(
            merged.distribution["c"],
            vec![("a".to_string(), 3), ("b".to_string(), 1)]
        );
    }
}
