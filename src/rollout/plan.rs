//! A rollout's rules, pure: how its nodes fall into waves, and what one look at it
//! decides (which nodes are done or failed, which start, whether the wave, the rollout,
//! or a rollback is over). The controller (`run.rs`) reads, asks `tick` and writes.

use std::collections::{BTreeMap, HashSet};

use crate::api::rollout::{OnFailure, RolloutRequest, RolloutState, StepStatus};
use crate::api::{Digest, Mac, NodeState};
use crate::store::{RolloutNodeRow, RolloutRow};

/// The nodes per later wave that `wave` (`10%` or `10`) means for `total` nodes.
pub fn wave_size(wave: &str, total: usize) -> Result<usize, String> {
    let bad = || format!("wave {wave:?} is not a count (10) or a share of the nodes (10%)");
    let n = if let Some(pct) = wave.trim().strip_suffix('%') {
        let pct: usize = pct.trim().parse().map_err(|_| bad())?;
        if pct == 0 || pct > 100 {
            return Err(format!("wave {wave:?}: a share is 1% to 100%"));
        }
        total.saturating_mul(pct).div_ceil(100)
    } else {
        wave.trim().parse().map_err(|_| bad())?
    };
    if n == 0 {
        return Err(format!("wave {wave:?}: a wave has at least one node"));
    }
    Ok(n)
}

/// Puts nodes (MAC and group, e.g. rack) into waves: `canary` first (wave 0, when any),
/// then waves of `size`. Groups take turns in the order, so a wave spreads over racks
/// instead of emptying one. Returns (mac, wave, position), in order.
pub fn waves(nodes: &[(Mac, Option<String>)], canary: usize, size: usize) -> Vec<(Mac, u32, u32)> {
    let mut groups: BTreeMap<Option<&str>, Vec<Mac>> = BTreeMap::new();
    for (mac, group) in nodes {
        groups.entry(group.as_deref()).or_default().push(*mac);
    }
    for g in groups.values_mut() {
        g.sort();
    }
    let mut order = Vec::with_capacity(nodes.len());
    let mut round = 0;
    while order.len() < nodes.len() {
        for g in groups.values() {
            if let Some(mac) = g.get(round) {
                order.push(*mac);
            }
        }
        round += 1;
    }
    let first_regular = u32::from(canary > 0);
    order
        .into_iter()
        .enumerate()
        .map(|(i, mac)| {
            let wave = if i < canary {
                0
            } else {
                first_regular + ((i - canary) / size.max(1)) as u32
            };
            (mac, wave, i as u32)
        })
        .collect()
}

/// What the controller knows of a node of the rollout now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeNow {
    pub state: NodeState,
    pub state_reason: String,
    /// The image of its newest boot, and when that boot began.
    pub booted: Option<Digest>,
    pub booted_at: Option<i64>,
    /// A failure since the step began (its state and reason), though the failure
    /// policy may have moved it on since (reimaging it again).
    pub failed: Option<(NodeState, String)>,
}

/// One node of the rollout and, unless it was removed, the node.
#[derive(Debug, Clone)]
pub struct StepNow {
    pub row: RolloutNodeRow,
    pub node: Option<NodeNow>,
}

/// The rollout's change of state that a look decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Begin wave `n` (pausing first when it follows the canaries and the spec says so).
    NextWave {
        wave: u32,
        pause: bool,
    },
    /// Past `max_failures`: stop, and roll the failed nodes back when the spec says so.
    Halt {
        reason: String,
        rollback: bool,
    },
    Finish,
    /// Every node to roll back has been rolled back (or failed to be).
    RolledBack,
}

/// What one look at a rollout decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Reimaging, and now ready on the rollout's digest.
    Done(Mac),
    /// Not ready on the digest (failed, wrong image, removed, too slow): why.
    Fail(Mac, String),
    /// Pending: start (drain first when it has a scheduler, else reimage).
    Start(Mac),
    /// Stuck in a failure from before its reimage took: reimage it again (its step
    /// stays at this status, its clock restarts).
    Again(Mac, StepStatus),
    /// Draining and its scheduler says drained (or the drain timed out and the policy
    /// forces): reimage it now, saying which.
    Reimage(Mac, String),
    /// Draining past the drain timeout, and the policy skips it.
    Skip(Mac, String),
    /// Reimaging when the rollout began rolling back, and now settled (ready or not):
    /// queue it for its rollback.
    QueueRollback(Mac),
    /// Draining when the rollout began rolling back: give it back to its scheduler.
    CancelDrain(Mac),
    /// Queued for rollback: start (drain first when it has a scheduler, else reimage).
    StartRollback(Mac),
    /// Draining for its rollback and drained (or forced at the drain timeout): reimage
    /// it back now, saying which.
    RollbackReimage(Mac, String),
    RolledBack(Mac),
    RollbackFailed(Mac, String),
    Rollout(Change),
}

/// When a drain takes longer than its timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DrainTimeout {
    /// Leave the node out of the rollout (it is given back to its scheduler).
    Skip,
    /// Keep waiting: a job decides when the node is free.
    Wait,
    /// Reimage it anyway.
    Force,
}

/// The drain settings a look needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainRules {
    pub timeout_ms: i64,
    pub on_timeout: DrainTimeout,
}

/// What a look says of a node reimaging for the rollout.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    Wait,
    Done,
    Failed(String),
    /// In a failed state from a boot that began before its reimage (its failure policy
    /// quarantined it meanwhile): it will not boot again by itself; reimage it again.
    Again,
}

/// Where a reimaging node stands against `target`, `timeout_ms` after `since_ms`.
/// Failures count only from a boot begun since (a boot of what it was given).
fn judge(
    node: Option<&NodeNow>,
    target: &Digest,
    since_ms: i64,
    timeout_ms: i64,
    now_ms: i64,
) -> Verdict {
    let Some(n) = node else {
        return Verdict::Failed("the node was removed".into());
    };
    let booted_since = n.booted_at.is_some_and(|at| at >= since_ms);
    match n.state {
        NodeState::Ready => {
            return match &n.booted {
                Some(d) if d == target => Verdict::Done,
                Some(d) => Verdict::Failed(format!("ready on {d}, not {target}")),
                None => Verdict::Failed("ready with no boot recorded".into()),
            };
        }
        // Degraded on the new image: slower than its peers there, which a rollout gated
        // on health must not call done.
        NodeState::AttestationFailed
        | NodeState::ValidationFailed
        | NodeState::Quarantined
        | NodeState::Degraded
            if booted_since =>
        {
            return Verdict::Failed(format!("{}: {}", n.state, n.state_reason));
        }
        NodeState::AttestationFailed
        | NodeState::ValidationFailed
        | NodeState::Quarantined
        | NodeState::Degraded => {
            return Verdict::Again;
        }
        _ => {}
    }
    if let Some((state, reason)) = &n.failed {
        return Verdict::Failed(format!("{state}: {reason}"));
    }
    if now_ms - since_ms > timeout_ms {
        return Verdict::Failed(format!(
            "not ready on {target} within {} s (it is {}: {})",
            timeout_ms / 1000,
            n.state,
            n.state_reason
        ));
    }
    Verdict::Wait
}

/// One look at an active rollout: `drained` are the draining nodes whose scheduler
/// says they are drained now.
pub fn tick(
    rollout: &RolloutRow,
    spec: &RolloutRequest,
    steps: &[StepNow],
    drained: &HashSet<Mac>,
    drain: DrainRules,
    now_ms: i64,
) -> Vec<Action> {
    let mut actions = Vec::new();
    let timeout_ms = i64::try_from(spec.timeout_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
    let rolling_back = rollout.state == RolloutState::RollingBack;
    // What becomes of the nodes in flight, whatever the rollout's state.
    let mut settled_now: HashSet<Mac> = HashSet::new();
    let mut failed_now = Vec::new();
    for s in steps {
        let mac = s.row.mac;
        let since = s.row.started_at_ms.unwrap_or(now_ms);
        match s.row.status {
            StepStatus::Reimaging => {
                let verdict = judge(s.node.as_ref(), &rollout.digest, since, timeout_ms, now_ms);
                match verdict {
                    Verdict::Wait => continue,
                    // Rolling back: whatever it came to, it goes back (one write), a node
                    // stuck in an older boot's failure too (never forward first).
                    _ if rolling_back => actions.push(Action::QueueRollback(mac)),
                    Verdict::Again => {
                        actions.push(Action::Again(mac, StepStatus::Reimaging));
                        continue;
                    }
                    Verdict::Done => actions.push(Action::Done(mac)),
                    Verdict::Failed(why) => {
                        failed_now.push(mac);
                        actions.push(Action::Fail(mac, why));
                    }
                }
                settled_now.insert(mac);
            }
            // Halted or rolling back: nothing new is reimaged onto the rollout's image; the
            // drain is given back. Paused: the drain waits.
            StepStatus::Draining if rolling_back || rollout.state == RolloutState::Halted => {
                actions.push(Action::CancelDrain(mac))
            }
            StepStatus::Draining if rollout.state != RolloutState::Running => {}
            StepStatus::Draining if drained.contains(&mac) => {
                actions.push(Action::Reimage(mac, "drained by its scheduler".into()))
            }
            StepStatus::Draining if now_ms - since > drain.timeout_ms => match drain.on_timeout {
                DrainTimeout::Skip => {
                    let why = format!("not drained within {} s", drain.timeout_ms / 1000);
                    actions.push(Action::Skip(mac, why));
                }
                DrainTimeout::Force => {
                    let why = format!("not drained within {} s: forced", drain.timeout_ms / 1000);
                    actions.push(Action::Reimage(mac, why));
                }
                DrainTimeout::Wait => {}
            },
            StepStatus::RollbackDraining if drained.contains(&mac) => actions.push(
                Action::RollbackReimage(mac, "drained by its scheduler".into()),
            ),
            StepStatus::RollbackDraining if now_ms - since > drain.timeout_ms => {
                let secs = drain.timeout_ms / 1000;
                match drain.on_timeout {
                    DrainTimeout::Skip => actions.push(Action::RollbackFailed(
                        mac,
                        format!("not drained within {secs} s: not rolled back"),
                    )),
                    DrainTimeout::Force => actions.push(Action::RollbackReimage(
                        mac,
                        format!("not drained within {secs} s: forced"),
                    )),
                    DrainTimeout::Wait => {}
                }
            }
            StepStatus::RollingBack => {
                let Some(previous) = &s.row.previous_digest else {
                    actions.push(Action::RollbackFailed(
                        mac,
                        "no earlier boot to return to".into(),
                    ));
                    continue;
                };
                match judge(s.node.as_ref(), previous, since, timeout_ms, now_ms) {
                    Verdict::Done => actions.push(Action::RolledBack(mac)),
                    Verdict::Failed(why) => actions.push(Action::RollbackFailed(mac, why)),
                    Verdict::Again => actions.push(Action::Again(mac, StepStatus::RollingBack)),
                    Verdict::Wait => {}
                }
            }
            _ => {}
        }
    }
    if rolling_back {
        rollback_tick(spec, steps, &settled_now, &mut actions);
        return actions;
    }
    if rollout.state != RolloutState::Running {
        return actions;
    }
    // Failures, counting this look's.
    let failed: Vec<Mac> = steps
        .iter()
        .filter(|s| s.row.status == StepStatus::Failed)
        .map(|s| s.row.mac)
        .chain(failed_now.iter().copied())
        .collect();
    if failed.len() > spec.max_failures as usize {
        let reason = format!(
            "{} node(s) failed, more than max-failures {}",
            failed.len(),
            spec.max_failures
        );
        let rollback = spec.on_failure == OnFailure::Rollback;
        actions.push(Action::Rollout(Change::Halt { reason, rollback }));
        return actions;
    }
    let wave = rollout.wave;
    let settled = |s: &StepNow| s.row.status.settled() || settled_now.contains(&s.row.mac);
    let in_wave: Vec<&StepNow> = steps.iter().filter(|s| s.row.wave == wave).collect();
    if in_wave.iter().all(|s| settled(s)) {
        let last = steps.iter().map(|s| s.row.wave).max().unwrap_or(0);
        actions.push(Action::Rollout(if wave >= last {
            Change::Finish
        } else {
            Change::NextWave {
                wave: wave + 1,
                pause: wave == 0 && spec.canary > 0 && spec.pause_after_canary,
            }
        }));
        return actions;
    }
    let in_flight = steps
        .iter()
        .filter(|s| s.row.status.in_flight() && !settled_now.contains(&s.row.mac))
        .count();
    let slots = (spec.max_unavailable as usize).saturating_sub(in_flight);
    actions.extend(
        in_wave
            .iter()
            .filter(|s| s.row.status == StepStatus::Pending)
            .take(slots)
            .map(|s| Action::Start(s.row.mac)),
    );
    actions
}

/// A rolling-back rollout: the nodes queued for rollback start within
/// `max_unavailable`; it is over when nothing is queued, rolling back or in flight.
/// (`settled_now`: nodes this look already moved, no longer in flight.)
fn rollback_tick(
    spec: &RolloutRequest,
    steps: &[StepNow],
    settled_now: &HashSet<Mac>,
    actions: &mut Vec<Action>,
) {
    let busy = steps
        .iter()
        .filter(|s| s.row.status.in_flight() && !settled_now.contains(&s.row.mac))
        .count();
    let slots = (spec.max_unavailable as usize).saturating_sub(busy);
    actions.extend(
        steps
            .iter()
            .filter(|s| s.row.status == StepStatus::RollbackPending)
            .take(slots)
            .map(|s| Action::StartRollback(s.row.mac)),
    );
    let open = steps.iter().any(|s| {
        s.row.status.in_flight()
            || s.row.status == StepStatus::RollbackPending
            || settled_now.contains(&s.row.mac)
    });
    if !open {
        actions.push(Action::Rollout(Change::RolledBack));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mac(i: u8) -> Mac {
        format!("52:54:00:00:00:{i:02x}").parse().unwrap()
    }
    fn digest(c: char) -> Digest {
        format!("sha256:{}", c.to_string().repeat(64))
            .parse()
            .unwrap()
    }
    fn spec() -> RolloutRequest {
        serde_json::from_value(serde_json::json!({
            "image": "gpu:2", "selector": "sku=h100", "canary": 2, "wave": "2",
            "max_unavailable": 2, "timeout_secs": 60, "reason": "driver 550"
        }))
        .unwrap()
    }
    fn rollout(state: RolloutState, wave: u32) -> RolloutRow {
        RolloutRow {
            id: 1,
            spec_json: String::new(),
            digest: digest('b'),
            state,
            state_reason: String::new(),
            wave,
            version: 0,
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }
    fn step(i: u8, wave: u32, status: StepStatus, node: Option<(NodeState, char)>) -> StepNow {
        StepNow {
            row: RolloutNodeRow {
                mac: mac(i),
                wave,
                position: u32::from(i),
                status,
                previous_assigned: Some("gpu:1".into()),
                previous_digest: Some(digest('a')),
                reason: String::new(),
                started_at_ms: Some(1_000),
                finished_at_ms: None,
            },
            node: node.map(|(state, d)| NodeNow {
                state,
                state_reason: "why".into(),
                booted: Some(digest(d)),
                booted_at: Some(1_500),
                failed: None,
            }),
        }
    }
    const DRAIN: DrainRules = DrainRules {
        timeout_ms: 10_000,
        on_timeout: DrainTimeout::Skip,
    };
    fn look(r: &RolloutRow, steps: &[StepNow], now: i64) -> Vec<Action> {
        tick(r, &spec(), steps, &HashSet::new(), DRAIN, now)
    }

    #[test]
    fn wave_sizes_are_counts_or_shares_rounded_up() {
        assert_eq!(wave_size("10%", 30), Ok(3));
        assert_eq!(wave_size("10%", 5), Ok(1));
        assert_eq!(wave_size("7", 30), Ok(7));
        assert!(wave_size("0", 30).is_err());
        assert!(wave_size("0%", 30).is_err());
        assert!(wave_size("150%", 30).is_err());
        assert!(wave_size("ten", 30).is_err());
    }

    #[test]
    fn waves_take_racks_in_turn_after_the_canaries() {
        let nodes: Vec<(Mac, Option<String>)> = (0..6)
            .map(|i| (mac(i), Some(format!("r{}", i % 2))))
            .collect();
        let w = waves(&nodes, 1, 2);
        let rack = |m: &Mac| {
            nodes
                .iter()
                .find(|(n, _)| n == m)
                .unwrap()
                .1
                .clone()
                .unwrap()
        };
        let racks: Vec<String> = w.iter().map(|(m, _, _)| rack(m)).collect();
        assert_eq!(racks, ["r0", "r1", "r0", "r1", "r0", "r1"]);
        let numbers: Vec<u32> = w.iter().map(|(_, n, _)| *n).collect();
        assert_eq!(numbers, [0, 1, 1, 2, 2, 3]);
        // Without canaries the first wave is wave 0.
        let numbers: Vec<u32> = waves(&nodes, 0, 4).iter().map(|(_, n, _)| *n).collect();
        assert_eq!(numbers, [0, 0, 0, 0, 1, 1]);
    }

    #[test]
    fn starts_no_more_than_max_unavailable_and_only_in_the_current_wave() {
        let r = rollout(RolloutState::Running, 1);
        let steps = [
            step(1, 0, StepStatus::Done, Some((NodeState::Ready, 'b'))),
            step(
                2,
                1,
                StepStatus::Reimaging,
                Some((NodeState::Provisioning, 'a')),
            ),
            step(3, 1, StepStatus::Pending, Some((NodeState::Ready, 'a'))),
            step(4, 1, StepStatus::Pending, Some((NodeState::Ready, 'a'))),
            step(5, 2, StepStatus::Pending, Some((NodeState::Ready, 'a'))),
        ];
        assert_eq!(look(&r, &steps, 2_000), [Action::Start(mac(3))]);
    }

    #[test]
    fn a_node_is_done_only_ready_on_the_new_digest() {
        let r = rollout(RolloutState::Running, 0);
        let steps = [
            step(1, 0, StepStatus::Reimaging, Some((NodeState::Ready, 'b'))),
            step(
                2,
                0,
                StepStatus::Reimaging,
                Some((NodeState::Validating, 'b')),
            ),
        ];
        assert_eq!(look(&r, &steps, 2_000), [Action::Done(mac(1))]);
        // Past the timeout the slow one fails, and max-failures 0 halts at once.
        let actions = look(&r, &steps, 62_000);
        assert!(
            matches!(&actions[1], Action::Fail(m, why) if *m == mac(2) && why.contains("within 60 s"))
        );
        assert!(matches!(
            &actions[2],
            Action::Rollout(Change::Halt {
                rollback: false,
                ..
            })
        ));
    }

    #[test]
    fn a_node_degraded_on_the_new_digest_is_not_done() {
        // Slower than its peers once on the new image: a failure of the rollout's, not a
        // success; degraded from before its reimage: reimaged again.
        let r = rollout(RolloutState::Running, 0);
        let mut before = step(
            2,
            0,
            StepStatus::Reimaging,
            Some((NodeState::Degraded, 'a')),
        );
        before.node.as_mut().unwrap().booted_at = Some(500);
        let steps = [
            step(
                1,
                0,
                StepStatus::Reimaging,
                Some((NodeState::Degraded, 'b')),
            ),
            before,
        ];
        let actions = look(&r, &steps, 2_000);
        assert!(
            matches!(&actions[0], Action::Fail(m, why) if *m == mac(1) && why.starts_with("degraded")),
            "{actions:?}"
        );
        assert!(
            actions.contains(&Action::Again(mac(2), StepStatus::Reimaging)),
            "{actions:?}"
        );
    }

    #[test]
    fn failed_validation_on_the_canaries_halts_and_rolls_back_with_rollback() {
        let r = rollout(RolloutState::Running, 0);
        let mut s = spec();
        s.on_failure = OnFailure::Rollback;
        let steps = [
            step(
                1,
                0,
                StepStatus::Reimaging,
                Some((NodeState::ValidationFailed, 'b')),
            ),
            step(2, 0, StepStatus::Reimaging, Some((NodeState::Booted, 'b'))),
            step(3, 1, StepStatus::Pending, Some((NodeState::Ready, 'a'))),
        ];
        let actions = tick(&r, &s, &steps, &HashSet::new(), DRAIN, 2_000);
        assert!(
            matches!(&actions[0], Action::Fail(m, why) if *m == mac(1) && why.starts_with("validation-failed"))
        );
        assert!(matches!(
            &actions[1],
            Action::Rollout(Change::Halt { rollback: true, .. })
        ));
        assert_eq!(actions.len(), 2, "nothing else starts: {actions:?}");
    }

    #[test]
    fn a_settled_wave_opens_the_next_pausing_after_the_canaries_when_asked() {
        let r = rollout(RolloutState::Running, 0);
        let mut s = spec();
        s.pause_after_canary = true;
        let steps = [
            step(1, 0, StepStatus::Done, Some((NodeState::Ready, 'b'))),
            step(2, 0, StepStatus::Reimaging, Some((NodeState::Ready, 'b'))),
            step(3, 1, StepStatus::Pending, Some((NodeState::Ready, 'a'))),
        ];
        let actions = tick(&r, &s, &steps, &HashSet::new(), DRAIN, 2_000);
        assert_eq!(
            actions,
            [
                Action::Done(mac(2)),
                Action::Rollout(Change::NextWave {
                    wave: 1,
                    pause: true
                })
            ]
        );
        let last = rollout(RolloutState::Running, 1);
        let steps = [step(3, 1, StepStatus::Skipped, None)];
        assert_eq!(
            look(&last, &steps, 2_000),
            [Action::Rollout(Change::Finish)]
        );
    }

    #[test]
    fn a_failure_the_failure_policy_moved_on_from_still_fails_the_node() {
        let r = rollout(RolloutState::Running, 0);
        let mut s = step(
            1,
            0,
            StepStatus::Reimaging,
            Some((NodeState::Reimaging, 'b')),
        );
        s.node.as_mut().unwrap().failed = Some((
            NodeState::ValidationFailed,
            "boot x: validation failed: 7 GPUs".into(),
        ));
        let actions = look(&r, &[s], 2_000);
        assert!(
            matches!(&actions[0], Action::Fail(_, why) if why == "validation-failed: boot x: validation failed: 7 GPUs")
        );
    }

    #[test]
    fn a_node_quarantined_by_an_older_boot_is_reimaged_again_not_failed() {
        let r = rollout(RolloutState::RollingBack, 0);
        let mut s = step(
            1,
            0,
            StepStatus::RollingBack,
            Some((NodeState::Quarantined, 'b')),
        );
        s.node.as_mut().unwrap().booted_at = Some(500);
        assert_eq!(
            look(&r, &[s.clone()], 2_000)[0],
            Action::Again(mac(1), StepStatus::RollingBack)
        );
        s.node.as_mut().unwrap().booted_at = Some(1_200);
        assert!(matches!(
            &look(&r, &[s], 2_000)[0],
            Action::RollbackFailed(..)
        ));
    }

    #[test]
    fn a_paused_or_halted_rollout_starts_nothing_but_watches_its_nodes() {
        for state in [RolloutState::Paused, RolloutState::Halted] {
            let r = rollout(state, 0);
            let steps = [
                step(1, 0, StepStatus::Reimaging, Some((NodeState::Ready, 'b'))),
                step(2, 0, StepStatus::Pending, Some((NodeState::Ready, 'a'))),
            ];
            assert_eq!(look(&r, &steps, 2_000), [Action::Done(mac(1))]);
        }
    }

    #[test]
    fn drains_end_in_a_reimage_or_by_the_timeout_policy() {
        let r = rollout(RolloutState::Running, 0);
        let steps = [
            step(1, 0, StepStatus::Draining, Some((NodeState::Ready, 'a'))),
            step(2, 0, StepStatus::Draining, Some((NodeState::Ready, 'a'))),
        ];
        let drained = HashSet::from([mac(1)]);
        let at = |now, policy| {
            let rules = DrainRules {
                timeout_ms: 10_000,
                on_timeout: policy,
            };
            tick(&r, &spec(), &steps, &drained, rules, now)
        };
        let drained = Action::Reimage(mac(1), "drained by its scheduler".into());
        assert_eq!(at(2_000, DrainTimeout::Skip), [drained]);
        assert!(matches!(&at(20_000, DrainTimeout::Skip)[1], Action::Skip(m, _) if *m == mac(2)));
        assert!(
            matches!(&at(20_000, DrainTimeout::Force)[1], Action::Reimage(m, why) if *m == mac(2) && why.ends_with("forced"))
        );
        assert_eq!(at(20_000, DrainTimeout::Wait).len(), 1);
    }

    #[test]
    fn a_rollback_drains_first_where_there_is_a_scheduler() {
        let r = rollout(RolloutState::RollingBack, 0);
        let steps = [
            step(
                1,
                0,
                StepStatus::RollbackDraining,
                Some((NodeState::Ready, 'b')),
            ),
            step(
                2,
                0,
                StepStatus::RollbackDraining,
                Some((NodeState::Ready, 'b')),
            ),
        ];
        let drained = HashSet::from([mac(1)]);
        let actions = tick(&r, &spec(), &steps, &drained, DRAIN, 2_000);
        assert_eq!(
            actions,
            [Action::RollbackReimage(
                mac(1),
                "drained by its scheduler".into()
            )]
        );
        let late = tick(&r, &spec(), &steps, &drained, DRAIN, 20_000);
        assert!(
            matches!(&late[1], Action::RollbackFailed(m, why) if *m == mac(2) && why.contains("not rolled back"))
        );
    }

    #[test]
    fn rolling_back_queues_what_settles_starts_within_the_limit_and_ends() {
        let r = rollout(RolloutState::RollingBack, 0);
        let steps = [
            step(
                1,
                0,
                StepStatus::Reimaging,
                Some((NodeState::ValidationFailed, 'b')),
            ),
            step(
                2,
                0,
                StepStatus::RollbackPending,
                Some((NodeState::ValidationFailed, 'b')),
            ),
            step(
                3,
                0,
                StepStatus::RollbackPending,
                Some((NodeState::ValidationFailed, 'b')),
            ),
            step(4, 0, StepStatus::RollingBack, Some((NodeState::Ready, 'a'))),
            step(5, 1, StepStatus::Pending, Some((NodeState::Ready, 'a'))),
        ];
        let actions = look(&r, &steps, 2_000);
        assert_eq!(
            actions,
            [
                Action::QueueRollback(mac(1)),
                Action::RolledBack(mac(4)),
                Action::StartRollback(mac(2)),
            ]
        );
        let over = [
            step(4, 0, StepStatus::RolledBack, Some((NodeState::Ready, 'a'))),
            step(5, 1, StepStatus::Pending, Some((NodeState::Ready, 'a'))),
        ];
        assert_eq!(
            look(&r, &over, 2_000),
            [Action::Rollout(Change::RolledBack)]
        );
    }
}
