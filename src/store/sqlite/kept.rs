//! Values read from the database and kept in memory until this process writes what they
//! are made of: for rows read on a hot path and written rarely (the broken-blob list and
//! the image a REF names, read for every boot script). A writer hands the value to its
//! batch (`WriteTx::forget_on_commit`), whose closer forgets it once the batch ends, so
//! a caller that goes away after its commit still leaves nothing stale. The caches assume
//! one server a SQLite database, which the server enforces (`lock_for_one_server`).
//!
//! A read that began before a write may end after it: its value is kept only if no write
//! forgot the value meanwhile (the epoch), as in `node_cache`.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;

/// What a batch's closer forgets once the batch ends.
pub trait Forget: Send + Sync {
    fn forget(&self);
}

/// One value: a `KeptMap` of one key.
#[derive(Debug)]
pub struct Kept<T>(KeptMap<(), T>);

impl<T: Clone> Default for Kept<T> {
    fn default() -> Self {
        Self(KeptMap::new(1))
    }
}

impl<T: Clone> Kept<T> {
    /// The kept value, or the epoch a read made now must `fill` with.
    pub fn get(&self) -> Result<T, u64> {
        self.0.get(&())
    }

    /// Keeps `value`, read after `get` answered `epoch`, unless a write forgot since.
    pub fn fill(&self, epoch: u64, value: T) {
        self.0.fill(epoch, (), value)
    }
}

impl<T: Send> Forget for Kept<T> {
    /// A write to what the value is made of ended (committed or not): read it again.
    fn forget(&self) {
        self.0.forget()
    }
}

/// Values by key, all forgotten at once; at most `cap` of them (past
/// that, the map starts again empty: the values are cheap to read again).
#[derive(Debug)]
pub struct KeptMap<K, V> {
    inner: Mutex<MapInner<K, V>>,
    cap: usize,
}

#[derive(Debug)]
struct MapInner<K, V> {
    epoch: u64,
    values: HashMap<K, V>,
}

impl<K: Hash + Eq, V: Clone> KeptMap<K, V> {
    pub fn new(cap: usize) -> Self {
        Self {
            inner: Mutex::new(MapInner {
                epoch: 0,
                values: HashMap::new(),
            }),
            cap,
        }
    }

    /// The value kept for `key`, or the epoch a read made now must `fill` with.
    pub fn get(&self, key: &K) -> Result<V, u64> {
        let inner = self.inner.lock().expect("not poisoned");
        inner.values.get(key).cloned().ok_or(inner.epoch)
    }

    /// Keeps `value` for `key`, read after `get` answered `epoch`, unless a write forgot
    /// since.
    pub fn fill(&self, epoch: u64, key: K, value: V) {
        let mut inner = self.inner.lock().expect("not poisoned");
        if inner.epoch != epoch {
            return;
        }
        if inner.values.len() >= self.cap && !inner.values.contains_key(&key) {
            inner.values.clear();
        }
        inner.values.insert(key, value);
    }
}

impl<K: Send, V: Send> Forget for KeptMap<K, V> {
    /// A write to what the values are made of ended: read each again.
    fn forget(&self) {
        let mut inner = self.inner.lock().expect("not poisoned");
        inner.epoch += 1;
        inner.values.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_overtaken_by_a_write_is_not_kept() {
        let kept: Kept<Vec<u8>> = Kept::default();
        let epoch = kept.get().expect_err("nothing kept");
        kept.forget();
        kept.fill(epoch, vec![1]);
        assert!(kept.get().is_err(), "read before the write: not kept");
        let epoch = kept.get().expect_err("nothing kept");
        kept.fill(epoch, vec![2]);
        assert_eq!(kept.get(), Ok(vec![2]));
        kept.forget();
        assert!(kept.get().is_err());
    }

    #[test]
    fn a_map_keeps_values_by_key_forgets_them_at_once_and_stays_bounded() {
        let kept: KeptMap<u32, Option<u32>> = KeptMap::new(2);
        let epoch = kept.get(&1).expect_err("nothing kept");
        kept.fill(epoch, 1, Some(10));
        kept.fill(epoch, 2, None);
        assert_eq!(kept.get(&1), Ok(Some(10)));
        assert_eq!(kept.get(&2), Ok(None), "an answer of none is kept too");
        // Full: a third key starts the map again.
        kept.fill(epoch, 3, Some(30));
        assert!(kept.get(&1).is_err());
        assert_eq!(kept.get(&3), Ok(Some(30)));
        let before = kept.get(&4).expect_err("not kept");
        Forget::forget(&kept);
        assert!(kept.get(&3).is_err(), "forgotten");
        kept.fill(before, 4, Some(40));
        assert!(kept.get(&4).is_err(), "read before the write: not kept");
    }
}
