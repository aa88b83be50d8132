//! SQL for removing a node (`RemovalStore`): the node row locked under its version,
//! children first (foreign keys), the row last, with the event, in one transaction.

use async_trait::async_trait;

use super::PgStore;
use crate::api::Mac;
use crate::api::event::NodeRemovedData;
use crate::clock::now_ms;
use crate::store::{RemovalStore, Removed, StoreError};

#[async_trait]
impl RemovalStore for PgStore {
    async fn remove_node(
        &self,
        mac: &Mac,
        version: i64,
        data: &NodeRemovedData,
    ) -> Result<Removed, StoreError> {
        let mut tx = self.tx().await?;
        let key = mac.to_string();
        let found: Option<(i64,)> =
            sqlx::query_as("SELECT version FROM nodes WHERE mac = $1 FOR UPDATE")
                .bind(&key)
                .fetch_optional(&mut *tx)
                .await?;
        match found {
            None => return Ok(Removed::Missing),
            Some((v,)) if v != version => return Ok(Removed::Stale),
            Some(_) => {}
        }
        for sql in [
            "DELETE FROM boot_fetches WHERE boot_id IN (SELECT id FROM boots WHERE mac = $1)",
            "DELETE FROM boots WHERE mac = $1",
            "DELETE FROM node_history WHERE mac = $1",
            "DELETE FROM reimage_requests WHERE mac = $1",
            "DELETE FROM nodes WHERE mac = $1",
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
        self.notify_events();
        Ok(Removed::Done)
    }
}
