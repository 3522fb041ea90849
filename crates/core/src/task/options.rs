//! Task options: parsed from the `options jsonb` argument, validated, and stored normalized.

use serde_json::{Map, Value};

/// An option value that cannot be used: a message naming it and a hint saying what would do.
/// (The extension raises it as an invalid parameter value, SQLSTATE 22023.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidOption {
    pub message: String,
    pub hint: String,
}

impl std::fmt::Display for InvalidOption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Whether streamed rows replace whole documents or update them field by field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    Replace,
    Upsert,
}

impl WriteMode {
    pub fn as_str(self) -> &'static str {
        match self {
            WriteMode::Replace => "replace",
            WriteMode::Upsert => "upsert",
        }
    }
}

/// What a task does once a DDL changed what its documents look like without changing rows (a
/// column dropped, renamed or retyped, an enum value renamed, the view replaced): `Resync`
/// rebuilds the index in the new shape on its own; `Report` only shows the task out of shape, for
/// an operator to resync when it suits (a very large source, say).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaChanges {
    Resync,
    Report,
}

impl SchemaChanges {
    pub fn as_str(self) -> &'static str {
        match self {
            SchemaChanges::Resync => "resync",
            SchemaChanges::Report => "report",
        }
    }
}

/// Whether a task's changes come from the database's one shared decoding pass, or from a slot
/// of its own (isolation, at the cost of decoding every change of the database once more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoding {
    Own,
    Shared,
}

impl Decoding {
    pub fn as_str(self) -> &'static str {
        match self {
            Decoding::Own => "own",
            Decoding::Shared => "shared",
        }
    }
}

/// One Meilisearch server of a task's `replicas`: each holds every document of the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replica {
    pub url: String,
    pub api_key: Option<String>,
}

/// One Meilisearch server of a task's `shards`: each holds the documents whose id hashes to it
/// (see [`crate::document::shard`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The server's remote name in Meilisearch's network, and the name its documents hash to.
    pub name: String,
    pub url: String,
    pub api_key: Option<String>,
}

/// At most this many replicas (or shards) per task: each one is a pipeline (and, with its own decoding, a
/// replication slot) of its own.
pub const MAX_REPLICAS: usize = 16;

#[derive(Debug, Clone, PartialEq)]
pub struct TaskOptions {
    pub url: Option<String>,
    pub api_key: Option<String>,
    /// The servers given with `replicas`, in place of `url` and `api_key` (empty when not given).
    /// Like the URL and the keys, they are not stored in the options: each replica has a task row.
    pub replicas: Vec<Replica>,
    /// The servers given with `shards`, in place of `url`, `api_key` and `replicas` (empty when
    /// not given); not stored in the options either: each shard has a catalog row.
    pub shards: Vec<Shard>,
    /// A key that may only search, for `meili_search` (never sent by the workers).
    pub search_api_key: Option<String>,
    pub primary_key: Option<Vec<String>>,
    pub columns: Option<Vec<String>>,
    pub exclude_columns: Vec<String>,
    pub batch_size: usize,
    pub batch_bytes: usize,
    /// No request body may be larger: Meilisearch refuses bodies over its
    /// `--http-payload-size-limit` (100,000,000 bytes unless changed).
    pub max_payload_bytes: usize,
    pub max_inflight: usize,
    /// Batches of the copy enqueued in Meilisearch and unconfirmed at once. Only `max_inflight` of
    /// them are held in memory: a batch's body is let go once enqueued (a failed one is read again
    /// from the table by its key range).
    pub snapshot_depth: usize,
    /// Batches of the stream enqueued in Meilisearch and unconfirmed at once; at most
    /// `max_inflight` of them are held in memory: a batch's body is let go once enqueued (should
    /// it fail, the stream decodes everything unconfirmed again from the slot).
    pub stream_depth: usize,
    pub flush_interval_ms: u64,
    pub gzip: bool,
    pub write_mode: WriteMode,
    pub decoding: Decoding,
    pub settings: Option<Map<String, Value>>,
    /// For a view: table name (as written) → the SQL query that maps the keys of its changed
    /// rows (text arrays `$1`, `$2`, …) to the keys of the documents they affect.
    pub mappings: Vec<(String, String)>,
    /// The PostGIS column whose points become `_geo` and other geometries `_geojson`.
    pub geo: Option<String>,
    /// Embedder name → the pgvector column that holds its user-provided embeddings.
    pub vectors: Vec<(String, String)>,
    /// For a view: its owner declares that its rows are the same for every reader, in place of
    /// the check that follows every function it calls (see docs/security.md).
    pub reader_independent: bool,
    pub schema_changes: SchemaChanges,
}

impl Default for TaskOptions {
    fn default() -> Self {
        TaskOptions {
            url: None,
            api_key: None,
            replicas: Vec::new(),
            shards: Vec::new(),
            search_api_key: None,
            primary_key: None,
            columns: None,
            exclude_columns: Vec::new(),
            batch_size: 10_000,
            batch_bytes: 16 * 1024 * 1024,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            max_inflight: 8,
            snapshot_depth: DEFAULT_SNAPSHOT_DEPTH,
            stream_depth: DEFAULT_STREAM_DEPTH,
            flush_interval_ms: 200,
            gzip: false,
            reader_independent: false,
            write_mode: WriteMode::Replace,
            decoding: Decoding::Shared,
            settings: None,
            mappings: Vec::new(),
            geo: None,
            vectors: Vec::new(),
            schema_changes: SchemaChanges::Resync,
        }
    }
}

/// Batches of a copy enqueued at once unless set (see [`TaskOptions::snapshot_depth`]).
pub const DEFAULT_SNAPSHOT_DEPTH: usize = 32;

/// Batches of a stream enqueued at once unless set (see [`TaskOptions::stream_depth`]).
pub const DEFAULT_STREAM_DEPTH: usize = 32;

/// Meilisearch's default payload limit ("100 MB", decimal) less 5% for what we do not count.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 95_000_000;

/// What [`OPTIONS`] says `meili_sync_alter` may do with an option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alter {
    /// Changed in place; the worker restarts with it.
    InPlace,
    /// Changed in place, but only by the task's owner (or a superuser): where the documents go
    /// and the keys that reach them.
    ByOwner,
    /// Changed in one direction only (`decoding`: `own` to `shared`).
    OneWay,
    /// Fixed when the task is created: changing it needs a new task.
    NewTask,
}

/// Every task option, with what `meili_sync_alter` may do with it: the one list that the parser,
/// `meili_sync_alter` and the docs (checked by `scripts/check-docs.py`) follow.
pub const OPTIONS: &[(&str, Alter)] = &[
    ("url", Alter::ByOwner),
    ("api_key", Alter::ByOwner),
    ("replicas", Alter::ByOwner),
    ("shards", Alter::ByOwner),
    ("search_api_key", Alter::ByOwner),
    ("primary_key", Alter::NewTask),
    ("columns", Alter::NewTask),
    ("exclude_columns", Alter::NewTask),
    ("batch_size", Alter::InPlace),
    ("batch_bytes", Alter::InPlace),
    ("max_payload_bytes", Alter::InPlace),
    ("max_inflight", Alter::InPlace),
    ("snapshot_depth", Alter::InPlace),
    ("stream_depth", Alter::InPlace),
    ("flush_interval_ms", Alter::InPlace),
    ("gzip", Alter::InPlace),
    ("write_mode", Alter::InPlace),
    ("decoding", Alter::OneWay),
    ("settings", Alter::InPlace),
    ("mappings", Alter::NewTask),
    ("geo", Alter::NewTask),
    ("vectors", Alter::NewTask),
    ("reader_independent", Alter::NewTask),
    ("schema_changes", Alter::InPlace),
];

/// The names of the options `meili_sync_alter` may do `alter` with.
pub fn options_altered_as(alter: Alter) -> impl Iterator<Item = &'static str> {
    OPTIONS
        .iter()
        .filter(move |(_, how)| *how == alter)
        .map(|(name, _)| *name)
}

/// The first option among `changes` that `meili_sync_alter` may do `alter` with, if any.
pub fn option_altered_as(changes: &Map<String, Value>, alter: Alter) -> Option<&'static str> {
    options_altered_as(alter).find(|name| changes.contains_key(*name))
}

fn invalid(message: String, hint: &str) -> InvalidOption {
    InvalidOption {
        message,
        hint: hint.to_owned(),
    }
}

const MAPPINGS_HINT: &str = "For example {\"mappings\": {\"brands\": \"SELECT p.id FROM public.products p WHERE p.brand_id = ANY($1::int[])\"}}: each table's query gets the changed rows' key columns as text arrays $1, $2, ... and returns the keys of the documents they affect.";

fn expect_mappings(value: &Value) -> Result<Vec<(String, String)>, InvalidOption> {
    let Value::Object(object) = value else {
        return Err(invalid(
            format!("option \"mappings\" must be a JSON object of table names and SQL queries, not {value}"),
            MAPPINGS_HINT,
        ));
    };
    let mut mappings = Vec::new();
    for (table, query) in object {
        match query.as_str() {
            Some(query) if !query.trim().is_empty() && !table.trim().is_empty() => {
                mappings.push((table.clone(), query.to_owned()))
            }
            _ => {
                return Err(invalid(
                    format!(
                        "the mapping of table \"{}\" must be a non-empty SQL query, not {query}",
                        table.escape_default()
                    ),
                    MAPPINGS_HINT,
                ))
            }
        }
    }
    Ok(mappings)
}

const VECTORS_HINT: &str = "For example {\"vectors\": {\"default\": \"embedding\"}}: each embedder's user-provided embeddings come from a pgvector column.";

fn expect_vectors(value: &Value) -> Result<Vec<(String, String)>, InvalidOption> {
    let object = match value {
        Value::Object(object) if !object.is_empty() => object,
        _ => {
            return Err(invalid(
                format!("option \"vectors\" must be a JSON object of embedder names and columns, not {value}"),
                VECTORS_HINT,
            ))
        }
    };
    let mut vectors: Vec<(String, String)> = Vec::new();
    for (embedder, column) in object {
        let column = match column.as_str() {
            Some(column) if !column.is_empty() && !embedder.is_empty() => column,
            _ => {
                return Err(invalid(
                    format!(
                        "the column of embedder \"{}\" in option \"vectors\" must be a column name, not {column}",
                        embedder.escape_default()
                    ),
                    VECTORS_HINT,
                ))
            }
        };
        if let Some((other, _)) = vectors.iter().find(|(_, named)| named == column) {
            return Err(invalid(
                format!("option \"vectors\" names column \"{column}\" for embedders \"{other}\" and \"{embedder}\""),
                "Give each embedder a column of its own.",
            ));
        }
        vectors.push((embedder.clone(), column.to_owned()));
    }
    Ok(vectors)
}

const REPLICAS_HINT: &str = "For example {\"replicas\": [{\"url\": \"http://a:7700\", \"api_key\": \"...\"}, {\"url\": \"http://b:7700\", \"api_key\": \"...\"}]}: every change is written to each server.";

const SHARDS_HINT: &str = "For example {\"shards\": [{\"name\": \"ms-0\", \"url\": \"http://a:7700\", \"api_key\": \"...\"}, {\"name\": \"ms-1\", \"url\": \"http://b:7700\", \"api_key\": \"...\"}]}: each document is written to the one shard its id hashes to.";

/// What kind of JSON value this is, for a message that must not quote it: a misplaced bracket can
/// put an API key where a list was expected.
fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(items) if items.is_empty() => "an empty array",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// How one list of servers (`replicas` or `shards`) is spelled in messages and hints.
struct ServerList {
    option: &'static str,
    /// One entry, in messages: "replica", "shard".
    entry: &'static str,
    /// Whether entries have a `name` (a shard's remote name in Meilisearch's network).
    named: bool,
    hint: &'static str,
}

const REPLICA_LIST: ServerList = ServerList::new("replicas", "replica", false, REPLICAS_HINT);
const SHARD_LIST: ServerList = ServerList::new("shards", "shard", true, SHARDS_HINT);

impl ServerList {
    const fn new(
        option: &'static str,
        entry: &'static str,
        named: bool,
        hint: &'static str,
    ) -> Self {
        ServerList {
            option,
            entry,
            named,
            hint,
        }
    }
}

/// One entry of a server list; `name` only in `shards`.
struct Server {
    name: Option<String>,
    url: String,
    api_key: Option<String>,
}

/// `replicas` or `shards`: a non-empty array of `{"url", "api_key"}` objects (with a `"name"` in
/// shards) with distinct URLs and names. Its messages never quote an unchecked value: it may hold
/// keys.
fn expect_servers<T>(
    list: &ServerList,
    value: &Value,
    make: fn(Server) -> T,
) -> Result<Vec<T>, InvalidOption> {
    let option = list.option;
    let items = match value {
        Value::Array(items) if !items.is_empty() => items,
        _ => {
            return Err(invalid(
                format!(
                    "option \"{option}\" must be a non-empty array of servers, not {}",
                    json_kind(value)
                ),
                list.hint,
            ))
        }
    };
    if items.len() > MAX_REPLICAS {
        return Err(invalid(
            format!(
                "option \"{option}\" names {} servers, more than {MAX_REPLICAS}",
                items.len()
            ),
            &format!(
                "Each {} is written to by a pipeline of its own; use at most {MAX_REPLICAS}.",
                list.entry
            ),
        ));
    }
    let fields_text = if list.named {
        "\"name\", \"url\" and \"api_key\""
    } else {
        "\"url\" and \"api_key\""
    };
    let mut servers: Vec<Server> = Vec::with_capacity(items.len());
    for item in items {
        let Value::Object(fields) = item else {
            return Err(invalid(
                format!(
                    "each of \"{option}\" must be an object with {fields_text}, not {}",
                    json_kind(item)
                ),
                list.hint,
            ));
        };
        let server = expect_server(list, fields, fields_text)?;
        if servers.iter().any(|other| other.url == server.url) {
            return Err(invalid(
                format!("option \"{option}\" names {} twice", server.url),
                &format!(
                    "Each {} is another Meilisearch server: name each once.",
                    list.entry
                ),
            ));
        }
        if let Some(name) = &server.name {
            if servers
                .iter()
                .any(|other| other.name.as_ref() == Some(name))
            {
                return Err(invalid(
                    format!("option \"{option}\" names shard \"{name}\" twice"),
                    "Each shard is one server of the network: give each a name of its own.",
                ));
            }
        }
        servers.push(server);
    }
    Ok(servers.into_iter().map(make).collect())
}

/// One entry of a server list, its fields checked.
fn expect_server(
    list: &ServerList,
    fields: &Map<String, Value>,
    fields_text: &str,
) -> Result<Server, InvalidOption> {
    let (option, entry) = (list.option, list.entry);
    let mut name = None;
    let mut url = None;
    let mut api_key = None;
    for (field, value) in fields {
        match field.as_str() {
            "name" if list.named => {
                let given = expect_string("shards.name", value)?;
                if !valid_shard_name(&given) {
                    // Not quoted: a misplaced key could be here.
                    return Err(invalid(
                        format!("a shard of \"shards\" has an invalid \"name\" ({} characters)", given.chars().count()),
                        "A shard name is 1 to 64 characters among A-Z, a-z, 0-9, '-' and '_': it is the server's remote name in Meilisearch's network.",
                    ));
                }
                name = Some(given);
            }
            "url" => {
                let given = expect_string(&format!("{option}.url"), value)?;
                validate_url(&given)?;
                url = Some(given.trim_end_matches('/').to_owned());
            }
            "api_key" => api_key = Some(expect_string(&format!("{option}.api_key"), value)?),
            unknown => {
                return Err(invalid(
                    format!(
                        "unknown field \"{}\" in a {entry} of \"{option}\"",
                        unknown.escape_default()
                    ),
                    &format!("A {entry} has {fields_text}."),
                ))
            }
        }
    }
    let missing = |field: &str| {
        invalid(
            format!("a {entry} of \"{option}\" has no \"{field}\""),
            list.hint,
        )
    };
    if list.named && name.is_none() {
        return Err(missing("name"));
    }
    Ok(Server {
        name,
        url: url.ok_or_else(|| missing("url"))?,
        api_key,
    })
}

/// A remote name of Meilisearch's network, as we allow it: 1 to 64 of `[A-Za-z0-9_-]`.
fn valid_shard_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn expect_string(name: &str, value: &Value) -> Result<String, InvalidOption> {
    match value {
        Value::String(text) if !text.is_empty() => Ok(text.clone()),
        _ => Err(invalid(
            format!("option \"{name}\" must be a non-empty string"),
            "Pass it as a JSON string.",
        )),
    }
}

fn expect_names(name: &str, value: &Value) -> Result<Vec<String>, InvalidOption> {
    let items = match value {
        Value::String(_) => vec![expect_string(name, value)?],
        Value::Array(items) if !items.is_empty() => items
            .iter()
            .map(|item| expect_string(name, item))
            .collect::<Result<_, _>>()?,
        _ => {
            return Err(invalid(
                format!(
                    "option \"{name}\" must be a column name or a non-empty array of column names"
                ),
                "For example [\"id\", \"name\"].",
            ))
        }
    };
    let mut seen = std::collections::HashSet::new();
    for item in &items {
        if !seen.insert(item) {
            return Err(invalid(
                format!("option \"{name}\" names column \"{item}\" twice"),
                "List each column once.",
            ));
        }
    }
    Ok(items)
}

fn expect_integer(name: &str, value: &Value, min: u64, max: u64) -> Result<u64, InvalidOption> {
    match value.as_u64() {
        Some(number) if (min..=max).contains(&number) => Ok(number),
        _ => Err(invalid(
            format!("option \"{name}\" must be an integer between {min} and {max}, not {value}"),
            "Pass a JSON number without quotes.",
        )),
    }
}

/// Checks that a URL can reach a Meilisearch server: http or https, a host, no credentials.
pub fn validate_url(url: &str) -> Result<(), InvalidOption> {
    let hint = "Use a URL such as http://127.0.0.1:7700.";
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or_else(|| {
            invalid(
                format!("invalid Meilisearch URL \"{url}\": the scheme must be http or https"),
                hint,
            )
        })?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return Err(invalid(
            "invalid Meilisearch URL: credentials in the URL are not allowed".to_owned(),
            "Pass the key with the api_key option.",
        ));
    }
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(']') || authority.starts_with('[') => {
            if port.is_empty() || port.parse::<u16>().is_err() {
                return Err(invalid(
                    format!("invalid Meilisearch URL \"{url}\": bad port \"{port}\""),
                    hint,
                ));
            }
            host
        }
        _ => authority,
    };
    let host_ok = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '[' | ']' | ':'));
    if !host_ok || url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid(
            format!("invalid Meilisearch URL \"{url}\": bad host"),
            hint,
        ));
    }
    Ok(())
}

/// Meilisearch index uids: 1 to 400 characters of `[A-Za-z0-9_-]`.
/// The text with control characters escaped, so a message cannot break a log line.
fn printable(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            if c.is_control() {
                c.escape_default().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect()
}

pub fn validate_index_uid(uid: &str) -> Result<(), InvalidOption> {
    let valid = !uid.is_empty()
        && uid.len() <= 400
        && uid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if valid {
        Ok(())
    } else {
        Err(invalid(
            format!("invalid Meilisearch index uid \"{}\"", printable(uid)),
            "An index uid is 1 to 400 characters among A-Z, a-z, 0-9, '-' and '_'.",
        ))
    }
}

impl TaskOptions {
    /// Parses the options object given to `meili_sync_start`; unknown keys and wrong types are errors.
    pub fn parse(options: &Value) -> Result<TaskOptions, InvalidOption> {
        let object = match options {
            Value::Object(object) => object,
            _ => {
                return Err(invalid(
                    "options must be a JSON object".to_owned(),
                    "For example '{\"batch_size\": 5000}'.",
                ))
            }
        };
        let mut parsed = TaskOptions::default();
        for (name, value) in object {
            match name.as_str() {
                "url" => {
                    let url = expect_string(name, value)?;
                    validate_url(&url)?;
                    parsed.url = Some(url.trim_end_matches('/').to_owned());
                }
                "api_key" => parsed.api_key = Some(expect_string(name, value)?),
                "replicas" => {
                    parsed.replicas = expect_servers(&REPLICA_LIST, value, |server| Replica {
                        url: server.url,
                        api_key: server.api_key,
                    })?
                }
                "shards" => {
                    parsed.shards = expect_servers(&SHARD_LIST, value, |server| Shard {
                        name: server.name.unwrap_or_default(),
                        url: server.url,
                        api_key: server.api_key,
                    })?
                }
                "search_api_key" => parsed.search_api_key = Some(expect_string(name, value)?),
                "primary_key" => parsed.primary_key = Some(expect_names(name, value)?),
                "columns" => parsed.columns = Some(expect_names(name, value)?),
                "exclude_columns" => parsed.exclude_columns = expect_names(name, value)?,
                "batch_size" => {
                    parsed.batch_size = expect_integer(name, value, 1, 1_000_000)? as usize
                }
                "batch_bytes" => {
                    parsed.batch_bytes =
                        expect_integer(name, value, 1024, 1024 * 1024 * 1024)? as usize
                }
                "max_payload_bytes" => {
                    parsed.max_payload_bytes =
                        expect_integer(name, value, 1024, 1024 * 1024 * 1024)? as usize
                }
                "max_inflight" => {
                    parsed.max_inflight = expect_integer(name, value, 1, 256)? as usize
                }
                "snapshot_depth" => {
                    parsed.snapshot_depth = expect_integer(name, value, 1, 1024)? as usize
                }
                "stream_depth" => {
                    parsed.stream_depth = expect_integer(name, value, 1, 1024)? as usize
                }
                "flush_interval_ms" => {
                    parsed.flush_interval_ms = expect_integer(name, value, 0, 600_000)?
                }
                "gzip" => {
                    parsed.gzip = value.as_bool().ok_or_else(|| {
                        invalid(
                            format!("option \"gzip\" must be true or false, not {value}"),
                            "Pass a JSON boolean.",
                        )
                    })?
                }
                "write_mode" => {
                    parsed.write_mode = match value.as_str() {
                        Some("replace") => WriteMode::Replace,
                        Some("upsert") => WriteMode::Upsert,
                        _ => return Err(invalid(
                            format!(
                            "option \"write_mode\" must be \"replace\" or \"upsert\", not {value}"
                        ),
                            "replace sends whole documents; upsert updates the fields it sends.",
                        )),
                    }
                }
                "decoding" => {
                    parsed.decoding = match value.as_str() {
                        Some("own") => Decoding::Own,
                        Some("shared") => Decoding::Shared,
                        _ => {
                            return Err(invalid(
                                format!(
                                    "option \"decoding\" must be \"own\" or \"shared\", not {value}"
                                ),
                                "shared reads the database's changes once for all tasks that share; own gives the task a replication slot of its own.",
                            ))
                        }
                    }
                }
                "settings" => match value {
                    Value::Object(settings) => parsed.settings = Some(settings.clone()),
                    _ => return Err(invalid(
                        "option \"settings\" must be a JSON object of Meilisearch index settings"
                            .to_owned(),
                        "For example {\"filterableAttributes\": [\"category\"]}.",
                    )),
                },
                "mappings" => parsed.mappings = expect_mappings(value)?,
                "vectors" => parsed.vectors = expect_vectors(value)?,
                "reader_independent" => {
                    parsed.reader_independent = value.as_bool().ok_or_else(|| {
                        invalid(
                            format!("option \"reader_independent\" must be true or false, not {value}"),
                            "Pass a JSON boolean: true declares, as the view's owner, that the view's rows are the same for every role that reads it.",
                        )
                    })?
                }
                "schema_changes" => {
                    parsed.schema_changes = match value.as_str() {
                        Some("resync") => SchemaChanges::Resync,
                        Some("report") => SchemaChanges::Report,
                        _ => return Err(invalid(
                            format!("option \"schema_changes\" must be \"resync\" or \"report\", not {value}"),
                            "resync rebuilds the index in the new shape on its own after a DDL that changes the documents; report only shows the task out of shape, for you to run meili_sync_resync.",
                        )),
                    }
                }
                "geo" => {
                    parsed.geo = Some(value.as_str().filter(|name| !name.is_empty()).map(str::to_owned).ok_or_else(|| {
                        invalid(
                            format!("option \"geo\" must be the name of a PostGIS column, not {value}"),
                            "For example {\"geo\": \"location\"}: its points become _geo, other geometries _geojson.",
                        )
                    })?)
                }
                unknown => {
                    return Err(invalid(
                        format!("unknown option \"{}\"", unknown.escape_default()),
                        &format!(
                            "Valid options are: {}.",
                            OPTIONS.iter().map(|(name, _)| *name).collect::<Vec<_>>().join(", ")
                        ),
                    ))
                }
            }
        }
        if parsed.batch_bytes > parsed.max_payload_bytes {
            if object.contains_key("batch_bytes") {
                return Err(invalid(
                    format!(
                        "option \"batch_bytes\" ({}) is larger than \"max_payload_bytes\" ({})",
                        parsed.batch_bytes, parsed.max_payload_bytes
                    ),
                    "A batch is one request body, and Meilisearch refuses bodies over its payload limit: lower batch_bytes, or raise max_payload_bytes to match the server's --http-payload-size-limit.",
                ));
            }
            parsed.batch_bytes = parsed.max_payload_bytes;
        }
        if !parsed.replicas.is_empty() && (parsed.url.is_some() || parsed.api_key.is_some()) {
            return Err(invalid(
                "option \"replicas\" replaces \"url\" and \"api_key\"; they cannot be given together".to_owned(),
                "Give each server's url and api_key inside \"replicas\", for example {\"replicas\": [{\"url\": \"http://a:7700\", \"api_key\": \"...\"}, {\"url\": \"http://b:7700\"}]}.",
            ));
        }
        let beside_shards = ["url", "api_key", "replicas"]
            .into_iter()
            .find(|other| object.contains_key(*other));
        if let (false, Some(other)) = (parsed.shards.is_empty(), beside_shards) {
            return Err(invalid(
                format!("option \"shards\" replaces \"url\", \"api_key\" and \"replicas\"; \"{other}\" cannot be given with it"),
                "Give each shard's name, url and api_key inside \"shards\".",
            ));
        }
        if parsed.columns.is_some() && !parsed.exclude_columns.is_empty() {
            return Err(invalid(
                "options \"columns\" and \"exclude_columns\" cannot be used together".to_owned(),
                "Give the columns to send, or the columns to leave out.",
            ));
        }
        Ok(parsed)
    }

    /// The options as stored in the catalog: everything but the URL and the keys, which have columns of their own.
    pub fn to_stored_json(&self) -> Value {
        let mut stored = Map::new();
        if let Some(primary_key) = &self.primary_key {
            stored.insert("primary_key".into(), Value::from(primary_key.clone()));
        }
        if let Some(columns) = &self.columns {
            stored.insert("columns".into(), Value::from(columns.clone()));
        }
        if !self.exclude_columns.is_empty() {
            stored.insert(
                "exclude_columns".into(),
                Value::from(self.exclude_columns.clone()),
            );
        }
        stored.insert("batch_size".into(), Value::from(self.batch_size));
        stored.insert("batch_bytes".into(), Value::from(self.batch_bytes));
        stored.insert(
            "max_payload_bytes".into(),
            Value::from(self.max_payload_bytes),
        );
        stored.insert("max_inflight".into(), Value::from(self.max_inflight));
        stored.insert("snapshot_depth".into(), Value::from(self.snapshot_depth));
        stored.insert("stream_depth".into(), Value::from(self.stream_depth));
        stored.insert(
            "flush_interval_ms".into(),
            Value::from(self.flush_interval_ms),
        );
        stored.insert("gzip".into(), Value::from(self.gzip));
        stored.insert("write_mode".into(), Value::from(self.write_mode.as_str()));
        if self.decoding == Decoding::Own {
            // Stored only when not the default: a task without it (also one created before shared
            // decoding was the default) is in the shared pass, and moves there by itself.
            stored.insert("decoding".into(), Value::from(self.decoding.as_str()));
        }
        if let Some(settings) = &self.settings {
            stored.insert("settings".into(), Value::Object(settings.clone()));
        }
        if !self.mappings.is_empty() {
            let mappings: Map<String, Value> = self
                .mappings
                .iter()
                .map(|(table, query)| (table.clone(), Value::from(query.as_str())))
                .collect();
            stored.insert("mappings".into(), Value::Object(mappings));
        }
        if let Some(geo) = &self.geo {
            stored.insert("geo".into(), Value::from(geo.as_str()));
        }
        if !self.vectors.is_empty() {
            let vectors: Map<String, Value> = self
                .vectors
                .iter()
                .map(|(embedder, column)| (embedder.clone(), Value::from(column.as_str())))
                .collect();
            stored.insert("vectors".into(), Value::Object(vectors));
        }
        if self.reader_independent {
            stored.insert("reader_independent".into(), Value::from(true));
        }
        if self.schema_changes != SchemaChanges::Resync {
            stored.insert(
                "schema_changes".into(),
                Value::from(self.schema_changes.as_str()),
            );
        }
        Value::Object(stored)
    }
}

/// The stored options with `changes` applied, as an alter stores them (to be parsed again): a
/// `max_payload_bytes` lowered below the stored `batch_bytes` takes it down too, unless both
/// change (then parsing checks them against each other).
pub fn merged_options(stored: &Value, changes: &Map<String, Value>) -> Value {
    let mut merged = stored.as_object().cloned().unwrap_or_default();
    for (name, value) in changes {
        merged.insert(name.clone(), value.clone());
    }
    if !changes.contains_key("batch_bytes") {
        let limit = changes.get("max_payload_bytes").and_then(Value::as_u64);
        let stored_bytes = merged.get("batch_bytes").and_then(Value::as_u64);
        if let (Some(limit), Some(stored_bytes)) = (limit, stored_bytes) {
            if stored_bytes > limit {
                merged.insert("batch_bytes".into(), limit.into());
            }
        }
    }
    Value::Object(merged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn replicas_replace_url_and_key_and_are_not_stored() {
        let parsed = TaskOptions::parse(&json!({"replicas": [
            {"url": "http://a:7700/", "api_key": "ka"},
            {"url": "http://b:7700"}
        ]}))
        .expect("parse");
        assert_eq!(
            parsed.replicas,
            vec![
                Replica {
                    url: "http://a:7700".into(),
                    api_key: Some("ka".into())
                },
                Replica {
                    url: "http://b:7700".into(),
                    api_key: None
                }
            ]
        );
        assert!(parsed.to_stored_json().get("replicas").is_none());
    }

    #[test]
    fn bad_replicas_are_refused() {
        let misplaced =
            TaskOptions::parse(&json!({"replicas": {"url": "http://a", "api_key": "s3cret-key"}}))
                .expect_err("an object is no list");
        assert!(
            !misplaced.message.contains("s3cret") && misplaced.message.contains("not an object"),
            "{}",
            misplaced.message
        );
        let quoted = TaskOptions::parse(&json!({"replicas": ["s3cret-key"]})).expect_err("refused");
        assert!(!quoted.message.contains("s3cret"), "{}", quoted.message);
        for (options, expected) in [
            (json!({"replicas": []}), "non-empty array"),
            (json!({"replicas": "http://a"}), "non-empty array"),
            (json!({"replicas": ["http://a"]}), "must be an object"),
            (json!({"replicas": [{"api_key": "k"}]}), "has no \"url\""),
            (json!({"replicas": [{"url": "ftp://a"}]}), "scheme"),
            (
                json!({"replicas": [{"url": "http://a", "key": "k"}]}),
                "unknown field \"key\"",
            ),
            (
                json!({"replicas": [{"url": "http://a"}, {"url": "http://a/"}]}),
                "names http://a twice",
            ),
            (
                json!({"url": "http://a", "replicas": [{"url": "http://b"}]}),
                "replaces \"url\"",
            ),
            (
                json!({"api_key": "k", "replicas": [{"url": "http://b"}]}),
                "replaces \"url\"",
            ),
        ] {
            let error = TaskOptions::parse(&options).expect_err("refused");
            assert!(
                error.message.contains(expected),
                "{options}: {}",
                error.message
            );
        }
        let many: Vec<Value> = (0..=MAX_REPLICAS)
            .map(|n| json!({"url": format!("http://r{n}:7700")}))
            .collect();
        let error = TaskOptions::parse(&json!({ "replicas": many })).expect_err("too many");
        assert!(error.message.contains("more than 16"), "{}", error.message);
    }

    #[test]
    fn shards_name_their_servers_and_are_not_stored() {
        let parsed = TaskOptions::parse(&json!({"shards": [
            {"name": "ms-0", "url": "http://a:7700/", "api_key": "ka"},
            {"name": "ms_1", "url": "http://b:7700"}
        ]}))
        .expect("parse");
        assert_eq!(
            parsed.shards,
            vec![
                Shard {
                    name: "ms-0".into(),
                    url: "http://a:7700".into(),
                    api_key: Some("ka".into())
                },
                Shard {
                    name: "ms_1".into(),
                    url: "http://b:7700".into(),
                    api_key: None
                }
            ]
        );
        assert!(parsed.replicas.is_empty() && parsed.url.is_none());
        assert!(parsed.to_stored_json().get("shards").is_none());
        let one = TaskOptions::parse(&json!({"shards": [{"name": "solo", "url": "http://a"}]}))
            .expect("one shard alone");
        assert_eq!(one.shards.len(), 1);
        assert!(TaskOptions::default().shards.is_empty());
        let longest = "n".repeat(64);
        assert!(
            TaskOptions::parse(&json!({"shards": [{"name": longest, "url": "http://a"}]})).is_ok()
        );
    }

    #[test]
    fn bad_shards_are_refused() {
        for misplaced in [
            json!({"shards": {"name": "a", "url": "http://a", "api_key": "s3cret-key"}}),
            json!({"shards": ["s3cret-key"]}),
            json!({"shards": [{"name": "s3cret key!", "url": "http://a"}]}),
            json!({"shards": [{"name": "a", "url": "http://a", "s3cret-key": 1}]}),
        ] {
            let error = TaskOptions::parse(&misplaced).expect_err("refused");
            // An unknown field's name is quoted (escaped), as for replicas; values never are.
            let leaks =
                error.message.contains("s3cret") && !error.message.contains("unknown field");
            assert!(!leaks, "{}", error.message);
        }
        let too_long = "n".repeat(65);
        for (options, expected) in [
            (json!({"shards": []}), "\"shards\" must be a non-empty array of servers, not an empty array"),
            (json!({"shards": "http://a"}), "non-empty array of servers, not a string"),
            (json!({"shards": {"name": "a"}}), "not an object"),
            (json!({"shards": [42]}), "each of \"shards\" must be an object with \"name\", \"url\" and \"api_key\", not a number"),
            (json!({"shards": [{"url": "http://a"}]}), "a shard of \"shards\" has no \"name\""),
            (json!({"shards": [{"name": "a"}]}), "a shard of \"shards\" has no \"url\""),
            (json!({"shards": [{"name": "a", "api_key": "k"}]}), "has no \"url\""),
            (json!({"shards": [{"name": "", "url": "http://a"}]}), "\"shards.name\" must be a non-empty string"),
            (json!({"shards": [{"name": 7, "url": "http://a"}]}), "\"shards.name\" must be a non-empty string"),
            (json!({"shards": [{"name": "a.b", "url": "http://a"}]}), "invalid \"name\" (3 characters)"),
            (json!({"shards": [{"name": too_long, "url": "http://a"}]}), "invalid \"name\" (65 characters)"),
            (json!({"shards": [{"name": "a", "url": "ftp://a"}]}), "scheme"),
            (json!({"shards": [{"name": "a", "url": 1}]}), "\"shards.url\" must be a non-empty string"),
            (json!({"shards": [{"name": "a", "url": "http://a", "api_key": ""}]}), "\"shards.api_key\" must be a non-empty string"),
            (json!({"shards": [{"name": "a", "url": "http://a", "key": "k"}]}), "unknown field \"key\" in a shard of \"shards\""),
            (json!({"shards": [{"name": "a", "url": "http://a"}, {"name": "b", "url": "http://a/"}]}), "option \"shards\" names http://a twice"),
            (json!({"shards": [{"name": "a", "url": "http://a"}, {"name": "a", "url": "http://b"}]}), "names shard \"a\" twice"),
            (json!({"url": "http://a", "shards": [{"name": "a", "url": "http://b"}]}), "\"url\" cannot be given with it"),
            (json!({"api_key": "k", "shards": [{"name": "a", "url": "http://b"}]}), "\"api_key\" cannot be given with it"),
            (json!({"replicas": [{"url": "http://c"}], "shards": [{"name": "a", "url": "http://b"}]}), "\"replicas\" cannot be given with it"),
        ] {
            let error = TaskOptions::parse(&options).expect_err("refused");
            assert!(error.message.contains(expected), "{options}: {}", error.message);
            assert!(!error.hint.is_empty(), "{options}");
        }
        // A replica has no name.
        let named = TaskOptions::parse(&json!({"replicas": [{"name": "a", "url": "http://a"}]}))
            .expect_err("refused");
        assert!(
            named
                .message
                .contains("unknown field \"name\" in a replica"),
            "{}",
            named.message
        );
        let many: Vec<Value> = (0..=MAX_REPLICAS)
            .map(|n| json!({"name": format!("s{n}"), "url": format!("http://s{n}:7700")}))
            .collect();
        let error = TaskOptions::parse(&json!({ "shards": many })).expect_err("too many");
        assert!(
            error
                .message
                .contains("\"shards\" names 17 servers, more than 16"),
            "{}",
            error.message
        );
    }

    #[test]
    fn geo_names_one_column_and_is_kept() {
        let parsed = TaskOptions::parse(&json!({"geo": "location"})).unwrap();
        assert_eq!(parsed.geo.as_deref(), Some("location"));
        assert_eq!(parsed.to_stored_json()["geo"], json!("location"));
        assert_eq!(
            TaskOptions::parse(&parsed.to_stored_json()).unwrap().geo,
            parsed.geo
        );
        for bad in [json!(""), json!(["location"]), json!(1)] {
            let error = TaskOptions::parse(&json!({ "geo": bad })).unwrap_err();
            assert!(error.message.contains("PostGIS column"), "{error:?}");
        }
        assert_eq!(
            option_altered_as(json!({"geo": "place"}).as_object().unwrap(), Alter::NewTask),
            Some("geo")
        );
    }

    #[test]
    fn vectors_name_a_column_per_embedder_and_are_kept() {
        let parsed =
            TaskOptions::parse(&json!({"vectors": {"default": "embedding", "small": "mini"}}))
                .unwrap();
        assert_eq!(
            parsed.vectors,
            vec![
                ("default".to_owned(), "embedding".to_owned()),
                ("small".to_owned(), "mini".to_owned())
            ]
        );
        assert_eq!(
            TaskOptions::parse(&parsed.to_stored_json())
                .unwrap()
                .vectors,
            parsed.vectors
        );
        for bad in [
            json!({}),
            json!(["embedding"]),
            json!({"default": ""}),
            json!({"default": 3}),
            json!({"a": "embedding", "b": "embedding"}),
        ] {
            assert!(
                TaskOptions::parse(&json!({ "vectors": bad })).is_err(),
                "{bad}"
            );
        }
        assert_eq!(
            option_altered_as(
                json!({"vectors": {"a": "b"}}).as_object().unwrap(),
                Alter::NewTask
            ),
            Some("vectors")
        );
    }

    #[test]
    fn mappings_are_table_names_and_queries() {
        let query = "SELECT p.id FROM public.products p WHERE p.brand_id = ANY($1::int[])";
        let parsed = TaskOptions::parse(&json!({"mappings": {"brands": query}})).unwrap();
        assert_eq!(
            parsed.mappings,
            vec![("brands".to_owned(), query.to_owned())]
        );
        assert_eq!(
            parsed.to_stored_json()["mappings"],
            json!({"brands": query})
        );
        for bad in [
            json!(["brands"]),
            json!({"brands": ""}),
            json!({"brands": 1}),
        ] {
            let error = TaskOptions::parse(&json!({ "mappings": bad })).unwrap_err();
            assert!(error.message.contains("mapping"), "{}", error.message);
            assert!(error.hint.contains("$1"), "{}", error.hint);
        }
    }

    #[test]
    fn defaults_for_empty_object() {
        assert_eq!(
            TaskOptions::parse(&json!({})).ok(),
            Some(TaskOptions::default())
        );
    }

    #[test]
    fn batch_bytes_stay_within_the_payload_limit() {
        let lowered = TaskOptions::parse(&json!({"max_payload_bytes": 1_000_000})).expect("valid");
        assert_eq!(
            (lowered.batch_bytes, lowered.max_payload_bytes),
            (1_000_000, 1_000_000)
        );
        let error =
            TaskOptions::parse(&json!({"max_payload_bytes": 1_000_000, "batch_bytes": 3_000_000}))
                .expect_err("batch_bytes above the limit");
        assert!(
            error.message.contains("larger than \"max_payload_bytes\""),
            "{}",
            error.message
        );
        let error = TaskOptions::parse(&json!({"batch_bytes": 200_000_000}))
            .expect_err("above the default limit");
        assert!(error.message.contains("batch_bytes"), "{}", error.message);
    }

    #[test]
    fn schema_changes_resync_unless_report_is_asked_and_kept_only_then() {
        let default = TaskOptions::parse(&json!({})).expect("no options");
        assert_eq!(default.schema_changes, SchemaChanges::Resync);
        assert!(default.to_stored_json().get("schema_changes").is_none());
        let report = TaskOptions::parse(&json!({"schema_changes": "report"})).expect("report");
        assert_eq!(report.schema_changes, SchemaChanges::Report);
        assert_eq!(report.to_stored_json()["schema_changes"], json!("report"));
        let error =
            TaskOptions::parse(&json!({"schema_changes": "ignore"})).expect_err("not a choice");
        assert!(
            error.message.contains("\"schema_changes\""),
            "{}",
            error.message
        );
    }

    #[test]
    fn reader_independent_is_a_boolean_kept_only_when_declared() {
        let declared = TaskOptions::parse(&json!({"reader_independent": true})).expect("a boolean");
        assert!(declared.reader_independent);
        assert_eq!(declared.to_stored_json()["reader_independent"], json!(true));
        let default = TaskOptions::parse(&json!({})).expect("no options");
        assert!(default.to_stored_json().get("reader_independent").is_none());
        let error = TaskOptions::parse(&json!({"reader_independent": "yes"}))
            .expect_err("a string is not a declaration");
        assert!(
            error.message.contains("reader_independent"),
            "{}",
            error.message
        );
        assert_eq!(
            option_altered_as(
                json!({"reader_independent": false})
                    .as_object()
                    .expect("object"),
                Alter::NewTask
            ),
            Some("reader_independent")
        );
    }

    #[test]
    fn parses_every_option() {
        let parsed = TaskOptions::parse(&json!({
            "url": "http://meili:7700/", "api_key": "k", "primary_key": ["a", "b"],
            "exclude_columns": "secret", "batch_size": 500, "batch_bytes": 2048, "max_inflight": 2,
            "snapshot_depth": 64, "stream_depth": 16, "flush_interval_ms": 0, "gzip": true, "write_mode": "upsert",
            "settings": {"filterableAttributes": ["a"]}
        }))
        .expect("valid options");
        assert_eq!(parsed.url.as_deref(), Some("http://meili:7700"));
        assert_eq!(
            parsed.primary_key,
            Some(vec!["a".to_owned(), "b".to_owned()])
        );
        assert_eq!(parsed.exclude_columns, vec!["secret".to_owned()]);
        assert_eq!(
            (
                parsed.batch_size,
                parsed.batch_bytes,
                parsed.max_inflight,
                parsed.snapshot_depth,
                parsed.stream_depth
            ),
            (500, 2048, 2, 64, 16)
        );
        assert!(parsed.gzip);
        assert_eq!(parsed.write_mode, WriteMode::Upsert);
        let stored = parsed.to_stored_json();
        assert_eq!(stored["write_mode"], json!("upsert"));
        assert!(stored.get("api_key").is_none() && stored.get("url").is_none());
    }

    #[test]
    fn shared_decoding_is_the_default_and_only_own_is_stored() {
        let default = TaskOptions::parse(&json!({"url": "http://m"})).expect("parse");
        assert_eq!(default.decoding, Decoding::Shared);
        assert!(default.to_stored_json().get("decoding").is_none());
        // A stored task without "decoding" reads as shared: it moves into the shared pass.
        let reread = TaskOptions::parse(&default.to_stored_json()).expect("parse");
        assert_eq!(reread.decoding, Decoding::Shared);
        let own =
            TaskOptions::parse(&json!({"url": "http://m", "decoding": "own"})).expect("parse");
        assert_eq!(own.to_stored_json()["decoding"], json!("own"));
        let reread = TaskOptions::parse(&own.to_stored_json()).expect("parse");
        assert_eq!(reread.decoding, Decoding::Own);
    }

    #[test]
    fn rejects_bad_input_with_a_message_naming_the_option() {
        let cases = [
            (json!({"bogus": 1}), "unknown option \"bogus\""),
            (
                json!({"batch_size": "10"}),
                "\"batch_size\" must be an integer",
            ),
            (
                json!({"batch_size": 0}),
                "\"batch_size\" must be an integer",
            ),
            (json!({"gzip": "yes"}), "\"gzip\" must be true or false"),
            (
                json!({"snapshot_depth": 0}),
                "\"snapshot_depth\" must be an integer between 1 and 1024",
            ),
            (
                json!({"stream_depth": 2000}),
                "\"stream_depth\" must be an integer between 1 and 1024",
            ),
            (json!({"write_mode": "merge"}), "\"write_mode\""),
            (json!({"decoding": "both"}), "\"decoding\""),
            (json!({"url": "ftp://x"}), "scheme must be http or https"),
            (json!({"url": "http://user:pw@x:7700"}), "credentials"),
            (json!({"url": "http://x:notaport"}), "bad port"),
            (json!({"url": "http:// x"}), "bad host"),
            (
                json!({"columns": ["a"], "exclude_columns": ["b"]}),
                "cannot be used together",
            ),
            (json!({"primary_key": []}), "\"primary_key\" must be"),
            (json!({"columns": ["a", "a"]}), "twice"),
            (
                json!({"settings": [1]}),
                "\"settings\" must be a JSON object",
            ),
            (json!([1]), "options must be a JSON object"),
        ];
        for (input, expected) in cases {
            let error = TaskOptions::parse(&input).expect_err("must be rejected");
            assert!(
                error.message.contains(expected),
                "{input}: {}",
                error.message
            );
            assert!(!error.hint.is_empty());
        }
    }

    #[test]
    fn index_uid_rules() {
        assert!(validate_index_uid("products_2024-v1").is_ok());
        assert!(validate_index_uid(&"a".repeat(400)).is_ok());
        for bad in ["", "a b", "a/b", "produits-é", "x'; DROP TABLE t; --"] {
            assert!(validate_index_uid(bad).is_err(), "{bad}");
        }
        assert!(validate_index_uid(&"a".repeat(401)).is_err());
    }

    #[test]
    fn url_rules() {
        for good in [
            "http://127.0.0.1:7700",
            "https://search.example.com",
            "http://[::1]:7700/",
        ] {
            assert!(validate_url(good).is_ok(), "{good}");
        }
    }

    fn changes(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn an_alter_merges_its_changes_over_the_stored_options() {
        let stored = json!({"batch_size": 500, "gzip": true, "url": "http://a"});
        let merged = merged_options(
            &stored,
            &changes(json!({"batch_size": 5000, "url": "http://b"})),
        );
        assert_eq!(
            merged,
            json!({"batch_size": 5000, "gzip": true, "url": "http://b"})
        );
    }

    #[test]
    fn a_lower_payload_limit_takes_the_stored_batch_bytes_down() {
        let stored = json!({"batch_bytes": 50_000_000});
        let merged = merged_options(&stored, &changes(json!({"max_payload_bytes": 1_000_000})));
        assert_eq!(merged["batch_bytes"], json!(1_000_000));
        // Both changed: left to parsing, which refuses batch_bytes above the limit.
        let both = changes(json!({"max_payload_bytes": 1_000_000, "batch_bytes": 2_000_000}));
        assert_eq!(
            merged_options(&stored, &both)["batch_bytes"],
            json!(2_000_000)
        );
        // A limit above the stored batch bytes leaves them.
        let higher = merged_options(&stored, &changes(json!({"max_payload_bytes": 90_000_000})));
        assert_eq!(higher["batch_bytes"], json!(50_000_000));
    }

    #[test]
    fn options_a_task_is_created_with_for_good_are_found_among_changes() {
        assert_eq!(
            option_altered_as(&changes(json!({"batch_size": 1})), Alter::NewTask),
            None
        );
        assert_eq!(
            option_altered_as(
                &changes(json!({"gzip": false, "columns": ["id"]})),
                Alter::NewTask
            ),
            Some("columns")
        );
        assert_eq!(
            option_altered_as(&changes(json!({"search_api_key": "k"})), Alter::ByOwner),
            Some("search_api_key")
        );
    }

    #[test]
    fn every_option_the_parser_takes_is_in_the_list_and_no_other() {
        // The parser answers "unknown option" for a name it has no arm for.
        for (name, _) in OPTIONS {
            let refused = TaskOptions::parse(&json!({ *name: "?" }))
                .err()
                .map(|e| e.message);
            assert!(
                !refused.unwrap_or_default().contains("unknown option"),
                "{name} is listed but the parser does not know it"
            );
        }
        let refused = TaskOptions::parse(&json!({"no_such_option": 1})).err();
        assert!(refused.is_some_and(|e| e.message.contains("unknown option")));
    }
}
