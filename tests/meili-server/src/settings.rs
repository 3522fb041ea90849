//! Index settings: defaults, request validation and updates.

use serde_json::{json, Map, Value};

use crate::error::ApiError;
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
        "rankingRules" => json!([
            "words",
            "typo",
            "proximity",
            "attribute",
            "sort",
            "exactness"
        ]),
        "synonyms" | "embedders" => json!({}),
        "distinctAttribute" | "searchCutoffMs" | "localizedAttributes" => Value::Null,
        "proximityPrecision" => json!("byWord"),
        "typoTolerance" => json!({
            "enabled": true,
            "minWordSizeForTypos": {"oneTypo": 5, "twoTypos": 9},
            "disableOnWords": [],
            "disableOnAttributes": []
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

fn type_error(key: &str, at: &str, expected: &str, v: &Value) -> ApiError {
    let place = if at.is_empty() {
        String::new()
    } else {
        format!(" at `{at}`")
    };
    ApiError::new(
        &format!("invalid_settings_{}", snake(key)),
        format!(
            "Invalid value type{place}: expected {expected}, but found {}",
            describe(v)
        ),
    )
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
        (Shape::Object, Value::Object(_)) => true,
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

fn unknown_field(key: &str) -> ApiError {
    let expected: Vec<String> = SETTINGS.iter().map(|(k, _, _)| format!("`{k}`")).collect();
    ApiError::new(
        "bad_request",
        format!(
            "Unknown field `{key}`: expected one of {}",
            expected.join(", ")
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
                for (pk, pv) in patch {
                    if pv.is_null() {
                        match default_value(k).get(pk) {
                            Some(d) => merged.insert(pk.clone(), d.clone()),
                            None => merged.remove(pk),
                        };
                    } else {
                        merged.insert(pk.clone(), pv.clone());
                    }
                }
                Value::Object(merged)
            }
            _ => v.clone(),
        };
        settings.insert(k.clone(), new);
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
