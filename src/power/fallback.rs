//! Carries a reimage to nodes that do not answer: a node asked to reimage that has not
//! started a new boot within `[reimage] agent_grace_secs` (its agent never asked for the
//! reboot), or at once when it could not have asked (it was unreachable, failed
//! attestation, never booted, or went silent since), is given a one-time network boot and
//! power-cycled through its BMC. A try that fails is retried after `[power] retry_secs`,
//! doubled each time; after `[power] attempts` tries the node is quarantined with the
//! BMC's last error, for a human. The budget was spent when the reimage was admitted:
//! these cycles only reach nodes it already counts.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::api::Mac;
use crate::api::NodeState;
use crate::api::power::PowerAction;
use crate::node::controller::NodeController;
use crate::node::state::NodeEvent;
use crate::store::{PendingReimage, PowerRow, Store, StoreError};

use super::service::PowerService;

/// The reason every fallback action carries; tries are counted by it.
pub const REASON_PREFIX: &str = "reimage fallback";

/// How often pending reimages are looked at.
pub const SCAN_EVERY: Duration = Duration::from_secs(5);

/// What to do about one pending reimage now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    Wait,
    /// Cycle it, saying why.
    Cycle(String),
    /// Out of tries: quarantine it with this reason.
    GiveUp(String),
}

/// Whether a node in `from` (or now in `state`) could ask for its reboot at all.
fn could_answer(p: &PendingReimage) -> bool {
    p.state == NodeState::Reimaging
        && matches!(
            p.from,
            Some(
                NodeState::Booted
                    | NodeState::Validating
                    | NodeState::Ready
                    | NodeState::ValidationFailed
                    | NodeState::Drifted
                    | NodeState::Degraded
            )
        )
}

/// The rule, pure: `tries` are this reimage's fallback actions, newest first.
pub fn next(
    p: &PendingReimage,
    tries: &[PowerRow],
    now_ms: i64,
    grace_secs: u64,
    attempts: u32,
    retry_secs: u64,
) -> Next {
    let grace_ms = grace_secs as i64 * 1000;
    if could_answer(p) && now_ms < p.since_ms + grace_ms {
        return Next::Wait;
    }
    let failures = tries.iter().filter(|t| t.outcome != "ok").count() as u32;
    if tries.len() as u32 >= attempts.max(1) {
        let last = tries.first().map(|t| t.outcome.as_str()).unwrap_or("");
        let why = if failures == 0 {
            format!(
                "reimage not begun after {} power cycles through the BMC; needs a human",
                tries.len()
            )
        } else {
            format!(
                "reimage could not reach the node: {failures} of {} tries through the BMC failed, the last with: {last}; needs a human",
                tries.len()
            )
        };
        return Next::GiveUp(why);
    }
    if let Some(last) = tries.first() {
        // After a cycle that went through, the node is given the grace to boot; after a
        // failure, the back-off.
        let wait_ms = if last.outcome == "ok" {
            grace_ms.max(retry_secs as i64 * 1000)
        } else {
            (retry_secs as i64 * 1000) << failures.saturating_sub(1).min(10)
        };
        if now_ms < last.at_ms + wait_ms {
            return Next::Wait;
        }
    }
    let why = if could_answer(p) {
        format!("{REASON_PREFIX}: no reboot asked for within {grace_secs} s")
    } else {
        let was = p.from.map(|s| s.as_str()).unwrap_or("unknown");
        format!(
            "{REASON_PREFIX}: the node cannot answer (was {was}, now {})",
            p.state
        )
    };
    Next::Cycle(why)
}

/// One scan: acts on every pending reimage whose time has come; returns how many it
/// acted on.
pub async fn scan(
    store: &Store,
    power: &PowerService,
    controller: &NodeController,
    grace_secs: u64,
) -> Result<usize, StoreError> {
    let now = crate::clock::now_ms();
    let settings = power.settings().clone();
    let mut acted = 0;
    for p in store.pending_reimages().await? {
        let Some(node) = store.node(&p.mac).await? else {
            continue;
        };
        if node.bmc.is_none() {
            continue;
        }
        let tries: Vec<PowerRow> = store
            .power_actions(&p.mac, 50)
            .await?
            .into_iter()
            .filter(|t| t.at_ms >= p.since_ms && t.reason.starts_with(REASON_PREFIX))
            .collect();
        match next(
            &p,
            &tries,
            now,
            grace_secs,
            settings.attempts,
            settings.retry_secs,
        ) {
            Next::Wait => {}
            Next::Cycle(why) => {
                acted += 1;
                cycle(power, &p.mac, &why).await;
            }
            Next::GiveUp(why) => {
                acted += 1;
                if let Err(e) = controller
                    .apply(&p.mac, NodeEvent::QuarantineImposed, &why)
                    .await
                {
                    tracing::warn!(mac = %p.mac, error = %e, "cannot quarantine a node the BMC could not reach");
                }
            }
        }
    }
    Ok(acted)
}

async fn cycle(power: &PowerService, mac: &Mac, why: &str) {
    // The outcome is recorded by the service (a row and an event) either way.
    if let Err(e) = power.act_counted(mac, PowerAction::Cycle, why).await {
        tracing::warn!(%mac, error = %e, "reimage fallback: power cycle failed");
    }
}

pub async fn run(
    store: Store,
    power: std::sync::Arc<PowerService>,
    controller: NodeController,
    grace_secs: u64,
    mut leading: tokio::sync::watch::Receiver<bool>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(SCAN_EVERY) => {}
            () = stop.cancelled() => return,
        }
        // One server acts for all that share a store (`leader::POWER`).
        if !crate::leader::until_leading(&mut leading, &stop).await {
            return;
        }
        if let Err(e) = scan(&store, &power, &controller, grace_secs).await {
            tracing::warn!(error = %e, "cannot scan for reimages to carry through the BMC");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(from: NodeState, state: NodeState) -> PendingReimage {
        PendingReimage {
            mac: "52:54:00:00:00:01".parse().unwrap(),
            since_ms: 1_000_000,
            from: Some(from),
            state,
        }
    }

    fn tried(at_ms: i64, outcome: &str) -> PowerRow {
        PowerRow {
            at_ms,
            action: "cycle".into(),
            reason: format!("{REASON_PREFIX}: x"),
            outcome: outcome.into(),
            took_ms: 5,
        }
    }

    #[test]
    fn a_node_that_could_answer_gets_the_grace_first() {
        let p = pending(NodeState::Ready, NodeState::Reimaging);
        assert_eq!(next(&p, &[], 1_000_000 + 299_000, 300, 3, 60), Next::Wait);
        assert!(
            matches!(next(&p, &[], 1_000_000 + 300_000, 300, 3, 60), Next::Cycle(w) if w.contains("within 300 s"))
        );
    }

    #[test]
    fn a_node_that_cannot_answer_is_cycled_at_once() {
        for p in [
            pending(NodeState::Unreachable, NodeState::Reimaging),
            pending(NodeState::AttestationFailed, NodeState::Reimaging),
            pending(NodeState::Ready, NodeState::Unreachable),
        ] {
            assert!(
                matches!(next(&p, &[], 1_000_001, 300, 3, 60), Next::Cycle(w) if w.contains("cannot answer")),
                "{p:?}"
            );
        }
    }

    #[test]
    fn failures_back_off_then_give_up_with_the_last_error() {
        let p = pending(NodeState::Unreachable, NodeState::Reimaging);
        let one = [tried(2_000_000, "BMC unreachable: refused")];
        assert_eq!(next(&p, &one, 2_000_000 + 59_000, 300, 3, 60), Next::Wait);
        assert!(matches!(
            next(&p, &one, 2_000_000 + 60_000, 300, 3, 60),
            Next::Cycle(_)
        ));
        let two = [
            tried(3_000_000, "BMC unreachable: refused"),
            tried(2_000_000, "x"),
        ];
        assert_eq!(next(&p, &two, 3_000_000 + 119_000, 300, 3, 60), Next::Wait);
        assert!(matches!(
            next(&p, &two, 3_000_000 + 120_000, 300, 3, 60),
            Next::Cycle(_)
        ));
        let three = [
            tried(4_000_000, "BMC unreachable: refused"),
            tried(3_000_000, "x"),
            tried(2_000_000, "x"),
        ];
        match next(&p, &three, 4_000_001, 300, 3, 60) {
            Next::GiveUp(w) => assert!(
                w.contains("3 of 3") && w.contains("refused") && w.contains("human"),
                "{w}"
            ),
            n => panic!("{n:?}"),
        }
    }

    #[test]
    fn a_cycle_that_went_through_is_given_time_to_boot() {
        let p = pending(NodeState::Unreachable, NodeState::Reimaging);
        let ok = [tried(2_000_000, "ok")];
        assert_eq!(next(&p, &ok, 2_000_000 + 299_000, 300, 3, 60), Next::Wait);
        assert!(matches!(
            next(&p, &ok, 2_000_000 + 300_000, 300, 3, 60),
            Next::Cycle(_)
        ));
    }
}
