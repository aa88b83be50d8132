//! Rollouts as the API speaks them: what starts one, what one is (per wave and per node),
//! and the admin actions on it. The waves, the gates and the states' meaning are the
//! server's (`rollout/`).

use serde::{Deserialize, Serialize};

use crate::{Digest, Mac};

/// Writes an enum whose every variant has one kebab-case name on the wire and in the
/// store, with `as_str`, `parse` and `ALL`.
macro_rules! named {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name { $($(#[$vm])* #[serde(rename = $s)] $v),+ }
        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$v),+];
            pub fn as_str(self) -> &'static str {
                match self { $($name::$v => $s),+ }
            }
            pub fn parse(s: &str) -> Option<Self> {
                match s { $($s => Some($name::$v),)+ _ => None }
            }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
        // By hand: the derive cannot read a `rename` that a macro passes it, and would
        // document the variants' Rust names.
        #[cfg(feature = "openapi")]
        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                crate::schema::names(Self::ALL.iter().map(|v| v.as_str()))
            }
        }
        #[cfg(feature = "openapi")]
        impl utoipa::ToSchema for $name {}
    };
}

named! {
    /// Where a rollout stands.
    RolloutState {
        /// Moving nodes, wave by wave.
        Running = "running",
        /// Stopped by an admin or after the canary wave; `resume` goes on.
        Paused = "paused",
        /// Past `max_failures`: nothing new starts; `rollback` or `abort`.
        Halted = "halted",
        /// Reimaging nodes back onto the digest each had before.
        RollingBack = "rolling-back",
        /// Every node is on the new digest (or failed within `max_failures`).
        Finished = "finished",
        /// Stopped by an admin: nodes stay where they are.
        Aborted = "aborted",
        /// Every node rolled back is on its old digest again (or failed to get there).
        RolledBack = "rolled-back",
    }
}

impl RolloutState {
    /// A rollout that still holds its nodes: no other rollout may take them.
    pub fn holds_nodes(self) -> bool {
        !matches!(self, Self::Finished | Self::Aborted | Self::RolledBack)
    }
}

named! {
    /// Where one node of a rollout stands.
    StepStatus {
        /// Not started.
        Pending = "pending",
        /// Asked its workload scheduler to drain; waiting until it has.
        Draining = "draining",
        /// Reimaging onto the rollout's digest; done once ready on it.
        Reimaging = "reimaging",
        /// Ready (attested and validated) on the rollout's digest.
        Done = "done",
        /// Not ready on the digest within the timeout, failed, or its drain failed.
        Failed = "failed",
        /// Its drain did not finish within the drain timeout and the policy skips it.
        Skipped = "skipped",
        /// To be reimaged back onto its previous digest.
        RollbackPending = "rollback-pending",
        /// Asked of its scheduler to drain before it is reimaged back.
        RollbackDraining = "rollback-draining",
        /// Reimaging back onto its previous digest.
        RollingBack = "rolling-back",
        /// Ready on its previous digest again.
        RolledBack = "rolled-back",
        /// Not ready on its previous digest within the timeout.
        RollbackFailed = "rollback-failed",
    }
}

impl StepStatus {
    /// Out of service for the rollout's sake now: counts against `max_unavailable`.
    pub fn in_flight(self) -> bool {
        matches!(
            self,
            Self::Draining | Self::Reimaging | Self::RollbackDraining | Self::RollingBack
        )
    }
    /// Nothing more will happen to it in the forward direction.
    pub fn settled(self) -> bool {
        !matches!(self, Self::Pending | Self::Draining | Self::Reimaging)
    }
}

named! {
    /// What a rollout does when its failures pass `max_failures`.
    OnFailure {
        /// Stop; the failed nodes stay where they are for a human.
        Halt = "halt",
        /// Stop, and reimage the failed nodes back onto the digest each had before.
        Rollback = "rollback",
    }
}

/// `POST /api/v1/rollouts`: what to roll out, to which nodes, how fast, and when to stop.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutRequest {
    /// The image REF (digest, name:version or name:tag), resolved once at start.
    pub image: String,
    /// The nodes: a label selector (`rack=r12,sku=hgx-h100`), matched once at start; or
    /// empty, with `nodes`.
    #[serde(default)]
    pub selector: String,
    /// The nodes by MAC instead of a selector.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<Mac>,
    /// Nodes in the first wave, the canaries.
    #[serde(default)]
    pub canary: u32,
    /// Nodes per later wave: a count (`10`) or a share of the selection (`10%`).
    #[serde(default = "default_wave")]
    pub wave: String,
    /// Nodes this rollout takes out of service at once (draining or reimaging).
    #[serde(default = "default_max_unavailable")]
    pub max_unavailable: u32,
    /// Pause once the canaries are done; `resume` goes on.
    #[serde(default)]
    pub pause_after_canary: bool,
    /// Seconds a node has from its reimage to ready on the new digest.
    #[serde(default = "default_timeout_secs")]
    pub timeout_secs: u64,
    /// Failed nodes tolerated; one more halts the rollout.
    #[serde(default)]
    pub max_failures: u32,
    #[serde(default = "default_on_failure")]
    pub on_failure: OnFailure,
    pub reason: String,
}

fn default_wave() -> String {
    "10%".into()
}
fn default_max_unavailable() -> u32 {
    1
}
fn default_timeout_secs() -> u64 {
    1200
}
fn default_on_failure() -> OnFailure {
    OnFailure::Halt
}

/// One node of a rollout.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutNode {
    pub mac: Mac,
    /// 0 is the canary wave (when there are canaries).
    pub wave: u32,
    pub status: StepStatus,
    /// What it was assigned before, and the digest it last booted: a rollback's target.
    pub previous_assigned: Option<String>,
    pub previous_digest: Option<Digest>,
    /// Why it failed, was skipped, or what it waits for.
    pub reason: String,
    pub started_at: Option<String>,
    pub finished_at: Option<String>,
}

/// One wave's progress: how many of its nodes are at each status.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaveProgress {
    pub wave: u32,
    pub canary: bool,
    pub nodes: u32,
    pub counts: std::collections::BTreeMap<String, u32>,
}

/// A rollout as `GET /api/v1/rollouts/{id}` answers.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rollout {
    pub id: i64,
    pub spec: RolloutRequest,
    /// The digest `spec.image` resolved to at start: what every node must come up on.
    pub digest: Digest,
    pub state: RolloutState,
    pub state_reason: String,
    /// The wave in progress.
    pub wave: u32,
    pub waves: Vec<WaveProgress>,
    pub nodes: Vec<RolloutNode>,
    pub created_at: String,
    pub updated_at: String,
}

/// A line of `GET /api/v1/rollouts`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutSummary {
    pub id: i64,
    pub image: String,
    pub digest: Digest,
    pub selector: String,
    pub state: RolloutState,
    pub state_reason: String,
    pub wave: u32,
    pub waves: u32,
    pub nodes: u32,
    pub done: u32,
    pub failed: u32,
    pub created_at: String,
}

/// `POST /api/v1/rollouts/{id}/{pause|resume|abort|rollback}`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutAction {
    pub reason: String,
}

/// `data` of every `rollout.*` event.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutEventData {
    pub rollout: i64,
    /// The wave concerned, when one is.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub wave: Option<u32>,
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_on_the_wire_and_in_parse() {
        for s in StepStatus::ALL {
            let json = serde_json::to_string(s).unwrap();
            assert_eq!(json, format!("\"{}\"", s.as_str()));
            assert_eq!(StepStatus::parse(s.as_str()), Some(*s));
        }
        for s in RolloutState::ALL {
            assert_eq!(RolloutState::parse(s.as_str()), Some(*s));
        }
        assert_eq!(RolloutState::parse("done"), None);
    }

    #[test]
    fn a_request_fills_its_defaults_and_refuses_unknown_fields() {
        let r: RolloutRequest =
            serde_json::from_str(r#"{"image":"a:1","selector":"rack=r1","reason":"x"}"#).unwrap();
        assert_eq!((r.wave.as_str(), r.max_unavailable), ("10%", 1));
        assert_eq!(r.on_failure, OnFailure::Halt);
        assert!(
            serde_json::from_str::<RolloutRequest>(
                r#"{"image":"a:1","selector":"","reason":"x","canaries":2}"#
            )
            .is_err()
        );
    }
}
