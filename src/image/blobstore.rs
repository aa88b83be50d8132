//! Content-addressed blob store on local disk: `blobs/sha256/<hex>`, written atomically.
//!
//! A blob becomes visible only by `rename` of a complete, fsynced, hashed temp file that
//! lives in the same directory (`.tmp-*`, never served, removed at start). Corrupt blobs
//! found by `verify` move to `quarantine/sha256/<hex>`, out of reach of the blob route.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest as _, Sha256};

use crate::api::Digest;

const TMP_PREFIX: &str = ".tmp-";

#[derive(Debug)]
pub struct BlobStore {
    dir: PathBuf,
    quarantine: PathBuf,
    /// Counts blobs leaving the directory (collected, evicted, quarantined), bumped
    /// before each goes: a reader that saw a blob there at count N knows it is there
    /// still while the count is N, without asking the filesystem (`removals`).
    removals: AtomicU64,
}

/// A blob being written: hashed as it is received.
pub struct TempBlobWriter {
    file: File,
    hasher: Sha256,
    size: u64,
    guard: TempPath,
}

/// A complete temp blob, fsynced, with its digest. Deleted on drop unless committed.
#[derive(Debug)]
pub struct TempBlob {
    pub digest: Digest,
    pub size: u64,
    guard: TempPath,
}

#[derive(Debug)]
struct TempPath(Option<PathBuf>);

impl Drop for TempPath {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VerifyReport {
    pub checked: usize,
    pub bytes: u64,
    /// Blobs whose content no longer matches their name; now quarantined.
    pub quarantined: Vec<Digest>,
}

impl BlobStore {
    /// Opens (creating) the store under `data_dir` and removes temp files left by a crash.
    pub fn open(data_dir: &Path) -> io::Result<Self> {
        let dir = data_dir.join("blobs").join("sha256");
        let quarantine = data_dir.join("quarantine").join("sha256");
        fs::create_dir_all(&dir)?;
        fs::create_dir_all(&quarantine)?;
        let store = Self {
            dir,
            quarantine,
            removals: AtomicU64::new(0),
        };
        for entry in fs::read_dir(&store.dir)? {
            let entry = entry?;
            if entry.file_name().to_string_lossy().starts_with(TMP_PREFIX) {
                fs::remove_file(entry.path())?;
            }
        }
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path_of(&self, digest: &Digest) -> PathBuf {
        self.dir.join(digest.hex())
    }

    pub fn contains(&self, digest: &Digest) -> bool {
        self.path_of(digest).is_file()
    }

    /// How many blobs have left the directory so far: a blob seen there when this was N
    /// is there still while it is N. This store is the only remover of its blobs (one per
    /// data directory, and every removal goes through it).
    pub fn removals(&self) -> u64 {
        self.removals.load(Ordering::Acquire)
    }

    /// Counted before the blob goes, so that no reader trusts an older sighting after.
    fn removing(&self) {
        self.removals.fetch_add(1, Ordering::AcqRel);
    }

    /// Bytes an unprivileged writer may still put in the blob directory's filesystem.
    pub fn available_bytes(&self) -> io::Result<u64> {
        let stat = nix::sys::statvfs::statvfs(self.dir()).map_err(io::Error::from)?;
        Ok(stat.blocks_available() as u64 * stat.fragment_size() as u64)
    }

    pub fn temp_writer(&self) -> io::Result<TempBlobWriter> {
        let name = format!("{TMP_PREFIX}{:016x}", rand::random::<u64>());
        let path = self.dir.join(name);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)?;
        Ok(TempBlobWriter {
            file,
            hasher: Sha256::new(),
            size: 0,
            guard: TempPath(Some(path)),
        })
    }

    /// Makes temp blobs visible under their digests, then fsyncs the directory once.
    /// A blob already present is kept (same name, same bytes) and the temp is dropped.
    pub fn commit(&self, temps: Vec<TempBlob>) -> io::Result<()> {
        for mut temp in temps {
            let target = self.path_of(&temp.digest);
            if target.exists() {
                continue; // `temp` drops and removes its file
            }
            let from = temp.guard.0.take().expect("temp blob has a path");
            if let Err(e) = fs::rename(&from, &target) {
                temp.guard.0 = Some(from);
                return Err(e);
            }
        }
        File::open(&self.dir)?.sync_all()
    }

    /// Every stored (visible) blob.
    pub fn list(&self) -> io::Result<Vec<Digest>> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir)? {
            let name = entry?.file_name();
            if let Some(d) = name.to_str().and_then(|n| Digest::from_hex(n).ok()) {
                out.push(d);
            }
        }
        out.sort();
        Ok(out)
    }

    /// Removes the blobs written longest ago (by mtime: when they were filled) until the
    /// directory holds at most `max_bytes`, never `keep`. Only for a directory that is a
    /// cache of an object store: here the blobs are copies.
    pub fn evict_oldest(&self, max_bytes: u64, keep: &Digest) -> io::Result<u64> {
        let mut held = Vec::new();
        let mut total = 0;
        for digest in self.list()? {
            let Ok(meta) = fs::metadata(self.path_of(&digest)) else {
                continue;
            };
            total += meta.len();
            held.push((meta.modified()?, meta.len(), digest));
        }
        held.sort();
        let mut evicted = 0;
        for (_, len, digest) in held {
            if total <= max_bytes {
                break;
            }
            if digest == *keep {
                continue;
            }
            // Another fill may have evicted it first.
            self.removing();
            match fs::remove_file(self.path_of(&digest)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            total -= len;
            evicted += len;
        }
        Ok(evicted)
    }

    /// Re-hashes every blob; moves the ones that no longer match to quarantine.
    pub fn verify(&self) -> io::Result<VerifyReport> {
        let mut report = VerifyReport {
            checked: 0,
            bytes: 0,
            quarantined: Vec::new(),
        };
        for digest in self.list()? {
            let path = self.path_of(&digest);
            let (actual, size) = match hash_file(&path) {
                Ok(v) => v,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            report.checked += 1;
            report.bytes += size;
            if actual != digest {
                tracing::warn!(%digest, %actual, "blob content does not match its digest; quarantined");
                self.removing();
                fs::rename(&path, self.quarantine.join(digest.hex()))?;
                report.quarantined.push(digest);
            }
        }
        File::open(&self.dir)?.sync_all()?;
        Ok(report)
    }

    /// Removes every blob not in `keep`; returns what was removed and how many bytes.
    pub fn remove_unreferenced(&self, keep: &HashSet<Digest>) -> io::Result<(Vec<Digest>, u64)> {
        let mut removed = Vec::new();
        let mut bytes = 0;
        for digest in self.list()? {
            if keep.contains(&digest) {
                continue;
            }
            let path = self.path_of(&digest);
            bytes += fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            self.removing();
            fs::remove_file(&path)?;
            removed.push(digest);
        }
        File::open(&self.dir)?.sync_all()?;
        Ok((removed, bytes))
    }
}

/// A temp file in the blob directory for a tool to write (mksquashfs, veritysetup):
/// removed on drop unless `adopt`ed.
#[derive(Debug)]
pub struct ScratchBlob(TempPath);

impl ScratchBlob {
    pub fn path(&self) -> &Path {
        self.0
            .0
            .as_deref()
            .expect("a scratch blob has its path until adopted")
    }
}

impl BlobStore {
    /// A path for a blob a tool writes; nothing is created yet.
    pub fn scratch(&self) -> ScratchBlob {
        let name = format!("{TMP_PREFIX}{:016x}", rand::random::<u64>());
        ScratchBlob(TempPath(Some(self.dir.join(name))))
    }

    /// The finished scratch file as a temp blob: hashed and fsynced.
    pub fn adopt(&self, scratch: ScratchBlob) -> io::Result<TempBlob> {
        let (digest, size) = hash_file(scratch.path())?;
        File::open(scratch.path())?.sync_all()?;
        Ok(TempBlob {
            digest,
            size,
            guard: scratch.0,
        })
    }
}

impl TempBlob {
    /// Where the temp blob lies until it is committed.
    pub fn path(&self) -> &Path {
        self.guard
            .0
            .as_deref()
            .expect("a temp blob has its path until committed")
    }
}

impl TempBlobWriter {
    /// Flushes and fsyncs the file and returns it with its digest.
    pub fn finish(self) -> io::Result<TempBlob> {
        self.file.sync_all()?;
        Ok(TempBlob {
            digest: Digest::from_hasher(self.hasher),
            size: self.size,
            guard: self.guard,
        })
    }
}

impl Write for TempBlobWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.file.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.size += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

pub fn hash_file(path: &Path) -> io::Result<(Digest, u64)> {
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((Digest::from_hasher(hasher), size))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(store: &BlobStore, bytes: &[u8]) -> Digest {
        let mut w = store.temp_writer().unwrap();
        w.write_all(bytes).unwrap();
        let t = w.finish().unwrap();
        let d = t.digest;
        store.commit(vec![t]).unwrap();
        d
    }

    fn tmp_files(store: &BlobStore) -> usize {
        fs::read_dir(store.dir())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with(TMP_PREFIX)
            })
            .count()
    }

    #[test]
    fn stores_once_verifies_and_quarantines() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let a = put(&store, b"alpha");
        assert_eq!(a, Digest::of(b"alpha"));
        assert_eq!(put(&store, b"alpha"), a);
        assert_eq!(store.list().unwrap(), vec![a]);
        assert_eq!(tmp_files(&store), 0);

        let b = put(&store, b"beta");
        fs::write(store.path_of(&b), b"bent").unwrap();
        let report = store.verify().unwrap();
        assert_eq!(report.checked, 2);
        assert_eq!(report.quarantined, vec![b]);
        assert!(!store.contains(&b));
        assert!(store.contains(&a));
    }

    #[test]
    fn dropped_temps_vanish_and_crash_leftovers_are_swept() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let mut w = store.temp_writer().unwrap();
        w.write_all(b"partial").unwrap();
        drop(w);
        let t = {
            let mut w = store.temp_writer().unwrap();
            w.write_all(b"complete").unwrap();
            w.finish().unwrap()
        };
        drop(t);
        assert_eq!(tmp_files(&store), 0);
        fs::write(store.dir().join(".tmp-leftover"), b"x").unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        assert_eq!(tmp_files(&store), 0);
    }

    #[test]
    fn gc_keeps_what_is_referenced() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let a = put(&store, b"a");
        let b = put(&store, b"b");
        let (removed, bytes) = store.remove_unreferenced(&HashSet::from([a])).unwrap();
        assert_eq!(removed, vec![b]);
        assert_eq!(bytes, 1);
        assert_eq!(store.list().unwrap(), vec![a]);
    }
}
