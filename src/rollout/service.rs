//! The admin's requests: start a rollout (the REF resolved and the nodes selected once,
//! their waves and previous images recorded), list, show, and pause, resume, abort or
//! roll back one. The controller (`run.rs`) does the moving.

use std::collections::BTreeMap;

use crate::api::event::kind;
use crate::api::node::NodeQuery;
use crate::api::refs::ImageRef;
use crate::api::rollout::{
    Rollout, RolloutNode, RolloutRequest, RolloutState, RolloutSummary, StepStatus, WaveProgress,
};
use crate::clock::format_ms;
use crate::node::reimage::DisruptionBudget;
use crate::node::selector::NodeFilter;
use crate::registry::{Registry, RegistryError};
use crate::store::{
    NewRollout, NodeRecord, RolloutCreated, RolloutMove, RolloutMoved, RolloutNodeRow, RolloutRow,
    Store, StoreError,
};

use super::plan;

#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error("{0}")]
    BadRequest(String),
    #[error("no rollout {0}")]
    NotFound(i64),
    /// Another rollout holds a node, or the rollout's state does not allow the action.
    #[error("{0}")]
    Conflict(String),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// An admin's action on a running rollout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminAction {
    Pause,
    Resume,
    Abort,
    Rollback,
}

impl AdminAction {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pause" => Self::Pause,
            "resume" => Self::Resume,
            "abort" => Self::Abort,
            "rollback" => Self::Rollback,
            _ => return None,
        })
    }
}

#[derive(Clone)]
pub struct RolloutService {
    pub store: Store,
    pub registry: Registry,
    /// Its group label (e.g. rack) spreads each wave over the groups.
    pub budget: DisruptionBudget,
    /// Which nodes have a workload scheduler (reimages of those wait for a drain).
    pub schedulers: std::sync::Arc<super::drain::Schedulers>,
}

/// How many times an admin action is retried when the controller moved the rollout
/// between its read and its write.
const CAS_ATTEMPTS: usize = 5;

fn check_request(r: &RolloutRequest) -> Result<(), RolloutError> {
    let bad = |m: &str| Err(RolloutError::BadRequest(m.into()));
    let reason = r.reason.trim();
    if reason.is_empty() || reason.len() > 1024 {
        return bad("a rollout needs a reason (1-1024 characters)");
    }
    match (r.selector.trim().is_empty(), r.nodes.is_empty()) {
        (true, true) => {
            return bad(
                "a rollout needs a selector (rack=r12,sku=hgx-h100) or nodes: it is never the whole fleet by default",
            );
        }
        (false, false) => return bad("give a selector or nodes, not both"),
        _ => {}
    }
    if r.max_unavailable == 0 {
        return bad("max-unavailable is at least 1");
    }
    if r.timeout_secs == 0 || r.timeout_secs > 7 * 24 * 3600 {
        return bad("the timeout is 1 s to 7 days");
    }
    Ok(())
}

impl RolloutService {
    pub async fn start(&self, req: RolloutRequest) -> Result<Rollout, RolloutError> {
        check_request(&req)?;
        let reference =
            ImageRef::parse(&req.image).map_err(|e| RolloutError::BadRequest(e.to_string()))?;
        let digest = self.registry.resolve(&reference).await?;
        let nodes = self.select(&req).await?;
        if nodes.is_empty() {
            return Err(RolloutError::BadRequest(format!(
                "no node matches the selector {:?}",
                req.selector
            )));
        }
        if req.canary as usize > nodes.len() {
            return Err(RolloutError::BadRequest(format!(
                "{} canaries asked for, {} node(s) selected",
                req.canary,
                nodes.len()
            )));
        }
        let size = plan::wave_size(&req.wave, nodes.len()).map_err(RolloutError::BadRequest)?;
        let group = self.budget.group_label.as_deref();
        let grouped: Vec<_> = nodes
            .iter()
            .map(|n| (n.mac, group.and_then(|g| n.labels.get(g).cloned())))
            .collect();
        let by_mac: BTreeMap<_, _> = nodes.iter().map(|n| (n.mac, n)).collect();
        let mut rows = Vec::with_capacity(nodes.len());
        for (mac, wave, position) in plan::waves(&grouped, req.canary as usize, size) {
            let previous = self.store.latest_boot(&mac).await?.map(|(d, _)| d);
            rows.push(RolloutNodeRow {
                mac,
                wave,
                position,
                status: StepStatus::Pending,
                previous_assigned: by_mac[&mac].assigned.clone(),
                previous_digest: previous,
                reason: String::new(),
                started_at_ms: None,
                finished_at_ms: None,
            });
        }
        let spec_json = serde_json::to_string(&req).expect("a request serialises");
        let created = self
            .store
            .create_rollout(&NewRollout {
                spec_json: &spec_json,
                digest: &digest,
                nodes: &rows,
                reason: req.reason.trim(),
            })
            .await?;
        match created {
            RolloutCreated::Created(id) => self.show(id).await,
            RolloutCreated::Overlap { mac, rollout } => Err(RolloutError::Conflict(format!(
                "node {mac} is in rollout {rollout}, which has not ended: wait for it, abort it, or narrow the selector"
            ))),
        }
    }

    /// The nodes a request means: its selector's matches, or its MACs (each must exist).
    async fn select(&self, req: &RolloutRequest) -> Result<Vec<NodeRecord>, RolloutError> {
        if !req.nodes.is_empty() {
            let found = self.store.nodes_in(&req.nodes).await?;
            if let Some(missing) = req
                .nodes
                .iter()
                .find(|m| !found.iter().any(|n| n.mac == **m))
            {
                return Err(RolloutError::BadRequest(format!("no node {missing}")));
            }
            return Ok(found);
        }
        let filter = NodeFilter::parse(&NodeQuery {
            selector: Some(req.selector.clone()),
            ..Default::default()
        })
        .map_err(RolloutError::BadRequest)?;
        Ok(self
            .store
            .nodes()
            .await?
            .into_iter()
            .filter(|n| filter.matches(&n.clone().into()))
            .collect())
    }

    pub async fn list(&self) -> Result<Vec<RolloutSummary>, RolloutError> {
        let mut out = Vec::new();
        for row in self.store.rollouts().await? {
            let Some(r) = self.read(row.id).await.ok() else {
                continue;
            };
            let count = |s: StepStatus| r.nodes.iter().filter(|n| n.status == s).count() as u32;
            out.push(RolloutSummary {
                id: r.id,
                image: r.spec.image.clone(),
                digest: r.digest,
                selector: r.spec.selector.clone(),
                state: r.state,
                state_reason: r.state_reason.clone(),
                wave: r.wave,
                waves: r.waves.len() as u32,
                nodes: r.nodes.len() as u32,
                done: count(StepStatus::Done),
                failed: count(StepStatus::Failed),
                created_at: r.created_at.clone(),
            });
        }
        Ok(out)
    }

    pub async fn show(&self, id: i64) -> Result<Rollout, RolloutError> {
        self.read(id).await
    }

    async fn read(&self, id: i64) -> Result<Rollout, RolloutError> {
        let (row, nodes) = self
            .store
            .rollout(id)
            .await?
            .ok_or(RolloutError::NotFound(id))?;
        Ok(to_api(&row, &nodes)?)
    }

    /// Pause, resume, abort or roll back, by compare-and-set against the controller.
    pub async fn act(
        &self,
        id: i64,
        action: AdminAction,
        reason: &str,
    ) -> Result<Rollout, RolloutError> {
        let reason = reason.trim();
        if reason.is_empty() || reason.len() > 1024 {
            return Err(RolloutError::BadRequest(
                "an action needs a reason (1-1024 characters)".into(),
            ));
        }
        for _ in 0..CAS_ATTEMPTS {
            let (row, nodes) = self
                .store
                .rollout(id)
                .await?
                .ok_or(RolloutError::NotFound(id))?;
            let (state, queue) = admin_move(&row, action)?;
            let kind = kind::rollout_state(state);
            let m = RolloutMove {
                state,
                reason,
                wave: row.wave,
                queue_rollback: queue,
                event_kind: &kind,
                reclaim: !row.state.holds_nodes(),
            };
            match self.store.move_rollout(id, row.version, &m).await? {
                RolloutMoved::Moved if action == AdminAction::Abort => {
                    self.hand_back(id, &nodes, reason).await?;
                    return self.read(id).await;
                }
                RolloutMoved::Moved => return self.read(id).await,
                RolloutMoved::Stale => continue,
                RolloutMoved::Overlap { mac, rollout } => {
                    return Err(RolloutError::Conflict(format!(
                        "node {mac} is in rollout {rollout} now: end that one before rolling this one back"
                    )));
                }
            }
        }
        Err(RolloutError::Conflict(format!(
            "rollout {id} kept changing under us; try again"
        )))
    }
}

impl RolloutService {
    /// Whether rollout `id`, which holds `mac`, will still reimage it: running (or
    /// rolling back) with the node's step not yet past its reimage.
    async fn will_reimage(&self, id: i64, mac: &crate::api::Mac) -> Result<bool, StoreError> {
        let Some((rollout, steps)) = self.store.rollout(id).await? else {
            return Ok(false);
        };
        let moving = matches!(
            rollout.state,
            RolloutState::Running | RolloutState::RollingBack
        );
        let ahead = steps.iter().find(|s| s.mac == *mac).is_some_and(|s| {
            matches!(
                s.status,
                StepStatus::Pending
                    | StepStatus::Draining
                    | StepStatus::Reimaging
                    | StepStatus::RollbackPending
                    | StepStatus::RollingBack
            )
        });
        Ok(moving && ahead)
    }

    /// An aborted rollout's nodes that its scheduler was asked to drain (draining, or
    /// reimaging now) are handed back at once: no controller looks at an ended rollout.
    /// A scheduler that refuses costs an event, not the abort.
    async fn hand_back(
        &self,
        id: i64,
        steps: &[RolloutNodeRow],
        reason: &str,
    ) -> Result<(), StoreError> {
        let macs: Vec<_> = steps
            .iter()
            .filter(|s| matches!(s.status, StepStatus::Draining | StepStatus::Reimaging))
            .map(|s| s.mac)
            .collect();
        for node in self.store.nodes_in(&macs).await? {
            let Ok(Some(scheduler)) = self.schedulers.of(&node) else {
                continue;
            };
            let target = super::drain::Target::from(&node);
            let said = match scheduler
                .resume(&target, &format!("rollout {id} aborted"))
                .await
            {
                Ok(()) => "handed back to its scheduler: the rollout was aborted".to_string(),
                Err(e) => format!("not handed back to its scheduler: {e}"),
            };
            let data = crate::api::rollout::RolloutEventData {
                rollout: id,
                wave: None,
                reason: format!("{said} ({reason})"),
            };
            let data = serde_json::to_value(&data).expect("serialises");
            self.store
                .record_event(kind::ROLLOUT_NODE_RESUMED, Some(&node.mac), &data)
                .await?;
        }
        Ok(())
    }
}

/// The state an admin action leads to from here, and the nodes that move with it.
fn admin_move(
    row: &RolloutRow,
    action: AdminAction,
) -> Result<(RolloutState, &'static [StepStatus]), RolloutError> {
    use RolloutState::*;
    let refuse = |what: &str| {
        Err(RolloutError::Conflict(format!(
            "rollout {} is {}: {what}",
            row.id, row.state
        )))
    };
    match (action, row.state) {
        (AdminAction::Pause, Running) => Ok((Paused, &[])),
        (AdminAction::Pause, _) => refuse("only a running rollout pauses"),
        (AdminAction::Resume, Paused) => Ok((Running, &[])),
        (AdminAction::Resume, Halted) => refuse("a halted rollout is rolled back or aborted"),
        (AdminAction::Resume, _) => refuse("only a paused rollout resumes"),
        (AdminAction::Abort, s) if s.holds_nodes() => Ok((Aborted, &[])),
        (AdminAction::Abort, _) => refuse("it has ended"),
        (AdminAction::Rollback, RollingBack | RolledBack) => refuse("it is rolled back already"),
        // Every node the rollout reimaged goes back (chosen by the store in the move's
        // transaction); those still reimaging follow when they settle, those draining
        // are handed back (the controller).
        (AdminAction::Rollback, _) => Ok((RollingBack, &[StepStatus::Done, StepStatus::Failed])),
    }
}

/// A rollout as the API shows it.
pub fn to_api(row: &RolloutRow, nodes: &[RolloutNodeRow]) -> Result<Rollout, StoreError> {
    let spec: RolloutRequest = serde_json::from_str(&row.spec_json)
        .map_err(|e| StoreError::Corrupt(format!("rollout {} spec: {e}", row.id)))?;
    let mut waves: BTreeMap<u32, WaveProgress> = BTreeMap::new();
    for n in nodes {
        let w = waves.entry(n.wave).or_insert_with(|| WaveProgress {
            wave: n.wave,
            canary: n.wave == 0 && spec.canary > 0,
            nodes: 0,
            counts: BTreeMap::new(),
        });
        w.nodes += 1;
        *w.counts.entry(n.status.as_str().to_string()).or_default() += 1;
    }
    Ok(Rollout {
        id: row.id,
        digest: row.digest,
        state: row.state,
        state_reason: row.state_reason.clone(),
        wave: row.wave,
        waves: waves.into_values().collect(),
        nodes: nodes
            .iter()
            .map(|n| RolloutNode {
                mac: n.mac,
                wave: n.wave,
                status: n.status,
                previous_assigned: n.previous_assigned.clone(),
                previous_digest: n.previous_digest,
                reason: n.reason.clone(),
                started_at: n.started_at_ms.map(format_ms),
                finished_at: n.finished_at_ms.map(format_ms),
            })
            .collect(),
        created_at: format_ms(row.created_at_ms),
        updated_at: format_ms(row.updated_at_ms),
        spec,
    })
}

/// A reimage of a node with a workload scheduler (an admin's, the drift policy's, the
/// failure policy's) becomes a rollout of that one node: drained, reimaged onto the REF
/// asked for (else what the node is assigned), handed back after ready; persisted and
/// carried on after a restart like any rollout.
#[async_trait::async_trait]
impl crate::node::reimage::DrainFirst for RolloutService {
    fn drains(&self, node: &NodeRecord) -> bool {
        !matches!(self.schedulers.of(node), Ok(None))
    }

    async fn revalidate_after_drain(
        &self,
        node: &NodeRecord,
        reason: &str,
    ) -> Result<bool, crate::node::reimage::ReimageError> {
        use crate::node::reimage::ReimageError;
        match self.schedulers.of(node) {
            Ok(Some(_)) => {}
            Ok(None) => return Ok(false),
            Err(e) => return Err(ReimageError::Conflict(e.to_string())),
        }
        if let Some(id) = self.store.claimed_by(&node.mac).await?
            && self.will_reimage(id, &node.mac).await?
        {
            tracing::info!(mac = %node.mac, rollout = id, "health revalidation left to the rollout that reimages the node");
            return Ok(false);
        }
        // Queued only: the controller asks the drain in its turn (`[drain]
        // revalidations_at_once`), and no scheduler's slowness holds up a heartbeat.
        let event = crate::api::event::HealthDrainData {
            step: "queued".into(),
            reason: reason.to_string(),
        };
        Ok(self
            .store
            .queue_revalidation_drain(&node.mac, reason, crate::clock::now_ms(), &event)
            .await?)
    }

    async fn reimage_after_drain(
        &self,
        node: &NodeRecord,
        reason: &str,
        image: Option<&str>,
    ) -> Result<crate::api::node::ReimageAccepted, crate::node::reimage::ReimageError> {
        use crate::node::reimage::ReimageError;
        let answer = |rollout: i64| crate::api::node::ReimageAccepted {
            outcome: "draining".into(),
            node: node.clone().into(),
            rollout: Some(rollout),
        };
        if let Some(id) = self.store.claimed_by(&node.mac).await? {
            // A rollout that will still reimage the node carries the request; one that
            // will not (stopped, or done with the node) would only hide it.
            if self.will_reimage(id, &node.mac).await? && image.is_none() {
                return Ok(answer(id));
            }
            let held = self.store.rollout(id).await?;
            let step = held
                .as_ref()
                .and_then(|(_, steps)| steps.iter().find(|s| s.mac == node.mac))
                .map(|s| s.status);
            let state = held.map_or("gone".to_string(), |(r, _)| r.state.to_string());
            return Err(ReimageError::Conflict(format!(
                "node {} is held by rollout {id} ({state}, its step {}): it will not take this reimage; let it end, or abort it",
                node.mac,
                step.map_or("unknown".to_string(), |s| s.to_string()),
            )));
        }
        let image = image
            .map(str::to_string)
            .or_else(|| node.assigned.clone())
            .ok_or_else(|| {
                ReimageError::BadRequest(format!("node {} has no image assigned", node.mac))
            })?;
        let req = RolloutRequest {
            image,
            selector: String::new(),
            nodes: vec![node.mac],
            canary: 0,
            wave: "1".into(),
            max_unavailable: 1,
            pause_after_canary: false,
            timeout_secs: 1200,
            max_failures: 0,
            on_failure: crate::api::rollout::OnFailure::Halt,
            reason: format!("reimage: {reason}"),
        };
        match self.start(req).await {
            Ok(r) => Ok(answer(r.id)),
            // Taken by a rollout between the look and the start: that one reimages it.
            Err(RolloutError::Conflict(_)) => match self.store.claimed_by(&node.mac).await? {
                Some(id) => Ok(answer(id)),
                None => Err(ReimageError::Conflict(format!(
                    "node {} changed rollouts; try again",
                    node.mac
                ))),
            },
            Err(RolloutError::BadRequest(m)) => Err(ReimageError::BadRequest(m)),
            Err(RolloutError::NotFound(id)) => {
                Err(ReimageError::Conflict(format!("rollout {id} vanished")))
            }
            Err(RolloutError::Registry(e)) => Err(ReimageError::Registry(e)),
            Err(RolloutError::Store(e)) => Err(ReimageError::Store(e)),
        }
    }
}
