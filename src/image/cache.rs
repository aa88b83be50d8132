//! The local blob directory as a cache of the shared object store: a blob a server does
//! not hold is filled from the object store on first request, verified by sha256 before
//! it becomes visible (`Objects::fetch`), once however many requests want it at the
//! same time (they wait on one fill and then all read the file), and the cache is held
//! under `cache_max_bytes` by evicting the blobs served longest ago (a file's mtime is
//! when it was filled, moved forward when it is served, at most once a minute). Eviction
//! is safe only because the object store keeps every blob: without one, nothing is
//! evicted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures_util::FutureExt as _;
use futures_util::future::{BoxFuture, Shared};

use super::blobstore::BlobStore;
use super::objects::{ObjectError, Objects};
use crate::api::Digest;

/// What `verify_objects` found.
#[derive(Debug, Default)]
pub struct ObjectsReport {
    pub checked: usize,
    pub bytes: u64,
    pub damaged: Vec<Digest>,
    pub missing: Vec<Digest>,
}

pub struct SharedBlobs {
    pub objects: Objects,
    local: Arc<BlobStore>,
    max_bytes: Option<u64>,
    /// The fill in progress per blob: a task of its own (a requester that goes away does
    /// not abort it), whose one result every requester that came meanwhile receives.
    fills: Mutex<HashMap<Digest, Fill>>,
}

type Fill = Shared<BoxFuture<'static, Result<(), FillFailure>>>;

/// How stale a served blob's mtime may get before it is moved to now: the eviction
/// order is the order of use to within this, for one `futimens` a minute per blob.
const TOUCH_EVERY: Duration = Duration::from_secs(60);

/// `ObjectError`, as every waiter of one fill receives it.
#[derive(Debug, Clone)]
enum FillFailure {
    Missing(Digest),
    Damaged { expected: Digest, actual: Digest },
    Unreachable(String),
    Local(String),
}

impl From<ObjectError> for FillFailure {
    fn from(e: ObjectError) -> Self {
        match e {
            ObjectError::Missing(d) => Self::Missing(d),
            ObjectError::Damaged { expected, actual } => Self::Damaged { expected, actual },
            ObjectError::Unreachable(m) => Self::Unreachable(m),
            e => Self::Local(e.to_string()),
        }
    }
}

impl From<FillFailure> for ObjectError {
    fn from(f: FillFailure) -> Self {
        match f {
            FillFailure::Missing(d) => Self::Missing(d),
            FillFailure::Damaged { expected, actual } => Self::Damaged { expected, actual },
            FillFailure::Unreachable(m) => Self::Unreachable(m),
            FillFailure::Local(m) => Self::Io(std::io::Error::other(m)),
        }
    }
}

impl SharedBlobs {
    pub fn new(objects: Objects, local: Arc<BlobStore>, max_bytes: Option<u64>) -> Self {
        Self {
            objects,
            local,
            max_bytes,
            fills: Default::default(),
        }
    }

    /// Makes `digest` present locally, filling it from the object store if it is not.
    pub async fn ensure_local(self: &Arc<Self>, digest: &Digest) -> Result<(), ObjectError> {
        if self.served_from_cache(digest) {
            return Ok(());
        }
        let fill = {
            let mut fills = self.fills.lock().expect("not poisoned");
            fills
                .entry(*digest)
                .or_insert_with(|| {
                    let (this, d) = (self.clone(), *digest);
                    let task = tokio::spawn(async move {
                        let result = if this.local.contains(&d) {
                            Ok(())
                        } else {
                            this.fill(&d).await.map_err(FillFailure::from)
                        };
                        // Only this task removes its entry: the next request after a
                        // failure starts a new fill.
                        this.fills.lock().expect("not poisoned").remove(&d);
                        result
                    });
                    async move {
                        task.await
                            .unwrap_or_else(|e| Err(FillFailure::Local(e.to_string())))
                    }
                    .boxed()
                    .shared()
                })
                .clone()
        };
        fill.await.map_err(ObjectError::from)
    }

    /// Whether the cache holds `digest`; when it does and eviction is on, its mtime is
    /// moved to now if it is older than `TOUCH_EVERY` (the least recently served go
    /// first). A failed touch costs only eviction order.
    fn served_from_cache(&self, digest: &Digest) -> bool {
        let path = self.local.path_of(digest);
        let Ok(meta) = std::fs::metadata(&path) else {
            return false;
        };
        if self.max_bytes.is_some()
            && meta
                .modified()
                .is_ok_and(|m| m.elapsed().is_ok_and(|age| age >= TOUCH_EVERY))
            && let Err(e) =
                std::fs::File::open(&path).and_then(|f| f.set_modified(SystemTime::now()))
        {
            tracing::debug!(%digest, error = %e, "could not mark a cached blob as served");
        }
        true
    }

    async fn fill(&self, digest: &Digest) -> Result<(), ObjectError> {
        let temp = self.objects.fetch(digest, &self.local).await?;
        let local = self.local.clone();
        let (max, keep) = (self.max_bytes, *digest);
        tokio::task::spawn_blocking(move || {
            local.commit(vec![temp])?;
            if let Some(max) = max {
                local.evict_oldest(max, &keep)?;
            }
            Ok::<_, std::io::Error>(())
        })
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))??;
        tracing::debug!(%digest, "blob filled from the object store");
        Ok(())
    }

    /// Re-hashes the object of every digest in `wanted` (each is downloaded into a temp
    /// blob and dropped; the cache is left as it was). Returns how many were checked and
    /// their bytes, the damaged ones and the missing ones.
    pub async fn verify_objects(&self, wanted: &[Digest]) -> Result<ObjectsReport, ObjectError> {
        let mut report = ObjectsReport::default();
        for d in wanted {
            match self.objects.fetch(d, &self.local).await {
                Ok(temp) => {
                    report.checked += 1;
                    report.bytes += temp.size;
                }
                Err(ObjectError::Missing(d)) => report.missing.push(d),
                Err(ObjectError::Damaged { expected, .. }) => {
                    tracing::warn!(digest = %expected, "object store copy is damaged");
                    report.damaged.push(expected)
                }
                Err(e) => return Err(e),
            }
        }
        Ok(report)
    }

    /// Removes the objects of `listed` that are not in `keep` and are older than the
    /// grace; returns them with their bytes. The caller reads `keep` after listing, so a
    /// blob published meanwhile is kept; each candidate's age is asked again just before
    /// its removal, so one another server's publish uploaded again since the listing is
    /// kept too. An object of unknown age is kept; one that cannot be removed is logged
    /// and left for the next run.
    pub async fn collect_objects(
        &self,
        listed: Vec<super::objects::ObjectEntry>,
        keep: &std::collections::HashSet<Digest>,
    ) -> (Vec<Digest>, u64) {
        let grace = self.objects.gc_grace();
        let old = |modified: i64| {
            modified > 0 && super::objects::older_than(modified, super::objects::now_secs(), grace)
        };
        let mut removed = Vec::new();
        let mut bytes = 0;
        for entry in listed {
            if keep.contains(&entry.digest) || !old(entry.modified_secs) {
                continue;
            }
            let d = entry.digest;
            let outcome = match self.objects.modified(&d).await {
                Ok(Some(m)) if old(m) => self.objects.delete(&d).await.map(|()| true),
                Ok(_) => Ok(false),
                Err(e) => Err(e),
            };
            match outcome {
                Ok(true) => {
                    removed.push(d);
                    bytes += entry.size;
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(digest = %d, error = %e, "cannot remove an object no image needs; left for the next gc")
                }
            }
        }
        (removed, bytes)
    }

    /// Uploads local blobs the object store does not hold yet (a publish, before its row).
    pub async fn upload(&self, digests: &[Digest]) -> Result<(), ObjectError> {
        for d in digests {
            self.objects.put_file(d, &self.local.path_of(d)).await?;
        }
        Ok(())
    }
}
