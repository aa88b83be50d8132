//! The one writer of node state: reads the node, asks the pure `transition`, writes with
//! compare-and-set (with the row that belongs with the change, in one transaction), and
//! retries from a fresh read when another writer got there first. Discovery and reimage
//! requests, which also set a node's state, go through here too.

use crate::api::{Mac, NodeState};
use crate::node::state::{NodeEvent, TransitionError, transition};
use crate::store::{
    Attached, CasOutcome, NodeRecord, ReimageOutcome, ReimageRule, Store, StoreError,
};

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("no node {0}")]
    UnknownNode(Mac),
    #[error(transparent)]
    NotAllowed(#[from] TransitionError),
    #[error("node {0} kept changing under us; try again")]
    Contended(Mac),
    /// The attached attestation was recorded before: nothing changed.
    #[error("this boot was already attested")]
    AlreadyAttested,
    /// The node runs a boot; removing it needs `force`.
    #[error(
        "node {0} is {1}: it runs a boot; remove it once it is unreachable, failed or quarantined, or force it"
    )]
    InUse(Mac, crate::api::NodeState),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How often a transition is re-tried after losing a compare-and-set.
const CAS_ATTEMPTS: usize = 5;

#[derive(Clone)]
pub struct NodeController {
    store: Store,
    /// New MACs are not recorded while this many nodes are discovered and unassigned.
    discovery_cap: Option<i64>,
    /// Every state change written is counted and timed here.
    metrics: crate::metrics::Metrics,
}

/// MACs not recorded because the discovery cap was reached.
static PAST_THE_CAP: super::sampled::Sampled = super::sampled::Sampled::new(
    "new MACs not recorded: [discovery] max_unassigned nodes are waiting for an image",
);

impl NodeController {
    pub fn new(store: Store) -> Self {
        Self {
            store,
            discovery_cap: None,
            metrics: Default::default(),
        }
    }

    /// Counts and times state changes into `metrics` (the server's).
    pub fn with_metrics(mut self, metrics: crate::metrics::Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// The metrics state changes are counted in; the node service records its own there.
    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.metrics
    }

    /// Bounds what unauthenticated traffic (DHCP, boot requests for made-up MACs) can add.
    pub fn with_discovery_cap(mut self, cap: u64) -> Self {
        self.discovery_cap = Some(i64::try_from(cap).unwrap_or(i64::MAX));
        self
    }

    /// The node as the store keeps it in memory where it does (`node_in_memory`: no
    /// read), else as `current`: where a compare-and-set loop starts.
    async fn cached(&self, mac: &Mac) -> Result<NodeRecord, ControlError> {
        match self.store.node_in_memory(mac) {
            Some(node) => Ok(node),
            None => self.current(mac).await,
        }
    }

    /// The node as stored now; a compare-and-set loop's retries start from it.
    async fn current(&self, mac: &Mac) -> Result<NodeRecord, ControlError> {
        self.store
            .node(mac)
            .await?
            .ok_or(ControlError::UnknownNode(*mac))
    }

    /// Removes the node with its history and boots (an event says so), when
    /// `state::removable` allows it or `force`; retried when the node changes meanwhile.
    pub async fn remove(
        &self,
        mac: &Mac,
        reason: &str,
        force: bool,
    ) -> Result<NodeRecord, ControlError> {
        for _ in 0..CAS_ATTEMPTS {
            let node = self.current(mac).await?;
            if !force && !crate::node::state::removable(node.state) {
                return Err(ControlError::InUse(*mac, node.state));
            }
            let data = crate::api::event::NodeRemovedData {
                state: node.state,
                reason: reason.to_string(),
            };
            match self.store.remove_node(mac, node.version, &data).await? {
                crate::store::Removed::Done => return Ok(node),
                crate::store::Removed::Missing => return Err(ControlError::UnknownNode(*mac)),
                crate::store::Removed::Stale => continue,
            }
        }
        Err(ControlError::Contended(*mac))
    }

    /// Applies `event` to the node's current state, recording `reason`.
    pub async fn apply(
        &self,
        mac: &Mac,
        event: NodeEvent,
        reason: &str,
    ) -> Result<NodeRecord, ControlError> {
        self.apply_with(mac, event, reason, None).await
    }

    /// As `apply`, and writes `with` (a boot record, a verdict) in the same transaction:
    /// the row exists exactly when its transition happened.
    pub async fn apply_with(
        &self,
        mac: &Mac,
        event: NodeEvent,
        reason: &str,
        with: Option<&Attached<'_>>,
    ) -> Result<NodeRecord, ControlError> {
        self.change(mac, None, event, reason, with).await
    }

    /// `first` (with its reason), then `event` as `apply_with`, in one write
    /// (`NodeStore::set_state_via`); a node already where `first` leads takes
    /// `event` alone. For a request that passes a state on its way: a first validation
    /// report moves a booted node through validating.
    pub async fn apply_via(
        &self,
        mac: &Mac,
        first: (NodeEvent, &str),
        event: NodeEvent,
        reason: &str,
        with: Option<&Attached<'_>>,
    ) -> Result<NodeRecord, ControlError> {
        self.change(mac, Some(first), event, reason, with).await
    }

    async fn change(
        &self,
        mac: &Mac,
        first: Option<(NodeEvent, &str)>,
        event: NodeEvent,
        reason: &str,
        with: Option<&Attached<'_>>,
    ) -> Result<NodeRecord, ControlError> {
        let _writing = self.metrics.state_change_started();
        let started = std::time::Instant::now();
        // The first try starts from the record the store keeps in memory (SQLite, current
        // as of the last commit: no read); the write is compare-and-set on its version,
        // so a record that was out of date costs a retry from a fresh read, never a
        // wrong write, and a refusal is only ever given on a fresh read. That first try
        // comes on top of the CAS_ATTEMPTS from fresh reads.
        let mut fresh = false;
        for _ in 0..=CAS_ATTEMPTS {
            let node = if fresh {
                self.current(mac).await?
            } else {
                self.cached(mac).await?
            };
            let (via, to) = match plan(node.state, first, event) {
                Ok(path) => path,
                Err(_) if !fresh => {
                    fresh = true;
                    continue;
                }
                Err(refused) => return Err(refused.into()),
            };
            let outcome = match via {
                None => {
                    self.store
                        .set_state(mac, node.version, node.state, to, reason, with)
                        .await?
                }
                Some(via) => {
                    self.store
                        .set_state_via(mac, node.version, node.state, via, to, reason, with)
                        .await?
                }
            };
            match outcome {
                CasOutcome::Done(updated) => {
                    let secs = started.elapsed().as_secs_f64();
                    let mut at = node.state;
                    for (step, why) in via.iter().copied().chain([(to, reason)]) {
                        tracing::info!(%mac, from = %at, to = %step, reason = why, "node state changed");
                        self.metrics.transition(at, step, secs);
                        at = step;
                    }
                    return Ok(*updated);
                }
                CasOutcome::Stale => fresh = true,
                CasOutcome::AlreadyAttested => return Err(ControlError::AlreadyAttested),
            }
        }
        Err(ControlError::Contended(*mac))
    }

    /// Records `mac` as discovered unless it is known (keeping the first UUID its
    /// firmware sent); returns the node and whether it is new, or None for a new MAC past
    /// the discovery cap (not recorded).
    pub async fn discover(
        &self,
        mac: &Mac,
        uuid: Option<&str>,
        reason: &str,
    ) -> Result<Option<(NodeRecord, bool)>, StoreError> {
        let Some((node, new)) = self
            .store
            .discover_within(mac, uuid, reason, self.discovery_cap)
            .await?
        else {
            PAST_THE_CAP.note();
            return Ok(None);
        };
        if new {
            tracing::info!(%mac, reason, "node discovered");
            // A machine registered by its BMC alone becomes this node when it first boots.
            if let Some(id) = self.store.match_bmc_registration(mac, uuid).await? {
                tracing::info!(%mac, registration = id, "node matched to the BMC it was registered by");
                let node = self.store.node(mac).await?.unwrap_or(node);
                return Ok(Some((node, new)));
            }
        }
        Ok(Some((node, new)))
    }

    /// Moves the node to reimaging if `rule` (the disruption budget) allows it, deciding
    /// and writing in one transaction.
    pub async fn reimage(
        &self,
        mac: &Mac,
        reason: &str,
        rule: &ReimageRule<'_>,
    ) -> Result<ReimageOutcome, StoreError> {
        let _writing = self.metrics.state_change_started();
        let started = std::time::Instant::now();
        let before = self.store.node(mac).await?.map(|n| n.state);
        let outcome = self.store.request_reimage(mac, reason, rule).await?;
        match &outcome {
            ReimageOutcome::Accepted(node) => {
                tracing::info!(%mac, to = %node.state, reason, "node state changed");
                let from = before.unwrap_or(node.state);
                let secs = started.elapsed().as_secs_f64();
                self.metrics.transition(from, node.state, secs);
            }
            refused => self.count_refusal(refused),
        }
        Ok(outcome)
    }
}

impl NodeController {
    /// A refused reimage, counted by why (`already reimaging` is not a refusal).
    fn count_refusal(&self, outcome: &ReimageOutcome) {
        use crate::store::ReimageDecision;
        match outcome {
            ReimageOutcome::Refused(ReimageDecision::OverBudget(_), _) => self
                .metrics
                .reimage_refused(crate::metrics::REFUSED_OVER_BUDGET),
            ReimageOutcome::Refused(ReimageDecision::NotAllowed(_), _) => self
                .metrics
                .reimage_refused(crate::metrics::REFUSED_NOT_ALLOWED),
            _ => {}
        }
    }

    /// A rollout step's reimage: the step's move, the node's assignment and its move to
    /// reimaging under `rule`, in one transaction (`RolloutStore::reimage_step`).
    pub async fn reimage_step(
        &self,
        rollout: i64,
        step: &crate::store::StepMove<'_>,
        assign: &str,
        reason: &str,
        rule: &ReimageRule<'_>,
    ) -> Result<crate::store::StepReimage, StoreError> {
        let _writing = self.metrics.state_change_started();
        let started = std::time::Instant::now();
        let before = self.store.node(step.mac).await?.map(|n| n.state);
        let outcome = self
            .store
            .reimage_step(rollout, step, assign, reason, rule)
            .await?;
        match &outcome {
            crate::store::StepReimage::Moved => {
                tracing::info!(mac = %step.mac, rollout, assign, reason, "node state changed to reimaging");
                let to = crate::api::NodeState::Reimaging;
                let secs = started.elapsed().as_secs_f64();
                self.metrics.transition(before.unwrap_or(to), to, secs);
            }
            crate::store::StepReimage::Refused(refused) => self.count_refusal(refused),
            crate::store::StepReimage::StaleStep => {}
        }
        Ok(outcome)
    }
}

/// A machine's UUID as reported (by firmware or a BMC), lower case, unless it is empty or
/// all zeros (QEMU without `-uuid`, firmware that has none): such a UUID names no machine.
/// What `discover` is given has been through this (the boot script's query) or the
/// equivalent byte check (DHCP option 97).
pub fn meaningful_uuid(uuid: Option<&str>) -> Option<String> {
    let u = uuid?.trim().to_ascii_lowercase();
    (!u.is_empty() && u.chars().any(|c| c.is_ascii_hexdigit() && c != '0')).then_some(u)
}

/// The changes `event` makes from `at`: through `first` (with its reason) unless the node
/// is already where `first` leads, then on. Pure; the transition table decides each step.
/// A change's path: the state it passes with that step's reason, if any, and where it ends.
type Path<'r> = (Option<(NodeState, &'r str)>, NodeState);

fn plan(
    at: NodeState,
    first: Option<(NodeEvent, &str)>,
    event: NodeEvent,
) -> Result<Path<'_>, TransitionError> {
    let via = match first {
        Some((e, why)) if at != e.target() => Some((transition(at, e)?, why)),
        _ => None,
    };
    let from = via.map_or(at, |(v, _)| v);
    Ok((via, transition(from, event)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_goes_through_its_first_step_unless_the_node_is_there() {
        let first = Some((NodeEvent::ValidationStarted, "received"));
        let validated = NodeEvent::Validated { passed: true };
        assert_eq!(
            plan(NodeState::Booted, first, validated).unwrap(),
            (Some((NodeState::Validating, "received")), NodeState::Ready)
        );
        assert_eq!(
            plan(NodeState::Validating, first, validated).unwrap(),
            (None, NodeState::Ready)
        );
        assert_eq!(
            plan(NodeState::Validating, None, validated).unwrap(),
            (None, NodeState::Ready)
        );
        // Either step refused refuses the whole.
        assert!(plan(NodeState::Discovered, first, validated).is_err());
        assert!(plan(NodeState::Booted, None, validated).is_err());
    }
}
