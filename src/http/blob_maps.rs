//! One shared read-only mapping per blob being served, whose pages stay in the process
//! only while a download holds them.
//!
//! Why shared: each download used to map and unmap its own 1 MiB windows; at 10,000
//! concurrent downloads that is 10,000 mmap and munmap calls per MiB served, and every
//! munmap in a multi-threaded process interrupts the other cores to flush their TLBs. A
//! mapping per blob, shared by every download of it and dropped when the last one ends,
//! is mapped once; each download takes windows of it.
//!
//! Why released by slot: a page once touched through a mapping stays in the process's
//! page tables (and in its RSS, as `ps` and the cgroup's `mapped_file` count it) until it
//! is unmapped, so 16 downloads of a 256 MiB blob left 256 MiB resident. The mapping is
//! cut in 1 MiB slots with a count of the windows holding each; when a slot's last holder
//! is done, its pages are dropped from the page tables (MADV_DONTNEED; the page cache
//! keeps them, and a later window maps them again without I/O). Resident memory is then
//! the slots in flight, and a slot many downloads read at once is released only once.
//!
//! Small blobs (up to `SMALL`) are not mapped: they are read whole once and kept, up to
//! `SMALL_TOTAL` bytes in all, so that serving one takes no file call and no trip to the
//! blocking pool (a 7-byte blob cost 3.5x nginx's CPU a request through the mapping).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use memmap2::{Advice, Mmap, UncheckedAdvice};

use crate::api::Digest;

/// The unit of release: the windows downloads take are this size (a range's first may
/// straddle two).
pub const SLOT: usize = 1 << 20;

/// Blobs up to this size are kept whole in memory instead of mapped.
pub const SMALL: u64 = 64 << 10;

/// What the small blobs kept may take in all; past it, others make room.
const SMALL_TOTAL: usize = 16 << 20;

#[derive(Debug, Default)]
pub struct BlobMaps {
    live: Mutex<HashMap<Digest, Weak<Blob>>>,
    small: Mutex<SmallBlobs>,
    /// The live mappings by start address, for `file_behind` (the sendfile path).
    by_address: RwLock<BTreeMap<usize, Weak<Blob>>>,
}

/// How long a slot seen whole in the page cache is taken to be there still. Hot blobs
/// (a storm's kernel) are then checked about once a second, not once a window, and
/// their windows are taken without a trip to the blocking pool. Were the kernel to
/// evict a slot within that time, sendfile would read it from the disk inside the
/// runtime: a stall of that connection's thread, not an error.
const CACHED_FOR: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
struct SmallBlobs {
    /// Each blob's bytes, and the blob store's removal count when the blob was last
    /// known to be in the store (`BlobStore::removals`).
    kept: HashMap<Digest, (Bytes, u64)>,
    total: usize,
}

/// A blob's mapping, its open file and its slots.
#[derive(Debug)]
struct Blob {
    map: Mmap,
    file: std::fs::File,
    slots: Mutex<Vec<Slot>>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// Windows holding it: its pages stay mapped while this is above 0.
    holders: u32,
    /// When every page of it was last seen in the page cache.
    cached_at: Option<Instant>,
}

/// Where bytes handed to a socket come from when they are a blob's: its file and the
/// offset in it, so that they can be sent with sendfile(2) instead of copied.
pub struct FileBytes {
    blob: Arc<Blob>,
    pub offset: u64,
}

impl FileBytes {
    pub fn file(&self) -> &std::fs::File {
        &self.blob.file
    }
}

/// A blob's shared mapping, as one download holds it.
#[derive(Clone)]
pub struct Mapped(Arc<Blob>);

/// The owner of one window's `Bytes`: its slots are held until every slice of it is gone.
struct Window {
    blob: Arc<Blob>,
    slots: std::ops::RangeInclusive<usize>,
}

impl AsRef<[u8]> for Window {
    fn as_ref(&self) -> &[u8] {
        &self.blob.map
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        let blob = &self.blob;
        // Released under the lock: a window taking this slot meanwhile waits, so its pages
        // are never dropped between its populate and its send.
        let mut slots = blob.slots.lock().expect("not poisoned");
        for slot in self.slots.clone() {
            slots[slot].holders -= 1;
            if slots[slot].holders == 0 {
                let start = slot * SLOT;
                let len = SLOT.min(blob.map.len() - start);
                // SAFETY: the mapping is read-only and file-backed (`Mmap::map`): dropping
                // its pages loses nothing, a later read maps them again from the page
                // cache. No slice of this slot is alive (its count is 0), so no reader
                // sees the pages go, and a reader that did would fault them back in.
                let _ = unsafe {
                    blob.map
                        .unchecked_advise_range(UncheckedAdvice::DontNeed, start, len)
                };
            }
        }
    }
}

impl BlobMaps {
    /// The whole of `file` (the blob `digest`, `len` bytes, not empty), mapped once for
    /// all its concurrent downloads. Pages are read by `Mapped::window`, not here.
    pub fn map(&self, digest: &Digest, file: &std::fs::File, len: u64) -> std::io::Result<Mapped> {
        let mut live = self.live.lock().expect("not poisoned");
        if let Some(blob) = live.get(digest).and_then(Weak::upgrade)
            && blob.map.len() as u64 == len
        {
            return Ok(Mapped(blob));
        }
        // SAFETY: blobs are immutable once visible: they are only ever renamed
        // (quarantine) or unlinked (gc), both of which leave a mapping valid. Nothing in
        // bootfleet writes or truncates a visible blob, which is what could make a
        // mapping fault.
        let map = unsafe { Mmap::map(file)? };
        let slots = map.len().div_ceil(SLOT);
        let blob = Arc::new(Blob {
            map,
            file: file.try_clone()?,
            slots: Mutex::new(vec![Slot::default(); slots]),
        });
        // Dead entries go when a new one is made: the maps stay as small as the set of
        // blobs recently served. A new mapping at a dead one's address replaces it.
        live.retain(|_, m| m.strong_count() > 0);
        live.insert(*digest, Arc::downgrade(&blob));
        let mut by_address = self.by_address.write().expect("not poisoned");
        by_address.retain(|_, m| m.strong_count() > 0);
        by_address.insert(blob.map.as_ptr() as usize, Arc::downgrade(&blob));
        Ok(Mapped(blob))
    }

    /// The small blob `digest`'s bytes when they are kept and no blob has left the store
    /// since they were read (`removals` is the store's count now): then the file is
    /// there still, and the same file, and a request needs no look at the filesystem. After
    /// any removal the bytes are read again: the blob may have been quarantined and
    /// published anew, and the kept copy may be the damaged one.
    pub fn small_unremoved(&self, digest: &Digest, removals: u64) -> Option<Bytes> {
        let small = self.small.lock().expect("not poisoned");
        match small.kept.get(digest) {
            Some((bytes, seen)) if *seen == removals => Some(bytes.clone()),
            _ => None,
        }
    }

    /// Reads the small blob `digest` (`len` bytes, at most `SMALL`) from `file` whole,
    /// and keeps it; `removals` is the store's removal count before `file` was opened.
    /// Blocking: call it on the blocking pool.
    pub fn read_small(
        &self,
        digest: &Digest,
        file: &std::fs::File,
        len: u64,
        removals: u64,
    ) -> std::io::Result<Bytes> {
        use std::os::unix::fs::FileExt;
        debug_assert!(len <= SMALL);
        let mut bytes = vec![0; len as usize];
        file.read_exact_at(&mut bytes, 0)?;
        let bytes = Bytes::from(bytes);
        let mut small = self.small.lock().expect("not poisoned");
        if let Some((old, _)) = small.kept.insert(*digest, (bytes.clone(), removals)) {
            small.total -= old.len();
        }
        small.total += bytes.len();
        // Over the budget: others go, in the map's (arbitrary) order, until it fits.
        while small.total > SMALL_TOTAL {
            let Some(other) = small.kept.keys().find(|d| *d != digest).copied() else {
                break;
            };
            let (gone, _) = small.kept.remove(&other).expect("just found");
            small.total -= gone.len();
        }
        Ok(bytes)
    }

    /// The blob file and offset behind `bytes` when they lie wholly inside a live
    /// blob's mapping (a window a download is sending), else None.
    pub fn file_behind(&self, bytes: &[u8]) -> Option<FileBytes> {
        let start = bytes.as_ptr() as usize;
        let by_address = self.by_address.read().expect("not poisoned");
        let (&base, blob) = by_address.range(..=start).next_back()?;
        let blob = blob.upgrade()?;
        let offset = start - base;
        (offset + bytes.len() <= blob.map.len()).then_some(FileBytes {
            blob,
            offset: offset as u64,
        })
    }
}

impl Mapped {
    /// `len` bytes (1 to `SLOT`) from `offset`, in the page cache before this returns
    /// (read in with MADV_POPULATE_READ when they were not) so that sending them does
    /// not wait on the disk inside the async runtime: call it on the blocking pool.
    /// Pages already cached are not mapped in here: sendfile reads them without, and a
    /// copy maps them as it reads. Kernels before 5.14 lack the advice; there pages
    /// fault in as sent. The window's slots are held until its last slice is dropped.
    pub fn window(&self, offset: usize, len: usize) -> Bytes {
        let slots = self.slots_of(offset, len);
        if !self.hold(slots.clone(), false) {
            let start = slots.start() * SLOT;
            let whole = (slots.end() + 1) * SLOT;
            let whole_len = whole.min(self.0.map.len()) - start;
            // Known cached only when seen so or read in: where the advice is missing
            // (before 5.14) the slots stay unknown and each window comes here.
            let cached = self.cached(start, whole_len)
                || self
                    .0
                    .map
                    .advise_range(Advice::PopulateRead, start, whole_len)
                    .is_ok();
            if cached {
                let now = Some(Instant::now());
                let mut held = self.0.slots.lock().expect("not poisoned");
                for slot in slots.clone() {
                    held[slot].cached_at = now;
                }
            }
        }
        self.bytes(slots, offset, len)
    }

    /// The window `window` would give, without blocking, when all its slots were seen
    /// in the page cache lately (`CACHED_FOR`); None sends the caller to `window`.
    pub fn cached_window(&self, offset: usize, len: usize) -> Option<Bytes> {
        let slots = self.slots_of(offset, len);
        self.hold(slots.clone(), true)
            .then(|| self.bytes(slots, offset, len))
    }

    fn slots_of(&self, offset: usize, len: usize) -> std::ops::RangeInclusive<usize> {
        debug_assert!(len > 0 && len <= SLOT && offset + len <= self.0.map.len());
        offset / SLOT..=(offset + len - 1) / SLOT
    }

    /// Takes a hold on `slots` (only if they are all lately cached, with `only_cached`);
    /// answers whether they were all lately cached.
    fn hold(&self, slots: std::ops::RangeInclusive<usize>, only_cached: bool) -> bool {
        let mut held = self.0.slots.lock().expect("not poisoned");
        let now = Instant::now();
        let cached = held[slots.clone()].iter().all(|s| {
            s.cached_at
                .is_some_and(|at| now.duration_since(at) < CACHED_FOR)
        });
        if cached || !only_cached {
            for slot in slots {
                held[slot].holders += 1;
            }
        }
        cached
    }

    /// The bytes of a window whose slots are held: the hold goes with the last slice.
    fn bytes(&self, slots: std::ops::RangeInclusive<usize>, offset: usize, len: usize) -> Bytes {
        let window = Window {
            blob: self.0.clone(),
            slots,
        };
        Bytes::from_owner(window).slice(offset..offset + len)
    }

    /// Whether every page of the range (at most two slots) is in the page cache
    /// (mincore(2), which for a file mapping answers for the file's pages whether or not
    /// they are mapped here, provided the process owns the file or may write it, as the
    /// server that wrote its blobs does; otherwise it answers for this process's mapped
    /// pages only, and windows take the slower path, never a wrong one).
    fn cached(&self, offset: usize, len: usize) -> bool {
        const PAGE: usize = 4096;
        let base = self.0.map.as_ptr() as usize;
        let start = (base + offset) & !(PAGE - 1);
        let end = base + offset + len;
        let mut resident = [0u8; 2 * SLOT / PAGE + 1];
        let pages = (end - start).div_ceil(PAGE);
        // SAFETY: [start, end) lies inside the live mapping (start rounded down to its
        // page, which the mapping's page-aligned base keeps inside it), and `resident`
        // has room for a byte a page of it (at most two slots). On a machine whose pages
        // are larger, mincore fails on the alignment or leaves bytes 0: "not cached",
        // and the range is populated, which is slower, never wrong.
        let answered = unsafe {
            libc::mincore(
                start as *mut libc::c_void,
                end - start,
                resident.as_mut_ptr(),
            )
        } == 0;
        answered && resident[..pages].iter().all(|page| page & 1 == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn mapped_file(bytes: &[u8]) -> (std::fs::File, Digest) {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(bytes).unwrap();
        (file, Digest::of(bytes))
    }

    fn holders(m: &Mapped) -> Vec<u32> {
        m.0.slots
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.holders)
            .collect()
    }

    #[test]
    fn concurrent_downloads_share_one_mapping_until_the_last_ends() {
        let (file, digest) = mapped_file(&[7u8; 10_000]);
        let maps = BlobMaps::default();
        let a = maps.map(&digest, &file, 10_000).unwrap();
        let b = maps.map(&digest, &file, 10_000).unwrap();
        assert!(Arc::ptr_eq(&a.0, &b.0), "one mapping");
        assert_eq!(&a.window(0, 10_000)[..], &[7u8; 10_000][..]);
        let window = b.window(5_001, 999);
        assert_eq!(&window[..], &[7u8; 999][..]);
        drop((a, b, window));
        let c = maps.map(&digest, &file, 10_000).unwrap();
        assert_eq!(c.window(9_999, 1).len(), 1);
        assert_eq!(maps.live.lock().unwrap().len(), 1);
    }

    /// The mapping's resident KiB as the kernel counts them for this process (its `Rss:`
    /// in smaps; mincore would answer for the page cache, not the process).
    fn resident_kib(m: &Mapped) -> u64 {
        let start = format!("{:x}-", m.0.map.as_ptr() as usize);
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&start));
        assert!(lines.next().is_some(), "the mapping is in smaps");
        let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
        rss.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[test]
    fn a_slot_leaves_the_process_when_its_last_window_is_dropped() {
        let bytes: Vec<u8> = (0..3 * SLOT + 100).map(|i| (i % 251) as u8).collect();
        let (file, digest) = mapped_file(&bytes);
        let maps = BlobMaps::default();
        let m = maps.map(&digest, &file, bytes.len() as u64).unwrap();

        // A window straddling slots 0 and 1, and another of slot 1 alone.
        let straddling = m.window(SLOT - 10, SLOT);
        assert!(straddling[..] == bytes[SLOT - 10..2 * SLOT - 10]);
        let second = m.window(SLOT, SLOT);
        assert_eq!(holders(&m), [1, 2, 0, 0]);
        assert!(resident_kib(&m) >= 1024, "the windows' pages are mapped in");

        // A slice outlives its window's other handles and keeps the slots held.
        let tail = straddling.slice(SLOT - 20..);
        drop(straddling);
        assert_eq!(holders(&m), [1, 2, 0, 0]);
        drop(tail);
        assert_eq!(holders(&m), [0, 1, 0, 0]);
        drop(second);
        assert_eq!(holders(&m), [0, 0, 0, 0]);
        assert_eq!(resident_kib(&m), 0, "no slot is held, no page stays mapped");

        // Pages dropped from the process are read again, unchanged.
        let last = m.window(3 * SLOT, 100);
        assert!(last[..] == bytes[3 * SLOT..]);
        assert!(m.window(0, SLOT)[..] == bytes[..SLOT]);
    }

    #[test]
    fn a_window_is_taken_without_blocking_only_once_its_slots_were_seen_cached() {
        let bytes: Vec<u8> = (0..2 * SLOT).map(|i| (i % 13) as u8).collect();
        let (file, digest) = mapped_file(&bytes);
        let maps = BlobMaps::default();
        let m = maps.map(&digest, &file, bytes.len() as u64).unwrap();
        assert!(m.cached_window(10, 100).is_none(), "never checked");
        assert_eq!(holders(&m), [0, 0], "a refused window holds nothing");
        let checked = m.window(SLOT - 5, 10);
        assert!(checked[..] == bytes[SLOT - 5..SLOT + 5]);
        let fast = m
            .cached_window(SLOT - 1, SLOT)
            .expect("both slots seen cached");
        assert!(fast[..] == bytes[SLOT - 1..2 * SLOT - 1]);
        assert_eq!(holders(&m), [2, 2]);
        drop((checked, fast));
        assert_eq!(holders(&m), [0, 0]);
        assert!(
            m.cached_window(0, 1).is_some(),
            "released slots stay known cached"
        );
    }

    #[test]
    fn small_blobs_are_kept_whole_within_their_budget() {
        let maps = BlobMaps::default();
        let count = SMALL_TOTAL / SMALL as usize + 20;
        for i in 0..count {
            let mut bytes = vec![0; SMALL as usize];
            bytes[..8].copy_from_slice(&i.to_le_bytes());
            let (file, digest) = mapped_file(&bytes);
            let read = maps.read_small(&digest, &file, SMALL, 7).unwrap();
            assert_eq!(read.len() as u64, SMALL);
            assert_eq!(
                maps.small_unremoved(&digest, 7),
                Some(read),
                "the newest is kept"
            );
        }
        let small = maps.small.lock().unwrap();
        assert!(
            small.total <= SMALL_TOTAL,
            "{} over the budget",
            small.total
        );
        assert_eq!(
            small.total,
            small.kept.values().map(|(b, _)| b.len()).sum::<usize>()
        );
        assert_eq!(small.kept.len(), SMALL_TOTAL / SMALL as usize);
        drop(small);

        // A file shorter than it was said to be is an error, not a short blob kept.
        let (file, digest) = mapped_file(b"short");
        assert!(maps.read_small(&digest, &file, 6, 7).is_err());
        assert_eq!(maps.small_unremoved(&digest, 7), None);
    }

    #[test]
    fn a_small_blob_is_trusted_present_only_while_nothing_left_the_store() {
        let maps = BlobMaps::default();
        let (file, digest) = mapped_file(b"tiny blob");
        maps.read_small(&digest, &file, 9, 3).unwrap();
        assert_eq!(
            maps.small_unremoved(&digest, 3).as_deref(),
            Some(&b"tiny blob"[..])
        );
        // A blob left the store since: it may have been this one.
        assert_eq!(maps.small_unremoved(&digest, 4), None);
        // Read again at 4: trusted again while the count stays there.
        maps.read_small(&digest, &file, 9, 4).unwrap();
        assert!(maps.small_unremoved(&digest, 4).is_some());
        assert_eq!(maps.small_unremoved(&digest, 5), None);
    }
}
