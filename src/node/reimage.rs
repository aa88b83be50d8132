//! Reimage requests, from an admin, a fleet controller or the drift policy: a reason, an
//! optional new image, the disruption budget (checked in the transaction that moves the
//! node) and `Idempotency-Key` (the same key gets the first answer again).

use crate::api::Mac;
use crate::api::NodeState;
use crate::api::event::kind;
use crate::api::node::ReimageAccepted;
use crate::api::refs::ImageRef;
use crate::node::state::{NodeEvent, transition};
use crate::registry::{Registry, RegistryError};
use crate::store::StoreError;
use crate::store::{KeyClaim, NodeRecord, ReimageDecision, ReimageOutcome};

/// How long a try waits for another try with its Idempotency-Key to answer, and how
/// often it looks.
const KEY_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
const KEY_POLL: std::time::Duration = std::time::Duration::from_millis(50);
/// A claimed key unanswered this long belongs to a server that died mid-request.
const KEY_STALE_MS: i64 = 60_000;

/// The disruption budget as a rule: a node may start reimaging if the state machine
/// allows it, fewer than `max_total` nodes are reimaging, and fewer than `max_per_group`
/// of its group (its value of `group_label`). `reimaging` is every node reimaging now.
pub fn decide(
    node: &NodeRecord,
    reimaging: &[NodeRecord],
    budget: &DisruptionBudget,
) -> ReimageDecision {
    if node.state == NodeState::Reimaging {
        return ReimageDecision::AlreadyReimaging;
    }
    let to = match transition(node.state, NodeEvent::ReimageRequested) {
        Ok(to) => to,
        Err(e) => return ReimageDecision::NotAllowed(e.to_string()),
    };
    let total = reimaging.len() as i64;
    if total >= budget.max_total {
        return ReimageDecision::OverBudget(format!(
            "{total} nodes are reimaging, the most allowed at once is {}",
            budget.max_total
        ));
    }
    if let Some(key) = &budget.group_label
        && let Some(group) = node.labels.get(key)
    {
        let in_group = reimaging
            .iter()
            .filter(|n| n.labels.get(key) == Some(group))
            .count() as i64;
        if in_group >= budget.max_per_group {
            return ReimageDecision::OverBudget(format!(
                "{in_group} nodes with {key}={group} are reimaging, the most allowed at once is {}",
                budget.max_per_group
            ));
        }
    }
    ReimageDecision::Move(to)
}

/// How many nodes may be reimaging at once: overall, and per value of one label.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DisruptionBudget {
    pub max_total: i64,
    /// The label that groups nodes (for example "rack"), and how many of one group at once.
    pub group_label: Option<String>,
    pub max_per_group: i64,
    /// Seconds a node's agent has to ask for its reboot before bootfleet power-cycles it
    /// through its BMC (nodes with one; see `power::fallback`).
    #[serde(default = "default_agent_grace_secs")]
    pub agent_grace_secs: u64,
}

fn default_agent_grace_secs() -> u64 {
    300
}

impl Default for DisruptionBudget {
    fn default() -> Self {
        Self {
            max_total: 10,
            group_label: Some("rack".into()),
            max_per_group: 2,
            agent_grace_secs: default_agent_grace_secs(),
        }
    }
}

#[derive(Clone)]
pub struct ReimageService {
    pub registry: Registry,
    pub controller: crate::node::controller::NodeController,
    pub budget: DisruptionBudget,
    /// Where a node with a workload scheduler goes instead: drained first, then
    /// reimaged (the rollout controller). None: every reimage is immediate.
    pub drain_first: Option<std::sync::Arc<dyn DrainFirst>>,
}

/// Reimages that wait for a drain. A node whose workload scheduler must drain it first
/// (its label names one) is not moved at once: it is handed to this, which drains it,
/// reimages it and hands it back (`rollout`, one layer up, implements it).
#[async_trait::async_trait]
pub trait DrainFirst: Send + Sync {
    /// Whether `node` has a scheduler to drain (or a label naming one that is not set up,
    /// which must fail visibly rather than skip the drain).
    fn drains(&self, node: &NodeRecord) -> bool;
    /// Queues the reimage of `node` (onto `image`, else what it is assigned) behind its
    /// drain; the answer. A node already in a rollout gets that rollout's number.
    async fn reimage_after_drain(
        &self,
        node: &NodeRecord,
        reason: &str,
        image: Option<&str>,
    ) -> Result<ReimageAccepted, ReimageError>;
    /// Queues a health rule's (or an admin's) revalidation of `node` behind its drain,
    /// which the rollout controller asks in its turn; false when nothing was queued (one
    /// is queued already, or a rollout holds the node and validates it anyway).
    async fn revalidate_after_drain(
        &self,
        node: &NodeRecord,
        reason: &str,
    ) -> Result<bool, ReimageError>;
}

/// Whether a reimage answer means the node moved (or was moving) to reimaging now, as
/// opposed to waiting for its drain: what a heartbeat may answer "reboot" to.
pub fn moved_now(answer: &str) -> bool {
    serde_json::from_str::<ReimageAccepted>(answer)
        .is_ok_and(|a| a.outcome == "accepted" || a.outcome == "already-reimaging")
}

#[derive(Debug, thiserror::Error)]
pub enum ReimageError {
    #[error("{0}")]
    BadRequest(String),
    #[error("no node {0}")]
    UnknownNode(Mac),
    /// The state machine does not allow it, or the key was used for another node.
    #[error("{0}")]
    Conflict(String),
    #[error("over the disruption budget: {0}")]
    OverBudget(String),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ReimageService {
    /// Returns the JSON answer (the stored one for a repeated key).
    pub async fn request(
        &self,
        mac: &Mac,
        reason: &str,
        image: Option<&str>,
        key: Option<&str>,
    ) -> Result<String, ReimageError> {
        let reason = reason.trim();
        if reason.is_empty() || reason.len() > 1024 {
            return Err(ReimageError::BadRequest(
                "a reimage needs a reason (1-1024 characters)".into(),
            ));
        }
        if key.is_some_and(|k| k.is_empty() || k.len() > 255) {
            return Err(ReimageError::BadRequest(
                "an Idempotency-Key is 1-255 characters".into(),
            ));
        }
        let Some(key) = key else {
            return self.decide_and_move(mac, reason, image).await;
        };
        let store = &self.registry.store;
        if let Some(answer) = self.claim(key, mac).await? {
            return Ok(answer);
        }
        let result = self.decide_and_move(mac, reason, image).await;
        match &result {
            Ok(body) => store.answer_idempotency_key(key, body).await?,
            // Refused or failed: no answer to keep; the next try asks afresh.
            Err(_) => store.release_idempotency_key(key).await?,
        }
        result
    }

    /// Claims `key` for this request: None when ours to go ahead, else the first try's
    /// answer. A try that finds the key held by another in progress waits for its answer
    /// (overlapping tries all get the first answer).
    async fn claim(&self, key: &str, mac: &Mac) -> Result<Option<String>, ReimageError> {
        let store = &self.registry.store;
        let other_node = |for_mac: &str| {
            ReimageError::Conflict(format!(
                "Idempotency-Key {key:?} was used for node {for_mac}"
            ))
        };
        let deadline = tokio::time::Instant::now() + KEY_WAIT;
        loop {
            match store.claim_idempotency_key(key, mac, KEY_STALE_MS).await? {
                KeyClaim::Claimed => return Ok(None),
                KeyClaim::Answered { mac: m, .. } | KeyClaim::InProgress { mac: m }
                    if m != mac.to_string() =>
                {
                    return Err(other_node(&m));
                }
                KeyClaim::Answered { response, .. } => return Ok(Some(response)),
                KeyClaim::InProgress { .. } if tokio::time::Instant::now() >= deadline => {
                    return Err(ReimageError::Conflict(format!(
                        "a request with Idempotency-Key {key:?} is still in progress; try again"
                    )));
                }
                KeyClaim::InProgress { .. } => tokio::time::sleep(KEY_POLL).await,
            }
        }
    }

    /// The budget's decision and the move, in the store's transaction; the answer as JSON.
    async fn decide_and_move(
        &self,
        mac: &Mac,
        reason: &str,
        image: Option<&str>,
    ) -> Result<String, ReimageError> {
        let store = &self.registry.store;
        if let Some(drain) = &self.drain_first
            && let Some(node) = store.node(mac).await?
            && node.state != NodeState::Reimaging
            && drain.drains(&node)
        {
            let answer = drain.reimage_after_drain(&node, reason, image).await?;
            return Ok(serde_json::to_string(&answer).expect("serialises"));
        }
        let image = match image {
            Some(r) => {
                let r = ImageRef::parse(r).map_err(|e| ReimageError::BadRequest(e.to_string()))?;
                let digest = self.registry.resolve(&r).await?;
                // A digest prefix is stored whole: a later image could make it ambiguous.
                Some(match r {
                    ImageRef::DigestPrefix(_) => ImageRef::Digest(digest),
                    r => r,
                })
            }
            None => None,
        };
        let reason = format!("reimage requested: {reason}");
        let rule =
            |node: &NodeRecord, reimaging: &[NodeRecord]| decide(node, reimaging, &self.budget);
        let (node, outcome) = match self.controller.reimage(mac, &reason, &rule).await? {
            ReimageOutcome::Accepted(n) => (n, "accepted"),
            ReimageOutcome::Refused(ReimageDecision::AlreadyReimaging, n) => {
                (n, "already-reimaging")
            }
            ReimageOutcome::Refused(ReimageDecision::OverBudget(why), _) => {
                let data = crate::api::event::ReimageRefusedData {
                    reason: why.clone(),
                    request: reason.clone(),
                };
                store
                    .record_event(
                        kind::REIMAGE_REFUSED,
                        Some(mac),
                        &serde_json::to_value(&data).expect("event data serialises"),
                    )
                    .await?;
                return Err(ReimageError::OverBudget(why));
            }
            ReimageOutcome::Refused(ReimageDecision::NotAllowed(why), _) => {
                return Err(ReimageError::Conflict(why));
            }
            // The rule never refuses with Move; a store that says so wrote nothing.
            ReimageOutcome::Refused(ReimageDecision::Move(_), _) => {
                return Err(ReimageError::Conflict(
                    "the reimage was not recorded".into(),
                ));
            }
            ReimageOutcome::UnknownNode => return Err(ReimageError::UnknownNode(*mac)),
        };
        let node = match image {
            Some(r) => store.assign(mac, &r.to_string()).await?,
            None => node,
        };
        let body = serde_json::to_string(&ReimageAccepted {
            outcome: outcome.into(),
            node: node.into(),
            rollout: None,
        })
        .expect("serialises");
        Ok(body)
    }
}
