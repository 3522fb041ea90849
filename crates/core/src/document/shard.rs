//! Which shard owns a document: rendezvous (highest random weight) hashing of the document id
//! over the shard names, bit for bit as Meilisearch's enterprise edition assigns documents to
//! shards, so that our pipelines and the servers' own sharding agree on every id.
//!
//! The weight of shard `name` for id `id` is XXH3-64 (seed 0, default secret) of the bytes
//! `name ++ 0xFF ++ id ++ 0xFF`: what Rust's `Hash` of the tuple `(name, id)` feeds a hasher,
//! each `str` followed by a `0xFF` terminator. The shard of highest weight owns the id; on equal
//! weights the greatest name (byte order) wins, as Meilisearch keeps its shards sorted by name and
//! takes the last maximum.

use twox_hash::XxHash3_64;

use crate::document::encode::{encode_id, DocumentShape};

/// Ends each string in the hashed bytes, as `Hasher::write_str` does by default.
const STR_END: u8 = 0xFF;

/// The rendezvous weight of shard `name` for document `id`.
fn weight(name: &str, id: &str, buffer: &mut Vec<u8>) -> u64 {
    buffer.clear();
    buffer.extend_from_slice(name.as_bytes());
    buffer.push(STR_END);
    buffer.extend_from_slice(id.as_bytes());
    buffer.push(STR_END);
    XxHash3_64::oneshot(buffer)
}

/// The index in `names` of the shard that owns document `id` (the text of the id as Meilisearch
/// sees it: a number's decimal digits, a string's content).
pub fn shard_of(id: &str, names: &[String]) -> Option<usize> {
    let mut buffer = Vec::with_capacity(id.len() + 72);
    let mut best: Option<(u64, usize)> = None;
    for (index, name) in names.iter().enumerate() {
        let candidate = weight(name, id, &mut buffer);
        let wins = match best {
            None => true,
            // Ties go to the greater name whatever the order of `names`, as in Meilisearch.
            Some((top, held)) => {
                candidate > top || (candidate == top && name.as_str() > names[held].as_str())
            }
        };
        if wins {
            best = Some((candidate, index));
        }
    }
    best.map(|(_, index)| index)
}

/// Whether a hit that shard `remote` returned for document `id` is a copy left behind by a
/// rebalance: `remote` is one of `names`, but the id now hashes to another of them (which holds
/// the document since the new list was adopted; the copy goes at the prune).
pub fn is_left_behind(id: &str, remote: &str, names: &[String]) -> bool {
    names.iter().any(|name| name == remote)
        && shard_of(id, names).is_some_and(|owner| names[owner] != remote)
}

/// The documents of one shard of a task: what this server's pipeline keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardFilter {
    names: Vec<String>,
    mine: usize,
}

impl ShardFilter {
    /// `names`: every shard of the task, `mine`: this server's. None when `mine` is not among
    /// `names`.
    pub fn new(names: Vec<String>, mine: &str) -> Option<ShardFilter> {
        let mine = names.iter().position(|name| name == mine)?;
        Some(ShardFilter { names, mine })
    }

    pub fn mine(&self) -> &str {
        &self.names[self.mine]
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Whether the id text is this shard's.
    pub fn keeps_id(&self, id: &str) -> bool {
        shard_of(id, &self.names) == Some(self.mine)
    }

    /// Whether a JSON-encoded id (a JSON string like `"ab-1"` or a JSON integer like `42`, as the
    /// encoder writes ids) is this shard's. Meilisearch hashes a string id's content and a
    /// number's digits, so the quotes go. Bytes that are no id at all are kept: dropping a
    /// document silently would be worse than one the server may refuse.
    pub fn keeps_encoded(&self, encoded_id: &[u8]) -> bool {
        match id_text(encoded_id) {
            Some(id) => self.keeps_id(&id),
            None => true,
        }
    }

    /// Whether a row (the text of its columns, as a copy reads them) is this shard's. A row whose
    /// key makes no document id is the first shard's: it becomes a dead letter there, once.
    pub fn keeps_row(&self, shape: &DocumentShape, row: &[Option<String>]) -> bool {
        let key = shape.key_of_row(row);
        let key: Vec<&str> = key.iter().map(String::as_str).collect();
        match encode_id(shape, &key) {
            Ok(id) => self.keeps_id(id.as_str()),
            Err(_) => self.mine == 0,
        }
    }
}

/// The text Meilisearch hashes for a JSON-encoded id, or None when the bytes are not one.
fn id_text(encoded_id: &[u8]) -> Option<std::borrow::Cow<'_, str>> {
    let text = std::str::from_utf8(encoded_id).ok()?;
    match text
        .strip_prefix('"')
        .and_then(|rest| rest.strip_suffix('"'))
    {
        // Ids hold only [A-Za-z0-9_-]: without a backslash the content is the id.
        Some(inner) if !inner.contains('\\') => Some(inner.into()),
        Some(_) => serde_json::from_str::<String>(text).ok().map(Into::into),
        None => Some(text.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::hash::{BuildHasher, BuildHasherDefault};

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|name| (*name).to_owned()).collect()
    }

    /// Meilisearch computes the weight as `BuildHasherDefault::<XxHash3_64>::hash_one((name, id))`
    /// (crates/milli/src/sharding/enterprise_edition.rs); our byte layout must give the same.
    fn meilisearch_weight(name: &str, id: &str) -> u64 {
        BuildHasherDefault::<twox_hash::XxHash3_64>::default().hash_one((name, id))
    }

    #[test]
    fn a_copy_is_left_behind_on_an_old_shard_only() {
        let before = names(&["a", "b"]);
        let after = names(&["a", "b", "c"]);
        let mut moved = 0;
        for number in 0..300 {
            let id = number.to_string();
            let old_owner = &before[shard_of(&id, &before).unwrap()];
            let new_owner = &after[shard_of(&id, &after).unwrap()];
            assert!(!is_left_behind(&id, new_owner, &after));
            assert_eq!(
                is_left_behind(&id, old_owner, &after),
                old_owner != new_owner
            );
            moved += usize::from(old_owner != new_owner);
            assert!(
                !is_left_behind(&id, "elsewhere", &after),
                "a remote that is not a shard"
            );
        }
        assert!((60..=140).contains(&moved), "{moved} of 300 moved");
    }

    #[test]
    fn weights_match_hashing_the_name_and_id_tuple() {
        let mut buffer = Vec::new();
        for name in ["ms-0", "ms-1", "shard_a", "x"] {
            for id in [
                "",
                "0",
                "42",
                "ab-1",
                "Z_z-9",
                "a-much-longer-document-id-0123456789",
            ] {
                assert_eq!(
                    weight(name, id, &mut buffer),
                    meilisearch_weight(name, id),
                    "{name} {id}"
                );
            }
        }
        // The terminators matter: ("ab", "c") and ("a", "bc") must not weigh alike.
        assert_ne!(
            weight("ab", "c", &mut buffer),
            weight("a", "bc", &mut buffer)
        );
    }

    #[test]
    fn the_owner_is_the_highest_weight_like_meilisearch() {
        let shards = names(&["ms-0", "ms-1", "ms-2"]);
        for n in 0..2000 {
            let id = format!("doc-{n}");
            // Meilisearch: shards sorted by name, max_by_key over the weights (last max wins).
            let expected = shards
                .iter()
                .enumerate()
                .max_by_key(|(_, name)| meilisearch_weight(name, &id))
                .map(|(index, _)| index);
            assert_eq!(shard_of(&id, &shards), expected, "{id}");
        }
    }

    #[test]
    fn pinned_assignments_do_not_change() {
        // Regression vectors computed with the algorithm above; a change in them means the
        // assignment no longer matches the servers'.
        let shards = names(&["ms-0", "ms-1", "ms-2"]);
        let owners: Vec<usize> = ["1", "2", "3", "42", "abc", "ab-1", "product_7"]
            .iter()
            .map(|id| shard_of(id, &shards).expect("a shard"))
            .collect();
        assert_eq!(owners, PINNED_OWNERS);
    }

    const PINNED_OWNERS: [usize; 7] = [1, 0, 0, 2, 1, 1, 0];

    #[test]
    fn the_hash_is_xxh3_64_with_seed_0() {
        // XXH3-64 of no bytes, seed 0: the reference implementation's published value.
        assert_eq!(XxHash3_64::oneshot(b""), 0x2D06_8005_38D3_94C2);
    }

    #[test]
    fn no_names_no_shard_and_one_name_owns_all() {
        assert_eq!(shard_of("1", &[]), None);
        let one = names(&["only"]);
        assert!((0..100).all(|n| shard_of(&n.to_string(), &one) == Some(0)));
    }

    #[test]
    fn the_order_of_names_does_not_change_the_owner() {
        let forward = names(&["a", "b", "c"]);
        let backward = names(&["c", "b", "a"]);
        for n in 0..1000 {
            let id = n.to_string();
            let owner = &forward[shard_of(&id, &forward).expect("a shard")];
            assert_eq!(owner, &backward[shard_of(&id, &backward).expect("a shard")]);
        }
    }

    #[test]
    fn three_shards_share_ids_about_evenly() {
        let shards = names(&["ms-0", "ms-1", "ms-2"]);
        let mut counts = [0usize; 3];
        let total = 30_000;
        for n in 0..total {
            counts[shard_of(&format!("id-{n}"), &shards).expect("a shard")] += 1;
        }
        for count in counts {
            let share = count as f64 / total as f64;
            assert!((0.25..=0.42).contains(&share), "{counts:?}");
        }
    }

    #[test]
    fn a_new_shard_only_takes_ids_from_the_old_ones() {
        let old = names(&["ms-0", "ms-1", "ms-2"]);
        let new = names(&["ms-0", "ms-1", "ms-2", "ms-3"]);
        let mut moved = 0;
        for n in 0..10_000 {
            let id = n.to_string();
            let before = shard_of(&id, &old).expect("a shard");
            let after = shard_of(&id, &new).expect("a shard");
            if after != before {
                assert_eq!(after, 3, "{id} moved between two old shards");
                moved += 1;
            }
        }
        assert!((1500..3500).contains(&moved), "{moved}");
    }

    #[test]
    fn filter_needs_its_own_name_among_the_shards() {
        assert!(ShardFilter::new(names(&["a", "b"]), "c").is_none());
        let filter = ShardFilter::new(names(&["a", "b"]), "b").expect("b is a shard");
        assert_eq!(filter.mine(), "b");
        assert_eq!(filter.names(), names(&["a", "b"]).as_slice());
    }

    #[test]
    fn the_shards_filters_split_every_id_once() {
        let all = names(&["ms-0", "ms-1", "ms-2"]);
        let filters: Vec<ShardFilter> = all
            .iter()
            .map(|mine| ShardFilter::new(all.clone(), mine).expect("a shard"))
            .collect();
        for n in 0..3000 {
            let id = format!("\"k-{n}\"");
            let keepers = filters
                .iter()
                .filter(|filter| filter.keeps_encoded(id.as_bytes()))
                .count();
            assert_eq!(keepers, 1, "{id}");
        }
    }

    #[test]
    fn encoded_ids_agree_with_their_text() {
        let all = names(&["ms-0", "ms-1", "ms-2", "ms-3"]);
        let filters: Vec<ShardFilter> = all
            .iter()
            .map(|mine| ShardFilter::new(all.clone(), mine).expect("a shard"))
            .collect();
        let kept = |encoded: &[u8]| -> HashSet<&str> {
            filters
                .iter()
                .filter(|filter| filter.keeps_encoded(encoded))
                .map(ShardFilter::mine)
                .collect()
        };
        let by_text = |id: &str| -> HashSet<&str> {
            filters
                .iter()
                .filter(|filter| filter.keeps_id(id))
                .map(ShardFilter::mine)
                .collect()
        };
        assert_eq!(kept(b"\"abc\""), by_text("abc"));
        assert_eq!(kept(b"42"), by_text("42"));
        assert_eq!(kept(b"42"), kept(b"\"42\""));
        // An escaped string is decoded before hashing.
        assert_eq!(kept(b"\"a\\u0062c\""), by_text("abc"));
        for n in 0..200 {
            assert_eq!(kept(n.to_string().as_bytes()), by_text(&n.to_string()));
        }
    }

    #[test]
    fn bytes_that_are_no_id_are_kept() {
        let filter = ShardFilter::new(names(&["a", "b"]), "a").expect("a shard");
        let other = ShardFilter::new(names(&["a", "b"]), "b").expect("a shard");
        for junk in [&b"\xff\xfe"[..], b"\"bad\\q\""] {
            assert!(filter.keeps_encoded(junk) && other.keeps_encoded(junk));
        }
    }
}
