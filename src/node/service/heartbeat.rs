//! The agent's heartbeat: proof of life, facts compared with what the boot attested and
//! validated (drift), and the answer that carries the node's next action.

use super::attest::{AttestError, Refusal};
use super::{BootError, NodeService};
use crate::api::NodeState;
use crate::api::agent::{AttestReport, Difference, HeartbeatAnswer, HeartbeatRequest, NextAction};
use crate::node::drift::{Baseline, compare};
use crate::node::policy::DriftAction;
use crate::node::reimage::ReimageError;
use crate::node::state::NodeEvent;
use crate::store::BootFacts;
use std::sync::Arc;

fn answer(action: NextAction, drift: Vec<Difference>) -> HeartbeatAnswer {
    HeartbeatAnswer { action, drift }
}

/// The baseline a boot's facts are compared with: its attestation report, and the GPUs
/// its validation saw.
fn baseline_of(boot: &BootFacts) -> Option<Baseline> {
    let report: AttestReport = serde_json::from_value(boot.report.clone()?).ok()?;
    let gpus = boot
        .validation
        .as_ref()
        .and_then(|v| serde_json::from_value::<Vec<String>>(v.get("gpus")?.clone()).ok());
    Some(attested_baseline(&report, gpus))
}

fn attested_baseline(report: &AttestReport, gpus: Option<Vec<String>>) -> Baseline {
    Baseline {
        kernel_release: report.kernel_release.clone(),
        cmdline: report.cmdline.clone(),
        versions: report.versions.clone(),
        modules: report.modules.clone(),
        gpus,
    }
}

/// Each boot's drift baseline, kept once known: a heartbeat of a ready node compared its
/// facts with a baseline read and parsed from the boot row (two queries and a JSON parse)
/// every time, though a boot's attestation never changes and its validation only when
/// it is validated again. A passed attestation here keeps its part (no GPUs yet: not
/// served to heartbeats), which a validation here completes; a boot attested or
/// validated by another server is read from the store at its first heartbeat here.
/// Bounded: past `BASELINES_MAX` entries it starts over (a fleet's nodes each have one
/// current boot). Another server's revalidation of a boot is not seen here until this
/// server restarts or starts over; a passed revalidation within one boot names the GPUs
/// the first one did.
#[derive(Default)]
pub struct Baselines(std::sync::Mutex<std::collections::HashMap<String, Arc<Baseline>>>);

const BASELINES_MAX: usize = 65_536;

impl Baselines {
    /// A validated boot's baseline (one only attested here is not final).
    fn get(&self, boot_id: &str) -> Option<Arc<Baseline>> {
        let all = self.0.lock().expect("not poisoned");
        all.get(boot_id).filter(|b| b.gpus.is_some()).cloned()
    }

    fn keep(&self, boot_id: &str, baseline: Arc<Baseline>) {
        bounded_insert(&mut self.0.lock().expect("not poisoned"), boot_id, baseline);
    }

    /// The boot passed its attestation here: what its heartbeats will be compared with,
    /// but for the GPUs its validation will name.
    /// Nothing kept already is replaced (a validation may have completed it).
    pub fn attested(&self, boot_id: &str, report: &AttestReport) {
        let mut all = self.0.lock().expect("not poisoned");
        if !all.contains_key(boot_id) {
            bounded_insert(&mut all, boot_id, Arc::new(attested_baseline(report, None)));
        }
    }

    /// The boot was validated (again) here with `gpus`: its baseline, if kept, is
    /// complete (or its GPUs replaced); if not, its first heartbeat reads it.
    pub fn validated(&self, boot_id: &str, gpus: Vec<String>) {
        let mut all = self.0.lock().expect("not poisoned");
        if let Some(kept) = all.get_mut(boot_id) {
            let mut baseline = Baseline::clone(kept);
            baseline.gpus = Some(gpus);
            *kept = Arc::new(baseline);
        }
    }
}

/// Past `BASELINES_MAX` entries the map starts over.
fn bounded_insert(
    all: &mut std::collections::HashMap<String, Arc<Baseline>>,
    boot_id: &str,
    baseline: Arc<Baseline>,
) {
    if all.len() >= BASELINES_MAX {
        all.clear();
    }
    all.insert(boot_id.to_string(), baseline);
}

impl NodeService {
    /// `boot_id`'s baseline, from memory or the store.
    async fn baseline(&self, boot_id: &str) -> Result<Option<Arc<Baseline>>, AttestError> {
        if let Some(hit) = self.baselines.get(boot_id) {
            return Ok(Some(hit));
        }
        let Some(boot) = self.store.boot_by_id(boot_id).await? else {
            return Ok(None);
        };
        let Some(baseline) = baseline_of(&boot).map(Arc::new) else {
            return Ok(None);
        };
        // Only a validated boot's baseline is final until its next validation.
        if baseline.gpus.is_some() {
            self.baselines.keep(boot_id, baseline.clone());
        }
        Ok(Some(baseline))
    }

    pub async fn heartbeat(
        &self,
        caller: &super::attest::Caller,
        req: &HeartbeatRequest,
    ) -> Result<HeartbeatAnswer, AttestError> {
        let result = self.heartbeat_inner(caller, req).await;
        self.noted("heartbeat", &req.boot_id, &req.mac, result)
            .await
    }

    async fn heartbeat_inner(
        &self,
        caller: &super::attest::Caller,
        req: &HeartbeatRequest,
    ) -> Result<HeartbeatAnswer, AttestError> {
        // Alive means alive in the image it was judged to run: before a verdict, a
        // heartbeat would bring back an unreachable boot that never attested.
        if !Self::claims(caller, &req.boot_id, &req.mac)?.attested() {
            return Err(Refusal::NotAttested.into());
        }
        let store = &self.store;
        let mac = &req.mac;
        let now_ms = crate::clock::now_ms();
        self.liveness.heard(*mac, now_ms);
        let node = store
            .node_for_heartbeat(mac)
            .await?
            .ok_or(Refusal::BadToken)?;
        self.controller
            .metrics()
            .gpus()
            .record(*mac, node.hostname.as_deref(), &req.gpus, now_ms);
        let verdicts = self.health.observe(req, &node.labels, now_ms);
        if let Some(action) = self.act_on_health(&node, &req.boot_id, verdicts).await? {
            return Ok(answer(action, vec![]));
        }
        match node.state {
            NodeState::Reimaging => return Ok(answer(NextAction::Reboot, vec![])),
            NodeState::Unreachable => {
                // Back after a silence: what held then may not hold now (a GPU fell off the
                // bus while we could not hear). Validate again before calling it ready.
                let reason = format!(
                    "boot {}: heartbeat resumed after a silence; revalidating",
                    req.boot_id
                );
                self.controller
                    .apply(mac, NodeEvent::ValidationStarted, &reason)
                    .await
                    .map_err(BootError::from)?;
                return Ok(answer(NextAction::Revalidate, vec![]));
            }
            _ => {}
        }
        let mut drift = Vec::new();
        if let Some(facts) = &req.facts
            && matches!(
                node.state,
                NodeState::Ready | NodeState::Degraded | NodeState::Drifted
            )
            && let Some(baseline) = self.baseline(&req.boot_id).await?
        {
            drift = compare(&baseline, facts);
        }
        if !drift.is_empty() {
            let named: Vec<String> = drift.iter().map(ToString::to_string).collect();
            let named = named.join("; ");
            if matches!(node.state, NodeState::Ready | NodeState::Degraded) {
                let reason = format!("boot {}: drifted: {named}", req.boot_id);
                self.controller
                    .apply(mac, NodeEvent::DriftDetected, &reason)
                    .await
                    .map_err(BootError::from)?;
            }
            if self.policy.drift_action(&node.labels) == DriftAction::Reimage {
                let reason = format!("drift policy: {named}");
                match self.reimage.request(mac, &reason, None, None).await {
                    // Waiting for its scheduler's drain: no reboot yet.
                    Ok(a) if !crate::node::reimage::moved_now(&a) => {}
                    Ok(_) => return Ok(answer(NextAction::Reboot, drift)),
                    // Stays drifted; the next heartbeat asks again, which is the queue.
                    Err(ReimageError::OverBudget(why)) => {
                        tracing::info!(%mac, why, "drifted node waits for the disruption budget")
                    }
                    Err(e) => tracing::warn!(%mac, error = %e, "drift policy cannot reimage"),
                }
            }
            return Ok(answer(NextAction::None, drift));
        }
        // Read with the node: a heartbeat that changes nothing writes nothing.
        if node.revalidate_requested && store.take_revalidate(mac).await? {
            return Ok(answer(NextAction::Revalidate, drift));
        }
        Ok(answer(NextAction::None, drift))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> AttestReport {
        AttestReport {
            image_digest: crate::api::Digest::of(b"image"),
            kernel_release: "6.1.0-18-amd64".into(),
            cmdline: "console=ttyS0".into(),
            versions: [("nvidia-driver".to_string(), "550.54.15".to_string())].into(),
            artifacts: Vec::new(),
            modules: Default::default(),
            verity_root_hash: None,
            stage1_failure: None,
        }
    }

    #[test]
    fn an_attested_baseline_is_served_once_its_validation_names_the_gpus() {
        let kept = Baselines::default();
        kept.attested("b1", &report());
        assert!(kept.get("b1").is_none(), "no GPUs yet: read from the store");
        kept.validated("b1", vec!["GPU-1".into()]);
        // A late second attestation (a retry's) leaves the complete one.
        kept.attested("b1", &report());
        let baseline = kept.get("b1").expect("complete");
        assert_eq!(baseline.gpus.as_deref(), Some(&["GPU-1".to_string()][..]));
        assert_eq!(baseline.kernel_release, "6.1.0-18-amd64");
        // A revalidation here replaces the GPUs.
        kept.validated("b1", vec!["GPU-2".into()]);
        let again = kept.get("b1").expect("complete");
        assert_eq!(again.gpus.as_deref(), Some(&["GPU-2".to_string()][..]));
    }

    #[test]
    fn a_validation_of_a_boot_attested_elsewhere_keeps_nothing() {
        let kept = Baselines::default();
        kept.validated("b2", vec!["GPU-1".into()]);
        assert!(
            kept.get("b2").is_none(),
            "its first heartbeat reads the store"
        );
    }
}
