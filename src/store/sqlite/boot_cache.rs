//! Each node's newest boot as the agent API's token check reads it (`boot_for_attest`):
//! every agent call (attest, validate, each heartbeat) checks its token against its boot
//! before anything else, and under a boot storm each such read is a round trip to
//! SQLite's thread, four or more a node.
//!
//! Kept from the write side: after each commit, under the write gate (so in commit
//! order), the batch's closer applies what its writers did to boots: a boot begun becomes
//! its node's newest, an attestation marks it, any other write to a node (or the removal
//! of an image) forgets what was kept. A read of a boot that is its node's newest is kept
//! unless a write was applied since the read began (the epoch), as in `node_cache`. Only
//! the newest boot of a node is kept: an older boot's token misses, is read, and is
//! refused as expired as before.
//!
//! "Newest" here is the last begun, as in the database (the boot inserted last, whatever
//! the clock said).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::api::{Digest, Mac};
use crate::store::{Attestation, BootForAttest};

/// Past this many boots the cache starts over (one a node; bounded like `node_cache`).
const MAX_ENTRIES: usize = 200_000;

/// What a committed write did to boots, applied by the batch's closer in commit order.
#[derive(Debug, Clone)]
pub(crate) enum BootTouch {
    /// Boot `id` of `mac` began (its row was inserted): now the node's newest.
    Began(String, BootForAttest),
    /// Boot `id` was attested.
    Attested(String, Attestation),
    /// Something else about `mac` changed (or it was removed): forget its boot.
    Forget(Mac),
    /// The boots of this image were removed with it.
    ForgetImage(Digest),
}

#[derive(Debug, Default)]
pub struct BootCache {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    boots: HashMap<String, BootForAttest>,
    /// Each node's newest boot id (a key of `boots`).
    newest: HashMap<Mac, String>,
    /// Bumped by every touch applied.
    epoch: u64,
}

impl Inner {
    fn keep(&mut self, id: String, boot: BootForAttest) {
        if self.boots.len() >= MAX_ENTRIES {
            self.boots.clear();
            self.newest.clear();
        }
        if let Some(older) = self.newest.insert(boot.mac, id.clone()) {
            self.boots.remove(&older);
        }
        self.boots.insert(id, boot);
    }

    fn forget(&mut self, mac: &Mac) {
        if let Some(id) = self.newest.remove(mac) {
            self.boots.remove(&id);
        }
    }
}

impl BootCache {
    /// Boot `id` if it is kept (then it is its node's newest).
    pub fn get(&self, id: &str) -> Option<BootForAttest> {
        self.lock().boots.get(id).cloned()
    }

    /// The epoch to pass to `fill` for a read that starts now.
    pub fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// Keeps boot `id` as read after `epoch()` returned `epoch`, if it is its node's
    /// newest and no write was applied since.
    pub fn fill(&self, epoch: u64, id: &str, boot: &BootForAttest) {
        let mut inner = self.lock();
        if inner.epoch == epoch && boot.latest {
            inner.keep(id.to_string(), boot.clone());
        }
    }

    /// Applies a committed write (the write gate's closer, after COMMIT, in order).
    pub(crate) fn apply(&self, touch: BootTouch) {
        let mut inner = self.lock();
        inner.epoch += 1;
        match touch {
            BootTouch::Began(id, boot) => inner.keep(id, boot),
            BootTouch::Attested(id, attestation) => {
                if let Some(boot) = inner.boots.get_mut(&id) {
                    boot.attestation = Some(attestation);
                }
            }
            BootTouch::Forget(mac) => inner.forget(&mac),
            BootTouch::ForgetImage(image) => {
                let gone: Vec<Mac> = inner
                    .boots
                    .values()
                    .filter(|b| b.image == image)
                    .map(|b| b.mac)
                    .collect();
                for mac in gone {
                    inner.forget(&mac);
                }
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("not poisoned")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boot(mac: &str, image: u8) -> BootForAttest {
        BootForAttest {
            mac: mac.parse().unwrap(),
            image: Digest::of(&[image]),
            token_sha256: Digest::of(b"token"),
            created_at_ms: 1,
            latest: true,
            attestation: None,
        }
    }

    const A: &str = "02:00:00:00:00:01";
    const B: &str = "02:00:00:00:00:02";

    #[test]
    fn a_newer_boot_replaces_its_nodes_older_one() {
        let cache = BootCache::default();
        cache.apply(BootTouch::Began("b1".into(), boot(A, 1)));
        cache.apply(BootTouch::Began("c1".into(), boot(B, 1)));
        assert!(cache.get("b1").is_some());
        cache.apply(BootTouch::Began("b2".into(), boot(A, 1)));
        assert!(cache.get("b1").is_none(), "an older boot is read, not kept");
        assert!(cache.get("b2").is_some_and(|b| b.latest && !b.attested()));
        assert!(cache.get("c1").is_some(), "another node's boot stays");
    }

    #[test]
    fn an_attestation_marks_the_kept_boot() {
        let cache = BootCache::default();
        cache.apply(BootTouch::Began("b1".into(), boot(A, 1)));
        let passed = Attestation {
            at_ms: 2,
            passed: true,
        };
        cache.apply(BootTouch::Attested("b1".into(), passed));
        assert!(
            cache
                .get("b1")
                .is_some_and(|b| b.attestation == Some(passed))
        );
        // Of a boot not kept: nothing to mark, nothing kept.
        cache.apply(BootTouch::Attested("b9".into(), passed));
        assert!(cache.get("b9").is_none());
    }

    #[test]
    fn other_writes_and_image_removals_forget() {
        let cache = BootCache::default();
        cache.apply(BootTouch::Began("b1".into(), boot(A, 1)));
        cache.apply(BootTouch::Began("c1".into(), boot(B, 2)));
        cache.apply(BootTouch::Forget(A.parse().unwrap()));
        assert!(cache.get("b1").is_none());
        cache.apply(BootTouch::Began("b2".into(), boot(A, 1)));
        cache.apply(BootTouch::ForgetImage(Digest::of(&[2])));
        assert!(cache.get("c1").is_none(), "the removed image's boot");
        assert!(cache.get("b2").is_some(), "another image's boot stays");
    }

    #[test]
    fn a_read_is_kept_only_if_newest_and_no_write_raced_it() {
        let cache = BootCache::default();
        let before = cache.epoch();
        cache.apply(BootTouch::Began("b2".into(), boot(A, 1)));
        // Read before b2 began: b1 looked newest then.
        cache.fill(before, "b1", &boot(A, 1));
        assert!(cache.get("b1").is_none());
        assert!(cache.get("b2").is_some());
        let old = BootForAttest {
            latest: false,
            ..boot(B, 1)
        };
        cache.fill(cache.epoch(), "c0", &old);
        assert!(cache.get("c0").is_none(), "not its node's newest");
        cache.fill(cache.epoch(), "c1", &boot(B, 1));
        assert!(cache.get("c1").is_some());
    }
}
