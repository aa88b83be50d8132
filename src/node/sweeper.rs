//! Finds nodes that went silent: a node that should heartbeat (or attest) and did not
//! within the policy's timeout becomes unreachable. The judgement is the policy's (pure);
//! this is the periodic scan and the transition.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::node::controller::{ControlError, NodeController};
use crate::node::policy::LifecyclePolicy;
use crate::node::state::NodeEvent;
use crate::store::Store;

/// How often to scan: a quarter of the shortest timeout, between 1 and 15 seconds.
pub fn scan_interval(policy: &LifecyclePolicy) -> Duration {
    let shortest = policy.heartbeat_timeout_secs.min(policy.boot_timeout_secs);
    Duration::from_millis((shortest * 250).clamp(1000, 15_000))
}

/// Marks every overdue node unreachable; returns how many were.
pub async fn sweep(
    store: &Store,
    controller: &NodeController,
    policy: &LifecyclePolicy,
) -> Result<usize, crate::store::StoreError> {
    let now = crate::clock::now_ms();
    let mut marked = 0;
    for (mac, state, seen) in store.last_seen().await? {
        if !policy.is_overdue(state, seen, now) {
            continue;
        }
        let silent = Duration::from_millis((now - seen).max(0) as u64 / 1000 * 1000);
        let reason = format!(
            "silent for {} while {state} (allowed: {} s)",
            humantime::format_duration(silent),
            policy.silence_allowed_ms(state).unwrap_or(0) / 1000
        );
        match controller
            .apply(&mac, NodeEvent::HeartbeatLost, &reason)
            .await
        {
            Ok(_) => marked += 1,
            // It changed under us (it spoke, or rebooted): judged again next scan.
            Err(ControlError::NotAllowed(_) | ControlError::Contended(_)) => {}
            Err(
                ControlError::UnknownNode(_)
                | ControlError::AlreadyAttested
                | ControlError::InUse(..),
            ) => {}
            Err(ControlError::Store(e)) => return Err(e),
        }
    }
    Ok(marked)
}

pub async fn run(
    store: Store,
    controller: NodeController,
    policy: LifecyclePolicy,
    mut leading: tokio::sync::watch::Receiver<bool>,
    stop: CancellationToken,
) {
    let every = scan_interval(&policy);
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = stop.cancelled() => return,
        }
        // One sweeper among servers sharing a store (`leader::SWEEPER`).
        if !crate::leader::until_leading(&mut leading, &stop).await {
            return;
        }
        if let Err(e) = sweep(&store, &controller, &policy).await {
            tracing::warn!(error = %e, "cannot scan for silent nodes");
        }
    }
}
