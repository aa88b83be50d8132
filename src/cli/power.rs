//! `bootfleet node power ...` and `bootfleet node bmc ...`: power status and actions
//! through nodes' BMCs, for MACs or a selector, several at once (bounded); and how a
//! node's BMC is reached.

use clap::{Args, Subcommand, ValueEnum};
use reqwest::Method;

use super::client::{Client, UsageError};
use super::output::{OutputFormat, emit};
use crate::api::Mac;
use crate::api::node::{Bmc, Node};
use crate::api::power::{
    BmcProtocol, BmcRegistration, PowerAction, PowerDone, PowerRequest, PowerStatus,
    RegisteredPowerDone,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Verb {
    /// What each BMC says: on, off or changing, with its inventory.
    Status,
    On,
    /// Off at once.
    Off,
    /// Ask the OS to shut down.
    SoftOff,
    /// Off and on again (on, if off): the node network-boots afresh.
    Cycle,
}

#[derive(Debug, Args)]
pub struct PowerArgs {
    /// status, on, off, soft-off or cycle.
    #[arg(value_enum)]
    pub verb: Verb,
    /// The nodes' MACs (52:54:00:12:34:56 or 52-54-00-12-34-56); or --selector.
    pub nodes: Vec<String>,
    /// Every node whose labels match instead of MACs (k=v, k!=v, k, !k).
    #[arg(long, short = 'l')]
    pub selector: Option<String>,
    /// Why (recorded in the node's power record and the event log); needed for actions.
    #[arg(long)]
    pub reason: Option<String>,
    /// Do not set a one-time network boot before `on` or `cycle`.
    #[arg(long)]
    pub no_netboot: bool,
    /// BMCs asked at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=512))]
    pub concurrency: u16,
}

/// How a BMC is reached.
#[derive(Debug, Args)]
pub struct BmcArgs {
    /// A Redfish BMC: https://HOST[:PORT], or with the system's path
    /// (https://HOST/redfish/v1/Systems/ID) when it manages several.
    #[arg(long, conflicts_with = "ipmi", required_unless_present = "ipmi")]
    redfish: Option<String>,
    /// An IPMI (lanplus) BMC: HOST or HOST:PORT.
    #[arg(long)]
    ipmi: Option<String>,
    /// The credential's name: a file NAME in the server's secrets directory with
    /// `username = "..."` and `password = "..."`, mode 0600.
    #[arg(long)]
    credential: String,
    /// Redfish: trust this CA (a PEM file NAME in the secrets directory).
    #[arg(long, requires = "redfish")]
    ca: Option<String>,
    /// Redfish: accept only the certificate with this SHA-256 fingerprint (hex,
    /// colons allowed: `openssl x509 -noout -fingerprint -sha256`).
    #[arg(long, requires = "redfish")]
    fingerprint: Option<String>,
    /// Redfish: accept any certificate (logged at every use).
    #[arg(long, requires = "redfish")]
    insecure: bool,
    /// A known departure of this BMC from its protocol, worked around (repeatable):
    /// boot-valid-unreported (IPMI: boot flags read back with the valid bit clear,
    /// as OpenIPMI's ipmi_sim does; the read-back then checks the device only).
    #[arg(long = "quirk", value_name = "QUIRK")]
    quirks: Vec<crate::api::power::BmcQuirk>,
}

impl BmcArgs {
    fn bmc(self) -> Result<Bmc, UsageError> {
        let (protocol, address) = match (self.redfish, self.ipmi) {
            (Some(url), None) => (BmcProtocol::Redfish, url),
            (None, Some(host)) => (BmcProtocol::Ipmi, host),
            _ => return Err(UsageError("give --redfish URL or --ipmi HOST".into())),
        };
        Ok(Bmc {
            protocol,
            address,
            credential: Some(self.credential),
            ca: self.ca,
            fingerprint: self.fingerprint,
            insecure: self.insecure,
            quirks: self.quirks,
        })
    }
}

#[derive(Debug, Subcommand)]
pub enum BmcCommand {
    /// Say how NODE's BMC is reached: --redfish URL or --ipmi HOST[:PORT], and the
    /// credential's name (a file in the server's secrets directory).
    Set {
        /// The node's MAC (52:54:00:12:34:56 or 52-54-00-12-34-56).
        node: String,
        #[command(flatten)]
        bmc: BmcArgs,
    },
    /// Forget NODE's BMC.
    Clear {
        /// The node's MAC (52:54:00:12:34:56 or 52-54-00-12-34-56).
        node: String,
    },
    /// Register a machine by its BMC alone, before its MAC is known: the BMC is asked for
    /// the system UUID and NIC MACs, and the machine becomes a node (with this BMC) when it
    /// first network-boots. Power it on with `node bmc power ID on`.
    Add {
        #[command(flatten)]
        bmc: BmcArgs,
    },
    /// The machines registered by their BMC and not yet seen booting.
    List,
    /// Forget a machine registered by its BMC.
    Remove {
        /// Its id (`node bmc list`).
        id: i64,
    },
    /// A power action on a machine registered by its BMC (`on` and `cycle` set a
    /// one-time network boot first).
    Power {
        /// Its id (`node bmc list`).
        id: i64,
        /// What to do: on, off (at once), soft-off (ask the OS), cycle.
        #[arg(value_enum)]
        verb: RegisteredVerb,
        /// Why (recorded in the event log).
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RegisteredVerb {
    On,
    Off,
    SoftOff,
    Cycle,
}

pub async fn bmc(cmd: BmcCommand, client: &Client, out: OutputFormat) -> anyhow::Result<()> {
    let (node, req) = match cmd {
        BmcCommand::Set { node, bmc } => {
            let mac: Mac = node.parse()?;
            let req = client
                .request(Method::PUT, &format!("/api/v1/nodes/{mac}/bmc"))
                .json(&bmc.bmc()?);
            (mac, req)
        }
        BmcCommand::Clear { node } => {
            let mac: Mac = node.parse()?;
            (
                mac,
                client.request(Method::DELETE, &format!("/api/v1/nodes/{mac}/bmc")),
            )
        }
        BmcCommand::Add { bmc } => {
            let req = client
                .request(Method::POST, "/api/v1/bmcs")
                .json(&bmc.bmc()?);
            let r: BmcRegistration = client.send(req).await?;
            return emit(out, &r, registration_line);
        }
        BmcCommand::List => {
            let all: Vec<BmcRegistration> = client
                .send(client.request(Method::GET, "/api/v1/bmcs"))
                .await?;
            return emit(out, &all, |all| all.iter().for_each(registration_line));
        }
        BmcCommand::Remove { id } => {
            let req = client.request(Method::DELETE, &format!("/api/v1/bmcs/{id}"));
            let removed: serde_json::Value = client.send(req).await?;
            return emit(out, &removed, |_| println!("registration {id} removed"));
        }
        BmcCommand::Power { id, verb, reason } => {
            let action = match verb {
                RegisteredVerb::On => PowerAction::On,
                RegisteredVerb::Off => PowerAction::Off,
                RegisteredVerb::SoftOff => PowerAction::SoftOff,
                RegisteredVerb::Cycle => PowerAction::Cycle,
            };
            let req = client
                .request(Method::POST, &format!("/api/v1/bmcs/{id}/power"))
                .json(&PowerRequest {
                    action,
                    reason,
                    netboot: None,
                });
            let done: RegisteredPowerDone = client.send(req).await?;
            return emit(out, &done, |d| {
                let boot = d
                    .netboot
                    .as_deref()
                    .map(|b| format!(", next boot {b}"))
                    .unwrap_or_default();
                println!("registration {}: {} done{boot}", d.id, d.action)
            });
        }
    };
    let n: Node = client.send(req).await?;
    emit(out, &n, |n| match &n.bmc {
        Some(b) => println!(
            "{node}: bmc {b} (credential {})",
            b.credential.as_deref().unwrap_or("-")
        ),
        None => println!("{node}: no bmc"),
    })
}

fn registration_line(r: &BmcRegistration) {
    let macs: Vec<String> = r.macs.iter().map(Mac::to_string).collect();
    println!(
        "{}: {} uuid {} macs {} (registered {})",
        r.id,
        r.bmc,
        r.uuid.as_deref().unwrap_or("-"),
        if macs.is_empty() {
            "-".into()
        } else {
            macs.join(",")
        },
        r.registered
    );
}

pub async fn power(args: PowerArgs, client: &Client, out: OutputFormat) -> anyhow::Result<()> {
    let targets = super::bulk::targets(client, &args.nodes, args.selector).await?;
    let width = usize::from(args.concurrency);
    let action = match args.verb {
        Verb::Status => {
            let status = |mac: Mac| async move {
                let req = client.request(Method::GET, &format!("/api/v1/nodes/{mac}/power"));
                Ok(serde_json::to_value(
                    client.send::<PowerStatus>(req).await?,
                )?)
            };
            let line = |s: &PowerStatus| {
                let inv = &s.inventory;
                format!(
                    "{}: {:<8} {} {}",
                    s.node,
                    s.state,
                    s.bmc,
                    [&inv.manufacturer, &inv.model, &inv.serial]
                        .into_iter()
                        .flatten()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(" ")
                )
            };
            return super::bulk::run_bounded(
                &targets,
                width,
                out,
                |v| super::bulk::as_text(v, line),
                status,
            )
            .await;
        }
        Verb::On => PowerAction::On,
        Verb::Off => PowerAction::Off,
        Verb::SoftOff => PowerAction::SoftOff,
        Verb::Cycle => PowerAction::Cycle,
    };
    let Some(reason) = args.reason else {
        return Err(UsageError(format!("`power {action}` needs --reason")).into());
    };
    let netboot = args.no_netboot.then_some(false);
    let act = |mac: Mac| {
        let req = client
            .request(Method::POST, &format!("/api/v1/nodes/{mac}/power"))
            .json(&PowerRequest {
                action,
                reason: reason.clone(),
                netboot,
            });
        async move { Ok(serde_json::to_value(client.send::<PowerDone>(req).await?)?) }
    };
    let line = |d: &PowerDone| {
        let boot = d
            .netboot
            .as_deref()
            .map(|b| format!(", next boot {b}"))
            .unwrap_or_default();
        format!(
            "{}: {} done (node {}{boot})",
            d.node, d.action, d.node_state
        )
    };
    super::bulk::run_bounded(&targets, width, out, |v| super::bulk::as_text(v, line), act).await
}
