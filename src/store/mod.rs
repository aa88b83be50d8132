//! The only module that speaks SQL: images, artifacts, tags and their history (here),
//! nodes, their state history and boots (`nodes`). SQLite.

pub mod boots;
pub mod events;
pub mod leases;
pub mod node_cache;
pub mod nodes;

use std::collections::HashSet;
use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use crate::api::Digest;
use crate::api::image::{Artifact, Image, Role, Tag, TagMove};
use crate::api::refs::{ImageRef, TagName};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
}

#[derive(Clone, Debug)]
pub struct Store {
    pool: SqlitePool,
    read_pool: SqlitePool,
    /// Every write in this process queues here (see `write_gate`).
    write_gate: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// Bumped after every commit that wrote events (see `events`).
    events_written: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
    /// Node records for DHCP (`node_for_dhcp`); every write to `nodes` invalidates.
    node_cache: std::sync::Arc<node_cache::NodeCache>,
}

/// A new image to insert.
pub struct NewImage<'a> {
    pub digest: Digest,
    pub name: &'a str,
    pub version: &'a str,
    pub manifest_toml: &'a str,
    pub canonical: &'a [u8],
    pub artifacts: &'a [Artifact],
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InsertOutcome {
    Inserted,
    /// The same content was published before: nothing changed.
    AlreadyPresent,
    /// `name:version` is taken by other content.
    VersionTaken {
        existing: Digest,
    },
    /// `name:version` would shadow a tag of the same spelling.
    ClashesWithTag,
}

#[derive(Debug, PartialEq, Eq)]
pub enum TagOutcome {
    Moved {
        from: Option<Digest>,
    },
    Unchanged,
    /// A version of that name has this spelling; a tag may not shadow it.
    ClashesWithVersion,
    /// The image's name differs from the tag's name.
    NameMismatch {
        image_name: String,
    },
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub fn format_ms(ms: i64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64))
        .to_string()
}

fn parse_digest(s: &str) -> Result<Digest, StoreError> {
    Digest::from_str(s).map_err(|e| StoreError::Corrupt(e.to_string()))
}

/// A write transaction holding its turn at the write gate until it ends.
pub(crate) struct WriteTx {
    tx: sqlx::Transaction<'static, sqlx::Sqlite>,
    _gate: tokio::sync::OwnedMutexGuard<()>,
}

impl WriteTx {
    pub(crate) async fn commit(self) -> Result<(), sqlx::Error> {
        self.tx.commit().await
    }
}

impl std::ops::Deref for WriteTx {
    type Target = sqlx::SqliteConnection;
    fn deref(&self) -> &Self::Target {
        &self.tx
    }
}

impl std::ops::DerefMut for WriteTx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.tx
    }
}

impl Store {
    /// Opens (creating) `path`, in WAL mode, and applies the embedded migrations.
    pub async fn open(path: &Path) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // Image and tag writes are rare and must survive power loss.
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        sqlx::migrate!("./migrations").run(&pool).await?;
        // Readers that never wait for a connection held by a writer queued on the write
        // lock (WAL lets them read alongside it); for the DHCP path.
        let read_pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(path)
                    .read_only(true)
                    .busy_timeout(Duration::from_secs(10)),
            )
            .await?;
        Ok(Self {
            pool,
            read_pool,
            write_gate: Default::default(),
            events_written: std::sync::Arc::new(tokio::sync::watch::Sender::new(0)),
            node_cache: Default::default(),
        })
    }

    /// A write transaction. `BEGIN IMMEDIATE` takes the write lock up front: a deferred
    /// transaction that reads and then writes fails with SQLITE_BUSY, without waiting,
    /// when another writer committed in between. Writers queue on `write_gate` first.
    pub(crate) async fn write_tx(&self) -> Result<WriteTx, StoreError> {
        let gate = self.write_gate().await;
        let tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        Ok(WriteTx { tx, _gate: gate })
    }

    /// Our turn to write. SQLite's own wait for its write lock is a sleep of 1 to 100 ms
    /// between tries, during which the lock often sits free: with a few writers at once
    /// (a boot storm's boot records, attestations, validations) most of the time went to
    /// those sleeps. Queued here, writers take the lock one after another, in order.
    pub(crate) async fn write_gate(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.write_gate.clone().lock_owned().await
    }

    pub async fn close(&self) {
        self.read_pool.close().await;
        self.pool.close().await;
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// Whether `img` could be inserted now, without inserting it.
    pub async fn precheck(&self, img: &NewImage<'_>) -> Result<InsertOutcome, StoreError> {
        let mut conn = self.pool.acquire().await?;
        check_insert(&mut conn, img).await
    }

    pub async fn insert_image(&self, img: &NewImage<'_>) -> Result<InsertOutcome, StoreError> {
        let mut tx = self.write_tx().await?;
        let outcome = check_insert(&mut tx, img).await?;
        if outcome != InsertOutcome::Inserted {
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
        tx.commit().await?;
        Ok(InsertOutcome::Inserted)
    }

    /// Resolves a REF: a digest, else `name:version`, else `name:tag`.
    pub async fn resolve(&self, r: &ImageRef) -> Result<Option<Digest>, StoreError> {
        let found: Option<(String,)> = match r {
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

    pub async fn image(&self, digest: &Digest) -> Result<Option<Image>, StoreError> {
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

    pub async fn manifest_toml(&self, digest: &Digest) -> Result<Option<String>, StoreError> {
        let row: Option<(String,)> =
            sqlx::query_as("SELECT manifest_toml FROM images WHERE digest = ?")
                .bind(digest.to_string())
                .fetch_optional(&self.pool)
                .await?;
        Ok(row.map(|(t,)| t))
    }

    pub async fn list_images(&self) -> Result<Vec<Image>, StoreError> {
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

    async fn record(
        &self,
        (digest, name, version, created): (String, String, String, i64),
    ) -> Result<Image, StoreError> {
        let artifacts: Vec<(String, String, String, i64)> = sqlx::query_as(
            "SELECT role, path, blob_digest, size FROM image_artifacts WHERE image_digest = ? ORDER BY position",
        )
        .bind(&digest)
        .fetch_all(&self.pool)
        .await?;
        let tags: Vec<(String, String)> =
            sqlx::query_as("SELECT name, tag FROM tags WHERE image_digest = ? ORDER BY tag")
                .bind(&digest)
                .fetch_all(&self.pool)
                .await?;
        Ok(Image {
            digest: parse_digest(&digest)?,
            name,
            version,
            created_at: format_ms(created),
            artifacts: artifacts
                .into_iter()
                .map(|(role, path, d, size)| {
                    Ok(Artifact {
                        role: Role::parse(&role)
                            .ok_or_else(|| StoreError::Corrupt(format!("role {role}")))?,
                        path,
                        digest: parse_digest(&d)?,
                        size: size as u64,
                    })
                })
                .collect::<Result<_, StoreError>>()?,
            tags: tags.into_iter().map(|(n, t)| format!("{n}:{t}")).collect(),
        })
    }

    /// Points `tag` at `digest`, recording the move. Idempotent.
    pub async fn set_tag(
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
            return Ok(TagOutcome::NameMismatch { image_name });
        }
        let version_clash: Option<(i64,)> =
            sqlx::query_as("SELECT 1 FROM images WHERE name = ? AND version = ?")
                .bind(&tag.name)
                .bind(&tag.tag)
                .fetch_optional(&mut *tx)
                .await?;
        if version_clash.is_some() {
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
        tx.commit().await?;
        Ok(TagOutcome::Moved { from })
    }

    pub async fn tag_history(&self, tag: &TagName) -> Result<Vec<TagMove>, StoreError> {
        let rows: Vec<(Option<String>, String, String, i64)> = sqlx::query_as(
            "SELECT from_digest, to_digest, actor, at_ms FROM tag_history WHERE name = ? AND tag = ? ORDER BY id",
        )
        .bind(&tag.name)
        .bind(&tag.tag)
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(from, to, actor, at)| {
                Ok(TagMove {
                    tag: tag.to_string(),
                    from: from.as_deref().map(parse_digest).transpose()?,
                    to: parse_digest(&to)?,
                    actor,
                    at: format_ms(at),
                })
            })
            .collect()
    }

    pub async fn list_tags(&self) -> Result<Vec<Tag>, StoreError> {
        let rows: Vec<(String, String, String, i64)> = sqlx::query_as(
            "SELECT name, tag, image_digest, updated_at_ms FROM tags ORDER BY name, tag",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(name, tag, d, at)| {
                Ok(Tag {
                    tag: format!("{name}:{tag}"),
                    digest: parse_digest(&d)?,
                    updated_at: format_ms(at),
                })
            })
            .collect()
    }

    /// Every blob digest that some image needs.
    pub async fn referenced_blobs(&self) -> Result<HashSet<Digest>, StoreError> {
        let rows: Vec<(String,)> =
            sqlx::query_as("SELECT DISTINCT blob_digest FROM image_artifacts")
                .fetch_all(&self.pool)
                .await?;
        rows.into_iter().map(|(d,)| parse_digest(&d)).collect()
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
