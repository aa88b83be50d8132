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
    // The field is named only for a difference: a heartbeat's facts are compared whole,
    // and most are the same as at boot.
    let mut diff = |field: &dyn Fn() -> String, was: &str, now: &str| {
        if was != now {
            out.push(Difference {
                field: field(),
                was: was.into(),
                now: now.into(),
            })
        }
    };
    if let Some(k) = &facts.kernel_release {
        diff(&|| "kernel_release".into(), &baseline.kernel_release, k);
    }
    if let Some(c) = &facts.cmdline {
        diff(&|| "cmdline".into(), baseline.cmdline.trim(), c.trim());
    }
    let absent = "(absent)";
    let maps = [
        ("versions", &baseline.versions, &facts.versions),
        ("modules", &*baseline.modules, &facts.modules),
    ];
    for (name, was, now) in maps {
        if now.is_empty() || was == now {
            continue; // not reported this time, or the same
        }
        let keys: BTreeSet<&String> = was.keys().chain(now.keys()).collect();
        for k in keys {
            diff(
                &|| format!("{name}.{k}"),
                was.get(k).map_or(absent, String::as_str),
                now.get(k).map_or(absent, String::as_str),
            );
        }
    }
    // The list's digest in its place: the same list, or one that cannot be named here.
    if let (true, Some(now)) = (facts.modules.is_empty(), &facts.modules_sha256) {
        diff(
            &|| "modules".into(),
            &baseline.modules_sha256.to_string(),
            &now.to_string(),
        );
    }
    if let (Some(was), Some(now)) = (&baseline.gpus, &facts.gpus) {
        let was: BTreeSet<&String> = was.iter().collect();
        let now: BTreeSet<&String> = now.iter().collect();
        for gone in was.difference(&now) {
            diff(&|| "gpus".into(), gone, absent);
        }
        for new in now.difference(&was) {
            diff(&|| "gpus".into(), absent, new);
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
    fn a_module_lists_digest_stands_for_it() {
        let mut f = same();
        let list = std::mem::take(&mut f.modules);
        f.modules_sha256 = Some(modules_digest(&list));
        assert_eq!(compare(&baseline(), &f), vec![], "the baseline's list");
        let mut other = list.clone();
        other.insert("nouveau".into(), "".into());
        f.modules_sha256 = Some(modules_digest(&other));
        let d: Vec<String> = compare(&baseline(), &f)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            d,
            [format!(
                "modules: was {}, now {}",
                modules_digest(&list),
                modules_digest(&other)
            )]
        );
        // A list sent whole is compared whole, whatever digest comes with it.
        f.modules = list;
        assert_eq!(compare(&baseline(), &f), vec![]);
    }

    #[test]
    fn unchanged_or_unreported_facts_are_no_drift() {
        assert_eq!(compare(&baseline(), &same()), vec![]);
        assert_eq!(compare(&baseline(), &NodeFacts::default()), vec![]);
    }

    #[test]
    fn every_change_is_named() {
        let mut f = same();
        f.versions
            .insert("nvidia-driver".into(), "535.104.05".into());
        f.modules.remove("nvidia");
        f.modules.insert("nouveau".into(), "1".into());
        f.gpus = Some(vec!["GPU-a".into()]);
        let d: Vec<String> = compare(&baseline(), &f)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            d,
            [
                "versions.nvidia-driver: was 550.127.05, now 535.104.05",
                "modules.nouveau: was (absent), now 1",
                "modules.nvidia: was 550.127.05, now (absent)",
                "gpus: was GPU-b, now (absent)",
            ]
        );
    }
}
