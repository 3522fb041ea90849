//! Focused tests: document ids, fault knobs (each observed over HTTP), gzip, task ordering,
//! HTTP framing, limits, search, the library helpers and the binary.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{read_response, send, write_request, Api, Resp};
use meili_test_server::{Config, TestServer};
use serde_json::{json, Value};

const KEY: &str = "MASTER_KEY";
const AUTH: (&str, &str) = ("Authorization", "Bearer MASTER_KEY");

impl Api {
    fn new(server: &TestServer) -> Self {
        Api { url: server.url() }
    }

    fn ndjson(&self, method: &str, path: &str, body: &str) -> Resp {
        send(
            &self.url,
            method,
            path,
            &[AUTH, ("Content-Type", "application/x-ndjson")],
            Some(body.as_bytes()),
        )
        .expect("request")
    }

    /// Enqueues NDJSON documents and returns the task uid.
    fn add(&self, index: &str, body: &str) -> u64 {
        let resp = self.ndjson(
            "POST",
            &format!("/indexes/{index}/documents?primaryKey=id"),
            body,
        );
        assert_eq!(resp.status, 202, "{}", String::from_utf8_lossy(&resp.body));
        resp.json()["taskUid"].as_u64().expect("taskUid")
    }
}

fn start() -> (TestServer, Api) {
    let server = TestServer::start(Some(KEY)).expect("start");
    let api = Api::new(&server);
    (server, api)
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(data).expect("gzip");
    enc.finish().expect("gzip")
}

#[test]
fn document_ids_follow_the_real_rules() {
    let (server, api) = start();
    let cases = [
        (r#"{"id":1,"v":"number"}"#, "succeeded"),
        (r#"{"id":"1","v":"string, same document"}"#, "succeeded"),
        (r#"{"id":18446744073709551615}"#, "succeeded"),
        (r#"{"id":-5}"#, "succeeded"),
        (r#"{"id":"abc-DEF_123"}"#, "succeeded"),
        (r#"{"id":18446744073709551616}"#, "failed"),
        (r#"{"id":1.5}"#, "failed"),
        (r#"{"id":7.0}"#, "failed"),
        (r#"{"id":"with space"}"#, "failed"),
        (r#"{"id":true}"#, "failed"),
        (r#"{"id":null}"#, "failed"),
    ];
    for (doc, status) in cases {
        let task = api.wait_task(api.add("ids", &format!("{doc}\n")));
        assert_eq!(task["status"], status, "{doc}: {task}");
        if status == "failed" {
            assert_eq!(task["error"]["code"], "invalid_document_id", "{doc}");
        }
    }
    let long = |n: usize| format!("{{\"id\":\"{}\"}}\n", "a".repeat(n));
    assert_eq!(
        api.wait_task(api.add("ids", &long(511)))["status"],
        "succeeded"
    );
    assert_eq!(
        api.wait_task(api.add("ids", &long(512)))["status"],
        "failed"
    );
    let missing = api.wait_task(api.add("ids", "{\"name\":\"no id\"}\n"));
    assert_eq!(missing["error"]["code"], "missing_document_id");

    let docs = server.documents("ids");
    let ids: Vec<&Value> = docs.iter().map(|d| &d["id"]).collect();
    assert_eq!(
        ids[..3],
        [&json!(-5), &json!(18446744073709551615u64), &json!("1")]
    );
    assert_eq!(docs.len(), 5, "1 and \"1\" are the same document");
    assert_eq!(
        api.get("/indexes/ids/documents/1")["v"],
        "string, same document"
    );
}

#[test]
fn primary_key_inference() {
    let (_server, api) = start();
    let post = |index: &str, body: &str| {
        let resp = api.ndjson("POST", &format!("/indexes/{index}/documents"), body);
        api.wait_task(resp.json()["taskUid"].as_u64().expect("taskUid"))
    };
    assert_eq!(
        post("a", "{\"bookId\":1,\"t\":\"x\"}\n")["status"],
        "succeeded"
    );
    assert_eq!(api.get("/indexes/a")["primaryKey"], "bookId");
    let none = post("b", "{\"t\":\"x\"}\n");
    assert_eq!(
        none["error"]["code"],
        "index_primary_key_no_candidate_found"
    );
    let missing = api.json("GET", "/indexes/b", None);
    assert_eq!(missing.status, 404, "a failed addition creates no index");
    let many = post("c", "{\"id\":1,\"author_id\":2}\n");
    assert_eq!(
        many["error"]["code"],
        "index_primary_key_multiple_candidates_found"
    );
}

#[test]
fn fail_next_requests_answers_errors_then_recovers() {
    let (server, api) = start();
    server.faults().fail_next_requests(2, 503);
    for _ in 0..2 {
        let resp = send(&api.url, "GET", "/health", &[], None).expect("request");
        assert_eq!(resp.status, 503);
        assert_eq!(resp.header("retry-after"), Some("1"));
        assert_eq!(resp.json()["type"], "system");
    }
    assert_eq!(
        send(&api.url, "GET", "/health", &[], None)
            .expect("request")
            .status,
        200
    );

    server.faults().fail_next_requests(1, 500);
    let resp = api.json("POST", "/indexes", Some(json!({"uid": "x"})));
    assert_eq!(
        (resp.status, resp.json()["code"].clone()),
        (500, json!("internal"))
    );
    server.faults().fail_next_requests(1, 429);
    let resp = api.json("GET", "/tasks", None);
    assert_eq!(
        (resp.status, resp.json()["code"].clone()),
        (429, json!("too_many_requests"))
    );
    assert!(
        api.get("/tasks")["results"]
            .as_array()
            .expect("results")
            .is_empty(),
        "faulted writes do nothing"
    );
    let log = server.request_log();
    assert_eq!(
        log.iter().map(|r| r.status).collect::<Vec<_>>(),
        [503, 503, 200, 500, 429, 200]
    );
}

#[test]
fn drop_next_connections_closes_without_answer() {
    let (server, api) = start();
    server.faults().drop_next_connections(1);
    let body = "{\"id\":1}\n";
    let dropped = send(
        &api.url,
        "POST",
        "/indexes/d/documents",
        &[AUTH, ("Content-Type", "application/x-ndjson")],
        Some(body.as_bytes()),
    );
    assert!(dropped.is_err(), "no response expected");
    let log = server.request_log();
    assert_eq!(
        (log[0].status, log[0].body.as_slice()),
        (0, body.as_bytes())
    );
    assert!(api.get("/tasks")["results"]
        .as_array()
        .expect("results")
        .is_empty());
    assert_eq!(
        send(&api.url, "GET", "/health", &[], None)
            .expect("request")
            .status,
        200
    );
}

#[test]
fn task_delay_shows_processing_and_fail_next_tasks_fails_tasks() {
    let (server, api) = start();
    api.wait_task(
        api.json("POST", "/indexes", Some(json!({"uid": "slow"})))
            .json()["taskUid"]
            .as_u64()
            .expect("uid"),
    );
    server.faults().set_task_delay(Duration::from_secs(30));
    let uid = api.add("slow", "{\"id\":1}\n");
    let deadline = Instant::now() + Duration::from_secs(5);
    while api.get(&format!("/tasks/{uid}"))["status"] != "processing" {
        assert!(Instant::now() < deadline, "task never seen processing");
        std::thread::sleep(Duration::from_millis(2));
    }
    let task = api.get(&format!("/tasks/{uid}"));
    assert!(
        task["startedAt"].is_string() && task["finishedAt"].is_null() && task["duration"].is_null()
    );
    assert_eq!(api.get("/indexes/slow/stats")["isIndexing"], true);
    assert!(!server.wait_idle(Duration::from_millis(10)));
    // Lowering the delay ends the wait of the batch being processed.
    server.faults().set_task_delay(Duration::ZERO);
    assert!(server.wait_idle(Duration::from_secs(5)));

    server.faults().fail_next_tasks(1, "internal");
    let failed = api.wait_task(api.add("slow", "{\"id\":2}\n"));
    assert_eq!(failed["status"], "failed");
    assert_eq!(
        (
            failed["error"]["code"].clone(),
            failed["error"]["type"].clone()
        ),
        (json!("internal"), json!("internal"))
    );
    assert_eq!(failed["details"]["indexedDocuments"], 0);
    let ok = api.wait_task(api.add("slow", "{\"id\":3}\n"));
    assert_eq!(ok["status"], "succeeded");
    assert_eq!(api.get("/indexes/slow/stats")["numberOfDocuments"], 2);
}

#[test]
fn unavailable_refuses_connections_until_cleared() {
    let (server, api) = start();
    let mut kept = TcpStream::connect(api.url.trim_start_matches("http://")).expect("connect");
    let host = api.url.trim_start_matches("http://").to_string();
    write_request(&mut kept, &host, "GET", "/health", &[], None).expect("write");
    let mut kept = BufReader::new(kept);
    assert_eq!(read_response(&mut kept).expect("response").status, 200);

    server.faults().set_unavailable(true);
    assert!(send(&api.url, "GET", "/health", &[], None).is_err());
    write_request(kept.get_mut(), &host, "GET", "/health", &[], None).ok();
    assert!(
        read_response(&mut kept).is_err(),
        "open connections are closed too"
    );

    server.faults().clear();
    assert_eq!(
        send(&api.url, "GET", "/health", &[], None)
            .expect("request")
            .status,
        200
    );
}

#[test]
fn gzip_and_deflate_bodies() {
    let (server, api) = start();
    let body = "{\"id\":1,\"n\":\"gzipped\"}\n{\"id\":2}\n";
    let headers = [
        AUTH,
        ("Content-Type", "application/x-ndjson"),
        ("Content-Encoding", "gzip"),
    ];
    let resp = send(
        &api.url,
        "POST",
        "/indexes/g/documents",
        &headers,
        Some(&gzip(body.as_bytes())),
    )
    .expect("request");
    assert_eq!(resp.status, 202);
    assert_eq!(
        api.wait_task(resp.json()["taskUid"].as_u64().expect("uid"))["details"]["indexedDocuments"],
        2
    );

    let record = &server.request_log()[0];
    assert_eq!(
        (record.body.as_slice(), record.content_encoding.as_deref()),
        (body.as_bytes(), Some("gzip"))
    );

    let resp = send(
        &api.url,
        "POST",
        "/indexes/g/documents",
        &headers,
        Some(body.as_bytes()),
    )
    .expect("request");
    assert_eq!(resp.status, 400);
    assert_eq!(
        resp.json()["message"],
        "The provided payload is incomplete and cannot be parsed"
    );

    let mut deflate = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
    deflate.write_all(b"{\"id\":3}").expect("deflate");
    let headers = [
        AUTH,
        ("Content-Type", "application/json"),
        ("Content-Encoding", "deflate"),
    ];
    let resp = send(
        &api.url,
        "PUT",
        "/indexes/g/documents",
        &headers,
        Some(&deflate.finish().expect("deflate")),
    )
    .expect("request");
    assert_eq!(
        api.wait_task(resp.json()["taskUid"].as_u64().expect("uid"))["status"],
        "succeeded"
    );
    assert_eq!(server.documents("g").len(), 3);
}

/// An RFC 3339 date as comparable parts (its fraction has a variable number of digits).
fn timestamp(v: &Value) -> (String, u32) {
    let s = v.as_str().unwrap_or("").trim_end_matches('Z');
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    (
        whole.to_string(),
        format!("{frac:0<9}").parse().unwrap_or(0),
    )
}

#[test]
fn tasks_run_in_enqueue_order_per_index() {
    let (server, api) = start();
    server.faults().set_task_delay(Duration::from_millis(20));
    let mut uids = Vec::new();
    for i in 0..12u64 {
        let index = if i % 2 == 0 { "even" } else { "odd" };
        uids.push(api.add(index, &format!("{{\"id\":1,\"v\":{i}}}\n")));
        if i % 3 == 0 {
            let patch = api.json(
                "PATCH",
                &format!("/indexes/{index}/settings"),
                Some(json!({"filterableAttributes": ["v"]})),
            );
            uids.push(patch.json()["taskUid"].as_u64().expect("uid"));
        }
    }
    assert!(server.wait_idle(Duration::from_secs(30)));
    let tasks = api.get("/tasks?limit=100&reverse=true")["results"]
        .as_array()
        .cloned()
        .expect("results");
    assert_eq!(tasks.len(), uids.len());
    for index in ["even", "odd"] {
        let mine: Vec<&Value> = tasks.iter().filter(|t| t["indexUid"] == index).collect();
        for pair in mine.windows(2) {
            assert!(pair[0]["uid"].as_u64() < pair[1]["uid"].as_u64());
            if pair[0]["batchUid"] == pair[1]["batchUid"] {
                continue; // auto-batched together
            }
            let (prev_end, next_start) = (
                timestamp(&pair[0]["finishedAt"]),
                timestamp(&pair[1]["startedAt"]),
            );
            assert!(
                prev_end <= next_start,
                "{index}: task {} started before {} finished",
                pair[1]["uid"],
                pair[0]["uid"]
            );
        }
    }
    assert!(tasks.iter().all(|t| t["status"] == "succeeded"));
    // The last write per index wins.
    assert_eq!(server.documents("even")[0]["v"], 10);
    assert_eq!(server.documents("odd")[0]["v"], 11);
}

#[test]
fn consecutive_additions_are_batched_and_a_bad_one_fails_alone() {
    let (server, api) = start();
    server.faults().set_task_delay(Duration::from_secs(10));
    let first = api.add("b", "{\"id\":1}\n");
    while api.get(&format!("/tasks/{first}"))["status"] != "processing" {
        std::thread::sleep(Duration::from_millis(2));
    }
    let ok1 = api.add("b", "{\"id\":2}\n");
    let bad = api.add("b", "{\"id\":3}\n{\"id\":\"bad id\"}\n");
    let ok2 = api.add("b", "{\"id\":4}\n");
    server.faults().set_task_delay(Duration::ZERO);
    assert!(server.wait_idle(Duration::from_secs(10)));
    let (t1, tb, t2) = (
        api.get(&format!("/tasks/{ok1}")),
        api.get(&format!("/tasks/{bad}")),
        api.get(&format!("/tasks/{ok2}")),
    );
    assert_eq!(
        (
            t1["status"].as_str(),
            tb["status"].as_str(),
            t2["status"].as_str()
        ),
        (Some("succeeded"), Some("failed"), Some("succeeded"))
    );
    assert_eq!(t1["batchUid"], t2["batchUid"]);
    let batch = api.get(&format!("/batches/{}", t1["batchUid"]));
    assert_eq!(batch["stats"]["totalNbTasks"], 3);
    assert_eq!(
        batch["details"],
        json!({"receivedDocuments": 4, "indexedDocuments": 2})
    );
    let ids: Vec<Value> = server
        .documents("b")
        .iter()
        .map(|d| d["id"].clone())
        .collect();
    assert_eq!(ids, [json!(1), json!(2), json!(4)]);
}

/// Applies a settings PATCH and returns its finished task.
fn patch_settings(api: &Api, index: &str, settings: Value) -> Value {
    let resp = api.json(
        "PATCH",
        &format!("/indexes/{index}/settings"),
        Some(settings),
    );
    api.wait_task(resp.json()["taskUid"].as_u64().expect("taskUid"))
}

/// NDJSON text of `docs`.
fn ndjson(docs: &[Value]) -> String {
    docs.iter().map(|d| format!("{d}\n")).collect()
}

fn geo_error(message: &str) -> Value {
    json!({
        "message": message,
        "code": "invalid_document_geo_field",
        "type": "invalid_request",
        "link": "https://docs.meilisearch.com/errors#invalid_document_geo_field"
    })
}

#[test]
fn bad_geo_fails_the_whole_task_once_geo_is_on() {
    let (server, api) = start();
    // Meilisearch only reads `_geo` when it is sortable or filterable.
    let plain = api.wait_task(api.add("plain", "{\"id\":1,\"_geo\":\"abc\"}\n"));
    assert_eq!(plain["status"], "succeeded", "{plain}");

    let task = patch_settings(&api, "geo", json!({"filterableAttributes": ["_geo"]}));
    assert_eq!(task["status"], "succeeded", "{task}");
    let docs: Vec<Value> = (1..=10)
        .map(|i| match i {
            3 => json!({"id": 3, "_geo": "abc"}),
            _ => json!({"id": i, "_geo": {"lat": i, "lng": -i}}),
        })
        .collect();
    let task = api.wait_task(api.add("geo", &ndjson(&docs)));
    assert_eq!(task["status"], "failed");
    assert_eq!(
        task["details"],
        json!({"receivedDocuments": 10, "indexedDocuments": 0})
    );
    assert_eq!(
        task["error"],
        geo_error("Index `geo`: The `_geo` field in the document with the id: `\"3\"` is not an object. Was expecting an object with the `_geo.lat` and `_geo.lng` fields but instead got `\"abc\"`.")
    );
    assert!(server.documents("geo").is_empty());

    let good = [
        json!({"id": 1, "_geo": {"lat": 48.85, "lng": 2.35}}),
        json!({"id": 2, "_geo": {"lng": "151.2", "lat": "-33.9"}}),
        json!({"id": 3, "_geo": null}),
        json!({"id": 4, "name": "no geo"}),
        json!({"id": 5, "_geo": {"lat": 0, "lng": "1e2"}}),
    ];
    let task = api.wait_task(api.add("geo", &ndjson(&good)));
    assert_eq!(task["status"], "succeeded", "{task}");
    assert_eq!(task["details"]["indexedDocuments"], 5);
    assert_eq!(server.documents("geo"), good);

    let bad = [
        (
            json!({"lat": "north", "lng": 2}),
            "Could not parse latitude in the document with the id: `\"6\"`. Was expecting a finite number but instead got `\"north\"`.",
        ),
        (
            json!({"lat": 2, "lng": [1]}),
            "Could not parse longitude in the document with the id: `\"6\"`. Was expecting a finite number but instead got `[1]`.",
        ),
        (
            json!({"lng": 2}),
            "Could not find latitude in the document with the id: `\"6\"`. Was expecting a `_geo.lat` field.",
        ),
        (
            json!({}),
            "Could not find latitude nor longitude in the document with the id: `\"6\"`. Was expecting `_geo.lat` and `_geo.lng` fields.",
        ),
    ];
    for (geo, message) in bad {
        let doc = json!({"id": "6", "_geo": geo});
        let task = api.wait_task(api.add("geo", &ndjson(&[doc])));
        assert_eq!(task["status"], "failed", "{geo}");
        assert_eq!(task["error"], geo_error(&format!("Index `geo`: {message}")));
    }

    // An update replaces `_geo` as a whole; one without `_geo` keeps the stored one.
    let put = |body: Value| {
        let resp = api.json("PUT", "/indexes/geo/documents", Some(body));
        api.wait_task(resp.json()["taskUid"].as_u64().expect("taskUid"))
    };
    let task = put(json!({"id": 1, "_geo": {"lat": 5}}));
    assert_eq!(
        task["error"]["message"],
        "Index `geo`: Could not find longitude in the document with the id: `\"1\"`. Was expecting a `_geo.lng` field."
    );
    assert_eq!(
        put(json!({"id": 1, "name": "Paris"}))["status"],
        "succeeded"
    );
    assert_eq!(
        api.get("/indexes/geo/documents/1"),
        json!({"id": 1, "_geo": {"lat": 48.85, "lng": 2.35}, "name": "Paris"})
    );
    // Within one payload the last version of a document is the one checked.
    let twice = "{\"id\":7,\"_geo\":\"abc\"}\n{\"id\":7,\"_geo\":{\"lat\":1,\"lng\":1}}\n";
    assert_eq!(api.wait_task(api.add("geo", twice))["status"], "succeeded");

    // Turning the geo feature on checks the stored documents; a bad one fails the settings.
    let task = patch_settings(&api, "plain", json!({"sortableAttributes": ["_geo"]}));
    assert_eq!(task["status"], "failed");
    assert_eq!(task["details"], json!({"sortableAttributes": ["_geo"]}));
    assert_eq!(
        task["error"],
        geo_error("Index `plain`: The `_geo` field in the document with the id: `\"1\"` is not an object. Was expecting an object with the `_geo.lat` and `_geo.lng` fields but instead got `\"abc\"`.")
    );
    let settings = server.index_settings("plain").expect("settings");
    assert_eq!(settings["sortableAttributes"], json!([]));
}

#[test]
fn bad_geo_fails_every_task_of_its_batch() {
    let (server, api) = start();
    patch_settings(&api, "b", json!({"sortableAttributes": ["_geo"]}));
    server.faults().set_task_delay(Duration::from_secs(10));
    let first = api.add("b", "{\"id\":1}\n");
    while api.get(&format!("/tasks/{first}"))["status"] != "processing" {
        std::thread::sleep(Duration::from_millis(2));
    }
    let batched = [
        api.add("b", "{\"id\":2,\"_geo\":{\"lat\":1,\"lng\":1}}\n"),
        api.add("b", "{\"id\":\"bad id\"}\n"),
        api.add("b", "{\"id\":3,\"_geo\":{\"lat\":\"north\",\"lng\":0}}\n"),
        api.add("b", "{\"id\":4}\n"),
    ];
    server.faults().set_task_delay(Duration::ZERO);
    assert!(server.wait_idle(Duration::from_secs(10)));
    // Indexing fails for the whole batch: every task of it gets the `_geo` error, even the
    // one whose own error (a bad id) came first.
    let message = "Index `b`: Could not parse latitude in the document with the id: `\"3\"`. Was expecting a finite number but instead got `\"north\"`.";
    let tasks: Vec<Value> = batched
        .iter()
        .map(|uid| api.get(&format!("/tasks/{uid}")))
        .collect();
    for task in &tasks {
        assert_eq!(task["status"], "failed", "{task}");
        assert_eq!(task["error"], geo_error(message));
        assert_eq!(task["details"]["indexedDocuments"], 0);
        assert_eq!(task["batchUid"], tasks[0]["batchUid"]);
    }
    let batch = api.get(&format!("/batches/{}", tasks[0]["batchUid"]));
    assert_eq!(batch["stats"]["status"], json!({"failed": 4}));
    assert_eq!(
        batch["details"],
        json!({"receivedDocuments": 4, "indexedDocuments": 0})
    );
    let ids: Vec<Value> = server
        .documents("b")
        .iter()
        .map(|d| d["id"].clone())
        .collect();
    assert_eq!(ids, [json!(1)]);
}

#[test]
fn keep_alive_pipelining_chunked_and_expect_continue() {
    let (_server, api) = start();
    let host = api.url.trim_start_matches("http://").to_string();
    let stream = TcpStream::connect(&host).expect("connect");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut writer = stream;

    // Three pipelined requests, answered in order on one connection.
    let mut batch = Vec::new();
    write_request(&mut batch, &host, "GET", "/health", &[], None).expect("write");
    write_request(&mut batch, &host, "GET", "/nope", &[], None).expect("write");
    write_request(&mut batch, &host, "GET", "/version", &[AUTH], None).expect("write");
    writer.write_all(&batch).expect("write");
    let statuses: Vec<u16> = (0..3)
        .map(|_| read_response(&mut reader).expect("response").status)
        .collect();
    assert_eq!(statuses, [200, 404, 200]);

    // Chunked request body.
    let chunked =
        "POST /indexes/c/documents HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer MASTER_KEY\r\n\
        Content-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n\
        9\r\n{\"id\":1}\n\r\n9\r\n{\"id\":2}\n\r\n0\r\n\r\n";
    writer.write_all(chunked.as_bytes()).expect("write");
    let resp = read_response(&mut reader).expect("response");
    assert_eq!(resp.status, 202);
    assert_eq!(
        api.wait_task(resp.json()["taskUid"].as_u64().expect("uid"))["details"]
            ["receivedDocuments"],
        2
    );

    // Expect: 100-continue gets an interim answer before the body is sent.
    let body = b"{\"id\":3}";
    let head = format!(
        "POST /indexes/c/documents HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer MASTER_KEY\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        body.len()
    );
    writer.write_all(head.as_bytes()).expect("write");
    let mut line = String::new();
    reader.read_line(&mut line).expect("read");
    assert!(line.starts_with("HTTP/1.1 100"), "{line}");
    reader.read_line(&mut line).expect("read");
    writer.write_all(body).expect("write");
    assert_eq!(read_response(&mut reader).expect("response").status, 202);

    // Method not allowed on a known route; unknown routes need no key.
    let resp = send(&api.url, "DELETE", "/health", &[], None).expect("request");
    assert_eq!((resp.status, resp.body.len()), (405, 0));
}

#[test]
fn payload_limit_answers_413() {
    let server = TestServer::start_with(Config {
        max_payload_bytes: 1024,
        ..Config::default()
    })
    .expect("start");
    let url = server.url();
    let big = format!("{{\"id\":1,\"text\":\"{}\"}}\n", "x".repeat(2000));
    let headers = [("Content-Type", "application/x-ndjson")];
    let resp = send(
        &url,
        "POST",
        "/indexes/p/documents",
        &headers,
        Some(big.as_bytes()),
    )
    .expect("request");
    assert_eq!(resp.status, 413);
    assert_eq!(resp.json()["code"], "payload_too_large");
    assert_eq!(
        resp.json()["message"],
        "The provided payload reached the size limit. The maximum accepted payload size is 1 KiB."
    );
    // Over the limit once decompressed.
    let gz = [
        ("Content-Type", "application/x-ndjson"),
        ("Content-Encoding", "gzip"),
    ];
    let resp = send(
        &url,
        "POST",
        "/indexes/p/documents",
        &gz,
        Some(&gzip(big.as_bytes())),
    )
    .expect("request");
    assert_eq!(resp.status, 413);
    let small = send(
        &url,
        "POST",
        "/indexes/p/documents",
        &headers,
        Some(b"{\"id\":1}"),
    )
    .expect("request");
    assert_eq!(small.status, 202, "no master key: no auth needed");
}

#[test]
fn auth_and_content_type_errors() {
    let (_server, api) = start();
    let resp = send(&api.url, "GET", "/indexes", &[], None).expect("request");
    assert_eq!(
        (resp.status, resp.json()["code"].clone()),
        (401, json!("missing_authorization_header"))
    );
    let resp = send(
        &api.url,
        "GET",
        "/indexes",
        &[("Authorization", "Bearer nope")],
        None,
    )
    .expect("request");
    assert_eq!(
        (resp.status, resp.json()["code"].clone()),
        (403, json!("invalid_api_key"))
    );
    assert_eq!(
        send(&api.url, "GET", "/health", &[], None)
            .expect("request")
            .json(),
        json!({"status": "available"})
    );

    let resp = send(
        &api.url,
        "POST",
        "/indexes/x/documents",
        &[AUTH],
        Some(b"{}"),
    )
    .expect("request");
    assert_eq!(
        (resp.status, resp.json()["code"].clone()),
        (415, json!("missing_content_type"))
    );
    let resp = api.json("POST", "/indexes", Some(json!({"uid": "bad uid"})));
    assert_eq!(
        (resp.status, resp.json()["code"].clone()),
        (400, json!("invalid_index_uid"))
    );
    let resp = api.ndjson("POST", "/indexes/x/documents", "");
    assert_eq!(resp.json()["message"], "A ndjson payload is missing.");
    let resp = api.json("POST", "/indexes/x/search", Some(json!({"limit": "1"})));
    assert_eq!(resp.json()["code"], "invalid_search_limit");
    assert_eq!(
        api.json("GET", "/tasks/42", None).json()["code"],
        "task_not_found"
    );
    assert_eq!(
        api.json("GET", "/batches/42", None).json()["code"],
        "batch_not_found"
    );
    assert_eq!(
        api.json("GET", "/indexes/nope/documents/1", None).json()["code"],
        "index_not_found"
    );
}

#[test]
fn index_lifecycle_documents_and_search() {
    let (server, api) = start();
    let created = api.json(
        "POST",
        "/indexes",
        Some(json!({"uid": "books", "primaryKey": "id"})),
    );
    api.wait_task(created.json()["taskUid"].as_u64().expect("uid"));
    let again = api.json("POST", "/indexes", Some(json!({"uid": "books"})));
    let again = api.wait_task(again.json()["taskUid"].as_u64().expect("uid"));
    assert_eq!(again["error"]["code"], "index_already_exists");

    let settings =
        json!({"filterableAttributes": ["genre", "year", "meta"], "sortableAttributes": ["year"]});
    let task = api.json("PATCH", "/indexes/books/settings", Some(settings));
    api.wait_task(task.json()["taskUid"].as_u64().expect("uid"));
    let docs = json!([
        {"id": 1, "title": "Dune", "genre": "sf", "year": 1965, "meta": {"lang": "en"}},
        {"id": 2, "title": "Dune Messiah", "genre": "sf", "year": 1969},
        {"id": 3, "title": "Emma", "genre": "classic", "year": 1815},
        {"id": "x4", "title": "Neuromancer", "genre": "sf", "year": 1984}
    ]);
    let task = api.json("POST", "/indexes/books/documents", Some(docs));
    api.wait_task(task.json()["taskUid"].as_u64().expect("uid"));
    let task = api.json(
        "PUT",
        "/indexes/books/documents",
        Some(json!({"id": 3, "year": 1816})),
    );
    api.wait_task(task.json()["taskUid"].as_u64().expect("uid"));
    assert_eq!(
        api.get("/indexes/books/documents/3"),
        json!({"id": 3, "title": "Emma", "genre": "classic", "year": 1816})
    );

    let search = |body: Value| api.json("POST", "/indexes/books/search", Some(body)).json();
    let r = search(json!({"q": "dune", "sort": ["year:desc"], "facets": ["genre"]}));
    assert_eq!(
        r["hits"]
            .as_array()
            .map(|h| h.iter().map(|d| d["id"].clone()).collect::<Vec<_>>()),
        Some(vec![json!(2), json!(1)])
    );
    assert_eq!(r["facetDistribution"], json!({"genre": {"sf": 2}}));
    let r = search(
        json!({"filter": [["genre = classic", "year > 1980"]], "hitsPerPage": 1, "page": 2}),
    );
    assert_eq!(
        (r["totalHits"].clone(), r["totalPages"].clone()),
        (json!(2), json!(2))
    );
    let r = search(json!({"filter": "meta.lang EXISTS", "attributesToRetrieve": ["title"]}));
    assert_eq!(r["hits"], json!([{"title": "Dune"}]));
    let r = search(json!({"sort": ["title:asc"]}));
    assert_eq!(r["code"], "invalid_search_sort");
    let r = api
        .json("GET", "/indexes/books/search?q=emma&limit=1", None)
        .json();
    assert_eq!(r["hits"][0]["id"], 3);
    let multi = json!({"federation": {}, "queries": [{"indexUid": "books", "q": "emma"}, {"indexUid": "books", "q": "neuro"}]});
    let r = api.json("POST", "/multi-search", Some(multi)).json();
    assert_eq!(r["hits"].as_array().map(Vec::len), Some(2));
    assert!(r["hits"][0]["_federation"]["indexUid"] == "books");

    let fetched = api.json(
        "POST",
        "/indexes/books/documents/fetch",
        Some(json!({"filter": "genre = sf", "fields": ["id"], "limit": 2})),
    );
    assert_eq!(
        fetched.json(),
        json!({"results": [{"id": 1}, {"id": 2}], "offset": 0, "limit": 2, "total": 3})
    );
    let task = api.json(
        "POST",
        "/indexes/books/documents/delete",
        Some(json!({"filter": "year < 1900"})),
    );
    assert_eq!(
        api.wait_task(task.json()["taskUid"].as_u64().expect("uid"))["details"]["deletedDocuments"],
        1
    );
    let task = api.json("DELETE", "/indexes/books/documents/x4", None);
    api.wait_task(task.json()["taskUid"].as_u64().expect("uid"));
    assert_eq!(api.get("/indexes/books/stats")["numberOfDocuments"], 2);

    assert_eq!(
        server.index_settings("books").expect("settings")["sortableAttributes"],
        json!(["year"])
    );
    let task = api.json("DELETE", "/indexes/books", None);
    assert_eq!(
        api.wait_task(task.json()["taskUid"].as_u64().expect("uid"))["details"]["deletedDocuments"],
        2
    );
    assert!(server.index_settings("books").is_none());
    assert_eq!(api.get("/indexes")["total"], 0);
}

#[test]
fn concurrent_loads_while_polling() {
    let (server, api) = start();
    let url = api.url.clone();
    let payload = |part: u64| -> Vec<u8> {
        (part * 5_000..(part + 1) * 5_000)
            .map(|id| format!("{{\"id\":{id},\"name\":\"item {id}\",\"price\":{}.5,\"tags\":[\"a\",\"b\"]}}\n", id % 100))
            .collect::<String>()
            .into_bytes()
    };
    let started = Instant::now();
    let loaders: Vec<_> = (0..4u64)
        .map(|thread| {
            let url = url.clone();
            let bodies: Vec<Vec<u8>> = (0..5).map(|i| gzip(&payload(thread * 5 + i))).collect();
            std::thread::spawn(move || {
                let headers = [
                    AUTH,
                    ("Content-Type", "application/x-ndjson"),
                    ("Content-Encoding", "gzip"),
                ];
                bodies
                    .iter()
                    .map(|b| {
                        send(&url, "POST", "/indexes/load/documents", &headers, Some(b))
                            .expect("post")
                            .json()["taskUid"]
                            .clone()
                    })
                    .collect::<Vec<Value>>()
            })
        })
        .collect();
    let uids: Vec<String> = loaders
        .into_iter()
        .flat_map(|t| t.join().expect("loader"))
        .map(|u| u.to_string())
        .collect();
    loop {
        let polled = api.get(&format!("/tasks?uids={}&limit=100", uids.join(",")));
        let results = polled["results"].as_array().expect("results");
        assert_eq!(results.len(), uids.len());
        if results.iter().all(|t| t["status"] == "succeeded") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "load did not finish"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(api.get("/indexes/load/stats")["numberOfDocuments"], 100_000);
    let docs = server.documents("load");
    assert_eq!(
        (docs[0]["id"].clone(), docs[99_999]["id"].clone()),
        (json!(0), json!(99_999))
    );
}

#[test]
fn binary_prints_its_url_and_serves() {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_meili-test-server"))
        .args(["--port", "0", "--master-key", KEY, "--task-delay-ms", "1"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn binary");
    let mut first = String::new();
    let stdout = child.stdout.take().expect("stdout");
    BufReader::new(stdout)
        .read_line(&mut first)
        .expect("first line");
    let url = first
        .trim()
        .strip_prefix("listening on ")
        .expect("url line")
        .to_string();
    let resp = send(&url, "GET", "/version", &[AUTH], None).expect("request");
    child.kill().ok();
    child.wait().ok();
    assert_eq!(resp.json()["pkgVersion"], "1.50.0");
}

#[test]
fn dropping_the_server_closes_the_port() {
    let (server, api) = start();
    let host = api.url.trim_start_matches("http://").to_string();
    let mut idle = TcpStream::connect(&host).expect("connect");
    drop(server);
    let mut buf = [0u8; 1];
    idle.set_read_timeout(Some(Duration::from_secs(5))).ok();
    assert!(matches!(idle.read(&mut buf), Ok(0) | Err(_)));
    assert!(TcpStream::connect(&host).is_err());
}
