//! Where an import's OCI content waits while it is read: a private staging directory
//! (removed with everything in it when the import ends, refused or not), blobs stored by
//! their sha256 as they arrive. An uploaded archive (`oci-archive`: an OCI layout as a
//! tar; `docker-archive`: what `docker save` writes) is spooled into it entry by entry,
//! every blob hashed while it is written; then the image is found in it: the manifest,
//! its config and its layers, each checked against the digest and size that names it.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};
use tar::EntryType;

use super::layer::LayerBlob;
use super::spec::{
    Compression, DOCKER_LIST, DockerArchiveImage, ImageConfig, ImageManifest, Index, OCI_INDEX,
    REF_NAME, is_wanted_platform,
};
use super::{OciError, OciImage};
use crate::api::Digest;
use crate::image::bundle_path::normalize_path;
use crate::image::tar_guard::TarGuard;

/// Bounds on what one import may spool.
#[derive(Debug, Clone, Copy)]
pub struct SpoolLimits {
    /// Bytes of all blobs together, as stored (compressed).
    pub max_bytes: u64,
    /// Files in an uploaded archive.
    pub max_files: usize,
    /// Largest JSON document (index, manifest, config) read into memory.
    pub max_json_bytes: u64,
}

impl Default for SpoolLimits {
    fn default() -> Self {
        Self {
            max_bytes: 64 << 30,
            max_files: 100_000,
            max_json_bytes: 4 << 20,
        }
    }
}

/// A blob being written into the staging directory; removed on drop unless finished.
pub struct BlobSpool {
    file: Option<File>,
    temp: PathBuf,
    hasher: Sha256,
    size: u64,
    expected: Option<(Digest, u64)>,
    what: String,
    /// Bytes the import may still spool.
    room: u64,
}

impl BlobSpool {
    pub fn write(&mut self, chunk: &[u8]) -> Result<(), OciError> {
        self.size += chunk.len() as u64;
        if self.size > self.room {
            return Err(OciError::Refused(
                "the image passes the import's size limit ([images] max_import_bytes)".into(),
            ));
        }
        if let Some((_, want)) = self.expected
            && self.size > want
        {
            return Err(OciError::Refused(format!(
                "{} is longer than the {want} bytes its descriptor says",
                self.what
            )));
        }
        self.hasher.update(chunk);
        self.file
            .as_mut()
            .expect("a spool has its file until finished")
            .write_all(chunk)?;
        Ok(())
    }
}

impl Drop for BlobSpool {
    fn drop(&mut self) {
        if self.file.is_some() {
            let _ = fs::remove_file(&self.temp);
        }
    }
}

pub struct Staging {
    dir: PathBuf,
    /// Archive paths (or, for a pull, nothing) -> the blob holding them.
    files: BTreeMap<String, Digest>,
    /// Symbolic links in an archive (older `docker save` links repeated layers).
    links: BTreeMap<String, String>,
    spooled: u64,
    pub limits: SpoolLimits,
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Staging {
    /// A fresh private directory under `parent` (created, mode 0700).
    pub fn new(parent: &Path, limits: SpoolLimits) -> io::Result<Self> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)?;
        let dir = parent.join(format!("import-{:016x}", rand::random::<u64>()));
        fs::DirBuilder::new().mode(0o700).create(&dir)?;
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir.join("blobs"))?;
        Ok(Self {
            dir,
            files: BTreeMap::new(),
            links: BTreeMap::new(),
            spooled: 0,
            limits,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn blob_path(&self, digest: &Digest) -> PathBuf {
        self.dir.join("blobs").join(digest.hex())
    }

    /// A scratch file path in the staging directory (removed with it).
    pub fn scratch(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Starts a blob that arrives in pieces (a registry download): hashed as it is
    /// written; with `expected`, content whose digest or size differs is refused (a
    /// truncated or altered download). Nothing is visible until `finish`.
    pub fn begin_blob(
        &mut self,
        expected: Option<(Digest, u64)>,
        what: &str,
    ) -> Result<BlobSpool, OciError> {
        let temp = self
            .dir
            .join(format!(".part-{:016x}", rand::random::<u64>()));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temp)?;
        Ok(BlobSpool {
            file: Some(file),
            temp,
            hasher: Sha256::new(),
            size: 0,
            expected,
            what: what.to_string(),
            room: self.limits.max_bytes.saturating_sub(self.spooled),
        })
    }

    /// Stores the whole of `input` as one blob (see `begin_blob`).
    pub fn add_blob(
        &mut self,
        input: &mut dyn Read,
        expected: Option<(Digest, u64)>,
        what: &str,
    ) -> Result<Digest, OciError> {
        let mut spool = self.begin_blob(expected, what)?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = match input.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(OciError::Refused(format!("{what}: {e}"))),
            };
            spool.write(&buf[..n])?;
        }
        self.finish_blob(spool)
    }

    /// Makes a spooled blob visible under its digest, once checked.
    pub fn finish_blob(&mut self, mut spool: BlobSpool) -> Result<Digest, OciError> {
        let digest = Digest::from_hasher(std::mem::take(&mut spool.hasher));
        if let Some((want, want_size)) = spool.expected
            && (digest != want || spool.size != want_size)
        {
            return Err(OciError::Refused(format!(
                "{} does not match its descriptor: {} bytes hashing to {digest}, expected {want_size} bytes hashing to {want} (truncated or altered)",
                spool.what, spool.size
            )));
        }
        drop(spool.file.take());
        fs::rename(&spool.temp, self.blob_path(&digest))?;
        self.spooled += spool.size;
        Ok(digest)
    }

    /// Spools an uploaded archive: every file becomes a blob, its path remembered.
    pub fn spool_archive(&mut self, input: impl Read) -> Result<(), OciError> {
        let mut archive = tar::Archive::new(TarGuard::new(input));
        let bad =
            |e: io::Error| OciError::Refused(format!("the archive is not a readable tar: {e}"));
        for entry in archive.entries().map_err(bad)? {
            let mut entry = entry.map_err(bad)?;
            if self.files.len() + self.links.len() >= self.limits.max_files {
                return Err(OciError::Refused(format!(
                    "the archive has more than {} files",
                    self.limits.max_files
                )));
            }
            let raw = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
            let kind = entry.header().entry_type();
            let path = match normalize_path(&raw) {
                Ok(p) => p,
                Err(_) if kind == EntryType::Directory => continue,
                Err(e) => return Err(OciError::Refused(format!("archive entry {raw:?}: {e}"))),
            };
            match kind {
                EntryType::Directory | EntryType::XGlobalHeader => {}
                EntryType::Regular | EntryType::Continuous => {
                    let digest =
                        self.add_blob(&mut entry, None, &format!("archive entry {path:?}"))?;
                    // An OCI layout names blobs by digest: the name must be the content.
                    if let Some(hex) = path.strip_prefix("blobs/sha256/")
                        && hex != digest.hex()
                    {
                        return Err(OciError::Refused(format!(
                            "archive entry {path:?} hashes to {digest}: truncated or altered"
                        )));
                    }
                    self.files.insert(path, digest);
                }
                EntryType::Symlink | EntryType::Link => {
                    let target = entry
                        .link_name_bytes()
                        .map(|t| String::from_utf8_lossy(&t).into_owned())
                        .unwrap_or_default();
                    let base = if kind == EntryType::Symlink {
                        path.rsplit_once('/').map(|(dir, _)| dir).unwrap_or("")
                    } else {
                        ""
                    };
                    let resolved = lexical_join(base, &target).ok_or_else(|| {
                        OciError::Refused(format!(
                            "archive link {path:?} -> {target:?} leaves the archive"
                        ))
                    })?;
                    self.links.insert(path, resolved);
                }
                other => {
                    return Err(OciError::Refused(format!(
                        "archive entry {path:?}: entry type {other:?} has no place in an image archive"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The blob an archive path holds (links followed).
    fn file(&self, path: &str) -> Option<Digest> {
        let mut path = path.to_string();
        for _ in 0..8 {
            if let Some(d) = self.files.get(&path) {
                return Some(*d);
            }
            path = self.links.get(&path)?.clone();
        }
        None
    }

    fn read_json<T: serde::de::DeserializeOwned>(
        &self,
        digest: &Digest,
        what: &str,
    ) -> Result<T, OciError> {
        let path = self.blob_path(digest);
        let size = fs::metadata(&path)?.len();
        if size > self.limits.max_json_bytes {
            return Err(OciError::Refused(format!(
                "{what} is {size} bytes, over the {} bytes a document may have",
                self.limits.max_json_bytes
            )));
        }
        let bytes = fs::read(&path)?;
        serde_json::from_slice(&bytes)
            .map_err(|e| OciError::Refused(format!("{what} is not valid: {e}")))
    }

    /// The image in a spooled archive: OCI (`index.json`) or Docker (`manifest.json`).
    /// `reference` picks one image of several by its ref name or repo tag.
    pub fn archive_image(&self, reference: Option<&str>) -> Result<OciImage, OciError> {
        if let Some(index) = self.file("index.json") {
            let index: Index = self.read_json(&index, "index.json")?;
            let chosen = choose_manifest(&index, reference)?;
            return self.image_from_descriptor(&chosen.digest, chosen.size, &chosen.media_type);
        }
        if let Some(manifest) = self.file("manifest.json") {
            let images: Vec<DockerArchiveImage> = self.read_json(&manifest, "manifest.json")?;
            return self.docker_archive_image(&images, reference);
        }
        Err(OciError::Refused(
            "the archive has neither index.json (an OCI layout) nor manifest.json (docker save)"
                .into(),
        ))
    }

    /// The image a manifest (or index) blob describes; an index picks linux/amd64.
    pub fn image_from_descriptor(
        &self,
        digest: &Digest,
        size: u64,
        media_type: &str,
    ) -> Result<OciImage, OciError> {
        self.check_blob(digest, size, "the manifest")?;
        if media_type == OCI_INDEX || media_type == DOCKER_LIST {
            let index: Index = self.read_json(digest, "the image index")?;
            let chosen = choose_platform(&index)?;
            return self.image_from_descriptor(&chosen.digest, chosen.size, &chosen.media_type);
        }
        let manifest: ImageManifest = self.read_json(digest, "the manifest")?;
        self.image_from_manifest(&manifest)
    }

    /// The image an image manifest describes, every blob it names checked.
    pub fn image_from_manifest(&self, manifest: &ImageManifest) -> Result<OciImage, OciError> {
        let config_desc = &manifest.config;
        self.check_blob(&config_desc.digest, config_desc.size, "the image config")?;
        let config: ImageConfig = self.read_json(&config_desc.digest, "the image config")?;
        check_config(&config, manifest.layers.len())?;
        let mut layers = Vec::new();
        for (i, (desc, diff_id)) in manifest
            .layers
            .iter()
            .zip(&config.rootfs.diff_ids)
            .enumerate()
        {
            let what = format!("layer {} ({})", i + 1, desc.digest);
            self.check_blob(&desc.digest, desc.size, &what)?;
            let compression = Compression::of_media_type(&desc.media_type).ok_or_else(|| {
                OciError::Refused(format!(
                    "{what} has media type {:?}, which is not a layer this import reads",
                    desc.media_type
                ))
            })?;
            layers.push(LayerBlob {
                path: self.blob_path(&desc.digest),
                compression,
                diff_id: *diff_id,
            });
        }
        Ok(OciImage {
            config_digest: config_desc.digest,
            layers,
        })
    }

    fn docker_archive_image(
        &self,
        images: &[DockerArchiveImage],
        reference: Option<&str>,
    ) -> Result<OciImage, OciError> {
        let tags = |i: &DockerArchiveImage| i.repo_tags.clone().unwrap_or_default();
        let image = match (images, reference) {
            ([one], None) => one,
            (_, Some(r)) => images
                .iter()
                .find(|i| tags(i).iter().any(|t| t == r))
                .ok_or_else(|| {
                    OciError::Refused(format!("the archive has no image tagged {r:?}"))
                })?,
            ([], None) => return Err(OciError::Refused("manifest.json lists no image".into())),
            (several, None) => {
                return Err(OciError::Refused(format!(
                    "the archive holds {} images ({}): name one with docker-archive:PATH:TAG",
                    several.len(),
                    several.iter().flat_map(tags).collect::<Vec<_>>().join(", ")
                )));
            }
        };
        let config_digest = self.file(&image.config).ok_or_else(|| {
            OciError::Refused(format!(
                "manifest.json names config {:?}, which the archive lacks",
                image.config
            ))
        })?;
        let config: ImageConfig = self.read_json(&config_digest, "the image config")?;
        check_config(&config, image.layers.len())?;
        let mut layers = Vec::new();
        for (i, (path, diff_id)) in image.layers.iter().zip(&config.rootfs.diff_ids).enumerate() {
            let digest = self.file(path).ok_or_else(|| {
                OciError::Refused(format!(
                    "manifest.json names layer {path:?}, which the archive lacks"
                ))
            })?;
            let blob = self.blob_path(&digest);
            let mut head = [0u8; 4];
            let n = File::open(&blob)?.read(&mut head)?;
            let compression = Compression::sniff(&head[..n]);
            if compression == Compression::None && digest != *diff_id {
                return Err(OciError::Refused(format!(
                    "layer {} ({path}) hashes to {digest}, but the image config says {diff_id}",
                    i + 1
                )));
            }
            layers.push(LayerBlob {
                path: blob,
                compression,
                diff_id: *diff_id,
            });
        }
        Ok(OciImage {
            config_digest,
            layers,
        })
    }

    /// A blob a descriptor names is here, whole.
    fn check_blob(&self, digest: &Digest, size: u64, what: &str) -> Result<(), OciError> {
        match fs::metadata(self.blob_path(digest)) {
            Ok(m) if m.len() == size => Ok(()),
            Ok(m) => Err(OciError::Refused(format!(
                "{what} ({digest}) is {} bytes, its descriptor says {size}",
                m.len()
            ))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                Err(OciError::Refused(format!("{what} ({digest}) is missing")))
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// `target` relative to the archive directory `base`, `..` resolved lexically; None when
/// it climbs above the archive's root (or is absolute).
fn lexical_join(base: &str, target: &str) -> Option<String> {
    if target.starts_with('/') {
        return None;
    }
    let mut parts: Vec<&str> = base.split('/').filter(|p| !p.is_empty()).collect();
    for part in target.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            other => parts.push(other),
        }
    }
    normalize_path(&parts.join("/")).ok()
}

fn check_config(config: &ImageConfig, layers: usize) -> Result<(), OciError> {
    if config.os != "linux" || config.architecture != "amd64" {
        return Err(OciError::Refused(format!(
            "the image is for {}/{}; bootfleet boots linux/amd64 images",
            config.os, config.architecture
        )));
    }
    if config.rootfs.kind != "layers" || config.rootfs.diff_ids.len() != layers {
        return Err(OciError::Refused(format!(
            "the image config lists {} layer digests for {layers} layers",
            config.rootfs.diff_ids.len()
        )));
    }
    if layers == 0 {
        return Err(OciError::Refused("the image has no layers".into()));
    }
    Ok(())
}

/// The manifest of an OCI layout's index: the one named `reference`, else the only one.
fn choose_manifest<'a>(
    index: &'a Index,
    reference: Option<&str>,
) -> Result<&'a super::spec::Descriptor, OciError> {
    let name = |d: &super::spec::Descriptor| d.annotations.get(REF_NAME).cloned();
    match (index.manifests.as_slice(), reference) {
        (_, Some(r)) => index
            .manifests
            .iter()
            .find(|d| name(d).as_deref() == Some(r))
            .ok_or_else(|| OciError::Refused(format!("the layout has no image named {r:?}"))),
        ([one], None) => Ok(one),
        ([], None) => Err(OciError::Refused("index.json lists no image".into())),
        (several, None) => Err(OciError::Refused(format!(
            "the layout holds {} images ({}): name one as oci-archive:PATH:NAME",
            several.len(),
            several
                .iter()
                .filter_map(name)
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// The linux/amd64 entry of a multi-platform index.
fn choose_platform(index: &Index) -> Result<&super::spec::Descriptor, OciError> {
    index
        .manifests
        .iter()
        .find(|d| d.platform.as_ref().is_some_and(is_wanted_platform))
        .ok_or_else(|| {
            OciError::Refused(format!(
                "the image index has no linux/amd64 image (it has {})",
                index
                    .manifests
                    .iter()
                    .filter_map(|d| d
                        .platform
                        .as_ref()
                        .map(|p| format!("{}/{}", p.os, p.architecture)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
}
