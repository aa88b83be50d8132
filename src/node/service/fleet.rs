//! The fleet at a glance (`GET /api/v1/fleet`), for the console's overview: counts by
//! state, image and label group (the metrics census), and the nodes that need a look.

use super::NodeService;
use super::admin::AdminError;
use crate::api::NodeState;
use crate::api::node::{Count, FleetSummary, Node};
use crate::metrics::census::Census;

/// Nodes listed as not ready, at most.
const NOT_READY_SHOWN: usize = 50;

/// States where a node rests as it should: not listed as needing a look.
fn resting(state: NodeState) -> bool {
    matches!(state, NodeState::Ready | NodeState::Discovered)
}

fn counts(pairs: impl Iterator<Item = (String, u64)>) -> Vec<Count> {
    let mut out: Vec<Count> = pairs.map(|(name, count)| Count { name, count }).collect();
    out.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.name.cmp(&b.name)));
    out
}

impl NodeService {
    pub async fn fleet(&self, group_keys: &[String]) -> Result<FleetSummary, AdminError> {
        let rows = self.store.census().await?;
        let census = Census::count(&rows, group_keys, i64::MIN);
        let names: std::collections::HashMap<String, String> = self
            .store
            .list_images()
            .await?
            .into_iter()
            .map(|i| (i.digest.to_string(), format!("{}:{}", i.name, i.version)))
            .collect();
        let by_image = counts(census.by_image.iter().map(|(digest, n)| {
            let name = names.get(digest).cloned().unwrap_or_else(|| digest.clone());
            (name, *n)
        }));
        let mut groups = std::collections::BTreeMap::new();
        // Named as selectors, so the console can list each group: `rack=r1`, `!rack`.
        for ((key, value, _), n) in &census.by_group {
            let name = if value.is_empty() {
                format!("!{key}")
            } else {
                format!("{key}={value}")
            };
            *groups.entry(name).or_insert(0) += n;
        }
        let mut not_ready: Vec<Node> = self
            .store
            .nodes()
            .await?
            .into_iter()
            .filter(|n| !resting(n.state))
            .map(Node::from)
            .collect();
        not_ready.sort_by(|a, b| b.updated_at.cmp(&a.updated_at));
        not_ready.truncate(NOT_READY_SHOWN);
        Ok(FleetSummary {
            nodes: rows.len() as u64,
            by_state: census
                .by_state
                .iter()
                .map(|(s, n)| Count {
                    name: s.as_str().into(),
                    count: *n,
                })
                .collect(),
            by_image,
            by_group: counts(groups.into_iter()),
            not_ready,
        })
    }
}
