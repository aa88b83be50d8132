//! SQL for DHCP leases: loaded at start, saved in batches (one transaction per batch).

use async_trait::async_trait;

use super::SqliteStore;
use crate::store::{LeaseRow, LeaseStore, StoreError, rows};

#[async_trait]
impl LeaseStore for SqliteStore {
    async fn load_leases(&self) -> Result<Vec<LeaseRow>, StoreError> {
        let rows: Vec<(String, String, i64)> =
            sqlx::query_as("SELECT mac, ip, expires_ms FROM dhcp_leases")
                .fetch_all(&self.pool)
                .await?;
        rows::leases(rows)
    }

    /// Writes a batch of lease changes in one transaction.
    async fn save_leases(&self, keep: &[LeaseRow], gone: &[LeaseRow]) -> Result<(), StoreError> {
        if keep.is_empty() && gone.is_empty() {
            return Ok(());
        }
        let mut tx = self.write_tx().await?;
        for l in keep {
            sqlx::query(
                "INSERT INTO dhcp_leases (mac, ip, expires_ms) VALUES (?, ?, ?)
                 ON CONFLICT (mac) DO UPDATE SET ip = excluded.ip, expires_ms = excluded.expires_ms",
            )
            .bind(l.mac.to_string())
            .bind(l.ip.to_string())
            .bind(l.expires_ms)
            .execute(&mut *tx)
            .await?;
        }
        for l in gone {
            sqlx::query("DELETE FROM dhcp_leases WHERE mac = ? AND ip = ?")
                .bind(l.mac.to_string())
                .bind(l.ip.to_string())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}
