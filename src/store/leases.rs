//! SQL for DHCP leases: loaded at start, saved in batches (one transaction per batch).

use std::net::Ipv4Addr;

use super::{Store, StoreError};
use crate::api::Mac;
use crate::dhcp::leases::{HwAddr, Lease};

impl Store {
    pub async fn load_leases(&self) -> Result<Vec<Lease>, StoreError> {
        let rows: Vec<(String, String, i64)> =
            sqlx::query_as("SELECT mac, ip, expires_ms FROM dhcp_leases")
                .fetch_all(&self.pool)
                .await?;
        rows.into_iter()
            .map(|(mac, ip, expires)| {
                let mac: Mac = mac
                    .parse()
                    .map_err(|e: crate::api::MacError| StoreError::Corrupt(e.to_string()))?;
                let ip: Ipv4Addr = ip
                    .parse()
                    .map_err(|_| StoreError::Corrupt(format!("lease address {ip:?}")))?;
                Ok(Lease {
                    mac: mac.octets(),
                    ip,
                    expires_ms: expires,
                    bound: true,
                })
            })
            .collect()
    }

    /// Writes a batch of lease changes in one transaction.
    pub async fn save_leases(&self, keep: &[Lease], gone: &[HwAddr]) -> Result<(), StoreError> {
        if keep.is_empty() && gone.is_empty() {
            return Ok(());
        }
        let mut tx = self.write_tx().await?;
        for l in keep {
            sqlx::query(
                "INSERT INTO dhcp_leases (mac, ip, expires_ms) VALUES (?, ?, ?)
                 ON CONFLICT (mac) DO UPDATE SET ip = excluded.ip, expires_ms = excluded.expires_ms",
            )
            .bind(Mac::from(l.mac).to_string())
            .bind(l.ip.to_string())
            .bind(l.expires_ms)
            .execute(&mut *tx)
            .await?;
        }
        for mac in gone {
            sqlx::query("DELETE FROM dhcp_leases WHERE mac = ?")
                .bind(Mac::from(*mac).to_string())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}
