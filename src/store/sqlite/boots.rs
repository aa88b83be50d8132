//! SQL for what happens within a boot: artifact fetches attributed to it, the attested
//! report, the validation verdict, and what the timeline and drift checks read back.

use async_trait::async_trait;

use super::SqliteStore;
use crate::api::Mac;
use crate::store::rows::{self, BootRow, select_boots};
use crate::store::{BootFacts, BootForAttest, BootStore, Fetch, StoreError};

/// Fetches written a statement: 8 parameters each, well under SQLite's 32,766. Not kept
/// prepared, like every statement whose size varies (see `nodes::HEARTBEATS_A_STATEMENT`).
const FETCHES_A_STATEMENT: usize = 256;

#[async_trait]
impl BootStore for SqliteStore {
    /// From the boot cache when kept (each node's newest boot), else read, and kept if
    /// it is its node's newest and no boot write committed meanwhile.
    async fn boot_for_attest(&self, id: &str) -> Result<Option<BootForAttest>, StoreError> {
        if let Some(boot) = self.boot_cache.get(id) {
            return Ok(Some(boot));
        }
        let epoch = self.boot_cache.epoch();
        let row: Option<rows::BootForAttestRow> = sqlx::query_as(
            "SELECT b.mac, b.image_digest, b.token_sha256, b.created_at_ms,
                    (SELECT id FROM boots WHERE mac = b.mac ORDER BY rowid DESC LIMIT 1),
                    b.attested_at_ms, b.attest_passed
             FROM boots b WHERE b.id = ?",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|row| rows::boot_for_attest(id, row))
            .transpose()
            .inspect(|boot| {
                if let Some(boot) = boot {
                    self.boot_cache.fill(epoch, id, boot);
                }
            })
    }
    /// Records `fetches` in one transaction, and in one statement for up to `FETCHES_A_STATEMENT` of them (each a
    /// trip to the connection's thread): fetches for boots that do not exist are skipped
    /// (a made-up boot id writes nothing); returns how many were recorded.
    async fn record_fetches(&self, fetches: &[(String, Fetch)]) -> Result<usize, StoreError> {
        if fetches.is_empty() {
            return Ok(0);
        }
        let mut tx = self.write_tx().await?;
        let mut recorded = 0;
        for (chunk, part) in fetches.chunks(FETCHES_A_STATEMENT).enumerate() {
            // In the order given (ids order a boot's fetches): column8 is each one's place.
            let mut insert = sqlx::QueryBuilder::new(
                "INSERT INTO boot_fetches (boot_id, digest, started_at_ms, finished_at_ms, offset_bytes, bytes, whole)
                 SELECT column1, column2, column3, column4, column5, column6, column7 FROM (",
            );
            insert.push_values(part.iter().enumerate(), |mut row, (i, (boot_id, fetch))| {
                row.push_bind(boot_id)
                    .push_bind(fetch.digest.to_string())
                    .push_bind(fetch.started_at_ms)
                    .push_bind(fetch.finished_at_ms)
                    .push_bind(fetch.offset as i64)
                    .push_bind(fetch.bytes as i64)
                    .push_bind(fetch.whole)
                    .push_bind((chunk * FETCHES_A_STATEMENT + i) as i64);
            });
            insert.push(") WHERE EXISTS (SELECT 1 FROM boots WHERE id = column1) ORDER BY column8");
            recorded += insert
                .build()
                .persistent(false)
                .execute(&mut *tx)
                .await?
                .rows_affected() as usize;
        }
        tx.commit().await?;
        Ok(recorded)
    }
    async fn fetches(&self, boot_id: &str) -> Result<Vec<Fetch>, StoreError> {
        let rows: Vec<rows::FetchRow> = sqlx::query_as(
            "SELECT digest, started_at_ms, finished_at_ms, offset_bytes, bytes, whole FROM boot_fetches WHERE boot_id = ? ORDER BY id",
        )
        .bind(boot_id)
        .fetch_all(&self.pool)
        .await?;
        rows::fetches(rows)
    }
    /// The node's last `limit` boots, newest first, with their fetches.
    async fn boot_facts(&self, mac: &Mac, limit: i64) -> Result<Vec<BootFacts>, StoreError> {
        let rows: Vec<BootRow> =
            sqlx::query_as(select_boots!("WHERE mac = ? ORDER BY rowid DESC LIMIT ?"))
                .bind(mac.to_string())
                .bind(limit)
                .fetch_all(&self.pool)
                .await?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            out.push(self.facts_from_row(row).await?);
        }
        Ok(out)
    }
    /// One boot's facts, by id.
    async fn boot_by_id(&self, id: &str) -> Result<Option<BootFacts>, StoreError> {
        let row: Option<BootRow> = sqlx::query_as(select_boots!("WHERE id = ?"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        match row {
            Some(row) => Ok(Some(self.facts_from_row(row).await?)),
            None => Ok(None),
        }
    }
    /// How many times the node failed validation since it was last ready (or ever).
    async fn validation_failures_since_ready(&self, mac: &Mac) -> Result<u32, StoreError> {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM node_history WHERE mac = ? AND to_state = 'validation-failed'
             AND id > COALESCE((SELECT MAX(id) FROM node_history WHERE mac = ? AND to_state = 'ready'), 0)",
        )
        .bind(mac.to_string())
        .bind(mac.to_string())
        .fetch_one(&self.pool)
        .await?;
        Ok(n.max(0) as u32)
    }
}
impl SqliteStore {
    async fn facts_from_row(&self, row: BootRow) -> Result<BootFacts, StoreError> {
        let fetches = self.fetches(&row.0).await?;
        rows::boot(row, fetches)
    }
}
