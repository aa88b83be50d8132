//! SQL for removing a node (`RemovalStore`): the node row locked under its version,
//! children first (foreign keys), the row last, with the event, in one transaction.

use async_trait::async_trait;

use super::PgStore;
use crate::api::Digest;
use crate::api::Mac;
use crate::api::event::{ImageEventData, NodeRemovedData, kind};
use crate::clock::now_ms;
use crate::store::{ImageUsers, RemovalStore, Removed, StoreError};

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
            "DELETE FROM power_actions WHERE mac = $1",
            "DELETE FROM revalidation_drains WHERE mac = $1",
            "DELETE FROM tpm_enrolments WHERE mac = $1",
            "DELETE FROM tpm_challenges WHERE mac = $1",
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
    async fn image_users(
        &self,
        digest: &Digest,
        name_version: &str,
    ) -> Result<ImageUsers, StoreError> {
        let tags: Vec<(String, String)> =
            sqlx::query_as("SELECT name, tag FROM tags WHERE image_digest = $1 ORDER BY name, tag")
                .bind(digest.to_string())
                .fetch_all(&self.pool)
                .await?;
        let assigned: Vec<(String,)> = sqlx::query_as(
            "SELECT mac FROM nodes WHERE assigned_ref = $1 OR assigned_ref = $2 ORDER BY mac",
        )
        .bind(digest.to_string())
        .bind(name_version)
        .fetch_all(&self.pool)
        .await?;
        let last_booted: Vec<(String, String)> = sqlx::query_as(
            "SELECT n.mac, n.state FROM nodes n WHERE
             (SELECT b.image_digest FROM boots b WHERE b.mac = n.mac
              ORDER BY b.seq DESC LIMIT 1) = $1 ORDER BY n.mac",
        )
        .bind(digest.to_string())
        .fetch_all(&self.pool)
        .await?;
        crate::store::rows::image_users(tags, assigned, last_booted)
    }
    async fn remove_image(&self, digest: &Digest) -> Result<Removed, StoreError> {
        let mut tx = self.tx().await?;
        let key = digest.to_string();
        let found: Option<(String, String)> =
            // Locked: a boot of it being opened meanwhile (its insert checks the key,
            // which waits on this lock) fails rather than land between the statements
            // below, where its node's older tokens would go unrevoked.
            sqlx::query_as("SELECT name, version FROM images WHERE digest = $1 FOR UPDATE")
                .bind(&key)
                .fetch_optional(&mut *tx)
                .await?;
        let Some((name, version)) = found else {
            return Ok(Removed::Missing);
        };
        // Before the deletion: of each node whose newest boot ran it, the older boots'
        // tokens are revoked (any other node's newest boot stays its newest).
        sqlx::query(
            "UPDATE boots SET token_sha256 = $1
             WHERE token_sha256 <> $1
               AND mac IN (SELECT b.mac FROM boots b WHERE b.image_digest = $2
                           AND b.seq = (SELECT MAX(seq) FROM boots m WHERE m.mac = b.mac))
               AND seq < (SELECT MAX(seq) FROM boots newer WHERE newer.mac = boots.mac)",
        )
        .bind(crate::store::REVOKED_TOKEN_SHA256)
        .bind(&key)
        .execute(&mut *tx)
        .await?;
        for sql in [
            "DELETE FROM boot_fetches WHERE boot_id IN (SELECT id FROM boots WHERE image_digest = $1)",
            "DELETE FROM boots WHERE image_digest = $1",
            "DELETE FROM image_artifacts WHERE image_digest = $1",
            "DELETE FROM images WHERE digest = $1",
        ] {
            sqlx::query(sql).bind(&key).execute(&mut *tx).await?;
        }
        let data = ImageEventData {
            image: *digest,
            name,
            version,
        };
        super::events::insert_event(&mut tx, kind::IMAGE_REMOVED, None, &data, now_ms()).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(Removed::Done)
    }
}
