//! Event retention: the log keeps `[events] retain_days` and at most `max_events` rows;
//! older ones are deleted in small batches by one server (the sweeper's role lease).

use std::time::Duration;

use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::store::Store;

/// `[events]` in the settings file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Retention {
    /// Events older than this are deleted [default: 30].
    pub retain_days: u64,
    /// At most this many events are kept, the newest [default: 1000000].
    pub max_events: i64,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            retain_days: 30,
            max_events: 1_000_000,
        }
    }
}

/// Rows deleted per statement: short transactions, so writers never wait long.
const BATCH: i64 = 5000;
const EVERY: Duration = Duration::from_secs(600);

/// Deletes what the policy no longer keeps; returns how many events went.
pub async fn prune(store: &Store, policy: &Retention) -> Result<u64, crate::store::StoreError> {
    let before = crate::clock::now_ms() - (policy.retain_days as i64).saturating_mul(86_400_000);
    let mut total = 0;
    loop {
        let gone = store
            .prune_events(before, policy.max_events.max(1), BATCH)
            .await?;
        total += gone;
        if gone < BATCH as u64 {
            return Ok(total);
        }
        tokio::task::yield_now().await;
    }
}

pub async fn run(
    store: Store,
    policy: Retention,
    mut leading: tokio::sync::watch::Receiver<bool>,
    stop: CancellationToken,
) {
    loop {
        if !crate::leader::until_leading(&mut leading, &stop).await {
            return;
        }
        match prune(&store, &policy).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(deleted = n, "event retention"),
            Err(e) => tracing::warn!(error = %e, "cannot prune events"),
        }
        tokio::select! {
            () = tokio::time::sleep(EVERY) => {}
            () = stop.cancelled() => return,
        }
    }
}
