//! One shared read-only mapping per blob being served. Each download used to map and
//! unmap its own 1 MiB windows; at 10,000 concurrent downloads that is 10,000 mmap and
//! munmap calls per MiB served, and every munmap in a multi-threaded process interrupts
//! the other cores to flush their TLBs. A mapping per blob, shared by every download of
//! it and dropped when the last one ends, is mapped once; each download takes slices.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use memmap2::{Advice, Mmap};

use crate::api::Digest;

#[derive(Debug, Default)]
pub struct BlobMaps {
    live: Mutex<HashMap<Digest, Weak<Mmap>>>,
}

/// A mapping as the owner of `Bytes` slices.
struct Shared(Arc<Mmap>);

impl AsRef<[u8]> for Shared {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// A blob's shared mapping, as one download holds it.
#[derive(Clone)]
pub struct Mapped {
    map: Arc<Mmap>,
    bytes: Bytes,
}

impl BlobMaps {
    /// The whole of `file` (the blob `digest`, `len` bytes, not empty), mapped once for
    /// all its concurrent downloads. Pages are read by `Mapped::window`, not here.
    pub fn map(&self, digest: &Digest, file: &std::fs::File, len: u64) -> std::io::Result<Mapped> {
        let mut live = self.live.lock().expect("not poisoned");
        let map = match live.get(digest).and_then(Weak::upgrade) {
            Some(map) if map.len() as u64 == len => map,
            _ => {
                // SAFETY: blobs are immutable once visible: they are only ever renamed
                // (quarantine) or unlinked (gc), both of which leave a mapping valid.
                // Nothing in bootfleet writes or truncates a visible blob, which is what
                // could make a mapping fault.
                let map = Arc::new(unsafe { Mmap::map(file)? });
                // Dead entries go when a new one is made: the map stays as small as
                // the set of blobs recently served.
                live.retain(|_, m| m.strong_count() > 0);
                live.insert(*digest, Arc::downgrade(&map));
                map
            }
        };
        let bytes = Bytes::from_owner(Shared(map.clone()));
        Ok(Mapped { map, bytes })
    }
}

impl Mapped {
    /// `len` bytes from `offset`, read into memory first (MADV_POPULATE_READ) so that
    /// sending them does not fault on the disk inside the async runtime: call it on the
    /// blocking pool. Kernels before 5.14 lack the advice; there pages fault in as sent.
    pub fn window(&self, offset: usize, len: usize) -> Bytes {
        let _ = self.map.advise_range(Advice::PopulateRead, offset, len);
        self.bytes.slice(offset..offset + len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn concurrent_downloads_share_one_mapping_until_the_last_ends() {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&[7u8; 10_000]).unwrap();
        let digest = Digest::of(&[7u8; 10_000]);
        let maps = BlobMaps::default();
        let a = maps.map(&digest, &file, 10_000).unwrap();
        let b = maps.map(&digest, &file, 10_000).unwrap();
        assert_eq!(a.bytes.as_ptr(), b.bytes.as_ptr(), "one mapping");
        assert_eq!(&a.window(0, 10_000)[..], &[7u8; 10_000][..]);
        let window = b.window(5_001, 999);
        assert_eq!(&window[..], &[7u8; 999][..]);
        drop((a, b, window));
        let c = maps.map(&digest, &file, 10_000).unwrap();
        assert_eq!(c.window(9_999, 1).len(), 1);
        assert_eq!(maps.live.lock().unwrap().len(), 1);
    }
}
