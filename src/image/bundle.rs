//! Reading an untrusted bundle (tar, optionally gzip or zstd) into staged temp blobs.
//!
//! Everything is checked while streaming; on any refusal the staged temp blobs are
//! dropped (and deleted), so nothing of a refused bundle remains.

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read};

use serde::{Deserialize, Serialize};
use tar::EntryType;

use super::blobstore::{BlobStore, TempBlob};
use super::bundle_path::normalize_path;
use super::canonical::{canonical_form, image_digest};
use super::manifest::{Manifest, ManifestError};
use crate::api::Digest;
use crate::api::image::Artifact;

pub use crate::api::image::MANIFEST_NAME;

/// Limits applied to every bundle; configurable (`[limits]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BundleLimits {
    /// Largest single artifact, in bytes.
    pub max_artifact_bytes: u64,
    /// Largest manifest.toml, in bytes.
    pub max_manifest_bytes: u64,
    /// Most entries (files and directories) in one bundle.
    pub max_entries: usize,
    /// Most bytes one bundle may stage, all artifacts together.
    pub max_bundle_bytes: u64,
    /// Free space an artifact must leave in the blob directory's filesystem (the
    /// database and the logs may share it).
    pub min_free_bytes: u64,
    /// Publishes read at once; more wait, unread. Each holds a blocking-pool thread for
    /// its upload, which blob serving needs too.
    pub max_concurrent_publishes: usize,
}

impl Default for BundleLimits {
    fn default() -> Self {
        Self {
            max_artifact_bytes: 16 << 30,
            max_manifest_bytes: 1 << 20,
            max_entries: 1024,
            max_bundle_bytes: 64 << 30,
            min_free_bytes: 256 << 20,
            max_concurrent_publishes: 8,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("bundle entry {path:?}: {reason}")]
    Entry { path: String, reason: String },
    #[error("bundle entry {path:?} is {size} bytes, over the limit of {limit} bytes")]
    TooLarge { path: String, size: u64, limit: u64 },
    #[error("bundle has more than {0} entries")]
    TooManyEntries(usize),
    #[error(
        "bundle's artifacts pass {0} bytes together, over the limit ([limits] max_bundle_bytes)"
    )]
    BundleTooLarge(u64),
    #[error(
        "no room for bundle entry {path:?} ({size} bytes): {available} bytes free in the blob directory"
    )]
    NoSpace {
        path: String,
        size: u64,
        available: u64,
    },
    #[error("bundle has no {MANIFEST_NAME}")]
    NoManifest,
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error("manifest names {field} {path:?}, which the bundle does not contain")]
    MissingArtifact { field: &'static str, path: String },
    #[error("bundle entry {0:?} is not named by the manifest")]
    Unreferenced(String),
    #[error("bundle is not a readable archive: {0}")]
    Malformed(String),
    #[error("storage error while staging the bundle: {0}")]
    Storage(io::Error),
}

/// A fully checked bundle whose artifacts wait as temp blobs, ready to commit.
#[derive(Debug)]
pub struct StagedImage {
    pub manifest: Manifest,
    pub manifest_text: String,
    pub artifacts: Vec<Artifact>,
    pub canonical: Vec<u8>,
    pub digest: Digest,
    pub temps: Vec<TempBlob>,
}

impl StagedImage {
    /// A checked image and its temp blobs (in `artifacts` order), with its canonical form
    /// and digest.
    pub fn new(
        manifest: Manifest,
        manifest_text: String,
        artifacts: Vec<Artifact>,
        temps: Vec<TempBlob>,
    ) -> Self {
        let canonical = canonical_form(&manifest, &artifacts);
        let digest = image_digest(&canonical);
        Self {
            manifest,
            manifest_text,
            artifacts,
            canonical,
            digest,
            temps,
        }
    }
}

const GZIP_MAGIC: &[u8] = &[0x1f, 0x8b];
const ZSTD_MAGIC: &[u8] = &[0x28, 0xb5, 0x2f, 0xfd];
/// Bytes tolerated after the end-of-archive marker (tar pads to 10 KiB records).
const MAX_TRAILING_BYTES: u64 = 1 << 20;

/// Reads a bundle from `input`, staging artifacts in `store` as temp blobs.
pub fn ingest(
    input: impl Read,
    store: &BlobStore,
    limits: &BundleLimits,
) -> Result<StagedImage, BundleError> {
    let mut buffered = BufReader::with_capacity(1 << 20, input);
    let head = buffered.fill_buf().map_err(read_error)?;
    let reader: Box<dyn Read> = if head.starts_with(GZIP_MAGIC) {
        Box::new(flate2::bufread::MultiGzDecoder::new(buffered))
    } else if head.starts_with(ZSTD_MAGIC) {
        Box::new(zstd::stream::read::Decoder::with_buffer(buffered).map_err(read_error)?)
    } else {
        Box::new(buffered)
    };
    // Extension headers are bounded before the tar parser reads them whole.
    let mut reader = super::tar_guard::TarGuard::new(reader);
    let staged = read_archive(&mut reader, store, limits)?;
    // The tar end marker can come before the compressed stream's end (and its checksum):
    // read to the true end, so a truncated or corrupt stream is refused.
    let trailing = io::copy(
        &mut (&mut reader).take(MAX_TRAILING_BYTES + 1),
        &mut io::sink(),
    )
    .map_err(read_error)?;
    if trailing > MAX_TRAILING_BYTES {
        return Err(BundleError::Malformed(
            "data continues after the end of the tar archive".into(),
        ));
    }
    staged.finish()
}

fn read_error(e: io::Error) -> BundleError {
    BundleError::Malformed(e.to_string())
}

struct Collected {
    /// The manifest, parsed as soon as it is read: entries after it are judged by it.
    manifest: Option<(String, Manifest)>,
    files: BTreeMap<String, TempBlob>,
    /// Artifact bytes staged so far.
    staged: u64,
}

fn read_archive(
    reader: &mut dyn Read,
    store: &BlobStore,
    limits: &BundleLimits,
) -> Result<Collected, BundleError> {
    let mut archive = tar::Archive::new(reader);
    let mut collected = Collected {
        manifest: None,
        files: BTreeMap::new(),
        staged: 0,
    };
    let mut dirs = std::collections::BTreeSet::new();
    let mut copy_buf = vec![0u8; COPY_CHUNK];
    let mut count = 0usize;
    for entry in archive.entries().map_err(read_error)? {
        let mut entry = entry.map_err(read_error)?;
        count += 1;
        if count > limits.max_entries {
            return Err(BundleError::TooManyEntries(limits.max_entries));
        }
        let raw_path = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let refuse = |reason: String| BundleError::Entry {
            path: raw_path.clone(),
            reason,
        };
        let kind = entry.header().entry_type();
        match kind {
            EntryType::Regular | EntryType::Continuous | EntryType::Directory => {}
            EntryType::XGlobalHeader => continue,
            EntryType::Symlink => return Err(refuse("symbolic links are not allowed".into())),
            EntryType::Link => return Err(refuse("hard links are not allowed".into())),
            EntryType::Char | EntryType::Block => {
                return Err(refuse("device files are not allowed".into()));
            }
            EntryType::Fifo => return Err(refuse("FIFOs are not allowed".into())),
            other => return Err(refuse(format!("entry type {other:?} is not allowed"))),
        }
        if std::str::from_utf8(&entry.path_bytes()).is_err() {
            return Err(refuse("path is not UTF-8".into()));
        }
        let path = match normalize_path(&raw_path) {
            Ok(p) => p,
            // `./` itself, as `tar -C dir .` writes it.
            Err(super::bundle_path::PathError::Empty) if kind == EntryType::Directory => continue,
            Err(e) => return Err(refuse(e.to_string())),
        };
        if kind == EntryType::Directory {
            if collected.files.contains_key(&path) || !dirs.insert(path) {
                return Err(refuse("duplicate name".into()));
            }
            continue;
        }
        if collected.files.contains_key(&path)
            || dirs.contains(&path)
            || (path == MANIFEST_NAME && collected.manifest.is_some())
        {
            return Err(refuse("duplicate name".into()));
        }
        let size = entry.header().size().map_err(|e| refuse(e.to_string()))?;
        if path == MANIFEST_NAME {
            if size > limits.max_manifest_bytes {
                return Err(BundleError::TooLarge {
                    path,
                    size,
                    limit: limits.max_manifest_bytes,
                });
            }
            let mut text = String::new();
            entry
                .read_to_string(&mut text)
                .map_err(|e| refuse(format!("unreadable: {e}")))?;
            // Refused now, not after the artifacts behind it are written.
            let manifest = Manifest::parse(&text)?;
            if let Some(early) = collected.files.keys().find(|p| {
                !manifest
                    .artifact_paths()
                    .iter()
                    .any(|(_, named)| *named == p.as_str())
            }) {
                return Err(BundleError::Unreferenced(early.clone()));
            }
            collected.manifest = Some((text, manifest));
            continue;
        }
        if let Some((_, manifest)) = &collected.manifest
            && !manifest
                .artifact_paths()
                .iter()
                .any(|(_, named)| *named == path)
        {
            return Err(BundleError::Unreferenced(path));
        }
        if size > limits.max_artifact_bytes {
            return Err(BundleError::TooLarge {
                path,
                size,
                limit: limits.max_artifact_bytes,
            });
        }
        collected.staged += size;
        if collected.staged > limits.max_bundle_bytes {
            return Err(BundleError::BundleTooLarge(limits.max_bundle_bytes));
        }
        let available = store.available_bytes().map_err(BundleError::Storage)?;
        if size.saturating_add(limits.min_free_bytes) > available {
            return Err(BundleError::NoSpace {
                path,
                size,
                available,
            });
        }
        let mut writer = store.temp_writer().map_err(BundleError::Storage)?;
        let copied = copy_in_large_chunks(&mut entry, &mut writer, &mut copy_buf)?;
        if copied != size {
            return Err(BundleError::Malformed(format!(
                "entry {path:?} ends after {copied} of {size} bytes"
            )));
        }
        let temp = writer.finish().map_err(BundleError::Storage)?;
        collected.files.insert(path, temp);
    }
    Ok(collected)
}

/// A bundle whose `[rootfs.verity]` names a root hash must carry the hash tree that
/// proves it: checked now (in user space, by veritysetup), or a node would only find
/// out when its reads fail.
fn check_verity(
    manifest: &Manifest,
    artifacts: &[Artifact],
    temps: &[TempBlob],
) -> Result<(), BundleError> {
    let Some(verity) = manifest
        .rootfs_spec
        .as_ref()
        .and_then(|r| r.verity.as_ref())
    else {
        return Ok(());
    };
    let Some((artifact, temp)) = artifacts
        .iter()
        .zip(temps)
        .find(|(a, _)| a.role == crate::api::image::Role::Rootfs)
    else {
        return Ok(());
    };
    let refuse = |reason: String| BundleError::Entry {
        path: artifact.path.clone(),
        reason,
    };
    if verity.hash_offset >= artifact.size {
        return Err(refuse(format!(
            "rootfs.verity puts the hash tree at byte {}, past the blob's {} bytes",
            verity.hash_offset, artifact.size
        )));
    }
    match super::import::squashfs::verity_verify(temp.path(), verity) {
        Ok(true) => Ok(()),
        Ok(false) => Err(refuse(format!(
            "its dm-verity tree does not prove rootfs.verity root-hash {}",
            verity.root_hash
        ))),
        Err(e) => Err(BundleError::Storage(e)),
    }
}

/// `io::copy` moves 8 KiB at a time: 131,072 write calls per GiB. 1 MiB chunks cut the
/// system calls 128-fold, which is most of what separates a publish from `sha256sum`.
const COPY_CHUNK: usize = 1 << 20;

fn copy_in_large_chunks(
    from: &mut impl Read,
    to: &mut impl io::Write,
    buf: &mut [u8],
) -> Result<u64, BundleError> {
    let mut total = 0u64;
    loop {
        // Fill the buffer as far as the reader allows before writing.
        let mut filled = 0;
        while filled < buf.len() {
            match from.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(read_error(e)),
            }
        }
        if filled == 0 {
            return Ok(total);
        }
        to.write_all(&buf[..filled]).map_err(BundleError::Storage)?;
        total += filled as u64;
    }
}

impl Collected {
    fn finish(mut self) -> Result<StagedImage, BundleError> {
        let (manifest_text, manifest) = self.manifest.take().ok_or(BundleError::NoManifest)?;
        let mut artifacts = Vec::new();
        let mut temps = Vec::new();
        for (role, path) in manifest.artifact_paths() {
            let temp = self
                .files
                .remove(path)
                .ok_or_else(|| BundleError::MissingArtifact {
                    field: match role {
                        crate::api::image::Role::Kernel => "boot.kernel",
                        crate::api::image::Role::Initrd => "boot.initrds",
                        crate::api::image::Role::Rootfs => "boot.rootfs",
                    },
                    path: path.to_string(),
                })?;
            artifacts.push(Artifact {
                role,
                path: path.to_string(),
                digest: temp.digest,
                size: temp.size,
            });
            temps.push(temp);
        }
        if let Some(extra) = self.files.keys().next() {
            return Err(BundleError::Unreferenced(extra.clone()));
        }
        check_verity(&manifest, &artifacts, &temps)?;
        Ok(StagedImage::new(manifest, manifest_text, artifacts, temps))
    }
}
