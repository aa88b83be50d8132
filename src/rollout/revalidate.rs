//! Revalidations behind a drain. A validation burns the GPUs in, so a `[health]` rule's
//! `revalidate` on a node with a workload scheduler must not start under a customer's
//! job: the node service queues it (`RolloutService::revalidate_after_drain`: a row and
//! its `health.drain` event), and the rollout controller, under its role, looks at each
//! queued one every tick: in its turn (at most `[drain] revalidations_at_once` drained at
//! once) it asks the drain; once drained the node is sent to validate (its next heartbeat
//! answers "revalidate"); once ready again it is handed back; a node that does not come
//! back ready is left drained for a look, and says so in an event.

use crate::api::event::HealthDrainData;
use crate::api::{Mac, NodeState};
use crate::clock::now_ms;
use crate::node::state::NodeEvent;
use crate::store::{NodeRecord, RevalidationDrain, StoreError};

use super::drain::{Drain, Target};
use super::plan::{DrainRules, DrainTimeout};
use super::run::Controller;

/// What to do with one queued revalidation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    Wait,
    /// Its turn (within `[drain] revalidations_at_once`): ask the drain.
    Ask,
    /// The scheduler does not know of the drain (asked before a restart, or resumed by
    /// someone): ask again.
    AskAgain,
    /// Drained (or past the timeout with `on_timeout = "force"`): send it to validate.
    Revalidate,
    /// A validation is under way already (it rebooted, say): it counts.
    Validating,
    /// The row ends: `step` and `why` for its event; `resume` whether to hand it back
    /// (`resumed`: ready again after its validation).
    End {
        step: &'static str,
        why: String,
        resume: bool,
    },
}

/// Where a booting or validating node is: on its way through a validation.
fn validating(state: NodeState) -> bool {
    matches!(
        state,
        NodeState::Provisioning | NodeState::Booted | NodeState::Validating
    )
}

/// Silent for now: its next heartbeat revalidates it (a long burn-in may miss one), so
/// it is waited for, not given up on.
fn silent(state: NodeState) -> bool {
    state == NodeState::Unreachable
}

/// The rule, pure: `drain` is what the scheduler says (None: not asked, or it did not
/// answer); only read for a draining node that is still ready or degraded. `room`:
/// whether one more drain may be asked now.
pub fn next(
    row: &RevalidationDrain,
    node: Option<&NodeRecord>,
    drain: Option<Drain>,
    rules: DrainRules,
    now_ms: i64,
    room: bool,
) -> Next {
    let Some(node) = node else {
        return Next::End {
            step: "left-drained",
            why: "the node was removed".into(),
            resume: false,
        };
    };
    let left = || Next::End {
        step: "left-drained",
        why: format!("it is {}: {}", node.state, node.state_reason),
        resume: false,
    };
    let Some(asked_at_ms) = row.asked_at_ms else {
        // Waiting its turn: nothing drained yet, so nothing to hand back.
        return match node.state {
            NodeState::Ready | NodeState::Degraded if room => Next::Ask,
            NodeState::Ready | NodeState::Degraded => Next::Wait,
            s if silent(s) => Next::Wait,
            s => Next::End {
                step: "dropped",
                why: format!("it is {s} before its turn: nothing was drained"),
                resume: false,
            },
        };
    };
    if let Some(since) = row.validating_at_ms {
        return match node.state {
            NodeState::Ready => Next::End {
                step: "resumed",
                why: "ready again".into(),
                resume: true,
            },
            s if !(validating(s) || silent(s)) => left(),
            // Not back within the drain's own time: left drained, and said so, rather
            // than waited for without a word.
            s if now_ms - since > rules.timeout_ms => Next::End {
                step: "left-drained",
                why: format!(
                    "not ready within {} s of its revalidation (it is {s}: {})",
                    rules.timeout_ms / 1000,
                    node.state_reason
                ),
                resume: false,
            },
            _ => Next::Wait,
        };
    }
    match node.state {
        NodeState::Ready | NodeState::Degraded => {}
        s if validating(s) => return Next::Validating,
        s if silent(s) => return Next::Wait,
        _ => return left(),
    }
    if drain == Some(Drain::Drained) {
        return Next::Revalidate;
    }
    if now_ms - asked_at_ms > rules.timeout_ms {
        match rules.on_timeout {
            DrainTimeout::Skip => {
                return Next::End {
                    step: "timed-out",
                    why: format!(
                        "not drained within {} s: handed back, not revalidated",
                        rules.timeout_ms / 1000
                    ),
                    resume: true,
                };
            }
            DrainTimeout::Force => return Next::Revalidate,
            DrainTimeout::Wait => {}
        }
    }
    if drain == Some(Drain::NotDraining) {
        return Next::AskAgain;
    }
    Next::Wait
}

/// Asks `node`'s scheduler for the drain; a refusal is logged (the next look, finding it
/// not draining, asks again).
async fn ask_drain(
    scheduler: Option<&dyn super::drain::Scheduler>,
    node: Option<&NodeRecord>,
    row: &RevalidationDrain,
) {
    if let (Some(s), Some(n)) = (scheduler, node)
        && let Err(e) = s
            .drain(
                &Target::from(n),
                &format!("bootfleet revalidation: {}", row.reason),
            )
            .await
    {
        tracing::warn!(mac = %row.mac, error = %e, "cannot ask for the drain; asking again next tick");
    }
}

impl Controller {
    /// One look at every queued revalidation; how many there were.
    pub(super) async fn tick_revalidations(&self) -> Result<usize, StoreError> {
        let rows = self.store.revalidation_drains().await?;
        if rows.is_empty() {
            return Ok(0);
        }
        let macs: Vec<Mac> = rows.iter().map(|r| r.mac).collect();
        let nodes = self.records(&macs).await?;
        // Oldest first: each waiting one takes a free place in turn.
        let asked = rows.iter().filter(|r| r.asked_at_ms.is_some()).count();
        let mut room = self.drain.revalidations_at_once.saturating_sub(asked);
        for row in &rows {
            // One node's trouble is logged and does not stop the others.
            match self.revalidation(row, nodes.get(&row.mac), room > 0).await {
                Ok(true) => room = room.saturating_sub(1),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(mac = %row.mac, error = %e, "revalidation behind a drain: a look failed; trying again next tick");
                }
            }
        }
        Ok(rows.len())
    }

    /// One look at `row`; true when it took a place (its drain was asked now).
    async fn revalidation(
        &self,
        row: &RevalidationDrain,
        node: Option<&NodeRecord>,
        room: bool,
    ) -> Result<bool, StoreError> {
        let scheduler = node.and_then(|n| self.schedulers.of(n).ok().flatten());
        let asks_scheduler = row.asked_at_ms.is_some()
            && row.validating_at_ms.is_none()
            && node.is_some_and(|n| matches!(n.state, NodeState::Ready | NodeState::Degraded));
        let drain = match (scheduler, node) {
            (Some(s), Some(n)) if asks_scheduler => match s.state(&Target::from(n)).await {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::warn!(mac = %row.mac, error = %e, "cannot ask how the drain stands");
                    None
                }
            },
            _ => None,
        };
        let event = |step: &str, reason: String| HealthDrainData {
            step: step.into(),
            reason,
        };
        match next(row, node, drain, self.drain.rules(), now_ms(), room) {
            Next::Wait => Ok(false),
            Next::Ask => {
                // Marked first: a restart before the ask finds the scheduler not
                // draining, and asks again (`AskAgain`).
                let reason = row.reason.clone();
                if !self
                    .store
                    .revalidation_asked(&row.mac, now_ms(), &event("asked", reason))
                    .await?
                {
                    return Ok(false);
                }
                ask_drain(scheduler, node, row).await;
                Ok(true)
            }
            Next::AskAgain => {
                ask_drain(scheduler, node, row).await;
                Ok(false)
            }
            Next::Revalidate => {
                // The flag first, then the move, then the row: a restart anywhere in
                // between leaves a node that validates (once more, at worst).
                self.store.request_revalidate(&row.mac).await?;
                let reason = format!("drained; revalidating: {}", row.reason);
                match self
                    .nodes
                    .apply(&row.mac, NodeEvent::ValidationStarted, &reason)
                    .await
                {
                    Ok(_) => {}
                    // It moved meanwhile (rebooted, failed): the flag goes (it would start a
                    // validation later, under whatever runs then); the next look sees where.
                    Err(e) => {
                        tracing::info!(mac = %row.mac, error = %e, "revalidation behind a drain: the node moved");
                        self.store.take_revalidate(&row.mac).await?;
                        return Ok(false);
                    }
                }
                self.store
                    .revalidation_validating(&row.mac, now_ms(), &event("revalidating", reason))
                    .await?;
                Ok(false)
            }
            Next::Validating => {
                let reason = "a validation under way counts as the revalidation".to_string();
                self.store
                    .revalidation_validating(&row.mac, now_ms(), &event("revalidating", reason))
                    .await?;
                Ok(false)
            }
            Next::End { step, why, resume } => {
                self.end_revalidation(row, node, scheduler, step, why, resume)
                    .await?;
                Ok(false)
            }
        }
    }

    /// Ends the row with its event, handing the node back first when `resume`.
    async fn end_revalidation(
        &self,
        row: &RevalidationDrain,
        node: Option<&NodeRecord>,
        scheduler: Option<&dyn super::drain::Scheduler>,
        step: &str,
        why: String,
        resume: bool,
    ) -> Result<(), StoreError> {
        let mut reason = why;
        if resume && let (Some(s), Some(n)) = (scheduler, node) {
            match s
                .resume(
                    &Target::from(n),
                    &format!("bootfleet revalidation: {}", row.reason),
                )
                .await
            {
                Ok(()) => reason.push_str(": handed back to its scheduler"),
                // A refusal costs the event's words, as for a rollout: the row ends
                // either way (kept, it would ask on every look, for ever).
                Err(e) => reason.push_str(&format!(": not handed back to its scheduler: {e}")),
            }
        }
        let data = HealthDrainData {
            step: step.into(),
            reason,
        };
        self.store.end_revalidation_drain(&row.mac, &data).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: DrainRules = DrainRules {
        timeout_ms: 10_000,
        on_timeout: DrainTimeout::Skip,
    };

    fn row(validating: bool) -> RevalidationDrain {
        RevalidationDrain {
            mac: "02:00:00:00:00:01".parse().unwrap(),
            reason: "ecc-rising".into(),
            queued_at_ms: 500,
            asked_at_ms: Some(1_000),
            validating_at_ms: validating.then_some(2_000),
        }
    }

    fn node(state: NodeState) -> NodeRecord {
        NodeRecord {
            mac: "02:00:00:00:00:01".parse().unwrap(),
            uuid: None,
            hostname: None,
            labels: Default::default(),
            assigned: None,
            state,
            state_reason: "why".into(),
            version: 1,
            created_at: String::new(),
            updated_at: String::new(),
            bmc: None,
            revalidate_requested: false,
        }
    }

    #[test]
    fn validation_waits_for_the_drain() {
        let ready = node(NodeState::Ready);
        let at = |d| next(&row(false), Some(&ready), d, RULES, 2_000, false);
        assert_eq!(at(Some(Drain::Draining)), Next::Wait);
        assert_eq!(at(None), Next::Wait);
        assert_eq!(at(Some(Drain::NotDraining)), Next::AskAgain);
        assert_eq!(at(Some(Drain::Drained)), Next::Revalidate);
        let degraded = node(NodeState::Degraded);
        assert_eq!(
            next(
                &row(false),
                Some(&degraded),
                Some(Drain::Drained),
                RULES,
                2_000,
                false
            ),
            Next::Revalidate
        );
    }

    #[test]
    fn a_queued_one_waits_its_turn_and_is_dropped_if_the_node_moves() {
        let mut waiting = row(false);
        waiting.asked_at_ms = None;
        let at = |state, room| next(&waiting, Some(&node(state)), None, RULES, 60_000, room);
        assert_eq!(at(NodeState::Ready, true), Next::Ask);
        assert_eq!(at(NodeState::Degraded, true), Next::Ask);
        // No place free: it waits, and its drain timeout has not started.
        assert_eq!(at(NodeState::Ready, false), Next::Wait);
        assert_eq!(at(NodeState::Unreachable, true), Next::Wait);
        for state in [
            NodeState::Validating,
            NodeState::Reimaging,
            NodeState::Quarantined,
        ] {
            assert!(
                matches!(
                    at(state, true),
                    Next::End {
                        step: "dropped",
                        resume: false,
                        ..
                    }
                ),
                "{state}"
            );
        }
    }

    #[test]
    fn handed_back_only_ready_after_its_validation() {
        let at = |state| next(&row(true), Some(&node(state)), None, RULES, 3_000, false);
        assert_eq!(at(NodeState::Validating), Next::Wait);
        assert_eq!(at(NodeState::Provisioning), Next::Wait);
        let resumed = |n: Next| {
            matches!(
                n,
                Next::End {
                    step: "resumed",
                    resume: true,
                    ..
                }
            )
        };
        assert!(resumed(at(NodeState::Ready)));
        // A missed heartbeat mid burn-in: its next one revalidates it.
        assert_eq!(at(NodeState::Unreachable), Next::Wait);
        // But not for ever: past the drain's time it is left drained, with why.
        let late = 2_000 + RULES.timeout_ms + 1;
        for state in [NodeState::Validating, NodeState::Unreachable] {
            let n = node(state);
            assert!(
                matches!(
                    next(&row(true), Some(&n), None, RULES, late, false),
                    Next::End { step: "left-drained", resume: false, ref why } if why.starts_with("not ready within 10 s")
                ),
                "{state}"
            );
        }
        let ready = node(NodeState::Ready);
        assert!(resumed(next(
            &row(true),
            Some(&ready),
            None,
            RULES,
            late,
            false
        )));
        for state in [
            NodeState::ValidationFailed,
            NodeState::Quarantined,
            NodeState::Degraded,
            NodeState::Reimaging,
        ] {
            assert!(
                matches!(
                    at(state),
                    Next::End {
                        step: "left-drained",
                        resume: false,
                        ..
                    }
                ),
                "{state}"
            );
        }
    }

    #[test]
    fn a_node_that_moved_while_draining() {
        let at = |state| next(&row(false), Some(&node(state)), None, RULES, 2_000, false);
        assert_eq!(at(NodeState::Validating), Next::Validating);
        assert_eq!(at(NodeState::Provisioning), Next::Validating);
        assert_eq!(at(NodeState::Unreachable), Next::Wait);
        assert!(matches!(
            at(NodeState::ValidationFailed),
            Next::End { resume: false, .. }
        ));
        assert!(matches!(
            next(&row(false), None, None, RULES, 2_000, false),
            Next::End { resume: false, .. }
        ));
    }

    #[test]
    fn a_drain_past_its_timeout_follows_on_timeout() {
        let ready = node(NodeState::Ready);
        let late = 1_000 + RULES.timeout_ms + 1;
        let with = |on_timeout| DrainRules {
            on_timeout,
            ..RULES
        };
        let at = |on_timeout| {
            next(
                &row(false),
                Some(&ready),
                Some(Drain::Draining),
                with(on_timeout),
                late,
                false,
            )
        };
        assert!(matches!(
            at(DrainTimeout::Skip),
            Next::End {
                step: "timed-out",
                resume: true,
                ..
            }
        ));
        assert_eq!(at(DrainTimeout::Force), Next::Revalidate);
        assert_eq!(at(DrainTimeout::Wait), Next::Wait);
    }
}
