//! Server settings: a TOML file, overridden by flags and `BOOTFLEET_*` environment variables.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::image::bundle::BundleLimits;

pub const DEFAULT_DATA_DIR: &str = "./bootfleet-data";
pub const DEFAULT_LISTEN: &str = "0.0.0.0:8080";
pub const DEFAULT_SERVER_URL: &str = "http://127.0.0.1:8080";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

/// The settings file, as written by operators. Every key is optional.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub data_dir: Option<PathBuf>,
    pub listen: Option<SocketAddr>,
    /// Serve the admin API (`/api/v1/` but the agent's calls) on this address only, apart
    /// from the boot routes: a management network nodes cannot reach [default: with the
    /// boot routes on `listen`].
    pub admin_listen: Option<SocketAddr>,
    pub log_format: Option<LogFormat>,
    /// Read the admin token from this file instead of `<data_dir>/admin.token`.
    pub admin_token_file: Option<PathBuf>,
    #[serde(default)]
    pub limits: BundleLimits,
    #[serde(default)]
    pub tftp: TftpFileConfig,
    /// Boot-script templates overriding the built-in ones, file by file.
    pub templates_dir: Option<PathBuf>,
    /// Per-node overlay files of two-stage images (`all/`, `label/KEY=VALUE/`; `.j2`
    /// files are templates), added to the built-in hostname, machine-id and hosts.
    pub overlay_dir: Option<PathBuf>,
    /// `[reimage]`: the disruption budget.
    #[serde(default)]
    pub reimage: crate::node::reimage::DisruptionBudget,
    /// `[lifecycle]`: heartbeat timeout and drift policy.
    #[serde(default)]
    pub lifecycle: crate::node::policy::LifecyclePolicy,
    /// `[[webhooks]]`: where events are delivered.
    #[serde(default)]
    pub webhooks: Vec<crate::events::webhook::WebhookConfig>,
    /// `[dhcp]`: proxyDHCP or authoritative DHCP. Off unless `mode` is set.
    #[serde(default)]
    pub dhcp: DhcpFileConfig,
    /// `[store]`: where nodes, images and events are kept.
    #[serde(default)]
    pub store: StoreConfig,
    /// `[blobs]`: the shared object store, when blobs are kept on S3.
    #[serde(default)]
    pub blobs: crate::image::objects::ObjectsConfig,
    /// `[cluster]`: the other servers sharing this state.
    #[serde(default)]
    pub cluster: ClusterConfig,
    /// `[http]`: connection caps and timeouts.
    #[serde(default)]
    pub http: crate::http::serve::HttpSettings,
    /// `[events]`: how long the event log is kept.
    #[serde(default)]
    pub events: crate::events::retention::Retention,
    /// `[boots]`: who may start a new boot of a MAC.
    #[serde(default)]
    pub boots: crate::node::boot_guard::BootsPolicy,
    /// `[discovery]`: what unknown MACs may add.
    #[serde(default)]
    pub discovery: crate::node::policy::DiscoveryPolicy,
    /// `[power]`: BMC secrets, timeouts and rate limits.
    #[serde(default)]
    pub power: crate::power::service::PowerSettings,
    /// `[images]`: imports of OCI images (limits, stage 1's busybox and agent).
    #[serde(default)]
    pub images: crate::image::import::ImportSettings,
    /// `[rollouts]`: how often the rollout controller looks.
    #[serde(default)]
    pub rollouts: crate::rollout::run::RolloutSettings,
    /// `[drain]`: nodes' workload schedulers, drained before a rollout reimages them.
    #[serde(default)]
    pub drain: crate::rollout::drain::DrainSettings,
    /// `[metrics]`: label groups and a scrape-only token for `/metrics`.
    #[serde(default)]
    pub metrics: crate::metrics::MetricsSettings,
    /// `[health]`: the rules that judge heartbeat readings over time, and their actions.
    #[serde(default)]
    pub health: crate::health::HealthSettings,
    /// `[fabric]`: the InfiniBand cabling validation checks nodes against.
    #[serde(default)]
    pub fabric: crate::fabric::FabricSettings,
    /// `[tpm]`: TPM-rooted attestation's policy and the CAs EK certificates chain to.
    #[serde(default)]
    pub tpm: crate::tpm::TpmSettings,
}

/// `[store]` in the settings file. Its Debug hides the URL (it may hold a password).
#[derive(Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// `sqlite://PATH` or `postgres://USER@HOST[:PORT]/DB` (`?host=/socket/dir` for a
    /// Unix socket); default: SQLite at `<data_dir>/bootfleet.db`. Servers that share one
    /// PostgreSQL database share one state.
    pub url: Option<String>,
    /// A file holding the PostgreSQL password (first line), kept out of the URL, the
    /// process list and the logs.
    pub password_file: Option<PathBuf>,
    /// SQLite: writers that may wait for their turn; one more is answered 503 with
    /// Retry-After, so memory stays bounded under any load [default: 4096].
    pub max_queued_writes: Option<usize>,
}

impl std::fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreConfig")
            .field("url", &self.url.as_ref().map(|_| "(redacted)"))
            .field("password_file", &self.password_file)
            .field("max_queued_writes", &self.max_queued_writes)
            .finish()
    }
}

impl StoreConfig {
    /// The store to open: the URL given, else SQLite in `data_dir`.
    pub fn url(&self, data_dir: &Path) -> Result<crate::store::StoreUrl, crate::store::StoreError> {
        match &self.url {
            Some(url) => crate::store::StoreUrl::parse(url),
            None => Ok(crate::store::StoreUrl::Sqlite(
                data_dir.join(crate::store::sqlite::DATABASE_FILE),
            )),
        }
    }

    /// The password in `password_file`, if one is named: its first line.
    pub fn password(&self) -> Result<Option<String>, crate::store::StoreError> {
        let Some(path) = &self.password_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path).map_err(|e| {
            crate::store::StoreError::Config(format!("password_file {}: {e}", path.display()))
        })?;
        Ok(Some(text.lines().next().unwrap_or("").to_string()))
    }
}

/// `[dhcp]` in the settings file.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DhcpFileConfig {
    /// off | proxy | authoritative [default: off].
    pub mode: Option<crate::dhcp::decide::Mode>,
    /// Answer only on this interface (SO_BINDTODEVICE); every interface when unset.
    pub interface: Option<String>,
    /// Our address on the boot segment: server identifier and TFTP next-server.
    pub server_ip: Option<std::net::Ipv4Addr>,
    /// Our HTTP base URL as nodes reach it [default: http://<server_ip>:<listen port>].
    pub http_url: Option<String>,
    /// [default: 67]
    pub port: Option<u16>,
    /// PXE boot-server port [default: 4011].
    pub pxe_port: Option<u16>,
    /// Port replies go to [default: 68]; tests use another.
    pub client_port: Option<u16>,
    /// Authoritative mode: the segment's mask, gateway and DNS servers.
    pub subnet_mask: Option<std::net::Ipv4Addr>,
    pub router: Option<std::net::Ipv4Addr>,
    #[serde(default)]
    pub dns: Vec<std::net::Ipv4Addr>,
    /// Authoritative mode: `[dhcp.pool]` start, end, reservations, lease_secs.
    pub pool: Option<crate::dhcp::leases::PoolConfig>,
    /// Authoritative mode: `[[dhcp.subnet]]`, a pool per boot segment behind a DHCP
    /// relay (relay = "10.40.0.0/24", [dhcp.subnet.pool], router, subnet_mask, dns),
    /// chosen by the relay address of each request.
    #[serde(default)]
    pub subnet: Vec<crate::dhcp::pools::SubnetConfig>,
    /// Authoritative mode, several servers on one segment: every pool is cut into this
    /// many slices; each server gives out one slice, held as a lease in the shared
    /// store (taken over within 20 s when its server dies), and a server that holds none
    /// stays silent (a standby). Every server of a segment must say the same, with the
    /// same pools [default: 1, the whole pool].
    pub slices: Option<u32>,
    /// `[dhcp.files]`: boot file names per client class.
    #[serde(default)]
    pub files: crate::dhcp::decide::BootFiles,
    /// Which iPXE clients get our iPXE binary before their script: "non-ipxe" (firmware
    /// that is not iPXE; an iPXE ROM gets the script at once) or "always" (replace every
    /// ROM's iPXE with ours) [default: non-ipxe]. Per node: label `ipxe=chainload`.
    #[serde(default)]
    pub chainload: crate::dhcp::chain::ChainPolicy,
    /// Answer IPv6 router solicitations on `interface` with "no router, no DHCPv6"
    /// (lifetime 0, no prefix): iPXE then stops waiting for IPv6, about 16 s at every
    /// start on a segment without an IPv6 router. Hosts that hear it change nothing
    /// [default: true when `interface` is set; it needs the interface].
    pub router_advertisements: Option<bool>,
}

/// `[cluster]`: several servers sharing one `[store]` and `[blobs]`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Every server's HTTP base as nodes reach it (`http://10.0.0.1:8080`): a node's
    /// entry script tries each in turn, and its agent turns to the next when the one it
    /// talks to does not answer (`bootfleet.servers=` on the kernel command line).
    /// Unset: a node knows only the server that answered it.
    #[serde(default)]
    pub servers: Vec<String>,
}

/// `[tftp]`: the read-only TFTP server for boot binaries. Off unless `listen` is set.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TftpFileConfig {
    pub listen: Option<SocketAddr>,
    /// Directory of the iPXE binaries (Debian's `ipxe` package: /usr/lib/ipxe).
    pub ipxe_dir: Option<PathBuf>,
    /// Most transfers at once; more are refused with "server busy" [default: 1024].
    pub max_transfers: Option<usize>,
    /// Largest RFC 7440 window accepted [default: 64].
    pub max_windowsize: Option<u16>,
}

pub const DEFAULT_IPXE_DIR: &str = "/usr/lib/ipxe";

/// What a flag or environment variable said (None: not given).
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub data_dir: Option<PathBuf>,
    pub listen: Option<SocketAddr>,
    pub admin_listen: Option<SocketAddr>,
    pub log_format: Option<LogFormat>,
    pub admin_token_file: Option<PathBuf>,
    pub max_artifact_bytes: Option<u64>,
    pub tftp_listen: Option<SocketAddr>,
    pub ipxe_dir: Option<PathBuf>,
    pub templates_dir: Option<PathBuf>,
    pub dhcp_mode: Option<crate::dhcp::decide::Mode>,
    pub dhcp_server_ip: Option<std::net::Ipv4Addr>,
    pub store_url: Option<String>,
}

/// The settings the server runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    pub log_format: LogFormat,
    pub admin_token_file: Option<PathBuf>,
    pub limits: BundleLimits,
    pub tftp_listen: Option<SocketAddr>,
    pub ipxe_dir: PathBuf,
    pub tftp: crate::tftp::server::TftpSettings,
    pub templates_dir: Option<PathBuf>,
    pub overlay_dir: Option<PathBuf>,
    pub budget: crate::node::reimage::DisruptionBudget,
    pub lifecycle: crate::node::policy::LifecyclePolicy,
    pub webhooks: Vec<crate::events::webhook::WebhookConfig>,
    pub dhcp: DhcpFileConfig,
    pub store: StoreConfig,
    pub blobs: crate::image::objects::ObjectsConfig,
    pub cluster: ClusterConfig,
    pub http: crate::http::serve::HttpSettings,
    pub events: crate::events::retention::Retention,
    pub discovery: crate::node::policy::DiscoveryPolicy,
    pub boots: crate::node::boot_guard::BootsPolicy,
    /// Serve the admin API here only, apart from the boot routes (a management network).
    pub admin_listen: Option<SocketAddr>,
    pub power: crate::power::service::PowerSettings,
    pub images: crate::image::import::ImportSettings,
    pub rollouts: crate::rollout::run::RolloutSettings,
    pub drain: crate::rollout::drain::DrainSettings,
    pub metrics: crate::metrics::MetricsSettings,
    pub health: crate::health::HealthSettings,
    pub fabric: crate::fabric::FabricSettings,
    pub tpm: crate::tpm::TpmSettings,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
}

impl FileConfig {
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim().to_string(),
        })
    }

    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }
}

impl ServerConfig {
    /// Flags and environment win over the file; the file wins over defaults.
    pub fn resolve(file: FileConfig, over: Overrides) -> Self {
        let mut limits = file.limits;
        if let Some(max) = over.max_artifact_bytes {
            limits.max_artifact_bytes = max;
        }
        Self {
            data_dir: over
                .data_dir
                .or(file.data_dir)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR)),
            listen: over
                .listen
                .or(file.listen)
                .unwrap_or_else(|| DEFAULT_LISTEN.parse().expect("valid default")),
            log_format: over.log_format.or(file.log_format).unwrap_or_default(),
            admin_token_file: over.admin_token_file.or(file.admin_token_file),
            limits,
            tftp_listen: over.tftp_listen.or(file.tftp.listen),
            ipxe_dir: over
                .ipxe_dir
                .or(file.tftp.ipxe_dir)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_IPXE_DIR)),
            templates_dir: over.templates_dir.or(file.templates_dir),
            overlay_dir: file.overlay_dir,
            budget: file.reimage,
            lifecycle: file.lifecycle,
            webhooks: file.webhooks,
            blobs: file.blobs,
            cluster: file.cluster,
            http: file.http,
            events: file.events,
            discovery: file.discovery,
            boots: file.boots,
            power: file.power,
            images: file.images,
            rollouts: file.rollouts,
            drain: file.drain,
            metrics: file.metrics,
            health: file.health,
            fabric: file.fabric,
            tpm: file.tpm,
            admin_listen: over.admin_listen.or(file.admin_listen),
            store: StoreConfig {
                url: over.store_url.or(file.store.url),
                ..file.store
            },
            dhcp: crate::config::DhcpFileConfig {
                mode: over.dhcp_mode.or(file.dhcp.mode),
                server_ip: over.dhcp_server_ip.or(file.dhcp.server_ip),
                ..file.dhcp
            },
            tftp: {
                let mut t = crate::tftp::server::TftpSettings::default();
                if let Some(n) = file.tftp.max_transfers {
                    t.max_transfers = n.max(1);
                }
                if let Some(w) = file.tftp.max_windowsize {
                    t.limits.max_windowsize = w.max(1);
                }
                t
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shipped example parses, and its `[health]` is the defaults it says it is.
    #[test]
    fn the_example_config_parses_and_shows_the_health_defaults() {
        let text = include_str!("../deploy/bootfleet.toml");
        let file = FileConfig::parse(text, Path::new("deploy/bootfleet.toml")).unwrap();
        assert_eq!(file.health, crate::health::HealthSettings::default());
        file.health.check().unwrap();
    }

    #[test]
    fn flags_beat_file_beats_defaults() {
        let file = FileConfig::parse(
            "listen = \"127.0.0.1:9000\"\ndata_dir = \"/var/lib/x\"\n[limits]\nmax_entries = 7\n",
            Path::new("t.toml"),
        )
        .unwrap();
        let cfg = ServerConfig::resolve(
            file,
            Overrides {
                data_dir: Some("/tmp/y".into()),
                max_artifact_bytes: Some(5),
                ..Default::default()
            },
        );
        assert_eq!(cfg.data_dir, PathBuf::from("/tmp/y"));
        assert_eq!(cfg.listen, "127.0.0.1:9000".parse().unwrap());
        assert_eq!(cfg.limits.max_entries, 7);
        assert_eq!(cfg.limits.max_artifact_bytes, 5);
        assert_eq!(cfg.log_format, LogFormat::Human);
    }

    #[test]
    fn unknown_keys_are_refused_with_position() {
        let e = FileConfig::parse("lsiten = \"x\"\n", Path::new("t.toml")).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("unknown field") && text.contains("line 1"),
            "{text}"
        );
    }
}
