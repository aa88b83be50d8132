//! Each node's health as its heartbeats tell it: per GPU and port, the state the rules
//! need (throttling since when, counters' recent rises, XIDs seen, readings missing since
//! when), the verdicts that hold, and the newest readings. One boot at a time: a new boot
//! starts clean. Missing readings never count as healthy: they neither end a condition
//! nor start a clean record, and `reading-missing` rules judge them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::{Value, json};

use super::rules::{Action, Condition, HealthSettings, Rule};
use super::series::Series;
use crate::api::Mac;
use crate::api::agent::{GpuSample, HeartbeatRequest, IbPortSample};
use crate::api::health::{HealthVerdict, NodeHealth};

/// The most nodes tracked; past it, the longest silent are forgotten.
const MAX_NODES: usize = 200_000;
/// The most GPUs and ports tracked a node (what a client sends past it is ignored).
const MAX_PARTS: usize = 64;
/// The most readings missing tracked a GPU or port.
const MAX_MISSING: usize = 16;

/// A verdict and what it asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub action: Action,
    pub view: HealthVerdict,
}

#[derive(Default)]
struct GpuTrack {
    index: u32,
    xids: u64,
    /// Each throttle reason active now, since when.
    throttled_since: BTreeMap<String, i64>,
    ecc_corrected: Series,
    /// Absent from the newest heartbeat, since when.
    gone_since: Option<i64>,
}

#[derive(Default)]
struct PortTrack {
    link_downed: Series,
    state: Option<String>,
}

#[derive(Default)]
struct NodeTrack {
    boot: String,
    at_ms: i64,
    gpus: BTreeMap<String, GpuTrack>,
    ports: BTreeMap<String, PortTrack>,
    /// (subject, reading) missing since when.
    missing_since: BTreeMap<(String, String), i64>,
    /// The verdicts that hold, by (rule, subject).
    holding: BTreeMap<(String, String), HealthVerdict>,
    readings: VecDeque<super::compact::Reading>,
    /// The node's InfiniBand port names, once (readings refer to them by position).
    port_names: Vec<String>,
}

/// Every node's health, behind one lock (a heartbeat's update is microseconds).
pub struct Health {
    settings: HealthSettings,
    /// The longest window any rule looks back over, ms: how long series keep points.
    keep_ms: i64,
    nodes: Mutex<HashMap<Mac, NodeTrack>>,
    /// Performance figures against peers' (grey failures).
    pub peers: super::peers::Peers,
}

fn gpu_subject(g: &GpuSample) -> String {
    if g.uuid.is_empty() {
        format!("gpu {}", g.index)
    } else {
        format!("gpu {} ({})", g.index, cut(&g.uuid))
    }
}

/// Client text, bounded.
fn cut(s: &str) -> String {
    s.chars().take(96).collect()
}

/// What a rule found on one subject: the subject, a summary, the readings.
struct Finding {
    subject: String,
    summary: String,
    readings: BTreeMap<String, Value>,
}

fn finding(subject: &str, summary: String, readings: Value) -> Finding {
    let readings = match readings {
        Value::Object(m) => m.into_iter().collect(),
        _ => BTreeMap::new(),
    };
    Finding {
        subject: subject.to_string(),
        summary,
        readings,
    }
}

impl Health {
    pub fn new(settings: HealthSettings) -> Self {
        let keep_secs = settings
            .rules
            .iter()
            .map(Rule::window_secs)
            .max()
            .unwrap_or(0);
        Health {
            keep_ms: (keep_secs as i64) * 1000,
            peers: super::peers::Peers::new(settings.grey.clone()),
            settings,
            nodes: Mutex::new(HashMap::new()),
        }
    }

    pub fn settings(&self) -> &HealthSettings {
        &self.settings
    }

    /// Takes one heartbeat's readings; answers the verdicts it gives that did not hold
    /// before (each holds until its condition clears, and is given once meanwhile).
    pub fn observe(
        &self,
        req: &HeartbeatRequest,
        labels: &BTreeMap<String, String>,
        now_ms: i64,
    ) -> Vec<Verdict> {
        let mut nodes = self.nodes.lock().expect("health lock");
        if nodes.len() >= MAX_NODES && !nodes.contains_key(&req.mac) {
            let oldest = nodes.values().map(|n| n.at_ms).min().unwrap_or(now_ms);
            nodes.retain(|_, n| n.at_ms > oldest);
        }
        let node = nodes.entry(req.mac).or_default();
        if node.boot != req.boot_id {
            *node = NodeTrack {
                boot: cut(&req.boot_id),
                ..Default::default()
            };
        }
        node.at_ms = now_ms;
        let gpus = &req.gpus[..req.gpus.len().min(MAX_PARTS)];
        let ports = &req.ib_ports[..req.ib_ports.len().min(MAX_PARTS)];
        let mut found: Vec<(usize, Finding)> = Vec::new();
        let rules: Vec<(usize, &Rule)> = self
            .settings
            .rules
            .iter()
            .enumerate()
            .filter(|(_, r)| r.applies_to(labels))
            .collect();
        let new_xids = update_gpus(node, gpus, now_ms, self.keep_ms);
        update_ports(node, ports, now_ms, self.keep_ms);
        update_missing(node, gpus, ports, now_ms);
        for &(i, rule) in &rules {
            for f in judge(rule, node, gpus, &new_xids, now_ms) {
                found.push((i, f));
            }
        }
        let at = crate::clock::format_ms(now_ms);
        let mut given = Vec::new();
        let mut holding_now = BTreeMap::new();
        for (i, f) in found {
            let rule = &self.settings.rules[i];
            let key = (rule.name.clone(), f.subject.clone());
            let view = match node.holding.remove(&key) {
                Some(v) => v,
                None => {
                    let v = HealthVerdict {
                        rule: rule.name.clone(),
                        action: rule.action.as_str().to_string(),
                        subject: f.subject,
                        summary: f.summary,
                        readings: f.readings,
                        at: at.clone(),
                    };
                    given.push(Verdict {
                        action: rule.action,
                        view: v.clone(),
                    });
                    v
                }
            };
            holding_now.insert(key, view);
        }
        // An XID's verdict holds for the boot: the error happened, whatever follows. So
        // does a grey failure's (judged at validation, not by heartbeats).
        let xid_rules: Vec<&str> = rules
            .iter()
            .filter(|(_, r)| matches!(r.when, Condition::Xid { .. }))
            .map(|(_, r)| r.name.as_str())
            .collect();
        for (key, v) in std::mem::take(&mut node.holding) {
            if xid_rules.contains(&key.0.as_str()) || key.0 == super::peers::RULE {
                holding_now.entry(key).or_insert(v);
            }
        }
        node.holding = holding_now;
        let kept = super::compact::Reading::new(now_ms, gpus, ports, &mut node.port_names);
        node.readings.push_back(kept);
        while node.readings.len() > self.settings.keep_readings {
            node.readings.pop_front();
        }
        given
    }

    /// What this server heard of `mac`'s current boot.
    pub fn view(&self, mac: &Mac) -> Option<NodeHealth> {
        let nodes = self.nodes.lock().expect("health lock");
        let node = nodes.get(mac)?;
        Some(NodeHealth {
            boot_id: node.boot.clone(),
            readings: node
                .readings
                .iter()
                .map(|r| r.view(&node.port_names))
                .collect(),
            verdicts: node.holding.values().cloned().collect(),
        })
    }

    /// Keeps a verdict given elsewhere (a grey failure, from a validation) with the
    /// node's, for its boot: shown until the boot ends.
    /// `boot_id`: the boot it is about (None: whichever boot the node is on).
    pub fn hold(&self, mac: &Mac, boot_id: Option<&str>, verdict: &HealthVerdict) {
        let mut nodes = self.nodes.lock().expect("health lock");
        let node = nodes.entry(*mac).or_default();
        if let Some(boot_id) = boot_id
            && node.boot != boot_id
        {
            *node = NodeTrack {
                boot: cut(boot_id),
                ..Default::default()
            };
        }
        let key = (verdict.rule.clone(), verdict.subject.clone());
        node.holding.insert(key, verdict.clone());
    }

    /// Forgets a node (removed), its readings and its figures among its peers.
    pub fn forget(&self, mac: &Mac) {
        self.nodes.lock().expect("health lock").remove(mac);
        self.peers.forget(mac);
    }
}

/// Updates each GPU's state; answers the new XIDs by subject (code list).
fn update_gpus(
    node: &mut NodeTrack,
    gpus: &[GpuSample],
    now_ms: i64,
    keep_ms: i64,
) -> BTreeMap<String, Vec<u32>> {
    let mut new_xids = BTreeMap::new();
    for t in node.gpus.values_mut() {
        t.gone_since.get_or_insert(now_ms);
    }
    for g in gpus {
        let subject = gpu_subject(g);
        let t = node
            .gpus
            .entry(subject.clone())
            .or_insert_with(|| GpuTrack {
                index: g.index,
                ..Default::default()
            });
        t.gone_since = None;
        let fresh = g.xids.saturating_sub(t.xids) as usize;
        t.xids = t.xids.max(g.xids);
        if fresh > 0 {
            let recent = &g.recent_xids[g.recent_xids.len().saturating_sub(fresh)..];
            new_xids.insert(subject.clone(), recent.to_vec());
        }
        if let Some(reasons) = &g.throttle_reasons {
            t.throttled_since.retain(|r, _| reasons.contains(r));
            for r in reasons.iter().take(MAX_MISSING) {
                t.throttled_since.entry(cut(r)).or_insert(now_ms);
            }
        }
        if let Some(ecc) = &g.ecc {
            t.ecc_corrected
                .push(now_ms, ecc.volatile_corrected, keep_ms);
        }
    }
    new_xids
}

fn update_ports(node: &mut NodeTrack, ports: &[IbPortSample], now_ms: i64, keep_ms: i64) {
    for p in ports {
        let t = node.ports.entry(cut(&p.port)).or_default();
        if let Some(n) = p.link_downed {
            t.link_downed.push(now_ms, n, keep_ms);
        }
        if p.state.is_some() {
            t.state = p.state.as_deref().map(cut);
        }
    }
}

/// Readings missing now, since when; a reading back ends its record.
fn update_missing(node: &mut NodeTrack, gpus: &[GpuSample], ports: &[IbPortSample], now_ms: i64) {
    let mut now: Vec<(String, String)> = Vec::new();
    for g in gpus {
        let subject = gpu_subject(g);
        let mut names: Vec<&str> = g.missing.iter().map(String::as_str).collect();
        if g.throttle_reasons.is_none() {
            names.push("throttle_reasons");
        }
        for n in names.into_iter().take(MAX_MISSING) {
            now.push((subject.clone(), cut(n)));
        }
    }
    for p in ports {
        for n in p.missing.iter().take(MAX_MISSING) {
            now.push((format!("port {}", cut(&p.port)), cut(n)));
        }
    }
    node.missing_since.retain(|k, _| now.contains(k));
    for k in now {
        node.missing_since.entry(k).or_insert(now_ms);
    }
}

/// What `rule` finds in the node's state now.
fn judge(
    rule: &Rule,
    node: &NodeTrack,
    gpus: &[GpuSample],
    new_xids: &BTreeMap<String, Vec<u32>>,
    now_ms: i64,
) -> Vec<Finding> {
    let mut out = Vec::new();
    let secs = |since: i64| (now_ms - since) / 1000;
    match &rule.when {
        Condition::Throttled { for_secs, reasons } => {
            for g in gpus {
                let subject = gpu_subject(g);
                let Some(t) = node.gpus.get(&subject) else {
                    continue;
                };
                let since = reasons
                    .iter()
                    .filter_map(|r| t.throttled_since.get(r))
                    .min();
                if let Some(&since) = since
                    && secs(since) >= *for_secs as i64
                {
                    let held: Vec<&String> = t
                        .throttled_since
                        .keys()
                        .filter(|r| reasons.contains(r))
                        .collect();
                    out.push(finding(
                        &subject,
                        format!("{subject} throttled ({held:?}) for {} s", secs(since)),
                        json!({
                            "throttle_reasons": held, "throttled_secs": secs(since),
                            "temperature_c": g.temperature_c, "sm_clock_mhz": g.sm_clock_mhz,
                            "sm_clock_max_mhz": g.sm_clock_max_mhz, "power_w": g.power_w,
                        }),
                    ));
                }
            }
        }
        Condition::EccCorrectedRate {
            per_hour,
            over_secs,
        } => {
            let limit = per_hour * (*over_secs as f64) / 3600.0;
            for (subject, t) in &node.gpus {
                let rise = t.ecc_corrected.rise(now_ms, (*over_secs as i64) * 1000);
                if t.gone_since.is_none() && rise as f64 > limit {
                    out.push(finding(
                        subject,
                        format!(
                            "{subject}: {rise} corrected ECC errors in {over_secs} s (limit {per_hour}/h)"
                        ),
                        json!({ "corrected_rise": rise, "over_secs": over_secs, "per_hour_limit": per_hour }),
                    ));
                }
            }
        }
        Condition::Xid { codes } => {
            for (subject, seen) in new_xids {
                for code in seen.iter().filter(|c| codes.contains(c)) {
                    let id = format!("{subject} xid {code}");
                    out.push(finding(
                        &id,
                        format!("{subject} logged XID {code}"),
                        json!({ "xid": code, "new_xids": seen, "xids_since_boot": node.gpus.get(subject).map(|t| t.xids) }),
                    ));
                }
            }
        }
        Condition::IbLinkDown { count, over_secs } => {
            for (port, t) in &node.ports {
                let downs = t.link_downed.rise(now_ms, (*over_secs as i64) * 1000);
                if downs >= *count {
                    let subject = format!("port {port}");
                    out.push(finding(
                        &subject,
                        format!("{subject}: link down {downs} times in {over_secs} s"),
                        json!({ "link_downs": downs, "over_secs": over_secs, "state": t.state }),
                    ));
                }
            }
        }
        Condition::GpuMissing => {
            let seen = node.gpus.len();
            for (subject, t) in node.gpus.iter().filter(|(_, t)| t.gone_since.is_some()) {
                out.push(finding(
                    subject,
                    format!("{subject} is no longer reported ({} of {seen} GPUs left)", gpus.len()),
                    json!({ "index": t.index, "gpus_seen_this_boot": seen, "gpus_reported": gpus.len() }),
                ));
            }
        }
        Condition::ReadingMissing { for_secs } => {
            for ((subject, reading), since) in &node.missing_since {
                if secs(*since) >= *for_secs as i64 {
                    out.push(finding(
                        &format!("{subject} {reading}"),
                        format!("{subject}: {reading} missing for {} s", secs(*since)),
                        json!({ "reading": reading, "missing_secs": secs(*since) }),
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::agent::EccCounts;

    const MIN: i64 = 60_000;

    fn gpu(index: u32) -> GpuSample {
        GpuSample {
            index,
            uuid: format!("GPU-{index}"),
            temperature_c: Some(60),
            ecc: Some(EccCounts::default()),
            sm_clock_mhz: Some(1980),
            sm_clock_max_mhz: Some(1980),
            throttle_reasons: Some(vec![]),
            ..Default::default()
        }
    }

    fn beat(gpus: Vec<GpuSample>, ports: Vec<IbPortSample>) -> HeartbeatRequest {
        HeartbeatRequest {
            boot_id: "b-1".into(),
            mac: "52:54:00:00:00:01".parse().unwrap(),
            facts: None,
            gpus,
            ib_ports: ports,
        }
    }

    fn health(rules: Vec<Rule>) -> Health {
        Health::new(HealthSettings {
            rules,
            keep_readings: 4,
            grey: Default::default(),
        })
    }

    fn no_labels() -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    fn hot_for_ten_minutes() -> Rule {
        Rule::new(
            "hot",
            Condition::Throttled {
                for_secs: 600,
                reasons: vec!["HW_THERMAL_SLOWDOWN".into()],
            },
            Action::Flag,
        )
    }

    #[test]
    fn thermal_throttling_is_flagged_after_its_window_not_before() {
        let h = health(vec![hot_for_ten_minutes()]);
        let mut hot = gpu(2);
        hot.throttle_reasons = Some(vec!["HW_THERMAL_SLOWDOWN".into()]);
        hot.temperature_c = Some(92);
        let req = beat(vec![gpu(0), gpu(1), hot.clone()], vec![]);
        for t in 0..10 {
            assert!(
                h.observe(&req, &no_labels(), t * MIN).is_empty(),
                "minute {t}"
            );
        }
        let v = h.observe(&req, &no_labels(), 10 * MIN);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].view.subject, "gpu 2 (GPU-2)");
        assert_eq!(v[0].view.readings["temperature_c"], 92);
        assert_eq!(v[0].view.readings["throttled_secs"], 600);
        // Given once while it holds; shown while it holds; gone once it clears.
        assert!(h.observe(&req, &no_labels(), 11 * MIN).is_empty());
        assert_eq!(h.view(&req.mac).unwrap().verdicts.len(), 1);
        let cool = beat(vec![gpu(0), gpu(1), gpu(2)], vec![]);
        h.observe(&cool, &no_labels(), 12 * MIN);
        assert!(h.view(&req.mac).unwrap().verdicts.is_empty());
    }

    #[test]
    fn a_break_in_throttling_restarts_its_clock_but_a_missing_reading_does_not() {
        let h = health(vec![hot_for_ten_minutes()]);
        let mut hot = gpu(0);
        hot.throttle_reasons = Some(vec!["HW_THERMAL_SLOWDOWN".into()]);
        let mut unknown = gpu(0);
        unknown.throttle_reasons = None;
        h.observe(&beat(vec![hot.clone()], vec![]), &no_labels(), 0);
        // Readings missing for five minutes: not a break.
        h.observe(&beat(vec![unknown], vec![]), &no_labels(), 5 * MIN);
        let v = h.observe(&beat(vec![hot.clone()], vec![]), &no_labels(), 10 * MIN);
        assert_eq!(v.len(), 1, "a missing reading ended the throttling: {v:?}");
        // A real break restarts it.
        h.observe(&beat(vec![gpu(0)], vec![]), &no_labels(), 11 * MIN);
        assert!(
            h.observe(&beat(vec![hot.clone()], vec![]), &no_labels(), 12 * MIN)
                .is_empty()
        );
        assert!(
            h.observe(&beat(vec![hot], vec![]), &no_labels(), 21 * MIN)
                .is_empty()
        );
    }

    #[test]
    fn corrected_ecc_rising_too_fast_is_caught_and_a_slow_climb_is_not() {
        let h = health(vec![Rule::new(
            "ecc",
            Condition::EccCorrectedRate {
                per_hour: 100.0,
                over_secs: 3600,
            },
            Action::Revalidate,
        )]);
        let at = |n: u64| {
            let mut g = gpu(0);
            g.ecc = Some(EccCounts {
                volatile_corrected: n,
                ..Default::default()
            });
            beat(vec![g], vec![])
        };
        // 50 an hour for three hours: within the limit.
        for m in 0..180 {
            assert!(
                h.observe(&at(m * 50 / 60), &no_labels(), m as i64 * MIN)
                    .is_empty()
            );
        }
        // Then 10 a minute: past 100 within the hour.
        let base = 150;
        let mut given = None;
        for m in 0..20 {
            let v = h.observe(&at(base + m * 10), &no_labels(), (180 + m as i64) * MIN);
            if !v.is_empty() {
                given = Some((m, v));
                break;
            }
        }
        let (m, v) = given.expect("the climb was caught");
        assert!(m <= 11, "caught after {m} minutes");
        assert_eq!(v[0].action, Action::Revalidate);
        assert!(v[0].view.readings["corrected_rise"].as_u64().unwrap() > 100);
    }

    #[test]
    fn a_port_flapping_five_times_in_an_hour_trips_the_rule() {
        let h = health(vec![Rule::new(
            "flap",
            Condition::IbLinkDown {
                count: 5,
                over_secs: 3600,
            },
            Action::Reimage,
        )]);
        let port = |downs: u64| IbPortSample {
            port: "mlx5_0/1".into(),
            state: Some("ACTIVE".into()),
            rate_gbps: Some(400.0),
            link_downed: Some(downs),
            ..Default::default()
        };
        let mut given = Vec::new();
        for (m, downs) in [(0, 2), (10, 3), (20, 4), (30, 5), (40, 6), (50, 7)] {
            given.push(h.observe(&beat(vec![], vec![port(downs)]), &no_labels(), m * MIN));
        }
        // The count it started with is no flap; the fifth rise within the hour is.
        assert!(given[..5].iter().all(Vec::is_empty), "{given:?}");
        assert_eq!(given[5].len(), 1);
        assert_eq!(given[5][0].view.subject, "port mlx5_0/1");
        assert_eq!(given[5][0].view.readings["link_downs"], 5);
    }

    #[test]
    fn a_new_xid_79_is_a_verdict_with_its_code_and_an_old_one_is_not_new() {
        let h = health(vec![Rule::new(
            "fatal",
            Condition::Xid { codes: vec![79] },
            Action::Quarantine,
        )]);
        let mut g = gpu(3);
        g.xids = 1;
        g.recent_xids = vec![13];
        assert!(
            h.observe(&beat(vec![g.clone()], vec![]), &no_labels(), 0)
                .is_empty()
        );
        g.xids = 2;
        g.recent_xids = vec![13, 79];
        let v = h.observe(&beat(vec![g.clone()], vec![]), &no_labels(), MIN);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].action, Action::Quarantine);
        assert_eq!(v[0].view.readings["xid"], 79);
        assert!(
            h.observe(&beat(vec![g], vec![]), &no_labels(), 2 * MIN)
                .is_empty()
        );
        assert_eq!(
            h.view(&"52:54:00:00:00:01".parse().unwrap())
                .unwrap()
                .verdicts
                .len(),
            1
        );
    }

    #[test]
    fn a_gpu_gone_from_the_bus_and_a_reading_gone_for_long_are_verdicts() {
        let h = health(vec![
            Rule::new("gone", Condition::GpuMissing, Action::Quarantine),
            Rule::new(
                "blind",
                Condition::ReadingMissing { for_secs: 300 },
                Action::Flag,
            ),
        ]);
        let all = beat((0..8).map(gpu).collect(), vec![]);
        assert!(h.observe(&all, &no_labels(), 0).is_empty());
        let mut seven: Vec<GpuSample> = (0..7).map(gpu).collect();
        seven[0].ecc = None;
        seven[0].missing = vec!["ecc".into()];
        let v = h.observe(&beat(seven.clone(), vec![]), &no_labels(), MIN);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].view.subject, "gpu 7 (GPU-7)");
        assert!(
            h.observe(&beat(seven.clone(), vec![]), &no_labels(), 5 * MIN)
                .is_empty()
        );
        let v = h.observe(&beat(seven, vec![]), &no_labels(), 6 * MIN);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].view.readings["reading"], "ecc");
    }

    #[test]
    fn rules_apply_to_their_label_group_and_a_new_boot_starts_clean() {
        let mut r = Rule::new(
            "fatal",
            Condition::Xid { codes: vec![79] },
            Action::Quarantine,
        );
        r.labels.insert("sku".into(), "hgx-h100".into());
        let h = health(vec![r]);
        let mut g = gpu(0);
        g.xids = 1;
        g.recent_xids = vec![79];
        let other: BTreeMap<String, String> = [("sku".into(), "l40s".into())].into();
        let mine: BTreeMap<String, String> = [("sku".into(), "hgx-h100".into())].into();
        assert!(
            h.observe(&beat(vec![g.clone()], vec![]), &other, 0)
                .is_empty()
        );
        let mut next = beat(vec![g], vec![]);
        next.boot_id = "b-2".into();
        assert_eq!(h.observe(&next, &mine, MIN).len(), 1);
        assert_eq!(h.view(&next.mac).unwrap().boot_id, "b-2");
        assert_eq!(h.view(&next.mac).unwrap().readings.len(), 1);
    }
}
