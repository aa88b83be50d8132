//! Acting on the `[health]` rules' verdicts from a heartbeat: each is recorded as an
//! event with its evidence; then the strongest action of them is carried out, through the
//! same paths an admin's request takes (the controller, the disruption budget).

use super::NodeService;
use super::attest::AttestError;
use crate::api::NodeState;
use crate::api::agent::NextAction;
use crate::api::event::kind;
use crate::health::{Action, Verdict};
use crate::node::reimage::ReimageError;
use crate::node::state::NodeEvent;
use crate::store::NodeRecord;

/// The order of strength: a quarantine outranks a reimage, which outranks a
/// revalidation, which outranks marking the node degraded (the revalidation judges it
/// afresh).
fn rank(a: Action) -> u8 {
    match a {
        Action::Flag => 0,
        Action::Degrade => 1,
        Action::Revalidate => 2,
        Action::Reimage => 3,
        Action::Quarantine => 4,
    }
}

impl NodeService {
    /// A passed validation does not clear what a heartbeat rule still sees (a GPU still
    /// throttling): a `degrade` verdict of this boot that still holds degrades the node
    /// again. Figures were judged afresh by the validation itself.
    pub(super) async fn degrade_again(
        &self,
        mac: &crate::api::Mac,
        boot_id: &str,
    ) -> Result<(), AttestError> {
        let Some(view) = self.health.view(mac) else {
            return Ok(());
        };
        let held = view
            .verdicts
            .iter()
            .find(|v| v.action == Action::Degrade.as_str() && v.rule != crate::health::peers::RULE);
        let Some(v) = held.filter(|_| view.boot_id == boot_id) else {
            return Ok(());
        };
        let reason = format!(
            "boot {boot_id}: health rule {} still holds: {}",
            v.rule, v.summary
        );
        match self
            .controller
            .apply(mac, NodeEvent::DegradationFound, &reason)
            .await
        {
            // Not ready any more (degraded by its figures, moved on): nothing to add.
            Ok(_) | Err(crate::node::controller::ControlError::NotAllowed(_)) => Ok(()),
            Err(e) => Err(super::BootError::from(e).into()),
        }
    }

    /// A passed validation's performance figures against the node's peers'; a slow
    /// node's verdict (this one's, or a peer's once the group grew enough to judge it)
    /// is held with the node's other verdicts and acted on.
    pub(super) async fn judge_figures(
        &self,
        node: &NodeRecord,
        boot_id: &str,
        image: &str,
        figures: &[crate::api::agent::Figure],
    ) -> Result<(), AttestError> {
        let at = crate::clock::format_ms(crate::clock::now_ms());
        let found = self
            .health
            .peers
            .observe(node.mac, image, &node.labels, figures, &at);
        for (mac, verdict) in found {
            let boot = (mac == node.mac).then_some(boot_id);
            // As it is now (this node's validation has just moved it).
            let record = self
                .store
                .node(&mac)
                .await
                .map_err(super::BootError::from)?;
            let Some(record) = record else { continue };
            self.health.hold(&mac, boot, &verdict.view);
            // Not a heartbeat: a revalidation reaches the node by its next one.
            let boot = boot.unwrap_or("its current boot");
            if self.act_on_health(&record, boot, vec![verdict]).await?
                == Some(NextAction::Revalidate)
            {
                self.store
                    .request_revalidate(&mac)
                    .await
                    .map_err(super::BootError::from)?;
            }
        }
        Ok(())
    }

    /// Records `verdicts` and carries out the strongest; answers the heartbeat's action
    /// when that decides it.
    pub(super) async fn act_on_health(
        &self,
        node: &NodeRecord,
        boot_id: &str,
        verdicts: Vec<Verdict>,
    ) -> Result<Option<NextAction>, AttestError> {
        let Some(strongest) = verdicts.iter().max_by_key(|v| rank(v.action)).cloned() else {
            return Ok(None);
        };
        let mac = &node.mac;
        for v in &verdicts {
            self.controller
                .metrics()
                .health_verdict(&v.view.rule, &v.view.action);
            let data = serde_json::to_value(&v.view).expect("a verdict serialises");
            self.store
                .record_event(kind::HEALTH_VERDICT, Some(mac), &data)
                .await
                .map_err(super::BootError::from)?;
        }
        let reason = format!(
            "boot {boot_id}: health rule {}: {}",
            strongest.view.rule, strongest.view.summary
        );
        match strongest.action {
            Action::Flag => Ok(None),
            Action::Degrade => {
                // Only a node that passed: a degraded one is so already, and one validating,
                // failed or gone is judged by what it is doing.
                if node.state == NodeState::Ready {
                    self.controller
                        .apply(mac, NodeEvent::DegradationFound, &reason)
                        .await
                        .map_err(super::BootError::from)?;
                }
                Ok(None)
            }
            Action::Revalidate => {
                // Only a node that passed: one validating or failed is judged already.
                if !matches!(node.state, NodeState::Ready | NodeState::Degraded) {
                    return Ok(None);
                }
                // A validation burns the GPUs in: never under a workload. A node with a
                // scheduler is drained first; the rollout controller sends it to validate
                // once drained and hands it back once ready again.
                if let Some(drain) = &self.reimage.drain_first
                    && drain.drains(node)
                {
                    if let Err(e) = drain.revalidate_after_drain(node, &reason).await {
                        tracing::warn!(%mac, error = %e, "health rule cannot revalidate behind a drain");
                    }
                    return Ok(None);
                }
                self.controller
                    .apply(mac, NodeEvent::ValidationStarted, &reason)
                    .await
                    .map_err(super::BootError::from)?;
                Ok(Some(NextAction::Revalidate))
            }
            Action::Reimage => match self.reimage.request(mac, &reason, None, None).await {
                Ok(a) if crate::node::reimage::moved_now(&a) => Ok(Some(NextAction::Reboot)),
                // Draining first: the rollout that drains it reimages it.
                Ok(_) => Ok(None),
                // Refused by the budget (recorded as `reimage.refused`): the verdict stays,
                // and the node's next verdict or an admin tries again.
                Err(ReimageError::OverBudget(why)) => {
                    tracing::info!(%mac, why, "health reimage waits for the disruption budget");
                    Ok(None)
                }
                Err(e) => {
                    tracing::warn!(%mac, error = %e, "health rule cannot reimage");
                    Ok(None)
                }
            },
            Action::Quarantine => {
                let data = serde_json::to_value(&strongest.view).expect("a verdict serialises");
                if node.state != NodeState::Quarantined {
                    self.controller
                        .apply(mac, NodeEvent::QuarantineImposed, &reason)
                        .await
                        .map_err(super::BootError::from)?;
                }
                self.store
                    .record_event(kind::HEALTH_TICKET, Some(mac), &data)
                    .await
                    .map_err(super::BootError::from)?;
                Ok(Some(NextAction::None))
            }
        }
    }
}
