//! SQL for images, their artifacts, tags and tag history.

use std::collections::HashSet;

use async_trait::async_trait;

use super::SqliteStore;
use crate::api::Digest;
use crate::api::event::kind;
use crate::api::image::{Image, Tag, TagMove};
use crate::api::refs::{ImageRef, TagName};
use crate::clock::now_ms;
use crate::store::rows::{self, parse_digest};
use crate::store::{ImageStore, InsertOutcome, NewImage, StoreError, TagOutcome};

#[async_trait]
impl ImageStore for SqliteStore {
    /// Whether `img` could be inserted now, without inserting it.
    async fn precheck(&self, img: &NewImage<'_>) -> Result<InsertOutcome, StoreError> {
        let mut conn = self.pool.acquire().await?;
        check_insert(&mut conn, img).await
    }
    async fn insert_image(&self, img: &NewImage<'_>) -> Result<InsertOutcome, StoreError> {
        let mut tx = self.write_tx().await?;
        let outcome = check_insert(&mut tx, img).await?;
        if outcome != InsertOutcome::Inserted {
            tx.abandon().await?;
            return Ok(outcome);
        }
        let canonical =
            std::str::from_utf8(img.canonical).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        sqlx::query(
            "INSERT INTO images (digest, name, version, manifest_toml, canonical, created_at_ms) VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(img.digest.to_string())
        .bind(img.name)
        .bind(img.version)
        .bind(img.manifest_toml)
        .bind(canonical)
        .bind(now_ms())
        .execute(&mut *tx)
        .await?;
        for (position, a) in img.artifacts.iter().enumerate() {
            sqlx::query(
                "INSERT INTO image_artifacts (image_digest, position, role, path, blob_digest, size) VALUES (?, ?, ?, ?, ?, ?)",
            )
            .bind(img.digest.to_string())
            .bind(position as i64)
            .bind(a.role.as_str())
            .bind(&a.path)
            .bind(a.digest.to_string())
            .bind(a.size as i64)
            .execute(&mut *tx)
            .await?;
        }
        super::events::insert_event(
            &mut tx,
            kind::IMAGE_PUBLISHED,
            None,
            &img.event_data(),
            now_ms(),
        )
        .await?;
        tx.forget_on_commit(self.resolved.clone());
        tx.commit().await?;
        self.notify_events();
        Ok(InsertOutcome::Inserted)
    }
    /// Resolves a REF: a digest, else `name:version`, else `name:tag`. A digest or a name
    /// is answered from memory once read, until an image or tag write ends.
    async fn resolve(&self, r: &ImageRef) -> Result<Option<Digest>, StoreError> {
        if let ImageRef::DigestPrefix(_) = r {
            // Typed by admins, not booted from: not kept.
            return self.resolve_from_database(r).await;
        }
        let epoch = match self.resolved.get(r) {
            Ok(kept) => return Ok(kept),
            Err(epoch) => epoch,
        };
        let found = self.resolve_from_database(r).await?;
        self.resolved.fill(epoch, r.clone(), found);
        Ok(found)
    }

    async fn digests_with_prefix(
        &self,
        prefix: &str,
        limit: i64,
    ) -> Result<Vec<Digest>, StoreError> {
        // A range, not LIKE: the primary key's index answers it, and a prefix holds no
        // wildcard to escape ('g' sorts after every hex digit).
        let rows: Vec<(String,)> = sqlx::query_as(
            "SELECT digest FROM images WHERE digest >= ?1 AND digest < ?2 ORDER BY digest LIMIT ?3",
        )
        .bind(format!("sha256:{prefix}"))
        .bind(format!("sha256:{prefix}g"))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(|(d,)| parse_digest(&d)).collect()
    }
    async fn image(&self, digest: &Digest) -> Result<Option<Image>, StoreError> {
        let row: Option<(String, String, String, i64)> = sqlx::query_as(
            "SELECT digest, name, version, created_at_ms FROM images WHERE digest = ?",
        )
        .bind(digest.to_string())
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some(row) => Ok(Some(self.record(row).await?)),
            None => Ok(None),
        }
    }
    async fn manifest_toml(&self, digest: &Digest) -> Result<Option<String>, StoreError> {
        let row: Option<(String,)> =
            sqlx::query_as("SELECT manifest_toml FROM images WHERE digest = ?")
                .bind(digest.to_string())
                .fetch_optional(&self.pool)
                .await?;
        Ok(row.map(|(t,)| t))
    }
    async fn list_images(&self) -> Result<Vec<Image>, StoreError> {
        let rows: Vec<(String, String, String, i64)> = sqlx::query_as(
            "SELECT digest, name, version, created_at_ms FROM images ORDER BY name, created_at_ms, version",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            out.push(self.record(row).await?);
        }
        Ok(out)
    }
    /// Points `tag` at `digest`, recording the move. Idempotent.
    async fn set_tag(
        &self,
        tag: &TagName,
        digest: &Digest,
        actor: &str,
    ) -> Result<TagOutcome, StoreError> {
        let mut tx = self.write_tx().await?;
        let image_name: Option<(String,)> =
            sqlx::query_as("SELECT name FROM images WHERE digest = ?")
                .bind(digest.to_string())
                .fetch_optional(&mut *tx)
                .await?;
        let Some((image_name,)) = image_name else {
            return Err(StoreError::Corrupt(format!(
                "tagging unknown image {digest}"
            )));
        };
        if image_name != tag.name {
            tx.abandon().await?;
            return Ok(TagOutcome::NameMismatch { image_name });
        }
        let version_clash: Option<(i64,)> =
            sqlx::query_as("SELECT 1 FROM images WHERE name = ? AND version = ?")
                .bind(&tag.name)
                .bind(&tag.tag)
                .fetch_optional(&mut *tx)
                .await?;
        if version_clash.is_some() {
            tx.abandon().await?;
            return Ok(TagOutcome::ClashesWithVersion);
        }
        let current: Option<(String,)> =
            sqlx::query_as("SELECT image_digest FROM tags WHERE name = ? AND tag = ?")
                .bind(&tag.name)
                .bind(&tag.tag)
                .fetch_optional(&mut *tx)
                .await?;
        let from = current.map(|(d,)| parse_digest(&d)).transpose()?;
        if from == Some(*digest) {
            tx.abandon().await?;
            return Ok(TagOutcome::Unchanged);
        }
        let now = now_ms();
        sqlx::query(
            "INSERT INTO tags (name, tag, image_digest, updated_at_ms) VALUES (?, ?, ?, ?)
             ON CONFLICT (name, tag) DO UPDATE SET image_digest = excluded.image_digest, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(&tag.name)
        .bind(&tag.tag)
        .bind(digest.to_string())
        .bind(now)
        .execute(&mut *tx)
        .await?;
        sqlx::query("INSERT INTO tag_history (name, tag, from_digest, to_digest, actor, at_ms) VALUES (?, ?, ?, ?, ?, ?)")
            .bind(&tag.name)
            .bind(&tag.tag)
            .bind(from.map(|d| d.to_string()))
            .bind(digest.to_string())
            .bind(actor)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        tx.forget_on_commit(self.resolved.clone());
        tx.commit().await?;
        Ok(TagOutcome::Moved { from })
    }
    async fn tag_history(&self, tag: &TagName) -> Result<Vec<TagMove>, StoreError> {
        let rows: Vec<(Option<String>, String, String, i64)> = sqlx::query_as(
            "SELECT from_digest, to_digest, actor, at_ms FROM tag_history WHERE name = ? AND tag = ? ORDER BY id",
        )
        .bind(&tag.name)
        .bind(&tag.tag)
        .fetch_all(&self.pool)
        .await?;
        rows::tag_history(tag, rows)
    }
    async fn list_tags(&self) -> Result<Vec<Tag>, StoreError> {
        let rows: Vec<(String, String, String, i64)> = sqlx::query_as(
            "SELECT name, tag, image_digest, updated_at_ms FROM tags ORDER BY name, tag",
        )
        .fetch_all(&self.pool)
        .await?;
        rows::tags(rows)
    }
    /// Every blob digest that some image needs.
    async fn referenced_blobs(&self) -> Result<HashSet<Digest>, StoreError> {
        let rows: Vec<(String,)> =
            sqlx::query_as("SELECT DISTINCT blob_digest FROM image_artifacts")
                .fetch_all(&self.pool)
                .await?;
        rows.into_iter().map(|(d,)| parse_digest(&d)).collect()
    }
    async fn mark_blobs_broken(&self, blobs: &[(Digest, String)]) -> Result<usize, StoreError> {
        if blobs.is_empty() {
            return Ok(0);
        }
        let mut tx = self.write_tx().await?;
        let now = now_ms();
        let mut events = 0;
        for (blob, reason) in blobs {
            let new = sqlx::query(
                "INSERT INTO broken_blobs (digest, reason, at_ms) VALUES (?, ?, ?) ON CONFLICT (digest) DO NOTHING",
            )
            .bind(blob.to_string())
            .bind(reason)
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected()
                == 1;
            if !new {
                continue;
            }
            let images: Vec<(String, String, String)> = sqlx::query_as(
                "SELECT DISTINCT i.digest, i.name, i.version FROM images i
                 JOIN image_artifacts a ON a.image_digest = i.digest WHERE a.blob_digest = ?
                 ORDER BY i.digest",
            )
            .bind(blob.to_string())
            .fetch_all(&mut *tx)
            .await?;
            for (image, name, version) in images {
                let data = crate::api::event::ImageBrokenData {
                    image: parse_digest(&image)?,
                    name,
                    version,
                    blob: *blob,
                    reason: reason.clone(),
                };
                super::events::insert_event(
                    &mut tx,
                    crate::api::event::kind::IMAGE_BROKEN,
                    None,
                    &data,
                    now,
                )
                .await?;
                events += 1;
            }
        }
        tx.forget_on_commit(self.broken_blobs.clone());
        tx.commit().await?;
        self.notify_events();
        Ok(events)
    }
    async fn clear_broken_blobs(&self, blobs: &[Digest]) -> Result<(), StoreError> {
        if blobs.is_empty() {
            return Ok(());
        }
        let mut tx = self.write_tx().await?;
        for blob in blobs {
            sqlx::query("DELETE FROM broken_blobs WHERE digest = ?")
                .bind(blob.to_string())
                .execute(&mut *tx)
                .await?;
        }
        tx.forget_on_commit(self.broken_blobs.clone());
        tx.commit().await?;
        Ok(())
    }
    /// Kept in memory between writes to it (every boot script asks).
    async fn broken_blobs(&self) -> Result<Vec<(Digest, String)>, StoreError> {
        let epoch = match self.broken_blobs.get() {
            Ok(kept) => return Ok(kept),
            Err(epoch) => epoch,
        };
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT digest, reason FROM broken_blobs ORDER BY digest")
                .fetch_all(&self.pool)
                .await?;
        let broken = rows
            .into_iter()
            .map(|(d, reason)| Ok((parse_digest(&d)?, reason)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        self.broken_blobs.fill(epoch, broken.clone());
        Ok(broken)
    }
}

/// The checks an insert makes; `Inserted` means "nothing stands in the way".
async fn check_insert(
    conn: &mut sqlx::SqliteConnection,
    img: &NewImage<'_>,
) -> Result<InsertOutcome, StoreError> {
    let existing: Option<(String,)> =
        sqlx::query_as("SELECT digest FROM images WHERE name = ? AND version = ?")
            .bind(img.name)
            .bind(img.version)
            .fetch_optional(&mut *conn)
            .await?;
    if let Some((digest,)) = existing {
        let existing = parse_digest(&digest)?;
        return Ok(if existing == img.digest {
            InsertOutcome::AlreadyPresent
        } else {
            InsertOutcome::VersionTaken { existing }
        });
    }
    let tag_clash: Option<(i64,)> = sqlx::query_as("SELECT 1 FROM tags WHERE name = ? AND tag = ?")
        .bind(img.name)
        .bind(img.version)
        .fetch_optional(&mut *conn)
        .await?;
    if tag_clash.is_some() {
        return Ok(InsertOutcome::ClashesWithTag);
    }
    Ok(InsertOutcome::Inserted)
}

impl SqliteStore {
    /// `resolve`, read.
    async fn resolve_from_database(&self, r: &ImageRef) -> Result<Option<Digest>, StoreError> {
        let found: Option<(String,)> = match r {
            ImageRef::DigestPrefix(p) => {
                let mut found = self.digests_with_prefix(p, 2).await?;
                return Ok(if found.len() == 1 { found.pop() } else { None });
            }
            ImageRef::Digest(d) => {
                sqlx::query_as("SELECT digest FROM images WHERE digest = ?")
                    .bind(d.to_string())
                    .fetch_optional(&self.pool)
                    .await?
            }
            ImageRef::Named { name, label } => {
                sqlx::query_as(
                    "SELECT digest FROM images WHERE name = ?1 AND version = ?2
                     UNION ALL
                     SELECT image_digest FROM tags WHERE name = ?1 AND tag = ?2
                     LIMIT 1",
                )
                .bind(name)
                .bind(label)
                .fetch_optional(&self.pool)
                .await?
            }
        };
        found.map(|(d,)| parse_digest(&d)).transpose()
    }
    async fn record(&self, row: rows::ImageRow) -> Result<Image, StoreError> {
        let artifacts: Vec<rows::ArtifactRow> = sqlx::query_as(
            "SELECT role, path, blob_digest, size FROM image_artifacts WHERE image_digest = ? ORDER BY position",
        )
        .bind(&row.0)
        .fetch_all(&self.pool)
        .await?;
        let tags: Vec<(String, String)> =
            sqlx::query_as("SELECT name, tag FROM tags WHERE image_digest = ? ORDER BY tag")
                .bind(&row.0)
                .fetch_all(&self.pool)
                .await?;
        rows::image(row, artifacts, tags)
    }
}
