//! `bootfleet node ...`: list, show, assign, label, history, events, reimage and
//! revalidate nodes; power and bmc are in `cli::power`.

use std::collections::BTreeMap;

use clap::Subcommand;
use reqwest::Method;

use super::client::Client;
use super::output::{OutputFormat, emit};
use crate::api::Mac;
use crate::api::event::EventPage;
use crate::api::node::{
    AssignRequest, LabelRequest, Node, NodeDetail, NodeQuery, ReimageAccepted, ReimageRequest,
    RevalidateAccepted,
};
use crate::api::refs::ImageRef;

#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// List nodes with their state and assigned image; the filters given must all hold.
    List {
        /// Only nodes in these states, comma-separated (ready,validation-failed).
        #[arg(long)]
        state: Option<String>,
        /// Only nodes assigned this REF, exactly as assigned (demo:stable).
        #[arg(long)]
        image: Option<String>,
        /// Only nodes whose labels match: k=v, k!=v, k (has it), !k (has not), comma-separated.
        #[arg(long, short = 'l')]
        selector: Option<String>,
        /// Only nodes whose MAC, hostname or a label value contains this text.
        #[arg(long)]
        search: Option<String>,
    },
    /// Show one node (NODE is its MAC): state, labels, last boots, state history.
    Show {
        /// The node's MAC (52:54:00:12:34:56 or 52-54-00-12-34-56).
        node: String,
        /// Keep watching: show the node again each time it changes (Ctrl-C ends it).
        #[arg(long, short = 'w')]
        watch: bool,
        /// With --watch: how often to look.
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration, requires = "watch")]
        every: std::time::Duration,
        /// With --watch: end once the node is in this state (exit 0), e.g. ready.
        #[arg(long, requires = "watch", value_parser = node_state)]
        until: Option<crate::api::NodeState>,
    },
    /// Assign REF (sha256:<hex>, NAME:VERSION or NAME:TAG) to nodes: `assign NODE... REF`
    /// or `assign --selector S REF`. A tag is followed at each boot; an unknown MAC is
    /// registered.
    Assign {
        /// The nodes' MACs (52:54:00:12:34:56 or 52-54-00-12-34-56), then the image to
        /// boot: sha256:<hex> (or its first 8+ digits), NAME:VERSION or NAME:TAG.
        #[arg(required = true, value_name = "NODE... REF")]
        args: Vec<String>,
        /// Every node whose labels match instead of MACs (k=v, k!=v, k, !k).
        #[arg(long, short = 'l')]
        selector: Option<String>,
    },
    /// Remove nodes with their history and boots (the event log keeps a node.removed
    /// event). Refused for a node that runs a boot (provisioning to ready, reimaging,
    /// drifted) unless --force: power it off first, or let it become unreachable.
    Rm {
        /// The nodes' MACs (52:54:00:12:34:56 or 52-54-00-12-34-56); or --selector.
        nodes: Vec<String>,
        /// Every node whose labels match instead of MACs (k=v, k!=v, k, !k).
        #[arg(long, short = 'l')]
        selector: Option<String>,
        /// Remove even nodes that run a boot.
        #[arg(long)]
        force: bool,
        /// Why (recorded in the node.removed event).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Import an inventory: a CSV file with a header row naming mac, and image, labels
    /// (k=v separated by spaces or ';'), bmc (https://... for Redfish or
    /// ipmi://HOST[:PORT]) with bmc_credential, bmc_ca, bmc_fingerprint, bmc_insecure
    /// (yes/no). The whole file is checked first; then each node is given its BMC,
    /// assigned its image and given its labels, one result a node.
    Import {
        /// The CSV file.
        file: std::path::PathBuf,
        /// Check the file and show what would be done; send nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Set labels (key=value) and remove them (key-), for grouping by rack, SKU...
    Label {
        /// The node's MAC (52:54:00:12:34:56 or 52-54-00-12-34-56).
        node: String,
        /// key=value to set a label, key- to remove one.
        #[arg(required = true)]
        labels: Vec<String>,
    },
    /// The node's state changes, oldest first, with reasons.
    History {
        /// The node's MAC (52:54:00:12:34:56 or 52-54-00-12-34-56).
        node: String,
    },
    /// The node's events (transitions, refused reports), oldest first.
    Events {
        /// The node's MAC (52:54:00:12:34:56 or 52-54-00-12-34-56).
        node: String,
        /// Only events after this seq.
        #[arg(long, default_value_t = 0)]
        since: i64,
    },
    /// Ask the node's agent to validate again (GPUs, checks): its next heartbeat says so.
    Revalidate {
        /// The node's MAC (52:54:00:12:34:56 or 52-54-00-12-34-56).
        node: String,
    },
    /// Power status and actions through nodes' BMCs: `power status|on|off|soft-off|cycle
    /// NODE...` or `--selector`. Actions need --reason; off, soft-off and cycle count
    /// against the disruption budget (the node becomes reimaging until it boots again);
    /// on and cycle set a one-time network boot first and read it back.
    Power(super::power::PowerArgs),
    /// How a node's BMC is reached (Redfish or IPMI, and the credential's name).
    #[command(subcommand)]
    Bmc(super::power::BmcCommand),
    /// The endorsement key a node's TPM attests with: show it, register one (before the
    /// node's first boot, with [tpm] enrolment = "pre-registered", or a new board's),
    /// or forget it (the next boot enrols again).
    #[command(subcommand)]
    Tpm(TpmCommand),
    /// Ask for a reimage: the node's next heartbeat answers "reboot". Refused over the
    /// disruption budget (retry later); the same --idempotency-key gets the first answer.
    Reimage {
        /// The nodes' MACs (52:54:00:12:34:56 or 52-54-00-12-34-56); or --selector.
        nodes: Vec<String>,
        /// Every node whose labels match instead of MACs (k=v, k!=v, k, !k); each is
        /// asked in turn, and those over the budget are reported refused.
        #[arg(long, short = 'l')]
        selector: Option<String>,
        /// Why (recorded in the node's history and events), for example "XID 79 on GPU 3".
        #[arg(long)]
        reason: String,
        /// Also assign this REF first.
        #[arg(long)]
        image: Option<String>,
        /// A key for this request (a ticket number): a retry with the same key gets the
        /// first answer and changes nothing. With several nodes, each gets KEY/MAC.
        #[arg(long)]
        idempotency_key: Option<String>,
    },
}

fn mac(s: &str) -> anyhow::Result<Mac> {
    Ok(s.parse()?)
}

pub async fn run(cmd: NodeCommand, client: &Client, out: OutputFormat) -> anyhow::Result<()> {
    match cmd {
        NodeCommand::List {
            state,
            image,
            selector,
            search,
        } => {
            let query = NodeQuery {
                state,
                image,
                selector,
                q: search,
                ..Default::default()
            };
            let nodes: Vec<Node> = client
                .send(client.request(Method::GET, "/api/v1/nodes").query(&query))
                .await?;
            emit(out, &nodes, |nodes| print_nodes(nodes))
        }
        NodeCommand::Show {
            node, watch: false, ..
        } => {
            let d: NodeDetail = client
                .send(client.request(Method::GET, &format!("/api/v1/nodes/{}", mac(&node)?)))
                .await?;
            emit(out, &d, print_detail)
        }
        NodeCommand::Show {
            node, every, until, ..
        } => watch(client, out, mac(&node)?, every, until).await,
        NodeCommand::Assign { mut args, selector } => {
            let reference = args.pop().expect("clap requires one");
            let r = ImageRef::parse(&reference)?;
            let single = args.len() == 1 && selector.is_none();
            let nodes = super::bulk::targets(client, &args, selector).await?;
            let assign = |mac: Mac| {
                let req = client
                    .request(Method::PUT, &format!("/api/v1/nodes/{mac}/image"))
                    .json(&AssignRequest {
                        image: r.to_string(),
                    });
                async move { client.send::<Node>(req).await }
            };
            let line = |n: &Node| {
                format!(
                    "{} boots {} from its next boot",
                    n.mac,
                    n.assigned.as_deref().unwrap_or("-")
                )
            };
            if single {
                let n = assign(nodes[0]).await?;
                return emit(out, &n, |n| println!("{}", line(n)));
            }
            super::bulk::run_each(
                &nodes,
                out,
                |v| super::bulk::as_text(v, line),
                |mac| async move { Ok(serde_json::to_value(assign(mac).await?)?) },
            )
            .await
        }
        NodeCommand::Rm {
            nodes,
            selector,
            force,
            reason,
        } => {
            let targets = super::bulk::targets(client, &nodes, selector).await?;
            let remove = |mac: Mac| {
                let mut query = vec![("force", force.to_string())];
                if let Some(r) = &reason {
                    query.push(("reason", r.clone()));
                }
                let req = client
                    .request(Method::DELETE, &format!("/api/v1/nodes/{mac}"))
                    .query(&query);
                async move { client.send::<Node>(req).await }
            };
            let line = |n: &Node| format!("{}: removed (was {})", n.mac, n.state);
            super::bulk::run_each(
                &targets,
                out,
                |v| super::bulk::as_text(v, line),
                |mac| async move { Ok(serde_json::to_value(remove(mac).await?)?) },
            )
            .await
        }
        NodeCommand::Import { file, dry_run } => {
            super::import::run(client, &file, dry_run, out).await
        }
        NodeCommand::Label { node, labels } => {
            let request = parse_labels(&labels)?;
            let n: Node = client
                .send(
                    client
                        .request(
                            Method::PATCH,
                            &format!("/api/v1/nodes/{}/labels", mac(&node)?),
                        )
                        .json(&request),
                )
                .await?;
            emit(out, &n, |n| {
                println!("{}: {}", n.mac, labels_of(n).join(", "))
            })
        }
        NodeCommand::Reimage {
            nodes,
            selector,
            reason,
            image,
            idempotency_key,
        } => {
            if let Some(r) = &image {
                ImageRef::parse(r)?;
            }
            let single = nodes.len() == 1 && selector.is_none();
            let targets = super::bulk::targets(client, &nodes, selector).await?;
            let reimage = |mac: Mac| {
                let mut req = client
                    .request(Method::POST, &format!("/api/v1/nodes/{mac}/reimage"))
                    .json(&ReimageRequest {
                        reason: reason.clone(),
                        image: image.clone(),
                    });
                if let Some(key) = &idempotency_key {
                    let key = if single {
                        key.clone()
                    } else {
                        format!("{key}/{mac}")
                    };
                    req = req.header("idempotency-key", key);
                }
                async move { client.send::<ReimageAccepted>(req).await }
            };
            let line = |a: &ReimageAccepted| {
                format!("{}: {} ({})", a.node.mac, a.outcome, a.node.state_reason)
            };
            if single {
                let answer = reimage(targets[0]).await?;
                return emit(out, &answer, |a| println!("{}", line(a)));
            }
            super::bulk::run_each(
                &targets,
                out,
                |v| super::bulk::as_text(v, line),
                |mac| async move { Ok(serde_json::to_value(reimage(mac).await?)?) },
            )
            .await
        }
        NodeCommand::Power(args) => super::power::power(args, client, out).await,
        NodeCommand::Bmc(cmd) => super::power::bmc(cmd, client, out).await,
        NodeCommand::Tpm(cmd) => tpm(cmd, client, out).await,
        NodeCommand::Events { node, since } => {
            let page: EventPage = client
                .send(client.request(
                    Method::GET,
                    &format!(
                        "/api/v1/events?node={}&since={since}&limit=1000",
                        mac(&node)?
                    ),
                ))
                .await?;
            emit(out, &page, print_events)
        }
        NodeCommand::Revalidate { node } => {
            let answer: RevalidateAccepted = client
                .send(client.request(
                    Method::POST,
                    &format!("/api/v1/nodes/{}/revalidate", mac(&node)?),
                ))
                .await?;
            emit(out, &answer, |a| println!("{}: {}", a.node, a.outcome))
        }
        NodeCommand::History { node } => {
            let d: NodeDetail = client
                .send(client.request(Method::GET, &format!("/api/v1/nodes/{}", mac(&node)?)))
                .await?;
            emit(out, &d.history, |history| {
                for h in history {
                    let from = h
                        .from
                        .map(|s| s.to_string())
                        .unwrap_or_else(|| "(new)".into());
                    println!(
                        "{}  {} -> {}  {}{}",
                        h.at,
                        from,
                        h.to,
                        h.reason,
                        by(&h.actor)
                    );
                }
            })
        }
    }
}

fn labels_of(n: &Node) -> Vec<String> {
    n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect()
}

fn print_nodes(nodes: &[Node]) {
    println!("{:<18} {:<20} {:<28} LABELS", "NODE", "STATE", "ASSIGNED");
    for n in nodes {
        let labels = labels_of(n);
        println!(
            "{:<18} {:<20} {:<28} {}",
            n.mac,
            n.state,
            n.assigned.as_deref().unwrap_or("-"),
            labels.join(",")
        );
    }
}

/// A node, its recent boots as timelines, and its state history.
/// A state by its name, as the API spells it.
fn node_state(name: &str) -> Result<crate::api::NodeState, String> {
    crate::api::NodeState::parse(name).ok_or_else(|| {
        let names: Vec<&str> = crate::api::NodeState::ALL
            .iter()
            .map(|s| s.as_str())
            .collect();
        format!("not a node state; one of {}", names.join(", "))
    })
}

/// Shows the node each time it changes, until it is in `until` (or forever). On a
/// terminal each view replaces the last; piped, views follow each other, each after a
/// line with its time (JSON: one object a line).
async fn watch(
    client: &Client,
    out: OutputFormat,
    node: Mac,
    every: std::time::Duration,
    until: Option<crate::api::NodeState>,
) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let terminal = std::io::stdout().is_terminal();
    let mut last: Option<String> = None;
    loop {
        let d: NodeDetail = client
            .send(client.request(Method::GET, &format!("/api/v1/nodes/{node}")))
            .await?;
        let seen = serde_json::to_string(&d)?;
        if last.as_ref() != Some(&seen) {
            match out {
                OutputFormat::Json => println!("{seen}"),
                OutputFormat::Text if terminal => {
                    print!("\x1b[2J\x1b[H");
                    print_detail(&d);
                }
                OutputFormat::Text => {
                    println!(
                        "--- {}",
                        humantime::format_rfc3339_millis(std::time::SystemTime::now())
                    );
                    print_detail(&d);
                }
            }
            last = Some(seen);
        }
        if until == Some(d.node.state) {
            return Ok(());
        }
        tokio::time::sleep(every).await;
    }
}

fn print_detail(d: &NodeDetail) {
    let n = &d.node;
    println!("node:     {}", n.mac);
    println!("uuid:     {}", n.uuid.as_deref().unwrap_or("-"));
    println!("state:    {} ({})", n.state, n.state_reason);
    println!("assigned: {}", n.assigned.as_deref().unwrap_or("-"));
    let labels = labels_of(n);
    println!("labels:   {}", labels.join(", "));
    match &n.bmc {
        Some(b) => println!(
            "bmc:      {b} (credential {})",
            b.credential.as_deref().unwrap_or("-")
        ),
        None => println!("bmc:      -"),
    }
    if !d.power.is_empty() {
        println!("power (newest first):");
        for p in &d.power {
            println!(
                "  {}  {:<8} {:>7}ms  {}  ({})",
                p.at, p.action, p.took_ms, p.outcome, p.reason
            );
        }
    }
    if !d.preboot.is_empty() {
        println!("since the last boot script (BMC, DHCP, TFTP):");
        print_steps(&d.preboot);
    }
    if let Some(h) = &d.health {
        print_health(h);
    }
    println!("boots (newest first):");
    for b in &d.boots {
        let end = match &b.stopped_at {
            Some(step) => format!("stopped at {step}"),
            None => "reached ready".into(),
        };
        println!("  {}  boot {}  {}  ({end})", b.at, b.id, b.image);
        print_steps(&b.steps);
    }
    println!("history:");
    for h in &d.history {
        let from = h
            .from
            .map(|s| s.to_string())
            .unwrap_or_else(|| "(new)".into());
        println!(
            "  {}  {} -> {}  {}{}",
            h.at,
            from,
            h.to,
            h.reason,
            by(&h.actor)
        );
    }
}

/// The health verdicts that hold, then the newest readings a GPU a line.
fn print_health(h: &crate::api::health::NodeHealth) {
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    if h.verdicts.is_empty() {
        println!("health:   no verdicts (boot {})", h.boot_id);
    } else {
        println!("health (boot {}):", h.boot_id);
        for v in &h.verdicts {
            println!("  {}  {} -> {}: {}", v.at, v.rule, v.action, v.summary);
        }
    }
    let Some(r) = h.readings.last() else { return };
    println!("readings ({}):", r.at);
    for g in &r.gpus {
        let throttled = match &g.throttle_reasons {
            Some(t) if t.is_empty() => "none".to_string(),
            Some(t) => t.join("+"),
            None => "-".into(),
        };
        println!(
            "  gpu {:<2} {:>4}C {:>6}W {:>5}MHz  ecc {}/{}  xids {}  throttled {throttled}",
            g.index,
            opt(g.temperature_c.map(|t| t.to_string())),
            opt(g.power_w.map(|p| format!("{p:.0}"))),
            opt(g.sm_clock_mhz.map(|c| c.to_string())),
            opt(g.ecc_corrected.map(|c| c.to_string())),
            opt(g.ecc_uncorrected.map(|c| c.to_string())),
            g.xids,
        );
    }
    for p in &r.ports {
        println!(
            "  {:<12} {:<8} {:>5} Gb/s  link downs {}",
            p.port,
            opt(p.state.clone()),
            opt(p.rate_gbps.map(|r| format!("{r:.0}"))),
            opt(p.link_downed.map(|d| d.to_string())),
        );
    }
}

fn print_steps(steps: &[crate::api::node::Step]) {
    for s in steps {
        println!(
            "    {:<24} {:>9}  {}",
            s.step,
            format!("+{:.3}s", s.took_ms as f64 / 1000.0),
            s.outcome
        );
    }
}

/// `key=value` sets a label, `key-` removes one.
fn parse_labels(labels: &[String]) -> anyhow::Result<LabelRequest> {
    let mut set = BTreeMap::new();
    let mut remove = Vec::new();
    for l in labels {
        match (l.split_once('='), l.strip_suffix('-')) {
            (Some((k, v)), _) => {
                set.insert(k.to_string(), v.to_string());
            }
            (None, Some(k)) => remove.push(k.to_string()),
            _ => {
                return Err(super::client::UsageError(format!(
                    "label {l:?}: use key=value to set, key- to remove"
                ))
                .into());
            }
        }
    }
    Ok(LabelRequest { set, remove })
}

/// Events, one a line: seq, time, kind, the transition if any, the reason.
fn print_events(page: &EventPage) {
    for e in &page.events {
        let data = &e.data;
        let what = match (data["from"].as_str(), data["to"].as_str()) {
            (from, Some(to)) => format!("{} -> {to}", from.unwrap_or("(new)")),
            _ => String::new(),
        };
        println!(
            "{:>6}  {}  {:<16} {what}  {}{}",
            e.seq,
            e.at,
            e.kind,
            data["reason"].as_str().unwrap_or(""),
            by(&e.actor)
        );
    }
}

/// `  (by NAME)` for what a token's request did; nothing for the server's own work.
fn by(actor: &Option<String>) -> String {
    actor
        .as_deref()
        .map(|a| format!("  (by {a})"))
        .unwrap_or_default()
}

#[derive(Debug, clap::Subcommand)]
pub enum TpmCommand {
    /// The EK the node is enrolled with.
    Show {
        /// The node's MAC (52:54:00:12:34:56 or 52-54-00-12-34-56).
        node: String,
    },
    /// Register the EK the node's TPM must present.
    Enrol {
        /// The node's MAC (52:54:00:12:34:56 or 52-54-00-12-34-56).
        node: String,
        /// The EK's public area as `tpm2_createek -G rsa -u FILE -f tss` writes it.
        #[arg(
            long,
            value_name = "FILE",
            conflicts_with = "ek_name",
            required_unless_present = "ek_name"
        )]
        ek_public: Option<std::path::PathBuf>,
        /// The EK's TPM Name in hex (`tpm2_readpublic`'s `name:`).
        #[arg(long, value_name = "HEX")]
        ek_name: Option<String>,
    },
    /// Forget the node's EK (a new board): its next boot enrols again, or needs `enrol`.
    Forget {
        /// The node's MAC (52:54:00:12:34:56 or 52-54-00-12-34-56).
        node: String,
    },
}

async fn tpm(cmd: TpmCommand, client: &Client, out: OutputFormat) -> anyhow::Result<()> {
    use crate::api::node::{TpmEnrolRequest, TpmEnrolment};
    let route =
        |node: &str| -> anyhow::Result<String> { Ok(format!("/api/v1/nodes/{}/tpm", mac(node)?)) };
    let (req, what) = match cmd {
        TpmCommand::Show { node } => (client.request(Method::GET, &route(&node)?), "enrolled"),
        TpmCommand::Enrol {
            node,
            ek_public,
            ek_name,
        } => {
            let ek_public = match ek_public {
                Some(path) => Some(hex::encode(
                    std::fs::read(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
                )),
                None => None,
            };
            let body = TpmEnrolRequest { ek_public, ek_name };
            (
                client.request(Method::PUT, &route(&node)?).json(&body),
                "registered",
            )
        }
        TpmCommand::Forget { node } => {
            (client.request(Method::DELETE, &route(&node)?), "forgotten")
        }
    };
    let e: TpmEnrolment = client.send(req).await?;
    emit(out, &e, |e| {
        println!(
            "EK {} {what} (at {}{})",
            e.ek_name,
            e.enrolled_at,
            if e.certified {
                ", certificate checked"
            } else {
                ""
            }
        )
    })
}
