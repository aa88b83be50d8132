//! Grey failures: a node that passes every check but runs slow. Each node's newest
//! performance figures (from its validation) are compared with those of its peers (the
//! same image and the same value of `[health.grey] label`, a SKU): a figure far below the
//! group's median, by a robust measure (the median and the median absolute deviation, so
//! the slow nodes themselves do not drag the yardstick), is a verdict with the figures in
//! it. Pure but for its memory: one number per node and figure.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::rules::Action;
use super::track::Verdict;
use crate::api::Mac;
use crate::api::agent::Figure;
use crate::api::health::HealthVerdict;

/// The rule name grey-failure verdicts carry.
pub const RULE: &str = "grey-failure";

/// The most figures kept a node, and groups and nodes kept in all.
const MAX_FIGURES: usize = 16;
const MAX_NODES: usize = 200_000;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GreySettings {
    /// The label whose value makes peers (with the image); nodes without it are peers
    /// of each other.
    pub label: String,
    /// Nodes a group needs before anyone is judged.
    pub min_peers: usize,
    /// How far below the median, in robust standard deviations (1.4826 x MAD), is slow.
    pub max_deviations: f64,
    /// And at least this share below the median (0.15: 15%), so a tight group's noise
    /// is not a verdict.
    pub min_drop: f64,
    pub action: Action,
}

impl Default for GreySettings {
    fn default() -> Self {
        GreySettings {
            label: "sku".into(),
            min_peers: 10,
            max_deviations: 4.0,
            min_drop: 0.15,
            action: Action::Flag,
        }
    }
}

impl GreySettings {
    pub fn check(&self) -> Result<(), String> {
        let ok = self.min_peers >= 3
            && self.max_deviations.is_finite()
            && self.max_deviations > 0.0
            && (0.0..1.0).contains(&self.min_drop);
        ok.then_some(()).ok_or_else(|| {
            "[health.grey]: min_peers >= 3, max_deviations > 0, 0 <= min_drop < 1".into()
        })
    }
}

/// Peers: (image digest, label value).
type Group = (String, String);

#[derive(Default)]
struct Figures {
    /// By figure name, each node's newest value.
    values: BTreeMap<String, HashMap<Mac, f64>>,
    /// Nodes judged slow, by (node, figure): given once.
    slow: std::collections::HashSet<(Mac, String)>,
    /// The group size at the last judgement of everyone: everyone is judged again each
    /// time the group doubles, so early reporters meet their later peers.
    judged_all_at: usize,
}

impl Figures {
    /// Nodes in the group (those with the most-reported figure).
    fn size(&self) -> usize {
        self.values.values().map(HashMap::len).max().unwrap_or(0)
    }
}

pub struct Peers {
    settings: GreySettings,
    groups: Mutex<HashMap<Group, Figures>>,
}

/// The median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A figure's yardstick in a group: the median and the robust deviation.
fn yardstick(values: &HashMap<Mac, f64>) -> (f64, f64) {
    let mut v: Vec<f64> = values.values().copied().collect();
    let m = median(&mut v);
    let mut dev: Vec<f64> = v.iter().map(|x| (x - m).abs()).collect();
    (m, 1.4826 * median(&mut dev))
}

impl Peers {
    pub fn new(settings: GreySettings) -> Self {
        Peers {
            settings,
            groups: Mutex::new(HashMap::new()),
        }
    }

    pub fn settings(&self) -> &GreySettings {
        &self.settings
    }

    /// Forgets a node's figures (removed): it is nobody's peer any more.
    pub fn forget(&self, mac: &Mac) {
        let mut groups = self.groups.lock().expect("peers lock");
        for g in groups.values_mut() {
            for by_node in g.values.values_mut() {
                by_node.remove(mac);
            }
            g.slow.retain(|(m, _)| m != mac);
        }
    }

    /// Takes a node's figures; answers the verdicts, by node, that they give (its own,
    /// and its peers' when the group has grown enough to judge everyone again).
    pub fn observe(
        &self,
        mac: Mac,
        image: &str,
        labels: &BTreeMap<String, String>,
        figures: &[Figure],
        at: &str,
    ) -> Vec<(Mac, Verdict)> {
        if figures.is_empty() {
            return vec![];
        }
        let group = (
            image.to_string(),
            labels
                .get(&self.settings.label)
                .cloned()
                .unwrap_or_default(),
        );
        let mut groups = self.groups.lock().expect("peers lock");
        let total: usize = groups.values().map(Figures::size).sum();
        if total >= MAX_NODES && !groups.contains_key(&group) {
            return vec![];
        }
        let g = groups.entry(group).or_default();
        for f in figures.iter().take(MAX_FIGURES) {
            if f.value.is_finite() && f.name.len() <= 64 {
                g.values
                    .entry(f.name.clone())
                    .or_default()
                    .insert(mac, f.value);
                g.slow.remove(&(mac, f.name.clone()));
            }
        }
        let size = g.size();
        if size < self.settings.min_peers {
            return vec![];
        }
        let everyone = size >= 2 * g.judged_all_at.max(self.settings.min_peers / 2);
        if everyone {
            g.judged_all_at = size;
        }
        let mut out = Vec::new();
        let Figures { values, slow, .. } = g;
        for (name, by_node) in values.iter() {
            if by_node.len() < self.settings.min_peers {
                continue;
            }
            let (m, sd) = yardstick(by_node);
            let judge = |node: &Mac, value: f64| -> Option<Verdict> {
                let drop = if m > 0.0 { (m - value) / m } else { 0.0 };
                let deviations = if sd > 0.0 {
                    (m - value) / sd
                } else {
                    f64::INFINITY
                };
                let slow_now =
                    drop >= self.settings.min_drop && deviations >= self.settings.max_deviations;
                slow_now
                    .then(|| Verdict {
                        action: self.settings.action,
                        view: HealthVerdict {
                            rule: RULE.into(),
                            action: self.settings.action.as_str().into(),
                            subject: format!("figure {name}"),
                            summary: format!(
                                "{name} {value} is {:.0}% below its {} peers' median {m}",
                                drop * 100.0,
                                by_node.len()
                            ),
                            readings: [
                                ("figure", json!(name)),
                                ("value", json!(value)),
                                ("median", json!(m)),
                                ("robust_sd", json!(sd)),
                                ("deviations", json!(deviations)),
                                ("drop", json!(drop)),
                                ("peers", json!(by_node.len())),
                            ]
                            .into_iter()
                            .map(|(k, v)| (k.to_string(), v))
                            .collect(),
                            at: at.to_string(),
                        },
                    })
                    .filter(|_| !slow.contains(&(*node, name.clone())))
            };
            let nodes: Vec<(Mac, f64)> = if everyone {
                by_node.iter().map(|(k, v)| (*k, *v)).collect()
            } else {
                by_node
                    .get(&mac)
                    .map(|v| vec![(mac, *v)])
                    .unwrap_or_default()
            };
            let mut newly = Vec::new();
            for (node, value) in nodes {
                if let Some(v) = judge(&node, value) {
                    newly.push((node, name.clone()));
                    out.push((node, v));
                }
            }
            slow.extend(newly);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mac(i: u32) -> Mac {
        format!("52:54:00:33:{:02x}:{:02x}", i / 256, i % 256)
            .parse()
            .unwrap()
    }

    fn gemm(value: f64) -> Vec<Figure> {
        vec![Figure {
            name: "gemm_tflops".into(),
            value,
        }]
    }

    fn sku() -> BTreeMap<String, String> {
        [("sku".to_string(), "hgx-h100".to_string())].into()
    }

    /// 100 nodes around 700 TFLOPS (within 2%), three at 55-70% of that, reporting in
    /// any order: the three are found, with their figures, and no one else.
    #[test]
    fn three_slow_nodes_among_a_hundred_are_found_whenever_they_report() {
        let peers = Peers::new(GreySettings::default());
        let slow = [3u32, 50, 97];
        let mut flagged = Vec::new();
        for i in 0..100u32 {
            let value = match i {
                3 => 385.0,
                50 => 455.0,
                97 => 490.0,
                _ => 700.0 + f64::from((i * 37) % 29) - 14.0,
            };
            for (node, v) in peers.observe(mac(i), "sha256:aa", &sku(), &gemm(value), "t") {
                assert_eq!(v.view.readings["figure"], "gemm_tflops");
                assert!(v.view.readings["median"].as_f64().unwrap() > 690.0, "{v:?}");
                flagged.push(node);
            }
        }
        flagged.sort();
        let mut expect: Vec<Mac> = slow.iter().map(|&i| mac(i)).collect();
        expect.sort();
        assert_eq!(flagged, expect);
    }

    #[test]
    fn peers_are_the_same_image_and_sku_and_a_small_group_is_not_judged() {
        let peers = Peers::new(GreySettings::default());
        let l40s: BTreeMap<String, String> = [("sku".to_string(), "l40s".to_string())].into();
        for i in 0..20 {
            assert!(
                peers
                    .observe(mac(i), "sha256:aa", &sku(), &gemm(700.0), "t")
                    .is_empty()
            );
        }
        // Slower hardware is not slow among its own kind; too few to judge anyway.
        for i in 20..25 {
            assert!(
                peers
                    .observe(mac(i), "sha256:aa", &l40s, &gemm(180.0), "t")
                    .is_empty()
            );
        }
        // Another image: another group.
        assert!(
            peers
                .observe(mac(30), "sha256:bb", &sku(), &gemm(100.0), "t")
                .is_empty()
        );
        assert_eq!(
            peers
                .observe(mac(31), "sha256:aa", &sku(), &gemm(100.0), "t")
                .len(),
            1
        );
    }

    #[test]
    fn a_forgotten_node_is_nobodys_peer() {
        let peers = Peers::new(GreySettings::default());
        for i in 0..9 {
            peers.observe(mac(i), "sha256:aa", &sku(), &gemm(700.0), "t");
        }
        peers.forget(&mac(0));
        // Eight left and a slow newcomer: nine, too few to judge (ten would be).
        assert!(
            peers
                .observe(mac(50), "sha256:aa", &sku(), &gemm(100.0), "t")
                .is_empty()
        );
    }
}
