//! A small search engine: prefix word matching over searchable fields (matching strategy
//! `last`, `all` or `frequency`), filters, sort, facets and both pagination modes.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value};

use crate::docs::{select_fields, Doc};
use crate::error::ApiError;
use crate::filter::{self, facet_values, values_at, Filter};
use crate::index::Index;
use crate::json::{array, describe, Obj};
use crate::network::RemoteResult;
use crate::settings::{filterable_patterns, pattern_matches, string_list};

#[derive(Clone, Copy, PartialEq)]
enum Strategy {
    Last,
    All,
    Frequency,
}

pub(crate) struct SearchQuery {
    q: Option<String>,
    offset: usize,
    limit: usize,
    page: Option<usize>,
    hits_per_page: Option<usize>,
    filter: Value,
    sort: Vec<String>,
    retrieve: Option<Vec<String>>,
    facets: Option<Vec<String>>,
    strategy: Strategy,
    show_ranking_score: bool,
    formatted: bool,
}

pub(crate) fn type_error(code: &str, at: &str, expected: &str, v: &Value) -> ApiError {
    ApiError::new(
        code,
        format!(
            "Invalid value type at `{at}`: expected {expected}, but found {}",
            describe(v)
        ),
    )
}

/// Reads a search request body (`at` is the JSON path prefix used in error messages).
pub(crate) fn parse_query(body: &Value, at: &str) -> Result<SearchQuery, ApiError> {
    let empty = Map::new();
    let obj = match body {
        Value::Object(o) => o,
        Value::Null => &empty,
        other => {
            return Err(type_error(
                "bad_request",
                if at.is_empty() { "." } else { at },
                "an object",
                other,
            ))
        }
    };
    let field = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let code = |k: &str| format!("invalid_search_{}", snake(k));
    let usize_of = |k: &str| -> Result<Option<usize>, ApiError> {
        match field(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| type_error(&code(k), &format!("{at}.{k}"), "a positive integer", v)),
        }
    };
    let strings = |k: &str| -> Result<Option<Vec<String>>, ApiError> {
        match field(k) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str().map(String::from).ok_or_else(|| {
                        type_error(&code(k), &format!("{at}.{k}[{i}]"), "a string", v)
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(v) => Err(type_error(&code(k), &format!("{at}.{k}"), "an array", v)),
        }
    };
    let boolean = |k: &str| -> Result<bool, ApiError> {
        match field(k) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(type_error(&code(k), &format!("{at}.{k}"), "a boolean", v)),
        }
    };
    let q = match field("q") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => {
            return Err(type_error(
                "invalid_search_q",
                &format!("{at}.q"),
                "a string",
                v,
            ))
        }
    };
    let strategy = match field("matchingStrategy") {
        None => Strategy::Last,
        Some(Value::String(s)) if s == "last" => Strategy::Last,
        Some(Value::String(s)) if s == "all" => Strategy::All,
        Some(Value::String(s)) if s == "frequency" => Strategy::Frequency,
        Some(v) => {
            return Err(ApiError::new(
                "invalid_search_matching_strategy",
                format!("Unknown value `{}` at `{at}.matchingStrategy`: expected one of `last`, `all`, `frequency`", v.as_str().unwrap_or(&v.to_string())),
            ))
        }
    };
    let highlight = strings("attributesToHighlight")?.is_some_and(|a| !a.is_empty());
    let crop = strings("attributesToCrop")?.is_some_and(|a| !a.is_empty());
    Ok(SearchQuery {
        q,
        offset: usize_of("offset")?.unwrap_or(0),
        limit: usize_of("limit")?.unwrap_or(20),
        page: usize_of("page")?,
        hits_per_page: usize_of("hitsPerPage")?,
        filter: field("filter").cloned().unwrap_or(Value::Null),
        sort: strings("sort")?.unwrap_or_default(),
        retrieve: strings("attributesToRetrieve")?,
        facets: strings("facets")?,
        strategy,
        show_ranking_score: boolean("showRankingScore")?,
        formatted: highlight || crop,
    })
}

/// Turns `GET /search` query parameters into the equivalent JSON body.
pub(crate) fn query_from_params(params: &[(String, String)]) -> Result<Value, ApiError> {
    let mut body = Map::new();
    for (k, v) in params {
        let value = match k.as_str() {
            "offset" | "limit" | "page" | "hitsPerPage" => match v.parse::<u64>() {
                Ok(n) => Value::from(n),
                Err(_) => {
                    return Err(ApiError::new(
                        &format!("invalid_search_{}", snake(k)),
                        format!("Invalid value in parameter `{k}`: could not parse `{v}` as a positive integer"),
                    ))
                }
            },
            "sort" | "attributesToRetrieve" | "facets" | "attributesToHighlight" | "attributesToCrop" => {
                Value::from(v.split(',').map(str::trim).collect::<Vec<_>>())
            }
            "showRankingScore" => Value::Bool(v == "true"),
            _ => Value::from(v.as_str()),
        };
        body.insert(k.clone(), value);
    }
    Ok(Value::Object(body))
}

fn snake(key: &str) -> String {
    let mut out = String::new();
    for c in key.chars() {
        if c.is_ascii_uppercase() {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

fn tokenize(s: &str, out: &mut Vec<String>) {
    out.extend(
        s.split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
            .map(str::to_lowercase),
    );
}

fn collect_words(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => tokenize(s, out),
        Value::Number(n) => tokenize(&n.to_string(), out),
        Value::Array(items) => items.iter().for_each(|i| collect_words(i, out)),
        Value::Object(o) => o.values().for_each(|i| collect_words(i, out)),
        _ => {}
    }
}

/// Number of query words matched (by prefix), counted the way the strategy ranks them.
fn score(doc: &Doc, searchable: &[String], words: &[String], strategy: Strategy) -> usize {
    let mut doc_words = Vec::new();
    for (k, v) in doc {
        if searchable
            .iter()
            .any(|s| s == "*" || pattern_matches(s, k) || pattern_matches(k, s))
        {
            collect_words(v, &mut doc_words);
        }
    }
    let found = |w: &String| doc_words.iter().any(|d| d.starts_with(w.as_str()));
    match strategy {
        Strategy::Frequency => words.iter().filter(|w| found(w)).count(),
        Strategy::Last | Strategy::All => words.iter().take_while(|w| found(w)).count(),
    }
}

/// Sort key of a document for one attribute: numbers first, then strings, missing last.
fn sort_value(doc: &Doc, attr: &str, asc: bool) -> Option<Value> {
    let mut raw = Vec::new();
    values_at(doc, attr, &mut raw);
    let mut facets = Vec::new();
    facet_values(&raw, &mut facets);
    let best = facets
        .into_iter()
        .filter(|v| v.is_number() || v.is_string())
        .reduce(|a, b| {
            let keep_a = (cmp_values(a, b) != Ordering::Greater) == asc;
            if keep_a {
                a
            } else {
                b
            }
        });
    best.cloned()
}

fn cmp_values(a: &Value, b: &Value) -> Ordering {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x
            .as_f64()
            .partial_cmp(&y.as_f64())
            .unwrap_or(Ordering::Equal),
        (Value::Number(_), _) => Ordering::Less,
        (_, Value::Number(_)) => Ordering::Greater,
        (Value::String(x), Value::String(y)) => filter::normalize(x).cmp(&filter::normalize(y)),
        _ => Ordering::Equal,
    }
}

struct Hit {
    score: usize,
    /// Position of the document in the index, to unite the matches of several queries.
    pos: usize,
    doc: Doc,
    sort_keys: Vec<Option<Value>>,
}

/// A search result before rendering, so multi-search can merge hits of several queries.
pub(crate) struct Outcome {
    hits: Vec<(f64, String)>,
    total: usize,
    facets: Option<(String, String)>,
    elapsed_ms: u64,
    /// Positions (in `Index::iter`) of every matching document.
    pub(crate) matched: Vec<usize>,
}

fn index_error(code: &str, uid: &str, message: String) -> ApiError {
    ApiError::new(code, format!("Index `{uid}`: {message}"))
}

/// Runs `q` against `idx`; `window` is `(offset, limit)` of hits to render.
pub(crate) fn execute(
    idx: &Index,
    q: &SearchQuery,
    window: (usize, usize),
) -> Result<Outcome, ApiError> {
    let started = Instant::now();
    let uid = idx.uid.as_str();
    let filterable = filterable_patterns(&idx.settings);
    let filter: Option<Filter> =
        filter::from_json(&q.filter).map_err(|m| ApiError::new("invalid_search_filter", m))?;
    if let Some(f) = &filter {
        f.check_filterable(&filterable)
            .map_err(|m| index_error("invalid_search_filter", uid, m))?;
    }
    let sortable = string_list(&idx.settings, "sortableAttributes");
    let mut sort = Vec::new();
    for s in &q.sort {
        let (attr, asc) = match s.rsplit_once(':') {
            Some((a, "asc")) => (a, true),
            Some((a, "desc")) => (a, false),
            _ => {
                return Err(ApiError::new(
                    "invalid_search_sort",
                    format!("Invalid syntax for the sort parameter: expected expression ending by `:asc` or `:desc`, found `{s}`."),
                ))
            }
        };
        if !sortable.iter().any(|p| pattern_matches(p, attr)) {
            let mut list = sortable.clone();
            list.sort();
            let hint = if list.is_empty() {
                "This index does not have configured sortable attributes.".to_string()
            } else {
                format!("Available sortable attributes are: `{}`.", list.join(", "))
            };
            return Err(index_error(
                "invalid_search_sort",
                uid,
                format!("Attribute `{attr}` is not sortable. {hint}"),
            ));
        }
        sort.push((attr.to_string(), asc));
    }
    let facet_attrs = match &q.facets {
        Some(list) => Some(facet_attributes(list, &filterable, uid)?),
        None => None,
    };

    let mut words = Vec::new();
    tokenize(q.q.as_deref().unwrap_or(""), &mut words);
    let searchable = string_list(&idx.settings, "searchableAttributes");
    let mut hits = Vec::new();
    for (pos, stored) in idx.iter().enumerate() {
        let doc = stored.parse();
        if filter.as_ref().is_some_and(|f| !f.matches(&doc)) {
            continue;
        }
        let score = if words.is_empty() {
            0
        } else {
            score(&doc, &searchable, &words, q.strategy)
        };
        let required = if q.strategy == Strategy::All {
            words.len()
        } else {
            1
        };
        if !words.is_empty() && score < required {
            continue;
        }
        let sort_keys = sort
            .iter()
            .map(|(a, asc)| sort_value(&doc, a, *asc))
            .collect();
        hits.push(Hit {
            score,
            pos,
            doc,
            sort_keys,
        });
    }
    hits.sort_by(|a, b| {
        b.score.cmp(&a.score).then_with(|| {
            for (i, (_, asc)) in sort.iter().enumerate() {
                let ord = match (&a.sort_keys[i], &b.sort_keys[i]) {
                    (Some(x), Some(y)) if *asc => cmp_values(x, y),
                    (Some(x), Some(y)) => cmp_values(y, x),
                    (Some(_), None) => Ordering::Less,
                    (None, Some(_)) => Ordering::Greater,
                    (None, None) => Ordering::Equal,
                };
                if ord != Ordering::Equal {
                    return ord;
                }
            }
            Ordering::Equal
        })
    });

    let facets = facet_attrs.map(|attrs| {
        let docs: Vec<&Doc> = hits.iter().map(|h| &h.doc).collect();
        facet_distribution(&count_facets(idx, &attrs, &docs))
    });
    let mut matched: Vec<usize> = hits.iter().map(|h| h.pos).collect();
    matched.sort_unstable();
    let max_total = idx.settings["pagination"]["maxTotalHits"]
        .as_u64()
        .unwrap_or(1000) as usize;
    let (offset, limit) = window;
    let end = offset.saturating_add(limit).min(max_total).min(hits.len());
    let displayed = string_list(&idx.settings, "displayedAttributes");
    let rendered = hits
        .get(offset..end)
        .unwrap_or(&[])
        .iter()
        .map(|h| {
            let ranking = if words.is_empty() {
                1.0
            } else {
                h.score as f64 / words.len() as f64
            };
            (ranking, render_hit(&h.doc, &displayed, q, ranking))
        })
        .collect();
    Ok(Outcome {
        hits: rendered,
        total: hits.len(),
        facets,
        elapsed_ms: started.elapsed().as_millis() as u64,
        matched,
    })
}

fn facet_attributes(
    list: &[String],
    filterable: &[String],
    uid: &str,
) -> Result<Vec<String>, ApiError> {
    if list.iter().any(|f| f == "*") {
        return Ok(filterable.to_vec());
    }
    let bad: Vec<&String> = list
        .iter()
        .filter(|f| !filterable.iter().any(|p| pattern_matches(p, f)))
        .collect();
    if bad.is_empty() {
        return Ok(list.to_vec());
    }
    let mut patterns = filterable.to_vec();
    patterns.sort();
    let hint = if patterns.is_empty() {
        "This index does not have configured filterable attributes.".to_string()
    } else {
        format!(
            "Available filterable attributes patterns are: `{}`.",
            patterns.join(", ")
        )
    };
    let names: Vec<&str> = bad.iter().map(|s| s.as_str()).collect();
    let message = if names.len() == 1 {
        format!(
            "Invalid facet distribution: Attribute `{}` is not filterable. {hint}",
            names[0]
        )
    } else {
        format!(
            "Invalid facet distribution: Attributes `{}` are not filterable. {hint}",
            names.join(", ")
        )
    };
    Err(index_error("invalid_search_facets", uid, message))
}

/// Above this many matching documents Meilisearch 1.50 reads a facet distribution from its facet
/// levels, numbers in numeric order; up to it from the documents, numbers in the order of their
/// text (seen with 3,000 and 3,001 matches: `0.5, 1, 10.5` against `0.5, 1, 2.5`).
const FACET_LEVELS_ABOVE: usize = 3000;

/// Values and counts of one facet, in the order they are answered.
pub(crate) type Counts = Vec<(String, u64)>;

/// A facet's name, counts and `(min, max)` when numbers were seen.
pub(crate) type FacetCounts = (String, Counts, Option<(f64, f64)>);

/// Distribution and stats (`min`, `max` when numbers were seen) of each of `attrs` over `docs`.
/// As in Meilisearch, the numbers come first, written as Rust writes an `f64` (`199`, not
/// `199.0`), then the strings (booleans are the strings `true` and `false`), at most
/// `maxValuesPerFacet` in all.
pub(crate) fn count_facets(idx: &Index, attrs: &[String], docs: &[&Doc]) -> Vec<FacetCounts> {
    let max_values = idx.settings["faceting"]["maxValuesPerFacet"]
        .as_u64()
        .unwrap_or(100) as usize;
    let mut out = Vec::new();
    for attr in attrs {
        let mut numbers: BTreeMap<String, (f64, u64)> = BTreeMap::new();
        let mut strings: BTreeMap<String, u64> = BTreeMap::new();
        let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
        for doc in docs {
            let mut raw = Vec::new();
            values_at(doc, attr, &mut raw);
            let mut values = Vec::new();
            facet_values(&raw, &mut values);
            // One count per document and value: `10` and `10.0` are the same number.
            let mut seen = BTreeSet::new();
            for v in values {
                match v {
                    Value::Number(n) => {
                        let f = n.as_f64().unwrap_or(0.0);
                        let key = f.to_string();
                        if seen.insert((0, key.clone())) {
                            (min, max) = (min.min(f), max.max(f));
                            numbers.entry(key).or_insert((f, 0)).1 += 1;
                        }
                    }
                    other => {
                        let key = other
                            .as_str()
                            .map_or_else(|| other.to_string(), String::from);
                        if seen.insert((1, key.clone())) {
                            *strings.entry(key).or_insert(0) += 1;
                        }
                    }
                }
            }
        }
        let mut numbers: Vec<(String, (f64, u64))> = numbers.into_iter().collect();
        if docs.len() > FACET_LEVELS_ABOVE {
            numbers.sort_by(|a, b| a.1 .0.total_cmp(&b.1 .0));
        }
        let counts = numbers
            .into_iter()
            .map(|(k, (_, n))| (k, n))
            .chain(strings)
            .take(max_values)
            .collect();
        out.push((attr.clone(), counts, (min <= max).then_some((min, max))));
    }
    out
}

/// One facet's counts as a JSON object.
pub(crate) fn counts_json(counts: &[(String, u64)]) -> String {
    counts
        .iter()
        .fold(Obj::new(), |o, (k, n)| o.num(k, *n))
        .end()
}

/// `{"min": .., "max": ..}` as Meilisearch writes its `f64`s (`1.0`).
pub(crate) fn stats_json((min, max): (f64, f64)) -> String {
    Obj::new()
        .val("min", &Value::from(min))
        .val("max", &Value::from(max))
        .end()
}

/// `facetDistribution` and `facetStats` of a search, facets in the order asked.
fn facet_distribution(facets: &[FacetCounts]) -> (String, String) {
    let (mut distribution, mut stats) = (Obj::new(), Obj::new());
    for (attr, counts, range) in facets {
        distribution = distribution.raw(attr, &counts_json(counts));
        if let Some(range) = range {
            stats = stats.raw(attr, &stats_json(*range));
        }
    }
    (distribution.end(), stats.end())
}

fn render_hit(doc: &Doc, displayed: &[String], q: &SearchQuery, ranking: f64) -> String {
    let shown = select_fields(doc, displayed);
    let selected = match &q.retrieve {
        Some(fields) => select_fields(&shown, fields),
        None => shown,
    };
    let mut out = Value::Object(selected.clone()).to_string();
    let mut extra = Vec::new();
    if q.formatted {
        extra.push(format!("\"_formatted\":{}", Value::Object(selected)));
    }
    if q.show_ranking_score {
        extra.push(format!("\"_rankingScore\":{}", Value::from(ranking)));
    }
    if !extra.is_empty() {
        out.pop();
        if out.len() > 1 {
            out.push(',');
        }
        out.push_str(&extra.join(","));
        out.push('}');
    }
    out
}

/// A UUID v7 string, like the `requestUid` of real responses.
pub(crate) fn request_uid() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let mut x = (now.as_nanos() as u64)
        ^ COUNTER
            .fetch_add(1, AtomicOrdering::Relaxed)
            .rotate_left(40);
    let mut next = || {
        // splitmix64
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let ms = now.as_millis() as u64 & 0xFFFF_FFFF_FFFF;
    let (a, b) = (next(), next());
    format!(
        "{:08x}-{:04x}-7{:03x}-{:04x}-{:012x}",
        ms >> 16,
        ms & 0xFFFF,
        a & 0xFFF,
        0x8000 | (b >> 48) & 0x3FFF,
        b & 0xFFFF_FFFF_FFFF
    )
}

/// The body of a single-index search, appended to `start` (multi-search puts `indexUid` first).
pub(crate) fn response(
    start: Obj,
    idx: &Index,
    q: &SearchQuery,
    request_uid: &str,
) -> Result<Obj, ApiError> {
    let paged = q.page.is_some() || q.hits_per_page.is_some();
    let (page, per_page) = (q.page.unwrap_or(1), q.hits_per_page.unwrap_or(20));
    let window = if paged {
        (
            page.saturating_sub(1).saturating_mul(per_page),
            if page == 0 { 0 } else { per_page },
        )
    } else {
        (q.offset, q.limit)
    };
    let outcome = execute(idx, q, window)?;
    let max_total = idx.settings["pagination"]["maxTotalHits"]
        .as_u64()
        .unwrap_or(1000) as usize;
    let mut obj = start
        .raw("hits", &array(outcome.hits.into_iter().map(|(_, h)| h)))
        .str("query", q.q.as_deref().unwrap_or(""))
        .num("processingTimeMs", outcome.elapsed_ms);
    if paged {
        let total_hits = outcome.total.min(max_total);
        let pages = if per_page == 0 {
            0
        } else {
            total_hits.div_ceil(per_page)
        };
        obj = obj
            .num("hitsPerPage", per_page as u64)
            .num("page", page as u64)
            .num("totalPages", pages as u64)
            .num("totalHits", total_hits as u64);
    } else {
        obj = obj
            .num("limit", q.limit as u64)
            .num("offset", q.offset as u64)
            .num("estimatedTotalHits", outcome.total as u64);
    }
    if let Some((distribution, stats)) = outcome.facets {
        obj = obj
            .raw("facetDistribution", &distribution)
            .raw("facetStats", &stats);
    }
    Ok(obj.str("requestUid", request_uid))
}

/// What the remotes of a federated search answered.
pub(crate) struct Remotes {
    /// This server's name in the network: the `_federation.remote` of its own hits.
    pub(crate) local_name: Option<String>,
    pub(crate) results: Vec<RemoteResult>,
    pub(crate) errors: BTreeMap<String, ApiError>,
}

/// Federated multi-search: hits of every query, local or remote, merged by weighted ranking
/// score (ties by query position), then paged. With `remotes`, local hits name this server in
/// `_federation.remote` and `remoteErrors` is answered; `proxy` adds what a calling server
/// needs (`weightedScoreValues`).
pub(crate) fn federated(
    parts: Vec<(String, usize, f64, Result<Outcome, ApiError>)>,
    remotes: Option<Remotes>,
    proxy: bool,
    offset: usize,
    limit: usize,
    facets: crate::facets::Rendered,
    request_uid: &str,
) -> Result<String, ApiError> {
    // (score, query position, members of the hit, `_federation`)
    let mut merged: Vec<(f64, usize, String, String)> = Vec::new();
    let (mut total, mut elapsed) = (0u64, 0);
    for (uid, position, weight, outcome) in parts {
        let outcome = outcome?;
        total += outcome.total as u64;
        elapsed += outcome.elapsed_ms;
        for (score, hit) in outcome.hits {
            let score = score * weight;
            let mut federation = Obj::new()
                .str("indexUid", &uid)
                .num("queriesPosition", position as u64)
                .val("weightedRankingScore", &Value::from(score));
            if let Some(r) = &remotes {
                federation = federation.opt_str("remote", r.local_name.as_deref());
            }
            if proxy {
                federation = federation
                    .raw(
                        "weightedScoreValues",
                        &format!("[{{\"weightedScore\":{}}}]", Value::from(score)),
                    )
                    .raw("extra_document", "{}");
            }
            let members = hit[1..hit.len() - 1].to_string();
            merged.push((score, position, members, federation.end()));
        }
    }
    let mut remote_errors = None;
    if let Some(r) = remotes {
        let mut errors = Obj::new();
        for (name, e) in &r.errors {
            errors = errors.raw(name, &e.to_json());
        }
        remote_errors = Some(errors.end());
        for result in r.results {
            total += result.total;
            elapsed = elapsed.max(result.elapsed_ms);
            for h in result.hits {
                merged.push((h.score, h.position, h.members, h.federation));
            }
        }
    }
    merged.sort_by(|a, b| {
        b.0.partial_cmp(&a.0)
            .unwrap_or(Ordering::Equal)
            .then(a.1.cmp(&b.1))
    });
    let hits = merged
        .into_iter()
        .skip(offset)
        .take(limit)
        .map(|(_, _, members, federation)| {
            let comma = if members.is_empty() { "" } else { "," };
            format!("{{{members}{comma}\"_federation\":{federation}}}")
        });
    let mut out = Obj::new()
        .raw("hits", &array(hits))
        .num("processingTimeMs", elapsed)
        .num("limit", limit as u64)
        .num("offset", offset as u64)
        .num("estimatedTotalHits", total);
    if let Some((distribution, stats)) = facets.merged {
        out = out
            .raw("facetDistribution", &distribution)
            .raw("facetStats", &stats);
    }
    if let Some(by_index) = facets.by_index {
        out = out.raw("facetsByIndex", &by_index);
    }
    out = out.str("requestUid", request_uid);
    if let Some(errors) = remote_errors {
        out = out.raw("remoteErrors", &errors);
    }
    Ok(out.end())
}

/// Runs one query of a federated search: every hit up to `maxTotalHits`.
pub(crate) fn execute_all(idx: &Index, q: &SearchQuery) -> Result<Outcome, ApiError> {
    let max_total = idx.settings["pagination"]["maxTotalHits"]
        .as_u64()
        .unwrap_or(1000) as usize;
    execute(idx, q, (0, max_total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_uid_looks_like_uuid_v7() {
        let uid = request_uid();
        assert_eq!(uid.len(), 36);
        assert_eq!(&uid[14..15], "7");
        assert_ne!(uid, request_uid());
    }

    #[test]
    fn query_type_errors() {
        let err = parse_query(&serde_json::json!({"limit": "2"}), "").err();
        assert_eq!(
            err.map(|e| e.code),
            Some("invalid_search_limit".to_string())
        );
        let err = parse_query(&serde_json::json!({"limit": -1}), ".queries[0]").err();
        assert!(err.is_some_and(|e| e
            .message
            .starts_with("Invalid value type at `.queries[0].limit`")));
    }
}
