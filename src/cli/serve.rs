//! `bootfleet serve`: resolve settings, start logging, bind, run until SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::config::{FileConfig, LogFormat, Overrides, ServerConfig};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on for HTTP [default: 0.0.0.0:8080].
    #[arg(long, env = "BOOTFLEET_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Serve the admin API on this address only, apart from the boot routes (a management
    /// network nodes cannot reach) [default: with the boot routes].
    #[arg(long, env = "BOOTFLEET_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// Log format [default: human].
    #[arg(long, env = "BOOTFLEET_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Read the admin token from this file instead of <data-dir>/admin.token.
    #[arg(long, env = "BOOTFLEET_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Largest artifact accepted in a bundle, in bytes [default: 16 GiB].
    #[arg(long, env = "BOOTFLEET_MAX_ARTIFACT_BYTES")]
    pub max_artifact_bytes: Option<u64>,
    /// Serve TFTP on this address (for example 0.0.0.0:69) [default: off].
    #[arg(long, env = "BOOTFLEET_TFTP_LISTEN")]
    pub tftp_listen: Option<SocketAddr>,
    /// Directory of the iPXE binaries served over TFTP [default: /usr/lib/ipxe].
    #[arg(long, env = "BOOTFLEET_IPXE_DIR")]
    pub ipxe_dir: Option<PathBuf>,
    /// Boot-script templates overriding the built-in ones, file by file (see templates/).
    #[arg(long, env = "BOOTFLEET_TEMPLATES_DIR")]
    pub templates_dir: Option<PathBuf>,
    /// DHCP service: off, proxy (boot information next to the site's DHCP) or
    /// authoritative (a pool from [dhcp.pool]) [default: off]. See [dhcp] in the config.
    #[arg(long, env = "BOOTFLEET_DHCP", value_enum)]
    pub dhcp: Option<crate::dhcp::decide::Mode>,
    /// Our address on the boot segment ([dhcp] server_ip): per machine, where one
    /// settings file serves several servers.
    #[arg(long, env = "BOOTFLEET_DHCP_SERVER_IP")]
    pub dhcp_server_ip: Option<std::net::Ipv4Addr>,
    /// Store: sqlite://PATH or postgres://USER@HOST/DB; servers sharing one PostgreSQL
    /// database share one state [default: sqlite in the data directory]. Put a password
    /// in [store] password_file, not here (flags show in the process list).
    #[arg(long, env = "BOOTFLEET_STORE_URL", hide_env_values = true)]
    pub store_url: Option<String>,
}

pub async fn run(
    args: ServeArgs,
    data_dir: Option<PathBuf>,
    config: Option<PathBuf>,
) -> anyhow::Result<()> {
    let file = match &config {
        Some(path) => FileConfig::load(path)?,
        None => FileConfig::default(),
    };
    let cfg = ServerConfig::resolve(
        file,
        Overrides {
            data_dir,
            listen: args.listen,
            admin_listen: args.admin_listen,
            log_format: args.log_format,
            admin_token_file: args.admin_token_file,
            max_artifact_bytes: args.max_artifact_bytes,
            tftp_listen: args.tftp_listen,
            ipxe_dir: args.ipxe_dir,
            templates_dir: args.templates_dir,
            dhcp_mode: args.dhcp,
            dhcp_server_ip: args.dhcp_server_ip,
            store_url: args.store_url,
        },
    );
    init_logging(cfg.log_format);
    // The port first: a second server on a busy port fails before it creates a data
    // directory or a token.
    let listener = crate::server::listen(cfg.listen)
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let admin = match cfg.admin_listen {
        Some(a) => Some(
            crate::server::listen(a).with_context(|| format!("cannot listen on {a} (admin)"))?,
        ),
        None => None,
    };
    let tls = match cfg.http.tls_listen {
        Some(a) => Some(
            crate::server::listen(a).with_context(|| format!("cannot listen on {a} (HTTPS)"))?,
        ),
        None => None,
    };
    let state = crate::server::open_state(&cfg).await?;
    let addr = listener.local_addr()?;
    // Handlers first: a SIGTERM that arrives once we say we listen must shut down cleanly.
    let shutdown = CancellationToken::new();
    use tokio::signal::unix::{SignalKind, signal};
    let signals = (
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
    );
    tokio::spawn(cancel_on_signal(signals, shutdown.clone()));
    tracing::info!(%addr, data_dir = %cfg.data_dir.display(), "listening on {addr}");
    if let Some(admin) = &admin {
        let admin_addr = admin.local_addr()?;
        tracing::info!(%admin_addr, "admin API listening on {admin_addr} only");
    }
    if let Some(tls) = &tls {
        let tls_addr = tls.local_addr()?;
        tracing::info!(%tls_addr, "HTTPS listening on {tls_addr}");
    }
    let tftp = crate::server::start_tftp(&cfg, &state, shutdown.clone()).await?;
    let dhcp = crate::server::start_dhcp(&cfg, &state, shutdown.clone()).await?;
    let listeners = crate::server::Listeners {
        boot: listener,
        admin,
        tls,
    };
    // Held until DHCP and TFTP have saved what they hold, after the HTTP side ends.
    let sqlite_lock = state.sqlite_lock.clone();
    let http = crate::server::run_on(listeners, state, shutdown.clone()).await;
    shutdown.cancel();
    for task in dhcp {
        task.await.context("DHCP server panicked")?;
    }
    if let Some(tftp) = tftp {
        tftp.await
            .context("TFTP server panicked")?
            .context("TFTP server failed")?;
    }
    drop(sqlite_lock);
    http
}

async fn cancel_on_signal(
    (mut term, mut int): (tokio::signal::unix::Signal, tokio::signal::unix::Signal),
    shutdown: CancellationToken,
) {
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("signal received, shutting down");
    shutdown.cancel();
}

fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
