//! The agent's heartbeat: proof of life, facts compared with what the boot attested and
//! validated (drift), and the answer that carries the node's next action.

use super::attest::{AttestError, Refusal};
use super::{BootError, NodeService};
use crate::api::agent::{AttestReport, Difference, HeartbeatAnswer, HeartbeatRequest, NextAction};
use crate::api::{Mac, NodeState};
use crate::node::drift::{Baseline, compare};
use crate::node::policy::DriftAction;
use crate::node::reimage::ReimageError;
use crate::node::state::NodeEvent;
use crate::store::BootFacts;
use std::sync::Arc;

fn answer(action: NextAction, drift: Vec<Difference>) -> HeartbeatAnswer {
    HeartbeatAnswer {
        action,
        drift,
        baseline_modules_sha256: None,
    }
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
    Baseline::new(
        report.kernel_release.clone(),
        report.cmdline.clone(),
        report.versions.clone(),
        report.modules.clone(),
        gpus,
    )
}

/// Each node's current boot's drift baseline, kept once known: a heartbeat of a ready
/// node compared its facts with a baseline read and parsed from the boot row (two queries
/// and a JSON parse) every time, though a boot's attestation never changes and its
/// validation only when it is validated again. A passed attestation here keeps its part
/// (no GPUs yet: not served to heartbeats), which a validation here completes; a boot
/// attested or validated by another server is read from the store at its first heartbeat
/// here. One a node, its latest boot's, and the module lists shared: a baseline lists
/// every loaded module (about 20 KB on a GPU server), the same on every node of an image;
/// kept a boot each, 10,000 nodes held 200 MB more (BENCHMARKS.md "Stop 46"), and a
/// fleet that reboots its old boots' too. Bounded: past `BASELINES_MAX` nodes it starts
/// over. Another server's revalidation of a boot is not seen here until this server
/// restarts or starts over; a passed revalidation within one boot names the GPUs the
/// first one did.
#[derive(Default)]
pub struct Baselines(std::sync::Mutex<Known>);

type Modules = std::collections::BTreeMap<String, String>;

struct Known {
    nodes: std::collections::HashMap<Mac, Kept>,
    /// The module lists kept baselines hold, each once.
    modules: std::collections::HashSet<Arc<Modules>>,
    /// Module lists past which those no baseline holds are dropped (twice the count
    /// after the last drop, so that dropping costs a constant a list).
    modules_limit: usize,
}

/// Module lists kept before the first look for unheld ones.
const MODULE_LISTS_FIRST_LIMIT: usize = 64;

impl Default for Known {
    fn default() -> Self {
        Self {
            nodes: Default::default(),
            modules: Default::default(),
            modules_limit: MODULE_LISTS_FIRST_LIMIT,
        }
    }
}

/// A node's boot and its baseline.
struct Kept {
    boot_id: String,
    baseline: Arc<Baseline>,
}

const BASELINES_MAX: usize = 65_536;

impl Known {
    /// Keeps `baseline` as `mac`'s, for its boot `boot_id`, with its module list shared;
    /// returns it as kept. Past `BASELINES_MAX` nodes it starts over.
    fn keep(&mut self, mac: &Mac, boot_id: &str, mut baseline: Baseline) -> Arc<Baseline> {
        if self.nodes.len() >= BASELINES_MAX && !self.nodes.contains_key(mac) {
            *self = Known::default();
        }
        baseline.modules = self.shared(baseline.modules);
        let baseline = Arc::new(baseline);
        let boot_id = boot_id.to_string();
        let kept = Kept {
            boot_id,
            baseline: baseline.clone(),
        };
        self.nodes.insert(*mac, kept);
        baseline
    }

    /// The kept copy of `modules` if there is one, else `modules`, kept.
    fn shared(&mut self, modules: Arc<Modules>) -> Arc<Modules> {
        if let Some(kept) = self.modules.get(&*modules) {
            return kept.clone();
        }
        if self.modules.len() >= self.modules_limit {
            self.modules.retain(|m| Arc::strong_count(m) > 1);
            self.modules_limit = (2 * self.modules.len()).max(MODULE_LISTS_FIRST_LIMIT);
        }
        self.modules.insert(modules.clone());
        modules
    }
}

impl Baselines {
    /// `mac`'s boot `boot_id`'s baseline if validated (one only attested here is not
    /// final).
    fn get(&self, mac: &Mac, boot_id: &str) -> Option<Arc<Baseline>> {
        let known = self.0.lock().expect("not poisoned");
        known
            .nodes
            .get(mac)
            .filter(|k| k.boot_id == boot_id && k.baseline.gpus.is_some())
            .map(|k| k.baseline.clone())
    }

    fn keep(&self, mac: &Mac, boot_id: &str, baseline: Baseline) -> Arc<Baseline> {
        let mut known = self.0.lock().expect("not poisoned");
        known.keep(mac, boot_id, baseline)
    }

    /// `mac`'s boot `boot_id` passed its attestation here: what its heartbeats will be
    /// compared with, but for the GPUs its validation will name. What is kept of the same
    /// boot is not replaced (a validation may have completed it); an earlier boot's is.
    pub fn attested(&self, mac: &Mac, boot_id: &str, report: &AttestReport) {
        // Made (its list copied and hashed) before the lock every heartbeat takes.
        let baseline = attested_baseline(report, None);
        let mut known = self.0.lock().expect("not poisoned");
        if known.nodes.get(mac).is_none_or(|k| k.boot_id != boot_id) {
            known.keep(mac, boot_id, baseline);
        }
    }

    /// `mac`'s boot `boot_id` was validated (again) here with `gpus`: its baseline, if
    /// kept, is complete (or its GPUs replaced); if not, its first heartbeat reads it.
    pub fn validated(&self, mac: &Mac, boot_id: &str, gpus: Vec<String>) {
        let mut known = self.0.lock().expect("not poisoned");
        if let Some(kept) = known.nodes.get_mut(mac).filter(|k| k.boot_id == boot_id) {
            let mut baseline = Baseline::clone(&kept.baseline);
            baseline.gpus = Some(gpus);
            kept.baseline = Arc::new(baseline);
        }
    }

    /// Nodes with a baseline kept, and module lists kept.
    #[cfg(test)]
    fn counts(&self) -> (usize, usize) {
        let known = self.0.lock().expect("not poisoned");
        (known.nodes.len(), known.modules.len())
    }
}

impl NodeService {
    /// `mac`'s boot `boot_id`'s baseline, from memory or the store.
    async fn baseline(
        &self,
        mac: &Mac,
        boot_id: &str,
    ) -> Result<Option<Arc<Baseline>>, AttestError> {
        if let Some(hit) = self.baselines.get(mac, boot_id) {
            return Ok(Some(hit));
        }
        let Some(boot) = self.store.boot_by_id(boot_id).await? else {
            return Ok(None);
        };
        let Some(baseline) = baseline_of(&boot) else {
            return Ok(None);
        };
        // Only a validated boot's baseline is final until its next validation.
        if baseline.gpus.is_none() {
            return Ok(Some(Arc::new(baseline)));
        }
        Ok(Some(self.baselines.keep(mac, boot_id, baseline)))
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
        // Named in the answer, so that the agent may send the list's digest alone.
        let mut modules_sha256 = None;
        if let Some(facts) = &req.facts
            && matches!(
                node.state,
                NodeState::Ready | NodeState::Degraded | NodeState::Drifted
            )
            && let Some(baseline) = self.baseline(mac, &req.boot_id).await?
        {
            drift = compare(&baseline, facts);
            modules_sha256 = Some(baseline.modules_sha256);
        }
        let answered = |action, drift| HeartbeatAnswer {
            baseline_modules_sha256: modules_sha256,
            ..answer(action, drift)
        };
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
                    Ok(_) => return Ok(answered(NextAction::Reboot, drift)),
                    // Stays drifted; the next heartbeat asks again, which is the queue.
                    Err(ReimageError::OverBudget(why)) => {
                        tracing::info!(%mac, why, "drifted node waits for the disruption budget")
                    }
                    Err(e) => tracing::warn!(%mac, error = %e, "drift policy cannot reimage"),
                }
            }
            return Ok(answered(NextAction::None, drift));
        }
        // Read with the node: a heartbeat that changes nothing writes nothing.
        if node.revalidate_requested && store.take_revalidate(mac).await? {
            return Ok(answered(NextAction::Revalidate, drift));
        }
        Ok(answered(NextAction::None, drift))
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

    fn mac(last: u8) -> Mac {
        Mac::from([0x52, 0x54, 0, 0, 0, last])
    }

    #[test]
    fn an_attested_baseline_is_served_once_its_validation_names_the_gpus() {
        let kept = Baselines::default();
        let m = mac(1);
        kept.attested(&m, "b1", &report());
        assert!(
            kept.get(&m, "b1").is_none(),
            "no GPUs yet: read from the store"
        );
        kept.validated(&m, "b1", vec!["GPU-1".into()]);
        // A late second attestation (a retry's) leaves the complete one.
        kept.attested(&m, "b1", &report());
        let baseline = kept.get(&m, "b1").expect("complete");
        assert_eq!(baseline.gpus.as_deref(), Some(&["GPU-1".to_string()][..]));
        assert_eq!(baseline.kernel_release, "6.1.0-18-amd64");
        // A revalidation here replaces the GPUs.
        kept.validated(&m, "b1", vec!["GPU-2".into()]);
        let again = kept.get(&m, "b1").expect("complete");
        assert_eq!(again.gpus.as_deref(), Some(&["GPU-2".to_string()][..]));
        assert!(kept.get(&mac(2), "b1").is_none(), "another node's");
    }

    #[test]
    fn a_validation_of_a_boot_attested_elsewhere_keeps_nothing() {
        let kept = Baselines::default();
        kept.validated(&mac(1), "b2", vec!["GPU-1".into()]);
        assert!(
            kept.get(&mac(1), "b2").is_none(),
            "its first heartbeat reads the store"
        );
    }

    #[test]
    fn module_lists_are_kept_once_and_dropped_when_no_baseline_holds_them() {
        let kept = Baselines::default();
        let with = |n: usize| AttestReport {
            modules: [
                (format!("mod{n}"), String::new()),
                ("nvidia".into(), "550".into()),
            ]
            .into(),
            ..report()
        };
        for node in 0..10 {
            kept.attested(&mac(node), "b0", &with(0));
        }
        assert_eq!(kept.counts(), (10, 1));
        let modules = |node| {
            kept.0.lock().unwrap().nodes[&mac(node)]
                .baseline
                .modules
                .clone()
        };
        assert!(Arc::ptr_eq(&modules(0), &modules(9)), "one copy");
        // Every node reboots, again and again, into a list of that boot's.
        for boot in 1..200 {
            for node in 0..10 {
                kept.attested(&mac(node), &format!("b{boot}"), &with(boot));
            }
        }
        let (nodes, lists) = kept.counts();
        assert_eq!(nodes, 10);
        assert!(
            lists <= 64,
            "lists no baseline holds are dropped: {lists} kept"
        );
        assert_eq!(modules(3)["mod199"], "");
    }

    #[test]
    fn a_node_keeps_only_its_latest_boots_baseline() {
        let kept = Baselines::default();
        for boot in 0..100 {
            for node in 0..3 {
                let (m, id) = (mac(node), format!("boot-{boot}"));
                kept.attested(&m, &id, &report());
                kept.validated(&m, &id, vec![format!("GPU-{boot}")]);
            }
        }
        assert_eq!(
            kept.counts(),
            (3, 1),
            "one a node, not one a boot; one module list"
        );
        let latest = kept.get(&mac(1), "boot-99").expect("the latest boot's");
        assert_eq!(latest.gpus.as_deref(), Some(&["GPU-99".to_string()][..]));
        assert!(
            kept.get(&mac(1), "boot-98").is_none(),
            "an earlier boot's is gone"
        );
        // A validation of the earlier boot (a late one) does not touch the latest's.
        kept.validated(&mac(1), "boot-98", vec!["GPU-x".into()]);
        let still = kept.get(&mac(1), "boot-99").expect("kept");
        assert_eq!(still.gpus.as_deref(), Some(&["GPU-99".to_string()][..]));
    }
}
