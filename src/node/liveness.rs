//! Proof of life without a write per heartbeat: each heartbeat is noted in memory, and
//! what was heard is stored for all nodes at once, every `LifecyclePolicy::liveness_flush_ms`
//! (a sixth of the heartbeat timeout). At 10,000 nodes beating every 10 s that is one
//! write of a few thousand rows every 15 s instead of 1,000 writes a second; the sweeper
//! allows the flush interval on top of the timeout (`LifecyclePolicy::is_overdue`), so a
//! node is never called silent for what is still only in memory.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::api::Mac;
use crate::store::{Store, StoreError};

/// Rows a write carries at most: a flush of a large fleet goes as several writes, so
/// other writers wait for none of them long.
const CHUNK: usize = 1000;

/// When each node was last heard here and not yet stored.
#[derive(Default)]
pub struct Liveness {
    heard: Mutex<HashMap<Mac, i64>>,
}

impl Liveness {
    /// Notes a heartbeat from `mac` at `at_ms`.
    pub fn heard(&self, mac: Mac, at_ms: i64) {
        let mut heard = self.heard.lock().expect("not poisoned");
        let at = heard.entry(mac).or_insert(at_ms);
        *at = (*at).max(at_ms);
    }

    /// Nodes heard and not yet stored.
    pub fn pending(&self) -> usize {
        self.heard.lock().expect("not poisoned").len()
    }

    /// Stores what was heard; on a failed write, what it carried is kept for the next.
    pub async fn flush(&self, store: &Store) -> Result<usize, StoreError> {
        let mut heard: Vec<(Mac, i64)> =
            std::mem::take(&mut *self.heard.lock().expect("not poisoned"))
                .into_iter()
                .collect();
        // One order for every server's writes, so that two flushing at once on
        // PostgreSQL take their row locks in the same order.
        heard.sort_unstable();
        let total = heard.len();
        for (i, chunk) in heard.chunks(CHUNK).enumerate() {
            if let Err(e) = store.record_heartbeats(chunk).await {
                for (mac, at) in &heard[i * CHUNK..] {
                    self.heard(*mac, *at);
                }
                return Err(e);
            }
        }
        Ok(total)
    }

    /// Flushes every `every` until `stop`, and once more then.
    pub async fn run(
        self: std::sync::Arc<Self>,
        store: Store,
        every: Duration,
        stop: CancellationToken,
    ) {
        loop {
            let stopping = tokio::select! {
                () = tokio::time::sleep(every) => false,
                () = stop.cancelled() => true,
            };
            if let Err(e) = self.flush(&store).await {
                tracing::warn!(error = %e, nodes = self.pending(), "cannot store when nodes were last heard");
            }
            if stopping {
                return;
            }
        }
    }
}
