//! The connection layer under the routes: accepts TCP connections up to a cap, bounds how
//! long a client may take to send its headers, stall its body or leave a response unread,
//! and shuts down within a deadline.
//!
//! `axum::serve` has none of these knobs (it installs no timer, so hyper's header timeout
//! never fires, and it waits for every connection at shutdown), so connections are served
//! with hyper's HTTP/1 builder directly.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower_http::timeout::RequestBodyTimeoutLayer;

use super::sendfile::SendfileStream;

/// `[http]` in the settings file: what one client may hold of the server.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSettings {
    /// Connections served at once, on each listener; up to four times as many more are
    /// accepted and wait their turn in arrival order (a node agent's call first,
    /// `http/slots.rs`), and past those the kernel's backlog (LISTEN_BACKLOG, capped by
    /// net.core.somaxconn), then their SYN retries. A boot
    /// storm is served fastest by few connections at a time: at 10,000 nodes on 2 cores,
    /// 1,024 readied them sooner, with less CPU and a third of the memory of 8,192
    /// (BENCHMARKS.md). The price: where links are slow, this many long blob downloads
    /// hold every slot and boot scripts and heartbeats wait behind them; raise it there.
    /// Lowered to fit the open-file limit [default: 1024].
    pub max_connections: usize,
    /// Past this many open connections (on the listener), responses say `Connection:
    /// close`, so that idle kept-alive connections, about 30 KiB each in hyper's buffers
    /// and their tokio task, stay bounded when `max_connections` is raised. 0: none is
    /// kept alive. Below `max_connections` it costs reconnects: in a storm every
    /// connection is busy, and 512 of 1,024 took 20-30% more server CPU at 10,000 nodes
    /// (BENCHMARKS.md) [default: 1024].
    pub keep_alive_connections: usize,
    /// A request's headers must arrive within this long of the connection opening or of
    /// the previous response ending: the header and the keep-alive idle timeout
    /// [default: 30].
    pub header_timeout_secs: u64,
    /// A request body that sends nothing for this long is abandoned [default: 60].
    pub body_timeout_secs: u64,
    /// A response the client reads nothing of for this long is abandoned [default: 60].
    pub write_timeout_secs: u64,
    /// On shutdown, requests and publishes in flight get this long to finish [default: 30].
    pub shutdown_grace_secs: u64,
    /// HTTPS: the certificate chain (PEM, the server's first), reloaded on SIGHUP or
    /// when it changes. With it, `tls_listen` serves every route over HTTPS,
    /// `admin_listen` speaks HTTPS, and the plain `listen` keeps only what nodes' firmware
    /// needs (scripts, blobs, the agent's calls), so no admin token crosses in clear.
    pub tls_cert_file: Option<std::path::PathBuf>,
    /// The certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub tls_key_file: Option<std::path::PathBuf>,
    /// Serve over HTTPS on this address: every route, or with `admin_listen` set the
    /// boot routes only (scripts and blobs for firmware that speaks TLS).
    pub tls_listen: Option<std::net::SocketAddr>,
    /// Failed authentications a source (an address; an IPv6 /64) may make in a minute
    /// before its admin requests are refused until the minute ends [default: 20].
    pub auth_failures_per_minute: u32,
}

impl Default for HttpSettings {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            keep_alive_connections: 1024,
            header_timeout_secs: 30,
            body_timeout_secs: 60,
            write_timeout_secs: 60,
            shutdown_grace_secs: 30,
            tls_cert_file: None,
            tls_key_file: None,
            tls_listen: None,
            auth_failures_per_minute: crate::auth::limiter::MAX_FAILURES,
        }
    }
}

/// The address a request's connection came from, in each request's extensions.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub std::net::SocketAddr);

/// In a request's extensions when its connection is TLS: the URLs it is answered with
/// say `https`, and the console's cookie is marked Secure.
#[derive(Debug, Clone, Copy)]
pub struct OverTls;

/// File descriptors kept back from connections: the database pool, blob files being
/// served, TFTP and DHCP sockets, object-store requests.
const RESERVED_FDS: u64 = 512;

/// Connections accepted for each one served at once: the rest wait in process, in arrival
/// order, for a slot. Left in the kernel's backlog instead, past `LISTEN_BACKLOG` (or
/// net.core.somaxconn) their handshakes are dropped and each client waits out a SYN
/// retransmission (1 s, then 3, 7, 15 s): at 10,000 nodes, tens of thousands of them.
/// A waiting connection holds a descriptor and a small task, not hyper's buffers.
const WAITING_PER_SERVED: usize = 5;

impl HttpSettings {
    fn secs(s: u64) -> Duration {
        Duration::from_secs(s.max(1))
    }

    /// The certificate and key, when HTTPS is configured; an error names what is missing.
    pub fn tls_files(&self) -> Result<Option<(&std::path::Path, &std::path::Path)>, String> {
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(c), Some(k)) => Ok(Some((c, k))),
            (None, None) if self.tls_listen.is_none() => Ok(None),
            (None, None) => Err("[http] tls_listen needs tls_cert_file and tls_key_file".into()),
            _ => Err("[http] tls_cert_file and tls_key_file go together".into()),
        }
    }

    pub fn shutdown_grace(&self) -> Duration {
        Self::secs(self.shutdown_grace_secs)
    }

    /// Connections served at once (`max_connections`), and connections accepted (served
    /// or waiting their turn, `WAITING_PER_SERVED`), both to fit the open-file limit,
    /// raised to its hard limit first (a boot storm holds thousands of connections; the
    /// usual soft limit is 1024).
    fn connection_limits(&self) -> (usize, usize) {
        use nix::sys::resource::{Resource, getrlimit, setrlimit};
        let soft = match getrlimit(Resource::RLIMIT_NOFILE) {
            Ok((soft, hard)) if soft < hard => setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
                .map(|_| hard)
                .unwrap_or(soft),
            Ok((soft, _)) => soft,
            Err(_) => return (self.max_connections.max(1), self.max_connections.max(1)),
        };
        let fit = usize::try_from(soft.saturating_sub(RESERVED_FDS).max(16)).unwrap_or(usize::MAX);
        let cap = self.max_connections.clamp(1, fit);
        if cap < self.max_connections {
            tracing::warn!(
                max_connections = self.max_connections,
                cap,
                nofile = soft,
                "[http] max_connections lowered to fit the open-file limit"
            );
        }
        // Waiting connections take a quarter of the descriptors at most: up to three
        // listeners, TFTP's transfers and the blob files being sent need theirs.
        let room = cap.saturating_mul(WAITING_PER_SERVED).min(fit / 4).max(cap);
        if room < cap.saturating_mul(WAITING_PER_SERVED) {
            tracing::warn!(
                cap,
                accepted = room,
                nofile = soft,
                "[http] fewer connections wait in process (the open-file limit): more in the kernel's backlog"
            );
        }
        (cap, room)
    }
}

/// Serves `app` on `listener` (over TLS when `tls` is given) until `shutdown` is
/// cancelled, then gives open connections `shutdown_grace` to finish their requests and
/// closes the rest. Plain connections send the bytes of `blob_maps`' mappings with
/// sendfile. `kept_blobs`, where given, answers plain requests for small blobs kept in
/// memory before `app` routes them.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    settings: &HttpSettings,
    tls: Option<Arc<rustls::ServerConfig>>,
    blob_maps: Arc<super::blob_maps::BlobMaps>,
    kept_blobs: Option<Arc<super::small_blobs::KeptBlobAnswers>>,
    shutdown: CancellationToken,
) {
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    let handshake_timeout = HttpSettings::secs(settings.header_timeout_secs);
    let (cap, accepted_cap) = settings.connection_limits();
    let slots = super::slots::Slots::new(cap);
    let accepted = Arc::new(Semaphore::new(accepted_cap));
    let write_timeout = HttpSettings::secs(settings.write_timeout_secs);
    let app = app.layer(RequestBodyTimeoutLayer::new(HttpSettings::secs(
        settings.body_timeout_secs,
    )));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HttpSettings::secs(settings.header_timeout_secs));
    let graceful = GracefulShutdown::new();
    loop {
        // Room first: past it, new connections wait in the kernel's backlog, unaccepted.
        let room = tokio::select! {
            _ = shutdown.cancelled() => break,
            room = accepted.clone().acquire_owned() => room.expect("the semaphore is never closed"),
        };
        let (tcp, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors or memory: wait for connections to end rather
                    // than spin on a listener that stays readable.
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        // Small responses (scripts, API) must not wait on Nagle.
        let _ = tcp.set_nodelay(true);
        let blob_maps = blob_maps.clone();
        let app = tower_http::add_extension::AddExtension::new(app.clone(), Peer(peer));
        let app = super::small_blobs::KeptBlobsFirst::new(app, kept_blobs.clone());
        let app = close_when_busy(app, slots.clone(), settings.keep_alive_connections);
        let watcher = graceful.watcher();
        let builder = builder.clone();
        let tls = tls.clone();
        let (slots, shutdown) = (slots.clone(), shutdown.clone());
        tokio::spawn(async move {
            // A slot to be served in: at once if one is free, else in arrival order, a
            // node agent's call first (`slots`; told apart on plain connections only).
            let agent =
                tls.is_none() && !slots.any_free() && super::slots::is_agent_call(&tcp).await;
            let slot = tokio::select! {
                _ = shutdown.cancelled() => return,
                slot = slots.acquire(agent) => slot,
            };
            // Boxed once its turn comes: a connection waiting for a slot holds a small
            // task, not the room hyper's connection state takes.
            let serving = Box::pin(async move {
                match tls {
                    None => {
                        let io = timed(SendfileStream::new(tcp, blob_maps), write_timeout);
                        let conn = builder
                            .serve_connection(TokioIo::new(io), TowerToHyperService::new(app));
                        watcher.watch(conn).await
                    }
                    Some(tls) => {
                        // The handshake gets as long as a request's headers would.
                        let io = timed(tcp, write_timeout);
                        match tokio::time::timeout(handshake_timeout, tls.accept(io)).await {
                            Ok(Ok(stream)) => {
                                let app =
                                    tower_http::add_extension::AddExtension::new(app, OverTls);
                                let conn = builder.serve_connection(
                                    TokioIo::new(stream),
                                    TowerToHyperService::new(app),
                                );
                                watcher.watch(conn).await
                            }
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                Ok(())
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "TLS handshake timed out");
                                Ok(())
                            }
                        }
                    }
                }
            });
            // Timeouts and resets end here; they are the client's, not ours to log loudly.
            if let Err(e) = serving.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(slot);
            drop(room);
        });
    }
    drop(listener);
    // Connections being served (those still waiting for a slot end at once).
    let open = slots.held();
    if tokio::time::timeout(settings.shutdown_grace(), graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            open,
            grace_secs = settings.shutdown_grace_secs,
            "connections still open after the shutdown grace: closing them"
        );
    }
}

/// `app` whose responses end their connection while more than `keep_alive` connections
/// hold slots: the header is the one race-free way to close a kept-alive connection
/// (closing an idle one races the client's next request on it).
fn close_when_busy<S>(
    app: S,
    slots: Arc<super::slots::Slots>,
    keep_alive: usize,
) -> tower::util::MapResponse<
    S,
    impl Fn(axum::response::Response) -> axum::response::Response + Clone,
> {
    tower::util::MapResponse::new(app, move |mut response: axum::response::Response| {
        let open = slots.held();
        if open > keep_alive {
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        response
    })
}

/// `io` whose writes fail after `write_timeout` without progress.
fn timed<S: AsyncRead + AsyncWrite>(
    io: S,
    write_timeout: Duration,
) -> Pin<Box<tokio_io_timeout::TimeoutStream<S>>> {
    let mut io = tokio_io_timeout::TimeoutStream::new(io);
    io.set_write_timeout(Some(write_timeout));
    Box::pin(io)
}
