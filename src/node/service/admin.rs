//! What admins do to nodes through the API: list, show (with history and timelines),
//! assign, label, revalidate. The label rules live here; HTTP only extracts and maps
//! the errors.

use crate::api::Mac;
use crate::api::node::{LabelRequest, Node, NodeDetail, NodeQuery, RevalidateAccepted};
use crate::api::power::PowerEntry;
use crate::api::refs::ImageRef;
use crate::node::selector::NodeFilter;
use crate::registry::RegistryError;

use super::NodeService;

/// Labels one node may carry: enough for placement and policy, few enough that a
/// node row stays small.
pub const MAX_LABELS: usize = 64;

/// Timelines shown with a node.
const TIMELINES_SHOWN: i64 = 5;
/// Power actions shown with a node.
const POWER_SHOWN: i64 = 10;

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    /// Not now, in the node's present state: 409.
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Internal(String),
}

impl From<crate::store::StoreError> for AdminError {
    fn from(e: crate::store::StoreError) -> Self {
        AdminError::Internal(e.to_string())
    }
}

impl From<super::BootError> for AdminError {
    fn from(e: super::BootError) -> Self {
        AdminError::Internal(e.to_string())
    }
}

impl From<RegistryError> for AdminError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::NotFound(m) => AdminError::NotFound(m),
            RegistryError::Invalid(m) => AdminError::BadRequest(m),
            e => AdminError::Internal(e.to_string()),
        }
    }
}

fn valid_label_key(k: &str) -> bool {
    (1..=63).contains(&k.len())
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/'))
}

/// A character a person reading a label sees for what it is: no control character, and
/// none of the invisible or text-direction formatting characters that make two labels
/// look alike or a value read backwards (zero-width spaces and joiners, bidi embeddings,
/// overrides and isolates, word joiners, the byte order mark, soft hyphens).
fn visible(c: char) -> bool {
    !(c.is_control()
        || matches!(c,
            '\u{00AD}' | '\u{061C}' | '\u{180E}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}'
            | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{206F}' | '\u{FEFF}'))
}

impl NodeService {
    /// The nodes `query` means (every node for an empty one).
    /// The nodes the query matches, by MAC, as a page (`limit`, `offset`), with how many
    /// match in all.
    pub async fn list(&self, query: &NodeQuery) -> Result<(Vec<Node>, usize), AdminError> {
        let filter = NodeFilter::parse(query).map_err(AdminError::BadRequest)?;
        let nodes = self.store.nodes().await?;
        let matching: Vec<Node> = nodes
            .into_iter()
            .map(Node::from)
            .filter(|n| filter.matches(n))
            .collect();
        let total = matching.len();
        let page = matching
            .into_iter()
            .skip(query.offset.unwrap_or(0))
            .take(query.limit.unwrap_or(usize::MAX))
            .collect();
        Ok((page, total))
    }

    /// The node's readings and health verdicts; None before its first heartbeat here.
    pub async fn health_of(
        &self,
        mac: &Mac,
    ) -> Result<Option<crate::api::health::NodeHealth>, AdminError> {
        if self.store.node(mac).await?.is_none() {
            return Err(AdminError::NotFound(format!("no node {mac}")));
        }
        Ok(self.health.view(mac))
    }

    pub async fn show(&self, mac: &Mac) -> Result<NodeDetail, AdminError> {
        let store = &self.store;
        let node = store
            .node(mac)
            .await?
            .ok_or_else(|| AdminError::NotFound(format!("no node {mac}")))?;
        let (boots, preboot) = self.timelines(mac, TIMELINES_SHOWN).await?;
        let validation = store
            .boot_facts(mac, TIMELINES_SHOWN)
            .await?
            .into_iter()
            .find_map(|b| {
                let v = b.validation?;
                Some(crate::api::node::LastValidation {
                    boot_id: b.id,
                    at: crate::clock::format_ms(b.validated_at_ms.unwrap_or(b.created_at_ms)),
                    passed: v.get("passed")?.as_bool()?,
                    failures: serde_json::from_value(v.get("failures")?.clone()).ok()?,
                    gpus: serde_json::from_value(v.get("gpus")?.clone()).unwrap_or_default(),
                })
            });
        Ok(NodeDetail {
            validation,
            health: self.health.view(mac),
            node: node.into(),
            history: store.node_history(mac).await?,
            boots,
            preboot,
            power: store
                .power_actions(mac, POWER_SHOWN)
                .await?
                .into_iter()
                .map(|r| PowerEntry {
                    at: crate::clock::format_ms(r.at_ms),
                    action: r.action,
                    reason: r.reason,
                    outcome: r.outcome,
                    took_ms: r.took_ms,
                })
                .collect(),
        })
    }

    /// Assigns a REF. It must resolve now (a typo is refused), and is resolved again at
    /// each boot, so a node assigned a tag follows the tag.
    pub async fn assign(&self, mac: &Mac, image: &str) -> Result<Node, AdminError> {
        let reference =
            ImageRef::parse(image).map_err(|e| AdminError::BadRequest(e.to_string()))?;
        let digest = self.registry.resolve(&reference).await?;
        // A digest prefix is stored whole: a later image could make it ambiguous.
        let stored = match reference {
            ImageRef::DigestPrefix(_) => digest.to_string(),
            r => r.to_string(),
        };
        let node = self.store.assign(mac, &stored).await?;
        Ok(node.into())
    }

    /// Removes a node, its history and boots (`node.removed` says so in the event log).
    /// Refused while it runs a boot, unless `force`: a decommissioned machine is first
    /// powered off or left to become unreachable.
    pub async fn remove(&self, mac: &Mac, reason: &str, force: bool) -> Result<Node, AdminError> {
        use crate::node::controller::ControlError;
        match self.controller.remove(mac, reason, force).await {
            Ok(node) => {
                self.health.forget(mac);
                Ok(node.into())
            }
            Err(ControlError::UnknownNode(m)) => Err(AdminError::NotFound(format!("no node {m}"))),
            Err(e @ ControlError::InUse(..)) => Err(AdminError::Conflict(e.to_string())),
            Err(e) => Err(AdminError::Internal(e.to_string())),
        }
    }

    /// Sets and removes labels in one write: keys are 1-63 characters from A-Z a-z 0-9
    /// . _ - /, values up to 253 printable characters; at most `MAX_LABELS` a node.
    pub async fn label(&self, mac: &Mac, req: &LabelRequest) -> Result<Node, AdminError> {
        for (k, v) in &req.set {
            if !valid_label_key(k) || v.len() > 253 || !v.chars().all(visible) {
                return Err(AdminError::BadRequest(format!(
                    "invalid label {k:?}={v:?}: keys are 1-63 characters from A-Z a-z 0-9 . _ - /, values up to 253 visible characters"
                )));
            }
            // Labels whose values reach a node's boot: refused now, not ignored there.
            if k == "rootfs-cache" && !crate::node::directory::valid_fs_label(v) {
                return Err(AdminError::BadRequest(format!(
                    "rootfs-cache={v:?}: a file-system label is 1-16 characters from A-Z a-z 0-9 . _ -"
                )));
            }
            if k == "hostname" && !crate::node::directory::valid_hostname(v) {
                return Err(AdminError::BadRequest(format!(
                    "hostname={v:?} is not a host name (dot-separated parts of letters, digits and hyphens)"
                )));
            }
        }
        // Checked against the labels now: two racing requests may pass it together, which
        // bounds the count at twice the cap rather than leaving it unbounded.
        let current = self
            .store
            .node(mac)
            .await?
            .ok_or_else(|| AdminError::NotFound(format!("no node {mac}")))?;
        let after = current
            .labels
            .keys()
            .filter(|k| !req.remove.contains(k) && !req.set.contains_key(*k))
            .count()
            + req.set.len();
        if after > MAX_LABELS {
            return Err(AdminError::BadRequest(format!(
                "a node has at most {MAX_LABELS} labels; this request would leave {after}"
            )));
        }
        let node = self.store.label(mac, &req.set, &req.remove).await?;
        node.map(Node::from)
            .ok_or_else(|| AdminError::NotFound(format!("no node {mac}")))
    }

    /// The node's next heartbeat answers "revalidate"; a node in service with a workload
    /// scheduler is drained first (`draining`), as a health rule's revalidation is.
    pub async fn revalidate(&self, mac: &Mac) -> Result<RevalidateAccepted, AdminError> {
        let node = self
            .store
            .node(mac)
            .await?
            .ok_or_else(|| AdminError::NotFound(format!("no node {mac}")))?;
        if matches!(
            node.state,
            crate::api::NodeState::Ready | crate::api::NodeState::Degraded
        ) && let Some(drain) = &self.reimage.drain_first
            && drain.drains(&node)
        {
            drain
                .revalidate_after_drain(&node, "asked through the API")
                .await
                .map_err(|e| AdminError::Conflict(e.to_string()))?;
            return Ok(RevalidateAccepted {
                outcome: "draining".into(),
                node: *mac,
            });
        }
        if !self.store.request_revalidate(mac).await? {
            return Err(AdminError::NotFound(format!("no node {mac}")));
        }
        Ok(RevalidateAccepted {
            outcome: "revalidate-requested".into(),
            node: *mac,
        })
    }
}
