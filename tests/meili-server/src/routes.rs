//! Routing, authentication and request handlers.

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, RwLock};

use serde_json::{Map, Value};

use crate::docs::{self, Format};
use crate::error::{did_you_mean, ApiError};
use crate::facets;
use crate::filter;
use crate::http::{percent_decode, query_pairs, BodyKind, Request, Response, TooLarge};
use crate::index::Index;
use crate::json::{array, describe, Obj};
use crate::network;
use crate::search;
use crate::settings;
use crate::tasks::{self, read, Kind, Op, Queue, Status, Swap};
use crate::{lock, Shared};

enum Route {
    Health,
    Version,
    Stats,
    ListIndexes,
    CreateIndex,
    GetIndex(String),
    UpdateIndex(String),
    DeleteIndex(String),
    IndexStats(String),
    GetSettings(String),
    UpdateSettings(String),
    ResetSettings(String),
    GetSetting(String, &'static str),
    UpdateSetting(String, &'static str),
    ResetSetting(String, &'static str),
    GetDocuments(String),
    AddDocuments(String, bool),
    ClearDocuments(String),
    DeleteBatch(String),
    DeleteByFilter(String),
    FetchDocuments(String),
    GetDocument(String, String),
    DeleteDocument(String, String),
    Search(String),
    SearchGet(String),
    MultiSearch,
    GetFeatures,
    PatchFeatures,
    GetNetwork,
    PatchNetwork,
    NetworkControl,
    SwapIndexes,
    ListTasks,
    GetTask(String),
    ListBatches,
    GetBatch(String),
}

type Result<T> = std::result::Result<T, ApiError>;

/// Matches a route; `Err` is 404 (unknown path) or 405 (known path, other method).
fn route(method: &str, segs: &[&str]) -> std::result::Result<Route, u16> {
    let s = |i: usize| segs[i].to_string();
    let pick = |options: Vec<(&str, Route)>| {
        options
            .into_iter()
            .find(|(m, _)| *m == method)
            .map(|(_, r)| r)
            .ok_or(405)
    };
    match segs {
        ["health"] => pick(vec![("GET", Route::Health)]),
        ["version"] => pick(vec![("GET", Route::Version)]),
        ["stats"] => pick(vec![("GET", Route::Stats)]),
        ["multi-search"] => pick(vec![("POST", Route::MultiSearch)]),
        ["experimental-features"] => pick(vec![
            ("GET", Route::GetFeatures),
            ("PATCH", Route::PatchFeatures),
        ]),
        ["network"] => pick(vec![
            ("GET", Route::GetNetwork),
            ("PATCH", Route::PatchNetwork),
        ]),
        ["network", "control"] => pick(vec![("POST", Route::NetworkControl)]),
        ["swap-indexes"] => pick(vec![("POST", Route::SwapIndexes)]),
        ["tasks"] => pick(vec![("GET", Route::ListTasks)]),
        ["tasks", _] => pick(vec![("GET", Route::GetTask(s(1)))]),
        ["batches"] => pick(vec![("GET", Route::ListBatches)]),
        ["batches", _] => pick(vec![("GET", Route::GetBatch(s(1)))]),
        ["indexes"] => pick(vec![
            ("GET", Route::ListIndexes),
            ("POST", Route::CreateIndex),
        ]),
        ["indexes", _] => pick(vec![
            ("GET", Route::GetIndex(s(1))),
            ("PATCH", Route::UpdateIndex(s(1))),
            ("DELETE", Route::DeleteIndex(s(1))),
        ]),
        ["indexes", _, "stats"] => pick(vec![("GET", Route::IndexStats(s(1)))]),
        ["indexes", _, "settings"] => pick(vec![
            ("GET", Route::GetSettings(s(1))),
            ("PATCH", Route::UpdateSettings(s(1))),
            ("DELETE", Route::ResetSettings(s(1))),
        ]),
        ["indexes", _, "settings", name] => {
            let (key, patch) = settings::route_key(name).ok_or(404u16)?;
            pick(vec![
                ("GET", Route::GetSetting(s(1), key)),
                (
                    if patch { "PATCH" } else { "PUT" },
                    Route::UpdateSetting(s(1), key),
                ),
                ("DELETE", Route::ResetSetting(s(1), key)),
            ])
        }
        ["indexes", _, "documents"] => pick(vec![
            ("GET", Route::GetDocuments(s(1))),
            ("POST", Route::AddDocuments(s(1), false)),
            ("PUT", Route::AddDocuments(s(1), true)),
            ("DELETE", Route::ClearDocuments(s(1))),
        ]),
        ["indexes", _, "documents", "delete-batch"] => {
            pick(vec![("POST", Route::DeleteBatch(s(1)))])
        }
        ["indexes", _, "documents", "delete"] => pick(vec![("POST", Route::DeleteByFilter(s(1)))]),
        ["indexes", _, "documents", "fetch"] => pick(vec![("POST", Route::FetchDocuments(s(1)))]),
        ["indexes", _, "documents", _] => pick(vec![
            ("GET", Route::GetDocument(s(1), s(3))),
            ("DELETE", Route::DeleteDocument(s(1), s(3))),
        ]),
        ["indexes", _, "search"] => pick(vec![
            ("GET", Route::SearchGet(s(1))),
            ("POST", Route::Search(s(1))),
        ]),
        _ => Err(404),
    }
}

pub(crate) fn handle(shared: &Shared, req: &Request) -> Response {
    let segments: Vec<String> = req
        .path()
        .split('/')
        .skip(1)
        .map(|s| percent_decode(s, false))
        .collect();
    let segs: Vec<&str> = segments.iter().map(String::as_str).collect();
    if segs.iter().any(|s| s.is_empty()) {
        return Response::empty(404);
    }
    let route = match route(&req.method, &segs) {
        Ok(route) => route,
        Err(status) => return Response::empty(status),
    };
    let result = (|| {
        if !matches!(route, Route::Health) {
            authorize(shared, req)?;
        }
        if shared.faults.disk_full() {
            disk_full(&route)?;
        }
        if req.undecodable {
            return Err(ApiError::new(
                "bad_request",
                "The provided payload is incomplete and cannot be parsed",
            ));
        }
        dispatch(shared, req, route)
    })();
    match result {
        Ok(resp) => resp,
        Err(e) => Response::json(e.status, e.to_json()),
    }
}

/// The error a write gets from a Meilisearch with a full disk ([`crate::Faults::set_disk_full`]):
/// a document payload cannot be stored, other writes cannot register their task.
fn disk_full(route: &Route) -> Result<()> {
    match route {
        Route::AddDocuments(..) => Err(ApiError::internal(format!(
            "Error while receiving the playload. `{}`.",
            crate::error::NO_SPACE
        ))),
        Route::CreateIndex
        | Route::UpdateIndex(_)
        | Route::DeleteIndex(_)
        | Route::UpdateSettings(_)
        | Route::ResetSettings(_)
        | Route::UpdateSetting(..)
        | Route::ResetSetting(..)
        | Route::ClearDocuments(_)
        | Route::DeleteBatch(_)
        | Route::DeleteByFilter(_)
        | Route::DeleteDocument(..)
        | Route::SwapIndexes => Err(ApiError::new(
            "no_space_left_on_device",
            crate::error::NO_SPACE,
        )),
        _ => Ok(()),
    }
}

fn authorize(shared: &Shared, req: &Request) -> Result<()> {
    let Some(key) = &shared.master_key else {
        return Ok(());
    };
    match req
        .header("authorization")
        .and_then(|h| h.strip_prefix("Bearer "))
    {
        None => Err(ApiError::new(
            "missing_authorization_header",
            "The Authorization header is missing. It must use the bearer authorization method.",
        )),
        Some(token) if token.trim() == key => Ok(()),
        Some(_) => Err(ApiError::new(
            "invalid_api_key",
            "The provided API key is invalid.",
        )),
    }
}

/// How a route reads its body: document payloads are streams, every other body is JSON.
pub(crate) fn body_kind(method: &str, path: &str) -> BodyKind {
    let segs: Vec<&str> = path.split('/').skip(1).collect();
    match (method, segs.as_slice()) {
        ("POST" | "PUT", ["indexes", _, "documents"]) => BodyKind::Stream,
        _ => BodyKind::Json,
    }
}

/// A document payload over the limit (observed on Meilisearch 1.50: `The maximum accepted
/// payload size is 100 MB.` by default, `1 MB` with `--http-payload-size-limit 1MB`).
fn payload_too_large(limit: usize) -> ApiError {
    ApiError::new(
        "payload_too_large",
        format!(
            "The provided payload reached the size limit. The maximum accepted payload size is {}.",
            byte_size(limit as u64)
        ),
    )
}

/// A JSON body over the limit, as actix's `JsonPayloadError` words it and Meilisearch codes it.
/// Observed on 1.50 (default limit): `Content-Length: 100000001` to `POST .../delete-batch` gives
/// 500 `internal` "JSON payload (100000001 bytes) is larger than allowed (limit: 100000000
/// bytes)."; a 150 MB chunked body gives 413 `payload_too_large` "JSON payload has exceeded limit
/// (100000000 bytes).".
fn json_too_large(too_large: TooLarge, limit: usize) -> ApiError {
    match too_large {
        TooLarge::Announced(n) => ApiError::internal(format!(
            "JSON payload ({n} bytes) is larger than allowed (limit: {limit} bytes)."
        )),
        TooLarge::Body => ApiError::new(
            "payload_too_large",
            format!("JSON payload has exceeded limit ({limit} bytes)."),
        ),
    }
}

/// A byte count the way Meilisearch 1.50 prints its payload limit: in binary units when the
/// largest unit dividing it exactly is binary, else in decimal ones; in the largest unit of that
/// kind not above it, with every decimal needed. Observed: 100000000 `100 MB`, 1000000 `1 MB`,
/// 123456789 `123.456789 MB`, 1048577 `1.048577 MB`, 1048576 `1 MiB`, 2048000 `1.953125 MiB`,
/// 1536000 `1.46484375 MiB`, 1024 `1 KiB`, 2560 `2.56 KB`, 1500 `1.5 KB`, 999 `999 B`.
pub(crate) fn byte_size(n: u64) -> String {
    const DECIMAL: [&str; 6] = ["KB", "MB", "GB", "TB", "PB", "EB"];
    const BINARY: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let n = u128::from(n);
    let unit = |binary: bool, i: usize| {
        let base: u128 = if binary { 1024 } else { 1000 };
        base.pow(i as u32 + 1)
    };
    let mut units: Vec<(u128, bool, usize)> = (0..6)
        .flat_map(|i| [(unit(false, i), false, i), (unit(true, i), true, i)])
        .collect();
    units.sort();
    let binary = units
        .iter()
        .rev()
        .find(|(u, _, _)| n >= *u && n % u == 0)
        .is_some_and(|(_, binary, _)| *binary);
    let Some((u, _, i)) = units.iter().rev().find(|(u, b, _)| *b == binary && n >= *u) else {
        return format!("{n} B");
    };
    let mut text = (n / u).to_string();
    let mut rest = n % u;
    if rest > 0 {
        text.push('.');
        // Terminates: a power of 1000 or 1024 only has the prime factors 2 and 5.
        while rest > 0 {
            rest *= 10;
            text.push(char::from(b'0' + (rest / u) as u8));
            rest %= u;
        }
    }
    let names = if binary { BINARY } else { DECIMAL };
    format!("{text} {}", names[*i])
}

fn ok(body: String) -> Result<Response> {
    Ok(Response::json(200, body))
}

fn dispatch(shared: &Shared, req: &Request, route: Route) -> Result<Response> {
    let params = query_pairs(req.query());
    match route {
        Route::Health => ok(r#"{"status":"available"}"#.into()),
        Route::Version => ok(Obj::new()
            .str("commitSha", "2ecfd54ca7f3dd1c76d304efce86c9b8af9f82aa")
            .str("commitDate", "2026-07-16T14:59:12.000000000Z")
            .str("pkgVersion", "1.50.0")
            .end()),
        Route::Stats => {
            known_params(&params, STATS_PARAMS, |_| Ok(()))?;
            global_stats(shared)
        }
        Route::ListIndexes => list_indexes(shared, &params),
        Route::CreateIndex => create_index(shared, req),
        Route::GetIndex(uid) => {
            let index = find_index(shared, &uid)?;
            let body = read(&index).to_json();
            ok(body)
        }
        Route::UpdateIndex(uid) => update_index(shared, req, &uid),
        Route::DeleteIndex(uid) => {
            check_uid(&uid)?;
            Ok(enqueue(shared, &uid, Op::DeleteIndex))
        }
        Route::IndexStats(uid) => {
            known_params(&params, STATS_PARAMS, |_| Ok(()))?;
            let index = find_index(shared, &uid)?;
            let indexing = lock(&shared.queue).processing_index.as_deref() == Some(uid.as_str());
            let body = read(&index).stats_json(indexing);
            ok(body)
        }
        Route::GetSettings(uid) => {
            let index = find_index(shared, &uid)?;
            let body = settings::to_json(&read(&index).settings);
            ok(body)
        }
        Route::UpdateSettings(uid) => {
            check_uid(&uid)?;
            let changes = settings::validate_patch(&json_body(req)?)?;
            Ok(enqueue(shared, &uid, Op::Settings(changes)))
        }
        Route::ResetSettings(uid) => {
            check_uid(&uid)?;
            Ok(enqueue(shared, &uid, Op::Settings(settings::reset_all())))
        }
        Route::GetSetting(uid, key) => {
            let index = find_index(shared, &uid)?;
            let idx = read(&index);
            ok(idx
                .settings
                .get(key)
                .cloned()
                .unwrap_or_else(|| settings::default_value(key))
                .to_string())
        }
        Route::UpdateSetting(uid, key) => {
            check_uid(&uid)?;
            let value = json_body(req)?;
            settings::validate(key, &value, "")?;
            Ok(enqueue(
                shared,
                &uid,
                Op::Settings(vec![(key.to_string(), value)]),
            ))
        }
        Route::ResetSetting(uid, key) => {
            check_uid(&uid)?;
            Ok(enqueue(
                shared,
                &uid,
                Op::Settings(vec![(key.to_string(), Value::Null)]),
            ))
        }
        Route::GetDocuments(uid) => get_documents(shared, &uid, &params),
        Route::AddDocuments(uid, merge) => add_documents(shared, req, &uid, &params, merge),
        Route::ClearDocuments(uid) => {
            let metadata = write_params(&params)?;
            check_uid(&uid)?;
            Ok(enqueue_with(shared, &uid, Op::ClearDocuments, metadata))
        }
        Route::DeleteBatch(uid) => {
            let metadata = write_params(&params)?;
            check_uid(&uid)?;
            let body = json_body(req)?;
            let Value::Array(ids) = body else {
                return Err(ApiError::new(
                    "bad_request",
                    format!(
                        "Json deserialize error: invalid type: {}, expected a sequence",
                        describe(&body)
                    ),
                ));
            };
            let ids = ids.iter().map(|v| {
                v.as_str()
                    .map(String::from)
                    .unwrap_or_else(|| v.to_string())
            });
            let op = Op::DeleteDocuments(ids.collect());
            Ok(enqueue_with(shared, &uid, op, metadata))
        }
        Route::DeleteByFilter(uid) => delete_by_filter(shared, req, &uid, &params),
        Route::FetchDocuments(uid) => fetch_documents(shared, req, &uid),
        Route::GetDocument(uid, id) => get_document(shared, &uid, &id, &params),
        Route::DeleteDocument(uid, id) => {
            let metadata = write_params(&params)?;
            check_uid(&uid)?;
            let op = Op::DeleteDocuments(vec![id]);
            Ok(enqueue_with(shared, &uid, op, metadata))
        }
        Route::Search(uid) => {
            let body = json_body(req)?;
            if let Some(k) = body
                .as_object()
                .and_then(|o| o.keys().find(|k| !SEARCH_FIELDS.contains(&k.as_str())))
            {
                return Err(unknown_field(k, SEARCH_FIELDS));
            }
            search_one(shared, &uid, &body)
        }
        Route::SearchGet(uid) => {
            let body = known_params(&params, SEARCH_PARAMS, search::query_from_params)?;
            search_one(shared, &uid, &body)
        }
        Route::MultiSearch => multi_search(shared, req),
        Route::GetFeatures => ok(network::get_features(shared)),
        Route::PatchFeatures => ok(network::patch_features(shared, &json_body(req)?)?),
        Route::GetNetwork => ok(network::get_network(shared)?),
        Route::PatchNetwork => ok(network::patch_network(shared, &json_body(req)?)?),
        Route::NetworkControl => ok(network::network_control(shared)?),
        Route::SwapIndexes => {
            let swaps = parse_swaps(&json_body(req)?)?;
            Ok(submit(shared, |queue| queue.register_swap(swaps)))
        }
        Route::ListTasks => list_tasks(shared, &params),
        Route::GetTask(id) => {
            let uid = id.parse::<u32>().map_err(|_| {
                ApiError::new(
                    "invalid_task_uids",
                    format!(
                        "Task uid `{id}` is invalid. It should only contain numeric characters."
                    ),
                )
            })?;
            let queue = lock(&shared.queue);
            let task = queue
                .tasks
                .get(uid as usize)
                .filter(|task| !task.forgotten)
                .ok_or_else(|| {
                    ApiError::new("task_not_found", format!("Task `{uid}` not found."))
                })?;
            ok(task.to_json())
        }
        Route::ListBatches => list_batches(shared, &params),
        Route::GetBatch(id) => {
            let uid = id.parse::<u32>().map_err(|_| {
                ApiError::new(
                    "invalid_batch_uids",
                    format!(
                        "Batch uid `{id}` is invalid. It should only contain numeric characters."
                    ),
                )
            })?;
            let queue = lock(&shared.queue);
            let batch = queue.batches.get(uid as usize).ok_or_else(|| {
                ApiError::new("batch_not_found", format!("Batch `{uid}` not found."))
            })?;
            ok(batch.to_json(&queue.tasks))
        }
    }
}

fn enqueue(shared: &Shared, uid: &str, op: Op) -> Response {
    enqueue_with(shared, uid, op, None)
}

/// Enqueues a document write with its `customMetadata`.
fn enqueue_with(shared: &Shared, uid: &str, op: Op, metadata: Option<String>) -> Response {
    submit(shared, |queue| queue.register(uid, op, metadata))
}

/// Registers a task, wakes the processor and answers 202 with the summarized task.
fn submit(shared: &Shared, register: impl FnOnce(&mut Queue) -> String) -> Response {
    let summary = register(&mut lock(&shared.queue));
    shared.cond.notify_all();
    Response::json(202, summary)
}

fn valid_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= 400
        && uid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn uid_message(uid: &str) -> String {
    format!("`{uid}` is not a valid index uid. Index uid can be an integer or a string containing only alphanumeric characters, hyphens (-) and underscores (_), and can not be more than 512 bytes.")
}

fn check_uid(uid: &str) -> Result<()> {
    if valid_uid(uid) {
        Ok(())
    } else {
        Err(ApiError::new("invalid_index_uid", uid_message(uid)))
    }
}

fn find_index(shared: &Shared, uid: &str) -> Result<Arc<RwLock<Index>>> {
    check_uid(uid)?;
    lock(&shared.indexes)
        .get(uid)
        .cloned()
        .ok_or_else(|| ApiError::index_not_found(uid))
}

fn mime(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// A JSON request body, with the real server's content-type and payload errors.
fn json_body(req: &Request) -> Result<Value> {
    let accepted = "Accepted values for the Content-Type header are: `application/json`";
    match req.header("content-type") {
        None => {
            return Err(ApiError::new(
                "missing_content_type",
                format!("A Content-Type header is missing. {accepted}"),
            ))
        }
        Some(ct) if mime(ct) != "application/json" => {
            return Err(ApiError::new(
                "invalid_content_type",
                format!("The Content-Type `{ct}` is invalid. {accepted}"),
            ))
        }
        Some(_) => {}
    }
    if let Some(too_large) = req.too_large {
        return Err(json_too_large(too_large, req.limit));
    }
    if req.body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::new(
            "missing_payload",
            "A json payload is missing.",
        ));
    }
    serde_json::from_slice(&req.body).map_err(|e| {
        ApiError::new(
            "malformed_payload",
            format!("The json payload provided is malformed. `{e}`."),
        )
    })
}

fn object(body: &Value) -> Result<&Map<String, Value>> {
    body.as_object().ok_or_else(|| {
        ApiError::new(
            "bad_request",
            format!(
                "Invalid value type: expected an object, but found {}",
                describe(body)
            ),
        )
    })
}

fn unknown_field(key: &str, expected: &[&str]) -> ApiError {
    ApiError::new(
        "bad_request",
        format!(
            "Unknown field `{key}`: {}expected one of {}",
            did_you_mean(key, expected),
            quoted_list(expected)
        ),
    )
}

fn param_usize(params: &[(String, String)], name: &str, code: &str) -> Result<Option<usize>> {
    match params.iter().rev().find(|(k, _)| k == name) {
        None => Ok(None),
        Some((_, v)) => v.parse::<usize>().map(Some).map_err(|_| {
            ApiError::new(
                code,
                format!("Invalid value in parameter `{name}`: could not parse `{v}` as a positive integer"),
            )
        }),
    }
}

fn param<'a>(params: &'a [(String, String)], name: &str) -> Option<&'a str> {
    params
        .iter()
        .rev()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// The query parameters Meilisearch 1.50 takes on each route that checks them; any other is
/// refused with 400 `bad_request` (observed: `GET /tasks?foo=1` "Unknown parameter `foo`:
/// expected one of `limit`, `from`, ...", `GET /tasks?limt=1` "... `limt`: did you mean
/// `limit`? expected one of ...", `GET /indexes/cm/documents?foo=1` "... expected one of
/// `offset`, `limit`, `fields`, `retrieveVectors`, `ids`, `filter`, `sort`, `useNetwork`").
/// Routes without a list ignore unknown parameters, as the real ones do (`GET /indexes/{uid}`,
/// settings, `POST` search, index writes, swaps, `GET /tasks/{uid}`, health, version).
/// Accepted parameters this server does not implement (`canceledBy`, date filters,
/// `retrieveVectors`, `useNetwork`, `skipCreation`, ...) are ignored.
const TASK_PARAMS: &[&str] = &[
    "limit",
    "from",
    "reverse",
    "batchUids",
    "uids",
    "canceledBy",
    "types",
    "statuses",
    "indexUids",
    "afterEnqueuedAt",
    "beforeEnqueuedAt",
    "afterStartedAt",
    "beforeStartedAt",
    "afterFinishedAt",
    "beforeFinishedAt",
];
const INDEX_LIST_PARAMS: &[&str] = &["offset", "limit"];
const DOCUMENTS_PARAMS: &[&str] = &[
    "offset",
    "limit",
    "fields",
    "retrieveVectors",
    "ids",
    "filter",
    "sort",
    "useNetwork",
];
const DOCUMENT_PARAMS: &[&str] = &["fields", "retrieveVectors", "useNetwork"];
const SEARCH_PARAMS: &[&str] = &[
    "q",
    "offset",
    "limit",
    "page",
    "hitsPerPage",
    "attributesToRetrieve",
    "attributesToCrop",
    "cropLength",
    "cropMarker",
    "attributesToHighlight",
    "highlightPreTag",
    "highlightPostTag",
    "showMatchesPosition",
    "filter",
    "sort",
    "distinct",
    "facets",
    "matchingStrategy",
    "attributesToSearchOn",
    "rankingScoreThreshold",
    "locales",
    "hybridEmbedder",
    "hybridSemanticRatio",
    "vector",
    "retrieveVectors",
    "personalizeUserContext",
    "useNetwork",
    "showRankingScore",
    "showRankingScoreDetails",
    "showPerformanceDetails",
];
/// The fields of a `POST /indexes/{uid}/search` body, in the order Meilisearch 1.50 lists them
/// when it refuses another one.
const SEARCH_FIELDS: &[&str] = &[
    "q",
    "offset",
    "limit",
    "page",
    "hitsPerPage",
    "attributesToRetrieve",
    "attributesToCrop",
    "cropLength",
    "cropMarker",
    "attributesToHighlight",
    "highlightPreTag",
    "highlightPostTag",
    "showMatchesPosition",
    "filter",
    "sort",
    "distinct",
    "facets",
    "matchingStrategy",
    "attributesToSearchOn",
    "rankingScoreThreshold",
    "locales",
    "hybrid",
    "vector",
    "retrieveVectors",
    "media",
    "personalize",
    "useNetwork",
    "showRankingScore",
    "showRankingScoreDetails",
    "showPerformanceDetails",
];
const STATS_PARAMS: &[&str] = &["showInternalDatabaseSizes", "sizeFormat"];
const ADD_DOCUMENTS_PARAMS: &[&str] = &[
    "primaryKey",
    "csvDelimiter",
    "customMetadata",
    "skipCreation",
];
/// Document deletions (by ids, by filter, one, all).
const WRITE_PARAMS: &[&str] = &["customMetadata"];

/// Parses query parameters with `parse` after checking their names against `known`. As with
/// deserr, parameters are taken in order and the first bad one is reported: an unknown name
/// after a bad value reports the value (observed: `GET /tasks?limit=abc&foo=1` gives
/// `invalid_task_limit`, `GET /tasks?foo=1&limit=abc` the unknown `foo`).
fn known_params<T>(
    params: &[(String, String)],
    known: &[&str],
    parse: impl Fn(&[(String, String)]) -> Result<T>,
) -> Result<T> {
    let Some(i) = params
        .iter()
        .position(|(k, _)| !known.contains(&k.as_str()))
    else {
        return parse(params);
    };
    parse(&params[..i])?;
    let name = &params[i].0;
    Err(ApiError::new(
        "bad_request",
        format!(
            "Unknown parameter `{name}`: {}expected one of {}",
            did_you_mean(name, known),
            quoted_list(known)
        ),
    ))
}

/// The `customMetadata` of a document deletion, after checking the parameter names.
fn write_params(params: &[(String, String)]) -> Result<Option<String>> {
    known_params(params, WRITE_PARAMS, |p| {
        Ok(param(p, "customMetadata").map(String::from))
    })
}

fn comma_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

fn global_stats(shared: &Shared) -> Result<Response> {
    let (processing, last_update) = {
        let queue = lock(&shared.queue);
        (queue.processing_index.clone(), queue.last_update)
    };
    let indexes: Vec<(String, Arc<RwLock<Index>>)> = lock(&shared.indexes)
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut size = 0;
    let mut stats = Obj::new();
    for (uid, index) in &indexes {
        let idx = read(index);
        size += idx.raw_document_db_size();
        stats = stats.raw(
            uid,
            &idx.stats_json(processing.as_deref() == Some(uid.as_str())),
        );
    }
    let database_size = size + 4096 * (1 + indexes.len() as u64);
    ok(Obj::new()
        .num("databaseSize", database_size)
        .num("usedDatabaseSize", database_size)
        .opt_str(
            "lastUpdate",
            last_update.map(crate::time::rfc3339).as_deref(),
        )
        .raw("indexes", &stats.end())
        .end())
}

fn list_indexes(shared: &Shared, params: &[(String, String)]) -> Result<Response> {
    let (offset, limit) = known_params(params, INDEX_LIST_PARAMS, |p| {
        Ok((
            param_usize(p, "offset", "invalid_index_offset")?.unwrap_or(0),
            param_usize(p, "limit", "invalid_index_limit")?.unwrap_or(20),
        ))
    })?;
    let indexes: Vec<Arc<RwLock<Index>>> = lock(&shared.indexes).values().cloned().collect();
    let results = indexes
        .iter()
        .skip(offset)
        .take(limit)
        .map(|i| read(i).to_json());
    ok(Obj::new()
        .raw("results", &array(results))
        .num("offset", offset as u64)
        .num("limit", limit as u64)
        .num("total", indexes.len() as u64)
        .end())
}

fn primary_key_field(obj: &Map<String, Value>) -> Result<Option<String>> {
    match obj.get("primaryKey") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(ApiError::new(
            "invalid_index_primary_key",
            format!(
                "Invalid value type at `.primaryKey`: expected a string, but found {}",
                describe(v)
            ),
        )),
    }
}

fn create_index(shared: &Shared, req: &Request) -> Result<Response> {
    let body = json_body(req)?;
    let obj = object(&body)?;
    if let Some(k) = obj
        .keys()
        .find(|k| !["uid", "primaryKey"].contains(&k.as_str()))
    {
        return Err(unknown_field(k, &["uid", "primaryKey"]));
    }
    let uid = match obj.get("uid") {
        None => return Err(ApiError::new("missing_index_uid", "Missing field `uid`")),
        Some(Value::String(uid)) if valid_uid(uid) => uid.clone(),
        Some(Value::String(uid)) => {
            return Err(ApiError::new(
                "invalid_index_uid",
                format!("Invalid value at `.uid`: {}", uid_message(uid)),
            ))
        }
        Some(v) => {
            return Err(ApiError::new(
                "invalid_index_uid",
                format!(
                    "Invalid value type at `.uid`: expected a string, but found {}",
                    describe(v)
                ),
            ))
        }
    };
    let pk = primary_key_field(obj)?;
    Ok(enqueue(shared, &uid, Op::CreateIndex(pk)))
}

fn update_index(shared: &Shared, req: &Request, uid: &str) -> Result<Response> {
    check_uid(uid)?;
    let body = json_body(req)?;
    let obj = object(&body)?;
    if let Some(k) = obj.keys().find(|k| k.as_str() != "primaryKey") {
        return Err(unknown_field(k, &["primaryKey"]));
    }
    let pk = primary_key_field(obj)?;
    Ok(enqueue(shared, uid, Op::UpdateIndex(pk)))
}

fn add_documents(
    shared: &Shared,
    req: &Request,
    uid: &str,
    params: &[(String, String)],
    merge: bool,
) -> Result<Response> {
    let delimiter = known_params(params, ADD_DOCUMENTS_PARAMS, |p| {
        match param(p, "csvDelimiter") {
            None => Ok(None),
            Some(d) if d.len() == 1 => Ok(Some(d.as_bytes()[0])),
            Some(d) => Err(ApiError::new(
                "invalid_document_csv_delimiter",
                format!(
                    "Invalid value in parameter `csvDelimiter`: expected a string of one character, but found the following string of {} characters: `{d}`",
                    d.chars().count()
                ),
            )),
        }
    })?;
    check_uid(uid)?;
    let primary_key = param(params, "primaryKey").map(String::from);
    let metadata = param(params, "customMetadata").map(String::from);
    let accepted = "Accepted values for the Content-Type header are: `application/json`, `application/x-ndjson`, `text/csv`";
    let Some(content_type) = req.header("content-type") else {
        return Err(ApiError::new(
            "missing_content_type",
            format!("A Content-Type header is missing. {accepted}"),
        ));
    };
    let format = match (mime(content_type).as_str(), delimiter) {
        ("application/json", None) => Format::Json,
        ("application/x-ndjson", None) => Format::Ndjson,
        ("text/csv", d) => Format::Csv(d.unwrap_or(b',')),
        (m @ ("application/json" | "application/x-ndjson"), Some(_)) => {
            return Err(ApiError::new(
                "invalid_content_type",
                format!("The Content-Type `{m}` does not support the use of a csv delimiter. The csv delimiter can only be used with the Content-Type `text/csv`."),
            ))
        }
        (m, _) => {
            let shown = if m.contains('/') { m.to_string() } else { content_type.to_string() };
            return Err(ApiError::new(
                "invalid_content_type",
                format!("The Content-Type `{shown}` is invalid. {accepted}"),
            ));
        }
    };
    if req.too_large.is_some() {
        return Err(payload_too_large(req.limit));
    }
    let docs = docs::parse_payload(&req.body, format)?;
    let op = Op::AddDocuments {
        docs,
        primary_key,
        merge,
    };
    Ok(enqueue_with(shared, uid, op, metadata))
}

fn delete_by_filter(
    shared: &Shared,
    req: &Request,
    uid: &str,
    params: &[(String, String)],
) -> Result<Response> {
    let metadata = write_params(params)?;
    check_uid(uid)?;
    let body = json_body(req)?;
    let obj = object(&body)?;
    if let Some(k) = obj.keys().find(|k| k.as_str() != "filter") {
        return Err(unknown_field(k, &["filter"]));
    }
    let Some(filter) = obj.get("filter") else {
        return Err(ApiError::new(
            "missing_document_filter",
            "Missing field `filter`",
        ));
    };
    let parsed =
        filter::from_json(filter).map_err(|m| ApiError::new("invalid_document_filter", m))?;
    if parsed.is_none() {
        return Err(ApiError::new(
            "invalid_document_filter",
            "Sending an empty filter is forbidden.",
        ));
    }
    let op = Op::DeleteByFilter(filter.clone());
    Ok(enqueue_with(shared, uid, op, metadata))
}

/// Options shared by `GET /documents` and `POST /documents/fetch`.
struct Browse {
    offset: usize,
    limit: usize,
    fields: Option<Vec<String>>,
    filter: Value,
    ids: Option<Vec<String>>,
}

fn get_documents(shared: &Shared, uid: &str, params: &[(String, String)]) -> Result<Response> {
    let browse = known_params(params, DOCUMENTS_PARAMS, |p| {
        Ok(Browse {
            offset: param_usize(p, "offset", "invalid_document_offset")?.unwrap_or(0),
            limit: param_usize(p, "limit", "invalid_document_limit")?.unwrap_or(20),
            fields: param(p, "fields").map(comma_list),
            filter: param(p, "filter").map_or(Value::Null, Value::from),
            ids: param(p, "ids").map(comma_list),
        })
    })?;
    browse_documents(shared, uid, browse)
}

fn fetch_documents(shared: &Shared, req: &Request, uid: &str) -> Result<Response> {
    let body = json_body(req)?;
    let obj = object(&body)?;
    let known = [
        "offset",
        "limit",
        "fields",
        "filter",
        "ids",
        "retrieveVectors",
        "sort",
    ];
    if let Some(k) = obj.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(unknown_field(k, &known));
    }
    let field = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let type_error = |k: &str, expected: &str, v: &Value| {
        let code = match k {
            "ids" => "invalid_document_ids".to_string(),
            _ => format!("invalid_document_{k}"),
        };
        ApiError::new(
            &code,
            format!(
                "Invalid value type at `.{k}`: expected {expected}, but found {}",
                describe(v)
            ),
        )
    };
    let number = |k: &str, default: usize| match field(k) {
        None => Ok(default),
        Some(v) => v
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| type_error(k, "a positive integer", v)),
    };
    let list = |k: &str| match field(k) {
        None => Ok(None),
        Some(Value::Array(items)) => Ok(Some(
            items
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(String::from)
                        .unwrap_or_else(|| v.to_string())
                })
                .collect(),
        )),
        Some(v) => Err(type_error(k, "an array", v)),
    };
    let browse = Browse {
        offset: number("offset", 0)?,
        limit: number("limit", 20)?,
        fields: list("fields")?,
        filter: field("filter").cloned().unwrap_or(Value::Null),
        ids: list("ids")?,
    };
    browse_documents(shared, uid, browse)
}

fn browse_documents(shared: &Shared, uid: &str, b: Browse) -> Result<Response> {
    let filter =
        filter::from_json(&b.filter).map_err(|m| ApiError::new("invalid_document_filter", m))?;
    let index = find_index(shared, uid)?;
    let idx = read(&index);
    if let Some(f) = &filter {
        f.check_filterable(&settings::filterable_patterns(&idx.settings))
            .map_err(|m| ApiError::new("invalid_document_filter", format!("Index `{uid}`: {m}")))?;
    }
    let candidates: Box<dyn Iterator<Item = &crate::index::StoredDoc>> = match &b.ids {
        Some(ids) => {
            let mut internal: Vec<u32> = ids.iter().filter_map(|id| idx.internal_id(id)).collect();
            internal.sort_unstable();
            internal.dedup();
            Box::new(internal.into_iter().filter_map(|i| idx.by_internal(i)))
        }
        None => Box::new(idx.iter()),
    };
    let render = |d: &crate::index::StoredDoc| match &b.fields {
        None => d.json.to_string(),
        Some(fields) => Value::Object(docs::select_fields(&d.parse(), fields)).to_string(),
    };
    let (total, results): (usize, Vec<String>) = match &filter {
        None if b.ids.is_none() => (
            idx.len(),
            idx.iter()
                .skip(b.offset)
                .take(b.limit)
                .map(render)
                .collect(),
        ),
        _ => {
            let matching: Vec<&crate::index::StoredDoc> = candidates
                .filter(|d| filter.as_ref().is_none_or(|f| f.matches(&d.parse())))
                .collect();
            let page = matching
                .iter()
                .skip(b.offset)
                .take(b.limit)
                .map(|d| render(d))
                .collect();
            (matching.len(), page)
        }
    };
    ok(Obj::new()
        .raw("results", &array(results))
        .num("offset", b.offset as u64)
        .num("limit", b.limit as u64)
        .num("total", total as u64)
        .end())
}

fn get_document(
    shared: &Shared,
    uid: &str,
    id: &str,
    params: &[(String, String)],
) -> Result<Response> {
    known_params(params, DOCUMENT_PARAMS, |_| Ok(()))?;
    let index = find_index(shared, uid)?;
    let idx = read(&index);
    let doc = idx.get(id).ok_or_else(|| {
        ApiError::new("document_not_found", format!("Document `{id}` not found."))
    })?;
    match param(params, "fields").map(comma_list) {
        None => ok(doc.json.to_string()),
        Some(fields) => ok(Value::Object(docs::select_fields(&doc.parse(), &fields)).to_string()),
    }
}

fn search_one(shared: &Shared, uid: &str, body: &Value) -> Result<Response> {
    let query = search::parse_query(body, "")?;
    let index = find_index(shared, uid)?;
    let idx = read(&index);
    let result = search::response(Obj::new(), &idx, &query, &search::request_uid())?;
    ok(result.end())
}

fn multi_search(shared: &Shared, req: &Request) -> Result<Response> {
    let body = json_body(req)?;
    let obj = object(&body)?;
    let queries = match obj.get("queries") {
        None => return Err(ApiError::new("bad_request", "Missing field `queries`")),
        Some(Value::Array(q)) => q,
        Some(v) => {
            return Err(ApiError::new(
                "bad_request",
                format!(
                    "Invalid value type at `.queries`: expected an array, but found {}",
                    describe(v)
                ),
            ))
        }
    };
    let federation = obj.get("federation").filter(|f| !f.is_null());
    let request_uid = search::request_uid();
    let Some(federation) = federation else {
        let mut results = Vec::new();
        for (i, q) in queries.iter().enumerate() {
            let at = format!(".queries[{i}]");
            let inside = format!("Inside `{at}`: ");
            let uid = query_index_uid(q, &at)?;
            let query = search::parse_query(q, &at)?;
            let index = find_index(shared, &uid).map_err(|e| e.prefixed(&inside))?;
            let idx = read(&index);
            let start = Obj::new().str("indexUid", &uid);
            let result = search::response(start, &idx, &query, &request_uid)
                .map_err(|e| e.prefixed(&inside))?;
            results.push(result.end());
        }
        return ok(Obj::new().raw("results", &array(results)).end());
    };
    let facet_options = facets::parse_options(federation)?;
    // A multi-search sent by another server for its remote queries (Meilisearch's proxy).
    let is_proxy = req.header("meili-proxy-search") == Some("true");
    if is_proxy {
        network::check_network(shared, "Performing a remote federated search")?;
    }
    let net = network::snapshot(shared);
    let offset = federation
        .get("offset")
        .and_then(Value::as_u64)
        .unwrap_or(0) as usize;
    let limit = federation
        .get("limit")
        .and_then(Value::as_u64)
        .unwrap_or(20) as usize;

    // 1. Parse and split the queries between this server and the remotes, as Meilisearch's
    // `PartitionedQueries` does, before any is run.
    let mut local = Vec::new();
    let mut by_remote: std::collections::BTreeMap<String, Vec<Value>> = Default::default();
    let mut has_remote = false;
    for (i, q) in queries.iter().enumerate() {
        let at = format!(".queries[{i}]");
        let inside = format!("Inside `{at}`: ");
        let uid = query_index_uid(q, &at)?;
        let query = search::parse_query(q, &at)?;
        let asked: Vec<String> = q
            .get("facets")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default();
        if !asked.is_empty() {
            return Err(facets::facets_in_query(&uid, &asked).prefixed(&inside));
        }
        let options = q.get("federationOptions");
        let weight = options
            .and_then(|o| o.get("weight"))
            .and_then(Value::as_f64)
            .unwrap_or(1.0);
        let remote = options
            .and_then(|o| o.get("remote"))
            .and_then(Value::as_str);
        let position = options
            .and_then(|o| o.get("queryPosition"))
            .and_then(Value::as_u64);
        let use_network = q.get("useNetwork").and_then(Value::as_bool);
        if use_network.is_some() {
            network::check_network(shared, "passing `useNetwork` in a search query")
                .map_err(|e| e.prefixed(&inside))?;
        }
        if use_network == Some(true) && remote.is_some() {
            return Err(ApiError::new(
                "invalid_multi_search_federation_options",
                "Using `.useNetwork` is not allowed as the same time as `.federationOptions.remote`.\n  - Hint: to perform an explicit query against a remote, remove `.useNetwork`.\n  - Hint: to automatically perform queries against the entire network, remove `.federationOptions.remote`.",
            )
            .prefixed(&inside));
        }
        // `useNetwork` (without a leader) sends the query to every remote, self included.
        let targets: Vec<Option<&str>> = if use_network == Some(true) {
            net.remotes.keys().map(|r| Some(r.as_str())).collect()
        } else {
            vec![remote]
        };
        let mut runs_here = false;
        for target in targets {
            let Some(name) = target else {
                runs_here = true;
                continue;
            };
            has_remote = true;
            network::check_network(shared, "Performing a remote federated search")
                .map_err(|e| e.prefixed(&inside))?;
            if net.local.as_deref() == Some(name) {
                runs_here = true;
                continue;
            }
            if !net.remotes.contains_key(name) {
                return Err(ApiError::new(
                    "invalid_multi_search_remote",
                    format!(
                        "Invalid `.federation_options.remote`: remote `{name}` is not registered"
                    ),
                )
                .prefixed(&inside));
            }
            // The remote gets the query without `remote` (it need not know its own name) and
            // with its position here, so its hits come back numbered for this request.
            let mut forwarded = q.as_object().cloned().unwrap_or_default();
            forwarded.remove("useNetwork");
            forwarded.insert(
                "federationOptions".into(),
                serde_json::json!({"weight": weight, "queryPosition": i}),
            );
            by_remote
                .entry(name.to_string())
                .or_default()
                .push(Value::Object(forwarded));
        }
        if runs_here {
            let position = match position {
                Some(p) => {
                    network::check_network(shared, "Using `federationOptions.queryPosition`")
                        .map_err(|e| e.prefixed(&inside))?;
                    p as usize
                }
                None => i,
            };
            local.push((uid, i, position, weight, query));
        }
    }

    // 2. Start the remote searches on their own threads (no lock is held, so two servers
    // querying each other cannot deadlock), run the local queries meanwhile.
    let mut proxy_federation = federation.as_object().cloned().unwrap_or_default();
    // The remotes' hits are paged here, so each sends the first `offset + limit`.
    match (
        federation.get("page").and_then(Value::as_u64),
        federation.get("hitsPerPage").and_then(Value::as_u64),
    ) {
        (None, None) => {
            proxy_federation.insert("limit".into(), Value::from(offset + limit));
            proxy_federation.insert("offset".into(), Value::from(0));
        }
        (Some(0), _) => {}
        (page, per_page) => {
            let (page, per_page) = (page.unwrap_or(1), per_page.unwrap_or(20));
            proxy_federation.insert("page".into(), Value::from(1));
            proxy_federation.insert("hitsPerPage".into(), Value::from(page * per_page));
        }
    }
    proxy_federation.remove("mergeFacets");
    let proxy_federation = Value::Object(proxy_federation);
    let calls: Vec<_> = by_remote
        .into_iter()
        .map(|(name, queries)| {
            let remote = net.remotes[&name].clone();
            let body =
                serde_json::json!({"federation": proxy_federation, "queries": queries}).to_string();
            let handle = std::thread::Builder::new()
                .name("meili-remote-search".into())
                .spawn({
                    let name = name.clone();
                    move || network::proxy_search(&name, &remote, &body)
                });
            (name, handle)
        })
        .collect();
    let mut order = facets::Order::new(facet_options.merge.is_some(), has_remote);
    let local = run_local(shared, local, facet_options.by_index, &mut order);
    let mut remotes = has_remote.then(|| {
        let mut results = Vec::new();
        let mut errors = std::collections::BTreeMap::new();
        for (name, handle) in calls {
            let outcome = match handle {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| Err(ApiError::internal("remote search panicked"))),
                Err(e) => Err(ApiError::internal(e.to_string())),
            };
            match outcome {
                Ok(r) => results.push(r),
                Err(e) => {
                    errors.insert(name, e);
                }
            }
        }
        search::Remotes {
            local_name: net.local.clone(),
            results,
            errors,
        }
    });
    let (parts, local_facets) = local?;
    let remote_facets = remotes
        .iter_mut()
        .flat_map(|r| r.results.iter_mut())
        .map(|r| std::mem::take(&mut r.facets))
        .collect();
    let rendered = facets::finish(order, facet_options.merge, local_facets, remote_facets);
    ok(search::federated(
        parts,
        remotes,
        is_proxy,
        offset,
        limit,
        rendered,
        &request_uid,
    )?)
}

type LocalParts = Vec<(String, usize, f64, Result<search::Outcome>)>;

/// Runs the local queries of a federated search index by index (in uid order, as Meilisearch
/// does), with the facets of `facetsByIndex` over all the queries of each index.
fn run_local(
    shared: &Shared,
    local: Vec<(String, usize, usize, f64, search::SearchQuery)>,
    mut by_index: std::collections::BTreeMap<String, Option<Vec<String>>>,
    order: &mut facets::Order,
) -> Result<(LocalParts, facets::ByIndex)> {
    let mut groups: std::collections::BTreeMap<String, Vec<_>> = Default::default();
    for (uid, i, position, weight, query) in local {
        groups
            .entry(uid)
            .or_default()
            .push((i, position, weight, query));
    }
    let mut parts = Vec::new();
    let mut out = facets::ByIndex::default();
    for (uid, queries) in groups {
        let (first, first_position) = (queries[0].0, queries[0].1);
        let index = find_index(shared, &uid)
            .map_err(|e| e.prefixed(&format!("Inside `.queries[{first}]`: ")))?;
        let idx = read(&index);
        let patterns = by_index.remove(&uid).flatten();
        let inside = format!(
            "Inside `.queries[{first_position}]`: Inside `.federation.facetsByIndex.{uid}`: "
        );
        order
            .check(&idx, patterns.as_deref())
            .map_err(|e| e.prefixed(&inside))?;
        let mut matched = BTreeSet::new();
        for (i, position, weight, query) in queries {
            let outcome = search::execute_all(&idx, &query)
                .map_err(|e| e.prefixed(&format!("Inside `.queries[{i}]`: ")))?;
            matched.extend(outcome.matched.iter().copied());
            parts.push((uid.clone(), position, weight, Ok(outcome)));
        }
        if let Some(patterns) = patterns {
            let f = facets::compute(&idx, &patterns, &matched).map_err(|e| e.prefixed(&inside))?;
            out.0.insert(uid, f);
        }
    }
    // Indexes no query uses are still checked.
    for (uid, patterns) in by_index {
        let note = |e: ApiError| {
            let mut e = e.prefixed(&format!("Inside `.federation.facetsByIndex.{uid}`: "));
            e.message += &format!("\n - Note: index `{uid}` is not used in queries");
            e
        };
        let index = find_index(shared, &uid).map_err(|e| note(e.with_status(400)))?;
        let idx = read(&index);
        order.check(&idx, patterns.as_deref()).map_err(note)?;
        if let Some(patterns) = patterns {
            facets::compute(&idx, &patterns, &BTreeSet::new()).map_err(note)?;
        }
    }
    Ok((parts, out))
}

/// The `indexUid` of one query of a multi-search.
fn query_index_uid(q: &Value, at: &str) -> Result<String> {
    match q.get("indexUid") {
        None => Err(ApiError::new(
            "missing_index_uid",
            format!("Missing field `indexUid` inside `{at}`"),
        )),
        Some(Value::String(uid)) if valid_uid(uid) => Ok(uid.clone()),
        Some(v) => {
            let shown = v.as_str().map_or_else(|| v.to_string(), String::from);
            Err(ApiError::new(
                "invalid_index_uid",
                format!("Invalid value at `{at}.indexUid`: {}", uid_message(&shown)),
            ))
        }
    }
}

/// `"Invalid value type at `{at}`: expected {expected}, but found {value}"` (no location at
/// the root), as Meilisearch's deserializer words a wrong JSON type.
fn type_error(code: &str, at: &str, expected: &str, v: &Value) -> ApiError {
    let at = if at.is_empty() {
        String::new()
    } else {
        format!(" at `{at}`")
    };
    ApiError::new(
        code,
        format!(
            "Invalid value type{at}: expected {expected}, but found {}",
            describe(v)
        ),
    )
}

/// The body of `POST /swap-indexes`, checked in Meilisearch's order: the whole body's shape
/// and uids, then that each swap names two indexes, then that no index is named twice.
fn parse_swaps(body: &Value) -> Result<Vec<Swap>> {
    let Value::Array(items) = body else {
        return Err(type_error("bad_request", "", "an array", body));
    };
    let mut requested = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("[{i}]");
        let Value::Object(obj) = item else {
            return Err(type_error("bad_request", &at, "an object", item));
        };
        let (mut indexes, mut rename) = (None, false);
        for (key, v) in obj {
            match key.as_str() {
                "indexes" => indexes = Some(swap_uids(v, &format!("{at}.indexes"))?),
                "rename" => {
                    rename = v.as_bool().ok_or_else(|| {
                        type_error(
                            "invalid_swap_rename",
                            &format!("{at}.rename"),
                            "a boolean",
                            v,
                        )
                    })?
                }
                _ => {
                    let message = format!(
                        "Unknown field `{key}` inside `{at}`: expected one of `indexes`, `rename`"
                    );
                    return Err(ApiError::new("bad_request", message));
                }
            }
        }
        let indexes = indexes.ok_or_else(|| {
            ApiError::new(
                "missing_swap_indexes",
                format!("Missing field `indexes` inside `{at}`"),
            )
        })?;
        requested.push((indexes, rename));
    }
    let mut swaps = Vec::with_capacity(requested.len());
    for (indexes, rename) in requested {
        match <[String; 2]>::try_from(indexes) {
            Ok(indexes) => swaps.push(Swap { indexes, rename }),
            Err(list) => {
                let quoted: Vec<String> = list.iter().map(|u| format!("\"{u}\"")).collect();
                return Err(ApiError::new(
                    "invalid_swap_indexes",
                    format!(
                        "Two indexes must be given for each swap. The list `[{}]` contains {} indexes.",
                        quoted.join(", "),
                        list.len()
                    ),
                ));
            }
        }
    }
    let mut seen = HashSet::new();
    let twice: BTreeSet<&str> = swaps
        .iter()
        .flat_map(|s| &s.indexes)
        .map(String::as_str)
        .filter(|uid| !seen.insert(*uid))
        .collect();
    let verb = match twice.len() {
        0 => return Ok(swaps),
        1 => "was",
        _ => "were",
    };
    Err(ApiError::new(
        "invalid_swap_duplicate_index_found",
        format!(
            "Indexes must be declared only once during a swap. {} {verb} specified several times.",
            quoted_list(&Vec::from_iter(twice))
        ),
    ))
}

/// The uids of one swap; a bad one is reported under the `indexes` field's error code.
fn swap_uids(v: &Value, at: &str) -> Result<Vec<String>> {
    let Value::Array(uids) = v else {
        return Err(type_error("invalid_swap_indexes", at, "an array", v));
    };
    uids.iter()
        .enumerate()
        .map(|(i, uid)| match uid {
            Value::String(s) if valid_uid(s) => Ok(s.clone()),
            Value::String(s) => Err(ApiError::new(
                "invalid_swap_indexes",
                format!("Invalid value at `{at}[{i}]`: {}", uid_message(s)),
            )),
            _ => Err(type_error(
                "invalid_swap_indexes",
                &format!("{at}[{i}]"),
                "a string",
                uid,
            )),
        })
        .collect()
}

/// Filters shared by `GET /tasks` and `GET /batches`.
struct TaskFilter {
    uids: Option<Vec<u32>>,
    batch_uids: Option<Vec<u32>>,
    statuses: Option<Vec<String>>,
    types: Option<Vec<String>>,
    index_uids: Option<Vec<String>>,
    limit: usize,
    from: Option<u32>,
    reverse: bool,
}

fn task_filter(params: &[(String, String)], uid_code: &str) -> Result<TaskFilter> {
    let list = |name: &str| {
        param(params, name)
            .map(comma_list)
            .filter(|l| !l.iter().any(|v| v == "*"))
    };
    let numbers = |name: &str, code: &str| -> Result<Option<Vec<u32>>> {
        list(name)
            .map(|l| {
                l.iter()
                    .map(|v| {
                        v.parse::<u32>().map_err(|_| {
                            ApiError::new(
                                code,
                                format!("Invalid value in parameter `{name}`: could not parse `{v}` as a positive integer"),
                            )
                        })
                    })
                    .collect()
            })
            .transpose()
    };
    let statuses = list("statuses");
    if let Some(bad) = statuses
        .iter()
        .flatten()
        .find(|s| !Status::ALL.contains(&s.as_str()))
    {
        return Err(ApiError::new(
            "invalid_task_statuses",
            format!("Invalid value in parameter `statuses`: `{bad}` is not a valid task status. Available statuses are {}.", quoted_list(&Status::ALL)),
        ));
    }
    let types = list("types");
    if let Some(bad) = types
        .iter()
        .flatten()
        .find(|t| !Kind::ALL.contains(&t.as_str()))
    {
        return Err(ApiError::new(
            "invalid_task_types",
            format!("Invalid value in parameter `types`: `{bad}` is not a valid task type. Available types are {}.", quoted_list(&Kind::ALL)),
        ));
    }
    let index_uids = list("indexUids");
    if let Some((i, bad)) = index_uids
        .iter()
        .flatten()
        .enumerate()
        .find(|(_, u)| !valid_uid(u))
    {
        return Err(ApiError::new(
            "invalid_index_uid",
            format!(
                "Invalid value in parameter `indexUids[{i}]`: {}",
                uid_message(bad)
            ),
        ));
    }
    let reverse = match param(params, "reverse") {
        None | Some("false") => false,
        Some("true") => true,
        Some(v) => {
            return Err(ApiError::new(
                "invalid_task_reverse",
                format!("Invalid value in parameter `reverse`: could not parse `{v}` as a boolean, expected either `true` or `false`"),
            ))
        }
    };
    Ok(TaskFilter {
        uids: numbers("uids", uid_code)?,
        batch_uids: numbers("batchUids", "invalid_batch_uids")?,
        statuses,
        types,
        index_uids,
        limit: param_usize(params, "limit", "invalid_task_limit")?.unwrap_or(20),
        from: param_usize(params, "from", "invalid_task_from")?.map(|n| n as u32),
        reverse,
    })
}

fn quoted_list(items: &[&str]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| format!("`{s}`")).collect();
    match quoted.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{}, {last}", rest.join(", ")),
        _ => quoted.join(""),
    }
}

fn matches_task(f: &TaskFilter, t: &tasks::Task) -> bool {
    !t.forgotten
        && f.uids.as_ref().is_none_or(|u| u.contains(&t.uid))
        && f.batch_uids
            .as_ref()
            .is_none_or(|b| t.batch_uid.is_some_and(|x| b.contains(&x)))
        && f.statuses
            .as_ref()
            .is_none_or(|s| s.iter().any(|s| s == t.status.name()))
        && f.types
            .as_ref()
            .is_none_or(|k| k.iter().any(|k| k == t.kind.name()))
        && f.index_uids
            .as_ref()
            .is_none_or(|i| i.iter().any(|uid| t.concerns(uid)))
}

/// Whether a matching task is listed. Meilisearch counts the swaps of the indexes asked for
/// in `total`, yet leaves tasks without an `indexUid` out of an `indexUids` query's results.
fn listed(f: &TaskFilter, t: &tasks::Task) -> bool {
    f.index_uids.is_none() || t.index_uid().is_some()
}

fn list_tasks(shared: &Shared, params: &[(String, String)]) -> Result<Response> {
    let f = known_params(params, TASK_PARAMS, |p| task_filter(p, "invalid_task_uids"))?;
    let queue = lock(&shared.queue);
    let matching: Vec<(u32, &tasks::Task)> = queue
        .tasks
        .iter()
        .filter(|t| matches_task(&f, t))
        .map(|t| (t.uid, t))
        .collect();
    let total = matching.len();
    ok(tasks::page(
        matching,
        total,
        (f.limit, f.from, f.reverse),
        |t| listed(&f, t),
        |t| t.to_json(),
    ))
}

/// `GET /batches`: unlike tasks, the batches of a swap are listed under `indexUids` (observed:
/// `GET /batches?indexUids=sa&limit=1` lists the swap's batch, `next` set).
fn list_batches(shared: &Shared, params: &[(String, String)]) -> Result<Response> {
    let f = known_params(params, TASK_PARAMS, |p| {
        task_filter(p, "invalid_batch_uids")
    })?;
    let queue = lock(&shared.queue);
    let task_filter = TaskFilter {
        uids: None,
        batch_uids: None,
        ..f
    };
    let matches = |b: &tasks::Batch| {
        b.task_uids
            .iter()
            .filter_map(|t| queue.tasks.get(*t as usize))
            .any(|t| matches_task(&task_filter, t))
    };
    let matching: Vec<(u32, &tasks::Batch)> = queue
        .batches
        .iter()
        .filter(|b| f.uids.as_ref().is_none_or(|u| u.contains(&b.uid)))
        .filter(|b| matches(b))
        .map(|b| (b.uid, b))
        .collect();
    let total = matching.len();
    let shown = (task_filter.limit, task_filter.from, task_filter.reverse);
    ok(tasks::page(
        matching,
        total,
        shown,
        |_| true,
        |b| b.to_json(&queue.tasks),
    ))
}

#[cfg(test)]
mod tests {
    use super::byte_size;

    #[test]
    fn byte_sizes_as_meilisearch_prints_them() {
        // Observed on Meilisearch 1.50 with `--http-payload-size-limit N`.
        let observed = [
            (100_000_000, "100 MB"),
            (1_000_000, "1 MB"),
            (123_456_789, "123.456789 MB"),
            (1_048_577, "1.048577 MB"),
            (1_048_576, "1 MiB"),
            (2_048_000, "1.953125 MiB"),
            (1_536_000, "1.46484375 MiB"),
            (1024, "1 KiB"),
            (1032, "1.032 KB"),
            (1040, "1.04 KB"),
            (1100, "1.1 KB"),
            (2560, "2.56 KB"),
            (1500, "1.5 KB"),
            (999, "999 B"),
        ];
        for (n, text) in observed {
            assert_eq!(byte_size(n), text, "{n}");
        }
    }
}
