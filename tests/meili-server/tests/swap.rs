//! `POST /swap-indexes`: validation, processing in task order, what moves with an index, the
//! rewritten task history, renames, and the `types` / `indexUids` task filters around swaps.

mod common;

use std::time::Duration;

use common::{send, Api};
use meili_test_server::TestServer;
use serde_json::{json, Value};

impl Api {
    /// Sends a write that must be accepted; returns its task uid.
    fn enqueue(&self, method: &str, path: &str, body: Value) -> u64 {
        let resp = self.json(method, path, Some(body));
        assert_eq!(resp.status, 202, "{}", String::from_utf8_lossy(&resp.body));
        resp.json()["taskUid"].as_u64().expect("taskUid")
    }

    fn add(&self, index: &str, docs: Value) -> u64 {
        self.enqueue("POST", &format!("/indexes/{index}/documents"), docs)
    }

    fn swap(&self, body: Value) -> u64 {
        self.enqueue("POST", "/swap-indexes", body)
    }

    /// Runs a write to completion and checks that it succeeded.
    fn run(&self, uid: u64) -> Value {
        let task = self.wait_task(uid);
        assert_eq!(task["status"], "succeeded", "{task}");
        task
    }

    fn index_uids_of_tasks(&self) -> Vec<Value> {
        let tasks = self.get("/tasks?reverse=true&limit=1000");
        let results = tasks["results"].as_array().cloned().expect("results");
        results.iter().map(|t| t["indexUid"].clone()).collect()
    }
}

fn start() -> (TestServer, Api) {
    let server = TestServer::start(Some("MASTER_KEY")).expect("start");
    let api = Api { url: server.url() };
    (server, api)
}

/// Two indexes that differ in documents, settings, primary key and creation date.
fn two_indexes(api: &Api) {
    api.run(api.enqueue("POST", "/indexes", json!({"uid": "a", "primaryKey": "id"})));
    api.run(api.add("a", json!([{"id": 1, "from": "a"}])));
    api.run(api.enqueue(
        "PATCH",
        "/indexes/a/settings",
        json!({"filterableAttributes": ["from"]}),
    ));
    // A later createdAt for `b`.
    std::thread::sleep(Duration::from_millis(5));
    api.run(api.enqueue("POST", "/indexes", json!({"uid": "b", "primaryKey": "sku"})));
    api.run(api.add(
        "b",
        json!([{"sku": "x", "from": "b"}, {"sku": "y", "from": "b"}]),
    ));
    api.run(api.enqueue(
        "PATCH",
        "/indexes/b/settings",
        json!({"searchableAttributes": ["from"], "sortableAttributes": ["sku"]}),
    ));
}

#[test]
fn swap_exchanges_documents_settings_primary_keys_and_dates() {
    let (server, api) = start();
    two_indexes(&api);
    let (before_a, before_b) = (api.get("/indexes/a"), api.get("/indexes/b"));
    assert_ne!(before_a["createdAt"], before_b["createdAt"]);

    let resp = api.json(
        "POST",
        "/swap-indexes",
        Some(json!([{"indexes": ["a", "b"]}])),
    );
    assert_eq!(resp.status, 202);
    assert_eq!(resp.header("content-type"), Some("application/json"));
    let summary = resp.json();
    assert_eq!(summary["indexUid"], Value::Null);
    assert_eq!(summary["status"], "enqueued");
    assert_eq!(summary["type"], "indexSwap");
    assert!(summary["enqueuedAt"].is_string());
    let keys: Vec<&String> = summary.as_object().expect("object").keys().collect();
    assert_eq!(
        keys,
        ["enqueuedAt", "indexUid", "status", "taskUid", "type"]
    );

    let task = api.run(summary["taskUid"].as_u64().expect("taskUid"));
    assert_eq!(task["type"], "indexSwap");
    assert_eq!(task["indexUid"], Value::Null);
    assert_eq!(task["error"], Value::Null);
    assert_eq!(
        task["details"],
        json!({"swaps": [{"indexes": ["a", "b"], "rename": false}]})
    );
    let batch = api.get(&format!("/batches/{}", task["batchUid"]));
    assert_eq!(batch["stats"]["types"], json!({"indexSwap": 1}));
    assert_eq!(batch["stats"]["indexUids"], json!({}));

    // Each uid now answers with what the other index held; only `uid` stays.
    let (after_a, after_b) = (api.get("/indexes/a"), api.get("/indexes/b"));
    assert_eq!(
        after_a,
        json!({"uid": "a", "createdAt": before_b["createdAt"], "updatedAt": before_b["updatedAt"], "primaryKey": "sku"})
    );
    assert_eq!(
        after_b,
        json!({"uid": "b", "createdAt": before_a["createdAt"], "updatedAt": before_a["updatedAt"], "primaryKey": "id"})
    );
    assert_eq!(
        server.documents("a"),
        [
            json!({"sku": "x", "from": "b"}),
            json!({"sku": "y", "from": "b"})
        ]
    );
    assert_eq!(server.documents("b"), [json!({"id": 1, "from": "a"})]);
    assert_eq!(
        api.get("/indexes/a/documents/y"),
        json!({"sku": "y", "from": "b"})
    );
    assert_eq!(api.get("/indexes/b/stats")["numberOfDocuments"], 1);
    let settings_a = server.index_settings("a").expect("a");
    let settings_b = server.index_settings("b").expect("b");
    assert_eq!(settings_a["searchableAttributes"], json!(["from"]));
    assert_eq!(settings_a["sortableAttributes"], json!(["sku"]));
    assert_eq!(settings_a["filterableAttributes"], json!([]));
    assert_eq!(settings_b["filterableAttributes"], json!(["from"]));
    assert_eq!(settings_b["searchableAttributes"], json!(["*"]));
    let search = api
        .json(
            "POST",
            "/indexes/b/search",
            Some(json!({"filter": "from = a"})),
        )
        .json();
    assert_eq!(search["hits"], json!([{"id": 1, "from": "a"}]));

    // The finished tasks name each index by its new uid.
    assert_eq!(
        api.index_uids_of_tasks(),
        [
            json!("b"),
            json!("b"),
            json!("b"),
            json!("a"),
            json!("a"),
            json!("a"),
            Value::Null
        ]
    );
}

#[test]
fn a_later_swap_rewrites_an_earlier_swap_and_pairs_swap_together() {
    let (server, api) = start();
    for (index, n) in [("a", 1), ("b", 2), ("c", 3), ("d", 4)] {
        api.run(api.add(index, json!({"id": n})));
    }
    let first = api.run(api.swap(json!([{"indexes": ["a", "b"]}])))["uid"].clone();
    let second = api.swap(json!([{"indexes": ["a", "b"]}, {"indexes": ["c", "d"]}]));
    let second = api.run(second);
    assert_eq!(
        second["details"]["swaps"],
        json!([
            {"indexes": ["a", "b"], "rename": false},
            {"indexes": ["c", "d"], "rename": false}
        ])
    );
    assert_eq!(
        api.get(&format!("/tasks/{first}"))["details"],
        json!({"swaps": [{"indexes": ["b", "a"], "rename": false}]})
    );
    // a and b are back; c and d hold each other's documents.
    for (index, n) in [("a", 1), ("b", 2), ("c", 4), ("d", 3)] {
        assert_eq!(server.documents(index), [json!({"id": n})], "{index}");
    }
    assert_eq!(
        api.index_uids_of_tasks(),
        [
            json!("a"),
            json!("b"),
            json!("d"),
            json!("c"),
            Value::Null,
            Value::Null
        ]
    );
}

#[test]
fn swap_with_a_missing_index_fails_and_changes_nothing() {
    let (server, api) = start();
    two_indexes(&api);
    let before = (api.get("/indexes/a"), api.get("/indexes/b"));
    let history = api.index_uids_of_tasks();

    let task = api.wait_task(api.swap(json!([{"indexes": ["a", "nope"]}])));
    assert_eq!(task["status"], "failed");
    assert_eq!(
        task["error"],
        json!({
            "message": "Index `nope` not found.",
            "code": "index_not_found",
            "type": "invalid_request",
            "link": "https://docs.meilisearch.com/errors#index_not_found"
        })
    );
    assert_eq!(
        task["details"],
        json!({"swaps": [{"indexes": ["a", "nope"], "rename": false}]})
    );

    // The valid pair is not applied either: a swap is all or nothing.
    let task = api.wait_task(api.swap(json!([
        {"indexes": ["a", "b"]},
        {"indexes": ["zz", "c"]}
    ])));
    assert_eq!(task["error"]["code"], "index_not_found");
    assert_eq!(task["error"]["message"], "Indexes `c`, `zz` not found.");

    assert_eq!((api.get("/indexes/a"), api.get("/indexes/b")), before);
    assert_eq!(server.documents("a"), [json!({"id": 1, "from": "a"})]);
    assert_eq!(server.documents("b").len(), 2);
    let mut expected = history;
    expected.extend([Value::Null, Value::Null]);
    assert_eq!(api.index_uids_of_tasks(), expected);
}

#[test]
fn bad_requests_are_refused_before_enqueueing() {
    let (_server, api) = start();
    let cases = [
        (
            json!([{"indexes": ["a", "b"]}, {"indexes": ["c", "a"]}]),
            "invalid_swap_duplicate_index_found",
            "Indexes must be declared only once during a swap. `a` was specified several times.",
        ),
        (
            json!([{"indexes": ["a", "a"]}, {"indexes": ["b", "b"]}]),
            "invalid_swap_duplicate_index_found",
            "Indexes must be declared only once during a swap. `a`, `b` were specified several times.",
        ),
        (
            json!({"indexes": ["a", "b"]}),
            "bad_request",
            "Invalid value type: expected an array, but found an object: `{\"indexes\":[\"a\",\"b\"]}`",
        ),
        (
            json!(["a"]),
            "bad_request",
            "Invalid value type at `[0]`: expected an object, but found a string: `\"a\"`",
        ),
        (
            json!([{"indexes": "a"}]),
            "invalid_swap_indexes",
            "Invalid value type at `[0].indexes`: expected an array, but found a string: `\"a\"`",
        ),
        (
            json!([{"indexes": ["a", 1]}]),
            "invalid_swap_indexes",
            "Invalid value type at `[0].indexes[1]`: expected a string, but found a positive integer: `1`",
        ),
        (
            json!([{"indexes": ["a", "b"]}, {"indexes": ["c", "d", "e"]}]),
            "invalid_swap_indexes",
            "Two indexes must be given for each swap. The list `[\"c\", \"d\", \"e\"]` contains 3 indexes.",
        ),
        (
            json!([{"indexes": ["a", "b c"]}]),
            "invalid_swap_indexes",
            "Invalid value at `[0].indexes[1]`: `b c` is not a valid index uid. Index uid can be an integer or a string containing only alphanumeric characters, hyphens (-) and underscores (_), and can not be more than 512 bytes.",
        ),
        (
            json!([{"indexes": ["a", "b"], "rename": "yes"}]),
            "invalid_swap_rename",
            "Invalid value type at `[0].rename`: expected a boolean, but found a string: `\"yes\"`",
        ),
        (
            json!([{"indexes": ["a", "b"], "other": 1}]),
            "bad_request",
            "Unknown field `other` inside `[0]`: expected one of `indexes`, `rename`",
        ),
        (
            json!([{"rename": false}]),
            "missing_swap_indexes",
            "Missing field `indexes` inside `[0]`",
        ),
    ];
    for (body, code, message) in cases {
        let resp = api.json("POST", "/swap-indexes", Some(body.clone()));
        assert_eq!(resp.status, 400, "{body}");
        assert_eq!(
            resp.json(),
            json!({
                "message": message,
                "code": code,
                "type": "invalid_request",
                "link": format!("https://docs.meilisearch.com/errors#{code}")
            }),
            "{body}"
        );
    }
    let unauthenticated = send(
        &api.url,
        "POST",
        "/swap-indexes",
        &[("Content-Type", "application/json")],
        Some(b"[]"),
    )
    .expect("request");
    assert_eq!(unauthenticated.status, 401);
    assert_eq!(
        unauthenticated.json()["code"],
        "missing_authorization_header"
    );
    assert_eq!(api.json("GET", "/swap-indexes", None).status, 405);
    assert_eq!(api.get("/tasks")["total"], 0);
}

#[test]
fn swap_waits_for_earlier_tasks_and_later_tasks_see_the_swapped_indexes() {
    let (server, api) = start();
    // A slow first task keeps the rest enqueued, so they could be batched across the swap.
    server.faults().set_task_delay(Duration::from_millis(300));
    let blocker = api.add("c", json!({"id": 0}));
    while api.get(&format!("/tasks/{blocker}"))["status"] != "processing" {
        std::thread::sleep(Duration::from_millis(2));
    }
    let early_a = api.add("a", json!({"id": 1, "v": "a1"}));
    let early_b = api.add("b", json!({"id": 1, "v": "b1"}));
    let swap = api.swap(json!([{"indexes": ["a", "b"]}]));
    let late_a = api.add("a", json!({"id": 2, "v": "a2"}));
    let late_b = api.add("b", json!({"id": 2, "v": "b2"}));
    server.faults().set_task_delay(Duration::ZERO);
    assert!(server.wait_idle(Duration::from_secs(30)));

    assert_eq!(
        server.documents("a"),
        [json!({"id": 1, "v": "b1"}), json!({"id": 2, "v": "a2"})]
    );
    assert_eq!(
        server.documents("b"),
        [json!({"id": 1, "v": "a1"}), json!({"id": 2, "v": "b2"})]
    );
    let task = |uid: u64| api.get(&format!("/tasks/{uid}"));
    let swap = task(swap);
    assert_eq!(swap["status"], "succeeded");
    for uid in [early_a, early_b] {
        assert!(instant(&task(uid)["finishedAt"]) <= instant(&swap["startedAt"]));
    }
    for uid in [late_a, late_b] {
        assert!(instant(&task(uid)["startedAt"]) >= instant(&swap["finishedAt"]));
    }
    // Finished tasks follow their index to its new uid; the ones enqueued after the swap keep
    // the uid they were sent to.
    let index_uids: Vec<Value> = [early_a, early_b, late_a, late_b]
        .iter()
        .map(|uid| task(*uid)["indexUid"].clone())
        .collect();
    assert_eq!(index_uids, [json!("b"), json!("a"), json!("a"), json!("b")]);
}

/// An RFC 3339 date as (seconds part, nanoseconds), comparable (trailing zeros are trimmed).
fn instant(v: &Value) -> (String, u32) {
    let s = v.as_str().expect("date").trim_end_matches('Z');
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    (
        whole.to_string(),
        format!("{frac:0<9}").parse().expect("nanos"),
    )
}

#[test]
fn rename_moves_the_index_to_a_free_uid() {
    let (server, api) = start();
    two_indexes(&api);
    let before = api.get("/indexes/a");

    let task = api.wait_task(api.swap(json!([{"indexes": ["a", "b"], "rename": true}])));
    assert_eq!(task["status"], "failed");
    assert_eq!(
        task["error"]["message"],
        "Cannot rename `a` to `b` as the index already exists. Hint: You can remove `b` first and then do your remove."
    );
    assert_eq!(task["error"]["code"], "index_already_exists");

    let task = api.run(api.swap(json!([{"indexes": ["a", "fresh"], "rename": true}])));
    assert_eq!(
        task["details"],
        json!({"swaps": [{"indexes": ["a", "fresh"], "rename": true}]})
    );
    assert_eq!(api.json("GET", "/indexes/a", None).status, 404);
    let renamed = api.get("/indexes/fresh");
    assert_eq!(renamed["uid"], "fresh");
    assert_eq!(renamed["createdAt"], before["createdAt"]);
    assert_eq!(renamed["primaryKey"], "id");
    assert_eq!(server.documents("fresh"), [json!({"id": 1, "from": "a"})]);
    assert_eq!(
        server.index_settings("fresh").expect("fresh")["filterableAttributes"],
        json!(["from"])
    );
    let creation = api.get("/tasks/0");
    assert_eq!(creation["indexUid"], "fresh");
}

#[test]
fn tasks_filter_by_types_and_index_uids_around_swaps() {
    let (_server, api) = start();
    api.run(api.add("a", json!({"id": 1})));
    api.run(api.add("b", json!({"id": 2})));
    api.run(api.enqueue(
        "PATCH",
        "/indexes/a/settings",
        json!({"filterableAttributes": ["id"]}),
    ));
    let swap = api.run(api.swap(json!([{"indexes": ["a", "b"]}])));
    api.run(api.add("a", json!({"id": 3})));

    let listed = |query: &str| {
        let page = api.get(&format!("/tasks?{query}"));
        let uids: Vec<(Value, Value)> = page["results"]
            .as_array()
            .expect("results")
            .iter()
            .map(|t| (t["uid"].clone(), t["type"].clone()))
            .collect();
        (uids, page["total"].clone())
    };
    let t = |uid: u64, kind: &str| (json!(uid), json!(kind));
    assert_eq!(
        listed("types=indexSwap"),
        (vec![t(3, "indexSwap")], json!(1))
    );
    assert_eq!(swap["uid"], 3);
    assert_eq!(
        listed("types=indexSwap,documentAdditionOrUpdate"),
        (
            vec![
                t(4, "documentAdditionOrUpdate"),
                t(3, "indexSwap"),
                t(1, "documentAdditionOrUpdate"),
                t(0, "documentAdditionOrUpdate")
            ],
            json!(4)
        )
    );
    assert_eq!(
        listed("types=settingsUpdate&statuses=succeeded"),
        (vec![t(2, "settingsUpdate")], json!(1))
    );
    // As in Meilisearch, an `indexUids` query counts the swaps of those indexes in `total`
    // but does not list them (they have no `indexUid`).
    assert_eq!(
        listed("indexUids=a"),
        (
            vec![
                t(4, "documentAdditionOrUpdate"),
                t(1, "documentAdditionOrUpdate")
            ],
            json!(3)
        )
    );
    assert_eq!(listed("indexUids=b&types=indexSwap"), (vec![], json!(1)));
    assert_eq!(listed("indexUids=zz"), (vec![], json!(0)));
    let bad = api.json("GET", "/tasks?types=indexSwap,nope", None);
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["code"], "invalid_task_types");
}
