//! SQL for nodes' BMCs and their power actions (`PowerStore`): each write with its event,
//! in one write transaction.

use async_trait::async_trait;

use super::SqliteStore;
use crate::api::Mac;
use crate::api::event::{BmcSetData, BmcUnregisteredData, PowerData, kind};
use crate::api::node::Bmc;
use crate::api::power::BmcRegistration;
use crate::clock::now_ms;
use crate::store::{NodeRecord, PendingReimage, PowerRow, PowerStore, StoreError, rows};

#[async_trait]
impl PowerStore for SqliteStore {
    async fn set_bmc(
        &self,
        mac: &Mac,
        bmc: Option<&Bmc>,
    ) -> Result<Option<NodeRecord>, StoreError> {
        let mut tx = self.write_tx().await?;
        let now = now_ms();
        let done = sqlx::query(
            "UPDATE nodes SET bmc = ?, version = version + 1, updated_at_ms = ? WHERE mac = ?",
        )
        .bind(bmc.map(|b| serde_json::to_string(b).expect("a BMC serialises")))
        .bind(now)
        .bind(mac.to_string())
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            tx.abandon().await?;
            return Ok(None);
        }
        let data = BmcSetData { bmc: bmc.cloned() };
        super::events::insert_event(&mut tx, kind::BMC_SET, Some(mac), &data, now).await?;
        tx.commit_touching(mac).await?;
        self.notify_events();
        self.node_after_write(mac).await
    }
    async fn record_power(&self, mac: &Mac, row: &PowerRow) -> Result<(), StoreError> {
        let mut tx = self.write_tx().await?;
        sqlx::query(
            "INSERT INTO power_actions (mac, at_ms, action, reason, outcome, took_ms) VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(mac.to_string())
        .bind(row.at_ms)
        .bind(&row.action)
        .bind(&row.reason)
        .bind(&row.outcome)
        .bind(row.took_ms)
        .execute(&mut *tx)
        .await?;
        let data = PowerData {
            action: row.action.clone(),
            reason: row.reason.clone(),
            outcome: row.outcome.clone(),
            took_ms: row.took_ms,
        };
        super::events::insert_event(&mut tx, kind::POWER, Some(mac), &data, row.at_ms).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(())
    }
    async fn power_actions(&self, mac: &Mac, limit: i64) -> Result<Vec<PowerRow>, StoreError> {
        let found: Vec<rows::PowerRowTuple> = sqlx::query_as(
            "SELECT at_ms, action, reason, outcome, took_ms FROM power_actions WHERE mac = ? ORDER BY id DESC LIMIT ?",
        )
        .bind(mac.to_string())
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(found.into_iter().map(rows::power_row).collect())
    }
    async fn pending_reimages(&self) -> Result<Vec<PendingReimage>, StoreError> {
        let found: Vec<(String, i64, Option<String>, String)> = sqlx::query_as(
            "SELECT n.mac, h.at_ms, h.from_state, n.state FROM nodes n JOIN node_history h ON h.mac = n.mac
             WHERE n.state IN ('reimaging', 'unreachable') AND h.to_state = 'reimaging'
               AND h.id = (SELECT MAX(x.id) FROM node_history x WHERE x.mac = n.mac AND x.to_state = 'reimaging')
               AND NOT EXISTS (SELECT 1 FROM node_history p WHERE p.mac = n.mac AND p.to_state = 'provisioning' AND p.id > h.id)
             ORDER BY n.mac",
        )
        .fetch_all(&self.pool)
        .await?;
        found
            .into_iter()
            .map(|(m, since_ms, from, state)| {
                Ok(PendingReimage {
                    mac: rows::mac(&m)?,
                    since_ms,
                    from: from.as_deref().map(rows::state).transpose()?,
                    state: rows::state(&state)?,
                })
            })
            .collect()
    }
    async fn register_bmc(
        &self,
        bmc: &Bmc,
        uuid: Option<&str>,
        macs: &[Mac],
    ) -> Result<BmcRegistration, StoreError> {
        let mut tx = self.write_tx().await?;
        let now = now_ms();
        let macs_json = serde_json::to_string(macs).expect("MACs serialise");
        let (id,): (i64,) = sqlx::query_as(
            "INSERT INTO bmc_registrations (bmc, uuid, macs, registered_ms) VALUES (?, ?, ?, ?) RETURNING id",
        )
        .bind(serde_json::to_string(bmc).expect("a BMC serialises"))
        .bind(uuid)
        .bind(&macs_json)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        let data = serde_json::json!({ "id": id, "bmc": bmc, "uuid": uuid, "macs": macs });
        super::events::insert_event(&mut tx, kind::BMC_REGISTERED, None, &data, now).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(BmcRegistration {
            id,
            bmc: bmc.clone(),
            uuid: uuid.map(str::to_string),
            macs: macs.to_vec(),
            registered: crate::clock::format_ms(now),
        })
    }
    async fn bmc_registrations(&self) -> Result<Vec<BmcRegistration>, StoreError> {
        let found: Vec<rows::RegistrationTuple> = sqlx::query_as(
            "SELECT id, bmc, uuid, macs, registered_ms FROM bmc_registrations ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await?;
        found.into_iter().map(rows::registration).collect()
    }
    async fn bmc_registration(&self, id: i64) -> Result<Option<BmcRegistration>, StoreError> {
        let found: Option<rows::RegistrationTuple> = sqlx::query_as(
            "SELECT id, bmc, uuid, macs, registered_ms FROM bmc_registrations WHERE id = ?",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        found.map(rows::registration).transpose()
    }
    async fn remove_bmc_registration(&self, id: i64) -> Result<bool, StoreError> {
        let mut tx = self.write_tx().await?;
        let done = sqlx::query("DELETE FROM bmc_registrations WHERE id = ?")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() == 0 {
            tx.abandon().await?;
            return Ok(false);
        }
        let data = BmcUnregisteredData { id };
        super::events::insert_event(&mut tx, kind::BMC_UNREGISTERED, None, &data, now_ms()).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(true)
    }
    async fn record_bmc_power(&self, data: &serde_json::Value) -> Result<(), StoreError> {
        let mut tx = self.write_tx().await?;
        super::events::insert_event(&mut tx, kind::BMC_POWER, None, data, now_ms()).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(())
    }
    async fn match_bmc_registration(
        &self,
        mac: &Mac,
        uuid: Option<&str>,
    ) -> Result<Option<i64>, StoreError> {
        const FIND: &str = "SELECT id, bmc, uuid FROM bmc_registrations WHERE macs LIKE ? OR (uuid IS NOT NULL AND uuid = ?) ORDER BY id LIMIT 1";
        // Asked at every new node's first sight, mostly with no registration at all: a
        // read first, so a boot storm of new MACs does not queue on the write lock.
        let seen: Option<(i64, String, Option<String>)> = sqlx::query_as(FIND)
            .bind(rows::mac_pattern(mac))
            .bind(uuid)
            .fetch_optional(&self.pool)
            .await?;
        if seen.is_none() {
            return Ok(None);
        }
        // Again inside the write, where another server may have matched it first.
        let mut tx = self.write_tx().await?;
        let found: Option<(i64, String, Option<String>)> = sqlx::query_as(FIND)
            .bind(rows::mac_pattern(mac))
            .bind(uuid)
            .fetch_optional(&mut *tx)
            .await?;
        let Some((id, bmc, found_uuid)) = found else {
            tx.abandon().await?;
            return Ok(None);
        };
        let now = now_ms();
        let given = sqlx::query(
            "UPDATE nodes SET bmc = ?, version = version + 1, updated_at_ms = ? WHERE mac = ? AND bmc IS NULL",
        )
        .bind(&bmc)
        .bind(now)
        .bind(mac.to_string())
        .execute(&mut *tx)
        .await?;
        if given.rows_affected() == 0 {
            tx.abandon().await?;
            return Ok(None);
        }
        sqlx::query("DELETE FROM bmc_registrations WHERE id = ?")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        let by = if uuid.is_some() && found_uuid.as_deref() == uuid {
            "uuid"
        } else {
            "mac"
        };
        let bmc: serde_json::Value =
            serde_json::from_str(&bmc).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let data = serde_json::json!({ "id": id, "by": by, "bmc": bmc });
        super::events::insert_event(&mut tx, kind::BMC_MATCHED, Some(mac), &data, now).await?;
        tx.commit_touching(mac).await?;
        self.node_cache.invalidate(mac);
        self.notify_events();
        Ok(Some(id))
    }
}
