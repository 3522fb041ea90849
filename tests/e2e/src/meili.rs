//! The Meilisearch the tests sync into: the real server at `MEILI_URL` (key `MEILI_MASTER_KEY`)
//! when given, otherwise the project's test server, started in this process.

use std::time::Duration;

use meili_test_server::TestServer;
use serde_json::{json, Value};
pub use ureq::http::Method;
use ureq::http::Request;

pub struct Meili {
    pub url: String,
    pub key: Option<String>,
    server: Option<TestServer>,
    agent: ureq::Agent,
}

const TEST_KEY: &str = "e2e-master-key";

impl Meili {
    pub fn from_env() -> Meili {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .into();
        match std::env::var("MEILI_URL")
            .ok()
            .filter(|url| !url.is_empty())
        {
            Some(url) => Meili {
                url: url.trim_end_matches('/').to_owned(),
                key: std::env::var("MEILI_MASTER_KEY")
                    .ok()
                    .filter(|key| !key.is_empty()),
                server: None,
                agent,
            },
            None => {
                let server =
                    TestServer::start(Some(TEST_KEY)).expect("start the Meilisearch test server");
                Meili {
                    url: server.url(),
                    key: Some(TEST_KEY.to_owned()),
                    server: Some(server),
                    agent,
                }
            }
        }
    }

    /// The in-process test server, when no real Meilisearch was given (for fault knobs and request logs).
    pub fn test_server(&self) -> Option<&TestServer> {
        self.server.as_ref()
    }

    /// The key the tests use (the master key), if the server has one.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    pub fn has_key(&self) -> bool {
        self.key.is_some()
    }

    /// A fresh index uid, so runs against a shared real server do not collide.
    pub fn unique_index(&self, prefix: &str) -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        format!("{prefix}_{}_{nanos}", std::process::id())
    }

    /// The task options naming this server, merged with `extra` (a JSON object).
    pub fn options(&self, extra: Value) -> String {
        let mut options = json!({ "url": self.url });
        if let Some(key) = &self.key {
            options["api_key"] = json!(key);
        }
        if let (Some(target), Some(source)) = (options.as_object_mut(), extra.as_object()) {
            for (name, value) in source {
                target.insert(name.clone(), value.clone());
            }
        }
        options.to_string().replace('\'', "''")
    }

    /// Sends a request, retrying what the test server's fault knobs (or a busy real server) may
    /// throw at the test's own requests: connection errors, 5xx and 429.
    pub fn request(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut attempt = 0;
        loop {
            match self.request_once(method.clone(), path, body.clone()) {
                Ok((status, answer)) if status < 500 && status != 429 => return (status, answer),
                outcome if attempt >= 200 => {
                    panic!("{method} {path}: giving up after {attempt} attempts: {outcome:?}")
                }
                _ => {
                    attempt += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    fn request_once(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value), String> {
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url));
        if let Some(key) = &self.key {
            builder = builder.header("Authorization", format!("Bearer {key}"));
        }
        let response = match body {
            Some(body) => self.agent.run(
                builder
                    .header("Content-Type", "application/json")
                    .body(body.to_string().into_bytes())
                    .expect("request"),
            ),
            None => self.agent.run(builder.body(()).expect("request")),
        };
        let mut response = response.map_err(|error| error.to_string())?;
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .with_config()
            .limit(1 << 30)
            .read_to_string()
            .map_err(|error| error.to_string())?;
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    }

    /// Posts an NDJSON body of documents to the index (as the extension does); the task uid.
    pub fn post_ndjson(&self, index: &str, body: Vec<u8>) -> Result<u64, String> {
        let mut builder = Request::builder()
            .method(Method::POST)
            .uri(format!(
                "{}/indexes/{index}/documents?primaryKey=id",
                self.url
            ))
            .header("Content-Type", "application/x-ndjson");
        if let Some(key) = &self.key {
            builder = builder.header("Authorization", format!("Bearer {key}"));
        }
        let request = builder.body(body).map_err(|error| error.to_string())?;
        let mut response = self.agent.run(request).map_err(|error| error.to_string())?;
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|error| error.to_string())?;
        let answer: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        answer["taskUid"]
            .as_u64()
            .ok_or_else(|| format!("no task uid in {text}"))
    }

    /// Waits until a task has finished; its final status.
    pub fn wait_task(&self, uid: u64, timeout: Duration) -> String {
        crate::wait_for("a Meilisearch task", timeout, || {
            let (_, task) = self.request(Method::GET, &format!("/tasks/{uid}"), None);
            let status = task["status"].as_str().unwrap_or_default().to_owned();
            matches!(status.as_str(), "succeeded" | "failed" | "canceled").then_some(status)
        })
    }

    /// Every document of the index, fetched page by page.
    pub fn all_documents(&self, index: &str) -> Vec<Value> {
        let mut documents = Vec::new();
        let page = 10_000;
        loop {
            let (status, answer) = self.request(
                Method::POST,
                &format!("/indexes/{index}/documents/fetch"),
                Some(json!({ "offset": documents.len(), "limit": page })),
            );
            if status == 404 {
                return documents;
            }
            assert_eq!(status, 200, "fetching documents of {index}: {answer}");
            let results = answer["results"].as_array().cloned().unwrap_or_default();
            let done = results.len() < page;
            documents.extend(results);
            if done {
                return documents;
            }
        }
    }

    /// Waits until Meilisearch has no enqueued or processing task for the index.
    pub fn wait_idle(&self, index: &str, timeout: Duration) {
        crate::wait_for("Meilisearch to finish its tasks", timeout, || {
            let (_, answer) = self.request(
                Method::GET,
                &format!("/tasks?indexUids={index}&statuses=enqueued,processing&limit=1"),
                None,
            );
            (answer["total"].as_u64() == Some(0)
                || answer["results"].as_array().is_some_and(|r| r.is_empty()))
            .then_some(())
        });
    }

    /// numberOfDocuments of the index's stats.
    pub fn document_count(&self, index: &str) -> Option<u64> {
        let (status, answer) = self.request(Method::GET, &format!("/indexes/{index}/stats"), None);
        (status == 200)
            .then(|| answer["numberOfDocuments"].as_u64())
            .flatten()
    }

    pub fn index(&self, index: &str) -> Option<Value> {
        let (status, answer) = self.request(Method::GET, &format!("/indexes/{index}"), None);
        (status == 200).then_some(answer)
    }

    pub fn delete_index(&self, index: &str) {
        let _ = self.request(Method::DELETE, &format!("/indexes/{index}"), None);
    }
}
