//! What a node did before it asked for its boot script, as DHCP and TFTP saw it: its
//! DHCP answers and TFTP transfers, kept per MAC in memory (bounded, and only the last
//! `PREBOOT_WINDOW_MS`), shown live with the node and taken into the boot record when its
//! script is served, so a boot's timeline starts at its first DHCP answer. Memory only:
//! a server restart forgets steps not yet attached to a boot (the node asks again).

use std::collections::HashMap;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::api::Mac;

/// Steps older than this when the script is served belong to an earlier try.
pub const PREBOOT_WINDOW_MS: i64 = 10 * 60_000;
/// Steps kept per MAC (the newest): a node retrying DHCP for an hour must not grow.
const STEPS_PER_NODE: usize = 12;
/// MACs kept; past it those quiet longest are dropped.
const MAX_NODES: usize = 50_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrebootStep {
    /// `dhcp offer`, `ipxe dhcp ack`, `tftp undionly.kpxe`...
    pub step: String,
    pub at_ms: i64,
    /// `ok` or what was handed out (`10.0.0.5, undionly.kpxe`), or what went wrong.
    pub outcome: String,
}

#[derive(Default)]
pub struct Preboot {
    by_mac: Mutex<HashMap<Mac, Vec<PrebootStep>>>,
}

impl Preboot {
    pub fn record(&self, mac: Mac, step: String, outcome: String, now_ms: i64) {
        let mut by_mac = self.by_mac.lock().expect("not poisoned");
        if by_mac.len() >= MAX_NODES && !by_mac.contains_key(&mac) {
            by_mac.retain(|_, steps| {
                steps
                    .last()
                    .is_some_and(|s| now_ms - s.at_ms < PREBOOT_WINDOW_MS)
            });
            if by_mac.len() >= MAX_NODES {
                by_mac.clear();
            }
        }
        let steps = by_mac.entry(mac).or_default();
        steps.retain(|s| now_ms - s.at_ms < PREBOOT_WINDOW_MS);
        // A retransmitted request answered again is the same step, not a new one.
        if let Some(last) = steps.last_mut()
            && last.step == step
            && last.outcome == outcome
        {
            last.at_ms = now_ms;
            return;
        }
        if steps.len() >= STEPS_PER_NODE {
            steps.remove(0);
        }
        steps.push(PrebootStep {
            step,
            at_ms: now_ms,
            outcome,
        });
    }

    /// The MAC's recent steps, oldest first, left in place.
    pub fn peek(&self, mac: &Mac, now_ms: i64) -> Vec<PrebootStep> {
        let by_mac = self.by_mac.lock().expect("not poisoned");
        recent(by_mac.get(mac).map(Vec::as_slice).unwrap_or(&[]), now_ms)
    }

    /// The MAC's recent steps, oldest first, removed: they now belong to a boot.
    pub fn take(&self, mac: &Mac, now_ms: i64) -> Vec<PrebootStep> {
        let steps = self.by_mac.lock().expect("not poisoned").remove(mac);
        recent(&steps.unwrap_or_default(), now_ms)
    }
}

fn recent(steps: &[PrebootStep], now_ms: i64) -> Vec<PrebootStep> {
    steps
        .iter()
        .filter(|s| now_ms - s.at_ms < PREBOOT_WINDOW_MS)
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_kept_per_mac_recent_bounded_and_taken_once() {
        let p = Preboot::default();
        let mac: Mac = "52:54:00:00:00:01".parse().unwrap();
        let other: Mac = "52:54:00:00:00:02".parse().unwrap();
        p.record(mac, "dhcp offer".into(), "10.0.0.5".into(), 1_000);
        // The same answer to a retransmission: one step, moved to the later time.
        p.record(mac, "dhcp offer".into(), "10.0.0.5".into(), 1_500);
        p.record(mac, "dhcp ack".into(), "10.0.0.5".into(), 2_000);
        p.record(other, "dhcp offer".into(), "10.0.0.6".into(), 2_000);
        let steps = p.peek(&mac, 3_000);
        assert_eq!(
            steps
                .iter()
                .map(|s| (s.step.as_str(), s.at_ms))
                .collect::<Vec<_>>(),
            [("dhcp offer", 1_500), ("dhcp ack", 2_000)]
        );
        assert_eq!(p.take(&mac, 3_000), steps);
        assert!(p.take(&mac, 3_000).is_empty(), "taken once");
        assert_eq!(p.peek(&other, 3_000).len(), 1);
        // An old try is not this boot's.
        assert!(p.peek(&other, 2_000 + PREBOOT_WINDOW_MS).is_empty());
        for i in 0..40 {
            p.record(mac, format!("tftp f{i}"), "ok".into(), 10_000 + i);
        }
        let steps = p.peek(&mac, 20_000);
        assert_eq!(steps.len(), STEPS_PER_NODE);
        assert_eq!(steps.last().unwrap().step, "tftp f39");
    }
}
