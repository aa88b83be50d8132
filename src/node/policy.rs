//! Lifecycle policy, pure: when a silent node counts as unreachable, and what drift does
//! to a node, by its labels.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::node::state::NodeState;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DriftAction {
    /// Mark the node drifted, with the differences; a human or controller decides.
    Flag,
    /// Mark it drifted and request a reimage (within the disruption budget; over budget
    /// it stays drifted and the next heartbeat tries again).
    Reimage,
}

/// `[lifecycle]` in the settings file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LifecyclePolicy {
    /// A node that should heartbeat and was silent this long is unreachable [default: 90].
    pub heartbeat_timeout_secs: u64,
    /// A node that got its boot script and did not attest within this long (a kernel
    /// panic, a hung initramfs) is unreachable [default: 600].
    pub boot_timeout_secs: u64,
    /// What drift does unless a label rule says otherwise [default: flag].
    pub drift: DriftAction,
    /// Per-group rules, `"key=value" = "flag" | "reimage"`; the first match in key order wins.
    pub drift_by_label: BTreeMap<String, DriftAction>,
}

impl Default for LifecyclePolicy {
    fn default() -> Self {
        Self {
            heartbeat_timeout_secs: 90,
            boot_timeout_secs: 600,
            drift: DriftAction::Flag,
            drift_by_label: BTreeMap::new(),
        }
    }
}

impl LifecyclePolicy {
    /// Rules that are not `key=value` are a settings error, found at start.
    pub fn check(&self) -> Result<(), String> {
        for rule in self.drift_by_label.keys() {
            match rule.split_once('=') {
                Some((k, v)) if !k.is_empty() && !v.is_empty() => {}
                _ => {
                    return Err(format!(
                        "[lifecycle.drift_by_label] {rule:?} is not key=value"
                    ));
                }
            }
        }
        if self.heartbeat_timeout_secs == 0 || self.boot_timeout_secs == 0 {
            return Err("[lifecycle] timeouts must be > 0".into());
        }
        Ok(())
    }

    pub fn drift_action(&self, labels: &BTreeMap<String, String>) -> DriftAction {
        self.drift_by_label
            .iter()
            .find(|(rule, _)| {
                rule.split_once('=')
                    .is_some_and(|(k, v)| labels.get(k).is_some_and(|have| have == v))
            })
            .map_or(self.drift, |(_, action)| *action)
    }
}

impl LifecyclePolicy {
    /// How long a node in `state` may stay silent; None when it owes us nothing (not yet
    /// booted by us, already unreachable, or held in quarantine).
    pub fn silence_allowed_ms(&self, state: NodeState) -> Option<i64> {
        use NodeState::*;
        match state {
            // In firmware or its kernel: the agent's attestation is the next thing we hear.
            Provisioning => Some(self.boot_timeout_secs as i64 * 1000),
            Booted | Validating | Ready | Reimaging | AttestationFailed | ValidationFailed
            | Drifted => Some(self.heartbeat_timeout_secs as i64 * 1000),
            Discovered | Unreachable | Quarantined => None,
        }
    }

    /// Whether a node last heard from (or last changed state) at `last_seen_ms` is overdue.
    pub fn is_overdue(&self, state: NodeState, last_seen_ms: i64, now_ms: i64) -> bool {
        self.silence_allowed_ms(state)
            .is_some_and(|allowed| now_ms - last_seen_ms > allowed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_action_follows_the_first_matching_label_rule() {
        let policy = LifecyclePolicy {
            drift_by_label: BTreeMap::from([
                ("pool=batch".to_string(), DriftAction::Reimage),
                ("rack=r9".to_string(), DriftAction::Flag),
            ]),
            ..Default::default()
        };
        policy.check().unwrap();
        let labels = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        assert_eq!(policy.drift_action(&labels(&[])), DriftAction::Flag);
        assert_eq!(
            policy.drift_action(&labels(&[("pool", "batch")])),
            DriftAction::Reimage
        );
        assert_eq!(
            policy.drift_action(&labels(&[("pool", "training")])),
            DriftAction::Flag
        );
        let bad = LifecyclePolicy {
            drift_by_label: BTreeMap::from([("pool".to_string(), DriftAction::Reimage)]),
            ..Default::default()
        };
        assert!(bad.check().unwrap_err().contains("key=value"));
    }

    #[test]
    fn silence_is_judged_by_state() {
        let p = LifecyclePolicy::default();
        assert!(p.is_overdue(NodeState::Ready, 0, 90_001));
        assert!(!p.is_overdue(NodeState::Ready, 0, 90_000));
        assert!(p.is_overdue(NodeState::Reimaging, 0, 100_000));
        assert!(!p.is_overdue(NodeState::Provisioning, 0, 100_000));
        assert!(p.is_overdue(NodeState::Provisioning, 0, 600_001));
        for quiet in [
            NodeState::Discovered,
            NodeState::Quarantined,
            NodeState::Unreachable,
        ] {
            assert!(!p.is_overdue(quiet, 0, i64::MAX / 2), "{quiet}");
        }
    }
}
