//! `[health]`: the rules that judge nodes' readings over time, each with the label group
//! it applies to and the action its verdict asks for.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// What a verdict asks the node service to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// An event (`health.flagged`) and nothing else.
    Flag,
    /// Mark a ready node `degraded`: it keeps running, but is not `ready` (schedulers and
    /// fleet controllers keep large jobs off it) until a revalidation passes.
    Degrade,
    /// Validate the node again (the next heartbeat's answer); a failed validation then
    /// follows the failure policy.
    Revalidate,
    /// Reimage the node, within the disruption budget.
    Reimage,
    /// Quarantine the node and open a hardware ticket: a `health.ticket` event with the
    /// evidence, delivered by the webhooks like every event.
    Quarantine,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Flag => "flag",
            Action::Degrade => "degrade",
            Action::Revalidate => "revalidate",
            Action::Reimage => "reimage",
            Action::Quarantine => "quarantine",
        }
    }
}

/// What a rule watches for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Condition {
    /// A GPU held down by one of `reasons` for `for_secs` without a break.
    Throttled {
        for_secs: u64,
        #[serde(default = "thermal_reasons")]
        reasons: Vec<String>,
    },
    /// A GPU's corrected ECC errors (volatile) rising faster than `per_hour`, over the
    /// last `over_secs`.
    EccCorrectedRate {
        per_hour: f64,
        #[serde(default = "an_hour")]
        over_secs: u64,
    },
    /// Any new XID with one of `codes` (fatal ones by default).
    Xid {
        #[serde(default = "fatal_xids")]
        codes: Vec<u32>,
    },
    /// An InfiniBand port's link going down `count` times or more within `over_secs`.
    IbLinkDown {
        count: u64,
        #[serde(default = "an_hour")]
        over_secs: u64,
    },
    /// A GPU seen earlier in this boot is no longer reported.
    GpuMissing,
    /// A reading (temperature, power, ecc, sm_clock, pcie_replay, throttle_reasons; a
    /// port's state, rate, link_downed...) missing for `for_secs` without a break.
    ReadingMissing { for_secs: u64 },
}

fn thermal_reasons() -> Vec<String> {
    ["HW_THERMAL_SLOWDOWN", "SW_THERMAL_SLOWDOWN"]
        .map(String::from)
        .to_vec()
}

fn an_hour() -> u64 {
    3600
}

/// XIDs that mean the GPU needs a human: 48 (double-bit ECC), 62/63/64 (internal and
/// row-remapping faults), 74 (NVLink), 79 (fallen off the bus), 92 (high single-bit ECC
/// rate), 94/95 (contained/uncontained ECC), 119/120 (GSP).
fn fatal_xids() -> Vec<u32> {
    vec![48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120]
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Named in every verdict and event.
    pub name: String,
    pub when: Condition,
    pub action: Action,
    /// The label group the rule applies to: every `key = value` must hold. Empty: all.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

impl Rule {
    /// A rule for every node (no label group).
    pub fn new(name: &str, when: Condition, action: Action) -> Self {
        Rule {
            name: name.into(),
            when,
            action,
            labels: BTreeMap::new(),
        }
    }

    pub fn applies_to(&self, labels: &BTreeMap<String, String>) -> bool {
        self.labels.iter().all(|(k, v)| labels.get(k) == Some(v))
    }

    /// The longest span of readings the rule looks back over.
    pub fn window_secs(&self) -> u64 {
        match &self.when {
            Condition::Throttled { for_secs, .. } | Condition::ReadingMissing { for_secs } => {
                *for_secs
            }
            Condition::EccCorrectedRate { over_secs, .. }
            | Condition::IbLinkDown { over_secs, .. } => *over_secs,
            Condition::Xid { .. } | Condition::GpuMissing => 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthSettings {
    /// The rules, in order; a node's verdicts follow it. Empty: nothing is judged.
    pub rules: Vec<Rule>,
    /// Heartbeats of readings kept per node for `node show` and the API.
    pub keep_readings: usize,
    /// `[health.grey]`: performance figures against the node's peers'.
    pub grey: super::peers::GreySettings,
}

impl Default for HealthSettings {
    /// What a GPU fleet wants without writing a rule: fatal XIDs and lost GPUs
    /// quarantine; corrected ECC climbing and flapping links revalidate; long thermal
    /// throttling and missing readings are flagged.
    fn default() -> Self {
        let rule = Rule::new;
        HealthSettings {
            rules: vec![
                rule(
                    "fatal-xid",
                    Condition::Xid {
                        codes: fatal_xids(),
                    },
                    Action::Quarantine,
                ),
                rule("gpu-missing", Condition::GpuMissing, Action::Quarantine),
                rule(
                    "ecc-corrected-rising",
                    Condition::EccCorrectedRate {
                        per_hour: 100.0,
                        over_secs: 3600,
                    },
                    Action::Revalidate,
                ),
                rule(
                    "ib-link-flapping",
                    Condition::IbLinkDown {
                        count: 5,
                        over_secs: 3600,
                    },
                    Action::Revalidate,
                ),
                rule(
                    "thermal-throttling",
                    Condition::Throttled {
                        for_secs: 600,
                        reasons: thermal_reasons(),
                    },
                    Action::Flag,
                ),
                rule(
                    "readings-missing",
                    Condition::ReadingMissing { for_secs: 600 },
                    Action::Flag,
                ),
            ],
            keep_readings: 6,
            grey: Default::default(),
        }
    }
}

impl HealthSettings {
    pub fn check(&self) -> Result<(), String> {
        let mut names = std::collections::BTreeSet::new();
        for r in &self.rules {
            if r.name.is_empty() || r.name.len() > 64 {
                return Err(format!("[health] rule name {:?}: 1-64 characters", r.name));
            }
            if !names.insert(&r.name) {
                return Err(format!("[health] rule {:?} is named twice", r.name));
            }
            let bad = match &r.when {
                Condition::Throttled { for_secs: 0, .. }
                | Condition::ReadingMissing { for_secs: 0 } => Some("for_secs must be > 0"),
                Condition::EccCorrectedRate {
                    per_hour,
                    over_secs,
                } => (!(per_hour.is_finite() && *per_hour > 0.0) || *over_secs == 0)
                    .then_some("per_hour and over_secs must be > 0"),
                Condition::IbLinkDown { count, over_secs } => {
                    (*count == 0 || *over_secs == 0).then_some("count and over_secs must be > 0")
                }
                _ => None,
            };
            if let Some(why) = bad {
                return Err(format!("[health] rule {:?}: {why}", r.name));
            }
        }
        self.grey.check()?;
        if self.keep_readings > 360 {
            return Err("[health] keep_readings: at most 360".into());
        }
        Ok(())
    }
}
