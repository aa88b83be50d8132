//! SQL for DHCP leases: loaded at start, saved in batches (one transaction per batch).

use async_trait::async_trait;

use super::PgStore;
use crate::store::{LeaseRow, LeaseStore, StoreError, rows};

#[async_trait]
impl LeaseStore for PgStore {
    async fn load_leases(&self) -> Result<Vec<LeaseRow>, StoreError> {
        let rows: Vec<(String, String, i64)> =
            sqlx::query_as("SELECT mac, ip, expires_ms FROM dhcp_leases")
                .fetch_all(&self.pool)
                .await?;
        rows::leases(rows)
    }

    /// Writes a batch of lease changes in one transaction, one statement per kind.
    async fn save_leases(&self, keep: &[LeaseRow], gone: &[LeaseRow]) -> Result<(), StoreError> {
        if keep.is_empty() && gone.is_empty() {
            return Ok(());
        }
        let mut tx = self.tx().await?;
        if !keep.is_empty() {
            sqlx::query(
                // A MAC given twice keeps its last lease (an upsert may not touch a row twice).
                "INSERT INTO dhcp_leases (mac, ip, expires_ms)
                 SELECT DISTINCT ON (mac) mac, ip, expires_ms
                 FROM UNNEST($1::text[], $2::text[], $3::bigint[]) WITH ORDINALITY AS u(mac, ip, expires_ms, n)
                 ORDER BY mac, n DESC
                 ON CONFLICT (mac) DO UPDATE SET ip = excluded.ip, expires_ms = excluded.expires_ms",
            )
            .bind(keep.iter().map(|l| l.mac.to_string()).collect::<Vec<_>>())
            .bind(keep.iter().map(|l| l.ip.to_string()).collect::<Vec<_>>())
            .bind(keep.iter().map(|l| l.expires_ms).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
        }
        if !gone.is_empty() {
            sqlx::query(
                "DELETE FROM dhcp_leases USING UNNEST($1::text[], $2::text[]) AS g(mac, ip)
                 WHERE dhcp_leases.mac = g.mac AND dhcp_leases.ip = g.ip",
            )
            .bind(gone.iter().map(|l| l.mac.to_string()).collect::<Vec<_>>())
            .bind(gone.iter().map(|l| l.ip.to_string()).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}
