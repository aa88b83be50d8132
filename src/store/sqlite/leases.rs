//! SQL for DHCP leases: loaded at start, saved in batches (one transaction per batch).

use async_trait::async_trait;

use super::SqliteStore;
use crate::store::{LeaseRow, LeaseStore, StoreError, rows};

/// Leases written a statement: 3 parameters each, well under SQLite's 32,766. A batch's
/// size varies, so these statements are not kept prepared (`persistent(false)`): they
/// would push the hot fixed statements out of the connection's statement cache.
const LEASES_A_STATEMENT: usize = 1000;

#[async_trait]
impl LeaseStore for SqliteStore {
    async fn load_leases(&self) -> Result<Vec<LeaseRow>, StoreError> {
        let rows: Vec<(String, String, i64)> =
            sqlx::query_as("SELECT mac, ip, expires_ms FROM dhcp_leases")
                .fetch_all(&self.pool)
                .await?;
        rows::leases(rows)
    }

    /// Writes a batch of lease changes in one transaction, up to `LEASES_A_STATEMENT` in a
    /// statement (each statement is a trip to the connection's thread, made while the
    /// batch's gate is held).
    async fn save_leases(&self, keep: &[LeaseRow], gone: &[LeaseRow]) -> Result<(), StoreError> {
        if keep.is_empty() && gone.is_empty() {
            return Ok(());
        }
        let mut tx = self.write_tx().await?;
        for part in keep.chunks(LEASES_A_STATEMENT) {
            let mut upsert =
                sqlx::QueryBuilder::new("INSERT INTO dhcp_leases (mac, ip, expires_ms) ");
            upsert.push_values(part, |mut row, l| {
                row.push_bind(l.mac.to_string())
                    .push_bind(l.ip.to_string())
                    .push_bind(l.expires_ms);
            });
            // Rows go in order: a MAC given twice keeps its last lease.
            upsert.push(
                " ON CONFLICT (mac) DO UPDATE SET ip = excluded.ip, expires_ms = excluded.expires_ms",
            );
            upsert.build().persistent(false).execute(&mut *tx).await?;
        }
        for part in gone.chunks(LEASES_A_STATEMENT) {
            // Through a join on the key: `(mac, ip) IN (VALUES ...)` scans the whole table.
            let mut delete = sqlx::QueryBuilder::new(
                "DELETE FROM dhcp_leases WHERE rowid IN (SELECT l.rowid FROM (",
            );
            delete.push_values(part, |mut row, l| {
                row.push_bind(l.mac.to_string()).push_bind(l.ip.to_string());
            });
            delete.push(
                ") AS gone JOIN dhcp_leases l ON l.mac = gone.column1 AND l.ip = gone.column2)",
            );
            delete.build().persistent(false).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }
}
