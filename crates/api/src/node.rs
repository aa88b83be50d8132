//! Nodes as the admin API shows them: the lifecycle states, a node, its state history and
//! boot timelines, and the admin requests that act on nodes (assign, label, reimage,
//! revalidate) with their answers. Which state may follow which is the server's rule
//! (`node::state`), not part of the contract.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{Digest, Mac};

/// Declares `NodeState` with each state's name written once: the variant, its wire and
/// database spelling, `ALL`, `as_str` and `parse` all come from this list.
macro_rules! node_states {
    ($( $(#[$doc:meta])* $variant:ident = $name:literal, )*) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum NodeState {
            $( $(#[$doc])* $variant, )*
        }

        impl NodeState {
            pub const ALL: [NodeState; [$($name),*].len()] = [$(NodeState::$variant),*];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(NodeState::$variant => $name,)*
                }
            }
        }
    };
}

node_states! {
    /// Seen on the network (DHCP/PXE), not yet booted by us.
    Discovered = "discovered",
    /// Booting: a boot script was served and a boot record opened.
    Provisioning = "provisioning",
    /// The agent attested: the node runs exactly the assigned image.
    Booted = "booted",
    /// Post-boot checks (GPUs, driver, compute) are running.
    Validating = "validating",
    /// Attested and validated: "GPU Ready", not just "Node Ready".
    Ready = "ready",
    /// Passed every check, yet a `[health]` verdict with the `degrade` action holds it back
    /// (slower than its peers, a GPU throttling): still running, not `ready`, so schedulers
    /// and fleet controllers keep large jobs off it. A passed revalidation makes it ready.
    Degraded = "degraded",
    /// A reimage was requested; the next heartbeat answers "reboot".
    Reimaging = "reimaging",
    AttestationFailed = "attestation-failed",
    ValidationFailed = "validation-failed",
    /// Was ready; now runs something other than what it attested or the image pins.
    Drifted = "drifted",
    /// Stopped heartbeating.
    Unreachable = "unreachable",
    /// Failed too often: needs a human or a hardware ticket.
    Quarantined = "quarantined",
}

impl NodeState {
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

impl fmt::Display for NodeState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `pad`, so that a width in the format (`{:<20}`) lines columns up.
        f.pad(self.as_str())
    }
}

impl Serialize for NodeState {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for NodeState {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).ok_or_else(|| serde::de::Error::custom(format!("unknown state {s:?}")))
    }
}

/// A node as listed and shown.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub mac: Mac,
    pub uuid: Option<String>,
    pub hostname: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// What the admin assigned (digest, name:version or name:tag), resolved at boot time.
    pub assigned: Option<String>,
    pub state: NodeState,
    pub state_reason: String,
    /// Bumped by every change to the node.
    pub version: i64,
    pub created_at: String,
    pub updated_at: String,
    /// How to reach the node's BMC, when it has one.
    pub bmc: Option<Bmc>,
}

/// `GET /api/v1/nodes` query: which nodes to list. Every part given must hold.
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeQuery {
    /// States, comma-separated (`ready,validation-failed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// The image REF exactly as assigned (`demo:stable`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// A label selector: `k=v`, `k!=v`, `k` (has the label), `!k` (has not), comma-separated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// Text the MAC, hostname or a label value contains (case-insensitive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q: Option<String>,
    /// A page of the matching nodes (by MAC): at most `limit`, after skipping `offset`.
    /// The answer's `X-Total-Count` header says how many match in all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<usize>,
}

/// `GET /api/v1/fleet`: the fleet at a glance, for the console's overview.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FleetSummary {
    pub nodes: u64,
    /// Every state with its count, zero included, in the state machine's order.
    pub by_state: Vec<Count>,
    /// By the image of each node's newest boot (`none`: never booted), largest first.
    pub by_image: Vec<Count>,
    /// By the value of each label key `[metrics] group_labels` names, as a selector:
    /// `key=value`, or `!key` for the nodes without the label.
    pub by_group: Vec<Count>,
    /// Nodes neither ready nor waiting for an image, most recently changed first (at
    /// most 50), with why.
    pub not_ready: Vec<Node>,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Count {
    pub name: String,
    pub count: u64,
}

pub use crate::power::Bmc;

/// One state change, with its reason.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateChange {
    pub from: Option<NodeState>,
    pub to: NodeState,
    pub reason: String,
    pub at: String,
    /// The API token whose request made the change; absent when the server (or the
    /// node's own reports) did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
}

/// `GET /api/v1/nodes/{mac}`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeDetail {
    #[serde(flatten)]
    pub node: Node,
    pub history: Vec<StateChange>,
    /// The last boots as timelines, newest first.
    pub boots: Vec<Timeline>,
    /// Power actions through the node's BMC, and what this server's DHCP and TFTP saw of
    /// the node, since its last boot script (a node stuck before its script shows how
    /// far it got); these open its next boot's timeline.
    #[serde(default)]
    pub preboot: Vec<Step>,
    /// The last power actions through the node's BMC, newest first.
    #[serde(default)]
    pub power: Vec<crate::power::PowerEntry>,
    /// The newest validation verdict among the last boots: each failing check, by GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<LastValidation>,
    /// The current boot's recent readings and the health verdicts that hold, as this
    /// server heard them (absent before its first heartbeat here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<crate::health::NodeHealth>,
}

/// A boot's validation verdict as the node page shows it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastValidation {
    pub boot_id: String,
    pub at: String,
    pub passed: bool,
    #[serde(default)]
    pub failures: Vec<crate::agent::Failure>,
    /// The UUIDs of the GPUs the report named.
    #[serde(default)]
    pub gpus: Vec<String>,
}

/// A boot as a timeline: what happened, when, and where it stopped.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timeline {
    pub id: String,
    pub image: Digest,
    pub at: String,
    pub steps: Vec<Step>,
    /// The first step that did not happen or did not pass; None for a boot that reached
    /// ready.
    pub stopped_at: Option<String>,
    /// What the boot's TPM evidence showed at attestation: the quoted PCRs, and what
    /// each measured boot application was matched to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<crate::agent::TpmFindings>,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// `dhcp offer`, `ipxe dhcp ack`, `tftp <file>` (before the script), `script`,
    /// `kernel`, `initrd <name>`, `attested`, `validated`.
    pub step: String,
    /// When the step ended.
    pub at: String,
    /// Time from the end of the previous step to the end of this one.
    pub took_ms: i64,
    /// `ok`, or what went wrong.
    pub outcome: String,
}

/// `PUT /api/v1/nodes/{mac}/image`: the REF the node boots (resolved at each boot).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssignRequest {
    pub image: String,
}

/// `PATCH /api/v1/nodes/{mac}/labels`: labels to set and to remove, in one write.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LabelRequest {
    #[serde(default)]
    pub set: BTreeMap<String, String>,
    #[serde(default)]
    pub remove: Vec<String>,
}

/// `POST /api/v1/nodes/{mac}/reimage` (an `Idempotency-Key` header is optional).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReimageRequest {
    pub reason: String,
    /// Also assign this REF first.
    #[serde(default)]
    pub image: Option<String>,
}

/// The answer to an accepted reimage request (202).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReimageAccepted {
    /// `accepted`, `already-reimaging` (nothing changed), or `draining`: the node has a
    /// workload scheduler, which drains it first; `rollout` carries it out.
    pub outcome: String,
    pub node: Node,
    /// The rollout that drains and reimages the node, when it waits for a drain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<i64>,
}

/// The answer to `POST /api/v1/nodes/{mac}/revalidate` (202).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RevalidateAccepted {
    /// `revalidate-requested` (its next heartbeat), or `draining` (a ready node with a
    /// workload scheduler: drained first, validated once drained, handed back once ready).
    pub outcome: String,
    pub node: Mac,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_round_trips_by_name() {
        for s in NodeState::ALL {
            assert_eq!(NodeState::parse(s.as_str()), Some(s));
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(json, format!("\"{s}\""));
            assert_eq!(serde_json::from_str::<NodeState>(&json).unwrap(), s);
        }
        assert_eq!(NodeState::AttestationFailed.as_str(), "attestation-failed");
        assert_eq!(format!("{:<8}|", NodeState::Ready), "ready   |");
        assert!(serde_json::from_str::<NodeState>("\"ready-ish\"").is_err());
    }
}

/// `PUT /api/v1/nodes/{mac}/tpm`: the endorsement key the node's TPM must present,
/// registered before its first boot (`[tpm] enrolment = "pre-registered"`) or replacing
/// the one enrolled (a new board). One of the two.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TpmEnrolRequest {
    /// The EK's TPM2B_PUBLIC, hex (`tpm2_createek -G rsa -u ek.pub -f tss`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ek_public: Option<String>,
    /// The EK's TPM Name, hex (`tpm2_readpublic`'s `name:`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ek_name: Option<String>,
}

/// The EK a node's TPM is enrolled with.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpmEnrolment {
    pub ek_name: String,
    /// Its certificate chained to a configured EK CA (false: first seen without one, or
    /// registered by an operator).
    pub certified: bool,
    pub enrolled_at: String,
}
