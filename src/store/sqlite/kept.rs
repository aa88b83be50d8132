//! One value read from the database and kept in memory until this process writes what it
//! is made of: for rows read on a hot path and written rarely (the broken-blob list, read
//! for every boot script). The caches assume one server a SQLite database, which the
//! server enforces (`lock_for_one_server`).
//!
//! A read that began before a write may end after it: its value is kept only if no write
//! forgot the value meanwhile (the epoch), as in `node_cache`.

use std::sync::Mutex;

#[derive(Debug, Default)]
pub struct Kept<T> {
    inner: Mutex<Inner<T>>,
}

#[derive(Debug, Default)]
struct Inner<T> {
    /// Bumped by every `forget`.
    epoch: u64,
    value: Option<T>,
}

impl<T: Clone> Kept<T> {
    /// The kept value, or the epoch a read made now must `fill` with.
    pub fn get(&self) -> Result<T, u64> {
        let inner = self.lock();
        inner.value.clone().ok_or(inner.epoch)
    }

    /// Keeps `value`, read after `get` answered `epoch`, unless a write forgot since.
    pub fn fill(&self, epoch: u64, value: T) {
        let mut inner = self.lock();
        if inner.epoch == epoch {
            inner.value = Some(value);
        }
    }

    /// A write to what the value is made of ended (committed or not): read it again.
    pub fn forget(&self) {
        let mut inner = self.lock();
        inner.epoch += 1;
        inner.value = None;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<T>> {
        self.inner.lock().expect("not poisoned")
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
}
