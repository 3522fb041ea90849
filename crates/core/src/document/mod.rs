//! Rows → Meilisearch documents: every column's Postgres text output becomes a JSON field, the
//! key becomes the document id, PostGIS and pgvector columns become Meilisearch's geo and vector
//! fields, and the id decides which shard owns the document.
//!
//! - `encode`: Postgres values → JSON documents and document ids.
//! - `geo`: PostGIS values → `_geo` / `_geojson`.
//! - `vectors`: pgvector columns → `_vectors`.
//! - `shard`: which shard owns a document id, as Meilisearch's own sharding decides.

pub mod encode;
pub mod geo;
pub mod shard;
pub mod vectors;
