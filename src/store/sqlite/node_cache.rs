//! Node records kept in memory for the DHCP hot path (and read by the state controller's
//! first try and by heartbeats, as current as of the last commit): every DHCP packet of a network
//! booting node needs its node, and under a boot storm a read that waits for one of the
//! pool's connections (held by writers queued on SQLite's write lock) costs the node a
//! firmware retransmit of 4 s or more. Every write to `nodes` invalidates its MAC after it
//! commits; a read that raced a write to its node does not fill the cache (the epoch check
//! below), so the cache never holds a record older than the last committed write it saw.
//! Races are judged per node: under a storm some node is written every millisecond, and
//! a read overtaken by any write at all would almost never be kept.

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

#[derive(Debug)]
struct Inner {
    nodes: HashMap<Mac, Entry>,
    /// Entries (records and marks) before the map starts over.
    cap: usize,
    /// Bumped by every invalidation.
    epoch: u64,
    /// The epoch when the map last started over: a read begun before it may have raced
    /// a write whose mark went with the map, and is not kept.
    floor: u64,
}

/// A node's record, if kept, and the epoch of its last invalidation (kept after the
/// record goes: the mark that turns away reads begun before it).
#[derive(Debug)]
struct Entry {
    /// Boxed: a mark alone is then a few words, not a record's size.
    node: Option<Box<NodeRecord>>,
    changed_at: u64,
}

impl NodeCache {
    pub fn get(&self, mac: &Mac) -> Option<NodeRecord> {
        self.lock()
            .nodes
            .get(mac)
            .and_then(|e| e.node.as_deref().cloned())
    }

    /// The epoch to pass to `fill` for a read that starts now.
    pub fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// Keeps `node`, read from the database after `epoch()` returned `epoch` (or written
    /// by a batch whose closer fills under the write gate, after its invalidations),
    /// unless its MAC was invalidated since (then the read may predate the write).
    pub fn fill(&self, epoch: u64, node: &NodeRecord) {
        let mut inner = self.lock();
        let changed_at = match inner.nodes.get(&node.mac) {
            Some(entry) => entry.changed_at,
            None => inner.floor,
        };
        if epoch < changed_at {
            return;
        }
        inner.make_room(&node.mac);
        inner.nodes.insert(
            node.mac,
            Entry {
                node: Some(Box::new(node.clone())),
                changed_at,
            },
        );
    }

    /// Forgets `mac`: call after a write to its row commits.
    pub fn invalidate(&self, mac: &Mac) {
        let mut inner = self.lock();
        inner.epoch += 1;
        inner.make_room(mac);
        let changed_at = inner.epoch;
        inner.nodes.insert(
            *mac,
            Entry {
                node: None,
                changed_at,
            },
        );
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("not poisoned")
    }
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            nodes: HashMap::new(),
            cap: MAX_ENTRIES,
            epoch: 0,
            floor: 0,
        }
    }
}

impl Inner {
    /// Starts the map over when it is full and `mac` is not in it.
    fn make_room(&mut self, mac: &Mac) {
        if self.nodes.len() >= self.cap && !self.nodes.contains_key(mac) {
            self.nodes.clear();
            self.floor = self.epoch;
        }
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
        // A read begun before the write, ending after it was kept, is turned away too.
        cache.fill(before, &old);
        assert_eq!(
            cache.get(&old.mac).map(|n| n.state),
            Some(NodeState::Quarantined)
        );
    }

    #[test]
    fn a_read_overtaken_only_by_writes_to_other_nodes_is_kept() {
        let cache = NodeCache::default();
        let a = node("02:00:00:00:00:01", NodeState::Ready);
        let before = cache.epoch();
        cache.invalidate(&"02:00:00:00:00:02".parse().unwrap());
        cache.fill(before, &a);
        assert_eq!(cache.get(&a.mac), Some(a));
    }

    #[test]
    fn a_read_begun_before_the_map_started_over_is_not_kept() {
        let cache = NodeCache::default();
        cache.lock().cap = 1;
        let a = node("02:00:00:00:00:01", NodeState::Ready);
        let before = cache.epoch();
        // A write to `a` commits; its mark goes when the map starts over for another's.
        cache.invalidate(&a.mac);
        cache.invalidate(&"02:00:00:00:00:02".parse().unwrap());
        cache.fill(before, &a);
        assert_eq!(cache.get(&a.mac), None);
        cache.fill(cache.epoch(), &a);
        assert_eq!(cache.get(&a.mac), Some(a));
    }
}
