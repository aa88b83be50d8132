//! `bootfleet token ...`: create named API tokens with a role, list them, revoke them.

use clap::Subcommand;
use reqwest::Method;

use super::client::Client;
use super::output::{OutputFormat, emit};
use crate::api::token::{Role, TokenCreated, TokenInfo, TokenList, TokenRequest};

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Create a token with a role; its secret is printed once and cannot be shown again.
    Create {
        /// The token's name, as the audit trail will show it (lowercase letters, digits,
        /// '.', '_', '-'; never reused, even once revoked).
        name: String,
        /// admin, operator (images, tags, nodes, reimage, power, rollouts),
        /// fleet-controller (read nodes and events, reimage within the budget,
        /// revalidate) or read-only.
        #[arg(long, value_parser = parse_role)]
        role: Role,
    },
    /// Every token (revoked ones too): name, role, who created it, when; never a secret.
    List,
    /// Revoke a token: every server refuses it from the next request on.
    Revoke {
        /// The token's name.
        name: String,
    },
}

fn parse_role(s: &str) -> Result<Role, String> {
    s.parse()
}

pub async fn run(cmd: TokenCommand, client: &Client, out: OutputFormat) -> anyhow::Result<()> {
    match cmd {
        TokenCommand::Create { name, role } => {
            let req = client
                .request(Method::POST, "/api/v1/tokens")
                .json(&TokenRequest { name, role });
            let created: TokenCreated = client.send(req).await?;
            emit(out, &created, |t| {
                eprintln!(
                    "token {} ({}) created; its secret is shown this once:",
                    t.name, t.role
                );
                println!("{}", t.token);
            })
        }
        TokenCommand::List => {
            let list: TokenList = client
                .send(client.request(Method::GET, "/api/v1/tokens"))
                .await?;
            emit(out, &list, |list| {
                println!(
                    "{:<24} {:<17} {:<24} {:<16} REVOKED",
                    "NAME", "ROLE", "CREATED", "BY"
                );
                for t in &list.tokens {
                    let revoked = match (&t.revoked_at, &t.revoked_by) {
                        (Some(at), Some(by)) => format!("{at} by {by}"),
                        (Some(at), None) => at.clone(),
                        _ => "-".into(),
                    };
                    println!(
                        "{:<24} {:<17} {:<24} {:<16} {revoked}",
                        t.name, t.role, t.created_at, t.created_by
                    );
                }
            })
        }
        TokenCommand::Revoke { name } => {
            let path = format!("/api/v1/tokens/{}", urlencoding(&name));
            let info: TokenInfo = client.send(client.request(Method::DELETE, &path)).await?;
            emit(out, &info, |t| {
                println!(
                    "token {} revoked at {}",
                    t.name,
                    t.revoked_at.as_deref().unwrap_or("?")
                )
            })
        }
    }
}

/// A token name in a path: names are `[a-z0-9._-]`, so anything else is escaped rather
/// than trusted (the server refuses it as unknown).
fn urlencoding(name: &str) -> String {
    name.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
