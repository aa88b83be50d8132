//! SQL for revalidations behind a drain (`RevalidationStore`): a row per node, each change
//! with its `health.drain` event in one transaction.

use async_trait::async_trait;

use super::PgStore;
use crate::api::Mac;
use crate::api::event::{HealthDrainData, kind};
use crate::clock::now_ms;
use crate::store::{RevalidationDrain, RevalidationStore, StoreError, rows};

impl PgStore {
    /// Runs `sql`, an UPDATE that sets one time of `mac`'s row where it is unset (its
    /// bindings: the time, the MAC), with its event; false when nothing was set.
    async fn set_once(
        &self,
        sql: &'static str,
        mac: &Mac,
        now_ms: i64,
        event: &HealthDrainData,
    ) -> Result<bool, StoreError> {
        let mut tx = self.tx().await?;
        let done = sqlx::query(sql)
            .bind(now_ms)
            .bind(mac.to_string())
            .execute(&mut *tx)
            .await?;
        self.commit_with_event(tx, done.rows_affected() == 1, mac, event, now_ms)
            .await
    }

    /// Commits `tx` with its `health.drain` event when it `changed` a row; else drops
    /// it (rolled back): nothing happened, nothing to say.
    async fn commit_with_event(
        &self,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
        changed: bool,
        mac: &Mac,
        event: &HealthDrainData,
        at_ms: i64,
    ) -> Result<bool, StoreError> {
        if !changed {
            return Ok(false);
        }
        super::events::insert_event(&mut tx, kind::HEALTH_DRAIN, Some(mac), event, at_ms).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(true)
    }
}

#[async_trait]
impl RevalidationStore for PgStore {
    async fn queue_revalidation_drain(
        &self,
        mac: &Mac,
        reason: &str,
        now_ms: i64,
        event: &HealthDrainData,
    ) -> Result<bool, StoreError> {
        let mut tx = self.tx().await?;
        let done = sqlx::query(
            "INSERT INTO revalidation_drains (mac, reason, queued_at_ms) VALUES ($1, $2, $3)
             ON CONFLICT (mac) DO NOTHING",
        )
        .bind(mac.to_string())
        .bind(reason)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        self.commit_with_event(tx, done.rows_affected() == 1, mac, event, now_ms)
            .await
    }

    async fn revalidation_drains(&self) -> Result<Vec<RevalidationDrain>, StoreError> {
        let found: Vec<(String, String, i64, Option<i64>, Option<i64>)> = sqlx::query_as(
            "SELECT mac, reason, queued_at_ms, asked_at_ms, validating_at_ms
             FROM revalidation_drains ORDER BY queued_at_ms, mac",
        )
        .fetch_all(&self.pool)
        .await?;
        found
            .into_iter()
            .map(
                |(mac, reason, queued_at_ms, asked_at_ms, validating_at_ms)| {
                    Ok(RevalidationDrain {
                        mac: rows::mac(&mac)?,
                        reason,
                        queued_at_ms,
                        asked_at_ms,
                        validating_at_ms,
                    })
                },
            )
            .collect()
    }

    async fn revalidation_asked(
        &self,
        mac: &Mac,
        now_ms: i64,
        event: &HealthDrainData,
    ) -> Result<bool, StoreError> {
        let sql = "UPDATE revalidation_drains SET asked_at_ms = $1
                   WHERE mac = $2 AND asked_at_ms IS NULL";
        self.set_once(sql, mac, now_ms, event).await
    }

    async fn revalidation_validating(
        &self,
        mac: &Mac,
        now_ms: i64,
        event: &HealthDrainData,
    ) -> Result<bool, StoreError> {
        let sql = "UPDATE revalidation_drains SET validating_at_ms = $1
                   WHERE mac = $2 AND validating_at_ms IS NULL";
        self.set_once(sql, mac, now_ms, event).await
    }

    async fn end_revalidation_drain(
        &self,
        mac: &Mac,
        event: &HealthDrainData,
    ) -> Result<bool, StoreError> {
        let mut tx = self.tx().await?;
        let done = sqlx::query("DELETE FROM revalidation_drains WHERE mac = $1")
            .bind(mac.to_string())
            .execute(&mut *tx)
            .await?;
        self.commit_with_event(tx, done.rows_affected() == 1, mac, event, now_ms())
            .await
    }
}
