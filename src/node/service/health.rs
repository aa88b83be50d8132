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

/// The order of strength: a quarantine outranks a reimage, which outranks a revalidation.
fn rank(a: Action) -> u8 {
    match a {
        Action::Flag => 0,
        Action::Revalidate => 1,
        Action::Reimage => 2,
        Action::Quarantine => 3,
    }
}

impl NodeService {
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
            Action::Revalidate => {
                // Only a node that passed: one validating or failed is judged already.
                if node.state != NodeState::Ready {
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
