//! `bootfleet rollout ...`: start a rollout, follow it, and pause, resume, abort or roll
//! it back.

use clap::{Args, Subcommand};
use reqwest::Method;

use super::client::Client;
use super::output::{OutputFormat, emit};
use crate::api::rollout::{
    OnFailure, Rollout, RolloutAction, RolloutRequest, RolloutSummary, StepStatus,
};

#[derive(Debug, Subcommand)]
pub enum RolloutCommand {
    /// Roll REF out to the nodes a selector matches, in waves: each node drained from its
    /// scheduler, reimaged, and done once ready (attested and validated) on REF's digest.
    Start(StartArgs),
    /// Every rollout, newest first.
    List,
    /// One rollout: its state, each wave's progress, each node's status and reason.
    Show {
        /// The rollout's number.
        id: i64,
    },
    /// Start no more nodes (those in flight finish); `resume` goes on.
    Pause(ActionArgs),
    /// Go on with a paused rollout.
    Resume(ActionArgs),
    /// Stop for good: nodes stay where they are; the nodes are free for another rollout.
    Abort(ActionArgs),
    /// Reimage every node the rollout reimaged back onto the image it ran before.
    Rollback(ActionArgs),
}

#[derive(Debug, Args)]
pub struct StartArgs {
    /// The image: sha256:<hex>, NAME:VERSION or NAME:TAG (resolved once, at start).
    pub image: String,
    /// The nodes whose labels match (k=v, k!=v, k, !k, comma-separated), chosen at start.
    #[arg(long, short = 'l', required_unless_present = "node")]
    pub selector: Option<String>,
    /// A node by MAC instead of a selector (repeatable).
    #[arg(long = "node", value_name = "MAC", conflicts_with = "selector")]
    pub node: Vec<crate::api::Mac>,
    /// Nodes in the first wave; the rest wait until they are done.
    #[arg(long, default_value_t = 0)]
    pub canary: u32,
    /// Nodes per later wave: a count (10) or a share of the nodes (10%).
    #[arg(long, default_value = "10%")]
    pub wave: String,
    /// Nodes this rollout takes out of service at once.
    #[arg(long, default_value_t = 1)]
    pub max_unavailable: u32,
    /// Pause once the canaries are done.
    #[arg(long)]
    pub pause_after_canary: bool,
    /// How long a node has to be ready on the new image: 90s, 20m, 2h.
    #[arg(long, default_value = "20m", value_parser = parse_duration)]
    pub timeout: u64,
    /// Failed nodes tolerated before the rollout halts.
    #[arg(long, default_value_t = 0)]
    pub max_failures: u32,
    /// Past max-failures: halt, or halt and roll the failed nodes back.
    #[arg(long, default_value = "halt", value_parser = parse_on_failure)]
    pub on_failure: OnFailure,
    /// Why (in every node's history and the event log).
    #[arg(long)]
    pub reason: String,
}

#[derive(Debug, Args)]
pub struct ActionArgs {
    /// The rollout's number.
    pub id: i64,
    /// Why (in the event log).
    #[arg(long)]
    pub reason: String,
}

/// Seconds from `90s`, `20m`, `2h` or a bare number of seconds.
fn parse_duration(s: &str) -> Result<u64, String> {
    let (n, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (90s, 20m, 2h)"))?;
    let scale = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err(format!("{s:?}: the unit is s, m or h")),
    };
    Ok(n * scale)
}

fn parse_on_failure(s: &str) -> Result<OnFailure, String> {
    OnFailure::parse(s).ok_or_else(|| format!("{s:?} is halt or rollback"))
}

pub async fn run(cmd: RolloutCommand, client: &Client, out: OutputFormat) -> anyhow::Result<()> {
    let act = |id: i64, verb: &'static str, reason: String| async move {
        let req = client
            .request(Method::POST, &format!("/api/v1/rollouts/{id}/{verb}"))
            .json(&RolloutAction { reason });
        client.send::<Rollout>(req).await
    };
    let rollout = match cmd {
        RolloutCommand::Start(a) => {
            let body = RolloutRequest {
                image: a.image,
                selector: a.selector.unwrap_or_default(),
                nodes: a.node,
                canary: a.canary,
                wave: a.wave,
                max_unavailable: a.max_unavailable,
                pause_after_canary: a.pause_after_canary,
                timeout_secs: a.timeout,
                max_failures: a.max_failures,
                on_failure: a.on_failure,
                reason: a.reason,
            };
            let req = client.request(Method::POST, "/api/v1/rollouts").json(&body);
            client.send::<Rollout>(req).await?
        }
        RolloutCommand::List => {
            let list: Vec<RolloutSummary> = client
                .send(client.request(Method::GET, "/api/v1/rollouts"))
                .await?;
            return emit(out, &list, |list| {
                println!(
                    "{:<5} {:<13} {:<24} {:<24} {:>6} {:>6} {:>6}",
                    "ID", "STATE", "IMAGE", "SELECTOR", "NODES", "DONE", "FAILED"
                );
                for r in list {
                    println!(
                        "{:<5} {:<13} {:<24} {:<24} {:>6} {:>6} {:>6}",
                        r.id,
                        r.state.as_str(),
                        r.image,
                        r.selector,
                        r.nodes,
                        r.done,
                        r.failed
                    );
                }
            });
        }
        RolloutCommand::Show { id } => {
            client
                .send(client.request(Method::GET, &format!("/api/v1/rollouts/{id}")))
                .await?
        }
        RolloutCommand::Pause(a) => act(a.id, "pause", a.reason).await?,
        RolloutCommand::Resume(a) => act(a.id, "resume", a.reason).await?,
        RolloutCommand::Abort(a) => act(a.id, "abort", a.reason).await?,
        RolloutCommand::Rollback(a) => act(a.id, "rollback", a.reason).await?,
    };
    emit(out, &rollout, print)
}

fn print(r: &Rollout) {
    println!(
        "rollout {}: {} ({})",
        r.id,
        r.state.as_str(),
        r.state_reason
    );
    println!("  image     {} = {}", r.spec.image, r.digest);
    println!("  selector  {}", r.spec.selector);
    println!("  reason    {}", r.spec.reason);
    println!("  waves (now {}):", r.wave);
    for w in &r.waves {
        let counts: Vec<String> = w.counts.iter().map(|(s, n)| format!("{n} {s}")).collect();
        let name = if w.canary {
            format!("{} (canary)", w.wave)
        } else {
            w.wave.to_string()
        };
        println!(
            "    {name:<12} {:>4} node(s): {}",
            w.nodes,
            counts.join(", ")
        );
    }
    println!("  nodes:");
    for n in &r.nodes {
        let why = if n.reason.is_empty() || n.status == StepStatus::Pending {
            String::new()
        } else {
            format!("  {}", n.reason)
        };
        println!(
            "    {}  wave {:<3} {:<16}{why}",
            n.mac,
            n.wave,
            n.status.as_str()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s"), Ok(90));
        assert_eq!(parse_duration("20m"), Ok(1200));
        assert_eq!(parse_duration("2h"), Ok(7200));
        assert_eq!(parse_duration("45"), Ok(45));
        assert!(parse_duration("1d").is_err());
        assert!(parse_duration("m").is_err());
    }
}
