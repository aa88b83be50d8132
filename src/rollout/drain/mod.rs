//! Workload schedulers: before a rollout reimages a node it asks the node's scheduler to
//! drain it (no new work; running work ends), waits until it is drained, and hands the
//! node back after it is ready again. Which scheduler a node has is its label
//! (`[drain] label`, default `scheduler`): `slurm` (`slurm.rs`, scontrol), `hook`
//! (`hook.rs`, an operator's command, e.g. the kubectl example in `deploy/drain/`) or
//! `webhook` (`webhook.rs`, signed calls to an operator's endpoint). A node without the
//! label is not drained.

pub mod hook;
pub mod slurm;
pub mod webhook;

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::api::Mac;
use crate::rollout::plan::{DrainRules, DrainTimeout};
use crate::store::NodeRecord;

/// The node as a scheduler driver sees it.
#[derive(Debug, Clone)]
pub struct Target {
    pub mac: Mac,
    pub hostname: Option<String>,
    pub labels: BTreeMap<String, String>,
}

impl From<&NodeRecord> for Target {
    /// The host name is the node's, else its `hostname` label (where operators keep it).
    fn from(n: &NodeRecord) -> Self {
        Self {
            mac: n.mac,
            hostname: n
                .hostname
                .clone()
                .or_else(|| n.labels.get("hostname").cloned()),
            labels: n.labels.clone(),
        }
    }
}

/// What a scheduler's program may see of the server's environment: nothing else (the
/// server's may hold a store URL with its password, or an admin token).
pub(crate) fn clean_env(cmd: &mut tokio::process::Command) {
    cmd.env_clear();
    for key in ["PATH", "LANG", "HOME", "KUBECONFIG", "SLURM_CONF", "TZ"] {
        if let Some(v) = std::env::var_os(key) {
            cmd.env(key, v);
        }
    }
}

/// Where a node's drain stands, as its scheduler says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drain {
    /// Not asked to drain (or resumed by someone since): ask again.
    NotDraining,
    /// No new work; work still runs.
    Draining,
    /// Nothing runs: it may be reimaged.
    Drained,
}

impl Drain {
    /// The word a hook or a webhook answers `status` with: `drained`, `draining` or
    /// `not-draining`.
    pub fn from_word(word: &str) -> Option<Drain> {
        match word {
            "drained" => Some(Drain::Drained),
            "draining" => Some(Drain::Draining),
            "not-draining" => Some(Drain::NotDraining),
            _ => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DrainError(pub String);

#[async_trait]
pub trait Scheduler: Send + Sync {
    /// Asks for the drain; asking again is harmless.
    async fn drain(&self, node: &Target, reason: &str) -> Result<(), DrainError>;
    async fn state(&self, node: &Target) -> Result<Drain, DrainError>;
    /// Hands the node back to the scheduler; harmless when it is not drained.
    async fn resume(&self, node: &Target, reason: &str) -> Result<(), DrainError>;
}

/// `[drain]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DrainSettings {
    /// The node label whose value names the node's scheduler (`slurm`, `hook`).
    pub label: String,
    /// Seconds a drain may take before `on_timeout` applies.
    pub timeout_secs: u64,
    pub on_timeout: DrainTimeout,
    /// Nodes drained at once for a health rule's revalidation; more wait their turn, so
    /// a rule that trips fleet-wide (a bad threshold) cannot empty the scheduler.
    pub revalidations_at_once: usize,
    pub slurm: slurm::SlurmSettings,
    pub hook: Option<hook::HookSettings>,
    pub webhook: Option<webhook::WebhookSettings>,
}

impl Default for DrainSettings {
    fn default() -> Self {
        Self {
            label: "scheduler".into(),
            timeout_secs: 3600,
            on_timeout: DrainTimeout::Skip,
            revalidations_at_once: 8,
            slurm: Default::default(),
            hook: None,
            webhook: None,
        }
    }
}

impl DrainSettings {
    pub fn rules(&self) -> DrainRules {
        DrainRules {
            timeout_ms: i64::try_from(self.timeout_secs.saturating_mul(1000)).unwrap_or(i64::MAX),
            on_timeout: self.on_timeout,
        }
    }
}

/// The scheduler drivers, picked per node by label.
pub struct Schedulers {
    label: String,
    slurm: slurm::Slurm,
    hook: Option<hook::Hook>,
    webhook: Option<webhook::Webhook>,
}

impl Schedulers {
    /// The drivers `s` sets up; a webhook whose URL or secret is bad stops the start.
    pub fn load(s: &DrainSettings) -> Result<Self, DrainError> {
        Ok(Self {
            label: s.label.clone(),
            slurm: slurm::Slurm::new(s.slurm.clone()),
            hook: s.hook.clone().map(hook::Hook::new),
            webhook: s.webhook.as_ref().map(webhook::Webhook::load).transpose()?,
        })
    }

    /// The node's scheduler: None when it has none (no label); an error when the label
    /// names one that is not set up.
    pub fn of(&self, node: &NodeRecord) -> Result<Option<&dyn Scheduler>, DrainError> {
        match node.labels.get(&self.label).map(String::as_str) {
            None | Some("none") => Ok(None),
            Some("slurm") => Ok(Some(&self.slurm)),
            Some("hook") => match &self.hook {
                Some(h) => Ok(Some(h)),
                None => Err(DrainError(format!(
                    "{}=hook but [drain.hook] has no command",
                    self.label
                ))),
            },
            Some("webhook") => match &self.webhook {
                Some(w) => Ok(Some(w)),
                None => Err(DrainError(format!(
                    "{}=webhook but [drain.webhook] has no url",
                    self.label
                ))),
            },
            Some(other) => Err(DrainError(format!(
                "{}={other} names no scheduler (slurm, hook, webhook or none)",
                self.label
            ))),
        }
    }
}

/// Runs a scheduler's command with a deadline; its standard output, or why it failed
/// (its standard error, cut to 512 bytes: a scheduler's message, not a log).
pub(crate) async fn run(
    mut cmd: tokio::process::Command,
    what: &str,
    deadline: Duration,
) -> Result<String, DrainError> {
    cmd.stdin(std::process::Stdio::null()).kill_on_drop(true);
    let out = match tokio::time::timeout(deadline, cmd.output()).await {
        Err(_) => {
            return Err(DrainError(format!(
                "{what}: no answer within {} s",
                deadline.as_secs()
            )));
        }
        Ok(Err(e)) => return Err(DrainError(format!("{what}: cannot run it: {e}"))),
        Ok(Ok(out)) => out,
    };
    if !out.status.success() {
        let mut err = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if err.len() > 512 {
            let mut cut = 512;
            while !err.is_char_boundary(cut) {
                cut -= 1;
            }
            err.truncate(cut);
        }
        return Err(DrainError(format!("{what}: {} ({err})", out.status)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
