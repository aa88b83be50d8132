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
    Some(Baseline {
        kernel_release: report.kernel_release,
        cmdline: report.cmdline,
        versions: report.versions,
        modules: report.modules,
        gpus,
    })
}

/// Each boot's drift baseline, kept once read: a heartbeat of a ready node compared its
/// facts with a baseline read and parsed from the boot row (two queries and a JSON parse)
/// every time, though a boot's attestation never changes and its validation only when
/// it is validated again (which forgets the entry here). Bounded: past `BASELINES_MAX`
/// entries it starts over (a fleet's nodes each have one current boot). Another server's
/// revalidation of a boot is not seen here until this server restarts or starts over;
/// a passed revalidation within one boot names the GPUs the first one did.
#[derive(Default)]
pub struct Baselines(std::sync::Mutex<std::collections::HashMap<String, Arc<Baseline>>>);

const BASELINES_MAX: usize = 65_536;

impl Baselines {
    fn get(&self, boot_id: &str) -> Option<Arc<Baseline>> {
        self.0.lock().expect("not poisoned").get(boot_id).cloned()
    }

    fn keep(&self, boot_id: &str, baseline: Arc<Baseline>) {
        let mut all = self.0.lock().expect("not poisoned");
        if all.len() >= BASELINES_MAX {
            all.clear();
        }
        all.insert(boot_id.to_string(), baseline);
    }

    /// The boot was validated again: its GPUs may differ.
    pub fn forget(&self, boot_id: &str) {
        self.0.lock().expect("not poisoned").remove(boot_id);
    }
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
