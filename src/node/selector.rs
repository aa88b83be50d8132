//! Which nodes a listing or a bulk command means: states, an assigned image, and a label
//! selector in Kubernetes' equality form (`rack=r1,pool!=batch,gpu,!drain`). Pure.

use std::collections::BTreeMap;

use crate::api::NodeState;
use crate::api::node::{Node, NodeQuery};

/// One requirement on a node's labels.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    Absent(String),
}

impl Requirement {
    fn holds(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            Self::Equals(k, v) => labels.get(k) == Some(v),
            Self::NotEquals(k, v) => labels.get(k) != Some(v),
            Self::Exists(k) => labels.contains_key(k),
            Self::Absent(k) => !labels.contains_key(k),
        }
    }
}

/// A parsed `NodeQuery`: every part must hold (an empty one holds for every node).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeFilter {
    states: Vec<NodeState>,
    image: Option<String>,
    labels: Vec<Requirement>,
    /// Lower case; found in the MAC, the hostname or a label value.
    search: Option<String>,
}

fn key(k: &str, whole: &str) -> Result<String, String> {
    let k = k.trim();
    if k.is_empty() {
        return Err(format!("selector {whole:?}: a requirement names no label"));
    }
    Ok(k.to_string())
}

impl NodeFilter {
    /// Parses the query; an unknown state or a malformed selector is an error that says
    /// which part.
    pub fn parse(q: &NodeQuery) -> Result<Self, String> {
        let mut f = Self::default();
        for s in q.state.iter().flat_map(|s| s.split(',')).map(str::trim) {
            let state = NodeState::parse(s).ok_or_else(|| {
                let all: Vec<&str> = NodeState::ALL.iter().map(|s| s.as_str()).collect();
                format!("state {s:?} is not a node state ({})", all.join(", "))
            })?;
            f.states.push(state);
        }
        f.image = q.image.clone().filter(|i| !i.is_empty());
        f.search =
            q.q.as_deref()
                .map(|t| t.trim().to_lowercase())
                .filter(|t| !t.is_empty());
        let whole = q.selector.as_deref().unwrap_or("");
        for part in whole.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let req = if let Some((k, v)) = part.split_once("!=") {
                Requirement::NotEquals(key(k, whole)?, v.trim().to_string())
            } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                Requirement::Equals(key(k, whole)?, v.trim().to_string())
            } else if let Some(k) = part.strip_prefix('!') {
                Requirement::Absent(key(k, whole)?)
            } else {
                Requirement::Exists(key(part, whole)?)
            };
            f.labels.push(req);
        }
        Ok(f)
    }

    pub fn matches(&self, node: &Node) -> bool {
        (self.states.is_empty() || self.states.contains(&node.state))
            && self
                .image
                .as_ref()
                .is_none_or(|i| node.assigned.as_ref() == Some(i))
            && self.labels.iter().all(|r| r.holds(&node.labels))
            && self.search.as_deref().is_none_or(|t| found(t, node))
    }
}

/// `text` (lower case) in the node's MAC (either spelling), hostname or a label value.
fn found(text: &str, node: &Node) -> bool {
    let mac = node.mac.to_string();
    mac.contains(text)
        || mac.replace(':', "-").contains(text)
        || node
            .hostname
            .as_deref()
            .is_some_and(|h| h.to_lowercase().contains(text))
        || node
            .labels
            .values()
            .any(|v| v.to_lowercase().contains(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(state: NodeState, image: Option<&str>, labels: &[(&str, &str)]) -> Node {
        Node {
            mac: "52:54:00:00:00:01".parse().unwrap(),
            uuid: None,
            hostname: None,
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            assigned: image.map(String::from),
            state,
            state_reason: String::new(),
            version: 1,
            created_at: String::new(),
            updated_at: String::new(),
            bmc: None,
        }
    }

    fn filter(state: Option<&str>, image: Option<&str>, selector: Option<&str>) -> NodeFilter {
        NodeFilter::parse(&NodeQuery {
            state: state.map(String::from),
            image: image.map(String::from),
            selector: selector.map(String::from),
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn search_finds_text_in_the_mac_hostname_or_a_label_value() {
        let mut n = node(NodeState::Ready, None, &[("rack", "R12")]);
        n.hostname = Some("gpu-node-7".into());
        let search = |q: &str| {
            NodeFilter::parse(&NodeQuery {
                q: Some(q.into()),
                ..Default::default()
            })
            .unwrap()
            .matches(&n)
        };
        assert!(search("52:54:00"));
        assert!(search("52-54-00-00-00-01"));
        assert!(search("NODE-7"));
        assert!(search("r12"));
        assert!(
            !search("rack"),
            "keys are not searched: a selector names them"
        );
        assert!(!search("gpu-node-8"));
    }

    #[test]
    fn every_part_of_a_filter_must_hold() {
        let a = node(
            NodeState::Ready,
            Some("demo:stable"),
            &[("rack", "r1"), ("gpu", "h100")],
        );
        let b = node(
            NodeState::ValidationFailed,
            Some("demo:2"),
            &[("rack", "r2"), ("drain", "yes")],
        );
        let c = node(NodeState::Discovered, None, &[]);
        let pick = |f: &NodeFilter| {
            [("a", &a), ("b", &b), ("c", &c)]
                .into_iter()
                .filter(|(_, n)| f.matches(n))
                .map(|(name, _)| name)
                .collect::<Vec<_>>()
        };
        assert_eq!(pick(&filter(None, None, None)), ["a", "b", "c"]);
        assert_eq!(
            pick(&filter(Some("ready,validation-failed"), None, None)),
            ["a", "b"]
        );
        assert_eq!(pick(&filter(None, Some("demo:2"), None)), ["b"]);
        assert_eq!(pick(&filter(None, None, Some("rack=r1"))), ["a"]);
        assert_eq!(pick(&filter(None, None, Some("rack==r2"))), ["b"]);
        assert_eq!(pick(&filter(None, None, Some("rack!=r1"))), ["b", "c"]);
        assert_eq!(pick(&filter(None, None, Some("gpu"))), ["a"]);
        assert_eq!(pick(&filter(None, None, Some("!drain, rack"))), ["a"]);
        assert_eq!(
            pick(&filter(Some("ready"), None, Some("rack=r2"))),
            Vec::<&str>::new()
        );
    }

    #[test]
    fn a_bad_state_or_selector_says_what_is_wrong() {
        let err = |q: NodeQuery| NodeFilter::parse(&q).unwrap_err();
        let e = err(NodeQuery {
            state: Some("redy".into()),
            ..Default::default()
        });
        assert!(e.contains("\"redy\"") && e.contains("ready"), "{e}");
        let e = err(NodeQuery {
            selector: Some("=r1".into()),
            ..Default::default()
        });
        assert!(e.contains("names no label"), "{e}");
    }
}
