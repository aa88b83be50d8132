//! Slurm through `scontrol`: `State=DRAIN` with the rollout's reason, drained once the
//! node's state is IDLE or DOWN with the DRAIN flag and nothing completing, `State=RESUME`
//! after. scontrol rather than slurmrestd: it is on every Slurm host, needs no token
//! service, and reads the same slurm.conf as the site's own tools (SLURM_CONF from the
//! server's environment, or `[drain.slurm] conf`).

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::{Drain, DrainError, Scheduler, Target, run};

/// `[drain.slurm]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlurmSettings {
    /// The scontrol to run.
    pub scontrol: String,
    /// A slurm.conf other than the default (sets SLURM_CONF for scontrol).
    pub conf: Option<std::path::PathBuf>,
    /// The node label that holds the node's Slurm NodeName; without it, its hostname.
    pub node_label: String,
}

impl Default for SlurmSettings {
    fn default() -> Self {
        Self {
            scontrol: "scontrol".into(),
            conf: None,
            node_label: "slurm-node".into(),
        }
    }
}

const DEADLINE: Duration = Duration::from_secs(30);

pub struct Slurm {
    settings: SlurmSettings,
}

/// Where a node stands, from `scontrol show node -o`'s `State=BASE+FLAG+...`.
pub fn parse_state(show: &str) -> Result<Drain, DrainError> {
    let state = show
        .split_whitespace()
        .find_map(|w| w.strip_prefix("State="))
        .ok_or_else(|| DrainError(format!("no State= in scontrol's answer: {show:.200}")))?;
    let mut parts = state.split('+');
    let base = parts.next().unwrap_or("");
    let flags: Vec<&str> = parts.collect();
    if !flags.contains(&"DRAIN") {
        return Ok(Drain::NotDraining);
    }
    // A drained node is idle (or down); ALLOCATED or MIXED still run jobs, and a
    // COMPLETING node is still tearing one down.
    let idle = matches!(base, "IDLE" | "DOWN");
    Ok(if idle && !flags.contains(&"COMPLETING") {
        Drain::Drained
    } else {
        Drain::Draining
    })
}

/// Whether the node's drain reason is ours (`Reason=bootfleet: ...`).
pub fn drained_by_us(show: &str) -> bool {
    show.split_once(" Reason=")
        .or_else(|| show.strip_prefix("Reason=").map(|r| ("", r)))
        .is_some_and(|(_, r)| r.starts_with("bootfleet:"))
}

impl Slurm {
    pub fn new(settings: SlurmSettings) -> Self {
        Self { settings }
    }

    fn name<'a>(&self, node: &'a Target) -> Result<&'a str, DrainError> {
        node.labels
            .get(&self.settings.node_label)
            .or(node.hostname.as_ref())
            .map(String::as_str)
            // One node: a hostlist (`gpu[01-64]`, `a,b`) would drain many.
            .filter(|n| {
                !n.is_empty() && !n.contains(|c: char| c.is_whitespace() || c == '[' || c == ',')
            })
            .ok_or_else(|| {
                DrainError(format!(
                    "node {} has no Slurm name: label it {}=NAME or give it a hostname",
                    node.mac, self.settings.node_label
                ))
            })
    }

    async fn scontrol(&self, args: &[&str]) -> Result<String, DrainError> {
        let mut cmd = tokio::process::Command::new(&self.settings.scontrol);
        super::clean_env(&mut cmd);
        cmd.args(args);
        if let Some(conf) = &self.settings.conf {
            cmd.env("SLURM_CONF", conf);
        }
        run(cmd, &format!("scontrol {}", args.join(" ")), DEADLINE).await
    }
}

#[async_trait]
impl Scheduler for Slurm {
    async fn drain(&self, node: &Target, reason: &str) -> Result<(), DrainError> {
        let name = self.name(node)?;
        let reason = format!("Reason=bootfleet: {reason}");
        self.scontrol(&[
            "update",
            &format!("NodeName={name}"),
            "State=DRAIN",
            &reason,
        ])
        .await
        .map(drop)
    }

    async fn state(&self, node: &Target) -> Result<Drain, DrainError> {
        let name = self.name(node)?;
        parse_state(&self.scontrol(&["show", "node", name, "--oneliner"]).await?)
    }

    async fn resume(&self, node: &Target, _reason: &str) -> Result<(), DrainError> {
        // RESUME on a node that is not drained is an error to scontrol: look first. And
        // only our own drain is undone: a node an operator drained (a hardware ticket)
        // stays drained.
        let name = self.name(node)?;
        let show = self.scontrol(&["show", "node", name, "--oneliner"]).await?;
        if parse_state(&show)? == Drain::NotDraining || !drained_by_us(&show) {
            return Ok(());
        }
        self.scontrol(&["update", &format!("NodeName={name}"), "State=RESUME"])
            .await
            .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_as_scontrol_prints_them() {
        let show = |s: &str| parse_state(&format!("NodeName=n1 Arch=x86_64 State={s} CPUTot=2"));
        assert_eq!(show("IDLE").unwrap(), Drain::NotDraining);
        assert_eq!(show("ALLOCATED").unwrap(), Drain::NotDraining);
        assert_eq!(show("ALLOCATED+DRAIN").unwrap(), Drain::Draining);
        assert_eq!(show("MIXED+DRAIN").unwrap(), Drain::Draining);
        assert_eq!(show("IDLE+COMPLETING+DRAIN").unwrap(), Drain::Draining);
        assert_eq!(show("IDLE+DRAIN").unwrap(), Drain::Drained);
        assert_eq!(show("DOWN+DRAIN+NOT_RESPONDING").unwrap(), Drain::Drained);
        assert!(parse_state("slurm_load_node error").is_err());
        assert!(drained_by_us(
            "NodeName=n1 State=IDLE+DRAIN Reason=bootfleet: rollout 3 [root@2026-12-05T17:00:00]"
        ));
        assert!(!drained_by_us(
            "NodeName=n1 State=IDLE+DRAIN Reason=bad DIMM, ticket 4711 [ops@2026-12-05T17:00:00]"
        ));
        assert!(!drained_by_us("NodeName=n1 State=IDLE"));
    }
}
