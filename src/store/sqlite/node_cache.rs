//! Node records kept in memory for the DHCP hot path (and read by the state controller's
//! first try and by heartbeats, as current as of the last commit): every DHCP packet of a network
//! booting node needs its node, and under a boot storm a read that waits for one of the
//! pool's connections (held by writers queued on SQLite's write lock) costs the node a
//! firmware retransmit of 4 s or more. Every write to `nodes` invalidates its MAC after it
//! commits; a read that raced a write does not fill the cache (the epoch check below), so
//! the cache never holds a record older than the last committed write it saw.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::api::Mac;
use crate::store::NodeRecord;

/// Past this many entries the cache starts over: MACs seen in DHCP are unbounded input.
const MAX_ENTRIES: usize = 200_000;

#[derive(Debug, Default)]
pub struct NodeCache {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    nodes: HashMap<Mac, NodeRecord>,
    /// Bumped by every invalidation.
    epoch: u64,
}

impl NodeCache {
    pub fn get(&self, mac: &Mac) -> Option<NodeRecord> {
        self.lock().nodes.get(mac).cloned()
    }

    /// The epoch to pass to `fill` for a read that starts now.
    pub fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// Keeps `node`, read from the database after `epoch()` returned `epoch` (or written
    /// by a batch whose closer fills under the write gate, after its invalidations),
    /// unless a write was invalidated since (then the read may predate it).
    pub fn fill(&self, epoch: u64, node: &NodeRecord) {
        let mut inner = self.lock();
        if inner.epoch != epoch {
            return;
        }
        if inner.nodes.len() >= MAX_ENTRIES {
            inner.nodes.clear();
        }
        inner.nodes.insert(node.mac, node.clone());
    }

    /// Forgets `mac`: call after a write to its row commits.
    pub fn invalidate(&self, mac: &Mac) {
        let mut inner = self.lock();
        inner.epoch += 1;
        inner.nodes.remove(mac);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("not poisoned")
    }
}

/// A node record of `mac` at `state` and `version`, the rest empty: for tests of the
/// cache and of what fills it.
#[cfg(test)]
pub(super) fn record(mac: &str, state: crate::api::NodeState, version: i64) -> NodeRecord {
    NodeRecord {
        mac: mac.parse().unwrap(),
        uuid: None,
        hostname: None,
        labels: Default::default(),
        assigned: None,
        state,
        state_reason: String::new(),
        version,
        created_at: String::new(),
        updated_at: String::new(),
        bmc: None,
        revalidate_requested: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::NodeState;

    fn node(mac: &str, state: NodeState) -> NodeRecord {
        record(mac, state, 1)
    }

    #[test]
    fn a_fill_is_kept_until_its_mac_is_invalidated() {
        let cache = NodeCache::default();
        let a = node("02:00:00:00:00:01", NodeState::Ready);
        cache.fill(cache.epoch(), &a);
        assert_eq!(cache.get(&a.mac), Some(a.clone()));
        cache.invalidate(&a.mac);
        assert_eq!(cache.get(&a.mac), None);
    }

    #[test]
    fn a_read_that_raced_a_write_is_not_kept() {
        let cache = NodeCache::default();
        let old = node("02:00:00:00:00:01", NodeState::Ready);
        let before = cache.epoch();
        // The read saw the old row; a write commits and invalidates before it fills.
        cache.invalidate(&old.mac);
        cache.fill(before, &old);
        assert_eq!(cache.get(&old.mac), None);
        // A read started after the write is kept.
        let new = node("02:00:00:00:00:01", NodeState::Quarantined);
        cache.fill(cache.epoch(), &new);
        assert_eq!(
            cache.get(&new.mac).map(|n| n.state),
            Some(NodeState::Quarantined)
        );
    }
}
