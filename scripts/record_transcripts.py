#!/usr/bin/env python3
"""Records the Meilisearch API transcripts that tests/meili-server/tests/transcripts.rs replays.

Run it through scripts/record-transcripts.sh, which finds the binary (MEILI_BIN, or
`meilisearch` on PATH). This program starts that binary in a temporary directory on a free
port with the master key MASTER_KEY, sends a fixed sequence of requests (SCENARIOS below), and
writes one JSON file per exchange into the output directory (by default
tests/meili-server/transcripts), replacing the *.json files there:

    {"request": {"method", "path", "headers", "body", "note"?, "bodyNote"?},
     "response": {"status", "body"}}

The request's headers are exactly those sent besides Host and Content-Length. A JSON body is
stored as JSON and was sent compact with sorted keys (what serde_json writes when the replay
sends it again); an NDJSON or other raw body is stored as a string. A gzip request's body is
shown before compression (`bodyNote` says so). The one big payload is omitted:
`"<omitted: N bytes ...>"`, and the replay generates the same documents (generated_products in
transcripts.rs; it checks the byte count).

Before each request the recorder waits until the server has no enqueued or processing task,
as the replay does, except inside a burst: a request whose note says "the next N requests"
is followed by N requests sent while its task is processing, so that they are auto-batched.

What the replay does not compare is replaced by a fixed placeholder of the same JSON type, so
that recording twice gives the same files: dates, durations, processing times, request uids
and database sizes (see PLACEHOLDERS; the replay's RUN_SPECIFIC keys), and the subtrees the
replay treats as opaque are emptied (OPAQUE). Task and batch uids are kept: the sequence is
fixed, so they are too, and the replay maps them onto the ones the test server assigns.

Python 3 standard library only.
"""

import argparse
import gzip
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

MASTER_KEY = "MASTER_KEY"
AUTH = {"Authorization": f"Bearer {MASTER_KEY}"}

# Values the replay only type-checks (its RUN_SPECIFIC list, minus the uids, `from` and `next`,
# which a fixed sequence makes fixed), by key: replaced by these when they are of that type.
DATE = "2000-01-01T00:00:00Z"
PLACEHOLDERS = {
    "enqueuedAt": DATE,
    "startedAt": DATE,
    "finishedAt": DATE,
    "createdAt": DATE,
    "updatedAt": DATE,
    "lastUpdate": DATE,
    "duration": "PT0S",
    "processingTimeMs": 0,
    "requestUid": "00000000-0000-0000-0000-000000000000",
    "databaseSize": 0,
    "usedDatabaseSize": 0,
    "rawDocumentDbSize": 0,
    "avgDocumentSize": 0,
}
# Engine-internal subtrees (timings per indexing step, LMDB sizes, channel counters): the replay
# only checks that they are objects.
OPAQUE = ("progressTrace", "internalDatabaseSizes", "writeChannelCongestion")

PRODUCTS = [
    {"id": 1, "name": "Red Kettle", "description": "steel kettle for the kitchen",
     "category": "kitchen", "price": 29.99, "in_stock": True, "tags": ["new", "eco", "gift"],
     "meta": {"color": "red", "size": "M"}, "updated_at": "2024-05-01T10:00:00Z", "version": 1},
    {"id": 2, "name": "Blue Lamp", "description": "modern office lamp", "category": "office",
     "price": 45.5, "in_stock": False, "tags": ["sale", "premium", "gift"],
     "meta": {"color": "blue", "size": "S"}, "updated_at": "2024-05-02T11:30:00Z", "version": 1},
    {"id": 3, "name": "Green Tent", "description": "lightweight outdoor tent for travel",
     "category": "outdoor", "price": 199.0, "in_stock": True,
     "tags": ["eco", "bundle", "limited"], "meta": {"color": "green", "size": "L"},
     "updated_at": "2024-05-03T08:15:00Z", "version": 1},
    {"id": 4, "name": "Black Watch", "description": "classic leather watch",
     "category": "clothing", "price": 120.0, "in_stock": True,
     "tags": ["gift", "premium", "new"], "meta": {"color": "black", "size": "M"},
     "updated_at": "2024-05-04T09:00:00Z", "version": 1},
    {"id": 5, "name": "White Chair", "description": "ergonomic office chair",
     "category": "office", "price": 349.95, "in_stock": True,
     "tags": ["bestseller", "sale", "local"], "meta": {"color": "white", "size": "L"},
     "updated_at": "2024-05-05T12:00:00Z", "version": 1},
]

BIG_IDS = range(100_000, 120_000)


def compact(value):
    """JSON as serde_json's `Value::to_string` writes it (sorted keys, no spaces)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def ndjson(*docs):
    """NDJSON lines as written here (insertion order of keys), each ending in a newline."""
    return "".join(json.dumps(d, separators=(",", ":"), ensure_ascii=False) + "\n" for d in docs)


def generated_products():
    """The big payload: the same documents as `generated_products` in tests/transcripts.rs."""
    categories = ["kitchen", "office", "outdoor", "clothing"]
    lines = []
    for i in BIG_IDS:
        lines.append(compact({
            "id": i,
            "name": f"Product {i}",
            "description": f"generated product number {i} for the autobatch test",
            "category": categories[i % 4],
            "price": float(i % 1000) + 0.99,
            "in_stock": i % 2 == 0,
            "tags": ["gen", categories[i % 3]],
            "meta": {"color": "grey", "size": "M"},
            "updated_at": "2024-06-01T00:00:00Z",
            "version": 1,
        }) + "\n")
    return "".join(lines).encode()


class Step:
    """One recorded exchange.

    `path` may name the task or batch of an earlier step: `{task:NAME}`, `{batch:NAME}` (the
    batch that step's task ran in). `body`: None, a dict or list (sent as JSON), a str (sent
    as is), or BIG. `task`: if the answer enqueued a task, also record `GET /tasks/{uid}` once
    it has finished, as NAME-task. `burst`: the next N steps are sent while this step's task
    is processing.
    """

    def __init__(self, name, method, path, body=None, *, ctype=None, headers=None, gzip=False,
                 note=None, task=False, burst=0):
        self.name, self.method, self.path, self.body = name, method, path, body
        self.gzip, self.note, self.task, self.burst = gzip, note, task, burst
        if headers is None:
            headers = dict(AUTH)
            if body is not None:
                headers["Content-Type"] = ctype or (
                    "application/json" if isinstance(body, (dict, list)) else "application/x-ndjson")
            if gzip:
                headers["Content-Encoding"] = "gzip"
        self.headers = headers


BIG = object()


def get(name, path, headers=None, note=None):
    return Step(name, "GET", path, headers=dict(AUTH) if headers is None else headers, note=note)


def add(name, index, body, note=None, method="POST", pk="id", task=True, **kw):
    return Step(name, method, f"/indexes/{index}/documents?primaryKey={pk}", body, note=note,
                task=task, **kw)


def search(name, index, body, note=None):
    return Step(name, "POST", f"/indexes/{index}/search", body, note=note)


LONG_ID = "a" * 600
ID_511 = "b" * 511

SCENARIOS = [
    # --- an index, documents as NDJSON and gzip NDJSON, wrong encodings, reads, partial updates
    Step("create-index", "POST", "/indexes", {"uid": "products", "primaryKey": "id"}, task=True),
    add("add-docs-ndjson", "products", ndjson(*PRODUCTS[:3])),
    add("add-docs-ndjson-gzip", "products", ndjson(*PRODUCTS[3:]), gzip=True),
    add("gzip-header-but-plain-body", "products", ndjson({"id": 99, "name": "not compressed"}),
        headers={**AUTH, "Content-Type": "application/x-ndjson", "Content-Encoding": "gzip"},
        note="Content-Encoding: gzip header sent, but the body is NOT compressed"),
    add("ndjson-as-form-urlencoded", "products", ndjson({"id": 98, "name": "form content type"}),
        ctype="application/x-www-form-urlencoded",
        note="NDJSON sent as application/x-www-form-urlencoded (what curl --data-binary sends"
             " without -H Content-Type)"),
    add("ndjson-without-content-type", "products", ndjson({"id": 97, "name": "no content type"}),
        headers=dict(AUTH), note="no Content-Type header at all"),
    get("get-document", "/indexes/products/documents/1"),
    add("put-docs-partial-ndjson", "products",
        ndjson({"id": 1, "price": 24.99, "version": 2},
               {"id": 6, "name": "Upserted Bottle", "price": 9.5}),
        method="PUT", note="PUT updates document 1 in part and creates document 6"),
    get("get-document-after-put", "/indexes/products/documents/1"),
    get("get-document-upserted", "/indexes/products/documents/6"),
    get("get-document-missing", "/indexes/products/documents/424242"),
    # --- settings and search
    Step("patch-settings-filterable", "PATCH", "/indexes/products/settings",
         {"filterableAttributes": ["category", "in_stock", "price", "meta.color"],
          "sortableAttributes": ["price", "updated_at"]}, task=True),
    search("search", "products", {"q": "office", "limit": 2, "sort": ["price:asc"],
                                  "filter": "category = office AND in_stock = true AND price < 400"}),
    search("search-filter-nested", "products", {"q": "", "limit": 5, "filter": "meta.color IN [red, blue]"}),
    search("search-filter-not-filterable", "products", {"q": "", "filter": "name = x"}),
    Step("multi-search", "POST", "/multi-search", {"queries": [
        {"indexUid": "products", "q": "tent", "limit": 1},
        {"indexUid": "products", "q": "", "filter": "price > 100", "limit": 2,
         "attributesToRetrieve": ["id", "price"]}]}),
    # --- deletions
    Step("delete-batch", "POST", "/indexes/products/documents/delete-batch", [2, "3", 12345],
         note='ids 2 (number), "3" (string) and 12345 (does not exist)', task=True),
    Step("delete-all", "DELETE", "/indexes/products/documents", task=True),
    # --- failures
    add("invalid-id-batch", "products", ndjson(
        {"id": 10, "name": "valid before"}, {"id": "bad id with spaces!", "name": "invalid id"},
        {"id": 11, "name": "valid after"}), note="one bad id fails the whole task"),
    get("invalid-id-batch-stats", "/indexes/products/stats"),
    add("missing-primary-key", "products", ndjson({"id": 20, "name": "has id"}, {"name": "no id field"})),
    add("malformed-ndjson", "products",
        '{"id":30,"name":"ok"}\n{"id":31,"name": "broken"\n{"id":32,"name":"ok"}\n'),
    add("json-array-as-ndjson", "products", '[{"id":33}]\n',
        note="a JSON array sent with Content-Type application/x-ndjson"),
    add("primary-key-mismatch", "products", ndjson({"sku": "a1", "name": "x"}), pk="sku",
        note="index primary key is id; request asks primaryKey=sku"),
    get("invalid-api-key", "/indexes", headers={"Authorization": "Bearer wrong-key"}),
    get("missing-api-key", "/indexes", headers={}),
    get("basic-auth-scheme", "/indexes", headers={"Authorization": f"Basic {MASTER_KEY}"},
        note="not the bearer scheme"),
    search("search-missing-index", "does-not-exist", {"q": "x"}),
    get("get-task-missing", "/tasks/999999"),
    get("get-index-missing", "/indexes/does-not-exist"),
    add("add-docs-autocreates-index", "autocreated", ndjson({"id": 1, "name": "x"}),
        note="index autocreated does not exist yet"),
    Step("create-index-exists", "POST", "/indexes", {"uid": "products", "primaryKey": "id"},
         task=True, note="products exists already"),
    Step("delete-index-missing", "DELETE", "/indexes/does-not-exist", task=True),
    Step("patch-settings-invalid", "PATCH", "/indexes/products/settings",
         {"filterableAttributes": "category"}, note="a string where an array is expected"),
    search("search-invalid-q", "products", {"q": 1}),
    search("search-unknown-parameter", "products", {"q": "", "foo": 1}),
    # --- auto-batching: three small tasks queued behind a big one run as one batch, and only
    # the task with the bad document fails
    Step("autobatch-0-big", "POST", "/indexes/products/documents?primaryKey=id", BIG,
         ctype="application/x-ndjson", task=False, burst=3,
         note="20,000 generated products (ids 100000..119999); the next 3 requests are sent"
              " while its task is processing"),
    add("autobatch-1-valid", "products", ndjson({"id": 40, "name": "autobatch valid 1"}), task=False),
    add("autobatch-2-invalid-id", "products", ndjson(
        {"id": 41, "name": "autobatch valid in bad task"}, {"id": "bad id!", "name": "autobatch invalid"}),
        task=False),
    add("autobatch-3-valid", "products", ndjson({"id": 42, "name": "autobatch valid 2"}), task=False),
    get("autobatch-0-big-task", "/tasks/{task:autobatch-0-big}"),
    get("autobatch-1-valid-task", "/tasks/{task:autobatch-1-valid}"),
    get("autobatch-2-invalid-id-task", "/tasks/{task:autobatch-2-invalid-id}"),
    get("autobatch-3-valid-task", "/tasks/{task:autobatch-3-valid}"),
    Step("autobatch-docs-40-41-42", "POST", "/indexes/products/documents/fetch",
         {"ids": [40, 41, 42], "fields": ["id", "name"]},
         note="which documents of the 3 small tasks were indexed?"),
    # --- value types: ids and fields
    Step("types-create-index", "POST", "/indexes", {"uid": "types", "primaryKey": "id"}, task=True),
    add("types-number-id", "types", ndjson({"id": 1, "kind": "number id"})),
    add("types-string-id", "types", ndjson({"id": "abc-DEF_123", "kind": "string id"})),
    add("types-string-id-same-as-number", "types", ndjson({"id": "1", "kind": 'string "1" after number 1'})),
    add("types-u64-max-id", "types", ndjson({"id": 18446744073709551615, "kind": "u64 max id"})),
    add("types-id-above-u64", "types", ndjson({"id": 18446744073709551616, "kind": "id above u64"})),
    add("types-negative-id", "types", ndjson({"id": -5, "kind": "negative id"})),
    add("types-float-id", "types", '{"id":1.5,"kind":"float id"}\n'),
    add("types-float-integral-id", "types", '{"id":7.0,"kind":"float id with .0"}\n'),
    add("types-511-byte-id", "types", ndjson({"id": ID_511, "kind": "511-byte string id"})),
    add("types-long-string-id", "types", ndjson({"id": LONG_ID, "kind": "600-char string id"})),
    add("types-nested-object", "types", ndjson(
        {"id": 100, "meta": {"color": "red", "size": {"w": 10, "h": 20}}, "kind": "nested object"})),
    add("types-text-array", "types", ndjson({"id": 101, "tags": ["red", "green", "blue"], "kind": "text array"})),
    add("types-null-field", "types", ndjson({"id": 102, "name": None, "kind": "null field"})),
    add("types-float-field", "types", '{"id":103,"price":12.34,"ratio":0.1,"big":1e300,"kind":"float"}\n'),
    add("types-mixed-array", "types", ndjson(
        {"id": 104, "arr": [1, "two", 3.5, None, {"x": 1}, [5, 6]], "kind": "mixed array"})),
    add("types-bool-and-date", "types", ndjson(
        {"id": 105, "in_stock": False, "updated_at": "2024-05-01T10:00:00Z", "kind": "bool and date string"})),
    add("types-duplicate-ids-in-batch", "types", '{"id":106,"v":1}\n{"id":106,"v":2}\n',
        note="the same id twice in one payload"),
    add("types-integral-float-and-mixed-array", "types",
        '{"id":107,"price":199.0,"tags":["yellow",2,10.0],"kind":"integral float, numbers in tags"}\n'),
    Step("types-settings-filterable", "PATCH", "/indexes/types/settings",
         {"filterableAttributes": ["meta.color", "tags", "name", "price", "in_stock", "meta"]}, task=True),
    get("types-get-documents", "/indexes/types/documents?limit=50"),
    search("types-filter-nested", "types", {"filter": "meta.color = red"}),
    search("types-filter-array", "types", {"filter": "tags = green"}),
    search("types-filter-null", "types", {"filter": "name IS NULL"}),
    search("types-filter-float", "types", {"filter": "price = 12.34"}),
    search("types-facets", "types", {"limit": 0, "facets": ["price", "tags", "in_stock"]},
           note="facet values of a few documents: numbers first, in the order of their text"),
    # --- what the extension reads: task lists, batches, documents by page, settings, facets
    get("tasks-filter-failed", "/tasks?indexUids=products&statuses=failed&limit=3"),
    get("tasks-filter-succeeded-types",
        "/tasks?indexUids=products,types&statuses=succeeded&types=documentAdditionOrUpdate&limit=2"),
    get("tasks-unfinished", "/tasks?statuses=enqueued,processing&limit=1",
        note="nothing is enqueued or processing"),
    get("tasks-by-uids", "/tasks?uids={task:add-docs-ndjson},{task:put-docs-partial-ndjson}&limit=2"),
    get("batches", "/batches?limit=2"),
    get("batch-of-autobatch", "/batches/{batch:autobatch-1-valid}"),
    Step("fetch-by-ids", "POST", "/indexes/products/documents/fetch",
         {"ids": [40, 100001, 424242], "limit": 3}),
    Step("fetch-page-of-field", "POST", "/indexes/products/documents/fetch",
         {"offset": 1, "limit": 3, "fields": ["id"]}),
    get("get-documents-page", "/indexes/products/documents?offset=1&limit=2"),
    get("get-settings", "/indexes/products/settings"),
    search("search-facets", "products", {"q": "", "limit": 0, "facets": ["category", "in_stock", "price"]},
           note="facet values of over 3,000 documents: numbers in numeric order, the first 100"),
    add("put-docs-gzip", "products", ndjson({"id": 42, "price": 1.5}), method="PUT", gzip=True),
    Step("delete-batch-gzip", "POST", "/indexes/products/documents/delete-batch", [40], gzip=True,
         task=True),
    get("health", "/health", headers={}),
    get("version", "/version"),
    get("stats", "/stats"),
    get("index-stats", "/indexes/products/stats"),
    get("get-index", "/indexes/products"),
    get("list-indexes", "/indexes"),
    # --- swapping a rebuilt index in, as a resync does, then dropping the old one
    Step("swap-create-index", "POST", "/indexes", {"uid": "products_new", "primaryKey": "id"}, task=True),
    add("swap-add-docs", "products_new", ndjson(PRODUCTS[0], PRODUCTS[1])),
    Step("swap-indexes", "POST", "/swap-indexes", [{"indexes": ["products", "products_new"]}], task=True),
    get("swap-index-stats-after", "/indexes/products/stats"),
    get("swap-old-index-stats-after", "/indexes/products_new/stats"),
    Step("swap-indexes-missing", "POST", "/swap-indexes", [{"indexes": ["products", "does-not-exist"]}],
         task=True, note="one index of the pair does not exist"),
    Step("delete-index", "DELETE", "/indexes/products_new", task=True),
    get("get-index-deleted", "/indexes/products_new"),
    get("tasks-swaps", "/tasks?types=indexSwap"),
]


def normalise(value, key=""):
    if key in OPAQUE and isinstance(value, dict):
        return {}
    if key in PLACEHOLDERS and type(value) is type(PLACEHOLDERS[key]):
        return PLACEHOLDERS[key]
    if isinstance(value, dict):
        return {k: normalise(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v) for v in value]
    return value


class Recorder:
    def __init__(self, host, port, out):
        self.host, self.port, self.out = host, port, out
        self.tasks = {}
        self.count = 0
        self.big = generated_products()

    def send(self, method, path, headers, body):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            for k, v in headers.items():
                conn.putheader(k, v)
            if body is not None:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, (json.loads(raw) if raw else None)
        finally:
            conn.close()

    def api(self, path):
        status, body = self.send("GET", path, AUTH, None)
        if status != 200:
            raise SystemExit(f"record-transcripts: GET {path} answered {status}: {body}")
        return body

    def wait_idle(self, timeout=300):
        deadline = time.monotonic() + timeout
        while self.api("/tasks?statuses=enqueued,processing&limit=1")["results"]:
            if time.monotonic() > deadline:
                raise SystemExit("record-transcripts: tasks did not finish")
            time.sleep(0.02)

    def resolve(self, path):
        """Replaces `{task:NAME}` and `{batch:NAME}` with the uids of step NAME's task."""
        for kind in ("task", "batch"):
            while "{" + kind + ":" in path:
                start = path.index("{" + kind + ":")
                end = path.index("}", start)
                uid = self.tasks[path[start + len(kind) + 2:end]]
                if kind == "batch":
                    uid = self.api(f"/tasks/{uid}")["batchUid"]
                path = path[:start] + str(uid) + path[end + 1:]
        return path

    def record(self, step):
        path = self.resolve(step.path)
        request = {"method": step.method, "path": path, "headers": step.headers}
        if step.body is BIG:
            sent = self.big
            request["body"] = (f"<omitted: {len(sent)} bytes of NDJSON: generated_products(100000..120000)"
                               " in tests/meili-server/tests/transcripts.rs>")
        elif isinstance(step.body, (dict, list)):
            sent = compact(step.body).encode()
            request["body"] = json.loads(sent)
        elif step.body is not None:
            sent = step.body.encode()
            request["body"] = step.body
        else:
            sent = None
            request["body"] = None
        if step.note:
            request["note"] = step.note
        if step.gzip:
            sent = gzip.compress(sent, mtime=0)
            request["bodyNote"] = "body was sent gzip-compressed; shown here before compression"
        status, body = self.send(step.method, path, step.headers, sent)
        if isinstance(body, dict) and isinstance(body.get("taskUid"), int):
            self.tasks[step.name] = body["taskUid"]
        self.count += 1
        transcript = {"request": request, "response": {"status": status, "body": normalise(body)}}
        name = f"{self.count:03}-{step.name}.json"
        with open(os.path.join(self.out, name), "w", encoding="utf-8") as f:
            json.dump(transcript, f, indent=2, ensure_ascii=False)
            f.write("\n")
        print(f"  {name}: {step.method} {path} -> {status}")
        return body

    def run(self, scenarios):
        steps = list(scenarios)
        burst = 0
        i = 0
        while i < len(steps):
            step = steps[i]
            if burst == 0:
                self.wait_idle()
            else:
                burst -= 1
            self.record(step)
            if step.burst:
                self.wait_processing(self.tasks[step.name])
                burst = step.burst
            if step.task and step.name in self.tasks:
                if burst:
                    raise SystemExit(f"record-transcripts: {step.name}: no task= inside a burst")
                steps.insert(i + 1, get(f"{step.name}-task", f"/tasks/{{task:{step.name}}}"))
            i += 1
        self.wait_idle()

    def wait_processing(self, uid):
        deadline = time.monotonic() + 60
        while True:
            status = self.api(f"/tasks/{uid}")["status"]
            if status == "processing":
                return
            if status != "enqueued" or time.monotonic() > deadline:
                raise SystemExit(f"record-transcripts: task {uid} is {status}, not processing: "
                                 "the burst after it would not be auto-batched")
            time.sleep(0.005)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_autobatch(rec):
    """The burst must have been batched as intended, or the transcripts say something else."""
    big = rec.api(f"/tasks/{rec.tasks['autobatch-0-big']}")["batchUid"]
    small = {rec.api(f"/tasks/{rec.tasks[n]}")["batchUid"]
             for n in ("autobatch-1-valid", "autobatch-2-invalid-id", "autobatch-3-valid")}
    if len(small) != 1 or big in small:
        raise SystemExit(f"record-transcripts: the burst was not auto-batched (big task in batch {big},"
                         f" the three small ones in {sorted(small)}); record again")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", required=True, help="the Meilisearch binary")
    parser.add_argument("--out", required=True, help="directory to write the transcripts into")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="meili-transcripts.")
    port = free_port()
    log_path = os.path.join(work, "meilisearch.log")
    log = open(log_path, "wb")
    server = subprocess.Popen(
        [args.bin, "--db-path", os.path.join(work, "data"), "--http-addr", f"127.0.0.1:{port}",
         "--master-key", MASTER_KEY, "--env", "development", "--no-analytics",
         "--dump-dir", os.path.join(work, "dumps"), "--snapshot-dir", os.path.join(work, "snapshots")],
        cwd=work, stdout=log, stderr=subprocess.STDOUT)
    staging = tempfile.mkdtemp(prefix="transcripts.", dir=os.path.dirname(os.path.abspath(args.out)))
    try:
        rec = Recorder("127.0.0.1", port, staging)
        deadline = time.monotonic() + 60
        while True:
            if server.poll() is not None:
                raise SystemExit(f"record-transcripts: {args.bin} exited with {server.returncode}:\n"
                                 + open(log_path, errors="replace").read()[-3000:])
            try:
                if rec.send("GET", "/health", {}, None)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("record-transcripts: Meilisearch did not answer /health within 60 s")
            time.sleep(0.1)
        version = rec.api("/version")["pkgVersion"]
        print(f"record-transcripts: Meilisearch {version} on 127.0.0.1:{port}, writing {args.out}")
        if not version.startswith("1.50."):
            print(f"record-transcripts: warning: the test server models Meilisearch 1.50, this is {version}",
                  file=sys.stderr)
        rec.run(SCENARIOS)
        check_autobatch(rec)
        os.makedirs(args.out, exist_ok=True)
        for name in os.listdir(args.out):
            if name.endswith(".json"):
                os.remove(os.path.join(args.out, name))
        for name in sorted(os.listdir(staging)):
            shutil.move(os.path.join(staging, name), os.path.join(args.out, name))
        print(f"record-transcripts: {rec.count} transcripts from Meilisearch {version} in {args.out}")
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
