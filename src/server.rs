//! Server assembly: open the data directory, bind, serve until cancelled, shut down cleanly.

use std::path::Path;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::AdminToken;
use crate::config::ServerConfig;
use crate::http::{AppState, router};
use crate::image::blobstore::BlobStore;
use crate::registry::Registry;
use crate::tftp::files::FileSource;
use crate::tftp::server::TftpServer;

pub use crate::store::sqlite::DATABASE_FILE;

/// The server, wired: the HTTP state (what the routes use) and what only the server's
/// own tasks need. Built once by `open_state`; `run`, `start_tftp` and `start_dhcp` take it.
#[derive(Clone)]
pub struct Server {
    pub http: AppState,
    pub store: crate::store::Store,
    pub blobs: std::sync::Arc<BlobStore>,
    /// Checked at start; each runs as a task of its own.
    pub webhooks: Vec<crate::events::webhook::Webhook>,
    pub policy: crate::node::policy::LifecyclePolicy,
    /// Connection caps and timeouts.
    pub http_settings: crate::http::serve::HttpSettings,
    pub retention: crate::events::retention::Retention,
    /// `[reimage] agent_grace_secs`, for the BMC fallback.
    pub agent_grace_secs: u64,
    /// The rollout controller, run under the `rollouts` role.
    pub rollouts: crate::rollout::run::Controller,
    /// The HTTPS certificate, when `[http] tls_cert_file` is set.
    pub tls: Option<std::sync::Arc<crate::http::tls::Certificates>>,
    /// On SQLite, the lock that makes this the database's one server (held while any
    /// clone of this lives).
    pub sqlite_lock: Option<std::sync::Arc<std::fs::File>>,
}

/// Opens everything under the data directory: blob store (sweeping crash leftovers),
/// database (migrated), admin token (generated on first start), and wires the services.
pub async fn open_state(cfg: &ServerConfig) -> anyhow::Result<Server> {
    let data_dir: &Path = &cfg.data_dir;
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("cannot create data directory {}", data_dir.display()))?;
    // Before anything in it is touched (the blob store sweeps its temp files): a second
    // server on one SQLite database is refused here.
    let store_url = cfg.store.url(data_dir)?;
    let sqlite_lock = match &store_url {
        crate::store::StoreUrl::Sqlite(path) => Some(std::sync::Arc::new(
            crate::store::sqlite::lock_for_one_server(path)?,
        )),
        crate::store::StoreUrl::Postgres(_) => None,
    };
    let blobs = BlobStore::open(data_dir)
        .with_context(|| format!("cannot open blob store in {}", data_dir.display()))?;
    let tls = match cfg.http.tls_files().map_err(anyhow::Error::msg)? {
        Some(_) if cfg.admin_listen.is_none() && cfg.http.tls_listen.is_none() => {
            anyhow::bail!(
                "[http] tls_cert_file is set but nothing speaks HTTPS: set tls_listen or admin_listen"
            )
        }
        Some((cert, key)) => Some(
            crate::http::tls::Certificates::open(cert.into(), key.into())
                .map_err(anyhow::Error::msg)?,
        ),
        None => None,
    };
    let store = crate::store::open(
        &store_url,
        cfg.store.password()?.as_deref(),
        cfg.store.max_queued_writes,
    )
    .await
    .with_context(|| format!("cannot open the store {store_url:?}"))?;
    let token = AdminToken::load_or_create(cfg.admin_token_file.as_deref(), data_dir)?;
    let templates = match &cfg.templates_dir {
        Some(dir) => crate::boot::script::BootTemplates::with_overrides(dir)?,
        None => crate::boot::script::BootTemplates::builtin(),
    }
    .with_peers(cfg.cluster.servers.clone());
    let overlay = match &cfg.overlay_dir {
        Some(dir) => crate::boot::overlay::Overlay::load(dir)?,
        None => crate::boot::overlay::Overlay::default(),
    };
    cfg.lifecycle.check().map_err(anyhow::Error::msg)?;
    cfg.health.check().map_err(anyhow::Error::msg)?;
    let webhooks = cfg
        .webhooks
        .iter()
        .map(crate::events::webhook::Webhook::load)
        .collect::<Result<Vec<_>, _>>()?;
    let mut registry = Registry::new(store.clone(), blobs, cfg.limits);
    registry.imports = std::sync::Arc::new(cfg.images.clone());
    registry.clear_import_staging()?;
    if let Some(objects) = crate::image::objects::Objects::open(&cfg.blobs)? {
        // A server restarted during an object-store outage still serves its cache: the
        // bucket check is a warning, not a reason to stay down.
        if let Err(e) = objects.ensure_bucket().await {
            tracing::warn!(error = %e, "cannot check the object store's bucket; serving from the cache until it answers");
        }
        registry = registry.with_objects(objects, cfg.blobs.cache_max_bytes);
    }
    let metrics = crate::metrics::Metrics::default();
    let scrape = crate::metrics::Scrape::load(
        &cfg.metrics,
        webhooks.iter().map(|w| w.url.clone()).collect(),
    )?;
    let controller = crate::node::controller::NodeController::new(store.clone())
        .with_discovery_cap(cfg.discovery.max_unassigned)
        .with_metrics(metrics.clone());
    let schedulers = std::sync::Arc::new(crate::rollout::drain::Schedulers::load(&cfg.drain)?);
    let rollouts = crate::rollout::service::RolloutService {
        store: store.clone(),
        registry: registry.clone(),
        budget: cfg.budget.clone(),
        schedulers: schedulers.clone(),
    };
    let nodes = crate::node::service::NodeService {
        store: store.clone(),
        registry: registry.clone(),
        templates,
        overlay: std::sync::Arc::new(overlay),
        controller: controller.clone(),
        fetches: crate::node::service::fetches::FetchRecorder::start(
            store.clone(),
            metrics.clone(),
        ),
        reimage: crate::node::reimage::ReimageService {
            registry: registry.clone(),
            controller: controller.clone(),
            budget: cfg.budget.clone(),
            drain_first: Some(std::sync::Arc::new(rollouts.clone())),
        },
        policy: cfg.lifecycle.clone(),
        images: Default::default(),
        guard: crate::node::boot_guard::BootGuard::new(cfg.boots.clone()),
        addresses: Default::default(),
        preboot: Default::default(),
        health: std::sync::Arc::new(crate::health::Health::new(cfg.health.clone())),
        liveness: Default::default(),
        baselines: Default::default(),
        fabric: cfg
            .fabric
            .load()
            .map_err(|e| anyhow::anyhow!(e))?
            .map(std::sync::Arc::new),
        trust: std::sync::Arc::new(crate::tpm::Trust::load(&cfg.tpm, &cfg.ipxe_dir)?),
    };
    let secrets = cfg
        .power
        .secrets_dir
        .clone()
        .unwrap_or_else(|| cfg.data_dir.join("secrets"));
    let power = crate::power::service::PowerService::new(
        store.clone(),
        nodes.reimage.clone(),
        crate::power::secrets::Secrets::new(secrets),
        cfg.power.clone(),
    );
    let blobs = registry.blobs.clone();
    let controller = crate::rollout::run::Controller {
        store: store.clone(),
        nodes: nodes.controller.clone(),
        registry: registry.clone(),
        budget: cfg.budget.clone(),
        schedulers,
        drain: cfg.drain.clone(),
        tick: std::time::Duration::from_millis(cfg.rollouts.tick_ms.max(10)),
        seen: Default::default(),
    };
    let http = AppState::new(crate::http::Shared {
        rollouts: std::sync::Arc::new(rollouts),
        power: std::sync::Arc::new(power),
        registry,
        tokens: std::sync::Arc::new(crate::auth::tokens::Tokens::new(
            store.clone(),
            token.clone(),
        )),
        auth_failures: std::sync::Arc::new(crate::auth::limiter::FailureLimiter::new(
            cfg.http.auth_failures_per_minute,
            crate::auth::limiter::WINDOW,
        )),
        token,
        tasks: TaskTracker::new(),
        nodes: std::sync::Arc::new(nodes),
        events: crate::events::EventLog::new(store.clone()),
        fallback_url: format!("http://{}", cfg.listen),
        stopping: CancellationToken::new(),
        ipxe_files: std::sync::Arc::new(FileSource::new(Some(cfg.ipxe_dir.clone()), None)),
        blob_maps: Default::default(),
        server_id: crate::leader::holder_id(),
        metrics,
        scrape: std::sync::Arc::new(scrape),
    });
    Ok(Server {
        http,
        store,
        blobs,
        webhooks,
        policy: cfg.lifecycle.clone(),
        agent_grace_secs: cfg.budget.agent_grace_secs,
        rollouts: controller,
        http_settings: cfg.http.clone(),
        retention: cfg.events.clone(),
        tls,
        sqlite_lock,
    })
}

/// The bound HTTP listeners: the boot routes, the admin API's own when it has one, and
/// HTTPS for every route when configured.
pub struct Listeners {
    pub boot: TcpListener,
    /// None: the admin API is served with the boot routes (unless HTTPS is configured).
    pub admin: Option<TcpListener>,
    /// `[http] tls_listen`: every route, over HTTPS.
    pub tls: Option<TcpListener>,
}

/// Serves every route on an already-bound listener (see `run_on`).
pub async fn run(
    listener: TcpListener,
    server: Server,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listeners = Listeners {
        boot: listener,
        admin: None,
        tls: None,
    };
    run_on(listeners, server, shutdown).await
}

/// Serves on already-bound listeners until `shutdown` is cancelled; then lets in-flight
/// requests and owned tasks finish and closes the database.
pub async fn run_on(
    listeners: Listeners,
    server: Server,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let state = server.http;
    let holder = state.server_id.clone();
    let lead = |role| {
        crate::leader::hold(
            server.store.clone(),
            role,
            holder.clone(),
            &state.tasks,
            state.stopping.clone(),
        )
    };
    if !server.webhooks.is_empty() {
        let leading = lead(crate::leader::WEBHOOKS);
        for hook in &server.webhooks {
            state
                .tasks
                .spawn(crate::store::own_task(crate::events::webhook::run(
                    hook.clone(),
                    server.store.clone(),
                    leading.clone(),
                    state.stopping.clone(),
                )));
        }
    }
    state.tasks.spawn(crate::heap::trim_every(
        crate::heap::TRIM_EVERY,
        state.stopping.clone(),
    ));
    let powering = lead(crate::leader::POWER);
    state
        .tasks
        .spawn(crate::store::own_task(crate::power::fallback::run(
            server.store.clone(),
            state.power.clone(),
            state.nodes.controller.clone(),
            server.agent_grace_secs,
            powering,
            state.stopping.clone(),
        )));
    let rolling = lead(crate::leader::ROLLOUTS);
    state
        .tasks
        .spawn(crate::store::own_task(crate::rollout::run::run(
            server.rollouts.clone(),
            rolling,
            state.stopping.clone(),
        )));
    // Every server stores what it heard; the last flush runs as it stops (and once more
    // after HTTP has drained, below). The server's own tasks are never refused at the
    // write queue (`store::own_task`): one write at a time each, and a refused sweep or
    // flush would turn a busy store into nodes called unreachable.
    state
        .tasks
        .spawn(crate::store::own_task(state.nodes.liveness.clone().run(
            server.store.clone(),
            std::time::Duration::from_millis(server.policy.liveness_flush_ms() as u64),
            state.stopping.clone(),
        )));
    // The sweeper's lease also makes one server the event pruner.
    let sweeping = lead(crate::leader::SWEEPER);
    state
        .tasks
        .spawn(crate::store::own_task(crate::node::sweeper::run(
            server.store.clone(),
            state.nodes.controller.clone(),
            server.policy.clone(),
            sweeping.clone(),
            state.stopping.clone(),
        )));
    state
        .tasks
        .spawn(crate::store::own_task(crate::events::retention::run(
            server.store.clone(),
            server.retention.clone(),
            sweeping,
            state.stopping.clone(),
        )));
    // Event streams end when the server starts stopping; they would hold connections.
    let stopping = state.stopping.clone();
    let http_shutdown = CancellationToken::new();
    let stop = http_shutdown.clone();
    tokio::spawn(async move {
        shutdown.cancelled().await;
        stopping.cancel();
        stop.cancel();
    });
    serve_listeners(
        listeners,
        &state,
        &server.http_settings,
        server.tls.as_ref(),
        http_shutdown,
    )
    .await?;
    state.tasks.close();
    // Heartbeats answered while HTTP drained.
    if let Err(e) = crate::store::own_task(state.nodes.liveness.flush(&server.store)).await {
        tracing::warn!(error = %e, "cannot store when nodes were last heard");
    }
    // A publish still uploading is abandoned at the deadline: it writes to a temporary
    // file and renames, so nothing half-written is left behind.
    if tokio::time::timeout(server.http_settings.shutdown_grace(), state.tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!("owned tasks still running after the shutdown grace: abandoning them");
    }
    server.store.close().await;
    tracing::info!("shut down cleanly");
    Ok(())
}

/// Serves each listener its routes until `shutdown`. Without HTTPS: every route on the
/// boot listener, or the admin API apart on its own. With HTTPS: the plain listener keeps
/// only what nodes need, and the admin API is reached over TLS alone.
async fn serve_listeners(
    listeners: Listeners,
    state: &AppState,
    settings: &crate::http::serve::HttpSettings,
    certs: Option<&std::sync::Arc<crate::http::tls::Certificates>>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    use crate::http::serve::serve;
    let tls = match certs {
        Some(certs) => {
            tokio::spawn(certs.clone().watch(shutdown.clone()));
            Some(certs.server_config().map_err(anyhow::Error::msg)?)
        }
        None => None,
    };
    let boot_app = if tls.is_none() && listeners.admin.is_none() {
        router(state.clone())
    } else {
        crate::http::boot_router(state.clone())
    };
    // With an admin listener of its own, the admin API stays there, over TLS too.
    let https_app = if listeners.admin.is_some() {
        crate::http::boot_router(state.clone())
    } else {
        router(state.clone())
    };
    let kept_blobs = crate::http::small_blobs::KeptBlobAnswers::new(state);
    let admin = listeners.admin.map(|admin| {
        serve(
            admin,
            crate::http::admin_router(state.clone()),
            settings,
            tls.clone(),
            state.blob_maps.clone(),
            None, // the admin listener serves no blobs
            shutdown.clone(),
        )
    });
    let https = match (listeners.tls, &tls) {
        (Some(l), Some(config)) => Some(serve(
            l,
            https_app,
            settings,
            Some(config.clone()),
            state.blob_maps.clone(),
            kept_blobs.clone(),
            shutdown.clone(),
        )),
        (Some(_), None) => anyhow::bail!("an HTTPS listener without [http] tls_cert_file"),
        (None, _) => None,
    };
    let optional = |f: Option<_>| async move {
        if let Some(f) = f {
            f.await
        }
    };
    tokio::join!(
        serve(
            listeners.boot,
            boot_app,
            settings,
            None,
            state.blob_maps.clone(),
            kept_blobs,
            shutdown.clone()
        ),
        optional(admin),
        optional(https),
    );
    Ok(())
}

/// Connections the kernel queues before we accept them (capped by net.core.somaxconn).
/// A boot storm opens thousands at once; tokio's `bind` asks for 128 here, and every
/// connection past that costs its node a SYN retransmission (1 s, then 3 s).
pub const LISTEN_BACKLOG: u32 = 4096;

/// A TCP listener on `addr` with `LISTEN_BACKLOG`.
pub fn listen(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Binds and starts the TFTP server when `[tftp] listen` is set; it stops on `shutdown`.
pub async fn start_tftp(
    cfg: &ServerConfig,
    server: &Server,
    shutdown: CancellationToken,
) -> anyhow::Result<Option<tokio::task::JoinHandle<std::io::Result<()>>>> {
    let Some(addr) = cfg.tftp_listen else {
        return Ok(None);
    };
    let runtime = own_runtime(&TFTP_RUNTIME, "bootfleet-tftp", cores())?;
    let socket = std::net::UdpSocket::bind(addr)
        .and_then(|s| s.set_nonblocking(true).map(|()| s))
        .with_context(|| format!("cannot listen for TFTP on {addr}"))?;
    crate::udp_buffer::grow(&socket, crate::udp_buffer::BURST)?;
    // Registered with the TFTP runtime's reactor, which its own thread drives.
    let socket = {
        let _on = runtime.enter();
        tokio::net::UdpSocket::from_std(socket)?
    };
    if !cfg.ipxe_dir.is_dir() {
        tracing::warn!(dir = %cfg.ipxe_dir.display(), "iPXE directory missing: only blobs are served over TFTP (apt-get install ipxe)");
    }
    let (transfers, done) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(transfers_to_timeline(
        done,
        server.http.nodes.clone(),
        server.http.metrics.clone(),
    ));
    let grub = GrubFiles {
        nodes: server.http.nodes.clone(),
        http_url: cfg.dhcp.http_url.clone(),
        http_port: cfg.listen.port(),
    };
    let mut tftp = TftpServer::new(
        std::sync::Arc::new(FileSource::new(
            Some(cfg.ipxe_dir.clone()),
            Some(server.blobs.clone()),
        )),
        cfg.tftp.clone(),
        server.http.metrics.tftp(),
        Some(transfers),
    )
    .with_generated(std::sync::Arc::new(grub));
    if server.http.registry.shared.is_some() {
        // Blobs this server has not served before come from the object store, as over
        // HTTP (the Secure Boot chain fetches kernel and initrd over TFTP).
        tftp = tftp.with_fill(std::sync::Arc::new(CacheFill(server.http.registry.clone())));
    }
    let server = std::sync::Arc::new(tftp);
    tracing::info!(tftp_addr = %socket.local_addr()?, "tftp listening on {}", socket.local_addr()?);
    Ok(Some(runtime.spawn(server.run(socket, shutdown))))
}

/// TFTP's blobs filled from the object store through the registry's cache.
struct CacheFill(Registry);

#[async_trait::async_trait]
impl crate::tftp::files::BlobFill for CacheFill {
    async fn fill(&self, digest: &crate::api::Digest) -> Result<(), String> {
        self.0
            .local_blob(digest)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// GRUB's files over TFTP, for the Secure Boot chain (shim, then Debian's signed GRUB,
/// which has no HTTP): `grub/grub.cfg`, the same for every node, and each node's
/// `boot/node.grub?mac=<mac>`, its boot script for GRUB from the node service (a boot
/// record and token, as `/boot/node.ipxe`).
struct GrubFiles {
    nodes: std::sync::Arc<crate::node::service::NodeService>,
    /// The HTTP base the agent reports to: `[dhcp] http_url`, else our address on the
    /// node's segment and the HTTP port.
    http_url: Option<String>,
    http_port: u16,
}

#[async_trait::async_trait]
impl crate::tftp::files::Generated for GrubFiles {
    async fn generate(
        &self,
        path: &str,
        query: Option<&str>,
        client: std::net::IpAddr,
        local: std::net::IpAddr,
    ) -> Option<bytes::Bytes> {
        use crate::boot::script::Loader;
        // Every TFTP request asks (iPXE's binaries and blobs in a storm): nothing is made
        // before the name is one of these.
        let server = || {
            self.http_url
                .clone()
                .unwrap_or_else(|| format!("http://{local}:{}", self.http_port))
        };
        let scripts = self.nodes.templates.grub(local);
        let text = match path {
            "grub/grub.cfg" => scripts.entry(&server()).map_err(|e| e.to_string()),
            "boot/node.grub" => {
                let server = server();
                let mac: crate::api::Mac = query?
                    .split('&')
                    .find_map(|kv| kv.strip_prefix("mac="))?
                    .parse()
                    .ok()?;
                let hyphens = mac.to_string().replace(':', "-");
                let loader = Loader::Grub { tftp: local };
                match self
                    .nodes
                    .node_script(&server, &mac, None, Some(client), loader)
                    .await
                {
                    Ok(text) => Ok(text),
                    // Too soon or from the wrong address: said on the console, asked again.
                    Err(crate::node::service::BootError::Refused(refusal)) => scripts
                        .held(&server, &hyphens, "refused", &refusal.to_string())
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            }
            _ => return None,
        };
        match text {
            Ok(text) => Some(text.into()),
            Err(e) => {
                tracing::warn!(path, error = %e, "cannot make a GRUB file");
                None
            }
        }
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(2, usize::from)
}

static DHCP_RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
static TFTP_RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();

/// A runtime of its own for DHCP (one thread: a packet is microseconds of work) or TFTP
/// (a thread a core: 10,000 lockstep transfers at once are real work; one thread and two
/// measured the same at 10,000 nodes on 2 cores, 24 and 25 s TFTP p50): in a boot storm the main runtime runs thousands
/// of HTTP tasks (boot scripts, agents' reports), and a DHCP packet waiting in that queue
/// missed firmware's retransmit timers (PXE DHCP p50 11.5 s at 5% loss with the agents'
/// calls against 0.55 s without). Here its sockets are polled by threads that do nothing
/// else. One per process, shared by every server in it (tests start many), never
/// dropped: it ends with the process.
fn own_runtime(
    cell: &'static std::sync::OnceLock<tokio::runtime::Runtime>,
    name: &'static str,
    threads: usize,
) -> std::io::Result<tokio::runtime::Handle> {
    if let Some(runtime) = cell.get() {
        return Ok(runtime.handle().clone());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()?;
    // Two servers starting at once may both build one; the first set stays.
    let runtime = match cell.set(runtime) {
        Ok(()) => cell.get().expect("just set"),
        Err(spare) => {
            // Dropping a runtime inside another blocks; hand it to a thread of its own.
            std::thread::spawn(move || drop(spare));
            cell.get().expect("set by the other")
        }
    };
    Ok(runtime.handle().clone())
}

/// TFTP transfers as boot timeline steps: the client's address names its MAC through
/// DHCP's address book (a transfer from an address DHCP did not see is left out). Ends
/// when the TFTP server does.
async fn transfers_to_timeline(
    mut done: tokio::sync::mpsc::UnboundedReceiver<crate::tftp::metrics::TransferEvent>,
    nodes: std::sync::Arc<crate::node::service::NodeService>,
    metrics: crate::metrics::Metrics,
) {
    while let Some(transfer) = done.recv().await {
        if matches!(
            transfer.outcome,
            crate::tftp::metrics::Outcome::Completed | crate::tftp::metrics::Outcome::Unconfirmed
        ) {
            metrics.boot_phase(crate::metrics::phase::TFTP, transfer.duration.as_secs_f64());
        }
        let std::net::IpAddr::V4(ip) = transfer.client.ip().to_canonical() else {
            continue;
        };
        let now = crate::clock::now_ms();
        // A blob named for a boot (GRUB's kernel and initrds) is that boot's download,
        // as an HTTP one is: attestation asks what reached the boot.
        if let (path, Some(query)) = crate::tftp::files::split_query(&transfer.file)
            && let Some(hex) = path.trim_start_matches('/').strip_prefix("blobs/sha256/")
            && let Ok(digest) = crate::api::Digest::from_hex(hex)
            && let Some(boot) = query.split('&').find_map(|kv| kv.strip_prefix("boot="))
        {
            let done = matches!(
                transfer.outcome,
                crate::tftp::metrics::Outcome::Completed
                    | crate::tftp::metrics::Outcome::Unconfirmed
            );
            nodes.fetches.record_done(
                boot,
                crate::store::Fetch {
                    digest,
                    started_at_ms: now - transfer.duration.as_millis() as i64,
                    finished_at_ms: done.then_some(now),
                    offset: 0,
                    bytes: transfer.bytes,
                    whole: done,
                },
            );
            continue;
        }
        let Some(mac) = nodes.addresses.get().and_then(|book| book.mac_at(ip, now)) else {
            continue;
        };
        let step = format!("tftp {}", transfer.file);
        nodes.preboot.record(mac, step, transfer.summary(), now);
    }
}

/// Starts DHCP per `[dhcp]` (ports 67 and 4011); nothing when the mode is off. The tasks
/// stop on `shutdown`, the lease saver after a last save.
pub async fn start_dhcp(
    cfg: &ServerConfig,
    server: &Server,
    shutdown: CancellationToken,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    use crate::dhcp::decide::{Mode, Port, Settings};
    use crate::dhcp::server::{DhcpServer, bind};
    use std::net::{Ipv4Addr, SocketAddrV4};
    let d = &cfg.dhcp;
    let mode = d.mode.unwrap_or(Mode::Off);
    if mode == Mode::Off {
        return Ok(Vec::new());
    }
    let server_ip = d
        .server_ip
        .context("[dhcp] server_ip is required: our address on the boot segment")?;
    let journal = std::sync::Arc::new(StoreLeases(server.store.clone()));
    let settings = Settings {
        mode,
        server_ip,
        http_base: d
            .http_url
            .clone()
            .unwrap_or_else(|| format!("http://{server_ip}:{}", cfg.listen.port())),
        files: d.files.clone(),
        subnet_mask: d.subnet_mask.unwrap_or(Ipv4Addr::new(255, 255, 255, 0)),
        router: d.router,
        dns: d.dns.clone(),
    };
    let pools = dhcp_pools(mode, d, &settings, journal.as_ref()).await?;
    let slices = match d.slices.unwrap_or(1) {
        0 => anyhow::bail!("[dhcp] slices must be at least 1"),
        1 => crate::dhcp::server::Slices::whole(),
        _ if pools.is_empty() => anyhow::bail!("[dhcp] slices is for authoritative mode"),
        65.. => anyhow::bail!("[dhcp] slices: at most 64"),
        of => {
            for pool in &pools {
                let (start, end) = (u32::from(pool.config.start), u32::from(pool.config.end));
                crate::dhcp::leases::slice_range(
                    start,
                    end,
                    crate::dhcp::leases::Slice { index: 0, of },
                )
                .map_err(|e| anyhow::anyhow!("[dhcp] slices: {e}"))?;
            }
            crate::dhcp::server::Slices::of(of)
        }
    };
    match server.store.warm_node_cache().await {
        Ok(n) => tracing::info!(nodes = n, "DHCP node cache warmed"),
        Err(e) => {
            tracing::warn!(error = %e, "cannot warm the DHCP node cache; nodes are read as they ask")
        }
    }
    let dhcp = std::sync::Arc::new(DhcpServer {
        settings,
        pools,
        directory: std::sync::Arc::new(crate::node::directory::StoreDirectory {
            store: server.store.clone(),
            controller: server.http.nodes.controller.clone(),
            preboot: server.http.nodes.preboot.clone(),
        }),
        journal,
        metrics: server.http.metrics.dhcp(),
        chain_policy: d.chainload,
        chain: Default::default(),
        relay_port: crate::dhcp::server::SERVER_PORT,
        client_port: d.client_port.unwrap_or(crate::dhcp::server::CLIENT_PORT),
        requested: Default::default(),
        slices,
        first_sightings: Default::default(),
        saving: Default::default(),
    });
    // New boots are checked against what DHCP saw of the MAC on the wire.
    let book: std::sync::Arc<dyn crate::dhcp::directory::AddressBook> = dhcp.clone();
    if server.http.nodes.addresses.set(book).is_err() {
        anyhow::bail!("DHCP was started twice for one server");
    }
    let mut tasks = Vec::new();
    let ports = [
        (
            d.port.unwrap_or(crate::dhcp::server::SERVER_PORT),
            Port::Dhcp,
        ),
        (d.pxe_port.unwrap_or(4011), Port::PxeServer),
    ];
    let runtime = own_runtime(&DHCP_RUNTIME, "bootfleet-dhcp", 1)?;
    for (port, role) in ports {
        let addr = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port);
        // Registered with the DHCP runtime's reactor, which its own thread drives.
        let socket = {
            let _on = runtime.enter();
            bind(addr, d.interface.as_deref())
        }
        .with_context(|| {
            format!("cannot listen for DHCP on {addr} (port 67 needs root or CAP_NET_BIND_SERVICE)")
        })?;
        tracing::info!(%addr, interface = d.interface.as_deref().unwrap_or("*"), ?mode, "dhcp listening on {addr}");
        // DHCP's writes (a new MAC recorded) are bounded by its datagrams in flight, and
        // a refusal would cost the node the firmware's back-off: never refused.
        tasks.push(runtime.spawn(crate::store::own_task(dhcp.clone().serve(
            socket,
            role,
            shutdown.clone(),
        ))));
    }
    if let Some(task) = start_router_advertisements(d, &runtime, server, &shutdown)? {
        tasks.push(task);
    }
    if dhcp.slices.of > 1 {
        let holding = hold_a_slice(dhcp.clone(), server, shutdown.clone());
        tasks.push(tokio::spawn(crate::store::own_task(holding)));
    }
    tasks.push(tokio::spawn(crate::store::own_task(dhcp.persist(shutdown))));
    Ok(tasks)
}

/// Holds one slice of the pools among the servers of this segment (a role lease per
/// slice, named by the segment's first pool, so other segments' servers sharing the
/// store do not compete for it) and gives it out: on taking one, its saved leases are
/// read from the store, so a server taking over a dead one's slice keeps its clients'
/// addresses. Ends when the lease holder does (at `shutdown`).
fn hold_a_slice(
    dhcp: std::sync::Arc<crate::dhcp::server::DhcpServer>,
    server: &Server,
    shutdown: CancellationToken,
) -> impl std::future::Future<Output = ()> + use<> {
    use crate::dhcp::directory::LeaseJournal as _;
    let of = dhcp.slices.of;
    let first = &dhcp.pools[0].config;
    let roles = (1..=of)
        .map(|k| format!("dhcp-slice/{}-{}/{k}-of-{of}", first.start, first.end))
        .collect();
    let mut held = crate::leader::hold_one(
        server.store.clone(),
        roles,
        server.http.server_id.clone(),
        &server.http.tasks,
        shutdown.clone(),
    );
    let journal = StoreLeases(server.store.clone());
    async move {
        let retry = || async {
            tokio::select! {
                () = tokio::time::sleep(std::time::Duration::from_secs(1)) => true,
                () = shutdown.cancelled() => false,
            }
        };
        let mut cut: Option<Option<u32>> = None;
        loop {
            let now = held.borrow_and_update().clone();
            dhcp.slices.set_live(&now.live);
            let index = now.mine.map(|k| k as u32);
            if cut == Some(index) {
                // Only the holders of the others changed.
                if held.changed().await.is_err() {
                    return;
                }
                continue;
            }
            cut = Some(index);
            // Silent first: the slice held until now may be another server's already.
            dhcp.take_slice(None, &[]).expect("giving up cannot fail");
            // What it bound is saved before anything is cut from the store's leases:
            // a binding not saved would be given out again.
            while !dhcp.save_changes().await {
                if !retry().await {
                    return;
                }
            }
            while index.is_some() {
                let taken = match journal.load().await {
                    Ok(saved) => dhcp.take_slice(index, &saved),
                    Err(e) => Err(e),
                };
                let Err(e) = taken else { break };
                tracing::warn!(error = %e, "cannot take up the DHCP slice held; silent until it can");
                if !retry().await {
                    return;
                }
            }
            if held.changed().await.is_err() {
                return;
            }
        }
    }
}

/// Answers router solicitations on the boot interface (`[dhcp] router_advertisements`),
/// on DHCP's runtime. Asked for by default: a failure to open the socket (no IPv6 on the
/// host) is then a warning; asked for explicitly, it stops the start.
fn start_router_advertisements(
    d: &crate::config::DhcpFileConfig,
    runtime: &tokio::runtime::Handle,
    server: &Server,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
    let Some(interface) = d.interface.as_deref() else {
        if d.router_advertisements == Some(true) {
            anyhow::bail!("[dhcp] router_advertisements needs [dhcp] interface");
        }
        return Ok(None);
    };
    if d.router_advertisements == Some(false) {
        return Ok(None);
    }
    let bound = {
        let _on = runtime.enter();
        crate::dhcp::ra_server::RaServer::bind(interface, server.http.metrics.dhcp())
    };
    match bound {
        Ok(ra) => {
            tracing::info!(
                interface,
                "answering IPv6 router solicitations (no router here)"
            );
            Ok(Some(runtime.spawn(ra.serve(shutdown.clone()))))
        }
        Err(e) if d.router_advertisements == Some(true) => {
            Err(e).with_context(|| format!("cannot answer router solicitations on {interface}"))
        }
        Err(e) => {
            tracing::warn!(interface, error = %e, "cannot answer router solicitations: iPXE will wait about 16 s for IPv6 at each start");
            Ok(None)
        }
    }
}

/// Authoritative mode's pools: `[dhcp.pool]` for our own segment, one per
/// `[[dhcp.subnet]]` behind a relay, each holding its leases from the journal.
async fn dhcp_pools(
    mode: crate::dhcp::decide::Mode,
    d: &crate::config::DhcpFileConfig,
    settings: &crate::dhcp::decide::Settings,
    journal: &StoreLeases,
) -> anyhow::Result<Vec<crate::dhcp::pools::Pool>> {
    use crate::dhcp::directory::LeaseJournal as _;
    use crate::dhcp::pools::Pool;
    if mode != crate::dhcp::decide::Mode::Authoritative {
        return Ok(Vec::new());
    }
    if d.pool.is_none() && d.subnet.is_empty() {
        anyhow::bail!("[dhcp] mode authoritative needs [dhcp.pool] or [[dhcp.subnet]]");
    }
    crate::dhcp::pools::check_disjoint(d.pool.as_ref(), &d.subnet).map_err(anyhow::Error::msg)?;
    let saved = journal.load().await.map_err(anyhow::Error::msg)?;
    let mut pools = Vec::new();
    if let Some(pool) = &d.pool {
        pools.push(Pool::local(pool, settings.clone()).map_err(anyhow::Error::msg)?);
    }
    for subnet in &d.subnet {
        pools.push(Pool::relayed(subnet, settings).map_err(anyhow::Error::msg)?);
    }
    for pool in &pools {
        pool.leases
            .lock()
            .expect("not poisoned")
            .load(saved.iter().copied());
    }
    Ok(pools)
}

/// DHCP's lease journal over the store (bound leases only; offers live in memory).
pub struct StoreLeases(pub crate::store::Store);

#[async_trait::async_trait]
impl crate::dhcp::directory::LeaseJournal for StoreLeases {
    async fn load(&self) -> Result<Vec<crate::dhcp::leases::Lease>, String> {
        let rows = self.0.load_leases().await.map_err(|e| e.to_string())?;
        Ok(rows
            .into_iter()
            .map(|r| crate::dhcp::leases::Lease {
                mac: r.mac.octets(),
                ip: r.ip,
                expires_ms: r.expires_ms,
                bound: true,
            })
            .collect())
    }

    async fn save(
        &self,
        keep: &[crate::dhcp::leases::Lease],
        gone: &[crate::dhcp::leases::Lease],
    ) -> Result<(), String> {
        let rows = |leases: &[crate::dhcp::leases::Lease]| -> Vec<crate::store::LeaseRow> {
            leases
                .iter()
                .map(|l| crate::store::LeaseRow {
                    mac: l.mac.into(),
                    ip: l.ip,
                    expires_ms: l.expires_ms,
                })
                .collect()
        };
        let (keep, gone) = (rows(keep), rows(gone));
        self.0
            .save_leases(&keep, &gone)
            .await
            .map_err(|e| e.to_string())
    }
}
