//! SQL for what happens within a boot: artifact fetches attributed to it, the attested
//! report, the validation verdict, and what the timeline and drift checks read back.

use async_trait::async_trait;

use super::PgStore;
use crate::api::Mac;
use crate::store::rows::{self, BootRow, select_boots};
use crate::store::{BootFacts, BootForAttest, BootStore, Fetch, StoreError};

#[async_trait]
impl BootStore for PgStore {
    async fn boot_for_attest(&self, id: &str) -> Result<Option<BootForAttest>, StoreError> {
        let row: Option<rows::BootForAttestRow> = sqlx::query_as(
            "SELECT b.mac, b.image_digest, b.token_sha256, b.created_at_ms,
                    (SELECT id FROM boots WHERE mac = b.mac ORDER BY seq DESC LIMIT 1),
                    b.attested_at_ms, b.attest_passed
             FROM boots b WHERE b.id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|row| rows::boot_for_attest(id, row)).transpose()
    }
    /// Records `fetches` in one statement: fetches for boots that do not exist are
    /// skipped (a made-up boot id writes nothing); returns how many were recorded.
    async fn record_fetches(&self, fetches: &[(String, Fetch)]) -> Result<usize, StoreError> {
        if fetches.is_empty() {
            return Ok(0);
        }
        let recorded = sqlx::query(
            "INSERT INTO boot_fetches (boot_id, digest, started_at_ms, finished_at_ms, offset_bytes, bytes, whole)
             SELECT f.* FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[], $7::boolean[])
                 AS f(boot_id, digest, started_at_ms, finished_at_ms, offset_bytes, bytes, whole)
             WHERE EXISTS (SELECT 1 FROM boots WHERE id = f.boot_id)",
        )
        .bind(fetches.iter().map(|(b, _)| b.clone()).collect::<Vec<_>>())
        .bind(fetches.iter().map(|(_, f)| f.digest.to_string()).collect::<Vec<_>>())
        .bind(fetches.iter().map(|(_, f)| f.started_at_ms).collect::<Vec<_>>())
        .bind(fetches.iter().map(|(_, f)| f.finished_at_ms).collect::<Vec<_>>())
        .bind(fetches.iter().map(|(_, f)| f.offset as i64).collect::<Vec<_>>())
        .bind(fetches.iter().map(|(_, f)| f.bytes as i64).collect::<Vec<_>>())
        .bind(fetches.iter().map(|(_, f)| f.whole).collect::<Vec<_>>())
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(recorded as usize)
    }
    async fn fetches(&self, boot_id: &str) -> Result<Vec<Fetch>, StoreError> {
        let rows: Vec<rows::FetchRow> = sqlx::query_as(
            "SELECT digest, started_at_ms, finished_at_ms, offset_bytes, bytes, whole FROM boot_fetches WHERE boot_id = $1 ORDER BY id",
        )
        .bind(boot_id)
        .fetch_all(&self.pool)
        .await?;
        rows::fetches(rows)
    }
    async fn boot_facts(&self, mac: &Mac, limit: i64) -> Result<Vec<BootFacts>, StoreError> {
        let rows: Vec<BootRow> =
            sqlx::query_as(select_boots!("WHERE mac = $1 ORDER BY seq DESC LIMIT $2"))
                .bind(mac.to_string())
                .bind(limit)
                .fetch_all(&self.pool)
                .await?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let fetches = self.fetches(&row.0).await?;
            out.push(rows::boot(row, fetches)?);
        }
        Ok(out)
    }
    async fn boot_by_id(&self, id: &str) -> Result<Option<BootFacts>, StoreError> {
        let row: Option<BootRow> = sqlx::query_as(select_boots!("WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        match row {
            Some(row) => {
                let fetches = self.fetches(&row.0).await?;
                Ok(Some(rows::boot(row, fetches)?))
            }
            None => Ok(None),
        }
    }
    async fn validation_failures_since_ready(&self, mac: &Mac) -> Result<u32, StoreError> {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM node_history WHERE mac = $1 AND to_state = 'validation-failed'
             AND id > COALESCE((SELECT MAX(id) FROM node_history WHERE mac = $1 AND to_state = 'ready'), 0)",
        )
        .bind(mac.to_string())
        .fetch_one(&self.pool)
        .await?;
        Ok(n.max(0) as u32)
    }
}
