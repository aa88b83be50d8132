//! Command line: `bootfleet serve` and the admin commands, which talk to the server over HTTP.

mod bulk;
pub mod client;
mod docs;
mod image;
mod import;
mod node;
pub mod output;
mod power;
mod rollout;
mod serve;
mod token;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

pub use output::OutputFormat;

#[derive(Debug, Parser)]
#[command(
    name = "bootfleet",
    version,
    about = "Network-boot, stateless provisioning server for bare-metal GPU clusters",
    long_about = "Network-boot, stateless provisioning server for bare-metal GPU clusters.\n\n\
        `bootfleet serve` runs the server. The other commands are admin commands: they talk \
        to a running server over HTTP, found from --server or BOOTFLEET_SERVER, and \
        authenticate with --token, BOOTFLEET_TOKEN, or the token file \
        <data-dir>/admin.token written by the server on first start. Given the server's \
        --config, they find the server and the token file from it.\n\n\
        Exit status of admin commands: 0 done, 1 failed, 2 usage, 3 not found, 4 refused \
        by the server (400, 401, 403, 409, 413, 429), 5 server unreachable or unavailable \
        (503). With --output json an error is a JSON object on stderr: \
        {\"error\", \"class\", \"status\"}."
)]
pub struct Cli {
    /// Server URL for admin commands [default: the --config file's admin_listen or listen
    /// address, else http://127.0.0.1:8080].
    #[arg(long, global = true, env = "BOOTFLEET_SERVER")]
    pub server: Option<String>,
    /// Admin bearer token (default: read <data-dir>/admin.token).
    #[arg(long, global = true, env = "BOOTFLEET_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Data directory: the server's store; admin commands read the token file there
    /// [default: ./bootfleet-data].
    #[arg(long, global = true, env = "BOOTFLEET_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Settings file (TOML; see deploy/bootfleet.toml): the server's settings for
    /// `serve` (flags and environment win over it); admin commands take the server's
    /// address, data directory and admin_token_file from it.
    #[arg(long, global = true, env = "BOOTFLEET_CONFIG")]
    pub config: Option<PathBuf>,
    /// PEM file of the CA that signed the server's HTTPS certificate, for an https://
    /// --server [default: the system's roots].
    #[arg(long, global = true, env = "BOOTFLEET_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// Output format of admin commands.
    #[arg(long, global = true, value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the server (HTTP API, artifact serving, and TFTP when configured).
    Serve(serve::ServeArgs),
    /// Publish, inspect, tag, verify and garbage-collect images.
    #[command(subcommand)]
    Image(image::ImageCommand),
    /// List, show, assign, label, reimage and revalidate nodes; their history and events.
    #[command(subcommand)]
    Node(node::NodeCommand),
    /// Roll an image out over nodes in waves, gated on their health; follow, pause,
    /// resume, abort or roll back.
    #[command(subcommand)]
    Rollout(rollout::RolloutCommand),
    /// Create, list and revoke named API tokens, each with a role (admin only).
    #[command(subcommand)]
    Token(token::TokenCommand),
    /// Print a shell completion script: `bootfleet completions bash >
    /// /etc/bash_completion.d/bootfleet` (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell to complete in.
        shell: clap_complete::Shell,
    },
    /// Write man pages for bootfleet and each of its commands into DIR
    /// (`bootfleet.1`, `bootfleet-node-list.1`...): `man -l DIR/bootfleet.1`.
    Man {
        /// Where the pages go (created if missing).
        dir: PathBuf,
    },
    /// Print the HTTP API's OpenAPI document (JSON), as this build serves it at
    /// `/api/v1/openapi.json`; `docs/openapi.json` is its checked-in copy.
    Openapi,
}

/// Globals only the admin commands read: hidden from `serve --help`, which ignores them.
const ADMIN_ONLY_GLOBALS: [&str; 4] = ["server", "token", "ca_file", "output"];

/// The command line definition for help: the derive's, with the admin-only globals
/// hidden under `serve` (clap propagates globals to every subcommand; `build` does that
/// first, so that they can be hidden there). Only for help: a command built so no longer
/// carries a global given after its subcommand (`serve --config F`) up to `Cli`.
pub fn command() -> clap::Command {
    let mut cmd = <Cli as clap::CommandFactory>::command();
    cmd.build();
    cmd.mut_subcommand("serve", |serve| {
        ADMIN_ONLY_GLOBALS
            .iter()
            .fold(serve, |s, id| s.mut_arg(*id, |a| a.hide(true)))
    })
}

/// `serve`'s help without the admin globals, when `args` ask for it (`serve --help`,
/// `serve -h`, `help serve`). Clap builds its own help at parse time, propagating the
/// globals again, so this one is rendered from `command()` instead.
pub fn serve_help(args: &[std::ffi::OsString]) -> Option<String> {
    let words: Vec<&std::ffi::OsStr> = args
        .iter()
        .skip(1)
        .map(|a| a.as_os_str())
        .take_while(|a| *a != "--")
        .collect();
    let serve = words.iter().position(|a| *a == "serve")?;
    let long = words.iter().any(|a| *a == "--help") || words[..serve].iter().any(|a| *a == "help");
    let short = words.iter().any(|a| *a == "-h");
    if !long && !short {
        return None;
    }
    let mut cmd = command();
    let serve = cmd.find_subcommand_mut("serve")?;
    let help = if long {
        serve.render_long_help()
    } else {
        serve.render_help()
    };
    Some(help.to_string())
}

/// Parses `args` with the derive's definition.
pub fn parse_from(args: Vec<std::ffi::OsString>) -> Result<Cli, clap::Error> {
    use clap::Parser as _;
    Cli::try_parse_from(args)
}

/// The process's arguments, parsed; exits with clap's message (or help) otherwise.
pub fn parse() -> Cli {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(help) = serve_help(&args) {
        print!("{help}");
        std::process::exit(0);
    }
    parse_from(args).unwrap_or_else(|e| e.exit())
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => return serve::run(args, cli.data_dir, cli.config).await,
        Command::Completions { shell } => return docs::completions(shell),
        Command::Man { dir } => return docs::man_pages(&dir),
        _ => {}
    }
    let target = client::Target::resolve(
        cli.server,
        cli.token,
        cli.data_dir,
        cli.config.as_deref(),
        cli.ca_file,
    )?;
    let client = client::Client::new(target)?;
    match cli.command {
        Command::Serve(_)
        | Command::Completions { .. }
        | Command::Man { .. }
        | Command::Openapi => {
            unreachable!("handled above (`openapi` by main: the CLI does not name `http`)")
        }
        Command::Image(cmd) => image::run(cmd, &client, cli.output).await,
        Command::Node(cmd) => node::run(cmd, &client, cli.output).await,
        Command::Rollout(cmd) => rollout::run(cmd, &client, cli.output).await,
        Command::Token(cmd) => token::run(cmd, &client, cli.output).await,
    }
}

#[cfg(test)]
mod tests {
    /// Every argument of every command says what it is in `--help`.
    #[test]
    fn every_argument_has_help() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if matches!(id, "help" | "version") || arg.is_hide_set() {
                    continue;
                }
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(
            &<super::Cli as clap::CommandFactory>::command(),
            "bootfleet",
            &mut missing,
        );
        assert!(missing.is_empty(), "arguments without help: {missing:?}");
    }

    /// `serve --help` lists what the server reads, not the admin commands' globals.
    #[test]
    fn serve_help_lists_no_admin_only_globals() {
        let mut cmd = super::command();
        let serve = cmd.find_subcommand_mut("serve").unwrap();
        let help = serve.render_long_help().to_string();
        for hidden in ["--server", "--token", "--output"] {
            assert!(!help.contains(hidden), "{hidden} in serve --help:\n{help}");
        }
        for shown in ["--config", "--data-dir", "--listen", "--admin-listen"] {
            assert!(help.contains(shown), "{shown} missing from serve --help");
        }
        let mut cmd = super::command();
        let node = cmd.find_subcommand_mut("node").unwrap();
        let list = node.find_subcommand_mut("list").unwrap();
        let help = list.render_long_help().to_string();
        assert!(
            help.contains("--server") && help.contains("--output"),
            "{help}"
        );
    }

    /// Globals given after the subcommand reach the command: `serve --config F` reads F.
    #[test]
    fn globals_after_the_subcommand_are_parsed() {
        let args = |a: &[&str]| a.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        let cli = super::parse_from(args(&[
            "bootfleet",
            "serve",
            "--config",
            "x.toml",
            "--data-dir",
            "/d",
        ]))
        .unwrap();
        assert_eq!(cli.config.as_deref(), Some(std::path::Path::new("x.toml")));
        assert_eq!(cli.data_dir.as_deref(), Some(std::path::Path::new("/d")));
        let cli = super::parse_from(args(&["bootfleet", "node", "list", "--server", "http://s"]))
            .unwrap();
        assert_eq!(cli.server.as_deref(), Some("http://s"));
        for asks in [
            &["bootfleet", "serve", "--help"][..],
            &["bootfleet", "--config", "x", "serve", "-h"],
            &["bootfleet", "help", "serve"],
        ] {
            let help = super::serve_help(&args(asks)).expect("serve's help");
            assert!(
                help.contains("--listen") && !help.contains("--token"),
                "{help}"
            );
        }
        assert_eq!(super::serve_help(&args(&["bootfleet", "serve"])), None);
        assert_eq!(
            super::serve_help(&args(&["bootfleet", "node", "list", "-h"])),
            None
        );
    }

    #[test]
    fn command_line_definition_is_consistent() {
        // Catches clashes such as a subcommand flag shadowing a global one.
        <super::Cli as clap::CommandFactory>::command().debug_assert();
    }
}
