//! A boot as a timeline: the scheduler drain and the power actions through the BMC that
//! led to it, DHCP answers
//! and TFTP transfers before the script (`preboot`), script served, kernel and initrds downloaded, attested, validated, ready; with the time
//! each step took and where the boot stopped. Built purely from what the store recorded;
//! the service method reads it.

use super::{BootError, NodeService};
use crate::api::Mac;
use crate::api::image::Artifact;
use crate::api::image::Role;
use crate::api::node::{Step, Timeline};
use crate::clock::format_ms;
use crate::node::attest::Received;
use crate::node::preboot::PrebootStep;
use crate::store::{BootFacts, PowerRow};

/// A power action as a step, at the time it finished.
fn power_step(r: &PowerRow) -> PrebootStep {
    PrebootStep {
        step: format!("power {} (bmc)", r.action),
        at_ms: r.at_ms + r.took_ms,
        outcome: r.outcome.clone(),
    }
}

/// A rollout's step for the node, from its event, as a step before the boot it led to:
/// the drain asked of its scheduler, and the drain done (or given up on) before its
/// reimage. Other rollout events are not steps towards a boot.
fn rollout_step(at_ms: i64, kind: &str, data: &serde_json::Value) -> Option<PrebootStep> {
    use crate::api::rollout::StepStatus;
    let rollout = data.get("rollout").and_then(|r| r.as_i64()).unwrap_or(0);
    let reason = data.get("reason").and_then(|r| r.as_str()).unwrap_or("");
    let is = |s: StepStatus| kind == crate::api::event::kind::rollout_node(s);
    let (step, outcome) = if is(StepStatus::Draining) || is(StepStatus::RollbackDraining) {
        ("scheduler drain asked", "ok".to_string())
    } else if is(StepStatus::Reimaging) || is(StepStatus::RollingBack) {
        match reason.split_once("; ") {
            Some((drain, _)) if drain.starts_with("drained") => ("scheduler drained", "ok".into()),
            Some((drain, _)) if drain.starts_with("not drained") => {
                ("scheduler drained", drain.to_string())
            }
            _ => ("reimage", "ok".into()),
        }
    } else {
        return None;
    };
    Some(PrebootStep {
        step: format!("{step} (rollout {rollout})"),
        at_ms,
        outcome,
    })
}

/// Which steps (power actions, rollout steps) led to which boot: `boots` newest first
/// (their creation times), `before` newest first. A boot gets the steps after the boot
/// before it (or at most `PREBOOT_WINDOW_MS` before it, for the oldest shown) and before
/// its script; the first list holds those after the newest boot, which lead to the next
/// one. Pure.
pub fn steps_by_boot(
    boots: &[i64],
    before: &[PrebootStep],
) -> (Vec<PrebootStep>, Vec<Vec<PrebootStep>>) {
    let window = crate::node::preboot::PREBOOT_WINDOW_MS;
    let pick = |after: i64, at: i64| -> Vec<PrebootStep> {
        let mut steps: Vec<PrebootStep> = before
            .iter()
            .filter(|r| r.at_ms > after && r.at_ms <= at)
            .cloned()
            .collect();
        steps.reverse();
        steps
    };
    let pending = pick(boots.first().copied().unwrap_or(i64::MIN), i64::MAX);
    let each = boots
        .iter()
        .enumerate()
        .map(|(i, &at)| pick(boots.get(i + 1).copied().unwrap_or(at - window), at))
        .collect();
    (pending, each)
}

/// The timeline of `boot`, whose image has `artifacts`, after the power actions `power`
/// (oldest first).
pub fn build(boot: &BootFacts, artifacts: &[Artifact], power: &[PrebootStep]) -> Timeline {
    let mut steps = Vec::new();
    let mut stopped_at = None;
    // Written by the node service; a row it cannot read is shown without them.
    let mut preboot: Vec<PrebootStep> = power.to_vec();
    preboot.extend(
        boot.preboot
            .clone()
            .and_then(|v| serde_json::from_value::<Vec<PrebootStep>>(v).ok())
            .unwrap_or_default(),
    );
    preboot.sort_by_key(|s| s.at_ms);
    let mut last = preboot
        .first()
        .map_or(boot.created_at_ms, |s| s.at_ms.min(boot.created_at_ms));
    let mut push = |steps: &mut Vec<Step>, step: String, at: i64, outcome: String| {
        steps.push(Step {
            step,
            at: format_ms(at),
            took_ms: at - last,
            outcome,
        });
        last = at;
    };
    for s in preboot {
        push(&mut steps, s.step, s.at_ms, s.outcome);
    }
    push(&mut steps, "script".into(), boot.created_at_ms, "ok".into());
    let passed = |v: &Option<serde_json::Value>| {
        v.as_ref()
            .and_then(|v| v.get("passed"))
            .and_then(|p| p.as_bool())
            == Some(true)
    };
    // A two-stage image's root comes last: stage 1 fetches it after the kernel boots.
    for artifact in artifacts {
        let name = match artifact.role {
            Role::Kernel => "kernel".to_string(),
            Role::Initrd => format!("initrd {}", artifact.path.rsplit('/').next().unwrap_or("")),
            Role::Rootfs => "stage1 rootfs".to_string(),
        };
        let mine: Vec<_> = boot
            .fetches
            .iter()
            .filter(|f| f.digest == artifact.digest)
            .collect();
        let got = Received::tally(mine.iter().copied())
            .remove(&artifact.digest)
            .unwrap_or_default();
        let (bytes, whole) = (got.bytes, got.complete(artifact.size));
        let end = mine.iter().filter_map(|f| f.finished_at_ms).max();
        // A root the node read from its own cache is not fetched; attestation proved it
        // (its dm-verity root hash), so the step is there with where it came from.
        if artifact.role == Role::Rootfs
            && mine.is_empty()
            && let Some(at) = boot.attested_at_ms.filter(|_| passed(&boot.verdict))
        {
            push(&mut steps, name, at, "from the node's cache".into());
            continue;
        }
        match (whole, end) {
            (true, Some(end)) if artifact.role == Role::Rootfs => {
                push(&mut steps, name, end, format!("ok ({bytes} bytes)"))
            }
            (true, Some(end)) => push(&mut steps, name, end, "ok".into()),
            _ => {
                if stopped_at.is_none() {
                    stopped_at = Some(name.clone());
                }
                if let Some(f) = mine.last() {
                    let at = f.finished_at_ms.unwrap_or(f.started_at_ms);
                    let outcome = format!("{bytes} of {} bytes", artifact.size);
                    push(&mut steps, name, at, outcome);
                }
            }
        }
    }
    // A failed step says why: the verdict's mismatches, named (a stage-1 failure, a
    // wrong root hash, a pin).
    let failed = |v: &Option<serde_json::Value>| {
        let named: Vec<String> = v
            .as_ref()
            .and_then(|v| v.get("mismatches"))
            .and_then(|m| m.as_array())
            .into_iter()
            .flatten()
            .filter_map(|m| {
                Some(format!(
                    "{}: {}",
                    m.get("field")?.as_str()?,
                    m.get("found")?.as_str()?
                ))
            })
            .collect();
        if named.is_empty() {
            "failed".to_string()
        } else {
            format!("failed: {}", named.join("; "))
        }
    };
    let judged = [
        ("attested", boot.attested_at_ms, &boot.verdict),
        ("validated", boot.validated_at_ms, &boot.validation),
    ];
    for (name, at, verdict) in judged {
        match at {
            Some(at) => {
                let ok = passed(verdict);
                push(
                    &mut steps,
                    name.into(),
                    at,
                    if ok { "ok".into() } else { failed(verdict) },
                );
                if !ok && stopped_at.is_none() {
                    stopped_at = Some(name.into());
                }
            }
            None => {
                if stopped_at.is_none() {
                    stopped_at = Some(name.into());
                }
            }
        }
    }
    Timeline {
        id: boot.id.clone(),
        image: boot.image,
        at: format_ms(boot.created_at_ms),
        steps,
        stopped_at,
        tpm: boot
            .verdict
            .as_ref()
            .and_then(|v| v.get("tpm"))
            .and_then(|t| serde_json::from_value(t.clone()).ok()),
    }
}

/// Power actions read to place in timelines: enough for the boots shown and the fallback's
/// retries between them.
const POWER_READ: i64 = 50;

impl NodeService {
    /// What DHCP and TFTP saw of `mac` since its last script, after the power actions
    /// `power` that came since, as steps.
    fn preboot_steps(&self, mac: &Mac, power: Vec<PrebootStep>) -> Vec<Step> {
        let mut steps = power;
        steps.extend(self.preboot.peek(mac, crate::clock::now_ms()));
        steps.sort_by_key(|s| s.at_ms);
        let mut last = steps.first().map_or(0, |s| s.at_ms);
        steps
            .into_iter()
            .map(|s| {
                let took_ms = s.at_ms - last;
                last = s.at_ms;
                Step {
                    step: s.step,
                    at: format_ms(s.at_ms),
                    took_ms,
                    outcome: s.outcome,
                }
            })
            .collect()
    }

    /// The node's last `limit` boots as timelines, newest first, and what happened since
    /// the newest (power actions, DHCP, TFTP), as steps.
    pub async fn timelines(
        &self,
        mac: &Mac,
        limit: i64,
    ) -> Result<(Vec<Timeline>, Vec<Step>), BootError> {
        let boots = self.store.boot_facts(mac, limit).await?;
        let mut before: Vec<PrebootStep> = (self.store.power_actions(mac, POWER_READ).await?)
            .iter()
            .map(power_step)
            .collect();
        let rollouts = self.store.node_rollout_events(mac, POWER_READ).await?;
        before.extend(
            rollouts
                .iter()
                .filter_map(|(at, k, d)| rollout_step(*at, k, d)),
        );
        before.sort_by_key(|s| std::cmp::Reverse(s.at_ms));
        let created: Vec<i64> = boots.iter().map(|b| b.created_at_ms).collect();
        let (pending, power) = steps_by_boot(&created, &before);
        let mut out = Vec::with_capacity(boots.len());
        for (boot, power) in boots.iter().zip(&power) {
            let artifacts = match self.image(&boot.image).await? {
                // A rootfs is a step only where stage 1 fetches it (a two-stage image);
                // a single-stage image's rootfs is for the image to use as it likes.
                Some(image) => {
                    let two_stage = image
                        .manifest
                        .rootfs_spec
                        .as_ref()
                        .is_some_and(|r| r.verity.is_some());
                    image
                        .record
                        .artifacts
                        .iter()
                        .filter(|a| two_stage || a.role != Role::Rootfs)
                        .cloned()
                        .collect()
                }
                None => Vec::new(),
            };
            out.push(build(boot, &artifacts, power));
        }
        Ok((out, self.preboot_steps(mac, pending)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Digest;
    use crate::store::Fetch;

    fn artifacts() -> Vec<Artifact> {
        vec![
            Artifact {
                role: Role::Kernel,
                path: "vmlinuz".into(),
                digest: Digest::of(b"k"),
                size: 100,
            },
            Artifact {
                role: Role::Initrd,
                path: "boot/initrd.img".into(),
                digest: Digest::of(b"i"),
                size: 50,
            },
        ]
    }

    fn boot() -> BootFacts {
        BootFacts {
            id: "b1".into(),
            image: Digest::of(b"image"),
            created_at_ms: 1000,
            attested_at_ms: None,
            verdict: None,
            report: None,
            validated_at_ms: None,
            validation: None,
            preboot: None,
            fetches: vec![],
        }
    }

    fn fetch(what: &[u8], start: i64, end: Option<i64>, bytes: u64, whole: bool) -> Fetch {
        Fetch {
            digest: Digest::of(what),
            started_at_ms: start,
            finished_at_ms: end,
            offset: 0,
            bytes,
            whole,
        }
    }

    fn names(t: &Timeline) -> Vec<(&str, i64, &str)> {
        t.steps
            .iter()
            .map(|s| (s.step.as_str(), s.took_ms, s.outcome.as_str()))
            .collect()
    }

    #[test]
    fn a_boot_that_reached_ready_has_every_step_and_its_time() {
        let mut b = boot();
        b.fetches = vec![
            fetch(b"k", 1100, Some(1300), 100, true),
            // The initrd download broke and resumed with a range.
            fetch(b"i", 1300, None, 20, true),
            Fetch {
                offset: 20,
                ..fetch(b"i", 1350, Some(1400), 30, false)
            },
        ];
        b.attested_at_ms = Some(5000);
        b.verdict = Some(serde_json::json!({ "passed": true }));
        b.validated_at_ms = Some(9000);
        b.validation = Some(serde_json::json!({ "passed": true }));
        let t = build(&b, &artifacts(), &[]);
        assert_eq!(
            names(&t),
            [
                ("script", 0, "ok"),
                ("kernel", 300, "ok"),
                ("initrd initrd.img", 100, "ok"),
                ("attested", 3600, "ok"),
                ("validated", 4000, "ok"),
            ]
        );
        assert_eq!(t.stopped_at, None);
    }

    #[test]
    fn dhcp_and_tftp_open_the_timeline() {
        let mut b = boot();
        let step = |step: &str, at_ms: i64, outcome: &str| PrebootStep {
            step: step.into(),
            at_ms,
            outcome: outcome.into(),
        };
        b.preboot = Some(
            serde_json::to_value([
                step("dhcp offer", 200, "10.0.0.5, undionly.kpxe"),
                step("dhcp ack", 250, "10.0.0.5, undionly.kpxe"),
                step("tftp undionly.kpxe", 600, "ok, 70 KiB"),
                step("ipxe dhcp ack", 900, "10.0.0.5, http://s/boot.ipxe"),
            ])
            .unwrap(),
        );
        let t = build(&b, &artifacts(), &[]);
        assert_eq!(
            names(&t)[..5],
            [
                ("dhcp offer", 0, "10.0.0.5, undionly.kpxe"),
                ("dhcp ack", 50, "10.0.0.5, undionly.kpxe"),
                ("tftp undionly.kpxe", 350, "ok, 70 KiB"),
                ("ipxe dhcp ack", 300, "10.0.0.5, http://s/boot.ipxe"),
                ("script", 100, "ok"),
            ]
        );
    }

    #[test]
    fn power_actions_open_the_boot_they_led_to() {
        let row = |at_ms: i64, action: &str, outcome: &str| PowerRow {
            at_ms,
            action: action.into(),
            reason: "r".into(),
            outcome: outcome.into(),
            took_ms: 40,
        };
        // Newest first, as the store lists them: a cycle after the newest boot (3000),
        // a failed and a good cycle before it, one before the older boot (1000).
        let rows = [
            row(3500, "cycle", "ok"),
            row(2600, "cycle", "ok"),
            row(2000, "cycle", "BMC unreachable: refused"),
            row(900, "off", "ok"),
        ];
        let steps: Vec<PrebootStep> = rows.iter().map(power_step).collect();
        let (pending, each) = steps_by_boot(&[3000, 1000], &steps);
        let steps = |v: &[PrebootStep]| -> Vec<(String, i64, String)> {
            v.iter()
                .map(|s| (s.step.clone(), s.at_ms, s.outcome.clone()))
                .collect()
        };
        assert_eq!(
            steps(&pending),
            [("power cycle (bmc)".into(), 3540, "ok".into())]
        );
        assert_eq!(
            steps(&each[0]),
            [
                (
                    "power cycle (bmc)".into(),
                    2040,
                    "BMC unreachable: refused".into()
                ),
                ("power cycle (bmc)".into(), 2640, "ok".into()),
            ]
        );
        assert_eq!(
            steps(&each[1]),
            [("power off (bmc)".into(), 940, "ok".into())]
        );

        let mut b = boot();
        b.created_at_ms = 3000;
        let t = build(&b, &artifacts(), &each[0]);
        assert_eq!(
            names(&t)[..3],
            [
                ("power cycle (bmc)", 0, "BMC unreachable: refused"),
                ("power cycle (bmc)", 600, "ok"),
                ("script", 360, "ok"),
            ]
        );
    }

    #[test]
    fn the_timeline_says_where_a_boot_stopped() {
        let mut b = boot();
        b.fetches = vec![
            fetch(b"k", 1100, Some(1300), 100, true),
            fetch(b"i", 1300, None, 20, true),
        ];
        let t = build(&b, &artifacts(), &[]);
        assert_eq!(t.stopped_at.as_deref(), Some("initrd initrd.img"));
        assert_eq!(t.steps[2].outcome, "20 of 50 bytes");

        let mut b = boot();
        b.fetches = vec![
            fetch(b"k", 1100, Some(1300), 100, true),
            fetch(b"i", 1300, Some(1400), 50, true),
        ];
        b.attested_at_ms = Some(5000);
        b.verdict = Some(serde_json::json!({ "passed": false }));
        let t = build(&b, &artifacts(), &[]);
        assert_eq!(t.stopped_at.as_deref(), Some("attested"));
        assert_eq!(t.steps.last().unwrap().outcome, "failed");
    }
}
