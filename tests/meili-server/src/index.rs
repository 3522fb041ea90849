//! One index: documents kept as compact JSON in internal-id order (the order the real
//! server lists them in), plus settings and the per-field counts behind `fieldDistribution`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::SystemTime;

use serde_json::{Map, Value};

use crate::docs::Doc;
use crate::json::Obj;
use crate::settings;
use crate::time::rfc3339;

pub(crate) struct StoredDoc {
    pub(crate) json: Box<str>,
    fields: Box<[u32]>,
}

impl StoredDoc {
    pub(crate) fn parse(&self) -> Doc {
        serde_json::from_str(&self.json).unwrap_or_default()
    }
}

pub(crate) struct Index {
    pub(crate) uid: String,
    pub(crate) primary_key: Option<String>,
    pub(crate) created_at: SystemTime,
    pub(crate) updated_at: SystemTime,
    pub(crate) settings: Map<String, Value>,
    field_names: Vec<String>,
    field_ids: HashMap<String, u32>,
    field_counts: Vec<u64>,
    /// Field ids of the last stored document: consecutive documents usually share their keys.
    last_fields: Box<[u32]>,
    /// External (normalized) id to internal id.
    ids: HashMap<String, u32>,
    docs: BTreeMap<u32, StoredDoc>,
    /// Internal ids freed by deletions; the smallest is reused first, as Meilisearch does.
    free: BTreeSet<u32>,
    next_internal: u32,
    raw_size: u64,
}

impl Index {
    pub(crate) fn new(uid: &str, primary_key: Option<String>, now: SystemTime) -> Self {
        Index {
            uid: uid.to_string(),
            primary_key,
            created_at: now,
            updated_at: now,
            settings: settings::defaults(),
            field_names: Vec::new(),
            field_ids: HashMap::new(),
            field_counts: Vec::new(),
            last_fields: Box::new([]),
            ids: HashMap::new(),
            docs: BTreeMap::new(),
            free: BTreeSet::new(),
            next_internal: 0,
            raw_size: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.docs.len()
    }

    pub(crate) fn get(&self, id: &str) -> Option<&StoredDoc> {
        self.ids.get(id).and_then(|i| self.docs.get(i))
    }

    /// Internal id of an external id, for ordering fetched documents.
    pub(crate) fn internal_id(&self, id: &str) -> Option<u32> {
        self.ids.get(id).copied()
    }

    pub(crate) fn by_internal(&self, internal: u32) -> Option<&StoredDoc> {
        self.docs.get(&internal)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &StoredDoc> {
        self.docs.values()
    }

    fn field_id(&mut self, name: &str) -> u32 {
        if let Some(id) = self.field_ids.get(name) {
            return *id;
        }
        let id = self.field_names.len() as u32;
        self.field_names.push(name.to_string());
        self.field_ids.insert(name.to_string(), id);
        self.field_counts.push(0);
        id
    }

    /// Inserts or replaces a document; `json` is its stored text.
    pub(crate) fn put(&mut self, id: String, json: Box<str>, doc: &Doc) {
        let same_keys = doc.len() == self.last_fields.len()
            && doc
                .keys()
                .zip(self.last_fields.iter())
                .all(|(k, f)| *k == self.field_names[*f as usize]);
        if !same_keys {
            self.last_fields = doc.keys().map(|k| self.field_id(k)).collect();
        }
        let fields = self.last_fields.clone();
        for f in fields.iter() {
            self.field_counts[*f as usize] += 1;
        }
        self.raw_size += json.len() as u64;
        let stored = StoredDoc { json, fields };
        match self.ids.get(&id) {
            Some(internal) => {
                if let Some(old) = self.docs.insert(*internal, stored) {
                    self.forget(&old);
                }
            }
            None => {
                let internal = self.free.pop_first().unwrap_or_else(|| {
                    self.next_internal += 1;
                    self.next_internal - 1
                });
                self.ids.insert(id, internal);
                self.docs.insert(internal, stored);
            }
        }
    }

    fn forget(&mut self, old: &StoredDoc) {
        for f in old.fields.iter() {
            self.field_counts[*f as usize] -= 1;
        }
        self.raw_size -= old.json.len() as u64;
    }

    pub(crate) fn delete(&mut self, id: &str) -> bool {
        let Some(internal) = self.ids.remove(id) else {
            return false;
        };
        if let Some(old) = self.docs.remove(&internal) {
            self.forget(&old);
        }
        self.free.insert(internal);
        true
    }

    pub(crate) fn clear(&mut self) -> u64 {
        let n = self.docs.len() as u64;
        self.ids.clear();
        self.docs.clear();
        self.free.clear();
        self.next_internal = 0;
        self.field_counts.iter_mut().for_each(|c| *c = 0);
        self.raw_size = 0;
        n
    }

    /// The public view of `GET /indexes/{uid}`.
    pub(crate) fn to_json(&self) -> String {
        Obj::new()
            .str("uid", &self.uid)
            .str("createdAt", &rfc3339(self.created_at))
            .str("updatedAt", &rfc3339(self.updated_at))
            .opt_str("primaryKey", self.primary_key.as_deref())
            .end()
    }

    /// Size on "disk": LMDB pages, so a multiple of 4 KiB.
    pub(crate) fn raw_document_db_size(&self) -> u64 {
        self.raw_size.div_ceil(4096) * 4096
    }

    pub(crate) fn stats_json(&self, is_indexing: bool) -> String {
        let n = self.docs.len() as u64;
        let avg = self.raw_size.checked_div(n).unwrap_or(0);
        let mut distribution: Vec<(&String, u64)> = self
            .field_names
            .iter()
            .zip(self.field_counts.iter().copied())
            .filter(|(_, c)| *c > 0)
            .collect();
        distribution.sort();
        let distribution = distribution
            .into_iter()
            .fold(Obj::new(), |o, (k, c)| o.num(k, c))
            .end();
        Obj::new()
            .num("numberOfDocuments", n)
            .num("rawDocumentDbSize", self.raw_document_db_size())
            .num("avgDocumentSize", avg)
            .raw("isIndexing", if is_indexing { "true" } else { "false" })
            .num("numberOfEmbeddings", 0u64)
            .num("numberOfEmbeddedDocuments", 0u64)
            .raw("fieldDistribution", &distribution)
            .end()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::docs::Prepared;

    fn put(idx: &mut Index, id: &str, v: Value) {
        let p = Prepared::new(match v {
            Value::Object(m) => m,
            _ => Doc::new(),
        });
        idx.put(id.into(), p.json, &p.doc);
    }

    #[test]
    fn replace_keeps_position_and_deleted_slots_are_reused() {
        let mut idx = Index::new("t", Some("id".into()), SystemTime::now());
        for i in 0..3 {
            put(&mut idx, &i.to_string(), json!({"id": i, "a": 1}));
        }
        put(&mut idx, "0", json!({"id": "0", "b": 1}));
        let order: Vec<String> = idx.iter().map(|d| d.parse()["id"].to_string()).collect();
        assert_eq!(order, ["\"0\"", "1", "2"]);
        assert!(idx.delete("1"));
        put(&mut idx, "9", json!({"id": 9}));
        let order: Vec<String> = idx.iter().map(|d| d.parse()["id"].to_string()).collect();
        assert_eq!(order, ["\"0\"", "9", "2"]);
        let stats: Value = serde_json::from_str(&idx.stats_json(false)).unwrap_or_default();
        assert_eq!(stats["fieldDistribution"], json!({"a": 1, "b": 1, "id": 3}));
    }
}
