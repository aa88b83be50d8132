//! The one writer of node state: reads the node, asks the pure `transition`, writes with
//! compare-and-set, and retries from a fresh read when another writer got there first.

use crate::api::Mac;
use crate::node::state::{NodeEvent, TransitionError, transition};
use crate::store::{CasOutcome, NewBoot, NodeRecord};
use crate::store::{Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("no node {0}")]
    UnknownNode(Mac),
    #[error(transparent)]
    NotAllowed(#[from] TransitionError),
    #[error("node {0} kept changing under us; try again")]
    Contended(Mac),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How often a transition is re-tried after losing a compare-and-set.
const CAS_ATTEMPTS: usize = 5;

#[derive(Clone)]
pub struct NodeController {
    store: Store,
}

impl NodeController {
    pub fn new(store: Store) -> Self {
        Self { store }
    }

    /// Applies `event` to the node's current state, recording `reason`.
    pub async fn apply(
        &self,
        mac: &Mac,
        event: NodeEvent,
        reason: &str,
    ) -> Result<NodeRecord, ControlError> {
        self.apply_with_boot(mac, event, reason, None).await
    }

    /// As `apply`, and records `boot` in the same transaction: a boot record exists
    /// exactly when its node moved to provisioning for it.
    pub async fn apply_with_boot(
        &self,
        mac: &Mac,
        event: NodeEvent,
        reason: &str,
        boot: Option<&NewBoot<'_>>,
    ) -> Result<NodeRecord, ControlError> {
        for _ in 0..CAS_ATTEMPTS {
            let node = self
                .store
                .node(mac)
                .await?
                .ok_or(ControlError::UnknownNode(*mac))?;
            let to = transition(node.state, event)?;
            match self
                .store
                .set_state(mac, node.version, node.state, to, reason, boot)
                .await?
            {
                CasOutcome::Done(updated) => {
                    tracing::info!(%mac, from = %node.state, to = %to, reason, "node state changed");
                    return Ok(*updated);
                }
                CasOutcome::Stale => continue,
            }
        }
        Err(ControlError::Contended(*mac))
    }
}
