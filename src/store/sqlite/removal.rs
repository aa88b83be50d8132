//! SQL for removing a node (`RemovalStore`): children first (foreign keys), the node row
//! last, under its version, with the event, in one write transaction.

use async_trait::async_trait;

use super::SqliteStore;
use crate::api::Digest;
use crate::api::Mac;
use crate::api::event::{ImageEventData, NodeRemovedData, kind};
use crate::clock::now_ms;
use crate::store::{ImageUsers, RemovalStore, Removed, StoreError};

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
            None => {
                tx.abandon().await?;
                return Ok(Removed::Missing);
            }
            Some((v,)) if v != version => {
                tx.abandon().await?;
                return Ok(Removed::Stale);
            }
            Some(_) => {}
        }
        for sql in [
            "DELETE FROM boot_fetches WHERE boot_id IN (SELECT id FROM boots WHERE mac = ?)",
            "DELETE FROM boots WHERE mac = ?",
            "DELETE FROM node_history WHERE mac = ?",
            "DELETE FROM reimage_requests WHERE mac = ?",
            "DELETE FROM power_actions WHERE mac = ?",
            "DELETE FROM revalidation_drains WHERE mac = ?",
            "DELETE FROM tpm_enrolments WHERE mac = ?",
            "DELETE FROM tpm_challenges WHERE mac = ?",
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
        tx.commit_touching(mac).await?;
        self.node_cache.invalidate(mac);
        self.notify_events();
        Ok(Removed::Done)
    }
    async fn image_users(
        &self,
        digest: &Digest,
        name_version: &str,
    ) -> Result<ImageUsers, StoreError> {
        let tags: Vec<(String, String)> =
            sqlx::query_as("SELECT name, tag FROM tags WHERE image_digest = ? ORDER BY name, tag")
                .bind(digest.to_string())
                .fetch_all(&self.pool)
                .await?;
        let assigned: Vec<(String,)> = sqlx::query_as(
            "SELECT mac FROM nodes WHERE assigned_ref = ? OR assigned_ref = ? ORDER BY mac",
        )
        .bind(digest.to_string())
        .bind(name_version)
        .fetch_all(&self.pool)
        .await?;
        let last_booted: Vec<(String, String)> = sqlx::query_as(
            "SELECT n.mac, n.state FROM nodes n WHERE
             (SELECT b.image_digest FROM boots b WHERE b.mac = n.mac
              ORDER BY b.rowid DESC LIMIT 1) = ? ORDER BY n.mac",
        )
        .bind(digest.to_string())
        .fetch_all(&self.pool)
        .await?;
        crate::store::rows::image_users(tags, assigned, last_booted)
    }
    async fn remove_image(&self, digest: &Digest) -> Result<Removed, StoreError> {
        let mut tx = self.write_tx().await?;
        let key = digest.to_string();
        let found: Option<(String, String)> =
            sqlx::query_as("SELECT name, version FROM images WHERE digest = ?")
                .bind(&key)
                .fetch_optional(&mut *tx)
                .await?;
        let Some((name, version)) = found else {
            tx.abandon().await?;
            return Ok(Removed::Missing);
        };
        // Before the deletion: of each node whose newest boot ran it, the older boots'
        // tokens are revoked (any other node's newest boot stays its newest).
        sqlx::query(
            "UPDATE boots SET token_sha256 = ?1
             WHERE token_sha256 <> ?1
               AND mac IN (SELECT b.mac FROM boots b WHERE b.image_digest = ?2
                           AND b.rowid = (SELECT MAX(rowid) FROM boots m WHERE m.mac = b.mac))
               AND rowid < (SELECT MAX(rowid) FROM boots newer WHERE newer.mac = boots.mac)",
        )
        .bind(crate::store::REVOKED_TOKEN_SHA256)
        .bind(&key)
        .execute(&mut *tx)
        .await?;
        for sql in [
            "DELETE FROM boot_fetches WHERE boot_id IN (SELECT id FROM boots WHERE image_digest = ?)",
            "DELETE FROM boots WHERE image_digest = ?",
            "DELETE FROM image_artifacts WHERE image_digest = ?",
            "DELETE FROM images WHERE digest = ?",
        ] {
            sqlx::query(sql).bind(&key).execute(&mut *tx).await?;
        }
        let data = ImageEventData {
            image: *digest,
            name,
            version,
        };
        super::events::insert_event(&mut tx, kind::IMAGE_REMOVED, None, &data, now_ms()).await?;
        tx.forget_on_commit(self.resolved.clone());
        tx.commit_removing_image(*digest).await?;
        self.notify_events();
        Ok(Removed::Done)
    }
}
