//! Behaviour checked against a real Meilisearch 1.50.0 (`MEILI_BIN`, started with
//! `--env development --max-indexing-threads 1`): each test quotes the requests sent to it and
//! what it answered, and expects the same from the test server.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{read_response, send, write_request, Api, Resp};
use meili_test_server::{Config, TestServer};
use serde_json::{json, Value};

const AUTH: (&str, &str) = ("Authorization", "Bearer MASTER_KEY");
const NDJSON: (&str, &str) = ("Content-Type", "application/x-ndjson");
const JSON: (&str, &str) = ("Content-Type", "application/json");

impl Api {
    fn new(server: &TestServer) -> Self {
        Api { url: server.url() }
    }

    fn ndjson(&self, method: &str, path: &str, body: &str) -> Resp {
        send(
            &self.url,
            method,
            path,
            &[AUTH, NDJSON],
            Some(body.as_bytes()),
        )
        .expect("request")
    }

    /// Sends a write and returns its task uid.
    fn enqueue(&self, resp: Resp) -> u64 {
        assert_eq!(resp.status, 202, "{}", String::from_utf8_lossy(&resp.body));
        resp.json()["taskUid"].as_u64().expect("taskUid")
    }

    fn add(&self, method: &str, path: &str, body: &str) -> u64 {
        self.enqueue(self.ndjson(method, path, body))
    }

    fn write(&self, method: &str, path: &str, body: Option<Value>) -> u64 {
        self.enqueue(self.json(method, path, body))
    }

    /// The error object of a refused request, after checking its status.
    fn refused(&self, method: &str, path: &str, body: Option<Value>, status: u16) -> Value {
        let resp = self.json(method, path, body);
        assert_eq!(resp.status, status, "{method} {path}: {}", resp.json());
        resp.json()
    }
}

fn start() -> (TestServer, Api) {
    let server = TestServer::start(Some("MASTER_KEY")).expect("start");
    let api = Api::new(&server);
    (server, api)
}

fn error(message: &str, code: &str, kind: &str) -> Value {
    json!({
        "message": message,
        "code": code,
        "type": kind,
        "link": format!("https://docs.meilisearch.com/errors#{code}")
    })
}

/// Holds the task processor on a first task (of another index) until `enqueue` has run, so that
/// what it enqueues is batched the way a busy Meilisearch batches it.
fn while_busy(server: &TestServer, api: &Api, enqueue: impl FnOnce()) {
    server.faults().set_task_delay(Duration::from_secs(30));
    let busy = api.add("POST", "/indexes/busy/documents", "{\"id\":1}\n");
    let deadline = Instant::now() + Duration::from_secs(10);
    while api.get(&format!("/tasks/{busy}"))["status"] != "processing" {
        assert!(Instant::now() < deadline, "the busy task never started");
        std::thread::sleep(Duration::from_millis(2));
    }
    enqueue();
    server.faults().set_task_delay(Duration::ZERO);
    assert!(server.wait_idle(Duration::from_secs(30)));
}

fn ids(server: &TestServer, index: &str) -> Vec<Value> {
    server
        .documents(index)
        .iter()
        .map(|d| d["id"].clone())
        .collect()
}

/// Item 1. Observed: `POST /indexes/ids/documents?primaryKey=id` with a string id of 511 `a`s
/// succeeded; with 512 (and 513) the task failed with this error.
#[test]
fn document_ids_of_512_bytes_are_invalid() {
    let (_server, api) = start();
    let long = |n: usize| format!("{{\"id\":\"{}\"}}\n", "a".repeat(n));
    let path = "/indexes/ids/documents?primaryKey=id";
    let ok = api.wait_task(api.add("POST", path, &long(511)));
    assert_eq!(ok["status"], "succeeded", "{ok}");
    let task = api.wait_task(api.add("POST", path, &long(512)));
    assert_eq!(task["status"], "failed");
    assert_eq!(
        task["details"],
        json!({"receivedDocuments": 1, "indexedDocuments": 0})
    );
    let message = format!(
        "Document identifier `\"{}\"` is invalid. A document identifier can be of type integer or string, only composed of alphanumeric characters (a-z A-Z 0-9), hyphens (-) and underscores (_), and can not be more than 511 bytes.",
        "a".repeat(512)
    );
    assert_eq!(
        task["error"],
        error(&message, "invalid_document_id", "invalid_request")
    );
}

/// The 413 error object of a document payload.
fn too_large(size: &str) -> Value {
    error(
        &format!("The provided payload reached the size limit. The maximum accepted payload size is {size}."),
        "payload_too_large",
        "invalid_request",
    )
}

/// Sends `head` and then `body` (or as much of it as the server takes) on a new connection;
/// returns whether the whole body was written and what was read back (if anything).
fn upload(url: &str, head: &str, body: &[u8]) -> (bool, Option<Resp>) {
    let mut stream = TcpStream::connect(url.trim_start_matches("http://")).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    stream.write_all(head.as_bytes()).expect("head");
    let written = body
        .chunks(64 * 1024)
        .try_for_each(|chunk| stream.write_all(chunk))
        .is_ok();
    let resp = read_response(&mut BufReader::new(stream)).ok();
    (written, resp)
}

fn post_head(path: &str, content_type: &str, length: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n"
    )
}

/// Item 2. Observed: the default limit is 100,000,000 bytes: a 100,000,000-byte body sent with
/// `Content-Length: 100000001` waited for more, the 100,000,001st byte got a 413 worded
/// "100 MB"; with `--http-payload-size-limit 1MB` the message says `1 MB`; the unit follows the
/// limit (1024 `1 KiB`, 1500 `1.5 KB`, 2560 `2.56 KB`, 2048000 `1.953125 MiB`, 1048577
/// `1.048577 MB`, 123456789 `123.456789 MB`, 999 `999 B`).
#[test]
fn payload_limit_is_100_mb_and_worded_as_meilisearch_does() {
    assert_eq!(Config::default().max_payload_bytes, 100_000_000);
    let server = TestServer::start(None).expect("start");
    let body = vec![b' '; 100_000_001];
    let head = post_head("/indexes/big/documents", "application/x-ndjson", body.len());
    let (written, resp) = upload(&server.url(), &head, &body);
    assert!(written, "a body one byte over the limit is read whole");
    let resp = resp.expect("an answer");
    assert_eq!(resp.status, 413);
    assert_eq!(resp.json(), too_large("100 MB"));
    drop(server);

    for (limit, size) in [
        (1_000_000, "1 MB"),
        (1024, "1 KiB"),
        (1500, "1.5 KB"),
        (2560, "2.56 KB"),
        (2_048_000, "1.953125 MiB"),
        (1_048_577, "1.048577 MB"),
        (123_456_789, "123.456789 MB"),
        (999, "999 B"),
    ] {
        let server = TestServer::start_with(Config {
            max_payload_bytes: limit,
            ..Config::default()
        })
        .expect("start");
        let head = format!(
            "POST /indexes/p/documents HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n",
            limit + 1
        );
        let mut body = vec![b' '; limit + 1];
        body.extend_from_slice(b"\r\n0\r\n\r\n");
        let (_, resp) = upload(&server.url(), &head, &body);
        let resp = resp.expect("an answer");
        assert_eq!(
            (resp.status, resp.json()),
            (413, too_large(size)),
            "{limit}"
        );
    }
}

/// Item 3. Observed (default limit): `Content-Length: 200000000` to `POST
/// /indexes/big/documents`, the client writing as fast as it could: after 105,130,872 bytes its
/// write failed with `BrokenPipeError`, and it could then read the 413 and an end of stream; the
/// server had answered as soon as more than the limit had arrived and closed the connection
/// without reading the rest. The same with a wrong key got the 403 after 65 KB. A 150 MB chunked
/// body was read to its end, answered 413, and a `GET /health` pipelined after it was answered
/// on the same connection. `Expect: 100-continue` with `Content-Length: 200000000` got `100
/// Continue` and then nothing until the body came.
#[test]
fn oversized_payload_is_answered_before_it_is_read_and_the_connection_closed() {
    let server = TestServer::start_with(Config {
        max_payload_bytes: 1_000_000,
        ..Config::default()
    })
    .expect("start");
    let body = vec![b' '; 50_000_000];
    let head = post_head("/indexes/p/documents", "application/x-ndjson", body.len());
    let (written, resp) = upload(&server.url(), &head, &body);
    assert!(
        !written,
        "the upload should break off (broken pipe or reset) once the server has answered"
    );
    if let Some(resp) = resp {
        assert_eq!((resp.status, resp.json()), (413, too_large("1 MB")));
    }
    let log = server.request_log();
    assert_eq!(log.last().map(|r| r.status), Some(413));

    // A chunked body is drained: the connection serves the next request.
    let host = server.url().trim_start_matches("http://").to_string();
    let stream = TcpStream::connect(&host).expect("connect");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut writer = stream;
    writer
        .write_all(b"POST /indexes/p/documents HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n")
        .expect("head");
    let chunk = vec![b' '; 500_000];
    for _ in 0..5 {
        writer
            .write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
            .expect("size");
        writer.write_all(&chunk).expect("chunk");
        writer.write_all(b"\r\n").expect("end");
    }
    writer.write_all(b"0\r\n\r\n").expect("last");
    write_request(&mut writer, &host, "GET", "/health", &[], None).expect("health");
    let resp = read_response(&mut reader).expect("413");
    assert_eq!((resp.status, resp.json()), (413, too_large("1 MB")));
    assert_eq!(read_response(&mut reader).expect("health").status, 200);

    // `Expect: 100-continue` is answered `100 Continue` whatever the announced size.
    let mut stream = TcpStream::connect(&host).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let head = "POST /indexes/p/documents HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\nContent-Length: 1000001\r\nExpect: 100-continue\r\n\r\n";
    stream.write_all(head.as_bytes()).expect("head");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut line = String::new();
    reader.read_line(&mut line).expect("interim");
    assert!(line.starts_with("HTTP/1.1 100"), "{line}");
    reader.read_line(&mut line).expect("blank line");
    stream.write_all(&vec![b' '; 1_000_001]).expect("body");
    let resp = read_response(&mut reader).expect("413");
    assert_eq!(resp.status, 413);
}

/// Item 4. Observed (default limit): `Content-Length: 100000001` to `POST
/// /indexes/big/documents/delete-batch`, no body sent: answered at once, then the connection
/// closed: 500 `{"message":"JSON payload (100000001 bytes) is larger than allowed (limit:
/// 100000000 bytes).","code":"internal","type":"internal",...}` (the same after `100
/// Continue` with `Expect: 100-continue`). A 150 MB chunked body to the same route: 413
/// `{"message":"JSON payload has exceeded limit (100000000 bytes).","code":"payload_too_large",
/// "type":"invalid_request",...}`.
#[test]
fn oversized_json_bodies_are_refused_as_actix_refuses_them() {
    let server = TestServer::start_with(Config {
        max_payload_bytes: 1000,
        ..Config::default()
    })
    .expect("start");
    let host = server.url().trim_start_matches("http://").to_string();
    for path in [
        "/indexes/p/documents/delete-batch",
        "/indexes/p/settings",
        "/indexes/p/search",
    ] {
        let method = if path.ends_with("settings") {
            "PATCH"
        } else {
            "POST"
        };
        let mut stream = TcpStream::connect(&host).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).expect("head");
        // Nothing of the body is sent: the answer must not wait for it.
        let mut reader = BufReader::new(stream);
        let resp = read_response(&mut reader).expect("answered before the body");
        assert_eq!(resp.status, 500, "{path}");
        assert_eq!(resp.header("content-type"), Some("application/json"));
        assert_eq!(
            resp.json(),
            error(
                "JSON payload (5000 bytes) is larger than allowed (limit: 1000 bytes).",
                "internal",
                "internal"
            )
        );
        let mut rest = Vec::new();
        assert_eq!(
            reader.read_to_end(&mut rest).ok(),
            Some(0),
            "the connection is closed"
        );
    }

    let big = json!(vec!["x"; 500]).to_string();
    let chunked = format!(
        "POST /indexes/p/documents/delete-batch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{big}\r\n0\r\n\r\n",
        big.len()
    );
    let (_, resp) = upload(&server.url(), &chunked, &[]);
    let resp = resp.expect("answer");
    assert_eq!(resp.status, 413);
    assert_eq!(
        resp.json(),
        error(
            "JSON payload has exceeded limit (1000 bytes).",
            "payload_too_large",
            "invalid_request"
        )
    );
    let small = send(
        &server.url(),
        "POST",
        "/indexes/p/documents/delete-batch",
        &[JSON],
        Some(b"[1]"),
    )
    .expect("request");
    assert_eq!(small.status, 202);
}

fn geo_error(message: &str) -> Value {
    error(message, "invalid_document_geo_field", "invalid_request")
}

/// Item 5, a bad `_geo`. Observed: index `ab` with `sortableAttributes: ["_geo"]` and documents
/// 10, 11, 12; while another index's 60,000 documents were indexing, tasks 3-7 were enqueued:
/// `POST {"id":20}`, `PUT {"id":21}`, `POST .../delete-batch [10, "11"]`, `POST
/// {"id":22,"_geo":{"lat":"north","lng":0}}`, `POST {"id":23}`. They ran as batch 3 (5 tasks,
/// types `{"documentAdditionOrUpdate":4,"documentDeletion":1}`), all failed with "Index `ab`:
/// Could not parse latitude in the document with the id: `\"22\"`. Was expecting a finite
/// number but instead got `\"north\"`.", the deletion's details `{"providedIds":2,
/// "deletedDocuments":0,"originalFilter":null}`, the batch's `{"receivedDocuments":4,
/// "indexedDocuments":0,"providedIds":2,"deletedDocuments":0}`; the index still held 10, 11, 12.
#[test]
fn additions_updates_and_deletions_batch_together_and_a_bad_geo_fails_them_all() {
    let (server, api) = start();
    let settings = api.write(
        "PATCH",
        "/indexes/ab/settings",
        Some(json!({"sortableAttributes": ["_geo"]})),
    );
    api.wait_task(settings);
    let seed = api.add(
        "POST",
        "/indexes/ab/documents?primaryKey=id",
        "{\"id\":10}\n{\"id\":11}\n{\"id\":12}\n",
    );
    api.wait_task(seed);
    let mut uids = Vec::new();
    while_busy(&server, &api, || {
        let docs = "/indexes/ab/documents";
        uids.push(api.add("POST", docs, "{\"id\":20}\n"));
        uids.push(api.add("PUT", docs, "{\"id\":21}\n"));
        uids.push(api.write(
            "POST",
            "/indexes/ab/documents/delete-batch",
            Some(json!([10, "11"])),
        ));
        let bad = "{\"id\":22,\"_geo\":{\"lat\":\"north\",\"lng\":0}}\n";
        uids.push(api.add("POST", docs, bad));
        uids.push(api.add("POST", docs, "{\"id\":23}\n"));
    });
    let message = "Index `ab`: Could not parse latitude in the document with the id: `\"22\"`. Was expecting a finite number but instead got `\"north\"`.";
    let tasks: Vec<Value> = uids
        .iter()
        .map(|uid| api.get(&format!("/tasks/{uid}")))
        .collect();
    for task in &tasks {
        assert_eq!(task["status"], "failed", "{task}");
        assert_eq!(task["error"], geo_error(message));
        assert_eq!(task["batchUid"], tasks[0]["batchUid"]);
    }
    assert_eq!(
        tasks[2]["details"],
        json!({"providedIds": 2, "deletedDocuments": 0, "originalFilter": null})
    );
    let batch = api.get(&format!("/batches/{}", tasks[0]["batchUid"]));
    assert_eq!(batch["stats"]["totalNbTasks"], 5);
    assert_eq!(
        batch["stats"]["types"],
        json!({"documentAdditionOrUpdate": 4, "documentDeletion": 1})
    );
    assert_eq!(
        batch["details"],
        json!({"receivedDocuments": 4, "indexedDocuments": 0, "providedIds": 2, "deletedDocuments": 0})
    );
    assert_eq!(ids(&server, "ab"), [json!(10), json!(11), json!(12)]);
}

/// Item 5, a batch that succeeds. Observed: index `mix` with documents 1 and 2 (primary key
/// `id`); enqueued while busy: 19 `POST {"id":30,"a":1}`, 20 delete-batch `[30, 1, 99]`, 21
/// `PUT {"id":30,"b":2}{"id":2,"b":2}`, 22 `POST ?primaryKey=id {"id":31}`, 23 `POST
/// {"id":"bad id"}`, 24 delete-batch `[31]`, 25 `POST ?primaryKey=other {"id":32}`. Tasks 19-24
/// ran as one batch: 19 indexed 1, 20 `{"providedIds":3,"deletedDocuments":3}`, 21 indexed 2,
/// 22 indexed 1, 23 failed alone (`invalid_document_id`), 24 deleted 1; batch details
/// `{"receivedDocuments":5,"indexedDocuments":4,"providedIds":4,"deletedDocuments":4}`. Task 25
/// ran in a batch of its own ("stopped batching before task with id 25 because its primary key
/// `other` is different from the primary key of the index `id`") and failed with "Index
/// already has a primary key: `id`.". The index held `{"id":2,"b":2}` and `{"id":30,"b":2}`.
/// Index `d2` (documents 1, 2): delete-batch `[1, 99, 1]` then `POST {"id":5}` ran as one
/// batch, the deletion with `{"providedIds":3,"deletedDocuments":2}`.
#[test]
fn a_mixed_document_batch_applies_its_tasks_in_order() {
    let (server, api) = start();
    let seed = "{\"id\":1}\n{\"id\":2}\n";
    api.wait_task(api.add("POST", "/indexes/mix/documents?primaryKey=id", seed));
    api.wait_task(api.add("POST", "/indexes/d2/documents?primaryKey=id", seed));
    let mut uids = Vec::new();
    while_busy(&server, &api, || {
        let docs = "/indexes/mix/documents";
        let delete = "/indexes/mix/documents/delete-batch";
        uids.push(api.add("POST", docs, "{\"id\":30,\"a\":1}\n"));
        uids.push(api.write("POST", delete, Some(json!([30, 1, 99]))));
        uids.push(api.add("PUT", docs, "{\"id\":30,\"b\":2}\n{\"id\":2,\"b\":2}\n"));
        uids.push(api.add("POST", &format!("{docs}?primaryKey=id"), "{\"id\":31}\n"));
        uids.push(api.add("POST", docs, "{\"id\":\"bad id\"}\n"));
        uids.push(api.write("POST", delete, Some(json!([31]))));
        uids.push(api.add("POST", &format!("{docs}?primaryKey=other"), "{\"id\":32}\n"));
        uids.push(api.write(
            "POST",
            "/indexes/d2/documents/delete-batch",
            Some(json!([1, 99, 1])),
        ));
        uids.push(api.add("POST", "/indexes/d2/documents", "{\"id\":5}\n"));
    });
    let tasks: Vec<Value> = uids
        .iter()
        .map(|uid| api.get(&format!("/tasks/{uid}")))
        .collect();
    let added = |n: u64| json!({"receivedDocuments": n, "indexedDocuments": n});
    let deleted = |provided: u64, n: u64| json!({"providedIds": provided, "deletedDocuments": n, "originalFilter": null});
    assert_eq!(tasks[0]["details"], added(1));
    assert_eq!(tasks[1]["details"], deleted(3, 3));
    assert_eq!(tasks[2]["details"], added(2));
    assert_eq!(tasks[3]["details"], added(1));
    assert_eq!(tasks[4]["status"], "failed");
    assert_eq!(tasks[4]["error"]["code"], "invalid_document_id");
    assert_eq!(tasks[5]["details"], deleted(1, 1));
    for task in &tasks[..6] {
        assert_eq!(task["batchUid"], tasks[0]["batchUid"], "{task}");
    }
    let batch = api.get(&format!("/batches/{}", tasks[0]["batchUid"]));
    assert_eq!(
        batch["details"],
        json!({"receivedDocuments": 5, "indexedDocuments": 4, "providedIds": 4, "deletedDocuments": 4})
    );
    assert_ne!(tasks[6]["batchUid"], tasks[0]["batchUid"]);
    assert_eq!(
        tasks[6]["error"],
        error(
            "Index already has a primary key: `id`.",
            "index_primary_key_already_exists",
            "invalid_request"
        )
    );
    assert_eq!(
        server.documents("mix"),
        [json!({"id": 2, "b": 2}), json!({"id": 30, "b": 2})]
    );
    assert_eq!(tasks[7]["batchUid"], tasks[8]["batchUid"]);
    assert_eq!(tasks[7]["details"], deleted(3, 2));
    assert_eq!(ids(&server, "d2"), [json!(2), json!(5)]);
}

/// Item 6. Observed: index `del` with documents 1, 2; enqueued while busy: 10 `POST {"id":3}`,
/// 11 `PATCH settings {"filterableAttributes":["x"]}`, 12 delete-batch `[1]`, 13 `DELETE
/// .../documents`, 14 `POST .../documents/delete {"filter":"x = 1"}`, 15 `DELETE /indexes/del`,
/// 16 `POST {"id":4}`. Batches: [10], [11], [12, 13, 14, 15], [16]. In the third every task
/// succeeded without being applied: 12 `{"providedIds":1,"deletedDocuments":0,
/// "originalFilter":null}`, 13 `{"deletedDocuments":null}`, 14 `{"providedIds":0,
/// "deletedDocuments":0,"originalFilter":"\"x = 1\""}`, 15 `{"deletedDocuments":3}`; batch
/// details `{"providedIds":1,"deletedDocuments":3,"originalFilter":"\"x = 1\""}`. Index `u1`
/// (missing): `POST {"id":1}` then `DELETE /indexes/u1` ran as one batch, both succeeded
/// (`indexedDocuments` 0, `deletedDocuments` 0), and no index was left.
#[test]
fn an_index_deletion_absorbs_the_tasks_batched_before_it() {
    let (server, api) = start();
    let seed = "{\"id\":1}\n{\"id\":2}\n";
    api.wait_task(api.add("POST", "/indexes/del/documents?primaryKey=id", seed));
    let mut uids = Vec::new();
    while_busy(&server, &api, || {
        uids.push(api.add("POST", "/indexes/del/documents", "{\"id\":3}\n"));
        uids.push(api.write(
            "PATCH",
            "/indexes/del/settings",
            Some(json!({"filterableAttributes": ["x"]})),
        ));
        uids.push(api.write(
            "POST",
            "/indexes/del/documents/delete-batch",
            Some(json!([1])),
        ));
        uids.push(api.write("DELETE", "/indexes/del/documents", None));
        uids.push(api.write(
            "POST",
            "/indexes/del/documents/delete",
            Some(json!({"filter": "x = 1"})),
        ));
        uids.push(api.write("DELETE", "/indexes/del", None));
        uids.push(api.add("POST", "/indexes/del/documents", "{\"id\":4}\n"));
        uids.push(api.add(
            "POST",
            "/indexes/u1/documents?primaryKey=id",
            "{\"id\":1}\n",
        ));
        uids.push(api.write("DELETE", "/indexes/u1", None));
    });
    let tasks: Vec<Value> = uids
        .iter()
        .map(|uid| api.get(&format!("/tasks/{uid}")))
        .collect();
    assert!(
        tasks.iter().all(|t| t["status"] == "succeeded"),
        "{tasks:?}"
    );
    let batch = |i: usize| tasks[i]["batchUid"].clone();
    assert_ne!(batch(0), batch(1));
    assert_ne!(batch(1), batch(2));
    assert!((3..=5).all(|i| batch(i) == batch(2)));
    assert_ne!(batch(6), batch(5));
    assert_eq!(
        tasks[2]["details"],
        json!({"providedIds": 1, "deletedDocuments": 0, "originalFilter": null})
    );
    assert_eq!(tasks[3]["details"], json!({"deletedDocuments": null}));
    assert_eq!(
        tasks[4]["details"],
        json!({"providedIds": 0, "deletedDocuments": 0, "originalFilter": "\"x = 1\""})
    );
    assert_eq!(tasks[5]["details"], json!({"deletedDocuments": 3}));
    assert_eq!(
        api.get(&format!("/batches/{}", batch(2)))["details"],
        json!({"providedIds": 1, "deletedDocuments": 3, "originalFilter": "\"x = 1\""})
    );
    assert_eq!(ids(&server, "del"), [json!(4)]);

    assert_eq!(batch(7), batch(8));
    assert_eq!(
        tasks[7]["details"],
        json!({"receivedDocuments": 1, "indexedDocuments": 0})
    );
    assert_eq!(tasks[8]["details"], json!({"deletedDocuments": 0}));
    assert_eq!(api.json("GET", "/indexes/u1", None).status, 404);
}

/// Item 7. Observed: 64 `POST /indexes/sa/documents`, 65 `POST /indexes/sb/documents`, 66 swap
/// `sa`/`sb`, 67 `POST /indexes/sa/documents`, 68 the same swap (so 67 is now filed under
/// `sb`). `GET /tasks?indexUids=sa&limit=1`: `{"results":[],"total":3,"limit":1,"from":null,
/// "next":null}`; `limit=2`: task 64 alone, `next` null; `GET /tasks?indexUids=sa,sb&limit=3`:
/// 67 and 65, `total` 5, `next` null. `GET /batches?indexUids=sa&limit=1` listed the batch of
/// swap 68, `next` set.
#[test]
fn task_listings_apply_limit_before_leaving_swaps_out() {
    let (_server, api) = start();
    let first = api.add(
        "POST",
        "/indexes/sa/documents?primaryKey=id",
        "{\"id\":1}\n",
    );
    api.wait_task(first);
    api.wait_task(api.add(
        "POST",
        "/indexes/sb/documents?primaryKey=id",
        "{\"id\":1}\n",
    ));
    let swap = json!([{"indexes": ["sa", "sb"]}]);
    api.wait_task(api.write("POST", "/swap-indexes", Some(swap.clone())));
    api.wait_task(api.add("POST", "/indexes/sa/documents", "{\"id\":2}\n"));
    let last = api.write("POST", "/swap-indexes", Some(swap));
    api.wait_task(last);
    let page = |query: &str| {
        let page = api.get(&format!("/tasks?{query}"));
        let uids: Vec<u64> = page["results"]
            .as_array()
            .expect("results")
            .iter()
            .filter_map(|t| t["uid"].as_u64())
            .collect();
        (
            uids,
            page["total"].clone(),
            page["from"].clone(),
            page["next"].clone(),
        )
    };
    assert_eq!(
        page("indexUids=sa&limit=1"),
        (vec![], json!(3), Value::Null, Value::Null)
    );
    assert_eq!(
        page("indexUids=sa&limit=2"),
        (vec![first], json!(3), json!(first), Value::Null)
    );
    assert_eq!(
        page("indexUids=sa,sb&limit=3"),
        (
            vec![first + 3, first + 1],
            json!(5),
            json!(first + 3),
            Value::Null
        )
    );
    // Unlike tasks, batches of swaps are listed.
    let batches = api.get("/batches?indexUids=sa&limit=1");
    assert_eq!(
        batches["results"][0]["details"]["swaps"][0]["indexes"],
        json!(["sa", "sb"])
    );
    assert!(batches["next"].is_u64(), "{batches}");
}

/// Item 8. Observed on 1.50, all 400 `bad_request` (`invalid_request`).
#[test]
fn unknown_query_parameters_are_refused() {
    let (_server, api) = start();
    api.wait_task(api.add(
        "POST",
        "/indexes/cm/documents?primaryKey=id",
        "{\"id\":1}\n",
    ));
    let tasks = "`limit`, `from`, `reverse`, `batchUids`, `uids`, `canceledBy`, `types`, `statuses`, `indexUids`, `afterEnqueuedAt`, `beforeEnqueuedAt`, `afterStartedAt`, `beforeStartedAt`, `afterFinishedAt`, `beforeFinishedAt`";
    let cases = [
        ("GET", "/tasks?foo=1", format!("Unknown parameter `foo`: expected one of {tasks}")),
        ("GET", "/tasks?limit=1&foo=1&bar=2", format!("Unknown parameter `foo`: expected one of {tasks}")),
        ("GET", "/tasks?Limit=1", format!("Unknown parameter `Limit`: did you mean `limit`? expected one of {tasks}")),
        ("GET", "/tasks?limt=1", format!("Unknown parameter `limt`: did you mean `limit`? expected one of {tasks}")),
        ("GET", "/tasks?lim=1", format!("Unknown parameter `lim`: expected one of {tasks}")),
        ("GET", "/tasks?statuse=1", format!("Unknown parameter `statuse`: did you mean `statuses`? expected one of {tasks}")),
        ("GET", "/tasks?foo", format!("Unknown parameter `foo`: expected one of {tasks}")),
        ("GET", "/batches?foo=1", format!("Unknown parameter `foo`: expected one of {tasks}")),
        ("GET", "/tasks?foo=1&limit=abc", format!("Unknown parameter `foo`: expected one of {tasks}")),
        ("GET", "/indexes?foo=1", "Unknown parameter `foo`: expected one of `offset`, `limit`".to_string()),
        ("GET", "/indexes/cm/documents?foo=1", "Unknown parameter `foo`: expected one of `offset`, `limit`, `fields`, `retrieveVectors`, `ids`, `filter`, `sort`, `useNetwork`".to_string()),
        ("GET", "/indexes/cm/documents/1?foo=1", "Unknown parameter `foo`: expected one of `fields`, `retrieveVectors`, `useNetwork`".to_string()),
        ("GET", "/indexes/cm/search?foo=1", "Unknown parameter `foo`: expected one of `q`, `offset`, `limit`, `page`, `hitsPerPage`, `attributesToRetrieve`, `attributesToCrop`, `cropLength`, `cropMarker`, `attributesToHighlight`, `highlightPreTag`, `highlightPostTag`, `showMatchesPosition`, `filter`, `sort`, `distinct`, `facets`, `matchingStrategy`, `attributesToSearchOn`, `rankingScoreThreshold`, `locales`, `hybridEmbedder`, `hybridSemanticRatio`, `vector`, `retrieveVectors`, `personalizeUserContext`, `useNetwork`, `showRankingScore`, `showRankingScoreDetails`, `showPerformanceDetails`".to_string()),
        ("GET", "/stats?foo=1", "Unknown parameter `foo`: expected one of `showInternalDatabaseSizes`, `sizeFormat`".to_string()),
        ("GET", "/indexes/cm/stats?foo=1", "Unknown parameter `foo`: expected one of `showInternalDatabaseSizes`, `sizeFormat`".to_string()),
        ("DELETE", "/indexes/cm/documents?foo=1", "Unknown parameter `foo`: expected one of `customMetadata`".to_string()),
        ("DELETE", "/indexes/cm/documents/1?foo=1", "Unknown parameter `foo`: expected one of `customMetadata`".to_string()),
    ];
    for (method, path, message) in cases {
        let body = api.refused(method, path, None, 400);
        assert_eq!(
            body,
            error(&message, "bad_request", "invalid_request"),
            "{path}"
        );
    }
    let body = api.refused(
        "POST",
        "/indexes/cm/documents/delete-batch?foo=1",
        Some(json!([1])),
        400,
    );
    assert_eq!(
        body["message"],
        "Unknown parameter `foo`: expected one of `customMetadata`"
    );
    let body = api.refused(
        "POST",
        "/indexes/cm/documents/delete?foo=1",
        Some(json!({"filter": "id = 1"})),
        400,
    );
    assert_eq!(
        body["message"],
        "Unknown parameter `foo`: expected one of `customMetadata`"
    );
    for method in ["POST", "PUT"] {
        let resp = api.ndjson(method, "/indexes/cm/documents?foo=1", "{\"id\":9}\n");
        assert_eq!(resp.status, 400);
        assert_eq!(
            resp.json()["message"],
            "Unknown parameter `foo`: expected one of `primaryKey`, `csvDelimiter`, `customMetadata`, `skipCreation`"
        );
    }
    // A bad value before the unknown name is reported first.
    let body = api.refused("GET", "/tasks?limit=abc&foo=1", None, 400);
    assert_eq!(body["code"], "invalid_task_limit");
    let body = api.refused("GET", "/indexes/cm/documents?offset=-1&foo=1", None, 400);
    assert_eq!(body["code"], "invalid_document_offset");
    // Routes that take no query parameters ignore them.
    for path in [
        "/indexes/cm?foo=1",
        "/indexes/cm/settings?foo=1",
        "/tasks/0?foo=1",
        "/health?foo=1",
        "/version?foo=1",
    ] {
        assert_eq!(api.json("GET", path, None).status, 200, "{path}");
    }
    let resp = api.json("POST", "/indexes/cm/search?foo=1", Some(json!({})));
    assert_eq!(resp.status, 200);
    let resp = api.json("PATCH", "/indexes/cm/settings?foo=1", Some(json!({})));
    assert_eq!(resp.status, 202);
}

/// Item 9. Observed on 1.50 with `PATCH /indexes/cm/settings` (and the sub-routes), all 400.
#[test]
fn nested_settings_are_validated() {
    let (server, api) = start();
    let typo = "invalid_settings_typo_tolerance";
    let faceting = "invalid_settings_faceting";
    let pagination = "invalid_settings_pagination";
    let typo_fields = "`enabled`, `minWordSizeForTypos`, `disableOnWords`, `disableOnAttributes`, `disableOnNumbers`";
    let cases = [
        (json!({"typoTolerance": {"enabled": "yes"}}), typo, "Invalid value type at `.typoTolerance.enabled`: expected a boolean, but found a string: `\"yes\"`".to_string()),
        (json!({"typoTolerance": {"foo": 1}}), typo, format!("Unknown field `foo` inside `.typoTolerance`: expected one of {typo_fields}")),
        (json!({"typoTolerance": {"enable": true}}), typo, format!("Unknown field `enable` inside `.typoTolerance`: did you mean `enabled`? expected one of {typo_fields}")),
        (json!({"typoTolerance": {"minWordSizeForTypos": {"oneTypo": "5"}}}), typo, "Invalid value type at `.typoTolerance.minWordSizeForTypos.oneTypo`: expected a positive integer, but found a string: `\"5\"`".to_string()),
        (json!({"typoTolerance": {"minWordSizeForTypos": {"oneTypo": -1}}}), typo, "Invalid value type at `.typoTolerance.minWordSizeForTypos.oneTypo`: expected a positive integer, but found a negative integer: `-1`".to_string()),
        (json!({"typoTolerance": {"minWordSizeForTypos": {"oneTypo": 300}}}), typo, "Invalid value at `.typoTolerance.minWordSizeForTypos.oneTypo`: value: `300` is too large to be deserialized, maximum value authorized is `255`".to_string()),
        (json!({"typoTolerance": {"minWordSizeForTypos": {"oneTypo": 6, "twoTypos": 5}}}), typo, "Invalid value at `.typoTolerance.minWordSizeForTypos`: `minWordSizeForTypos` setting is invalid. `oneTypo` and `twoTypos` fields should be between `0` and `255`, and `twoTypos` should be greater or equals to `oneTypo` but found `oneTypo: 6` and twoTypos: 5`.".to_string()),
        (json!({"typoTolerance": {"minWordSizeForTypos": {"three": 1}}}), typo, "Unknown field `three` inside `.typoTolerance.minWordSizeForTypos`: expected one of `oneTypo`, `twoTypos`".to_string()),
        (json!({"typoTolerance": {"minWordSizeForTypos": 5}}), typo, "Invalid value type at `.typoTolerance.minWordSizeForTypos`: expected an object, but found a positive integer: `5`".to_string()),
        (json!({"typoTolerance": {"disableOnWords": "x"}}), typo, "Invalid value type at `.typoTolerance.disableOnWords`: expected an array, but found a string: `\"x\"`".to_string()),
        (json!({"typoTolerance": {"disableOnWords": [1]}}), typo, "Invalid value type at `.typoTolerance.disableOnWords[0]`: expected a string, but found a positive integer: `1`".to_string()),
        (json!({"typoTolerance": {"disableOnNumbers": 1}}), typo, "Invalid value type at `.typoTolerance.disableOnNumbers`: expected a boolean, but found a positive integer: `1`".to_string()),
        (json!({"typoTolerance": {"enabled": "x", "foo": 1}}), typo, "Invalid value type at `.typoTolerance.enabled`: expected a boolean, but found a string: `\"x\"`".to_string()),
        (json!({"typoTolerance": []}), typo, "Invalid value type at `.typoTolerance`: expected an object, but found an array: `[]`".to_string()),
        (json!({"faceting": {"maxValuesPerFacet": "1"}}), faceting, "Invalid value type at `.faceting.maxValuesPerFacet`: expected a positive integer, but found a string: `\"1\"`".to_string()),
        (json!({"faceting": {"maxValuesPerFacet": -1}}), faceting, "Invalid value type at `.faceting.maxValuesPerFacet`: expected a positive integer, but found a negative integer: `-1`".to_string()),
        (json!({"faceting": {"sortFacetValuesBy": {"*": "asc"}}}), faceting, "Unknown value `asc` at `.faceting.sortFacetValuesBy.*`: expected one of `alpha`, `count`".to_string()),
        (json!({"faceting": {"sortFacetValuesBy": {"*": "alph"}}}), faceting, "Unknown value `alph` at `.faceting.sortFacetValuesBy.*`: did you mean `alpha`? expected one of `alpha`, `count`".to_string()),
        (json!({"faceting": {"sortFacetValuesBy": "alpha"}}), faceting, "Invalid value type at `.faceting.sortFacetValuesBy`: expected an object, but found a string: `\"alpha\"`".to_string()),
        (json!({"faceting": {"sortFacetValuesBy": {"a": 1}}}), faceting, "Invalid value type at `.faceting.sortFacetValuesBy.a`: expected a string, but found a positive integer: `1`".to_string()),
        (json!({"faceting": {"sortFacetValuesBy": {"a": null}}}), faceting, "Invalid value type at `.faceting.sortFacetValuesBy.a`: expected a string, but found null".to_string()),
        (json!({"faceting": {"foo": 1}}), faceting, "Unknown field `foo` inside `.faceting`: expected one of `maxValuesPerFacet`, `sortFacetValuesBy`".to_string()),
        (json!({"pagination": {"maxTotalHits": "1"}}), pagination, "Invalid value type at `.pagination.maxTotalHits`: expected a positive integer, but found a string: `\"1\"`".to_string()),
        (json!({"pagination": {"maxTotalHits": -5}}), pagination, "Invalid value type at `.pagination.maxTotalHits`: expected a positive integer, but found a negative integer: `-5`".to_string()),
        (json!({"pagination": {"maxTotalHits": 1.5}}), pagination, "Invalid value type at `.pagination.maxTotalHits`: expected a positive integer, but found a number: `1.5`".to_string()),
        (json!({"pagination": {"maxTotalHits": 0}}), pagination, "Invalid value at `.pagination.maxTotalHits`: a non-zero integer value lower than `18446744073709551615` was expected, but found a zero".to_string()),
        (json!({"pagination": {"foo": 1}}), pagination, "Unknown field `foo` inside `.pagination`: expected one of `maxTotalHits`".to_string()),
        (json!({"pagination": "x"}), pagination, "Invalid value type at `.pagination`: expected an object, but found a string: `\"x\"`".to_string()),
        (json!({"filterableAtributes": []}), "bad_request", "Unknown field `filterableAtributes`: did you mean `filterableAttributes`? expected one of `displayedAttributes`, `searchableAttributes`, `filterableAttributes`, `sortableAttributes`, `foreignKeys`, `rankingRules`, `stopWords`, `nonSeparatorTokens`, `separatorTokens`, `dictionary`, `synonyms`, `distinctAttribute`, `proximityPrecision`, `typoTolerance`, `faceting`, `pagination`, `embedders`, `searchCutoffMs`, `localizedAttributes`, `facetSearch`, `prefixSearch`, `chat`".to_string()),
    ];
    // (Fields are checked in the order sent; serde_json here sorts object keys, so only cases
    // whose keys are sorted already can show it.)
    for (body, code, message) in cases {
        let refused = api.refused("PATCH", "/indexes/cm/settings", Some(body.clone()), 400);
        assert_eq!(refused, error(&message, code, "invalid_request"), "{body}");
    }
    // The sub-routes report from the root of their body.
    let sub = [
        ("typo-tolerance", json!({"foo": 1}), format!("Unknown field `foo`: expected one of {typo_fields}")),
        ("typo-tolerance", json!({"enabled": "x"}), "Invalid value type at `.enabled`: expected a boolean, but found a string: `\"x\"`".to_string()),
        ("typo-tolerance", json!({"minWordSizeForTypos": {"oneTyp": 3}}), "Unknown field `oneTyp` inside `.minWordSizeForTypos`: did you mean `oneTypo`? expected one of `oneTypo`, `twoTypos`".to_string()),
        ("pagination", json!({"maxTotalHits": 0}), "Invalid value at `.maxTotalHits`: a non-zero integer value lower than `18446744073709551615` was expected, but found a zero".to_string()),
        ("faceting", json!({"sortFacetValuesBy": {"*": "x"}}), "Unknown value `x` at `.sortFacetValuesBy.*`: expected one of `alpha`, `count`".to_string()),
        ("faceting", json!([]), "Invalid value type: expected an object, but found an array: `[]`".to_string()),
    ];
    for (route, body, message) in sub {
        let path = format!("/indexes/cm/settings/{route}");
        let refused = api.refused("PATCH", &path, Some(body.clone()), 400);
        assert_eq!(refused["message"], message, "{route} {body}");
    }
    // Nulls reset and pass.
    for body in [
        json!({"typoTolerance": {"disableOnAttributes": null, "enabled": null}}),
        json!({"pagination": {"maxTotalHits": null}}),
        json!({"faceting": {"maxValuesPerFacet": null, "sortFacetValuesBy": null}}),
        json!({"typoTolerance": {"minWordSizeForTypos": {"oneTypo": null}}}),
    ] {
        let task = api.wait_task(api.write("PATCH", "/indexes/cm/settings", Some(body.clone())));
        assert_eq!(task["status"], "succeeded", "{body}: {task}");
    }
    // `minWordSizeForTypos` merges field by field; `oneTypo` above the stored `twoTypos` fails
    // the task (observed: "Index `cm`: `minWordSizeForTypos` setting is invalid. ... but found
    // `oneTypo: 10` and twoTypos: 9`.").
    let patch = |body: Value| api.wait_task(api.write("PATCH", "/indexes/cm/settings", Some(body)));
    let task = patch(json!({"typoTolerance": {"minWordSizeForTypos": {"oneTypo": 10}}}));
    assert_eq!(task["status"], "failed");
    assert_eq!(
        task["error"],
        error(
            "Index `cm`: `minWordSizeForTypos` setting is invalid. `oneTypo` and `twoTypos` fields should be between `0` and `255`, and `twoTypos` should be greater or equals to `oneTypo` but found `oneTypo: 10` and twoTypos: 9`.",
            typo,
            "invalid_request"
        )
    );
    patch(json!({"typoTolerance": {"minWordSizeForTypos": {"twoTypos": 12}}}));
    patch(json!({"typoTolerance": {"minWordSizeForTypos": {"oneTypo": 3}}}));
    let settings = server.index_settings("cm").expect("settings");
    // The defaults of a fresh 1.50 index, with the sizes patched.
    assert_eq!(
        settings["typoTolerance"],
        json!({"enabled": true, "minWordSizeForTypos": {"oneTypo": 3, "twoTypos": 12}, "disableOnWords": [], "disableOnAttributes": [], "disableOnNumbers": false})
    );
    assert_eq!(
        settings["rankingRules"],
        json!([
            "words",
            "typo",
            "proximity",
            "attributeRank",
            "sort",
            "wordPosition",
            "exactness"
        ])
    );
}

/// Item 10. Observed: `POST /indexes/cm/documents?primaryKey=id&customMetadata=my-meta-1`
/// answered `{"taskUid":44,"indexUid":"cm","status":"enqueued","type":
/// "documentAdditionOrUpdate","enqueuedAt":"...","customMetadata":"my-meta-1"}` and the task
/// ends with `"finishedAt":"...","customMetadata":"my-meta-1"`; the same for delete-batch
/// (`customMetadata=del%20meta` shown as `"del meta"`), `PUT` (`customMetadata=` as `""`),
/// `DELETE .../documents/2`, `DELETE .../documents` and `POST .../documents/delete`; a
/// settings `PATCH` with `customMetadata=s` was accepted without it.
#[test]
fn custom_metadata_is_shown_in_document_tasks() {
    let (_server, api) = start();
    let resp = api.ndjson(
        "POST",
        "/indexes/cm/documents?primaryKey=id&customMetadata=my-meta-1",
        "{\"id\":1}\n",
    );
    let summary = String::from_utf8_lossy(&resp.body).into_owned();
    assert!(
        summary.ends_with(",\"customMetadata\":\"my-meta-1\"}"),
        "{summary}"
    );
    let uid = api.enqueue(resp);
    let task = api.wait_task(uid);
    let text =
        String::from_utf8_lossy(&api.json("GET", &format!("/tasks/{uid}"), None).body).into_owned();
    assert!(
        text.ends_with(",\"customMetadata\":\"my-meta-1\"}"),
        "{text}"
    );
    assert_eq!(task["status"], "succeeded");

    let writes = [
        (
            "POST",
            "/indexes/cm/documents/delete-batch?customMetadata=del%20meta",
            Some(json!([1])),
            "del meta",
        ),
        (
            "DELETE",
            "/indexes/cm/documents/2?customMetadata=x",
            None,
            "x",
        ),
        (
            "DELETE",
            "/indexes/cm/documents?customMetadata=y",
            None,
            "y",
        ),
        (
            "POST",
            "/indexes/cm/documents/delete?customMetadata=z",
            Some(json!({"filter": "id = 1"})),
            "z",
        ),
    ];
    for (method, path, body, metadata) in writes {
        let resp = api.json(method, path, body);
        assert_eq!(resp.json()["customMetadata"], metadata, "{path}");
        let task = api.wait_task(api.enqueue(resp));
        assert_eq!(task["customMetadata"], metadata, "{path}");
    }
    let resp = api.ndjson(
        "PUT",
        "/indexes/cm/documents?customMetadata=",
        "{\"id\":2}\n",
    );
    assert_eq!(resp.json()["customMetadata"], "");
    let plain = api.ndjson("PUT", "/indexes/cm/documents", "{\"id\":3}\n");
    assert!(plain.json().get("customMetadata").is_none());
    let task = api.wait_task(api.enqueue(plain));
    assert!(task.get("customMetadata").is_none(), "{task}");
    let settings = api.json(
        "PATCH",
        "/indexes/cm/settings?customMetadata=s",
        Some(json!({})),
    );
    assert_eq!(settings.status, 202);
    assert!(settings.json().get("customMetadata").is_none());
}

/// Item 11. Observed with the data directory on a full 30 MB tmpfs: `POST /indexes
/// {"uid":"g"}`, `PATCH /indexes/pre/settings` and `POST /indexes/pre/documents/delete-batch`
/// answered 422 `{"message":"No space left on device (os error 28)","code":
/// "no_space_left_on_device","type":"system",...}`; `POST /indexes/f/documents` (NDJSON) 500
/// `{"message":"Error while receiving the playload. `No space left on device (os error 28)`.",
/// "code":"internal","type":"internal",...}`; `GET /tasks` 200.
#[test]
fn full_disk_faults_answer_as_a_full_disk_does() {
    let (server, api) = start();
    let no_space = error(
        "No space left on device (os error 28)",
        "no_space_left_on_device",
        "system",
    );
    server
        .faults()
        .fail_next_requests_as(2, 422, "no_space_left_on_device", "system");
    for _ in 0..2 {
        let body = api.refused("GET", "/tasks", None, 422);
        assert_eq!(body, no_space);
    }
    assert_eq!(api.json("GET", "/tasks", None).status, 200);
    server
        .faults()
        .fail_next_requests_as(1, 503, "service_unavailable", "system");
    let body = api.refused("GET", "/tasks", None, 503);
    assert_eq!(
        (body["code"].clone(), body["type"].clone()),
        (json!("service_unavailable"), json!("system"))
    );

    server.faults().set_disk_full(true);
    for (method, path, body) in [
        ("POST", "/indexes", Some(json!({"uid": "g"}))),
        (
            "PATCH",
            "/indexes/pre/settings",
            Some(json!({"filterableAttributes": ["a"]})),
        ),
        (
            "POST",
            "/indexes/pre/documents/delete-batch",
            Some(json!([1])),
        ),
    ] {
        assert_eq!(api.refused(method, path, body, 422), no_space, "{path}");
    }
    let resp = api.ndjson("POST", "/indexes/f/documents?primaryKey=id", "{\"id\":1}\n");
    assert_eq!(resp.status, 500);
    assert_eq!(
        resp.json(),
        error(
            "Error while receiving the playload. `No space left on device (os error 28)`.",
            "internal",
            "internal"
        )
    );
    assert_eq!(api.json("GET", "/tasks", None).status, 200);
    assert!(api.get("/tasks")["results"]
        .as_array()
        .expect("results")
        .is_empty());
    server.faults().clear();
    api.wait_task(api.write("POST", "/indexes", Some(json!({"uid": "g"}))));
}
