//! The event log as the API pages and streams it, and the kinds of event.

use serde::{Deserialize, Serialize};

use crate::Mac;

/// Event kinds, as stored and as sent.
pub mod kind {
    /// A node changed state: `{from, to, reason}`.
    pub const NODE_STATE: &str = "node.state";
    /// An agent report (attestation, heartbeat, validation) was refused: `{route, boot, reason}`.
    pub const REPORT_REFUSED: &str = "report.refused";
    /// A reimage request was refused by the disruption budget: `{reason}`.
    pub const REIMAGE_REFUSED: &str = "reimage.refused";
    /// An image needs a blob `image verify` found damaged or missing; no node is handed
    /// it until a re-publish restores the blob: `{image, name, version, blob, reason}`.
    pub const IMAGE_BROKEN: &str = "image.broken";
    /// An admin removed a node (with its history and boots): `{state, reason}`.
    pub const NODE_REMOVED: &str = "node.removed";
    /// A power action through a node's BMC, carried out or failed:
    /// `{action, reason, outcome, took_ms}` (`outcome` is `ok` or the BMC's error).
    pub const POWER: &str = "node.power";
    /// A BMC's settings were set or removed: `{bmc}` (never a credential, only its name).
    pub const BMC_SET: &str = "node.bmc";
    /// A machine was registered by its BMC alone: `{id, bmc, uuid, macs}`.
    pub const BMC_REGISTERED: &str = "bmc.registered";
    /// A power action on a machine known only by its BMC: `{id, action, reason, outcome}`.
    pub const BMC_POWER: &str = "bmc.power";
    /// A booting node was matched to a machine registered by its BMC and given that BMC:
    /// `{id, by}` (`by` is `mac` or `uuid`).
    pub const BMC_MATCHED: &str = "bmc.matched";
    /// A rollout began: `{rollout, reason}` (every `rollout.*` event carries
    /// `RolloutEventData`; a node's carries the node).
    pub const ROLLOUT_STARTED: &str = "rollout.started";
    /// A rollout began a wave: `{rollout, wave, reason}`.
    pub const ROLLOUT_WAVE: &str = "rollout.wave-started";
    /// A node was handed back to its scheduler after it was ready again (or its
    /// scheduler refused: the reason says so).
    pub const ROLLOUT_NODE_RESUMED: &str = "rollout.node-resumed";
    /// A `[health]` rule's verdict on a node: `HealthVerdict` (rule, action, subject,
    /// summary, readings).
    pub const HEALTH_VERDICT: &str = "health.verdict";
    /// A node quarantined by a health rule needs hands on the hardware: the verdict with
    /// its evidence, for the ticketing system (webhooks deliver it like every event).
    pub const HEALTH_TICKET: &str = "health.ticket";
    /// A health rule's revalidation of a node with a workload scheduler, drained first:
    /// `HealthDrainData` (drain asked, revalidating once drained, handed back once ready,
    /// or why not).
    pub const HEALTH_DRAIN: &str = "health.drain";
    /// A node's TPM endorsement key was enrolled at its first TPM challenge:
    /// `TpmEnrolledData`.
    pub const TPM_ENROLLED: &str = "tpm.enrolled";
    /// A node's TPM enrolment was removed by an operator (its next boot enrols again, or
    /// needs a registration): `{ek_name}`.
    pub const TPM_FORGOTTEN: &str = "tpm.forgotten";
    /// An API token was created: `{name, role}` (never its secret).
    pub const TOKEN_CREATED: &str = "token.created";
    /// An API token was revoked: `{name, role}`.
    pub const TOKEN_REVOKED: &str = "token.revoked";
    /// A node was assigned an image: `{image}` (the reference as given).
    pub const NODE_ASSIGNED: &str = "node.assigned";
    /// A node was asked to validate again at its next heartbeat: `{}`.
    pub const REVALIDATE_REQUESTED: &str = "node.revalidate-requested";
    /// A node's labels were changed: `{labels}` (all of them, after the change).
    pub const NODE_LABELLED: &str = "node.labelled";
    /// An image was published (a bundle, an import): `ImageEventData`.
    pub const IMAGE_PUBLISHED: &str = "image.published";
    /// An image was removed, with its boots: `ImageEventData`.
    pub const IMAGE_REMOVED: &str = "image.removed";
    /// Blobs no image needs were collected: `BlobsCollectedData`.
    pub const BLOBS_COLLECTED: &str = "blobs.collected";
    /// A machine registered by its BMC alone was unregistered: `{id}`.
    pub const BMC_UNREGISTERED: &str = "bmc.unregistered";
    /// A rollout changed state: `rollout.` and the state (`rollout.paused`,
    /// `rollout.halted`, `rollout.finished`, ...), from `rollout_state`.
    pub fn rollout_state(state: crate::rollout::RolloutState) -> String {
        format!("rollout.{state}")
    }
    /// A node of a rollout changed status: `rollout.node-` and the status
    /// (`rollout.node-draining`, `rollout.node-done`, `rollout.node-failed`, ...).
    pub fn rollout_node(status: crate::rollout::StepStatus) -> String {
        format!("rollout.node-{status}")
    }
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub seq: i64,
    pub at: String,
    pub kind: String,
    /// The node concerned; for a refused report, the node the caller claimed to be.
    pub node: Option<Mac>,
    pub data: serde_json::Value,
    /// Who caused it: the name of the API token of the request (`admin` for the
    /// first-start token); absent for what the server did on its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
}

/// `GET /api/v1/events`: a page after a cursor.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventPage {
    pub events: Vec<Event>,
    /// The cursor for the next page: the last seq returned, or `since` when none was.
    pub next: i64,
}

/// `data` of a `node.state` event.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStateData {
    pub from: Option<crate::NodeState>,
    pub to: crate::NodeState,
    pub reason: String,
}

/// `data` of `token.created` and `token.revoked` events.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenEventData {
    pub name: String,
    pub role: crate::token::Role,
}

/// `data` of `image.published` and `image.removed` events.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageEventData {
    pub image: crate::Digest,
    pub name: String,
    pub version: String,
}

/// `data` of a `blobs.collected` event.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlobsCollectedData {
    /// How many blobs were removed from the server's data directory.
    pub removed: usize,
    pub bytes_freed: u64,
    /// How many objects were removed from the shared object store (`[blobs]`).
    #[serde(default)]
    pub objects_removed: usize,
    #[serde(default)]
    pub object_bytes_freed: u64,
}

/// `data` of a `health.drain` event.
/// `tpm.enrolled`: the EK a node's TPM attests with from now on.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TpmEnrolledData {
    /// The EK's TPM Name (hex): nameAlg ‖ SHA-256 of its public area.
    pub ek_name: String,
    /// Its certificate chained to a configured EK CA (false: trusted on first use).
    pub certified: bool,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthDrainData {
    /// `queued` (waiting its turn), `asked` (the scheduler was asked to drain the node),
    /// `dropped` (it moved before its turn: nothing drained), `revalidating` (drained: the
    /// node validates at its next heartbeat), `resumed` (ready again: handed back),
    /// `left-drained` (it did not come back ready: left out of the scheduler for a
    /// look), `timed-out` (not drained within `[drain] timeout_secs`; handed back
    /// unvalidated, as `on_timeout = "skip"` says).
    pub step: String,
    pub reason: String,
}

/// `data` of a `bmc.unregistered` event.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BmcUnregisteredData {
    pub id: i64,
}

/// `data` of a `node.assigned` event.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeAssignedData {
    /// The image reference as the admin gave it.
    pub image: String,
}

/// `data` of a `node.labelled` event.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeLabelledData {
    /// Every label the node has after the change.
    pub labels: std::collections::BTreeMap<String, String>,
}

/// `data` of a `report.refused` event.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportRefusedData {
    /// `attest`, `validate` or `heartbeat`.
    pub route: String,
    /// The boot id the caller claimed (cut to 64 characters).
    pub boot: String,
    pub reason: String,
}

/// `data` of a `reimage.refused` event.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReimageRefusedData {
    /// Why the disruption budget refused it.
    pub reason: String,
    /// The request's own reason.
    pub request: String,
}

/// `data` of a `node.removed` event.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRemovedData {
    /// The state it was in.
    pub state: crate::NodeState,
    pub reason: String,
}

/// `data` of a `node.power` event.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PowerData {
    /// `on`, `off`, `soft-off`, `cycle`.
    pub action: String,
    pub reason: String,
    /// `ok`, or the BMC's error.
    pub outcome: String,
    pub took_ms: i64,
}

/// `data` of a `node.bmc` event: the BMC as set, or None when it was removed.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BmcSetData {
    pub bmc: Option<crate::power::Bmc>,
}

/// `data` of an `image.broken` event.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageBrokenData {
    pub image: crate::Digest,
    pub name: String,
    pub version: String,
    pub blob: crate::Digest,
    pub reason: String,
}

/// The body of one webhook delivery (signed; see the server's `webhook` module).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WebhookDelivery {
    pub events: Vec<Event>,
}
