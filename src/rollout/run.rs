//! The rollout controller, one server at a time (the `rollouts` role): every tick it
//! reads each active rollout, asks its schedulers how their drains stand, asks
//! `plan::tick` what that means, and writes it. Every write is a compare-and-set in the
//! store (a step from its status, a rollout from its version), and a step's reimage is
//! written with the node's move to reimaging, so a server killed anywhere here leaves a
//! state the next holder goes on from: no node is reimaged twice, none is skipped.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::api::event::kind;
use crate::api::refs::ImageRef;
use crate::api::rollout::{RolloutEventData, RolloutRequest, RolloutState, StepStatus};
use crate::api::{Digest, Mac, NodeState};
use crate::clock::now_ms;
use crate::node::reimage::{DisruptionBudget, decide};
use crate::registry::Registry;
use crate::store::{
    NodeRecord, ReimageDecision, ReimageOutcome, RolloutMove, RolloutNodeRow, RolloutRow, StepMove,
    StepReimage, Store, StoreError,
};

use super::drain::{Drain, DrainSettings, Schedulers, Target};
use super::plan::{self, Action, Change, NodeNow, StepNow};

/// `[rollouts]`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutSettings {
    /// Milliseconds between the controller's looks at active rollouts.
    pub tick_ms: u64,
}

impl Default for RolloutSettings {
    fn default() -> Self {
        Self { tick_ms: 1000 }
    }
}

#[derive(Clone)]
pub struct Controller {
    pub store: Store,
    /// The one writer of node state: a step's reimage goes through it.
    pub nodes: crate::node::controller::NodeController,
    pub registry: Registry,
    pub budget: DisruptionBudget,
    pub schedulers: Arc<Schedulers>,
    pub drain: DrainSettings,
    pub tick: Duration,
    /// What the last look read of each node, by the node's version and its step.
    pub seen: Arc<std::sync::Mutex<std::collections::HashMap<Mac, (NodeKey, NodeNow)>>>,
}

/// A node row's version, its step's start and status: what a look's view of it depends on.
pub type NodeKey = (i64, Option<i64>, StepStatus);

/// The least time between two looks: a look follows the events (a node ready, a step
/// moved) that could change what it decides, but not faster than this.
const MIN_GAP: Duration = Duration::from_millis(100);

/// Looks at active rollouts while this server holds the role, until `stop`: every
/// `tick`, and (while any is active) sooner when events are committed (a node that got ready starts the next
/// node at once, not a tick later: waves follow each other without idle gaps).
pub async fn run(ctrl: Controller, mut leading: watch::Receiver<bool>, stop: CancellationToken) {
    let mut events = ctrl.store.subscribe_events();
    loop {
        if !crate::leader::until_leading(&mut leading, &stop).await {
            return;
        }
        while *leading.borrow() {
            events.mark_unchanged();
            let active = match ctrl.tick_all().await {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(error = %e, "rollout controller: a look failed; trying again next tick");
                    0
                }
            };
            // With nothing to move, events (a boot storm writes thousands) do not wake
            // it: a new rollout waits for the tick.
            if active == 0 {
                tokio::select! {
                    () = tokio::time::sleep(ctrl.tick) => {}
                    () = stop.cancelled() => return,
                }
                continue;
            }
            tokio::select! {
                () = tokio::time::sleep(ctrl.tick) => {}
                _ = events.changed() => {}
                () = stop.cancelled() => return,
            }
            tokio::select! {
                () = tokio::time::sleep(MIN_GAP.min(ctrl.tick)) => {}
                () = stop.cancelled() => return,
            }
        }
    }
}

/// One step's move, its times set as the new status wants.
fn step_move<'a>(
    version: i64,
    mac: &'a Mac,
    from: StepStatus,
    to: StepStatus,
    reason: &'a str,
    kind: &'a str,
) -> StepMove<'a> {
    let now = now_ms();
    let starts = to.in_flight();
    let finishes = matches!(
        to,
        StepStatus::Done
            | StepStatus::Failed
            | StepStatus::Skipped
            | StepStatus::RolledBack
            | StepStatus::RollbackFailed
    );
    StepMove {
        version,
        mac,
        from,
        to,
        reason,
        started_at_ms: starts.then_some(now),
        finished_at_ms: finishes.then_some(now),
        event_kind: kind,
    }
}

impl Controller {
    /// The nodes `macs` as they are now, by MAC (a removed one is absent).
    pub(super) async fn records(
        &self,
        macs: &[Mac],
    ) -> Result<std::collections::HashMap<Mac, NodeRecord>, StoreError> {
        let found = self.store.nodes_in(macs).await?;
        Ok(found.into_iter().map(|n| (n.mac, n)).collect())
    }

    /// One look at every active rollout; how many there were.
    pub async fn tick_all(&self) -> Result<usize, StoreError> {
        let active = self.store.active_rollouts().await?;
        for &id in &active {
            // A rollout that opened a wave is looked at again at once: the wave's
            // nodes start now, not at the next look. One rollout's trouble (a corrupt
            // row, a store error) is logged and does not stop the others.
            for _ in 0..3 {
                match self.tick_one(id).await {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(e) => {
                        tracing::warn!(rollout = id, error = %e, "rollout controller: a look failed; trying again next tick");
                        break;
                    }
                }
            }
        }
        // Revalidations behind a drain: the same look, the same role.
        let queued = self.tick_revalidations().await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "revalidations behind a drain: a look failed; trying again next tick");
            0
        });
        Ok(active.len() + queued)
    }

    /// One look at rollout `id`; true when it opened a wave and runs on.
    async fn tick_one(&self, id: i64) -> Result<bool, StoreError> {
        let Some((row, rows)) = self.store.rollout(id).await? else {
            return Ok(false);
        };
        let spec: RolloutRequest = serde_json::from_str(&row.spec_json)
            .map_err(|e| StoreError::Corrupt(format!("rollout {id} spec: {e}")))?;
        // The nodes a look can judge or start: those in flight, and the first
        // max-unavailable waiting (pending in this wave, or queued for rollback); the
        // plan starts no more than that.
        let limit = spec.max_unavailable as usize;
        let (mut pending, mut queued) = (0, 0);
        let wanted: Vec<bool> = rows
            .iter()
            .map(|r| match r.status {
                s if s.in_flight() => true,
                StepStatus::Pending if r.wave == row.wave => {
                    pending += 1;
                    pending <= limit
                }
                StepStatus::RollbackPending => {
                    queued += 1;
                    queued <= limit
                }
                _ => false,
            })
            .collect();
        let macs: Vec<Mac> = rows
            .iter()
            .zip(&wanted)
            .filter(|(_, w)| **w)
            .map(|(r, _)| r.mac)
            .collect();
        let records = self.records(&macs).await?;
        let mut steps = Vec::with_capacity(rows.len());
        for (r, wanted) in rows.into_iter().zip(wanted) {
            let now = match records.get(&r.mac) {
                Some(n) => Some(self.node_now(n, &r).await?),
                // Wanted and gone: the node was removed.
                None if wanted => None,
                // Not looked at: what the plan never judges needs no view.
                None => Some(NodeNow {
                    state: NodeState::Ready,
                    state_reason: String::new(),
                    booted: None,
                    booted_at: None,
                    failed: None,
                }),
            };
            steps.push(StepNow { row: r, node: now });
        }
        let drained = self.drains(&row, &spec, &steps, &records).await;
        let actions = plan::tick(&row, &spec, &steps, &drained, self.drain.rules(), now_ms());
        let next_wave = actions
            .iter()
            .any(|a| matches!(a, Action::Rollout(Change::NextWave { pause: false, .. })));
        for action in actions {
            self.apply(&row, &spec, &steps, &records, action).await?;
        }
        Ok(next_wave)
    }

    async fn node_now(&self, n: &NodeRecord, step: &RolloutNodeRow) -> Result<NodeNow, StoreError> {
        // A node whose row has not changed since the last look (same version, same step
        // start) is judged from what was read then: its boots and history moved with it.
        let key = (n.version, step.started_at_ms, step.status);
        if let Some((k, now)) = self.seen.lock().expect("not poisoned").get(&n.mac)
            && *k == key
        {
            return Ok(now.clone());
        }
        // Only a node in flight is judged: its newest boot, and its failures since.
        let (booted, booted_at) = if step.status.in_flight() {
            self.store.latest_boot(&n.mac).await?.unzip()
        } else {
            (None, None)
        };
        let failed = match step.started_at_ms {
            Some(since) if step.status.in_flight() && n.state != NodeState::Ready => {
                self.store.failure_since(&n.mac, since).await?
            }
            _ => None,
        };
        let now = NodeNow {
            state: n.state,
            state_reason: n.state_reason.clone(),
            booted,
            booted_at,
            failed,
        };
        let mut seen = self.seen.lock().expect("not poisoned");
        // Bounded: a look re-reads what it forgot.
        if seen.len() > 100_000 {
            seen.clear();
        }
        seen.insert(n.mac, (key, now.clone()));
        Ok(now)
    }

    /// The draining nodes whose scheduler says they are drained; a drain the scheduler
    /// does not know of (asked before a restart, or resumed by someone) is asked again.
    async fn drains(
        &self,
        row: &RolloutRow,
        spec: &RolloutRequest,
        steps: &[StepNow],
        records: &std::collections::HashMap<Mac, NodeRecord>,
    ) -> HashSet<Mac> {
        let mut drained = HashSet::new();
        for s in steps.iter().filter(|s| {
            matches!(
                s.row.status,
                StepStatus::Draining | StepStatus::RollbackDraining
            )
        }) {
            let Some(node) = records.get(&s.row.mac) else {
                continue;
            };
            let Ok(Some(scheduler)) = self.schedulers.of(node) else {
                continue;
            };
            let target = Target::from(node);
            match scheduler.state(&target).await {
                Ok(Drain::Drained) => {
                    drained.insert(s.row.mac);
                }
                Ok(Drain::Draining) => {}
                Ok(Drain::NotDraining) => {
                    if let Err(e) = scheduler.drain(&target, &drain_reason(row, spec)).await {
                        tracing::warn!(mac = %s.row.mac, error = %e, "cannot ask for the drain");
                    }
                }
                Err(e) => {
                    tracing::warn!(mac = %s.row.mac, error = %e, "cannot ask how the drain stands")
                }
            }
        }
        drained
    }

    async fn apply(
        &self,
        row: &RolloutRow,
        spec: &RolloutRequest,
        steps: &[StepNow],
        records: &std::collections::HashMap<Mac, NodeRecord>,
        action: Action,
    ) -> Result<(), StoreError> {
        match action {
            Action::Done(mac) => {
                self.resume(row, &mac, records).await?;
                let why = format!("ready on {}", row.digest);
                self.mark(row, &mac, StepStatus::Reimaging, StepStatus::Done, &why)
                    .await?;
            }
            Action::Fail(mac, why) => {
                self.mark(row, &mac, StepStatus::Reimaging, StepStatus::Failed, &why)
                    .await?;
            }
            Action::Start(mac) => self.start(row, spec, &mac, records).await?,
            Action::Again(mac, status) => {
                let Some(step) = steps.iter().find(|s| s.row.mac == mac) else {
                    return Ok(());
                };
                let assign = match (status, step.row.previous_digest) {
                    (StepStatus::RollingBack, Some(previous)) => {
                        match &step.row.previous_assigned {
                            Some(r) => self.assignment(r, &previous).await,
                            None => previous.to_string(),
                        }
                    }
                    _ => self.assignment(&spec.image, &row.digest).await,
                };
                let why = format!(
                    "reimaged again (stuck in a failure of an older boot); reimaging onto {assign}"
                );
                self.reimage(row, spec, &mac, (status, status), &assign, &why)
                    .await?;
            }
            Action::Reimage(mac, drain) => {
                let assign = self.assignment(&spec.image, &row.digest).await;
                let (from, to) = (StepStatus::Draining, StepStatus::Reimaging);
                let why = format!("{drain}; reimaging onto {assign}");
                self.reimage(row, spec, &mac, (from, to), &assign, &why)
                    .await?;
            }
            Action::Skip(mac, why) => {
                self.resume(row, &mac, records).await?;
                self.mark(row, &mac, StepStatus::Draining, StepStatus::Skipped, &why)
                    .await?;
            }
            Action::CancelDrain(mac) => {
                self.resume(row, &mac, records).await?;
                let why = "the rollout is rolling back: not reimaged";
                self.mark(row, &mac, StepStatus::Draining, StepStatus::Skipped, why)
                    .await?;
            }
            Action::QueueRollback(mac) => {
                let why = "reimaged while the rollout began rolling back";
                self.mark(
                    row,
                    &mac,
                    StepStatus::Reimaging,
                    StepStatus::RollbackPending,
                    why,
                )
                .await?;
            }
            Action::StartRollback(mac) => {
                self.start_rollback(row, spec, steps, &mac, records).await?
            }
            Action::RollbackReimage(mac, drain) => {
                let Some(step) = steps.iter().find(|s| s.row.mac == mac) else {
                    return Ok(());
                };
                let Some(assign) = self.rollback_assignment(&step.row).await else {
                    return Ok(());
                };
                let why = format!("{drain}; rolling back onto {assign}");
                let moves = (StepStatus::RollbackDraining, StepStatus::RollingBack);
                self.reimage(row, spec, &mac, moves, &assign, &why).await?;
            }
            Action::RolledBack(mac) => {
                self.resume(row, &mac, records).await?;
                let why = "ready on its previous image";
                self.mark(
                    row,
                    &mac,
                    StepStatus::RollingBack,
                    StepStatus::RolledBack,
                    why,
                )
                .await?;
            }
            Action::RollbackFailed(mac, why) => {
                let from = steps
                    .iter()
                    .find(|s| s.row.mac == mac)
                    .map_or(StepStatus::RollingBack, |s| s.row.status);
                self.mark(row, &mac, from, StepStatus::RollbackFailed, &why)
                    .await?;
            }
            Action::Rollout(change) => self.change(row, change).await?,
        }
        Ok(())
    }

    /// Moves one step from `from` to `to` with its event; false when it was not at `from`.
    async fn mark(
        &self,
        row: &RolloutRow,
        mac: &Mac,
        from: StepStatus,
        to: StepStatus,
        why: &str,
    ) -> Result<bool, StoreError> {
        let k = kind::rollout_node(to);
        let m = step_move(row.version, mac, from, to, why, &k);
        self.store.move_step(row.id, &m).await
    }

    /// What a node rolled back is assigned: its previous REF while that still means its
    /// previous digest, else that digest. None: it never booted before the rollout.
    async fn rollback_assignment(&self, step: &RolloutNodeRow) -> Option<String> {
        let previous = step.previous_digest?;
        Some(match &step.previous_assigned {
            Some(r) => self.assignment(r, &previous).await,
            None => previous.to_string(),
        })
    }

    /// A node queued for rollback: drained first when it has a scheduler (it may have
    /// taken work since it was handed back), else reimaged back at once.
    async fn start_rollback(
        &self,
        row: &RolloutRow,
        spec: &RolloutRequest,
        steps: &[StepNow],
        mac: &Mac,
        records: &std::collections::HashMap<Mac, NodeRecord>,
    ) -> Result<(), StoreError> {
        let (pending, failed) = (StepStatus::RollbackPending, StepStatus::RollbackFailed);
        let Some(step) = steps.iter().find(|s| s.row.mac == *mac) else {
            return Ok(());
        };
        let Some(assign) = self.rollback_assignment(&step.row).await else {
            let why = "no earlier boot to return to";
            self.mark(row, mac, pending, failed, why).await?;
            return Ok(());
        };
        let Some(node) = records.get(mac) else {
            self.mark(row, mac, pending, failed, "the node was removed")
                .await?;
            return Ok(());
        };
        match self.schedulers.of(node) {
            Err(e) => {
                self.mark(row, mac, pending, failed, &e.to_string()).await?;
            }
            Ok(Some(scheduler)) => {
                let reason = format!("rollout {} rolling back: {}", row.id, spec.reason.trim());
                let to = StepStatus::RollbackDraining;
                if self.mark(row, mac, pending, to, &reason).await?
                    && let Err(e) = scheduler.drain(&Target::from(node), &reason).await
                {
                    tracing::warn!(%mac, error = %e, "cannot ask for the drain; asking again next tick");
                }
            }
            Ok(None) => {
                let why = format!("rolling back onto {assign}");
                let moves = (pending, StepStatus::RollingBack);
                self.reimage(row, spec, mac, moves, &assign, &why).await?;
            }
        }
        Ok(())
    }

    /// What a node is assigned for `digest`: `reference` while it still means that
    /// digest (a tag keeps being followed), else the digest itself.
    async fn assignment(&self, reference: &str, digest: &Digest) -> String {
        let resolved = match ImageRef::parse(reference) {
            // A prefix is never stored: a later image could make it ambiguous.
            Ok(ImageRef::DigestPrefix(_)) | Err(_) => None,
            Ok(r) => self.registry.resolve(&r).await.ok(),
        };
        if resolved.as_ref() == Some(digest) {
            reference.to_string()
        } else {
            digest.to_string()
        }
    }

    async fn start(
        &self,
        row: &RolloutRow,
        spec: &RolloutRequest,
        mac: &Mac,
        records: &std::collections::HashMap<Mac, NodeRecord>,
    ) -> Result<(), StoreError> {
        let Some(node) = records.get(mac) else {
            let why = "the node was removed";
            self.mark(row, mac, StepStatus::Pending, StepStatus::Failed, why)
                .await?;
            return Ok(());
        };
        match self.schedulers.of(node) {
            Err(e) => {
                let why = e.to_string();
                self.mark(row, mac, StepStatus::Pending, StepStatus::Failed, &why)
                    .await?;
            }
            Ok(Some(scheduler)) => {
                let reason = drain_reason(row, spec);
                let moved = self
                    .mark(row, mac, StepStatus::Pending, StepStatus::Draining, &reason)
                    .await?;
                // Asked after the step is written: a restart in between asks again.
                if moved && let Err(e) = scheduler.drain(&Target::from(node), &reason).await {
                    tracing::warn!(%mac, error = %e, "cannot ask for the drain; asking again next tick");
                }
            }
            Ok(None) => {
                let assign = self.assignment(&spec.image, &row.digest).await;
                let steps = (StepStatus::Pending, StepStatus::Reimaging);
                let why = format!("reimaging onto {assign}");
                self.reimage(row, spec, mac, steps, &assign, &why).await?;
            }
        }
        Ok(())
    }

    /// The step's reimage under the disruption budget; a budget that is spent, or a
    /// node already reimaging for someone else (its failure policy, an admin), waits for
    /// the next tick. Not joined: such a node may have its script already, and would
    /// come up on what it was given then.
    async fn reimage(
        &self,
        row: &RolloutRow,
        spec: &RolloutRequest,
        mac: &Mac,
        (from, to): (StepStatus, StepStatus),
        assign: &str,
        why: &str,
    ) -> Result<(), StoreError> {
        let k = kind::rollout_node(to);
        let m = step_move(row.version, mac, from, to, why, &k);
        let reason = format!("rollout {}: {}", row.id, spec.reason.trim());
        let rule = |n: &NodeRecord, reimaging: &[NodeRecord]| decide(n, reimaging, &self.budget);
        let failed = |why: String| async move {
            let to = if to == StepStatus::RollingBack {
                StepStatus::RollbackFailed
            } else {
                StepStatus::Failed
            };
            self.mark(row, mac, from, to, &why).await
        };
        let outcome = match self
            .nodes
            .reimage_step(row.id, &m, assign, &reason, &rule)
            .await?
        {
            StepReimage::Moved | StepReimage::StaleStep => return Ok(()),
            StepReimage::Refused(outcome) => *outcome,
        };
        match outcome {
            ReimageOutcome::Refused(
                ReimageDecision::OverBudget(_) | ReimageDecision::AlreadyReimaging,
                _,
            ) => {}
            ReimageOutcome::Refused(ReimageDecision::NotAllowed(why), _) => {
                failed(why).await?;
            }
            ReimageOutcome::UnknownNode => {
                failed("the node was removed".into()).await?;
            }
            other => {
                tracing::warn!(%mac, ?other, "rollout reimage: unexpected answer; trying again next tick");
            }
        }
        Ok(())
    }

    /// Hands a node back to its scheduler, recording what came of it (a scheduler that
    /// refuses costs an event, not the rollout).
    async fn resume(
        &self,
        row: &RolloutRow,
        mac: &Mac,
        records: &std::collections::HashMap<Mac, NodeRecord>,
    ) -> Result<(), StoreError> {
        let Some(node) = records.get(mac) else {
            return Ok(());
        };
        let Ok(Some(scheduler)) = self.schedulers.of(node) else {
            return Ok(());
        };
        let reason = match scheduler
            .resume(&Target::from(node), &format!("rollout {}", row.id))
            .await
        {
            Ok(()) => "handed back to its scheduler".to_string(),
            Err(e) => format!("not handed back to its scheduler: {e}"),
        };
        let data = RolloutEventData {
            rollout: row.id,
            wave: None,
            reason,
        };
        self.store
            .record_event(
                kind::ROLLOUT_NODE_RESUMED,
                Some(mac),
                &serde_json::to_value(&data).expect("serialises"),
            )
            .await
    }

    async fn change(&self, row: &RolloutRow, change: Change) -> Result<(), StoreError> {
        const NONE: &[StepStatus] = &[];
        const FAILED: &[StepStatus] = &[StepStatus::Failed];
        let halted = kind::rollout_state(RolloutState::Halted);
        let (state, reason, wave, steps, event_kind) = match change {
            Change::NextWave { wave, pause: true } => (
                RolloutState::Paused,
                "paused after the canary wave: resume to go on".to_string(),
                wave,
                NONE,
                kind::rollout_state(RolloutState::Paused),
            ),
            Change::NextWave { wave, pause: false } => (
                RolloutState::Running,
                format!("wave {wave}"),
                wave,
                NONE,
                kind::ROLLOUT_WAVE.to_string(),
            ),
            Change::Halt {
                reason,
                rollback: false,
            } => (RolloutState::Halted, reason, row.wave, NONE, halted),
            Change::Halt {
                reason,
                rollback: true,
            } => {
                let reason = format!("{reason}: rolling back the failed nodes");
                (RolloutState::RollingBack, reason, row.wave, FAILED, halted)
            }
            Change::Finish => (
                RolloutState::Finished,
                "every node is settled".to_string(),
                row.wave,
                NONE,
                kind::rollout_state(RolloutState::Finished),
            ),
            Change::RolledBack => (
                RolloutState::RolledBack,
                "every node rolled back is settled".to_string(),
                row.wave,
                NONE,
                kind::rollout_state(RolloutState::RolledBack),
            ),
        };
        let m = RolloutMove {
            state,
            reason: &reason,
            wave,
            queue_rollback: steps,
            event_kind: &event_kind,
            reclaim: false,
        };
        // A stale version: an admin acted meanwhile; the next tick decides afresh.
        self.store
            .move_rollout(row.id, row.version, &m)
            .await
            .map(drop)
    }
}

fn drain_reason(row: &RolloutRow, spec: &RolloutRequest) -> String {
    format!(
        "rollout {} to {}: {}",
        row.id,
        spec.image,
        spec.reason.trim()
    )
}
