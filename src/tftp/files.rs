//! What TFTP may serve: iPXE binaries from the configured directory and blobs by digest
//! (`blobs/sha256/<hex>`). Names are checked before any filesystem access; small files
//! are served from memory.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use bytes::Bytes;

use crate::api::Digest;
use crate::image::blobstore::BlobStore;
use crate::image::bundle_path::normalize_path_within;

/// Longest file name accepted; iPXE and firmware names are far shorter.
pub const MAX_NAME_LEN: usize = 255;
/// Files up to this size are kept in memory once read (iPXE binaries are 70 KiB-1 MiB).
pub const CACHE_MAX_FILE: u64 = 8 << 20;

/// Why a requested name is refused: the bundle path rules, with TFTP's length limit.
pub use crate::image::bundle_path::PathError as NameError;

/// The contents to send: shared memory for cached files, else an open file.
pub enum Content {
    Memory(Bytes),
    File(Arc<std::fs::File>),
}

pub struct Opened {
    pub content: Content,
    pub len: u64,
}

struct Cached {
    len: u64,
    modified: Option<SystemTime>,
    bytes: Bytes,
}

pub struct FileSource {
    ipxe_dir: Option<PathBuf>,
    blobs: Option<Arc<BlobStore>>,
    cache: Mutex<HashMap<PathBuf, Cached>>,
}

/// Files made on request rather than read from disk: GRUB's configuration, per node.
/// The TFTP server asks before it looks on disk; the server's node service answers.
#[async_trait::async_trait]
pub trait Generated: Send + Sync {
    /// The contents of `path` (checked) with its `query` (after `?`, as GRUB appends one),
    /// asked by `client` at our `local` address; None when `path` is not one of these.
    async fn generate(
        &self,
        path: &str,
        query: Option<&str>,
        client: std::net::IpAddr,
        local: std::net::IpAddr,
    ) -> Option<Bytes>;
}

/// Makes a blob present in the blob directory before TFTP opens it: a server with an
/// object store fills its cache from it (verified before it is visible). Asked for every
/// `blobs/sha256/<hex>` name, on the TFTP runtime.
#[async_trait::async_trait]
pub trait BlobFill: Send + Sync {
    /// Ok when the blob is there now, or is known nowhere (the open then answers "file
    /// not found"); Err with why it cannot be served now (the object store is away).
    async fn fill(&self, digest: &Digest) -> Result<(), String>;
}

/// The digest a checked name asks for, when it is a blob's (`blobs/sha256/<hex>`).
pub fn blob_digest(name: &str) -> Option<Digest> {
    Digest::from_hex(name.strip_prefix("blobs/sha256/")?).ok()
}

/// A requested name split at its first `?`: the path, and the query GRUB appends to
/// per-boot names (`blobs/sha256/<hex>?boot=<id>`).
pub fn split_query(name: &str) -> (&str, Option<&str>) {
    match name.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (name, None),
    }
}

/// Checks a requested name and returns its normalised form.
pub fn check_name(name: &str) -> Result<String, NameError> {
    normalize_path_within(name, MAX_NAME_LEN)
}

impl FileSource {
    pub fn new(ipxe_dir: Option<PathBuf>, blobs: Option<Arc<BlobStore>>) -> Self {
        Self {
            ipxe_dir,
            blobs,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Maps a checked name to a path: blobs by digest, everything else in the iPXE dir.
    fn path_of(&self, name: &str) -> Option<PathBuf> {
        if name.starts_with("blobs/sha256/") {
            let digest = blob_digest(name)?;
            return self.blobs.as_ref().map(|b| b.path_of(&digest));
        }
        self.ipxe_dir.as_ref().map(|d| d.join(name))
    }

    /// Opens `name` (already checked) for reading; blocking (stat, maybe a read).
    pub fn open(&self, name: &str) -> std::io::Result<Opened> {
        let not_found = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let path = self.path_of(name).ok_or_else(not_found)?;
        let file = std::fs::File::open(&path)?;
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Err(not_found());
        }
        let len = meta.len();
        if len > CACHE_MAX_FILE {
            return Ok(Opened {
                content: Content::File(Arc::new(file)),
                len,
            });
        }
        let modified = meta.modified().ok();
        let cache = self.cache.lock().expect("cache lock");
        if let Some(c) = cache.get(&path)
            && c.len == len
            && c.modified == modified
        {
            return Ok(Opened {
                content: Content::Memory(c.bytes.clone()),
                len,
            });
        }
        drop(cache);
        let mut buf = Vec::with_capacity(len as usize);
        std::io::Read::read_to_end(&mut std::io::Read::take(&file, len), &mut buf)?;
        let bytes = Bytes::from(buf);
        let len = bytes.len() as u64;
        self.cache.lock().expect("cache lock").insert(
            path,
            Cached {
                len,
                modified,
                bytes: bytes.clone(),
            },
        );
        Ok(Opened {
            content: Content::Memory(bytes),
            len,
        })
    }
}

impl Content {
    /// Bytes `start..end`: a slice of memory, or one positioned read on the blocking pool.
    pub async fn range(&self, start: u64, end: u64) -> std::io::Result<Bytes> {
        match self {
            Content::Memory(b) => Ok(b.slice(start as usize..end as usize)),
            Content::File(f) => {
                let f = f.clone();
                tokio::task::spawn_blocking(move || {
                    use std::os::unix::fs::FileExt;
                    let mut buf = vec![0u8; (end - start) as usize];
                    f.read_exact_at(&mut buf, start)?;
                    Ok(Bytes::from(buf))
                })
                .await
                .map_err(std::io::Error::other)?
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let check = |n: &str, e: Result<&str, NameError>| {
            assert_eq!(check_name(n), e.map(String::from), "{n:?}")
        };
        check("undionly.kpxe", Ok("undionly.kpxe"));
        check("./efi//ipxe.efi", Ok("efi/ipxe.efi"));
        check("../etc/passwd", Err(NameError::ParentDir));
        check("a/../../x", Err(NameError::ParentDir));
        check("/etc/passwd", Err(NameError::Absolute));
        check("a\\b", Err(NameError::BadCharacter));
        check("a\u{1}b", Err(NameError::BadCharacter));
        check("", Err(NameError::Empty));
        check(&"a".repeat(300), Err(NameError::TooLong(MAX_NAME_LEN)));
    }

    #[test]
    fn serves_from_memory_and_sees_changes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.bin"), b"first").unwrap();
        let files = FileSource::new(Some(dir.path().to_path_buf()), None);
        let read = |f: &FileSource| match f.open("a.bin").unwrap().content {
            Content::Memory(b) => b.to_vec(),
            Content::File(_) => panic!("small files come from memory"),
        };
        assert_eq!(read(&files), b"first");
        assert_eq!(read(&files), b"first");
        std::fs::write(dir.path().join("a.bin"), b"second!").unwrap();
        assert_eq!(read(&files), b"second!");
        assert!(files.open("missing").is_err());
        assert!(files.open("blobs/sha256/zz").is_err());
    }
}
