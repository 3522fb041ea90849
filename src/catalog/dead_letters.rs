//! Dead letters: documents Meilisearch refused, stored before the slot or the copy moves past
//! them, listed and deleted by the dead-letter functions.

use pgrx::prelude::*;

use pg_meili_sync_core::pipeline::dispatch::DeadLetter;

use super::{as_catalog_owner, format_lsn, CatalogResult};

/// Stores documents Meilisearch refused; a document already there is updated (attempts + 1).
/// During streaming the checkpoint is the commit LSN of the change.
pub fn insert_dead_letters(
    task_id: i64,
    dead_letters: &[DeadLetter],
    streaming: bool,
) -> CatalogResult<()> {
    Spi::connect_mut(|client| {
        for dead in dead_letters {
            let id = match &dead.id {
                serde_json::Value::String(text) => Some(text.clone()),
                serde_json::Value::Null => None,
                other => Some(other.to_string()),
            };
            let lsn = dead.checkpoint.filter(|_| streaming).map(format_lsn);
            client.update(
                "INSERT INTO meili_sync.dead_letters
                     (task_id, document_id, operation, document, error_code, error_message, meili_task_uid, lsn)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8::pg_lsn)
                 ON CONFLICT (task_id, document_id) DO UPDATE
                    SET operation = EXCLUDED.operation, document = EXCLUDED.document,
                        error_code = EXCLUDED.error_code, error_message = EXCLUDED.error_message,
                        meili_task_uid = EXCLUDED.meili_task_uid, lsn = EXCLUDED.lsn,
                        last_seen = pg_catalog.now(), attempts = meili_sync.dead_letters.attempts + 1",
                None,
                &[
                    task_id.into(),
                    id.into(),
                    dead.op.name().into(),
                    String::from_utf8_lossy(&dead.document).into_owned().into(),
                    dead.code.as_str().into(),
                    dead.message.as_str().into(),
                    dead.task_uid.and_then(|uid| i64::try_from(uid).ok()).into(),
                    lsn.into(),
                ],
            )?;
        }
        Ok(())
    })
}

/// Document ids of a task's dead letters (all, or those in `only`).
pub fn dead_letter_ids(task_id: i64, only: Option<&[String]>) -> CatalogResult<Vec<String>> {
    Spi::connect(|client| {
        let rows = client.select(
            "SELECT document_id FROM meili_sync.dead_letters
              WHERE task_id OPERATOR(pg_catalog.=) $1 AND document_id IS NOT NULL AND ($2::text[] IS NULL OR document_id OPERATOR(pg_catalog.=) ANY ($2))
              ORDER BY id",
            None,
            &[task_id.into(), only.map(<[String]>::to_vec).into()],
        )?;
        let mut ids = Vec::new();
        for row in rows {
            if let Some(id) = row.get::<String>(1)? {
                ids.push(id);
            }
        }
        Ok(ids)
    })
}

pub fn delete_dead_letters(task_id: i64, only: Option<&[String]>) -> CatalogResult<i64> {
    as_catalog_owner(|| {
        Spi::connect_mut(|client| {
            let table = client.update(
            "WITH gone AS (DELETE FROM meili_sync.dead_letters
                            WHERE task_id OPERATOR(pg_catalog.=) $1 AND ($2::text[] IS NULL OR document_id OPERATOR(pg_catalog.=) ANY ($2)) RETURNING 1)
             SELECT pg_catalog.count(*) FROM gone",
            None,
            &[task_id.into(), only.map(<[String]>::to_vec).into()],
        )?;
            Ok(table.first().get_one::<i64>()?.unwrap_or(0))
        })
    })
}
