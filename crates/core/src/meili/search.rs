//! Searching from SQL: the request body from a query and options, an answer's hits and facet
//! distribution as rows, and [`SearchThread`], which runs requests off a backend's main thread so
//! that the backend can notice a cancel while Meilisearch answers.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use serde_json::{Map, Value};

use super::client::{Client, MeiliError};

/// The search body: Meilisearch's own parameters from `options` (a JSON object, passed as is),
/// with `q` from `query` unless the options set it.
pub fn search_body(query: Option<&str>, options: &Value) -> Result<Value, String> {
    let mut body = match options {
        Value::Object(object) => object.clone(),
        Value::Null => Map::new(),
        other => {
            return Err(format!(
                "search options must be a JSON object of Meilisearch search parameters, not {other}"
            ))
        }
    };
    if let Some(query) = query {
        body.entry("q").or_insert_with(|| Value::from(query));
    }
    Ok(Value::Object(body))
}

/// One hit as a row: the document id (as text: the number of an integer id), the ranking score
/// when Meilisearch sent one, the document without the fields Meilisearch adds, and the
/// highlighted (`_formatted`) document when asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct Hit {
    pub id: Option<String>,
    pub score: Option<f64>,
    pub document: Value,
    pub formatted: Option<Value>,
}

/// The hits of a search answer; `primary_key` is the index's key attribute.
pub fn hits(answer: &Value, primary_key: &str) -> Result<Vec<Hit>, String> {
    let Some(hits) = answer.get("hits").and_then(Value::as_array) else {
        return Err("the search answer has no \"hits\" array".to_owned());
    };
    Ok(hits
        .iter()
        .map(|hit| {
            let mut document = hit.as_object().cloned().unwrap_or_default();
            let score = document.remove("_rankingScore").and_then(|v| v.as_f64());
            let formatted = document.remove("_formatted");
            document.remove("_rankingScoreDetails");
            document.remove("_matchesPosition");
            let id = document.get(primary_key).and_then(|id| match id {
                Value::String(text) => Some(text.clone()),
                Value::Number(number) => Some(number.to_string()),
                _ => None,
            });
            Hit {
                id,
                score,
                document: Value::Object(document),
                formatted,
            }
        })
        .collect())
}

/// A search answer's `facetDistribution` as (facet, value, count) rows, in the answer's order.
pub fn facet_counts(answer: &Value) -> Vec<(String, String, i64)> {
    let mut rows = Vec::new();
    let Some(distribution) = answer.get("facetDistribution").and_then(Value::as_object) else {
        return rows;
    };
    for (facet, values) in distribution {
        let Some(values) = values.as_object() else {
            continue;
        };
        for (value, count) in values {
            rows.push((facet.clone(), value.clone(), count.as_i64().unwrap_or(0)));
        }
    }
    rows
}

/// One request for the search thread.
struct Job {
    seq: u64,
    client: Client,
    uid: String,
    body: Value,
}

/// A thread that runs search requests one at a time, for a thread that must stay free to notice
/// a cancel (a backend's main thread). The caller starts it with every signal blocked, as for
/// any thread in a Postgres process. It ends when the `SearchThread` is dropped.
pub struct SearchThread {
    jobs: Sender<Job>,
    answers: Receiver<(u64, Result<Value, MeiliError>)>,
    next_seq: u64,
}

/// How waiting for an answer ended.
pub enum Waited {
    Answer(Result<Value, MeiliError>),
    /// `interrupted` said to stop: the answer, when it comes, is dropped.
    Interrupted,
}

impl SearchThread {
    pub fn start() -> std::io::Result<SearchThread> {
        let (jobs, job_receiver) = channel::<Job>();
        let (answer_sender, answers) = channel();
        std::thread::Builder::new()
            .name("pg_meili_sync search".into())
            .spawn(move || {
                for job in job_receiver {
                    let answer = job.client.search(&job.uid, &job.body);
                    if answer_sender.send((job.seq, answer)).is_err() {
                        return;
                    }
                }
            })?;
        Ok(SearchThread {
            jobs,
            answers,
            next_seq: 0,
        })
    }

    /// Runs one search, calling `interrupted` every few milliseconds while it waits; answers of
    /// earlier, interrupted searches are skipped. Err if the thread is gone.
    pub fn search(
        &mut self,
        client: &Client,
        uid: &str,
        body: Value,
        mut interrupted: impl FnMut() -> bool,
    ) -> Result<Waited, String> {
        self.next_seq += 1;
        let seq = self.next_seq;
        self.jobs
            .send(Job {
                seq,
                client: client.clone(),
                uid: uid.to_owned(),
                body,
            })
            .map_err(|_| "the search thread has stopped".to_owned())?;
        loop {
            match self.answers.recv_timeout(Duration::from_millis(2)) {
                Ok((answered, answer)) if answered == seq => return Ok(Waited::Answer(answer)),
                Ok(_) => continue,
                Err(RecvTimeoutError::Timeout) => {
                    if interrupted() {
                        return Ok(Waited::Interrupted);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err("the search thread has stopped".to_owned())
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_body_is_the_options_with_the_query() {
        let body =
            search_body(Some("kettle"), &json!({"limit": 3, "filter": "price > 10"})).unwrap();
        assert_eq!(
            body,
            json!({"q": "kettle", "limit": 3, "filter": "price > 10"})
        );
        let body = search_body(Some("kettle"), &json!({"q": "own"})).unwrap();
        assert_eq!(body, json!({"q": "own"}), "the options' q wins");
        assert_eq!(search_body(None, &Value::Null).unwrap(), json!({}));
        assert!(search_body(Some("x"), &json!([1]))
            .unwrap_err()
            .contains("JSON object"));
    }

    #[test]
    fn hits_become_rows_without_meilisearch_fields() {
        let answer = json!({"hits": [
            {"id": 7, "name": "kettle", "_rankingScore": 0.9, "_formatted": {"id": "7", "name": "<em>kettle</em>"}},
            {"id": "a_20b", "name": "pot"},
            {"name": "no id"}
        ]});
        let rows = hits(&answer, "id").unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].id.as_deref(), Some("7"));
        assert_eq!(rows[0].score, Some(0.9));
        assert_eq!(rows[0].document, json!({"id": 7, "name": "kettle"}));
        assert_eq!(
            rows[0].formatted,
            Some(json!({"id": "7", "name": "<em>kettle</em>"}))
        );
        assert_eq!(rows[1].id.as_deref(), Some("a_20b"));
        assert_eq!(rows[1].score, None);
        assert_eq!(rows[2].id, None);
        assert!(hits(&json!({"message": "x"}), "id").is_err());
    }

    #[test]
    fn the_search_thread_answers_and_an_interrupted_wait_leaves_it_usable() {
        use std::net::TcpListener;
        // A server that accepts and never answers: the wait must end when told to.
        let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", silent.local_addr().expect("address"));
        let stuck = Client::new(&url, None, Duration::from_secs(2)).expect("client");
        let mut thread = SearchThread::start().expect("thread");
        let started = std::time::Instant::now();
        let mut looks = 0;
        let waited = thread
            .search(&stuck, "any", serde_json::json!({}), || {
                looks += 1;
                looks > 10
            })
            .expect("the thread runs");
        assert!(matches!(waited, Waited::Interrupted));
        assert!(started.elapsed() < Duration::from_secs(1));
        // The next search gets its own answer, not the stuck one's late failure.
        let server = meili_test_server::TestServer::start(None).expect("test server");
        let client = Client::new(&server.url(), None, Duration::from_secs(10)).expect("client");
        let uid = client.create_index("books", "id").expect("enqueued");
        client
            .wait_task(uid, Duration::from_secs(10))
            .expect("created");
        match thread
            .search(&client, "books", serde_json::json!({"q": ""}), || false)
            .expect("the thread runs")
        {
            Waited::Answer(Ok(answer)) => assert_eq!(answer["hits"], serde_json::json!([])),
            Waited::Answer(Err(error)) => panic!("{error}"),
            Waited::Interrupted => panic!("not interrupted"),
        }
        drop(silent);
    }

    #[test]
    fn facet_distribution_becomes_rows() {
        let answer = json!({"facetDistribution": {"category": {"garden": 3, "kitchen": 5}, "color": {"red": 1}}});
        let rows = facet_counts(&answer);
        assert_eq!(
            rows,
            vec![
                ("category".to_owned(), "garden".to_owned(), 3),
                ("category".to_owned(), "kitchen".to_owned(), 5),
                ("color".to_owned(), "red".to_owned(), 1),
            ]
        );
        assert!(facet_counts(&json!({})).is_empty());
    }
}
