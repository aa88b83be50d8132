//! SQL for role leases (`LeaderStore`): one conditional upsert, atomic on any server.

use async_trait::async_trait;

use super::PgStore;
use crate::store::{LeaderStore, StoreError};

#[async_trait]
impl LeaderStore for PgStore {
    async fn lead(
        &self,
        role: &str,
        holder: &str,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<bool, StoreError> {
        let n = sqlx::query(
            "INSERT INTO leaders (role, holder, expires_ms) VALUES ($1, $2, $3)
             ON CONFLICT (role) DO UPDATE SET holder = excluded.holder, expires_ms = excluded.expires_ms
             WHERE leaders.holder = excluded.holder OR leaders.expires_ms < $4",
        )
        .bind(role)
        .bind(holder)
        .bind(now_ms + ttl_ms)
        .bind(now_ms)
        .execute(&self.control_pool)
        .await?
        .rows_affected();
        Ok(n == 1)
    }
    async fn resign(&self, role: &str, holder: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM leaders WHERE role = $1 AND holder = $2")
            .bind(role)
            .bind(holder)
            .execute(&self.control_pool)
            .await?;
        Ok(())
    }
    async fn held_roles(&self, now_ms: i64) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> =
            sqlx::query_as("SELECT role FROM leaders WHERE expires_ms >= $1")
                .bind(now_ms)
                .fetch_all(&self.control_pool)
                .await?;
        Ok(rows.into_iter().map(|(r,)| r).collect())
    }
}
