//! The fleet at scrape time, read from the store: nodes by state, by the image their
//! newest boot runs, and by the values of chosen label keys; how far each webhook is
//! behind the event log. Shared by every server of a store, so each server reports the
//! whole fleet (query with `max by`, not `sum`).

use std::collections::BTreeMap;

use crate::api::{Digest, NodeState};
use crate::store::{CensusRow, Store, StoreError};

/// Label values kept per group key; the rest are counted under `other`.
pub const MAX_GROUP_VALUES: usize = 1000;

#[derive(Debug, Default, PartialEq)]
pub struct Census {
    /// Every state, zero included, so an alert on a state sees 0 and not nothing.
    pub by_state: BTreeMap<NodeState, u64>,
    /// Nodes by the image of their newest boot (`none`: never booted).
    pub by_image: BTreeMap<String, u64>,
    /// (label key, label value, state) -> nodes; a node without the key counts as "".
    pub by_group: BTreeMap<(String, String, NodeState), u64>,
    pub webhooks: Vec<WebhookLag>,
    /// Nodes in a state a boot passes through (provisioning, booted, validating,
    /// reimaging) for longer than `[metrics] stuck_after_secs`, by state.
    pub stuck: BTreeMap<NodeState, u64>,
}

/// The states a node passes through while it boots: one that stays in them is stuck.
pub const PASSING_STATES: [NodeState; 4] = [
    NodeState::Provisioning,
    NodeState::Booted,
    NodeState::Validating,
    NodeState::Reimaging,
];

#[derive(Debug, PartialEq)]
pub struct WebhookLag {
    /// The webhook's host and port (its path may carry a secret).
    pub webhook: String,
    pub events: u64,
    /// Age of the oldest event not yet delivered; 0 when caught up.
    pub seconds: f64,
}

impl Census {
    /// Counts the rows; pure.
    pub fn count(rows: &[CensusRow], group_keys: &[String], stuck_before_ms: i64) -> Census {
        let mut c = Census::default();
        for s in NodeState::ALL {
            c.by_state.insert(s, 0);
        }
        for s in PASSING_STATES {
            c.stuck.insert(s, 0);
        }
        let mut values: BTreeMap<&str, std::collections::BTreeSet<&str>> = BTreeMap::new();
        for row in rows {
            *c.by_state.entry(row.state).or_default() += 1;
            if row.since_ms < stuck_before_ms
                && let Some(stuck) = c.stuck.get_mut(&row.state)
            {
                *stuck += 1;
            }
            let image = row
                .image
                .as_ref()
                .map_or_else(|| "none".to_string(), Digest::to_string);
            *c.by_image.entry(image).or_default() += 1;
            for key in group_keys {
                let value = row.labels.get(key).map_or("", String::as_str);
                let seen = values.entry(key).or_default();
                let value = if seen.contains(value) || seen.len() < MAX_GROUP_VALUES {
                    seen.insert(value);
                    value
                } else {
                    "other"
                };
                *c.by_group
                    .entry((key.clone(), value.to_string(), row.state))
                    .or_default() += 1;
            }
        }
        c
    }
}

/// Reads the census: one query for the nodes, two per webhook.
pub async fn gather(store: &Store, scrape: &super::Scrape) -> Result<Census, StoreError> {
    let rows = store.census().await?;
    let now = crate::clock::now_ms();
    let stuck_before = now - i64::try_from(scrape.stuck_after_secs * 1000).unwrap_or(i64::MAX);
    let mut census = Census::count(&rows, &scrape.group_labels, stuck_before);
    let webhooks = &scrape.webhooks;
    if webhooks.is_empty() {
        return Ok(census);
    }
    let head = store.events_head().await?;
    for url in webhooks {
        // A webhook that has not started yet starts from the head: nothing behind.
        let cursor = store.webhook_cursor(url).await?.unwrap_or(head);
        let oldest = if cursor < head {
            store
                .events_since(cursor, 1, None)
                .await?
                .into_iter()
                .next()
        } else {
            None
        };
        let seconds = oldest
            .and_then(|e| crate::clock::parse_ms(&e.at))
            .map_or(0.0, |at| (now - at).max(0) as f64 / 1000.0);
        census.webhooks.push(WebhookLag {
            webhook: host_of(url),
            events: u64::try_from(head - cursor).unwrap_or(0),
            seconds,
        });
    }
    Ok(census)
}

/// `host:port` of a URL, or `?` when it has none.
fn host_of(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(u) => match (u.host_str(), u.port_or_known_default()) {
            (Some(h), Some(p)) => format!("{h}:{p}"),
            (Some(h), None) => h.to_string(),
            _ => "?".into(),
        },
        Err(_) => "?".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(state: NodeState, image: Option<&str>, rack: Option<&str>) -> CensusRow {
        at(state, image, rack, 1_000)
    }

    fn at(state: NodeState, image: Option<&str>, rack: Option<&str>, since_ms: i64) -> CensusRow {
        let mut labels = BTreeMap::new();
        if let Some(r) = rack {
            labels.insert("rack".to_string(), r.to_string());
        }
        CensusRow {
            state,
            since_ms,
            image: image.map(|h| format!("sha256:{}", h.repeat(64)).parse().unwrap()),
            labels,
        }
    }

    #[test]
    fn counts_by_state_image_and_group_with_zeros() {
        let rows = [
            row(NodeState::Ready, Some("a"), Some("r1")),
            row(NodeState::Ready, Some("a"), Some("r2")),
            row(NodeState::ValidationFailed, Some("b"), Some("r1")),
            row(NodeState::Discovered, None, None),
        ];
        let c = Census::count(&rows, &["rack".to_string()], 0);
        assert_eq!(c.by_state[&NodeState::Ready], 2);
        assert_eq!(c.by_state[&NodeState::Quarantined], 0);
        assert_eq!(c.by_image[&format!("sha256:{}", "a".repeat(64))], 2);
        assert_eq!(c.by_image["none"], 1);
        let g = |v: &str, s| {
            c.by_group
                .get(&("rack".to_string(), v.to_string(), s))
                .copied()
        };
        assert_eq!(g("r1", NodeState::Ready), Some(1));
        assert_eq!(g("r1", NodeState::ValidationFailed), Some(1));
        assert_eq!(g("", NodeState::Discovered), Some(1));
    }

    #[test]
    fn group_values_past_the_cap_are_other() {
        let rows: Vec<CensusRow> = (0..MAX_GROUP_VALUES + 5)
            .map(|i| row(NodeState::Ready, None, Some(&format!("r{i}"))))
            .collect();
        let c = Census::count(&rows, &["rack".to_string()], 0);
        assert_eq!(c.by_group.len(), MAX_GROUP_VALUES + 1);
        assert_eq!(
            c.by_group[&("rack".to_string(), "other".to_string(), NodeState::Ready)],
            5
        );
    }

    #[test]
    fn only_nodes_long_in_a_passing_state_are_stuck() {
        let rows = [
            at(NodeState::Provisioning, None, None, 100),
            at(NodeState::Provisioning, None, None, 5_000),
            at(NodeState::Reimaging, None, None, 100),
            // Long ready or failed is not stuck: those states are where nodes rest.
            at(NodeState::Ready, None, None, 100),
            at(NodeState::ValidationFailed, None, None, 100),
        ];
        let c = Census::count(&rows, &[], 1_000);
        assert_eq!(c.stuck[&NodeState::Provisioning], 1);
        assert_eq!(c.stuck[&NodeState::Reimaging], 1);
        assert_eq!(c.stuck[&NodeState::Validating], 0);
        assert!(!c.stuck.contains_key(&NodeState::Ready));
    }

    #[test]
    fn webhooks_are_named_by_host_only() {
        assert_eq!(
            host_of("http://hooks.example:8080/s3cret/path"),
            "hooks.example:8080"
        );
        assert_eq!(host_of("http://10.0.0.1/x"), "10.0.0.1:80");
        assert_eq!(host_of("not a url"), "?");
    }
}
