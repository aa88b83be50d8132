//! Drift judgement, pure: does what a ready node reports now differ from what it attested
//! and validated (kernel, command line, versions, modules, GPU inventory)? Each difference
//! is named, so the drifted state says what changed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::api::Digest;
use crate::api::agent::{Difference, NodeFacts, modules_digest};

/// What the node was at attestation and validation.
#[derive(Debug, Clone)]
pub struct Baseline {
    pub kernel_release: String,
    pub cmdline: String,
    pub versions: BTreeMap<String, String>,
    /// Every loaded module (a hundred or more on a GPU server): shared between the
    /// baselines that list the same ones (`heartbeat::Baselines`).
    pub modules: Arc<BTreeMap<String, String>>,
    /// `modules`' digest (`api::agent::modules_digest`): a heartbeat may send it alone.
    pub modules_sha256: Digest,
    /// GPU UUIDs validated; None when the boot was not validated.
    pub gpus: Option<Vec<String>>,
}

impl Baseline {
    /// A baseline of `modules` and the rest; GPUs are added by validation.
    pub fn new(
        kernel_release: String,
        cmdline: String,
        versions: BTreeMap<String, String>,
        modules: BTreeMap<String, String>,
        gpus: Option<Vec<String>>,
    ) -> Self {
        let modules_sha256 = modules_digest(&modules);
        Self {
            kernel_release,
            cmdline,
            versions,
            modules: Arc::new(modules),
            modules_sha256,
            gpus,
        }
    }
}

/// Differences between `facts` and `baseline`, for what `facts` reports. A version or
/// module that was there and is gone counts; one never seen before counts too.
pub fn compare(baseline: &Baseline, facts: &NodeFacts) -> Vec<Difference> {
    let mut out = Vec::new();
    let mut diff = |field: String, was: &str, now: &str| {
        if was != now {
            out.push(Difference {
                field,
                was: was.into(),
                now: now.into(),
            })
        }
    };
    if let Some(k) = &facts.kernel_release {
        diff("kernel_release".into(), &baseline.kernel_release, k);
    }
    if let Some(c) = &facts.cmdline {
        diff("cmdline".into(), baseline.cmdline.trim(), c.trim());
    }
    let absent = "(absent)";
    let maps = [
        ("versions", &baseline.versions, &facts.versions),
        ("modules", &*baseline.modules, &facts.modules),
    ];
    for (name, was, now) in maps {
        // Not reported this time, or the same: a heartbeat's maps mostly are, and a GPU
        // server's module list is a hundred keys or more to name one by one.
        if now.is_empty() || was == now {
            continue;
        }
        let keys: BTreeSet<&String> = was.keys().chain(now.keys()).collect();
        for k in keys {
            diff(
                format!("{name}.{k}"),
                was.get(k).map_or(absent, String::as_str),
                now.get(k).map_or(absent, String::as_str),
            );
        }
    }
    // A digest in the list's place is not compared here: the answer names the baseline's
    // digest, and an agent whose list has another sends its list next, which names what
    // differs (a digest alone could not, and a drift policy may reimage on it).
    if let (Some(was), Some(now)) = (&baseline.gpus, &facts.gpus) {
        let was: BTreeSet<&String> = was.iter().collect();
        let now: BTreeSet<&String> = now.iter().collect();
        for gone in was.difference(&now) {
            diff("gpus".into(), gone, absent);
        }
        for new in now.difference(&was) {
            diff("gpus".into(), absent, new);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn baseline() -> Baseline {
        Baseline::new(
            "6.1.0-28-cloud-amd64".into(),
            "console=ttyS0 bootfleet.boot=b1".into(),
            BTreeMap::from([("nvidia-driver".into(), "550.127.05".into())]),
            BTreeMap::from([("nvidia".into(), "550.127.05".into())]),
            Some(vec!["GPU-a".into(), "GPU-b".into()]),
        )
    }

    fn same() -> NodeFacts {
        NodeFacts {
            kernel_release: Some("6.1.0-28-cloud-amd64".into()),
            cmdline: Some("console=ttyS0 bootfleet.boot=b1\n".into()),
            versions: BTreeMap::from([("nvidia-driver".into(), "550.127.05".into())]),
            modules: BTreeMap::from([("nvidia".into(), "550.127.05".into())]),
            modules_sha256: None,
            gpus: Some(vec!["GPU-b".into(), "GPU-a".into()]),
        }
    }

    #[test]
    fn a_module_lists_digest_in_its_place_is_not_a_drift() {
        let mut f = same();
        let list = std::mem::take(&mut f.modules);
        f.modules_sha256 = Some(modules_digest(&list));
        assert_eq!(compare(&baseline(), &f), vec![], "the baseline's list");
        // Another digest: the agent is told the baseline's and sends its list next.
        let mut other = list.clone();
        other.insert("nouveau".into(), "".into());
        f.modules_sha256 = Some(modules_digest(&other));
        assert_eq!(compare(&baseline(), &f), vec![]);
        // The list itself names what differs, whatever digest comes with it.
        f.modules = other;
        let d: Vec<String> = compare(&baseline(), &f)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(d, ["modules.nouveau: was (absent), now "]);
    }
}
