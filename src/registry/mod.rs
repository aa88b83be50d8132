//! The image registry service: publish, import, resolve, tag, verify and collect
//! garbage, over the blob store and the database. HTTP handlers call this; it knows
//! nothing of HTTP.

mod import;

pub use import::ImportSource;

use std::io::Read;
use std::sync::Arc;

use tokio::sync::RwLock;

use crate::api::Digest;
use crate::api::image::{GcReport, Image, PublishOutcome, TagMove, TagResult, VerifyReport};
use crate::api::refs::{ImageRef, TagName};
use crate::image::blobstore::BlobStore;
use crate::image::bundle::{self, BundleError, BundleLimits};
use crate::store::{InsertOutcome, NewImage, Store, StoreError, TagOutcome};

/// The prefix of an unreachable store's errors (for the HTTP layer, which names no store).
pub use crate::store::BUSY as STORE_BUSY;
pub use crate::store::UNAVAILABLE as STORE_UNAVAILABLE;

#[derive(Clone)]
pub struct Registry {
    pub store: Store,
    pub blobs: Arc<BlobStore>,
    pub limits: BundleLimits,
    /// The shared object store, when `[blobs] url` is set: `blobs` is then its cache.
    pub shared: Option<Arc<crate::image::cache::SharedBlobs>>,
    /// Publishes hold it shared while they make blobs visible and insert rows; GC holds
    /// it exclusively, so it never sees a blob whose image row is not yet written.
    gc_lock: Arc<RwLock<()>>,
    /// Publishes reading their bundle now (`[limits] max_concurrent_publishes`): each
    /// holds a blocking thread, so unbounded slow uploads would starve blob serving.
    publishing: Arc<tokio::sync::Semaphore>,
    /// `[images]`: what imports may take and where stage 1's parts come from.
    pub imports: Arc<crate::image::import::ImportSettings>,
    /// Where imports stage their blobs (`<data-dir>/imports`), emptied at start.
    pub imports_dir: std::path::PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("blob storage error: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Objects(#[from] crate::image::objects::ObjectError),
    #[error("import refused: {0}")]
    Import(#[from] crate::image::import::ImportError),
}

impl Registry {
    pub fn new(store: Store, blobs: BlobStore, limits: BundleLimits) -> Self {
        let imports_dir = blobs
            .dir()
            .parent()
            .and_then(|p| p.parent())
            .map(|data| data.join("imports"))
            .unwrap_or_else(|| "imports".into());
        Self {
            store,
            blobs: Arc::new(blobs),
            limits,
            shared: None,
            gc_lock: Arc::new(RwLock::new(())),
            publishing: Arc::new(tokio::sync::Semaphore::new(
                limits.max_concurrent_publishes.max(1),
            )),
            imports: Arc::default(),
            imports_dir,
        }
    }

    /// Blobs on a shared object store, `blobs` its local cache.
    pub fn with_objects(
        mut self,
        objects: crate::image::objects::Objects,
        cache_max_bytes: Option<u64>,
    ) -> Self {
        self.shared = Some(Arc::new(crate::image::cache::SharedBlobs::new(
            objects,
            self.blobs.clone(),
            cache_max_bytes,
        )));
        self
    }

    /// Makes `digest` servable from the local directory: true if it is there now. With
    /// an object store, a missing blob is filled from it (verified first).
    pub async fn local_blob(&self, digest: &Digest) -> Result<bool, RegistryError> {
        let Some(shared) = &self.shared else {
            return Ok(self.blobs.contains(digest));
        };
        match shared.ensure_local(digest).await {
            Ok(()) => Ok(true),
            Err(crate::image::objects::ObjectError::Missing(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Reads a bundle (blocking reader, run on the blocking pool) and publishes it.
    pub async fn publish(
        &self,
        input: impl Read + Send + 'static,
        tag: Option<TagName>,
        actor: &str,
    ) -> Result<PublishOutcome, RegistryError> {
        let blobs = self.blobs.clone();
        let limits = self.limits;
        // Waits here, its body unread, while the others upload.
        let reading = self
            .publishing
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let staged = tokio::task::spawn_blocking(move || bundle::ingest(input, &blobs, &limits))
            .await
            .map_err(|e| std::io::Error::other(format!("bundle reader failed: {e}")))??;
        drop(reading);
        self.publish_staged(staged, tag, actor).await
    }

    /// Publishes a checked image whose blobs wait as temp blobs (a bundle's, an import's):
    /// refused before anything becomes visible, then blobs, then the row, then the tag.
    pub async fn publish_staged(
        &self,
        staged: crate::image::bundle::StagedImage,
        tag: Option<TagName>,
        actor: &str,
    ) -> Result<PublishOutcome, RegistryError> {
        let m = &staged.manifest;
        if let Some(t) = &tag
            && t.name != m.name
        {
            return Err(RegistryError::Invalid(format!(
                "tag {t} does not match the image name {:?}",
                m.name
            )));
        }
        let new = NewImage {
            digest: staged.digest,
            name: &m.name,
            version: &m.version,
            manifest_toml: &staged.manifest_text,
            canonical: &staged.canonical,
            artifacts: &staged.artifacts,
        };
        // Refuse before any blob becomes visible, so a refused bundle leaves nothing.
        self.refuse_unless_publishable(&new, self.store.precheck(&new).await?)?;
        let bytes = staged.artifacts.iter().map(|a| a.size).sum();
        let outcome = {
            let _shared = self.gc_lock.read().await;
            let blobs = self.blobs.clone();
            // Also runs for a re-publish: it restores blobs that verify quarantined.
            tokio::task::spawn_blocking(move || blobs.commit(staged.temps))
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))??;
            // The object store before the row: a row another server can read always
            // names blobs it can fetch.
            if let Some(shared) = &self.shared {
                let digests: Vec<Digest> = new.artifacts.iter().map(|a| a.digest).collect();
                shared.upload(&digests).await?;
            }
            let outcome = self.store.insert_image(&new).await?;
            // Its blobs are whole again (a re-publish is how a broken image is repaired).
            if matches!(
                outcome,
                InsertOutcome::Inserted | InsertOutcome::AlreadyPresent
            ) {
                let digests: Vec<Digest> = new.artifacts.iter().map(|a| a.digest).collect();
                self.store.clear_broken_blobs(&digests).await?;
            }
            outcome
        };
        self.refuse_unless_publishable(&new, outcome.clone())?;
        let tag = match tag {
            Some(t) => Some(self.tag(&t, &new.digest, actor).await?),
            None => None,
        };
        tracing::info!(digest = %new.digest, name = new.name, version = new.version, created = outcome == InsertOutcome::Inserted, "published image");
        Ok(PublishOutcome {
            digest: new.digest,
            name: new.name.to_string(),
            version: new.version.to_string(),
            created: outcome == InsertOutcome::Inserted,
            bytes,
            tag,
        })
    }

    fn refuse_unless_publishable(
        &self,
        new: &NewImage<'_>,
        outcome: InsertOutcome,
    ) -> Result<(), RegistryError> {
        match outcome {
            InsertOutcome::Inserted | InsertOutcome::AlreadyPresent => Ok(()),
            InsertOutcome::VersionTaken { existing } => Err(RegistryError::Conflict(format!(
                "{}:{} is already published as {existing}; this bundle is {}. Published images never change: publish it under a new version",
                new.name, new.version, new.digest
            ))),
            InsertOutcome::ClashesWithTag => Err(RegistryError::Conflict(format!(
                "{}:{} is a tag; a version may not have a tag's name",
                new.name, new.version
            ))),
        }
    }

    pub async fn list(&self) -> Result<Vec<Image>, RegistryError> {
        let broken = self.store.broken_blobs().await?;
        let mut images = self.store.list_images().await?;
        for image in &mut images {
            image.broken = broken_reason(image, &broken);
        }
        Ok(images)
    }

    /// Why `image` cannot be booted, if a blob it needs is marked broken; None when whole.
    pub async fn broken(&self, image: &Image) -> Result<Option<String>, RegistryError> {
        Ok(broken_reason(image, &self.store.broken_blobs().await?))
    }

    pub async fn list_tags(&self) -> Result<Vec<crate::api::image::Tag>, RegistryError> {
        Ok(self.store.list_tags().await?)
    }

    /// Whether the database answers.
    pub async fn ping(&self) -> Result<(), RegistryError> {
        Ok(self.store.ping().await?)
    }

    /// Commits a write (the row of `server`, this server's holder id, in `write_probes`).
    /// Never refused at the write queue: a full queue is load, not a broken disk, and a
    /// server called unready at its peak would be pulled from its load balancer.
    pub async fn probe_write(&self, server: &str) -> Result<(), RegistryError> {
        let probe = self.store.probe_write(server, crate::clock::now_ms());
        Ok(crate::store::own_task(probe).await?)
    }

    /// `ok`, or what keeps the blob directory from taking a publish.
    pub fn blob_readiness(&self) -> String {
        if !self.blobs.dir().is_dir() {
            return "blob directory missing".into();
        }
        match self.blobs.available_bytes() {
            Ok(free) if free < self.limits.min_free_bytes => format!(
                "{free} bytes free in {}, less than [limits] min_free_bytes ({})",
                self.blobs.dir().display(),
                self.limits.min_free_bytes
            ),
            Ok(_) => "ok".into(),
            Err(e) => format!(
                "cannot read free space of {}: {e}",
                self.blobs.dir().display()
            ),
        }
    }

    pub async fn resolve(&self, r: &ImageRef) -> Result<Digest, RegistryError> {
        if let ImageRef::DigestPrefix(p) = r {
            let found = self.store.digests_with_prefix(p, 3).await?;
            return match found.as_slice() {
                [] => Err(RegistryError::NotFound(format!("no image {r}"))),
                [one] => Ok(*one),
                several => Err(RegistryError::Invalid(format!(
                    "{r} is ambiguous: {}{}; give more digits",
                    several[..2]
                        .iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    if several.len() > 2 { ", ..." } else { "" }
                ))),
            };
        }
        self.store
            .resolve(r)
            .await?
            .ok_or_else(|| RegistryError::NotFound(format!("no image {r}")))
    }

    pub async fn show(&self, r: &ImageRef) -> Result<(Image, String), RegistryError> {
        let digest = self.resolve(r).await?;
        let not_found = || RegistryError::NotFound(format!("no image {r}"));
        let mut record = self.store.image(&digest).await?.ok_or_else(not_found)?;
        record.broken = self.broken(&record).await?;
        let manifest = self
            .store
            .manifest_toml(&digest)
            .await?
            .ok_or_else(not_found)?;
        Ok((record, manifest))
    }

    pub async fn tag(
        &self,
        tag: &TagName,
        digest: &Digest,
        actor: &str,
    ) -> Result<TagResult, RegistryError> {
        match self.store.set_tag(tag, digest, actor).await? {
            TagOutcome::Moved { from } => {
                tracing::info!(%tag, ?from, to = %digest, actor, "tag moved");
                Ok(TagResult {
                    tag: tag.to_string(),
                    digest: *digest,
                    from,
                    changed: true,
                })
            }
            TagOutcome::Unchanged => Ok(TagResult {
                tag: tag.to_string(),
                digest: *digest,
                from: Some(*digest),
                changed: false,
            }),
            TagOutcome::ClashesWithVersion => Err(RegistryError::Conflict(format!(
                "{tag} is a published version; a tag may not have a version's name"
            ))),
            TagOutcome::NameMismatch { image_name } => Err(RegistryError::Invalid(format!(
                "tag {tag} cannot point to {digest}, an image named {image_name:?}"
            ))),
        }
    }

    pub async fn tag_history(&self, tag: &TagName) -> Result<Vec<TagMove>, RegistryError> {
        let mut history = self.store.tag_history(tag).await?;
        if history.is_empty() {
            return Err(RegistryError::NotFound(format!("no tag {tag}")));
        }
        // Versions say more to a reader than digests; each image is read once.
        let mut versions: std::collections::HashMap<Digest, Option<String>> = Default::default();
        for m in &mut history {
            for digest in m.from.iter().chain([&m.to]) {
                if !versions.contains_key(digest) {
                    let version = self.store.image(digest).await?.map(|i| i.version);
                    versions.insert(*digest, version);
                }
            }
            m.from_version = m.from.and_then(|d| versions[&d].clone());
            m.to_version = versions[&m.to].clone().unwrap_or_default();
        }
        Ok(history)
    }

    pub async fn verify(&self) -> Result<VerifyReport, RegistryError> {
        let _shared = self.gc_lock.read().await;
        let blobs = self.blobs.clone();
        let report = tokio::task::spawn_blocking(move || blobs.verify())
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))??;
        let mut referenced: Vec<Digest> =
            self.store.referenced_blobs().await?.into_iter().collect();
        referenced.sort();
        if let Some(shared) = &self.shared {
            // The bucket is the copy of record: every object an image needs is re-hashed
            // (downloaded, not kept); the local cache was checked above.
            let objects = shared.verify_objects(&referenced).await?;
            // A quarantined cache copy is refilled from the bucket: only the bucket's
            // missing and damaged objects break images.
            self.store
                .mark_blobs_broken(&damaged_marks(&[], &objects.missing, &objects.damaged))
                .await?;
            return Ok(VerifyReport {
                checked: report.checked + objects.checked,
                bytes: report.bytes + objects.bytes,
                quarantined: report.quarantined,
                missing: objects.missing,
                damaged_objects: objects.damaged,
            });
        }
        let present: std::collections::HashSet<Digest> = self.blobs.list()?.into_iter().collect();
        let missing: Vec<Digest> = referenced
            .iter()
            .filter(|d| !present.contains(d))
            .copied()
            .collect();
        // Only referenced blobs break images; a quarantined orphan is just gone.
        let quarantined: Vec<Digest> = report
            .quarantined
            .iter()
            .filter(|d| referenced.binary_search(d).is_ok())
            .copied()
            .collect();
        self.store
            .mark_blobs_broken(&damaged_marks(&quarantined, &missing, &[]))
            .await?;
        Ok(VerifyReport {
            checked: report.checked,
            bytes: report.bytes,
            quarantined: report.quarantined,
            missing,
            damaged_objects: Vec::new(),
        })
    }

    /// Removes an image nothing uses: no tag points at it, no node is assigned it by
    /// digest or version, and no node whose newest boot ran it is in a state `runs` says
    /// runs a boot. Its boot records go with it (the event log keeps the transitions),
    /// and its nodes' older boots' tokens are revoked, so none becomes good again;
    /// its blobs are left for `gc`. Holds the GC lock, so no publish of the same content
    /// interleaves.
    pub async fn remove(
        &self,
        r: &ImageRef,
        runs: impl Fn(crate::api::NodeState) -> bool,
    ) -> Result<Image, RegistryError> {
        let _exclusive = self.gc_lock.write().await;
        let digest = self.resolve(r).await?;
        let image = self
            .store
            .image(&digest)
            .await?
            .ok_or_else(|| RegistryError::NotFound(format!("no image {r}")))?;
        let name_version = format!("{}:{}", image.name, image.version);
        let users = self.store.image_users(&digest, &name_version).await?;
        let running: Vec<String> = users
            .last_booted
            .iter()
            .filter(|(_, state)| runs(*state))
            .map(|(mac, state)| format!("{mac} ({state})"))
            .collect();
        let mut why = Vec::new();
        let few = |items: Vec<String>| {
            let more = items.len().saturating_sub(5);
            let mut shown: Vec<String> = items.into_iter().take(5).collect();
            if more > 0 {
                shown.push(format!("{more} more"));
            }
            shown.join(", ")
        };
        if !users.tags.is_empty() {
            why.push(format!("tags point at it: {}", few(users.tags)));
        }
        if !users.assigned.is_empty() {
            let macs = users.assigned.iter().map(|m| m.to_string()).collect();
            why.push(format!("nodes are assigned it: {}", few(macs)));
        }
        if !running.is_empty() {
            why.push(format!("nodes run it: {}", few(running)));
        }
        if !why.is_empty() {
            return Err(RegistryError::Conflict(format!(
                "{name_version} ({digest}) is in use: {}",
                why.join("; ")
            )));
        }
        match self.store.remove_image(&digest).await? {
            crate::store::Removed::Done => {
                tracing::info!(%digest, image = %name_version, "image removed");
                Ok(image)
            }
            _ => Err(RegistryError::NotFound(format!("no image {r}"))),
        }
    }

    /// Removes the blobs no image needs from the data directory and, with an object
    /// store, its objects older than `[blobs] gc_grace_secs` (listed before the
    /// references are read: a blob published meanwhile is kept).
    pub async fn gc(&self) -> Result<GcReport, RegistryError> {
        let _exclusive = self.gc_lock.write().await;
        let listed = match &self.shared {
            Some(shared) => Some(shared.objects.list().await?),
            None => None,
        };
        let keep = self.store.referenced_blobs().await?;
        let (objects_removed, object_bytes_freed) = match (&self.shared, listed) {
            (Some(shared), Some(listed)) => shared.collect_objects(listed, &keep).await,
            _ => (Vec::new(), 0),
        };
        let blobs = self.blobs.clone();
        let kept = keep.len();
        let (removed, bytes_freed) =
            tokio::task::spawn_blocking(move || blobs.remove_unreferenced(&keep))
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))??;
        tracing::info!(
            removed = removed.len(),
            bytes_freed,
            "garbage collected blobs"
        );
        // Files, not rows: the event follows the removal (a failure to record it leaves
        // the blobs removed and the answer an error saying so).
        if !removed.is_empty() || !objects_removed.is_empty() {
            let data = crate::api::event::BlobsCollectedData {
                removed: removed.len(),
                bytes_freed,
                objects_removed: objects_removed.len(),
                object_bytes_freed,
            };
            let data = serde_json::to_value(&data).expect("plain data serialises");
            self.store
                .record_event(crate::api::event::kind::BLOBS_COLLECTED, None, &data)
                .await?;
        }
        Ok(GcReport {
            removed,
            bytes_freed,
            kept,
            objects_removed,
            object_bytes_freed,
        })
    }
}

/// The reasons to mark blobs broken, by what `image verify` found.
fn damaged_marks(
    quarantined: &[Digest],
    missing: &[Digest],
    damaged_objects: &[Digest],
) -> Vec<(Digest, String)> {
    let mark = |list: &[Digest], why: &str| {
        list.iter()
            .map(|d| (*d, format!("blob {d} {why}")))
            .collect::<Vec<_>>()
    };
    let mut marks = mark(quarantined, "did not match its digest and was quarantined");
    marks.extend(mark(missing, "is missing"));
    marks.extend(mark(damaged_objects, "is damaged in the object store"));
    marks
}

/// The first broken blob `image` needs, as the reason it cannot boot.
pub fn broken_reason(image: &Image, broken: &[(Digest, String)]) -> Option<String> {
    image.artifacts.iter().find_map(|a| {
        broken.iter().find(|(d, _)| *d == a.digest).map(|(_, why)| {
            format!(
                "image {} is broken: {why} ({}); publish its bundle again to repair it",
                image.digest, a.path
            )
        })
    })
}
