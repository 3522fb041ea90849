//! Request bodies for a task whose index is spread over shards: the `/network` that lets one
//! server search the others, and the `/multi-search` that asks every shard at once. Pure JSON:
//! the extension sends them with the client.
//!
//! Written against Meilisearch 1.50: `PATCH /network` takes `self` and `remotes` (each with `url`,
//! `searchApiKey`, `writeApiKey`) in the community edition, and refuses `leader` there; a network
//! with a `leader` is the enterprise edition's own sharding, which does the spreading itself.

use serde_json::{json, Map, Value};

use super::search::InvalidSearch;

/// The `PATCH /network` body naming this server `self_name` and the servers it may search:
/// `(name, url, search key)`. A `null` key clears one set before. `writeApiKey` is left out (so
/// left as it is): only a leader forwards writes, and we write to each shard ourselves.
pub fn network_body(self_name: &str, remotes: &[(&str, &str, Option<&str>)]) -> Value {
    let remotes: Map<String, Value> = remotes
        .iter()
        .map(|(name, url, key)| ((*name).to_owned(), json!({"url": url, "searchApiKey": key})))
        .collect();
    json!({"self": self_name, "remotes": remotes})
}

/// Search parameters a federated query refuses that have a place in `federation` instead, under
/// the same name. (Meilisearch refuses pagination, `showPerformanceDetails` and `personalize` in a
/// query of a federated search; `distinct` there would only dedupe within one shard.)
const MOVED_TO_FEDERATION: [&str; 7] = [
    "limit",
    "offset",
    "page",
    "hitsPerPage",
    "showPerformanceDetails",
    "personalize",
    "distinct",
];

/// Keys of a multi-search request or query that the caller's single-index body must not hold:
/// we write them.
const OURS: [&str; 4] = ["indexUid", "federationOptions", "federation", "queries"];

/// The `POST /multi-search` body that runs the single-index search `body` (the parameters of
/// `POST /indexes/{uid}/search`) on index `index_uid` of every server in `remotes`, merged into one
/// result. Errors say which parameter cannot be spread over shards.
pub fn federated_search_body(
    index_uid: &str,
    body: &Value,
    remotes: &[&str],
) -> Result<Value, InvalidSearch> {
    let refused = |why: &str| Err(InvalidSearch(why.to_owned()));
    let Value::Object(params) = body else {
        return refused("a search body must be a JSON object");
    };
    if remotes.is_empty() {
        return refused("a search over shards needs at least one shard");
    }
    let mut query = Map::new();
    let mut federation = Map::new();
    for (name, value) in params {
        let name = name.as_str();
        if OURS.contains(&name) {
            return refused(&format!(
                "search parameter \"{name}\" cannot be given: the search over shards sets it"
            ));
        }
        if value.is_null() {
            // Null is the default for every parameter; it has no place in `federation`.
            continue;
        }
        if MOVED_TO_FEDERATION.contains(&name) {
            federation.insert(name.to_owned(), value.clone());
        } else if name == "facets" {
            federation.insert("facetsByIndex".into(), json!({ index_uid: value }));
            federation.insert("mergeFacets".into(), json!({}));
        } else if name == "useNetwork" {
            // Each query names its shard; Meilisearch refuses `useNetwork: true` beside a remote.
            if value != &Value::Bool(false) {
                return refused(
                    "search parameter \"useNetwork\" cannot be used: the search over shards asks each shard itself",
                );
            }
        } else {
            query.insert(name.to_owned(), value.clone());
        }
    }
    let queries: Vec<Value> = remotes
        .iter()
        .map(|remote| {
            let mut one = Map::with_capacity(query.len() + 2);
            one.insert("indexUid".into(), Value::from(index_uid));
            one.extend(
                query
                    .iter()
                    .map(|(name, value)| (name.clone(), value.clone())),
            );
            one.insert("federationOptions".into(), json!({ "remote": remote }));
            Value::Object(one)
        })
        .collect();
    Ok(json!({"federation": federation, "queries": queries}))
}

/// The `leader` of a `GET /network` answer, when set: the server then shards by itself
/// (enterprise edition), and a task must not spread the index a second time.
pub fn network_leader(network: &Value) -> Option<&str> {
    network
        .get("leader")
        .and_then(Value::as_str)
        .filter(|leader| !leader.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_network_names_self_and_each_remote() {
        let body = network_body(
            "ms-0",
            &[
                ("ms-0", "http://a:7700", Some("ka")),
                ("ms-1", "http://b:7700", None),
            ],
        );
        assert_eq!(
            body,
            json!({
                "self": "ms-0",
                "remotes": {
                    "ms-0": {"url": "http://a:7700", "searchApiKey": "ka"},
                    "ms-1": {"url": "http://b:7700", "searchApiKey": null}
                }
            })
        );
        assert_eq!(
            network_body("solo", &[]),
            json!({"self": "solo", "remotes": {}})
        );
    }

    #[test]
    fn a_search_becomes_one_query_per_shard() {
        let body = json!({
            "q": "shoe",
            "filter": "brand = 'x'",
            "limit": 5,
            "offset": 10,
            "facets": ["brand"],
            "attributesToRetrieve": ["id"],
            "showRankingScore": true,
            "sort": null
        });
        let federated =
            federated_search_body("products", &body, &["ms-0", "ms-1"]).expect("a body");
        let query = |remote: &str| {
            json!({
                "indexUid": "products",
                "q": "shoe",
                "filter": "brand = 'x'",
                "attributesToRetrieve": ["id"],
                "showRankingScore": true,
                "federationOptions": {"remote": remote}
            })
        };
        assert_eq!(
            federated,
            json!({
                "federation": {
                    "limit": 5,
                    "offset": 10,
                    "facetsByIndex": {"products": ["brand"]},
                    "mergeFacets": {}
                },
                "queries": [query("ms-0"), query("ms-1")]
            })
        );
    }

    #[test]
    fn federation_only_parameters_move_there() {
        let body = json!({
            "q": "",
            "page": 2,
            "hitsPerPage": 20,
            "distinct": "sku",
            "showPerformanceDetails": true,
            "personalize": {"userContext": "likes red"},
            "useNetwork": false
        });
        let federated = federated_search_body("i", &body, &["a"]).expect("a body");
        assert_eq!(
            federated["federation"],
            json!({
                "page": 2,
                "hitsPerPage": 20,
                "distinct": "sku",
                "showPerformanceDetails": true,
                "personalize": {"userContext": "likes red"}
            })
        );
        assert_eq!(
            federated["queries"],
            json!([{"indexUid": "i", "q": "", "federationOptions": {"remote": "a"}}])
        );
        let bare = federated_search_body("i", &json!({}), &["a"]).expect("a body");
        assert_eq!(bare["federation"], json!({}));
    }

    #[test]
    fn what_cannot_be_spread_is_refused() {
        for (body, expected) in [
            (json!([]), "JSON object"),
            (json!({"indexUid": "other"}), "\"indexUid\""),
            (
                json!({"federationOptions": {"remote": "x"}}),
                "\"federationOptions\"",
            ),
            (json!({"federation": {}}), "\"federation\""),
            (json!({"queries": []}), "\"queries\""),
            (json!({"useNetwork": true}), "\"useNetwork\""),
        ] {
            let error = federated_search_body("i", &body, &["a"]).expect_err("refused");
            assert!(error.0.contains(expected), "{body}: {error}");
        }
        let error = federated_search_body("i", &json!({}), &[]).expect_err("no shard");
        assert!(error.0.contains("at least one shard"), "{error}");
    }

    #[test]
    fn the_leader_is_read_when_set() {
        assert_eq!(
            network_leader(&json!({"self": "a", "leader": "a", "remotes": {}})),
            Some("a")
        );
        assert_eq!(network_leader(&json!({"self": "a", "leader": null})), None);
        assert_eq!(network_leader(&json!({"self": "a"})), None);
        assert_eq!(network_leader(&json!({"leader": ""})), None);
        assert_eq!(network_leader(&json!([])), None);
    }
}
