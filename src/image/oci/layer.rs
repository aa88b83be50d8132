//! Reading one layer blob: decompressed, hashed (its uncompressed digest must be the
//! config's `diff_id`), each tar header turned into a tree `Entry`. Contents are skipped,
//! except those a caller asks to keep (small files the import reads, such as
//! `modules.dep`).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::Path;

use sha2::{Digest as _, Sha256};
use tar::EntryType;

use super::spec::Compression;
use super::tree::{Entry, EntryKind, Meta, Origin};
use crate::api::Digest;
use crate::image::tar_guard::TarGuard;

/// A layer blob on disk and how it is compressed.
#[derive(Debug, Clone)]
pub struct LayerBlob {
    pub path: std::path::PathBuf,
    pub compression: Compression,
    /// The digest of the uncompressed tar (the config's `diff_id`).
    pub diff_id: Digest,
}

/// The uncompressed tar stream of a layer blob.
pub fn open(path: &Path, compression: Compression) -> io::Result<Box<dyn Read + Send>> {
    let file = BufReader::with_capacity(1 << 20, File::open(path)?);
    Ok(match compression {
        Compression::None => Box::new(file),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(file)),
        Compression::Zstd => Box::new(zstd::stream::read::Decoder::with_buffer(file)?),
    })
}

/// A reader that hashes what passes through it.
pub struct Hashing<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> Hashing<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
        }
    }

    /// Reads what is left and returns the digest of everything read.
    pub fn finish(mut self) -> io::Result<Digest> {
        io::copy(&mut self, &mut io::sink())?;
        Ok(Digest::from_hasher(self.hasher))
    }
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Decides whether an entry's bytes are kept (returned with the entries), by its name as
/// written and its size. Kept files are read into memory: keep only small ones.
pub type Keep<'a> = &'a dyn Fn(&[u8], u64) -> bool;

/// What pass one may still take of an import, over all its layers: each bound is
/// checked at the entry's header, before its bytes are read, so a hostile layer is
/// refused at the first entry past one (a decompression bomb at its declared size).
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub entries: usize,
    /// Names, link targets and xattrs held in memory for the tree.
    pub metadata_bytes: u64,
    /// Declared file bytes over all layers (a file replaced later counts too).
    pub content_bytes: u64,
    /// Bytes of small files kept in memory (`Keep`).
    pub kept_bytes: u64,
}

impl Budget {
    /// Tree metadata held in memory at most (names, links, xattrs).
    pub const METADATA_BYTES: u64 = 512 << 20;
    /// Small files kept in memory at most.
    pub const KEPT_BYTES: u64 = 64 << 20;

    pub fn for_rules(rules: &super::tree::Rules) -> Self {
        Self {
            entries: rules.max_entries,
            metadata_bytes: Self::METADATA_BYTES,
            content_bytes: rules.max_root_bytes.saturating_mul(2),
            kept_bytes: Self::KEPT_BYTES,
        }
    }

    /// Takes what `entry` costs; why not, when it is over.
    fn take(&mut self, entry: &Entry) -> Result<(), String> {
        let over = |what: &str| format!("the image passes the import's limit on {what}");
        self.entries = self
            .entries
            .checked_sub(1)
            .ok_or_else(|| over("entries (max_entries)"))?;
        let link = match &entry.kind {
            EntryKind::Symlink(t) | EntryKind::HardLink(t) => t.len(),
            _ => 0,
        };
        let xattrs: usize = entry
            .meta
            .xattrs
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum();
        let metadata = (entry.path.len() + link + xattrs + 128) as u64;
        self.metadata_bytes = self
            .metadata_bytes
            .checked_sub(metadata)
            .ok_or_else(|| over("names, links and extended attributes"))?;
        if let EntryKind::File { size } = entry.kind {
            self.content_bytes = self
                .content_bytes
                .checked_sub(size)
                .ok_or_else(|| over("file bytes over all layers (max_root_bytes x 2)"))?;
        }
        Ok(())
    }
}

/// What pass one learns of a layer.
pub struct LayerRead {
    pub entries: Vec<Entry>,
    /// The bytes of the entries `keep` chose, by origin.
    pub kept: BTreeMap<Origin, Vec<u8>>,
}

/// Reads the layer's headers (index `layer` in the manifest), checking its diff_id; each
/// entry is charged to `budget` before anything of it is read.
pub fn read_entries(
    blob: &LayerBlob,
    layer: u32,
    keep: Keep<'_>,
    budget: &mut Budget,
) -> Result<LayerRead, String> {
    let stream = open(&blob.path, blob.compression).map_err(|e| e.to_string())?;
    let mut hashing = Hashing::new(stream);
    let mut read = LayerRead {
        entries: Vec::new(),
        kept: BTreeMap::new(),
    };
    {
        let mut archive = tar::Archive::new(TarGuard::new(&mut hashing));
        for (index, entry) in archive.entries().map_err(|e| e.to_string())?.enumerate() {
            let mut entry = entry.map_err(|e| format!("unreadable tar: {e}"))?;
            let origin = Origin {
                layer,
                entry: u32::try_from(index).map_err(|_| "too many entries".to_string())?,
            };
            let Some(parsed) = entry_of(&mut entry, origin)? else {
                continue;
            };
            budget.take(&parsed)?;
            if let EntryKind::File { size } = parsed.kind
                && keep(&parsed.path, size)
            {
                budget.kept_bytes = budget.kept_bytes.checked_sub(size).ok_or(
                    "the image has more kernel module lists and version files than an import keeps (64 MiB)",
                )?;
                let mut bytes = Vec::with_capacity(size as usize);
                entry
                    .read_to_end(&mut bytes)
                    .map_err(|e| format!("unreadable tar: {e}"))?;
                read.kept.insert(origin, bytes);
            }
            read.entries.push(parsed);
        }
    }
    let found = hashing.finish().map_err(|e| format!("unreadable: {e}"))?;
    if found != blob.diff_id {
        return Err(format!(
            "its uncompressed content is {found}, but the image config says {}",
            blob.diff_id
        ));
    }
    Ok(read)
}

/// The tree entry a tar entry describes; None for entries that describe nothing in the
/// root (PAX global headers).
pub fn entry_of<R: Read>(
    entry: &mut tar::Entry<'_, R>,
    origin: Origin,
) -> Result<Option<Entry>, String> {
    let path = entry.path_bytes().into_owned();
    let name = || String::from_utf8_lossy(&path).into_owned();
    let header = entry.header();
    let kind_of = header.entry_type();
    let link = || {
        entry
            .link_name_bytes()
            .map(|l| l.into_owned())
            .ok_or_else(|| format!("entry {:?}: a link without a target", name()))
    };
    let device = || -> Result<(u32, u32), String> {
        let major = header.device_major().ok().flatten().unwrap_or(0);
        let minor = header.device_minor().ok().flatten().unwrap_or(0);
        Ok((major, minor))
    };
    let kind = match kind_of {
        EntryType::Regular | EntryType::Continuous => EntryKind::File { size: entry.size() },
        EntryType::Directory => EntryKind::Dir,
        EntryType::Symlink => EntryKind::Symlink(link()?),
        EntryType::Link => EntryKind::HardLink(link()?),
        EntryType::Char => {
            let (a, b) = device()?;
            EntryKind::Char(a, b)
        }
        EntryType::Block => {
            let (a, b) = device()?;
            EntryKind::Block(a, b)
        }
        EntryType::Fifo => EntryKind::Fifo,
        EntryType::XGlobalHeader => return Ok(None),
        other => {
            return Err(format!(
                "entry {:?}: tar entry type {other:?} is not supported",
                name()
            ));
        }
    };
    let mut meta = Meta {
        mode: header
            .mode()
            .map_err(|e| format!("entry {:?}: {e}", name()))?
            & 0o7777,
        uid: header.uid().unwrap_or(0),
        gid: header.gid().unwrap_or(0),
        mtime: header.mtime().unwrap_or(0),
        xattrs: BTreeMap::new(),
    };
    if let Some(pax) = entry
        .pax_extensions()
        .map_err(|e| format!("entry {:?}: {e}", name()))?
    {
        for ext in pax {
            let ext = ext.map_err(|e| format!("entry {:?}: {e}", name()))?;
            let Ok(key) = ext.key() else { continue };
            let number = || {
                ext.value()
                    .ok()
                    .and_then(|v| v.split('.').next())
                    .and_then(|v| v.parse::<u64>().ok())
            };
            if let Some(attr) = key.strip_prefix("SCHILY.xattr.") {
                meta.xattrs
                    .insert(attr.to_string(), ext.value_bytes().to_vec());
            } else if key == "uid" {
                meta.uid = number().unwrap_or(meta.uid);
            } else if key == "gid" {
                meta.gid = number().unwrap_or(meta.gid);
            } else if key == "mtime" {
                meta.mtime = number().unwrap_or(meta.mtime);
            }
        }
    }
    Ok(Some(Entry {
        path,
        kind,
        meta,
        origin,
    }))
}
