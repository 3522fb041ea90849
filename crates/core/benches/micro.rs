//! Micro benchmarks of the worker's pure stages (criterion): the value encoder per type, one
//! `products` document, the batcher's NDJSON framing of 10,000-document batches, gzip levels, and
//! the streaming pipeline alone (pgoutput Insert bytes → parse → change mapping → encoding →
//! batcher) into a sink that drops the batches, in documents per second.
//!
//! Run with `bash scripts/bench-micro.sh` (or `cargo bench -p pg_meili_sync_core --bench micro`;
//! criterion arguments such as a name filter or `--measurement-time 10` after `--`).
//!
//! These call the core crate's own functions, the ones the worker calls, built with the release
//! profile. The one piece replaced here is the worker's `Relation` → document shape (its type lookups ask the
//! catalog): [`products_shape`] maps the `products` columns' type OIDs as `catalog::value_kind`
//! does, once per stream, outside the timed loop.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flate2::Compression;
use pg_meili_sync_core::document::encode::{
    encode_document, write_value, Column, ColumnValue, DocumentShape, ValueKind,
};
use pg_meili_sync_core::meili::request::{Batch, Operation};
use pg_meili_sync_core::meili::writer::gzip;
use pg_meili_sync_core::pipeline::batch::{BatchLimits, Batcher};
use pg_meili_sync_core::task::failure::{Failure, FailureKind};
use pg_meili_sync_core::wal::changes::{ChangeMapper, RelationShape};
use pg_meili_sync_core::wal::pgoutput::{parse, Message, Relation};
use pg_meili_sync_e2e::products;

/// Documents per batch: the `batch_size` default.
const BATCH_DOCS: usize = 10_000;
/// The `batch_bytes` default; 10,000 `products` documents stay well below it.
const BATCH_BYTES: usize = 16 << 20;
/// Rows per transaction in the pipeline's stream, as in the load command's `stream` run.
const ROWS_PER_TRANSACTION: usize = 500;
/// The worker closes aged batches once per round of this many decoded records.
const RECORDS_PER_ROUND: usize = 2000;
/// Relation oid of the synthetic `products` table.
const PRODUCTS_OID: u32 = 16_400;

fn limits() -> BatchLimits {
    BatchLimits {
        max_docs: BATCH_DOCS,
        max_bytes: BATCH_BYTES,
        max_age: Duration::from_millis(200),
    }
}

fn array(element: ValueKind) -> ValueKind {
    ValueKind::Array(Box::new(element))
}

// ---------------------------------------------------------------------------------------------
// The `products` table of tests/e2e/src/products.rs, as Postgres' text output sends its rows.

/// Name, type oid, type modifier.
const PRODUCTS_COLUMNS: [(&str, u32, i32); 10] = [
    ("id", 20, -1),                        // bigint
    ("name", 25, -1),                      // text
    ("description", 25, -1),               // text
    ("category", 25, -1),                  // text
    ("price", 1700, ((10 << 16) | 2) + 4), // numeric(10,2)
    ("in_stock", 16, -1),                  // boolean
    ("tags", 1009, -1),                    // text[]
    ("meta", 3802, -1),                    // jsonb
    ("updated_at", 1184, -1),              // timestamptz
    ("version", 23, -1),                   // integer
];

/// `catalog::value_kind` for the types `products` uses.
fn value_kind(type_oid: u32) -> ValueKind {
    match type_oid {
        20 | 23 => ValueKind::Integer,
        25 => ValueKind::Text,
        1700 => ValueKind::Numeric,
        16 => ValueKind::Bool,
        1009 => array(ValueKind::Text),
        3802 => ValueKind::Json,
        1184 => ValueKind::TimestampTz,
        _ => ValueKind::Other,
    }
}

/// The worker's `ColumnRules::relation_shape` for a task with default options: every column, the
/// primary key `id` as key.
fn products_shape(relation: &Relation) -> Result<RelationShape, Failure> {
    let columns: Vec<Column> = relation
        .columns
        .iter()
        .map(|column| Column {
            name: column.name.clone(),
            kind: value_kind(column.type_oid),
        })
        .collect();
    let key = columns
        .iter()
        .position(|column| column.name == "id")
        .ok_or_else(|| Failure::new(FailureKind::Source, "no id column"))?;
    let source_columns = (0..columns.len()).collect();
    let shape = DocumentShape::new(columns, vec![key])
        .map_err(|error| Failure::new(FailureKind::Source, error.to_string()))?;
    Ok(RelationShape {
        table: "public.products".to_owned(),
        shape,
        source_columns,
    })
}

/// The text output of each column of row `id` (`None` = NULL), as `products::insert_sql`
/// generates it, in a session with `TimeZone 'UTC'`.
struct ProductRow {
    texts: [Option<String>; 10],
}

impl ProductRow {
    fn new(id: i64) -> Self {
        const CATEGORIES: [&str; 4] = ["kitchen", "office", "outdoor", "garden"];
        const COLORS: [&str; 3] = ["red", "blue", "green"];
        let cents = (id % 1000) * 137 + 99;
        let description =
            (id % 10 != 0).then(|| format!("Déscription \"{id}\"\\ with ünïcødé ✓\tand tab"));
        let tags = if id % 7 == 0 {
            "{}".to_owned()
        } else {
            format!("{{t{},u{}}}", id % 5, id % 11)
        };
        // jsonb's output: keys by length, then bytes.
        let meta = format!(
            r#"{{"size": {}, "color": "{}", "nested": {{"k": {id}, "list": [1, "a", null]}}}}"#,
            id % 10,
            COLORS[(id % 3) as usize]
        );
        ProductRow {
            texts: [
                Some(id.to_string()),
                Some(format!("Product {id}")),
                description,
                Some(CATEGORIES[(id % 4) as usize].to_owned()),
                Some(format!("{}.{:02}", cents / 100, cents % 100)),
                Some(if id % 3 != 0 { "t" } else { "f" }.to_owned()),
                Some(tags),
                Some(meta),
                Some(timestamptz_after_2024(id)),
                Some("1".to_owned()),
            ],
        }
    }

    fn values(&self) -> Vec<ColumnValue<'_>> {
        self.texts
            .iter()
            .map(|text| text.as_deref().map_or(ColumnValue::Null, ColumnValue::Text))
            .collect()
    }
}

/// `timestamptz '2024-01-01 00:00:00+00' + minutes * interval '1 minute'` as Postgres prints it
/// under `TimeZone 'UTC'` (the data generator's date, in Postgres's text form).
fn timestamptz_after_2024(minutes: i64) -> String {
    products::timestamp_after_2024(minutes)
        .replacen('T', " ", 1)
        .replace('Z', "+00")
}

fn products_document_shape() -> DocumentShape {
    products_shape(&relation())
        .expect("the products shape is valid")
        .shape
}

/// Rows 1..=count encoded by the encoder alone.
fn encoded_products(shape: &DocumentShape, count: usize) -> Vec<Vec<u8>> {
    (1..=count as i64)
        .map(|id| {
            let row = ProductRow::new(id);
            let mut document = Vec::new();
            encode_document(shape, &row.values(), &mut document).expect("products rows encode");
            document
        })
        .collect()
}

/// One closed batch of `documents`, as the batcher frames it.
fn ndjson_batch(documents: &[Vec<u8>]) -> Batch {
    let mut batcher = Batcher::new(limits());
    let now = Instant::now();
    let mut closed = documents
        .iter()
        .filter_map(|document| batcher.push(Operation::Replace, document, now));
    let batch = closed.next().expect("10,000 documents fill one batch");
    assert!(closed.next().is_none() && batcher.is_empty());
    batch
}

// ---------------------------------------------------------------------------------------------
// pgoutput messages (protocol version 1), byte for byte as proto.c writes them.

fn cstring(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(text.as_bytes());
    out.push(0);
}

fn relation_message() -> Vec<u8> {
    let mut out = vec![b'R'];
    out.extend_from_slice(&PRODUCTS_OID.to_be_bytes());
    cstring(&mut out, "public");
    cstring(&mut out, "products");
    out.push(b'd');
    out.extend_from_slice(&(PRODUCTS_COLUMNS.len() as u16).to_be_bytes());
    for (name, type_oid, type_modifier) in PRODUCTS_COLUMNS {
        out.push(u8::from(name == "id"));
        cstring(&mut out, name);
        out.extend_from_slice(&type_oid.to_be_bytes());
        out.extend_from_slice(&type_modifier.to_be_bytes());
    }
    out
}

fn relation() -> Relation {
    match parse(&relation_message()).expect("the Relation message parses") {
        Message::Relation(relation) => relation,
        other => panic!("expected a Relation message, got {other:?}"),
    }
}

fn insert_message(row: &ProductRow) -> Vec<u8> {
    let mut out = vec![b'I'];
    out.extend_from_slice(&PRODUCTS_OID.to_be_bytes());
    out.push(b'N');
    out.extend_from_slice(&(row.texts.len() as u16).to_be_bytes());
    for text in &row.texts {
        match text {
            None => out.push(b'n'),
            Some(text) => {
                out.push(b't');
                out.extend_from_slice(&(text.len() as i32).to_be_bytes());
                out.extend_from_slice(text.as_bytes());
            }
        }
    }
    out
}

fn begin_message(final_lsn: u64, xid: u32) -> Vec<u8> {
    let mut out = vec![b'B'];
    out.extend_from_slice(&final_lsn.to_be_bytes());
    out.extend_from_slice(&800_000_000_000_000_i64.to_be_bytes());
    out.extend_from_slice(&xid.to_be_bytes());
    out
}

fn commit_message(commit_lsn: u64, end_lsn: u64) -> Vec<u8> {
    let mut out = vec![b'C', 0];
    out.extend_from_slice(&commit_lsn.to_be_bytes());
    out.extend_from_slice(&end_lsn.to_be_bytes());
    out.extend_from_slice(&800_000_000_000_000_i64.to_be_bytes());
    out
}

/// Inserts of rows 1..=rows in transactions of [`ROWS_PER_TRANSACTION`] rows.
fn insert_stream(rows: usize) -> Vec<Vec<u8>> {
    let mut messages = Vec::new();
    let mut lsn = 0x0100_0000_u64;
    for (transaction, first) in (1..=rows).step_by(ROWS_PER_TRANSACTION).enumerate() {
        let last = (first + ROWS_PER_TRANSACTION - 1).min(rows);
        let commit_lsn = lsn + 200 * (last - first + 1) as u64;
        messages.push(begin_message(commit_lsn, 1000 + transaction as u32));
        for id in first..=last {
            messages.push(insert_message(&ProductRow::new(id as i64)));
        }
        messages.push(commit_message(commit_lsn, commit_lsn + 48));
        lsn = commit_lsn + 48;
    }
    messages
}

/// Stands for the dispatcher: takes every closed batch and drops it.
#[derive(Default)]
struct DiscardingSink {
    batches: usize,
    docs: usize,
    bytes: usize,
    skipped: usize,
    checkpoint: Option<u64>,
}

impl DiscardingSink {
    fn take(&mut self, batch: Batch) {
        self.batches += 1;
        self.docs += batch.docs;
        self.bytes += batch.body.len();
        self.checkpoint = batch.checkpoint.or(self.checkpoint);
    }
}

/// What the worker's decoding callback does with one message (`Streamer::message`, then
/// `report_skipped` and `send_ready` with a dispatcher that always has room).
fn feed(mapper: &mut ChangeMapper, data: &[u8], sink: &mut DiscardingSink) {
    let message = parse(data).expect("the bench's messages are well formed");
    mapper
        .apply(&message, &Instant::now, &mut products_shape)
        .expect("the products relation maps");
    sink.skipped += mapper.take_skipped().len();
    while let Some(batch) = mapper.next_ready() {
        sink.take(batch);
    }
    if let Some(checkpoint) = mapper.take_pending_checkpoint() {
        sink.checkpoint = Some(checkpoint);
    }
}

/// The worker's loop around the callback: aged batches are closed once per round of records.
fn feed_stream(mapper: &mut ChangeMapper, messages: &[Vec<u8>], sink: &mut DiscardingSink) {
    for round in messages.chunks(RECORDS_PER_ROUND) {
        for message in round {
            feed(mapper, message, sink);
        }
        mapper.flush_due(Instant::now());
    }
}

fn mapper_with_relation() -> ChangeMapper {
    let mut mapper = ChangeMapper::new(limits(), false);
    let mut sink = DiscardingSink::default();
    feed(&mut mapper, &relation_message(), &mut sink);
    mapper
}

// ---------------------------------------------------------------------------------------------
// Benchmarks.

fn value_encoder(c: &mut Criterion) {
    let long_text = "Sturdy enamelled cast-iron casserole with a self-basting lid, \
                     oven safe to 260 °C, suitable for induction, gas and ceramic hobs. "
        .repeat(7);
    let cases: Vec<(&str, ValueKind, String)> = vec![
        ("int4", ValueKind::Integer, "12345".into()),
        ("int8", ValueKind::Integer, "9000000000123".into()),
        ("float8", ValueKind::Float, "3.141592653589793".into()),
        ("numeric_10_2", ValueKind::Numeric, "473.64".into()),
        (
            "numeric_33_digits",
            ValueKind::Numeric,
            "123456789012345678901234567890.123".into(),
        ),
        ("bool", ValueKind::Bool, "t".into()),
        ("text_short", ValueKind::Text, "Product 12345".into()),
        (
            "text_escapes",
            ValueKind::Text,
            "Déscription \"12345\"\\ with ünïcødé ✓\tand tab".into(),
        ),
        ("text_long_1KB", ValueKind::Text, long_text),
        (
            "uuid",
            ValueKind::Text,
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11".into(),
        ),
        (
            "jsonb",
            ValueKind::Json,
            ProductRow::new(12345).texts[7].clone().expect("meta"),
        ),
        ("date", ValueKind::Date, "2024-01-09".into()),
        (
            "timestamp",
            ValueKind::Timestamp,
            "2024-01-09 13:45:00.123456".into(),
        ),
        (
            "timestamptz",
            ValueKind::TimestampTz,
            "2024-01-09 13:45:00+00".into(),
        ),
        (
            "timestamptz_offset",
            ValueKind::TimestampTz,
            "2024-01-09 19:15:00+05:30".into(),
        ),
        ("time", ValueKind::Time, "13:45:00.123456".into()),
        ("timetz", ValueKind::TimeTz, "13:45:00-08".into()),
        (
            "bytea_32B",
            ValueKind::Bytea,
            format!("\\x{}", "0123456789abcdef".repeat(4)),
        ),
        ("text_array", array(ValueKind::Text), "{t0,u3}".into()),
        (
            "text_array_quoted",
            array(ValueKind::Text),
            r#"{"a b","c \"d\"",NULL,plain}"#.into(),
        ),
        (
            "int4_array",
            array(ValueKind::Integer),
            "{1,2,3,4,5,6,7,8}".into(),
        ),
        ("interval", ValueKind::Other, "1 day 02:00:00".into()),
    ];
    let mut group = c.benchmark_group("value");
    let mut out = Vec::with_capacity(4096);
    for (name, kind, text) in &cases {
        group.throughput(Throughput::BytesDecimal(text.len() as u64));
        group.bench_function(*name, |b| {
            b.iter(|| {
                out.clear();
                write_value(&mut out, black_box(kind), black_box(text));
                out.len()
            })
        });
    }
    group.finish();
}

fn products_document(c: &mut Criterion) {
    let shape = products_document_shape();
    let row = ProductRow::new(12345);
    let values = row.values();
    let mut out = Vec::with_capacity(1024);
    encode_document(&shape, &values, &mut out).expect("products rows encode");
    println!(
        "# products document (id 12345): {} bytes: {}",
        out.len(),
        String::from_utf8_lossy(&out)
    );
    let mut group = c.benchmark_group("document");
    group.throughput(Throughput::Elements(1));
    group.bench_function("products", |b| {
        b.iter(|| {
            out.clear();
            encode_document(&shape, black_box(&values), &mut out)
        })
    });
    group.finish();
}

fn batcher(c: &mut Criterion) {
    let documents = encoded_products(&products_document_shape(), BATCH_DOCS);
    let body_bytes = ndjson_batch(&documents).body.len();
    println!(
        "# NDJSON batch: {BATCH_DOCS} products documents, {body_bytes} bytes ({:.0} bytes/document)",
        body_bytes as f64 / BATCH_DOCS as f64
    );
    let mut batcher = Batcher::new(limits());
    let mut group = c.benchmark_group("batcher");
    group.throughput(Throughput::Elements(BATCH_DOCS as u64));
    group.bench_function("ndjson_10k_docs", |b| {
        b.iter(|| {
            let now = Instant::now();
            let mut closed = None;
            for document in &documents {
                if let Some(batch) = batcher.push(Operation::Replace, black_box(document), now) {
                    closed = Some(batch);
                }
            }
            closed
        })
    });
    group.finish();
    assert!(
        batcher.is_empty(),
        "every iteration closes exactly one batch"
    );
}

fn gzip_levels(c: &mut Criterion) {
    let batch = ndjson_batch(&encoded_products(&products_document_shape(), BATCH_DOCS));
    let body = &batch.body[..];
    let mut group = c.benchmark_group("gzip");
    group.sample_size(10);
    group.throughput(Throughput::BytesDecimal(body.len() as u64));
    for level in [1, 6, 9] {
        let compressed = gzip(body, Compression::new(level));
        println!(
            "# gzip level {level}: {} -> {} bytes, ratio {:.2}:1 ({:.1}% of the NDJSON)",
            body.len(),
            compressed.len(),
            body.len() as f64 / compressed.len() as f64,
            100.0 * compressed.len() as f64 / body.len() as f64
        );
        group.bench_with_input(BenchmarkId::new("level", level), &level, |b, &level| {
            b.iter(|| gzip(black_box(body), Compression::new(level)))
        });
    }
    group.finish();
}

fn pgoutput_parse(c: &mut Criterion) {
    let messages: Vec<Vec<u8>> = (1..=BATCH_DOCS as i64)
        .map(|id| insert_message(&ProductRow::new(id)))
        .collect();
    let bytes: usize = messages.iter().map(Vec::len).sum();
    println!(
        "# pgoutput Insert messages: {BATCH_DOCS}, {bytes} bytes ({:.0} bytes/message)",
        bytes as f64 / BATCH_DOCS as f64
    );
    let mut group = c.benchmark_group("pgoutput");
    group.throughput(Throughput::Elements(BATCH_DOCS as u64));
    group.bench_function("parse_10k_inserts", |b| {
        b.iter(|| {
            let mut values = 0;
            for message in &messages {
                if let Ok(Message::Insert { new, .. }) = parse(black_box(message)) {
                    values += new.values.len();
                }
            }
            values
        })
    });
    group.finish();
}

fn pipeline(c: &mut Criterion) {
    let messages = insert_stream(BATCH_DOCS);

    // The pipeline must give exactly the batch the encoder and batcher give on their own.
    let mut mapper = mapper_with_relation();
    let mut first_batch = None;
    for message in &messages {
        let message = parse(message).expect("the bench's messages are well formed");
        mapper
            .apply(&message, &Instant::now, &mut products_shape)
            .expect("the products relation maps");
        if let Some(batch) = mapper.next_ready() {
            first_batch = Some(batch);
        }
    }
    let first_batch = first_batch.expect("the stream fills one batch");
    let expected = ndjson_batch(&encoded_products(&products_document_shape(), BATCH_DOCS));
    assert_eq!(first_batch.body, expected.body);
    assert_eq!(first_batch.docs, BATCH_DOCS);
    for line in first_batch.body.split(|&byte| byte == b'\n') {
        if !line.is_empty() {
            serde_json::from_slice::<serde_json::Value>(line).expect("NDJSON lines are JSON");
        }
    }
    assert!(mapper.take_skipped().is_empty());

    let mut mapper = mapper_with_relation();
    let mut sink = DiscardingSink::default();
    let mut streams_fed = 0;
    let mut group = c.benchmark_group("pipeline");
    group.throughput(Throughput::Elements(BATCH_DOCS as u64));
    group.bench_function("pgoutput_to_batches_10k_docs", |b| {
        b.iter(|| {
            streams_fed += 1;
            feed_stream(&mut mapper, black_box(&messages), &mut sink)
        })
    });
    group.finish();
    mapper.flush();
    while let Some(batch) = mapper.next_ready() {
        sink.take(batch);
    }
    assert_eq!(sink.skipped, 0);
    assert_eq!(
        sink.docs,
        streams_fed * BATCH_DOCS,
        "every document reached the sink"
    );
    assert!(sink.checkpoint.is_some());
    println!(
        "# pipeline: {} documents in {} batches ({} bytes) reached the discarding sink",
        sink.docs, sink.batches, sink.bytes
    );
}

criterion_group! {
    name = micro;
    // Short runs by default (the whole suite takes about three minutes on two cores); criterion's
    // command line overrides these.
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = value_encoder, products_document, batcher, gzip_levels, pgoutput_parse, pipeline
}
criterion_main!(micro);
