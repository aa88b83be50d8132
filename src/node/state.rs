//! The node lifecycle as data: states, the events that move a node, and the explicit table
//! of allowed transitions. Pure: no I/O, no clock; the controller persists. The states
//! themselves are part of the wire contract (`api::NodeState`).
//!
//! Every event names its target state, so a transition is "look up the target, check the
//! edge is in the table": there is no per-state branching to drift out of sync with the
//! diagram in ARCHITECTURE.md, which a test compares with `ALLOWED`.

use serde::{Deserialize, Serialize};

use crate::api::NodeState;

/// What happened to a node. Each event has exactly one target state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeEvent {
    BootStarted,
    Attested {
        passed: bool,
    },
    ValidationStarted,
    Validated {
        passed: bool,
    },
    DriftDetected,
    ReimageRequested,
    HeartbeatLost,
    QuarantineImposed,
    /// A health verdict whose action is `degrade`.
    DegradationFound,
}

impl NodeEvent {
    pub fn target(self) -> NodeState {
        use NodeState::*;
        match self {
            NodeEvent::BootStarted => Provisioning,
            NodeEvent::Attested { passed: true } => Booted,
            NodeEvent::Attested { passed: false } => AttestationFailed,
            NodeEvent::ValidationStarted => Validating,
            NodeEvent::Validated { passed: true } => Ready,
            NodeEvent::Validated { passed: false } => ValidationFailed,
            NodeEvent::DriftDetected => Drifted,
            NodeEvent::ReimageRequested => Reimaging,
            NodeEvent::HeartbeatLost => Unreachable,
            NodeEvent::QuarantineImposed => Quarantined,
            NodeEvent::DegradationFound => Degraded,
        }
    }
}

use NodeState::*;

/// Every allowed edge. A stateless node may reboot at any time, so every state but
/// quarantine may start a boot; quarantine is left only by an admin's reimage request.
pub const ALLOWED: &[(NodeState, NodeState)] = &[
    (Discovered, Provisioning),
    (Discovered, Reimaging),
    (Provisioning, Provisioning),
    (Provisioning, Booted),
    (Provisioning, AttestationFailed),
    (Provisioning, Reimaging),
    (Provisioning, Unreachable),
    (Booted, Provisioning),
    (Booted, Validating),
    (Booted, Reimaging),
    (Booted, Unreachable),
    // A health rule's verdict (a fatal XID, a GPU gone) needs hands on the hardware.
    (Booted, Quarantined),
    (Validating, Provisioning),
    (Validating, Ready),
    (Validating, ValidationFailed),
    (Validating, Reimaging),
    (Validating, Unreachable),
    (Validating, Quarantined),
    (Ready, Provisioning),
    (Ready, Validating),
    (Ready, Drifted),
    (Ready, Reimaging),
    (Ready, Unreachable),
    (Ready, Quarantined),
    // Still running, held back by a health verdict; a passed revalidation ends it.
    (Ready, Degraded),
    (Degraded, Provisioning),
    (Degraded, Validating),
    (Degraded, Drifted),
    (Degraded, Reimaging),
    (Degraded, Unreachable),
    (Degraded, Quarantined),
    (Reimaging, Provisioning),
    (Reimaging, Unreachable),
    (Reimaging, Quarantined),
    (AttestationFailed, Provisioning),
    (AttestationFailed, Reimaging),
    (AttestationFailed, Unreachable),
    (AttestationFailed, Quarantined),
    (ValidationFailed, Provisioning),
    (ValidationFailed, Validating),
    (ValidationFailed, Reimaging),
    (ValidationFailed, Unreachable),
    (ValidationFailed, Quarantined),
    (Drifted, Provisioning),
    (Drifted, Reimaging),
    (Drifted, Unreachable),
    (Drifted, Quarantined),
    (Unreachable, Provisioning),
    (Unreachable, Validating),
    (Unreachable, Reimaging),
    (Unreachable, Quarantined),
    (Quarantined, Reimaging),
];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a node that is {from} cannot become {to} ({event:?})")]
pub struct TransitionError {
    pub from: NodeState,
    pub to: NodeState,
    pub event: NodeEvent,
}

/// The state after `event`, or why the event is not allowed now.
pub fn transition(from: NodeState, event: NodeEvent) -> Result<NodeState, TransitionError> {
    let to = event.target();
    if ALLOWED.contains(&(from, to)) {
        Ok(to)
    } else {
        Err(TransitionError { from, to, event })
    }
}

/// Whether a node may be removed without `force`: it runs no boot we track (it never
/// booted, stopped answering, failed, or is quarantined). Removing a node mid-boot or
/// ready would orphan a running machine's agent calls.
pub fn removable(state: NodeState) -> bool {
    matches!(
        state,
        NodeState::Discovered
            | NodeState::Unreachable
            | NodeState::AttestationFailed
            | NodeState::ValidationFailed
            | NodeState::Quarantined
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(from: NodeState, event: NodeEvent, expected: Option<NodeState>) {
        assert_eq!(transition(from, event).ok(), expected, "{from} + {event:?}");
    }

    #[test]
    fn the_happy_path_and_the_failures() {
        check(Discovered, NodeEvent::BootStarted, Some(Provisioning));
        check(
            Provisioning,
            NodeEvent::Attested { passed: true },
            Some(Booted),
        );
        check(Booted, NodeEvent::ValidationStarted, Some(Validating));
        check(
            Validating,
            NodeEvent::Validated { passed: true },
            Some(Ready),
        );
        check(Ready, NodeEvent::DriftDetected, Some(Drifted));
        check(Drifted, NodeEvent::ReimageRequested, Some(Reimaging));
        check(Reimaging, NodeEvent::BootStarted, Some(Provisioning));
        check(
            Provisioning,
            NodeEvent::Attested { passed: false },
            Some(AttestationFailed),
        );
        check(
            Validating,
            NodeEvent::Validated { passed: false },
            Some(ValidationFailed),
        );
        check(
            ValidationFailed,
            NodeEvent::QuarantineImposed,
            Some(Quarantined),
        );
    }

    #[test]
    fn nothing_skips_attestation_or_validation() {
        // Node Ready is not GPU Ready: no path to ready but through validation.
        for from in NodeState::ALL {
            let to_ready = transition(from, NodeEvent::Validated { passed: true });
            assert_eq!(to_ready.is_ok(), from == Validating, "{from} -> ready");
            let to_booted = transition(from, NodeEvent::Attested { passed: true });
            assert_eq!(to_booted.is_ok(), from == Provisioning, "{from} -> booted");
        }
        check(Discovered, NodeEvent::ValidationStarted, None);
        check(Provisioning, NodeEvent::ValidationStarted, None);
    }

    #[test]
    fn degraded_is_entered_from_ready_and_left_to_ready_only_through_validation() {
        for from in NodeState::ALL {
            let to = transition(from, NodeEvent::DegradationFound);
            assert_eq!(to.is_ok(), from == Ready, "{from} -> degraded");
        }
        check(Degraded, NodeEvent::Validated { passed: true }, None);
        check(Degraded, NodeEvent::ValidationStarted, Some(Validating));
        check(Degraded, NodeEvent::DriftDetected, Some(Drifted));
        check(Degraded, NodeEvent::BootStarted, Some(Provisioning));
        check(Degraded, NodeEvent::QuarantineImposed, Some(Quarantined));
    }

    #[test]
    fn quarantine_is_left_only_by_a_reimage_request() {
        for event in [
            NodeEvent::BootStarted,
            NodeEvent::Attested { passed: true },
            NodeEvent::ValidationStarted,
            NodeEvent::Validated { passed: true },
            NodeEvent::DriftDetected,
            NodeEvent::HeartbeatLost,
        ] {
            check(Quarantined, event, None);
        }
        check(Quarantined, NodeEvent::ReimageRequested, Some(Reimaging));
    }

    #[test]
    fn table_has_no_duplicates() {
        let mut edges = ALLOWED.to_vec();
        edges.sort();
        edges.dedup();
        assert_eq!(edges.len(), ALLOWED.len());
    }
}
