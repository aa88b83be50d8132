//! SQL for role leases (`LeaderStore`): one conditional upsert.

use async_trait::async_trait;

use super::SqliteStore;
use crate::store::{LeaderStore, StoreError};

#[async_trait]
impl LeaderStore for SqliteStore {
    async fn lead(
        &self,
        role: &str,
        holder: &str,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<bool, StoreError> {
        let mut tx = self.write_tx().await?;
        let n = sqlx::query(
            "INSERT INTO leaders (role, holder, expires_ms) VALUES (?1, ?2, ?3)
             ON CONFLICT (role) DO UPDATE SET holder = excluded.holder, expires_ms = excluded.expires_ms
             WHERE leaders.holder = excluded.holder OR leaders.expires_ms < ?4",
        )
        .bind(role)
        .bind(holder)
        .bind(now_ms + ttl_ms)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(n == 1)
    }
    async fn resign(&self, role: &str, holder: &str) -> Result<(), StoreError> {
        let mut tx = self.write_tx().await?;
        sqlx::query("DELETE FROM leaders WHERE role = ? AND holder = ?")
            .bind(role)
            .bind(holder)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }
    async fn held_roles(&self, now_ms: i64) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> = sqlx::query_as("SELECT role FROM leaders WHERE expires_ms >= ?")
            .bind(now_ms)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.into_iter().map(|(r,)| r).collect())
    }
}
