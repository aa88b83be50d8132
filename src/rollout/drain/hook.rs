//! A scheduler behind an operator's command: `COMMAND drain|status|resume`, with the node
//! in the environment (BOOTFLEET_NODE_MAC, BOOTFLEET_NODE_HOSTNAME, BOOTFLEET_NODE_LABELS
//! as JSON, BOOTFLEET_REASON). `status` prints `drained`, `draining` or `not-draining`;
//! any other answer, or a failed exit, is an error. Run without a shell: nothing of the
//! node's (its labels are the admin's, its hostname the node's) reaches a command line;
//! and with none of the server's environment but PATH, LANG, HOME, TZ, KUBECONFIG and
//! SLURM_CONF.

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::{Drain, DrainError, Scheduler, Target, run};

/// `[drain.hook]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HookSettings {
    /// The program (an absolute path), run with the action as its one argument.
    pub command: std::path::PathBuf,
    #[serde(default = "default_timeout_secs")]
    pub timeout_secs: u64,
}

fn default_timeout_secs() -> u64 {
    60
}

pub struct Hook {
    settings: HookSettings,
}

impl Hook {
    pub fn new(settings: HookSettings) -> Self {
        Self { settings }
    }

    async fn call(&self, action: &str, node: &Target, reason: &str) -> Result<String, DrainError> {
        let mut cmd = tokio::process::Command::new(&self.settings.command);
        super::clean_env(&mut cmd);
        cmd.arg(action)
            .env("BOOTFLEET_NODE_MAC", node.mac.to_string())
            .env(
                "BOOTFLEET_NODE_HOSTNAME",
                node.hostname.as_deref().unwrap_or(""),
            )
            .env(
                "BOOTFLEET_NODE_LABELS",
                serde_json::to_string(&node.labels).expect("labels serialise"),
            )
            .env("BOOTFLEET_REASON", reason);
        let what = format!("drain hook {} {action}", self.settings.command.display());
        run(cmd, &what, Duration::from_secs(self.settings.timeout_secs)).await
    }
}

/// The hook's answer to `status`.
pub fn parse_status(out: &str) -> Result<Drain, DrainError> {
    match out.split_whitespace().next().and_then(Drain::from_word) {
        Some(drain) => Ok(drain),
        None => Err(DrainError(format!(
            "drain hook status answered {:?}, not drained, draining or not-draining",
            out.chars().take(100).collect::<String>()
        ))),
    }
}

#[async_trait]
impl Scheduler for Hook {
    async fn drain(&self, node: &Target, reason: &str) -> Result<(), DrainError> {
        self.call("drain", node, reason).await.map(drop)
    }
    async fn state(&self, node: &Target) -> Result<Drain, DrainError> {
        parse_status(&self.call("status", node, "").await?)
    }
    async fn resume(&self, node: &Target, reason: &str) -> Result<(), DrainError> {
        self.call("resume", node, reason).await.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_answers() {
        assert_eq!(parse_status("drained\n").unwrap(), Drain::Drained);
        assert_eq!(
            parse_status("draining 3 pods left").unwrap(),
            Drain::Draining
        );
        assert_eq!(parse_status("not-draining").unwrap(), Drain::NotDraining);
        assert!(parse_status("").is_err());
        assert!(parse_status("yes").is_err());
    }
}
