//! Experimental features, `/network` and federated search across several test servers, as
//! Meilisearch 1.50 (community edition) does them.

mod common;

use std::net::TcpListener;

use common::{send, Api};
use meili_test_server::TestServer;
use serde_json::{json, Value};

const KEY: &str = "MASTER_KEY";

fn start() -> (TestServer, Api) {
    let server = TestServer::start(Some(KEY)).expect("start");
    let api = Api { url: server.url() };
    (server, api)
}

fn enable_network(api: &Api) {
    let r = api.json(
        "PATCH",
        "/experimental-features",
        Some(json!({"network": true})),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["network"], true);
}

/// Adds documents with primary key `id` and waits for them.
fn add(api: &Api, index: &str, docs: Value) {
    let body = docs.to_string();
    let r = send(
        &api.url,
        "POST",
        &format!("/indexes/{index}/documents?primaryKey=id"),
        &[
            ("Authorization", "Bearer MASTER_KEY"),
            ("Content-Type", "application/json"),
        ],
        Some(body.as_bytes()),
    )
    .expect("request");
    assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
    let task = api.wait_task(r.json()["taskUid"].as_u64().expect("taskUid"));
    assert_eq!(task["status"], "succeeded", "{task}");
}

fn error(code: &str, kind: &str, message: &str) -> Value {
    json!({
        "message": message,
        "code": code,
        "type": kind,
        "link": format!("https://docs.meilisearch.com/errors#{code}"),
    })
}

/// A URL nothing listens on.
fn dead_url() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    format!("http://{}", listener.local_addr().expect("addr"))
}

#[test]
fn experimental_features_toggle() {
    let (_server, api) = start();
    let r = api.json("GET", "/experimental-features", None);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let body = String::from_utf8(r.body).unwrap();
    assert!(
        body.starts_with(r#"{"metrics":false,"logsRoute":false,"#),
        "{body}"
    );
    assert!(
        body.ends_with(r#""legacySearch":false,"renderRoute":false}"#),
        "{body}"
    );

    let r = api.json(
        "PATCH",
        "/experimental-features",
        Some(json!({"network": true, "metrics": null})),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["network"], true);
    assert_eq!(r.json()["metrics"], false);
    assert_eq!(api.get("/experimental-features")["network"], true);

    let r = api.json(
        "PATCH",
        "/experimental-features",
        Some(json!({"network": 42})),
    );
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json(),
        error(
            "bad_request",
            "invalid_request",
            "Invalid value type at `.network`: expected a boolean, but found a positive integer: `42`"
        )
    );
    let r = api.json(
        "PATCH",
        "/experimental-features",
        Some(json!({"NotAFeature": true})),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["code"], "bad_request");
    assert!(r.json()["message"]
        .as_str()
        .unwrap()
        .starts_with("Unknown field `NotAFeature`: expected one of `metrics`, `logsRoute`"));
}

#[test]
fn network_needs_the_feature() {
    let (_server, api) = start();
    let refused = error(
        "feature_not_enabled",
        "invalid_request",
        "Using the /network route requires enabling the `network` experimental feature. See https://github.com/orgs/meilisearch/discussions/805",
    );
    let r = api.json("GET", "/network", None);
    assert_eq!((r.status, r.json()), (400, refused.clone()));
    let r = api.json("PATCH", "/network", Some(json!({"self": "myself"})));
    assert_eq!((r.status, r.json()), (400, refused));

    // A remote query is refused too, before any search.
    let multi = json!({"federation": {}, "queries": [
        {"indexUid": "books", "federationOptions": {"remote": "ms1"}}
    ]});
    let r = api.json("POST", "/multi-search", Some(multi));
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json()["message"],
        "Inside `.queries[0]`: Performing a remote federated search requires enabling the `network` experimental feature. See https://github.com/orgs/meilisearch/discussions/805"
    );
}

#[test]
fn patch_network_merges_and_validates() {
    let (_server, api) = start();
    enable_network(&api);
    let r = api.json("GET", "/network", None);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json(),
        json!({"self": null, "remotes": {}, "shards": {}, "leader": null,
               "version": "00000000-0000-0000-0000-000000000000"})
    );

    let patch = json!({"self": "ms0", "remotes": {
        "ms0": {"url": "http://localhost:7700"},
        "ms1": {"url": "http://localhost:7701", "searchApiKey": "foo", "writeApiKey": "bar"},
    }});
    let r = api.json("PATCH", "/network", Some(patch));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let mut got = r.json();
    let version = got["version"].take();
    assert_eq!(version.as_str().map(str::len), Some(36));
    assert_eq!(
        got,
        json!({"self": "ms0", "remotes": {
            "ms0": {"url": "http://localhost:7700", "searchApiKey": null, "writeApiKey": null, "status": "available"},
            "ms1": {"url": "http://localhost:7701", "searchApiKey": "foo", "writeApiKey": "bar", "status": "available"},
        }, "shards": {}, "leader": null, "version": null})
    );

    // Absent fields are kept, `null` resets a key, a `null` remote is removed.
    let r = api.json(
        "PATCH",
        "/network",
        Some(json!({"remotes": {"ms1": {"searchApiKey": null}, "ms0": null, "ms2": {"url": "http://x:1"}}})),
    );
    assert_eq!(r.status, 200);
    let n = api.get("/network");
    assert_eq!(n["self"], "ms0");
    assert_eq!(
        n["remotes"].as_object().unwrap().keys().collect::<Vec<_>>(),
        ["ms1", "ms2"]
    );
    assert_eq!(n["remotes"]["ms1"]["searchApiKey"], Value::Null);
    assert_eq!(n["remotes"]["ms1"]["writeApiKey"], "bar");
    assert_eq!(n["remotes"]["ms1"]["url"], "http://localhost:7701");

    let cases = [
        (
            json!({"selfie": "me"}),
            400,
            "bad_request",
            "Unknown field `selfie`: expected one of `remotes`, `shards`, `previousShards`, `self`, `leader`, `previousRemotes`",
        ),
        (
            json!({"self": 42}),
            400,
            "invalid_network_self",
            "Invalid value type at `.self`: expected a string, but found a positive integer: `42`",
        ),
        (
            json!({"remotes": 42}),
            400,
            "invalid_network_remotes",
            "Invalid value type at `.remotes`: expected an object, but found a positive integer: `42`",
        ),
        (
            json!({"remotes": {"new": {"searchApiKey": "k"}}}),
            400,
            "missing_network_url",
            "Missing field `.remotes.new.url`",
        ),
        (
            json!({"remotes": {"new": {"url": 7700}}}),
            400,
            "invalid_network_url",
            "Invalid value type at `.remotes.new.url`: expected a string, but found a positive integer: `7700`",
        ),
        (
            json!({"remotes": {"new": {"url": "no-http-scheme"}}}),
            400,
            "invalid_network_url",
            "Invalid `.remotes.new.url` (`no-http-scheme`): relative URL without a base",
        ),
        (
            json!({"remotes": {"new": {"url": "http://a:1", "doggo": "Intel"}}}),
            400,
            "invalid_network_remotes",
            "Unknown field `doggo` inside `.remotes.new`: expected one of `url`, `searchApiKey`, `writeApiKey`",
        ),
        (
            json!({"remotes": {"ms1": {"url": null}}}),
            400,
            "invalid_network_url",
            "Field `.remotes.ms1.url` cannot be set to `null`",
        ),
        (
            json!({"leader": "ms0"}),
            451,
            "requires_enterprise_edition",
            "Meilisearch Enterprise Edition is required to set `network.leader`",
        ),
    ];
    for (body, status, code, message) in cases {
        let r = api.json("PATCH", "/network", Some(body.clone()));
        assert_eq!(r.status, status, "{body}");
        assert_eq!(r.json()["code"], code, "{body}");
        assert_eq!(r.json()["message"], message, "{body}");
    }
    // Refused patches changed nothing.
    assert_eq!(api.get("/network")["remotes"], n["remotes"]);
}

/// Three servers `ms0..ms2`, each knowing all; `books` split between them (ids 1-3, 4-6, 7-9).
fn cluster() -> Vec<(TestServer, Api)> {
    let servers: Vec<(TestServer, Api)> = (0..3).map(|_| start()).collect();
    let remotes: serde_json::Map<String, Value> = servers
        .iter()
        .enumerate()
        .map(|(i, (_, api))| {
            (
                format!("ms{i}"),
                json!({"url": api.url, "searchApiKey": KEY}),
            )
        })
        .collect();
    for (i, (_, api)) in servers.iter().enumerate() {
        enable_network(api);
        let r = api.json(
            "PATCH",
            "/network",
            Some(json!({"self": format!("ms{i}"), "remotes": remotes})),
        );
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let docs: Vec<Value> = (1..=3)
            .map(|n| {
                let id = i * 3 + n;
                json!({"id": id, "title": format!("book {id}")})
            })
            .collect();
        add(api, "books", Value::from(docs));
    }
    servers
}

fn queries_for_all(q: &str) -> Value {
    Value::from(
        (0..3)
            .map(|i| json!({"indexUid": "books", "q": q, "federationOptions": {"remote": format!("ms{i}")}}))
            .collect::<Vec<_>>(),
    )
}

/// `(id, remote)` of each hit.
fn hits(r: &Value) -> Vec<(u64, String)> {
    r["hits"]
        .as_array()
        .expect("hits")
        .iter()
        .map(|h| {
            (
                h["id"].as_u64().expect("id"),
                h["_federation"]["remote"]
                    .as_str()
                    .expect("remote")
                    .to_string(),
            )
        })
        .collect()
}

#[test]
fn federated_search_spans_remotes() {
    let servers = cluster();
    let api = &servers[0].1;
    let multi = json!({"federation": {}, "queries": queries_for_all("book")});
    let r = api.json("POST", "/multi-search", Some(multi));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let body = r.json();
    let mut got = hits(&body);
    got.sort();
    let expected: Vec<(u64, String)> = (1..=9)
        .map(|id| (id, format!("ms{}", (id - 1) / 3)))
        .collect();
    assert_eq!(got, expected);
    assert_eq!(body["estimatedTotalHits"], 9);
    assert_eq!(body["remoteErrors"], json!({}));
    // Hits keep their fields in order and get `_federation` last, as from a local index.
    let first = &body["hits"][0];
    assert_eq!(first["_federation"]["indexUid"], "books");
    assert!(first["_federation"]["weightedRankingScore"].is_number());
    assert!(first["_federation"].get("weightedScoreValues").is_none());
    let raw = String::from_utf8(r.body).unwrap();
    assert!(raw.contains(r#"{"id":4,"title":"book 4","_federation":{"indexUid":"books","queriesPosition":1,"weightedRankingScore":1.0,"remote":"ms1"}}"#), "{raw}");

    // Paging applies to the merged hits; totals add up over the servers.
    let all = hits(&body);
    let multi =
        json!({"federation": {"offset": 3, "limit": 4}, "queries": queries_for_all("book")});
    let paged = api.json("POST", "/multi-search", Some(multi)).json();
    assert_eq!(hits(&paged), all[3..7].to_vec());
    assert_eq!(paged["estimatedTotalHits"], 9);
    assert_eq!(
        (paged["offset"].clone(), paged["limit"].clone()),
        (json!(3), json!(4))
    );

    // `useNetwork` sends one query to every server of the network.
    let multi = json!({"federation": {}, "queries": [{"indexUid": "books", "q": "book", "useNetwork": true}]});
    let r = servers[1]
        .1
        .json("POST", "/multi-search", Some(multi))
        .json();
    let mut got = hits(&r);
    got.sort();
    assert_eq!(got, expected);

    // Without remotes involved, no `remote` and no `remoteErrors`.
    let multi = json!({"federation": {}, "queries": [{"indexUid": "books", "q": "book"}]});
    let r = api.json("POST", "/multi-search", Some(multi)).json();
    assert!(r.get("remoteErrors").is_none());
    assert!(r["hits"][0]["_federation"].get("remote").is_none());

    // An unknown remote is refused.
    let multi = json!({"federation": {}, "queries": [{"indexUid": "books", "federationOptions": {"remote": "ms9"}}]});
    let r = api.json("POST", "/multi-search", Some(multi));
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json(),
        error(
            "invalid_multi_search_remote",
            "invalid_request",
            "Inside `.queries[0]`: Invalid `.federation_options.remote`: remote `ms9` is not registered"
        )
    );
}

#[test]
fn servers_querying_each_other_concurrently_do_not_deadlock() {
    let servers = cluster();
    let urls: Vec<String> = servers.iter().map(|(_, api)| api.url.clone()).collect();
    let threads: Vec<_> = (0..12)
        .map(|n| {
            let url = urls[n % urls.len()].clone();
            std::thread::spawn(move || {
                let api = Api { url };
                let multi = json!({"federation": {}, "queries": queries_for_all("book")});
                let r = api.json("POST", "/multi-search", Some(multi)).json();
                (hits(&r).len(), r["remoteErrors"].clone())
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), (9, json!({})));
    }
}

#[test]
fn failing_remotes_are_reported_with_the_other_hits() {
    let servers = cluster();
    let api = &servers[0].1;
    let (_plain, plain_api) = start(); // network feature off
    add(
        &plain_api,
        "books",
        json!([{"id": 100, "title": "book 100"}]),
    );
    let r = api.json(
        "PATCH",
        "/network",
        Some(json!({"remotes": {
            "dead": {"url": dead_url()},
            "badkey": {"url": servers[1].1.url, "searchApiKey": "wrong"},
            "plain": {"url": plain_api.url, "searchApiKey": KEY},
        }})),
    );
    assert_eq!(r.status, 200);
    let mut queries = queries_for_all("book").as_array().unwrap().clone();
    for name in ["dead", "badkey", "plain"] {
        queries
            .push(json!({"indexUid": "books", "q": "book", "federationOptions": {"remote": name}}));
    }
    let multi = json!({"federation": {}, "queries": queries});
    let r = api.json("POST", "/multi-search", Some(multi));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let body = r.json();
    assert_eq!(hits(&body).len(), 9);
    assert_eq!(body["estimatedTotalHits"], 9);
    let errors = &body["remoteErrors"];
    assert_eq!(
        errors["dead"],
        error(
            "remote_could_not_send_request",
            "system",
            "error sending request"
        )
    );
    assert_eq!(
        errors["badkey"],
        error(
            "remote_invalid_api_key",
            "auth",
            "could not authenticate against the remote host\n  - hint: check that the remote instance was registered with a valid API key having the `search` action"
        )
    );
    assert_eq!(errors["plain"]["code"], "remote_bad_request");
    let message = errors["plain"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("remote host responded with code 400:\n  - response from remote: {\"message\":\"Performing a remote federated search requires enabling the `network` experimental feature."),
        "{message}"
    );
    assert_eq!(errors.as_object().unwrap().len(), 3);
}

/// `cluster()` plus a `shop` index split between the servers, `category` and `price` filterable.
const CATEGORIES: [&[&str]; 3] = [
    &["a", "b", "a", "c"],
    &["a", "b", "b"],
    &["c", "c", "a", "d"],
];

fn shop_cluster() -> Vec<(TestServer, Api)> {
    let servers = cluster();
    let mut id = 0;
    for (i, (_, api)) in servers.iter().enumerate() {
        let docs: Vec<Value> = CATEGORIES[i]
            .iter()
            .map(|c| {
                id += 1;
                json!({"id": id, "title": format!("item {id}"), "category": c, "price": id * 10})
            })
            .collect();
        add(api, "shop", Value::from(docs));
        let r = api.json(
            "PATCH",
            "/indexes/shop/settings",
            Some(json!({"filterableAttributes": ["category", "price"]})),
        );
        assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
        let task = api.wait_task(r.json()["taskUid"].as_u64().expect("taskUid"));
        assert_eq!(task["status"], "succeeded", "{task}");
    }
    servers
}

fn shop_queries() -> Value {
    Value::from(
        (0..3)
            .map(|i| json!({"indexUid": "shop", "federationOptions": {"remote": format!("ms{i}")}}))
            .collect::<Vec<_>>(),
    )
}

#[test]
fn merged_facets_add_up_over_the_network() {
    let servers = shop_cluster();
    let api = &servers[0].1;
    let multi = json!({"federation": {"facetsByIndex": {"shop": ["category", "price"]}, "mergeFacets": {}}, "queries": shop_queries()});
    let r = api.json("POST", "/multi-search", Some(multi));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let body = r.json();
    assert_eq!(body["estimatedTotalHits"], 11);
    assert_eq!(body["remoteErrors"], json!({}));
    assert_eq!(
        body["facetDistribution"]["category"],
        json!({"a": 4, "b": 3, "c": 3, "d": 1})
    );
    assert_eq!(
        body["facetStats"],
        json!({"price": {"min": 10.0, "max": 110.0}})
    );
    assert!(body.get("facetsByIndex").is_none());
    let raw = String::from_utf8(r.body).unwrap();
    assert!(
        raw.contains(r#""estimatedTotalHits":11,"facetDistribution":{"category":{"a":4,"b":3,"c":3,"d":1},"price":{"#),
        "{raw}"
    );
    assert!(
        raw.contains(r#""facetStats":{"price":{"min":10.0,"max":110.0}},"requestUid":"#),
        "{raw}"
    );

    // `maxValuesPerFacet` keeps the first values of the merged (alphabetical) order.
    let multi = json!({"federation": {"facetsByIndex": {"shop": ["category"]}, "mergeFacets": {"maxValuesPerFacet": 2}}, "queries": shop_queries()});
    let body = api.json("POST", "/multi-search", Some(multi)).json();
    assert_eq!(
        body["facetDistribution"],
        json!({"category": {"a": 4, "b": 3}})
    );

    // Without `facetsByIndex` there is nothing to merge.
    let multi = json!({"federation": {"mergeFacets": {}}, "queries": shop_queries()});
    let body = api.json("POST", "/multi-search", Some(multi)).json();
    assert!(body.get("facetDistribution").is_none());
    assert!(body.get("facetStats").is_none());
}

#[test]
fn facets_by_index_over_the_network_and_locally() {
    let servers = shop_cluster();
    let api = &servers[1].1;
    let multi = json!({"federation": {"facetsByIndex": {"shop": ["cat*"], "books": null}}, "queries": shop_queries()});
    let r = api.json("POST", "/multi-search", Some(multi));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let body = r.json();
    assert!(body.get("facetDistribution").is_none());
    assert_eq!(
        body["facetsByIndex"],
        json!({"shop": {"distribution": {"category": {"a": 4, "b": 3, "c": 3, "d": 1}}, "stats": {}}})
    );

    // Local only: over the union of the queries of the index, each document counted once.
    let multi = json!({"federation": {"facetsByIndex": {"shop": ["category", "price"]}}, "queries": [
        {"indexUid": "shop", "filter": "category = a"},
        {"indexUid": "shop", "filter": "category IN [a, b]"},
        {"indexUid": "books", "q": "book"},
    ]});
    let r = servers[0].1.json("POST", "/multi-search", Some(multi));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let body = r.json();
    assert_eq!(
        body["facetsByIndex"],
        json!({"shop": {
            "distribution": {"category": {"a": 2, "b": 1}, "price": {"10": 1, "20": 1, "30": 1}},
            "stats": {"price": {"min": 10.0, "max": 30.0}},
        }})
    );
    assert!(body.get("remoteErrors").is_none());
}

#[test]
fn federated_facets_errors() {
    let (_server, api) = start();
    add(
        &api,
        "shop",
        json!([{"id": 1, "category": "a", "title": "x"}]),
    );
    let r = api.json(
        "PATCH",
        "/indexes/shop/settings",
        Some(json!({"filterableAttributes": ["price", "category"]})),
    );
    api.wait_task(r.json()["taskUid"].as_u64().expect("taskUid"));
    let cases = [
        (
            json!({"federation": {}, "queries": [{"indexUid": "shop"}, {"indexUid": "shop", "facets": ["category"]}]}),
            400,
            "invalid_multi_search_query_facets",
            "Inside `.queries[1]`: Using facet options is not allowed in federated queries.\n - Hint: remove `facets` from the query or remove `federation` from the request\n - Hint: pass `federation.facetsByIndex.shop: [\"category\"]` for facets in federated search",
        ),
        (
            json!({"federation": {"facetsByIndex": {"shop": ["title"]}}, "queries": [{"indexUid": "shop"}]}),
            400,
            "invalid_search_facets",
            "Inside `.queries[0]`: Inside `.federation.facetsByIndex.shop`: Invalid facet distribution: Pattern `title` is not filterable. Available filterable attributes patterns are: `category, price`.",
        ),
        (
            json!({"federation": {"facetsByIndex": {"nope": ["title"]}}, "queries": [{"indexUid": "shop"}]}),
            400,
            "index_not_found",
            "Inside `.federation.facetsByIndex.nope`: Index `nope` not found.\n - Note: index `nope` is not used in queries",
        ),
        (
            json!({"federation": {"facetsByIndex": ["shop"]}, "queries": []}),
            400,
            "invalid_multi_search_facets_by_index",
            "Invalid value type at `.federation.facetsByIndex`: expected an object, but found an array: `[\"shop\"]`",
        ),
        (
            json!({"federation": {"mergeFacets": {"maxValues": 1}}, "queries": []}),
            400,
            "invalid_multi_search_merge_facets",
            "Unknown field `maxValues` inside `.federation.mergeFacets`: expected one of `maxValuesPerFacet`",
        ),
    ];
    for (body, status, code, message) in cases {
        let r = api.json("POST", "/multi-search", Some(body.clone()));
        assert_eq!(r.status, status, "{body}");
        assert_eq!(r.json()["code"], code, "{body}");
        assert_eq!(r.json()["message"], message, "{body}");
    }
}
