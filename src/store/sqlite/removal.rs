//! SQL for removing a node (`RemovalStore`): children first (foreign keys), the node row
//! last, under its version, with the event, in one write transaction.

use async_trait::async_trait;

use super::SqliteStore;
use crate::api::Mac;
use crate::api::event::NodeRemovedData;
use crate::clock::now_ms;
use crate::store::{RemovalStore, Removed, StoreError};

#[async_trait]
impl RemovalStore for SqliteStore {
    async fn remove_node(
        &self,
        mac: &Mac,
        version: i64,
        data: &NodeRemovedData,
    ) -> Result<Removed, StoreError> {
        let mut tx = self.write_tx().await?;
        let key = mac.to_string();
        let found: Option<(i64,)> = sqlx::query_as("SELECT version FROM nodes WHERE mac = ?")
            .bind(&key)
            .fetch_optional(&mut *tx)
            .await?;
        match found {
            None => return Ok(Removed::Missing),
            Some((v,)) if v != version => return Ok(Removed::Stale),
            Some(_) => {}
        }
        for sql in [
            "DELETE FROM boot_fetches WHERE boot_id IN (SELECT id FROM boots WHERE mac = ?)",
            "DELETE FROM boots WHERE mac = ?",
            "DELETE FROM node_history WHERE mac = ?",
            "DELETE FROM reimage_requests WHERE mac = ?",
            "DELETE FROM nodes WHERE mac = ?",
        ] {
            sqlx::query(sql).bind(&key).execute(&mut *tx).await?;
        }
        super::events::insert_event(
            &mut tx,
            crate::api::event::kind::NODE_REMOVED,
            Some(mac),
            data,
            now_ms(),
        )
        .await?;
        tx.commit().await?;
        self.node_cache.invalidate(mac);
        self.notify_events();
        Ok(Removed::Done)
    }
}
