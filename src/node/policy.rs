//! Lifecycle policy, pure: when a silent node counts as unreachable, and what drift does
//! to a node, by its labels.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::api::NodeState;

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
    /// A node that should heartbeat and was silent this long is unreachable (noticed within
    /// a sixth more: heartbeats are stored in batches, `liveness_flush_ms`) [default: 90].
    pub heartbeat_timeout_secs: u64,
    /// A node that got its boot script and did not attest within this long (a kernel
    /// panic, a hung initramfs) is unreachable [default: 600].
    pub boot_timeout_secs: u64,
    /// What drift does unless a label rule says otherwise [default: flag].
    pub drift: DriftAction,
    /// Per-group rules, `"key=value" = "flag" | "reimage"`; the first match in key order wins.
    pub drift_by_label: BTreeMap<String, DriftAction>,
    /// A node that fails validation is reimaged up to this many times (counted since it
    /// was last ready), then quarantined for a human or a hardware ticket [default: 2].
    pub validation_reimages: u32,
    /// Per-group counts, `"key=value" = K`; the first match in key order wins.
    pub validation_reimages_by_label: BTreeMap<String, u32>,
}

impl Default for LifecyclePolicy {
    fn default() -> Self {
        Self {
            heartbeat_timeout_secs: 90,
            boot_timeout_secs: 600,
            drift: DriftAction::Flag,
            drift_by_label: BTreeMap::new(),
            validation_reimages: 2,
            validation_reimages_by_label: BTreeMap::new(),
        }
    }
}

impl LifecyclePolicy {
    /// Rules that are not `key=value` are a settings error, found at start.
    pub fn check(&self) -> Result<(), String> {
        for rule in self
            .drift_by_label
            .keys()
            .chain(self.validation_reimages_by_label.keys())
        {
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
        first_match(&self.drift_by_label, labels).unwrap_or(self.drift)
    }

    /// What a failed validation does: reimage (attempt n of K) or quarantine.
    pub fn after_failed_validation(
        &self,
        labels: &BTreeMap<String, String>,
        failures_since_ready: u32,
    ) -> FailureAction {
        let allowed = first_match(&self.validation_reimages_by_label, labels)
            .unwrap_or(self.validation_reimages);
        if failures_since_ready <= allowed {
            FailureAction::Reimage {
                attempt: failures_since_ready,
                of: allowed,
            }
        } else {
            FailureAction::Quarantine
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureAction {
    Reimage { attempt: u32, of: u32 },
    Quarantine,
}

/// The value of the first `key=value` rule (in key order) that `labels` match.
fn first_match<T: Copy>(
    rules: &BTreeMap<String, T>,
    labels: &BTreeMap<String, String>,
) -> Option<T> {
    rules
        .iter()
        .find(|(rule, _)| {
            rule.split_once('=')
                .is_some_and(|(k, v)| labels.get(k).is_some_and(|have| have == v))
        })
        .map(|(_, value)| *value)
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
            | Drifted | Degraded => Some(self.heartbeat_timeout_secs as i64 * 1000),
            Discovered | Unreachable | Quarantined => None,
        }
    }

    /// How often each server stores when it last heard its nodes (`node::liveness`): a
    /// sixth of the heartbeat timeout, between 100 ms and 15 s.
    pub fn liveness_flush_ms(&self) -> i64 {
        (self.heartbeat_timeout_secs as i64 * 1000 / 6).clamp(100, 15_000)
    }

    /// Whether a node last heard from (or last changed state) at `last_seen_ms`, as
    /// stored, is overdue. A heartbeat is stored up to `liveness_flush_ms` after it came,
    /// so that much more is allowed to nodes that heartbeat.
    pub fn is_overdue(&self, state: NodeState, last_seen_ms: i64, now_ms: i64) -> bool {
        let unstored = match state {
            NodeState::Provisioning => 0,
            _ => self.liveness_flush_ms(),
        };
        self.silence_allowed_ms(state)
            .is_some_and(|allowed| now_ms - last_seen_ms > allowed + unstored)
    }
}

/// `[discovery]` in the settings file: what unknown MACs may add.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryPolicy {
    /// New MACs (from DHCP or boot requests) are not recorded while this many nodes are
    /// discovered and not yet assigned an image; admins' `assign` always records
    /// [default: 20000].
    pub max_unassigned: u64,
}

impl Default for DiscoveryPolicy {
    fn default() -> Self {
        Self {
            max_unassigned: 20_000,
        }
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
    fn failed_validation_reimages_k_times_then_quarantines() {
        let policy = LifecyclePolicy {
            validation_reimages_by_label: BTreeMap::from([("sku=h200".to_string(), 0)]),
            ..Default::default()
        };
        let none = BTreeMap::new();
        assert_eq!(
            policy.after_failed_validation(&none, 1),
            FailureAction::Reimage { attempt: 1, of: 2 }
        );
        assert_eq!(
            policy.after_failed_validation(&none, 2),
            FailureAction::Reimage { attempt: 2, of: 2 }
        );
        assert_eq!(
            policy.after_failed_validation(&none, 3),
            FailureAction::Quarantine
        );
        let h200 = BTreeMap::from([("sku".to_string(), "h200".to_string())]);
        assert_eq!(
            policy.after_failed_validation(&h200, 1),
            FailureAction::Quarantine
        );
    }

    #[test]
    fn silence_is_judged_by_state() {
        let p = LifecyclePolicy::default();
        // 90 s, and 15 s for a heartbeat not yet stored.
        assert_eq!(p.liveness_flush_ms(), 15_000);
        assert!(p.is_overdue(NodeState::Ready, 0, 105_001));
        assert!(!p.is_overdue(NodeState::Ready, 0, 105_000));
        assert!(p.is_overdue(NodeState::Reimaging, 0, 110_000));
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
