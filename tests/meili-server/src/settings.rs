//! Index settings: defaults, request validation and updates.

use serde_json::{json, Map, Value};

use crate::error::{did_you_mean, ApiError};
use crate::json::{describe, Obj};

/// What a setting's value must look like.
#[derive(Clone, Copy)]
enum Shape {
    Strings,
    /// Filterable attributes: strings or `{attributePatterns, features}` objects.
    Rules,
    Object,
    OptString,
    Str,
    OptInt,
    OptArray,
    Bool,
}

/// Settings in the order the real server returns them, with their route name.
const SETTINGS: &[(&str, &str, Shape)] = &[
    (
        "displayedAttributes",
        "displayed-attributes",
        Shape::Strings,
    ),
    (
        "searchableAttributes",
        "searchable-attributes",
        Shape::Strings,
    ),
    (
        "filterableAttributes",
        "filterable-attributes",
        Shape::Rules,
    ),
    ("sortableAttributes", "sortable-attributes", Shape::Strings),
    ("rankingRules", "ranking-rules", Shape::Strings),
    ("stopWords", "stop-words", Shape::Strings),
    ("nonSeparatorTokens", "non-separator-tokens", Shape::Strings),
    ("separatorTokens", "separator-tokens", Shape::Strings),
    ("dictionary", "dictionary", Shape::Strings),
    ("synonyms", "synonyms", Shape::Object),
    ("distinctAttribute", "distinct-attribute", Shape::OptString),
    ("proximityPrecision", "proximity-precision", Shape::Str),
    ("typoTolerance", "typo-tolerance", Shape::Object),
    ("faceting", "faceting", Shape::Object),
    ("pagination", "pagination", Shape::Object),
    ("embedders", "embedders", Shape::Object),
    ("searchCutoffMs", "search-cutoff-ms", Shape::OptInt),
    (
        "localizedAttributes",
        "localized-attributes",
        Shape::OptArray,
    ),
    ("facetSearch", "facet-search", Shape::Bool),
    ("prefixSearch", "prefix-search", Shape::Str),
];

/// Nested settings that a PATCH merges field by field instead of replacing.
const MERGED: &[&str] = &["typoTolerance", "faceting", "pagination", "embedders"];

pub(crate) fn default_value(key: &str) -> Value {
    match key {
        "displayedAttributes" | "searchableAttributes" => json!(["*"]),
        // As a fresh Meilisearch 1.50 index shows them (`GET /indexes/cm/settings`).
        "rankingRules" => json!([
            "words",
            "typo",
            "proximity",
            "attributeRank",
            "sort",
            "wordPosition",
            "exactness"
        ]),
        "synonyms" | "embedders" => json!({}),
        "distinctAttribute" | "searchCutoffMs" | "localizedAttributes" => Value::Null,
        "proximityPrecision" => json!("byWord"),
        "typoTolerance" => json!({
            "enabled": true,
            "minWordSizeForTypos": {"oneTypo": 5, "twoTypos": 9},
            "disableOnWords": [],
            "disableOnAttributes": [],
            "disableOnNumbers": false
        }),
        "faceting" => json!({"maxValuesPerFacet": 100, "sortFacetValuesBy": {"*": "alpha"}}),
        "pagination" => json!({"maxTotalHits": 1000}),
        "facetSearch" => json!(true),
        "prefixSearch" => json!("indexingTime"),
        _ => json!([]),
    }
}

pub(crate) fn defaults() -> Map<String, Value> {
    SETTINGS
        .iter()
        .map(|(k, _, _)| (k.to_string(), default_value(k)))
        .collect()
}

/// The full settings object in the real server's key order.
pub(crate) fn to_json(settings: &Map<String, Value>) -> String {
    SETTINGS
        .iter()
        .fold(Obj::new(), |o, (k, _, _)| {
            let default = default_value(k);
            o.val(k, settings.get(*k).unwrap_or(&default))
        })
        .end()
}

/// Where a setting comes in the settings object.
pub(crate) fn position(key: &str) -> Option<usize> {
    SETTINGS.iter().position(|(k, _, _)| *k == key)
}

/// The camelCase key and whether the route updates with PATCH, for a sub-route name.
pub(crate) fn route_key(route: &str) -> Option<(&'static str, bool)> {
    SETTINGS
        .iter()
        .find(|(_, r, _)| *r == route)
        .map(|(k, _, _)| (*k, MERGED.contains(k)))
}

fn snake(key: &str) -> String {
    key.chars()
        .flat_map(|c| {
            if c.is_ascii_uppercase() {
                vec!['_', c.to_ascii_lowercase()]
            } else {
                vec![c]
            }
        })
        .collect()
}

fn code(key: &str) -> String {
    format!("invalid_settings_{}", snake(key))
}

/// ` at `{at}`` (nothing at the root of a body).
fn place(at: &str) -> String {
    if at.is_empty() {
        String::new()
    } else {
        format!(" at `{at}`")
    }
}

fn type_error(key: &str, at: &str, expected: &str, v: &Value) -> ApiError {
    ApiError::new(
        &code(key),
        format!(
            "Invalid value type{}: expected {expected}, but found {}",
            place(at),
            describe(v)
        ),
    )
}

/// A well-typed value deserr refuses (`Invalid value at ...`).
fn value_error(key: &str, at: &str, message: &str) -> ApiError {
    ApiError::new(&code(key), format!("Invalid value{}: {message}", place(at)))
}

/// A field a nested setting does not have; `at` is the object's path.
fn unknown_nested(key: &str, field: &str, at: &str, expected: &[&str]) -> ApiError {
    let inside = if at.is_empty() {
        String::new()
    } else {
        format!(" inside `{at}`")
    };
    ApiError::new(
        &code(key),
        format!(
            "Unknown field `{field}`{inside}: {}expected one of {}",
            did_you_mean(field, expected),
            quoted(expected)
        ),
    )
}

fn quoted(items: &[&str]) -> String {
    let list: Vec<String> = items.iter().map(|k| format!("`{k}`")).collect();
    list.join(", ")
}

/// Fields of the nested settings, in the order Meilisearch lists them.
const TYPO_FIELDS: &[&str] = &[
    "enabled",
    "minWordSizeForTypos",
    "disableOnWords",
    "disableOnAttributes",
    "disableOnNumbers",
];
const TYPO_SIZE_FIELDS: &[&str] = &["oneTypo", "twoTypos"];
const FACETING_FIELDS: &[&str] = &["maxValuesPerFacet", "sortFacetValuesBy"];
const PAGINATION_FIELDS: &[&str] = &["maxTotalHits"];

/// Checks `typoTolerance`, `faceting` and `pagination` field by field, in order, the first
/// error winning, with Meilisearch 1.50's messages (observed with `PATCH
/// /indexes/cm/settings`, all `invalid_settings_*` 400s: `{"typoTolerance":{"enabled":"yes"}}`
/// "Invalid value type at `.typoTolerance.enabled`: expected a boolean, but found a string:
/// `\"yes\"`"; `{"typoTolerance":{"enable":true}}` "Unknown field `enable` inside
/// `.typoTolerance`: did you mean `enabled`? expected one of `enabled`, `minWordSizeForTypos`,
/// `disableOnWords`, `disableOnAttributes`, `disableOnNumbers`"; `oneTypo` 300 "Invalid value at
/// `.typoTolerance.minWordSizeForTypos.oneTypo`: value: `300` is too large to be deserialized,
/// maximum value authorized is `255`"; `{"faceting":{"sortFacetValuesBy":{"*":"asc"}}}`
/// "Unknown value `asc` at `.faceting.sortFacetValuesBy.*`: expected one of `alpha`, `count`";
/// `{"pagination":{"maxTotalHits":0}}` "Invalid value at `.pagination.maxTotalHits`: a non-zero
/// integer value lower than `18446744073709551615` was expected, but found a zero"). Nulls reset
/// a field and pass.
fn validate_nested(key: &str, map: &Map<String, Value>, at: &str) -> Result<(), ApiError> {
    let boolean = |v: &Value, here: &str| match v {
        Value::Null | Value::Bool(_) => Ok(()),
        _ => Err(type_error(key, here, "a boolean", v)),
    };
    let strings = |v: &Value, here: &str| match v {
        Value::Null => Ok(()),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find(|(_, item)| !item.is_string())
            .map_or(Ok(()), |(i, item)| {
                Err(type_error(key, &format!("{here}[{i}]"), "a string", item))
            }),
        _ => Err(type_error(key, here, "an array", v)),
    };
    let positive = |v: &Value, here: &str| match v {
        Value::Null => Ok(None),
        Value::Number(n) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| type_error(key, here, "a positive integer", v)),
        _ => Err(type_error(key, here, "a positive integer", v)),
    };
    let fields = match key {
        "typoTolerance" => TYPO_FIELDS,
        "faceting" => FACETING_FIELDS,
        _ => PAGINATION_FIELDS,
    };
    for (field, v) in map {
        let here = format!("{at}.{field}");
        match (key, field.as_str()) {
            ("typoTolerance", "enabled" | "disableOnNumbers") => boolean(v, &here)?,
            ("typoTolerance", "disableOnWords" | "disableOnAttributes") => strings(v, &here)?,
            ("typoTolerance", "minWordSizeForTypos") => match v {
                Value::Null => {}
                Value::Object(sizes) => {
                    let mut found = [None, None];
                    for (size, v) in sizes {
                        let slot = TYPO_SIZE_FIELDS.iter().position(|f| f == size);
                        let Some(slot) = slot else {
                            return Err(unknown_nested(key, size, &here, TYPO_SIZE_FIELDS));
                        };
                        let there = format!("{here}.{size}");
                        match positive(v, &there)? {
                            Some(n) if n > 255 => {
                                let message = format!("value: `{n}` is too large to be deserialized, maximum value authorized is `255`");
                                return Err(value_error(key, &there, &message));
                            }
                            n => found[slot] = n,
                        }
                    }
                    if let [Some(one), Some(two)] = found {
                        if one > two {
                            return Err(value_error(key, &here, &typo_sizes_message(one, two)));
                        }
                    }
                }
                _ => return Err(type_error(key, &here, "an object", v)),
            },
            ("faceting", "maxValuesPerFacet") => {
                positive(v, &here)?;
            }
            ("faceting", "sortFacetValuesBy") => match v {
                Value::Null => {}
                Value::Object(orders) => {
                    for (name, order) in orders {
                        let there = format!("{here}.{name}");
                        match order.as_str() {
                            Some("alpha" | "count") => {}
                            Some(other) => {
                                let accepted = ["alpha", "count"];
                                return Err(ApiError::new(
                                    &code(key),
                                    format!(
                                        "Unknown value `{other}` at `{there}`: {}expected one of {}",
                                        did_you_mean(other, &accepted),
                                        quoted(&accepted)
                                    ),
                                ));
                            }
                            None => return Err(type_error(key, &there, "a string", order)),
                        }
                    }
                }
                _ => return Err(type_error(key, &here, "an object", v)),
            },
            ("pagination", "maxTotalHits") => {
                if positive(v, &here)? == Some(0) {
                    let message = "a non-zero integer value lower than `18446744073709551615` was expected, but found a zero";
                    return Err(value_error(key, &here, message));
                }
            }
            _ => return Err(unknown_nested(key, field, at, fields)),
        }
    }
    Ok(())
}

fn typo_sizes_message(one: u64, two: u64) -> String {
    format!("`minWordSizeForTypos` setting is invalid. `oneTypo` and `twoTypos` fields should be between `0` and `255`, and `twoTypos` should be greater or equals to `oneTypo` but found `oneTypo: {one}` and twoTypos: {two}`.")
}

/// Checks settings once merged, as Meilisearch does when it applies them: `oneTypo` above
/// `twoTypos` fails the task (observed: `{"typoTolerance":{"minWordSizeForTypos":{"oneTypo":10}}}`
/// over the default `twoTypos` 9 is accepted, then the task fails with "Index `cm`:
/// `minWordSizeForTypos` setting is invalid. ... but found `oneTypo: 10` and twoTypos: 9`.").
pub(crate) fn check_merged(settings: &Map<String, Value>) -> Result<(), ApiError> {
    let sizes = settings
        .get("typoTolerance")
        .and_then(|t| t.get("minWordSizeForTypos"));
    let size = |name: &str| sizes.and_then(|s| s.get(name)).and_then(Value::as_u64);
    match (size("oneTypo"), size("twoTypos")) {
        (Some(one), Some(two)) if one > two => Err(ApiError::new(
            &code("typoTolerance"),
            typo_sizes_message(one, two),
        )),
        _ => Ok(()),
    }
}

/// Validates one setting value (`null` always means reset).
pub(crate) fn validate(key: &str, v: &Value, at: &str) -> Result<(), ApiError> {
    let Some((_, _, shape)) = SETTINGS.iter().find(|(k, _, _)| *k == key) else {
        return Err(unknown_field(key));
    };
    let ok = match (shape, v) {
        (_, Value::Null) => true,
        (Shape::Strings | Shape::Rules, Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let fine = item.is_string() || (matches!(shape, Shape::Rules) && item.is_object());
                if !fine {
                    return Err(type_error(key, &format!("{at}[{i}]"), "a string", item));
                }
            }
            true
        }
        (Shape::Object, Value::Object(map)) => {
            if matches!(key, "typoTolerance" | "faceting" | "pagination") {
                validate_nested(key, map, at)?;
            }
            true
        }
        (Shape::OptString | Shape::Str, Value::String(_)) => true,
        (Shape::OptInt, Value::Number(n)) => n.is_u64(),
        (Shape::OptArray, Value::Array(_)) => true,
        (Shape::Bool, Value::Bool(_)) => true,
        _ => false,
    };
    if ok {
        return Ok(());
    }
    let expected = match shape {
        Shape::Strings | Shape::Rules | Shape::OptArray => "an array",
        Shape::Object => "an object",
        Shape::OptString | Shape::Str => "a string",
        Shape::OptInt => "a positive integer",
        Shape::Bool => "a boolean",
    };
    Err(type_error(key, at, expected, v))
}

/// Every top-level field of Meilisearch 1.50's settings, as its error lists them (observed:
/// `PATCH /indexes/cm/settings` with `{"filterableAtributes":[]}` gives "Unknown field
/// `filterableAtributes`: did you mean `filterableAttributes`? expected one of ..."); this
/// server does not support `foreignKeys` and `chat`.
const ALL_FIELDS: &[&str] = &[
    "displayedAttributes",
    "searchableAttributes",
    "filterableAttributes",
    "sortableAttributes",
    "foreignKeys",
    "rankingRules",
    "stopWords",
    "nonSeparatorTokens",
    "separatorTokens",
    "dictionary",
    "synonyms",
    "distinctAttribute",
    "proximityPrecision",
    "typoTolerance",
    "faceting",
    "pagination",
    "embedders",
    "searchCutoffMs",
    "localizedAttributes",
    "facetSearch",
    "prefixSearch",
    "chat",
];

fn unknown_field(key: &str) -> ApiError {
    ApiError::new(
        "bad_request",
        format!(
            "Unknown field `{key}`: {}expected one of {}",
            did_you_mean(key, ALL_FIELDS),
            quoted(ALL_FIELDS)
        ),
    )
}

/// Validates a `PATCH /settings` body; returns the provided settings in order.
pub(crate) fn validate_patch(body: &Value) -> Result<Vec<(String, Value)>, ApiError> {
    let Value::Object(map) = body else {
        return Err(ApiError::new(
            "bad_request",
            format!(
                "Invalid value type: expected an object, but found {}",
                describe(body)
            ),
        ));
    };
    let mut out = Vec::new();
    for (k, v) in map {
        validate(k, v, &format!(".{k}"))?;
        out.push((k.clone(), v.clone()));
    }
    // Report details in the same order the settings object uses.
    out.sort_by_key(|(k, _)| SETTINGS.iter().position(|(s, _, _)| s == k));
    Ok(out)
}

/// Every setting set to null, i.e. reset (`DELETE /settings`).
pub(crate) fn reset_all() -> Vec<(String, Value)> {
    SETTINGS
        .iter()
        .map(|(k, _, _)| (k.to_string(), Value::Null))
        .collect()
}

/// Applies validated changes: null resets, nested objects merge, the rest replaces.
pub(crate) fn apply(settings: &mut Map<String, Value>, changes: &[(String, Value)]) {
    for (k, v) in changes {
        let new = match (v, settings.get(k)) {
            (Value::Null, _) => default_value(k),
            (Value::Object(patch), Some(Value::Object(current)))
                if MERGED.contains(&k.as_str()) =>
            {
                let mut merged = current.clone();
                merge(&mut merged, patch, &default_value(k));
                Value::Object(merged)
            }
            _ => v.clone(),
        };
        settings.insert(k.clone(), new);
    }
}

/// Merges a nested setting field by field; null resets a field. `minWordSizeForTypos` merges
/// too (observed: `{"minWordSizeForTypos":{"oneTypo":3}}` over `twoTypos` 12 keeps 12).
fn merge(current: &mut Map<String, Value>, patch: &Map<String, Value>, defaults: &Value) {
    for (k, v) in patch {
        let default = defaults.get(k);
        match (v, current.get_mut(k)) {
            (Value::Null, _) => match default {
                Some(d) => {
                    current.insert(k.clone(), d.clone());
                }
                None => {
                    current.remove(k);
                }
            },
            (Value::Object(inner), Some(Value::Object(existing))) if k == "minWordSizeForTypos" => {
                merge(existing, inner, default.unwrap_or(&Value::Null));
            }
            _ => {
                current.insert(k.clone(), v.clone());
            }
        }
    }
}

/// Attribute patterns of `filterableAttributes` that allow filtering.
pub(crate) fn filterable_patterns(settings: &Map<String, Value>) -> Vec<String> {
    let mut out = Vec::new();
    for rule in settings
        .get("filterableAttributes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        match rule {
            Value::String(s) => out.push(s.clone()),
            Value::Object(o) => {
                let filter = o.get("features").and_then(|f| f.get("filter"));
                let disabled = filter.is_some_and(|f| {
                    f.get("equality") == Some(&Value::Bool(false))
                        && f.get("comparison") != Some(&Value::Bool(true))
                });
                if !disabled {
                    let patterns = o.get("attributePatterns").and_then(Value::as_array);
                    out.extend(
                        patterns
                            .into_iter()
                            .flatten()
                            .filter_map(Value::as_str)
                            .map(String::from),
                    );
                }
            }
            _ => {}
        }
    }
    out
}

/// Whether the geo feature is on: `_geo` is sortable, or filterable as the plain string rule
/// (milli's `Index::is_geo_enabled`; a `{attributePatterns: ["_geo"]}` rule does not count).
/// Only then does Meilisearch check documents' `_geo` fields.
pub(crate) fn geo_enabled(settings: &Map<String, Value>) -> bool {
    let has_geo = |key: &str| {
        settings
            .get(key)
            .and_then(Value::as_array)
            .is_some_and(|rules| rules.iter().any(|r| r.as_str() == Some("_geo")))
    };
    has_geo("sortableAttributes") || has_geo("filterableAttributes")
}

pub(crate) fn string_list(settings: &Map<String, Value>, key: &str) -> Vec<String> {
    settings
        .get(key)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(String::from)
        .collect()
}

/// Whether `attr` is covered by a pattern: equal, a parent object, or a `*` glob.
pub(crate) fn pattern_matches(pattern: &str, attr: &str) -> bool {
    if pattern == attr
        || attr
            .strip_prefix(pattern)
            .is_some_and(|r| r.starts_with('.'))
    {
        return true;
    }
    match pattern.split_once('*') {
        Some((prefix, suffix)) => {
            attr.len() >= prefix.len() + suffix.len()
                && attr.starts_with(prefix)
                && attr.ends_with(suffix)
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_merges_nested_settings() {
        let mut s = defaults();
        apply(&mut s, &[("pagination".into(), json!({"maxTotalHits": 5}))]);
        apply(&mut s, &[("filterableAttributes".into(), json!(["a"]))]);
        assert_eq!(s["pagination"], json!({"maxTotalHits": 5}));
        apply(
            &mut s,
            &[("typoTolerance".into(), json!({"enabled": false}))],
        );
        assert_eq!(
            s["typoTolerance"]["minWordSizeForTypos"]["oneTypo"],
            json!(5)
        );
        apply(&mut s, &[("filterableAttributes".into(), Value::Null)]);
        assert_eq!(s["filterableAttributes"], json!([]));
    }

    #[test]
    fn validation_errors() {
        let err =
            validate("filterableAttributes", &json!("x"), ".filterableAttributes").unwrap_err();
        assert_eq!(err.code, "invalid_settings_filterable_attributes");
        assert!(validate_patch(&json!({"foo": 1})).is_err());
        assert!(validate_patch(&json!({"searchCutoffMs": 10, "distinctAttribute": null})).is_ok());
    }

    #[test]
    fn patterns() {
        assert!(pattern_matches("meta", "meta.color"));
        assert!(pattern_matches("meta.*", "meta.color"));
        assert!(pattern_matches("*", "anything"));
        assert!(!pattern_matches("meta", "metadata"));
    }
}
