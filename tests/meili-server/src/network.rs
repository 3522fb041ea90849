//! Experimental features, `/network` and the remote half of federated search, as Meilisearch
//! 1.50's community edition has them (crates/meilisearch/src/routes/features.rs,
//! routes/network/{mod,community_edition}.rs, search/federated/{perform,proxy}.rs).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use crate::error::{did_you_mean, ApiError};
use crate::json::{array, describe, quote, Obj};
use crate::search::type_error;
use crate::{lock, Shared};

/// The runtime-togglable features, in the order Meilisearch lists them.
const FEATURES: [&str; 15] = [
    "metrics",
    "logsRoute",
    "editDocumentsByFunction",
    "containsFilter",
    "dynamicSearchRules",
    "network",
    "getTaskDocumentsRoute",
    "taskQueueCompactionRoute",
    "compositeEmbedders",
    "chatCompletions",
    "multimodal",
    "foreignKeys",
    "disableDocumentsFetchQueue",
    "legacySearch",
    "renderRoute",
];

/// Meilisearch waits 25 s by default; tests want an unreachable remote to fail fast.
const REMOTE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Remote {
    pub(crate) url: String,
    pub(crate) search_api_key: Option<String>,
    write_api_key: Option<String>,
}

#[derive(Clone, Debug)]
pub(crate) struct Network {
    pub(crate) local: Option<String>,
    pub(crate) remotes: BTreeMap<String, Remote>,
    shards: BTreeMap<String, BTreeSet<String>>,
    version: String,
}

pub(crate) struct State {
    features: [bool; FEATURES.len()],
    network: Network,
}

impl Default for State {
    fn default() -> Self {
        State {
            features: [false; FEATURES.len()],
            network: Network {
                local: None,
                remotes: BTreeMap::new(),
                shards: BTreeMap::new(),
                // A network never patched has the nil UUID as its version.
                version: "00000000-0000-0000-0000-000000000000".into(),
            },
        }
    }
}

impl State {
    fn enabled(&self, feature: &str) -> bool {
        FEATURES
            .iter()
            .position(|f| *f == feature)
            .is_some_and(|i| self.features[i])
    }
}

fn features_json(state: &State) -> String {
    FEATURES
        .iter()
        .zip(state.features)
        .fold(Obj::new(), |o, (k, v)| o.val(k, &Value::Bool(v)))
        .end()
}

pub(crate) fn get_features(shared: &Shared) -> String {
    features_json(&lock(&shared.experimental))
}

/// Absent and `null` keep a feature as it is; anything but a boolean is refused.
pub(crate) fn patch_features(shared: &Shared, body: &Value) -> Result<String, ApiError> {
    let obj = object(body, "bad_request")?;
    let mut changes = Vec::new();
    for (k, v) in obj {
        let Some(i) = FEATURES.iter().position(|f| f == k) else {
            return Err(unknown_field("bad_request", k, "", &FEATURES));
        };
        match v {
            Value::Null => {}
            Value::Bool(b) => changes.push((i, *b)),
            v => return Err(type_error("bad_request", &format!(".{k}"), "a boolean", v)),
        }
    }
    let mut state = lock(&shared.experimental);
    for (i, b) in changes {
        state.features[i] = b;
    }
    Ok(features_json(&state))
}

/// `feature_not_enabled` unless the `network` feature is on; `action` starts the message.
pub(crate) fn check_network(shared: &Shared, action: &str) -> Result<(), ApiError> {
    if lock(&shared.experimental).enabled("network") {
        return Ok(());
    }
    Err(ApiError::new(
        "feature_not_enabled",
        format!("{action} requires enabling the `network` experimental feature. See https://github.com/orgs/meilisearch/discussions/805"),
    ))
}

/// The network as it is now (searches work on a copy so no lock is held during remote calls).
pub(crate) fn snapshot(shared: &Shared) -> Network {
    lock(&shared.experimental).network.clone()
}

fn network_json(n: &Network) -> String {
    let remotes = n.remotes.iter().fold(Obj::new(), |o, (name, r)| {
        o.raw(
            name,
            &Obj::new()
                .str("url", &r.url)
                .opt_str("searchApiKey", r.search_api_key.as_deref())
                .opt_str("writeApiKey", r.write_api_key.as_deref())
                .str("status", "available")
                .end(),
        )
    });
    let shards = n.shards.iter().fold(Obj::new(), |o, (name, owners)| {
        o.raw(
            name,
            &Obj::new()
                .raw("remotes", &array(owners.iter().map(|r| quote(r))))
                .end(),
        )
    });
    Obj::new()
        .opt_str("self", n.local.as_deref())
        .raw("remotes", &remotes.end())
        .raw("shards", &shards.end())
        .raw("leader", "null")
        .str("version", &n.version)
        .end()
}

pub(crate) fn get_network(shared: &Shared) -> Result<String, ApiError> {
    check_network(shared, "Using the /network route")?;
    Ok(network_json(&snapshot(shared)))
}

/// `POST /network/control` only exists in the enterprise edition.
pub(crate) fn network_control(shared: &Shared) -> Result<String, ApiError> {
    check_network(shared, "Using the /network/control route")?;
    Err(enterprise(
        "Meilisearch Enterprise Edition is required to call this route",
    ))
}

fn enterprise(message: &str) -> ApiError {
    ApiError::new("requires_enterprise_edition", message)
}

/// A field of a PATCH: absent, `null` or a value.
enum Setting<T> {
    NotSet,
    Reset,
    Set(T),
}

struct RemotePatch {
    url: Setting<String>,
    search_api_key: Setting<String>,
    write_api_key: Setting<String>,
}

#[derive(Default)]
struct ShardPatch {
    remotes: Option<BTreeSet<String>>,
    add: Option<BTreeSet<String>>,
    remove: Option<BTreeSet<String>>,
}

struct NetworkPatch {
    remotes: Setting<BTreeMap<String, Option<RemotePatch>>>,
    shards: Setting<BTreeMap<String, Option<ShardPatch>>>,
    local: Setting<String>,
    leader: Setting<String>,
    previous_remotes: bool,
}

const NETWORK_FIELDS: [&str; 6] = [
    "remotes",
    "shards",
    "previousShards",
    "self",
    "leader",
    "previousRemotes",
];
const REMOTE_FIELDS: [&str; 3] = ["url", "searchApiKey", "writeApiKey"];
const SHARD_FIELDS: [&str; 3] = ["remotes", "addRemotes", "removeRemotes"];

fn object<'a>(v: &'a Value, code: &str) -> Result<&'a Map<String, Value>, ApiError> {
    v.as_object().ok_or_else(|| {
        ApiError::new(
            code,
            format!(
                "Invalid value type: expected an object, but found {}",
                describe(v)
            ),
        )
    })
}

fn unknown_field(code: &str, key: &str, inside: &str, expected: &[&str]) -> ApiError {
    let inside = if inside.is_empty() {
        String::new()
    } else {
        format!(" inside `{inside}`")
    };
    let list: Vec<String> = expected.iter().map(|e| format!("`{e}`")).collect();
    ApiError::new(
        code,
        format!(
            "Unknown field `{key}`{inside}: {}expected one of {}",
            did_you_mean(key, expected),
            list.join(", ")
        ),
    )
}

fn string_setting(v: Option<&Value>, code: &str, at: &str) -> Result<Setting<String>, ApiError> {
    match v {
        None => Ok(Setting::NotSet),
        Some(Value::Null) => Ok(Setting::Reset),
        Some(Value::String(s)) => Ok(Setting::Set(s.clone())),
        Some(v) => Err(type_error(code, at, "a string", v)),
    }
}

fn parse_remotes(
    v: Option<&Value>,
    at: &str,
) -> Result<Setting<BTreeMap<String, Option<RemotePatch>>>, ApiError> {
    let code = "invalid_network_remotes";
    let obj = match v {
        None => return Ok(Setting::NotSet),
        Some(Value::Null) => return Ok(Setting::Reset),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(type_error(code, at, "an object", v)),
    };
    let mut out = BTreeMap::new();
    for (name, r) in obj {
        let at = format!("{at}.{name}");
        let r = match r {
            Value::Null => None,
            Value::Object(r) => {
                if let Some(k) = r.keys().find(|k| !REMOTE_FIELDS.contains(&k.as_str())) {
                    return Err(unknown_field(code, k, &at, &REMOTE_FIELDS));
                }
                Some(RemotePatch {
                    url: string_setting(r.get("url"), "invalid_network_url", &format!("{at}.url"))?,
                    search_api_key: string_setting(
                        r.get("searchApiKey"),
                        "invalid_network_search_api_key",
                        &format!("{at}.searchApiKey"),
                    )?,
                    write_api_key: string_setting(
                        r.get("writeApiKey"),
                        "invalid_network_write_api_key",
                        &format!("{at}.writeApiKey"),
                    )?,
                })
            }
            v => return Err(type_error(code, &at, "an object", v)),
        };
        out.insert(name.clone(), r);
    }
    Ok(Setting::Set(out))
}

fn parse_shards(
    v: Option<&Value>,
    at: &str,
) -> Result<Setting<BTreeMap<String, Option<ShardPatch>>>, ApiError> {
    let code = "invalid_network_shards";
    let obj = match v {
        None => return Ok(Setting::NotSet),
        Some(Value::Null) => return Ok(Setting::Reset),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(type_error(code, at, "an object", v)),
    };
    let names = |v: Option<&Value>, at: String| -> Result<Option<BTreeSet<String>>, ApiError> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    s.as_str().map(String::from).ok_or_else(|| {
                        type_error(
                            "invalid_network_remotes",
                            &format!("{at}[{i}]"),
                            "a string",
                            s,
                        )
                    })
                })
                .collect::<Result<_, _>>()
                .map(Some),
            Some(v) => Err(type_error("invalid_network_remotes", &at, "an array", v)),
        }
    };
    let mut out = BTreeMap::new();
    for (name, s) in obj {
        let at = format!("{at}.{name}");
        let s = match s {
            Value::Null => None,
            Value::Object(s) => {
                if let Some(k) = s.keys().find(|k| !SHARD_FIELDS.contains(&k.as_str())) {
                    return Err(unknown_field(code, k, &at, &SHARD_FIELDS));
                }
                Some(ShardPatch {
                    remotes: names(s.get("remotes"), format!("{at}.remotes"))?,
                    add: names(s.get("addRemotes"), format!("{at}.addRemotes"))?,
                    remove: names(s.get("removeRemotes"), format!("{at}.removeRemotes"))?,
                })
            }
            v => return Err(type_error(code, &at, "an object", v)),
        };
        out.insert(name.clone(), s);
    }
    Ok(Setting::Set(out))
}

fn parse_patch(body: &Value) -> Result<NetworkPatch, ApiError> {
    let obj = object(body, "bad_request")?;
    if let Some(k) = obj.keys().find(|k| !NETWORK_FIELDS.contains(&k.as_str())) {
        return Err(unknown_field("bad_request", k, "", &NETWORK_FIELDS));
    }
    parse_shards(obj.get("previousShards"), ".previousShards")?;
    Ok(NetworkPatch {
        remotes: parse_remotes(obj.get("remotes"), ".remotes")?,
        shards: parse_shards(obj.get("shards"), ".shards")?,
        local: string_setting(obj.get("self"), "invalid_network_self", ".self")?,
        leader: string_setting(obj.get("leader"), "invalid_network_leader", ".leader")?,
        previous_remotes: !matches!(
            parse_remotes(obj.get("previousRemotes"), ".previousRemotes")?,
            Setting::NotSet
        ),
    })
}

/// Meilisearch validates URLs with the `url` crate; these are the errors tests meet.
fn check_url(name: &str, url: &str) -> Result<(), ApiError> {
    let scheme_len = url
        .find(':')
        .filter(|&i| {
            i > 0
                && url[..i].starts_with(|c: char| c.is_ascii_alphabetic())
                && url[..i]
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        })
        .map(|i| i + 1);
    let problem = match scheme_len {
        None => Some("relative URL without a base"),
        Some(n) => {
            let scheme = url[..n - 1].to_ascii_lowercase();
            let rest = url[n..].trim_start_matches('/');
            let host = rest.split(['/', '?', '#', ':']).next().unwrap_or("");
            (matches!(scheme.as_str(), "http" | "https") && host.is_empty()).then_some("empty host")
        }
    };
    match problem {
        None => Ok(()),
        Some(p) => Err(ApiError::new(
            "invalid_network_url",
            format!("Invalid `.remotes.{name}.url` (`{url}`): {p}"),
        )),
    }
}

/// Synchronous, as in Meilisearch 1.50: answers the merged network, no task.
pub(crate) fn patch_network(shared: &Shared, body: &Value) -> Result<String, ApiError> {
    let patch = parse_patch(body)?;
    check_network(shared, "Using the /network route")?;
    if matches!(patch.leader, Setting::Set(_)) {
        return Err(enterprise(
            "Meilisearch Enterprise Edition is required to set `network.leader`",
        ));
    }
    if patch.previous_remotes {
        return Err(ApiError::new(
            "unexpected_network_previous_remotes",
            "Unexpected `previousRemotes` in network call.\n  - Note: `previousRemote` is reserved for internal use.",
        ));
    }
    let mut state = lock(&shared.experimental);
    let merged = merge(&state.network, patch)?;
    state.network = merged;
    Ok(network_json(&state.network))
}

fn merge(old: &Network, patch: NetworkPatch) -> Result<Network, ApiError> {
    let local = match patch.local {
        Setting::Set(s) => Some(s),
        Setting::Reset => None,
        Setting::NotSet => old.local.clone(),
    };
    let mut shards = match patch.shards {
        Setting::Set(new) => {
            let mut shards = old.shards.clone();
            for (name, s) in new {
                let Some(s) = s else {
                    shards.remove(&name);
                    continue;
                };
                let before = shards.remove(&name).unwrap_or_default();
                let mut owners = s.remotes.unwrap_or(before);
                owners.extend(s.add.unwrap_or_default());
                for r in s.remove.unwrap_or_default() {
                    owners.remove(&r);
                }
                shards.insert(name, owners);
            }
            shards
        }
        Setting::Reset => BTreeMap::new(),
        Setting::NotSet => old.shards.clone(),
    };
    let remotes = match patch.remotes {
        Setting::Set(new) => {
            let mut remotes = old.remotes.clone();
            for (name, r) in new {
                let Some(r) = r else {
                    remotes.remove(&name);
                    for owners in shards.values_mut() {
                        owners.remove(&name);
                    }
                    continue;
                };
                let merged = match remotes.get(&name) {
                    Some(before) => Remote {
                        url: match r.url {
                            Setting::Set(url) => {
                                check_url(&name, &url)?;
                                url
                            }
                            Setting::Reset => {
                                return Err(ApiError::new(
                                    "invalid_network_url",
                                    format!("Field `.remotes.{name}.url` cannot be set to `null`"),
                                ))
                            }
                            Setting::NotSet => before.url.clone(),
                        },
                        search_api_key: keep(r.search_api_key, &before.search_api_key),
                        write_api_key: keep(r.write_api_key, &before.write_api_key),
                    },
                    None => {
                        let Setting::Set(url) = r.url else {
                            return Err(ApiError::new(
                                "missing_network_url",
                                format!("Missing field `.remotes.{name}.url`"),
                            ));
                        };
                        check_url(&name, &url)?;
                        Remote {
                            url,
                            search_api_key: keep(r.search_api_key, &None),
                            write_api_key: keep(r.write_api_key, &None),
                        }
                    }
                };
                remotes.insert(name, merged);
            }
            remotes
        }
        Setting::Reset => BTreeMap::new(),
        Setting::NotSet => old.remotes.clone(),
    };
    shards.retain(|_, owners| !owners.is_empty());
    Ok(Network {
        local,
        remotes,
        shards,
        version: crate::search::request_uid(),
    })
}

fn keep(patch: Setting<String>, before: &Option<String>) -> Option<String> {
    match patch {
        Setting::Set(s) => Some(s),
        Setting::Reset => None,
        Setting::NotSet => before.clone(),
    }
}

/// One hit of a remote's answer, ready to be merged.
pub(crate) struct RemoteHit {
    pub(crate) score: f64,
    pub(crate) position: usize,
    /// The hit's members but `_federation`, as the remote wrote them.
    pub(crate) members: String,
    /// `_federation` with `remote` set and the proxy-only fields left out.
    pub(crate) federation: String,
}

pub(crate) struct RemoteResult {
    pub(crate) hits: Vec<RemoteHit>,
    pub(crate) total: u64,
    pub(crate) elapsed_ms: u64,
    /// The remote's `facetsByIndex`, to add up with the local ones.
    pub(crate) facets: crate::facets::ByIndex,
}

/// Sends the queries meant for `name` as one federated multi-search, as Meilisearch's
/// `proxy_search` does: the remote's search key as bearer and `Meili-Proxy-Search: true`.
pub(crate) fn proxy_search(
    name: &str,
    remote: &Remote,
    body: &str,
) -> Result<RemoteResult, ApiError> {
    let (status, answer) = post_json(
        &remote.url,
        "/multi-search",
        remote.search_api_key.as_deref(),
        body.as_bytes(),
        REMOTE_TIMEOUT,
    )
    .map_err(|e| match e {
        SendError::Timeout => ApiError::new(
            "remote_timeout",
            "remote host did not answer before the deadline",
        ),
        SendError::Send => ApiError::new("remote_could_not_send_request", "error sending request"),
    })?;
    // Meilisearch quotes a JSON answer compacted, keys in their order; ours are compact.
    let shown = || String::from_utf8_lossy(&answer).trim().to_string();
    match status {
        200..=299 => {}
        401 | 403 => return Err(ApiError::new(
            "remote_invalid_api_key",
            "could not authenticate against the remote host\n  - hint: check that the remote instance was registered with a valid API key having the `search` action",
        )),
        400..=499 => return Err(ApiError::new(
            "remote_bad_request",
            format!("remote host responded with code {status}:\n  - response from remote: {}\n  - hint: check that the remote instance has the correct index configuration for that request\n  - hint: check that the `network` experimental feature is enabled on the remote instance", shown()),
        )),
        500..=599 => return Err(ApiError::new(
            "remote_remote_error",
            format!("remote host responded with code {status}:\n  - response from remote: {}", shown()),
        )),
        _ => {}
    }
    let bad_response = || {
        ApiError::new(
            "remote_bad_response",
            format!("could not parse response from the remote host as a federated search response:\n  - response from remote: {}\n  - hint: check that the remote instance is a Meilisearch instance running the same version", shown()),
        )
    };
    let text = std::str::from_utf8(&answer).map_err(|_| bad_response())?;
    let parsed: Value = serde_json::from_str(text).map_err(|_| bad_response())?;
    let total = ["estimatedTotalHits", "totalHits"]
        .iter()
        .find_map(|k| parsed.get(*k).and_then(Value::as_u64));
    let (Some(total), Some(raw_hits)) = (
        total,
        members(text.trim())
            .into_iter()
            .find(|(k, _)| k == "hits")
            .and_then(|(_, v)| elements(v)),
    ) else {
        return Err(bad_response());
    };
    let facets =
        crate::facets::ByIndex::from_json(parsed.get("facetsByIndex")).ok_or_else(bad_response)?;
    let mut hits = Vec::new();
    for raw in raw_hits {
        hits.push(remote_hit(name, raw)?);
    }
    Ok(RemoteResult {
        hits,
        total,
        elapsed_ms: parsed["processingTimeMs"].as_u64().unwrap_or(0),
        facets,
    })
}

fn remote_hit(name: &str, raw: &str) -> Result<RemoteHit, ApiError> {
    let missing = |path: &str| {
        ApiError::new(
            "remote_bad_response",
            format!("remote hit does not contain `{path}`\n  - hint: check that the remote instance is a Meilisearch instance running the same version"),
        )
    };
    let unexpected = |path: &str, expected: &str, v: &str| {
        ApiError::new(
            "remote_bad_response",
            format!("remote hit contains an unexpected value at path `{path}`: expected {expected}, received `{v}`\n  - hint: check that the remote instance is a Meilisearch instance running the same version"),
        )
    };
    let all = members(raw);
    let fed_raw = all
        .iter()
        .find(|(k, _)| k == "_federation")
        .map(|(_, v)| *v)
        .ok_or_else(|| missing("._federation"))?;
    if !fed_raw.starts_with('{') {
        return Err(unexpected("._federation", "map", fed_raw));
    }
    let fed = members(fed_raw);
    let get = |k: &str| fed.iter().find(|(key, _)| key == k).map(|(_, v)| *v);
    if get("weightedScoreValues").is_none() {
        return Err(missing("._federation.weightedScoreValues"));
    }
    let score_raw =
        get("weightedRankingScore").ok_or_else(|| missing("._federation.weightedRankingScore"))?;
    let score = score_raw
        .parse::<f64>()
        .map_err(|_| unexpected("._federation.weightedRankingScore", "number", score_raw))?;
    let pos_raw = get("queriesPosition").ok_or_else(|| missing("._federation.queriesPosition"))?;
    let position = pos_raw
        .parse::<usize>()
        .map_err(|_| unexpected("._federation.queriesPosition", "integer", pos_raw))?;
    let uid_raw = get("indexUid").ok_or_else(|| missing("._federation.indexUid"))?;
    if !uid_raw.starts_with('"') {
        return Err(unexpected("._federation.indexUid", "string", uid_raw));
    }
    let members = all
        .iter()
        .filter(|(k, _)| k != "_federation")
        .map(|(k, v)| format!("{}:{v}", quote(k)))
        .collect::<Vec<_>>()
        .join(",");
    let federation = Obj::new()
        .raw("indexUid", uid_raw)
        .raw("queriesPosition", pos_raw)
        .raw("weightedRankingScore", score_raw)
        .str("remote", name)
        .end();
    Ok(RemoteHit {
        score,
        position,
        members,
        federation,
    })
}

/// End of the JSON value starting at `i` in valid JSON text (strings and nesting honoured).
fn value_end(b: &[u8], mut i: usize) -> usize {
    let mut depth = 0usize;
    let mut in_string = false;
    while i < b.len() {
        let c = b[i];
        if in_string {
            match c {
                b'\\' => i += 1,
                b'"' => {
                    in_string = false;
                    if depth == 0 {
                        return i + 1;
                    }
                }
                _ => {}
            }
        } else {
            match c {
                b'"' => in_string = true,
                b'{' | b'[' => depth += 1,
                b'}' | b']' if depth == 0 => return i,
                b'}' | b']' => {
                    depth -= 1;
                    if depth == 0 {
                        return i + 1;
                    }
                }
                b',' if depth == 0 => return i,
                c if depth == 0 && c.is_ascii_whitespace() => return i,
                _ => {}
            }
        }
        i += 1;
    }
    i
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// The members of a valid JSON object, values as raw text; empty for anything else.
fn members(raw: &str) -> Vec<(String, &str)> {
    let b = raw.as_bytes();
    let mut out = Vec::new();
    if b.first() != Some(&b'{') {
        return out;
    }
    let mut i = skip_ws(b, 1);
    while i < b.len() && b[i] == b'"' {
        let key_end = value_end(b, i);
        let key: String = serde_json::from_str(&raw[i..key_end]).unwrap_or_default();
        i = skip_ws(b, key_end) + 1; // the colon
        let start = skip_ws(b, i);
        let end = value_end(b, start);
        out.push((key, &raw[start..end]));
        i = skip_ws(b, end);
        if i < b.len() && b[i] == b',' {
            i = skip_ws(b, i + 1);
        }
    }
    out
}

/// The elements of a valid JSON array as raw text; `None` for anything else.
fn elements(raw: &str) -> Option<Vec<&str>> {
    let b = raw.as_bytes();
    if b.first() != Some(&b'[') {
        return None;
    }
    let mut out = Vec::new();
    let mut i = skip_ws(b, 1);
    while i < b.len() && b[i] != b']' {
        let end = value_end(b, i);
        out.push(&raw[i..end]);
        i = skip_ws(b, end);
        if i < b.len() && b[i] == b',' {
            i = skip_ws(b, i + 1);
        }
    }
    Some(out)
}

enum SendError {
    Timeout,
    Send,
}

fn io_error(e: std::io::Error) -> SendError {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => SendError::Timeout,
        _ => SendError::Send,
    }
}

/// A blocking HTTP/1.1 POST on a fresh connection (`Connection: close`), answer read to the
/// end. Only `http://`; the URL's own path is replaced by `path`, as Meilisearch does.
fn post_json(
    base: &str,
    path: &str,
    key: Option<&str>,
    body: &[u8],
    timeout: Duration,
) -> Result<(u16, Vec<u8>), SendError> {
    let deadline = Instant::now() + timeout;
    let rest = base.strip_prefix("http://").ok_or(SendError::Send)?;
    let host = rest.split(['/', '?', '#']).next().unwrap_or("");
    let with_port = if host
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        host.to_string()
    } else {
        format!("{host}:80")
    };
    let addrs: Vec<_> = with_port
        .to_socket_addrs()
        .map_err(|_| SendError::Send)?
        .collect();
    let mut last = SendError::Send;
    let mut stream = None;
    for addr in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(SendError::Timeout);
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = io_error(e),
        }
    }
    let mut stream = stream.ok_or(last)?;
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{auth}Meili-Proxy-Search: true\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let left = deadline.saturating_duration_since(Instant::now());
    stream
        .set_write_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(io_error)?;
    stream.write_all(head.as_bytes()).map_err(io_error)?;
    stream.write_all(body).map_err(io_error)?;
    let mut answer = Vec::new();
    let mut buf = [0u8; 64 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(SendError::Timeout);
        }
        stream.set_read_timeout(Some(left)).map_err(io_error)?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_error(e)),
        }
    }
    parse_response(&answer).ok_or(SendError::Send)
}

/// Status and body of a whole HTTP/1.1 response (Content-Length, chunked or until close).
fn parse_response(raw: &[u8]) -> Option<(u16, Vec<u8>)> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split]).ok()?;
    let body = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let mut length = None;
    let mut chunked = false;
    for line in lines {
        let (k, v) = line.split_once(':')?;
        let v = v.trim();
        if k.eq_ignore_ascii_case("content-length") {
            length = v.parse::<usize>().ok();
        } else if k.eq_ignore_ascii_case("transfer-encoding") {
            chunked = v.to_ascii_lowercase().contains("chunked");
        }
    }
    if chunked {
        let mut out = Vec::new();
        let mut rest = body;
        loop {
            let line_end = rest.windows(2).position(|w| w == b"\r\n")?;
            let size = std::str::from_utf8(&rest[..line_end]).ok()?;
            let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
            if size == 0 {
                return Some((status, out));
            }
            let chunk = rest.get(line_end + 2..line_end + 2 + size)?;
            out.extend_from_slice(chunk);
            rest = rest.get(line_end + 4 + size..)?;
        }
    }
    match length {
        Some(n) => Some((status, body.get(..n)?.to_vec())),
        None => Some((status, body.to_vec())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_members_keep_order_and_text() {
        let raw = r#"{ "b" : 1.50 , "a":{"x":[1,"]"]},"c":"q\"}"}"#;
        let m = members(raw);
        let keys: Vec<&str> = m.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["b", "a", "c"]);
        assert_eq!(m[0].1, "1.50");
        assert_eq!(m[1].1, r#"{"x":[1,"]"]}"#);
        assert_eq!(m[2].1, r#""q\"}""#);
        assert_eq!(
            elements(r#"[ {"a":1} , 2,"x"]"#),
            Some(vec![r#"{"a":1}"#, "2", r#""x""#])
        );
        assert_eq!(elements("[]"), Some(vec![]));
    }

    #[test]
    fn urls_are_checked_like_the_url_crate() {
        assert!(check_url("a", "http://localhost:7700").is_ok());
        let e = check_url("new", "no-http-scheme").unwrap_err();
        assert_eq!(
            e.message,
            "Invalid `.remotes.new.url` (`no-http-scheme`): relative URL without a base"
        );
        assert!(check_url("a", "http://").is_err());
    }

    #[test]
    fn chunked_answers_are_decoded() {
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(raw), Some((200, b"abcde".to_vec())));
    }
}
