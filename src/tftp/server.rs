//! The TFTP socket loop: receives requests on the listening socket and runs each transfer
//! on its own task and ephemeral socket. Thin: decisions live in `transfer` and `options`.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::files::{
    BlobFill, Content, FileSource, Generated, Opened, blob_digest, check_name, split_query,
};
use super::metrics::{Outcome, TftpMetrics, TransferEvent};
use super::options::{OptionLimits, negotiate};
use super::packet::{ErrorCode, Packet, encode_data_header};
use super::pktinfo;
use super::transfer::{Step, Transfer};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TftpSettings {
    pub max_transfers: usize,
    /// Retransmissions of one window before the transfer is abandoned: with exponential
    /// back-off to 5 s, 12 tries span about 40 s of silence from the client.
    pub max_retries: u32,
    /// A transfer taking longer than this is abandoned, whatever its progress.
    pub total_timeout: Duration,
    pub limits: OptionLimits,
}

impl Default for TftpSettings {
    fn default() -> Self {
        Self {
            max_transfers: 1024,
            max_retries: 12,
            total_timeout: Duration::from_secs(600),
            limits: OptionLimits::default(),
        }
    }
}

pub struct TftpServer {
    files: Arc<FileSource>,
    settings: TftpSettings,
    metrics: Arc<TftpMetrics>,
    /// Where transfer events go (the node timeline); None: only logged.
    events: Option<mpsc::UnboundedSender<TransferEvent>>,
    /// Transfers in progress by client address, so a retransmitted request nudges its
    /// transfer instead of starting a second one.
    active: std::sync::Mutex<HashMap<SocketAddr, Arc<Notify>>>,
    /// Files made on request (GRUB's per-node configuration), asked before the disk.
    generated: Option<Arc<dyn Generated>>,
    fill: Option<Arc<dyn BlobFill>>,
}

/// Removes a transfer from `active` when it ends, however it ends.
struct ActiveGuard<'a> {
    server: &'a TftpServer,
    client: SocketAddr,
}

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.server
            .active
            .lock()
            .expect("active lock")
            .remove(&self.client);
    }
}

impl TftpServer {
    pub fn new(
        files: Arc<FileSource>,
        settings: TftpSettings,
        metrics: Arc<TftpMetrics>,
        events: Option<mpsc::UnboundedSender<TransferEvent>>,
    ) -> Self {
        Self {
            files,
            settings,
            metrics,
            events,
            active: Default::default(),
            generated: None,
            fill: None,
        }
    }

    /// Opens a checked name: a stat, and a first read of a small file, on the blocking
    /// pool, since a slow disk must not stall every other transfer.
    async fn open(&self, name: &str) -> std::io::Result<Opened> {
        let files = self.files.clone();
        let name = name.to_string();
        tokio::task::spawn_blocking(move || files.open(&name))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)))
    }

    /// Asks `fill` to make each blob present before it is opened (a cache of an object
    /// store).
    pub fn with_fill(mut self, fill: Arc<dyn BlobFill>) -> Self {
        self.fill = Some(fill);
        self
    }

    /// Serves `generated`'s files too.
    pub fn with_generated(mut self, generated: Arc<dyn Generated>) -> Self {
        self.generated = Some(generated);
        self
    }

    pub fn metrics(&self) -> &Arc<TftpMetrics> {
        &self.metrics
    }

    /// Serves on an already-bound socket until `shutdown`; then waits for transfers.
    pub async fn run(
        self: Arc<Self>,
        socket: UdpSocket,
        shutdown: CancellationToken,
    ) -> std::io::Result<()> {
        let local = socket.local_addr()?;
        // Bound to 0.0.0.0, only IP_PKTINFO says which address a request came to, and the
        // reply must come from that address or the client drops it.
        let wildcard = local.ip().is_unspecified();
        if wildcard {
            pktinfo::enable(&socket)?;
        }
        let slots = Arc::new(Semaphore::new(self.settings.max_transfers));
        let mut transfers = JoinSet::new();
        let mut buf = vec![0u8; 2048];
        loop {
            let received = tokio::select! {
                _ = shutdown.cancelled() => break,
                Some(_) = transfers.join_next(), if !transfers.is_empty() => continue,
                r = pktinfo::recv(&socket, &mut buf, wildcard) => r,
            };
            let (len, client, to) = match received {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(error = %e, "tftp receive failed");
                    continue;
                }
            };
            let local_ip = to.unwrap_or(local.ip());
            let packet = match Packet::parse(&buf[..len]) {
                Ok(p) => p,
                Err(e) => {
                    self.metrics.malformed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%client, error = %e, "dropped malformed tftp packet");
                    continue;
                }
            };
            let request = match packet {
                Packet::Rrq(r) => r,
                Packet::Wrq(r) => {
                    self.metrics.refused_writes.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(%client, file = %r.filename, "refused tftp write");
                    reply_error(
                        local_ip,
                        client,
                        ErrorCode::AccessViolation,
                        "this server is read-only",
                    )
                    .await;
                    continue;
                }
                _ => {
                    // DATA/ACK/ERROR on the request port belong to no transfer.
                    self.metrics.malformed.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            let existing = self
                .active
                .lock()
                .expect("active lock")
                .get(&client)
                .cloned();
            if let Some(kick) = existing {
                // The client did not hear us yet and asked again: same transfer.
                self.metrics
                    .duplicate_requests
                    .fetch_add(1, Ordering::Relaxed);
                kick.notify_one();
                continue;
            }
            self.metrics.requests.fetch_add(1, Ordering::Relaxed);
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                self.metrics.refused_busy.fetch_add(1, Ordering::Relaxed);
                reply_error(
                    local_ip,
                    client,
                    ErrorCode::NotDefined,
                    "server busy, try again",
                )
                .await;
                continue;
            };
            let kick = Arc::new(Notify::new());
            self.active
                .lock()
                .expect("active lock")
                .insert(client, kick.clone());
            let server = self.clone();
            let shutdown = shutdown.clone();
            transfers.spawn(async move {
                let _permit = permit;
                let _active = ActiveGuard {
                    server: &server,
                    client,
                };
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = server.transfer(local_ip, client, request, &kick) => {}
                }
            });
        }
        while transfers.join_next().await.is_some() {}
        Ok(())
    }

    async fn transfer(
        &self,
        local_ip: IpAddr,
        client: SocketAddr,
        request: super::packet::Request,
        kick: &Notify,
    ) {
        let started = Instant::now();
        let mut event = TransferEvent {
            client,
            file: request.filename.clone(),
            bytes: 0,
            duration: Duration::ZERO,
            retransmits: 0,
            outcome: Outcome::Completed,
        };
        let outcome = self
            .serve(local_ip, client, &request, &mut event, kick)
            .await;
        event.duration = started.elapsed();
        event.outcome = outcome;
        self.metrics.record(&event);
        match &event.outcome {
            Outcome::Completed | Outcome::Unconfirmed => {
                tracing::info!(%client, file = %event.file, bytes = event.bytes, ms = event.duration.as_millis() as u64, retransmits = event.retransmits, confirmed = event.outcome == Outcome::Completed, "tftp transfer done")
            }
            other => {
                tracing::info!(%client, file = %event.file, outcome = ?other, "tftp transfer failed")
            }
        }
        if let Some(events) = &self.events {
            let _ = events.send(event);
        }
    }

    async fn serve(
        &self,
        local_ip: IpAddr,
        client: SocketAddr,
        request: &super::packet::Request,
        event: &mut TransferEvent,
        kick: &Notify,
    ) -> Outcome {
        let socket = match bind_reply_socket(local_ip, client).await {
            Ok(s) => s,
            Err(e) => return Outcome::Failed(format!("cannot open a reply socket: {e}")),
        };
        if request.mode != "octet" {
            let m = format!("mode {:?} is not supported; use octet", request.mode);
            send_error(&socket, ErrorCode::IllegalOperation, &m).await;
            return Outcome::Refused(m);
        }
        let (path, query) = split_query(&request.filename);
        // GRUB names files from the root (`/grub/grub.cfg`), as many TFTP clients do:
        // the root is ours, so a leading `/` is read as the root (what follows is checked
        // as any name is).
        let path = path.trim_start_matches('/');
        let name = match check_name(path) {
            Ok(n) => n,
            Err(e) => {
                self.metrics.refused_paths.fetch_add(1, Ordering::Relaxed);
                let m = e.to_string();
                send_error(&socket, ErrorCode::AccessViolation, &m).await;
                return Outcome::Refused(m);
            }
        };
        let made = match &self.generated {
            Some(g) => g.generate(&name, query, client.ip(), local_ip).await,
            None => None,
        };
        if made.is_none()
            && let (Some(fill), Some(digest)) = (&self.fill, blob_digest(&name))
            && let Err(why) = fill.fill(&digest).await
        {
            let m = format!("{name}: {why}");
            send_error(&socket, ErrorCode::NotDefined, &m).await;
            return Outcome::Failed(m);
        }
        let opened = if let Some(bytes) = made {
            Ok(Opened {
                len: bytes.len() as u64,
                content: Content::Memory(bytes),
            })
        } else {
            let mut opened = self.open(&name).await;
            // Evicted from the cache by another fill between this one and the open: fill
            // again (firmware takes "file not found" as final).
            if matches!(&opened, Err(e) if e.kind() == std::io::ErrorKind::NotFound)
                && let (Some(fill), Some(digest)) = (&self.fill, blob_digest(&name))
                && fill.fill(&digest).await.is_ok()
            {
                opened = self.open(&name).await;
            }
            opened
        };
        let Opened { content, len } = match opened {
            Ok(o) => o,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let m = format!("{name}: file not found");
                send_error(&socket, ErrorCode::FileNotFound, &m).await;
                return Outcome::Refused(m);
            }
            // Out of file descriptors (a storm's thousands of transfers and downloads):
            // no error packet, which firmware takes as fatal; its RRQ retransmit comes
            // back when a transfer has ended.
            Err(e)
                if [nix::errno::Errno::EMFILE, nix::errno::Errno::ENFILE]
                    .map(|n| Some(n as i32))
                    .contains(&e.raw_os_error()) =>
            {
                self.metrics.refused_busy.fetch_add(1, Ordering::Relaxed);
                return Outcome::Failed(format!("{name}: {e}; left for the client to retry"));
            }
            Err(e) => {
                let m = format!("{name}: {e}");
                send_error(&socket, ErrorCode::NotDefined, &m).await;
                return Outcome::Failed(m);
            }
        };
        let negotiated = negotiate(&request.options, len, self.settings.limits);
        let now = Instant::now();
        let mut transfer = Transfer::new(len, &negotiated, self.settings.max_retries, now);
        let give_up_at = now + self.settings.total_timeout;
        let oack = Packet::Oack {
            options: negotiated.oack.clone(),
        }
        .encode();
        let mut step = transfer.start(now);
        let segment = transfer.blksize() as usize + 4;
        let gso = negotiated.windowsize > 1 && enable_gso(&socket, segment);
        let mut packet = Vec::with_capacity(
            segment
                * if gso {
                    max_segments(segment) as usize
                } else {
                    1
                },
        );
        let mut buf = vec![0u8; 1024];
        // One timer for the whole transfer, moved forward rather than re-created.
        let timer = tokio::time::sleep_until(tokio::time::Instant::from_std(transfer.deadline()));
        tokio::pin!(timer);
        loop {
            match step {
                Step::Done => {
                    event.bytes = len;
                    event.retransmits = transfer.retransmits;
                    return Outcome::Completed;
                }
                Step::Failed(reason) => {
                    event.bytes = transfer.bytes_acked(len);
                    event.retransmits = transfer.retransmits;
                    send_error(&socket, ErrorCode::NotDefined, &reason).await;
                    return Outcome::Failed(reason);
                }
                Step::SendOack => {
                    tracing::debug!(%client, "tftp sending oack");
                    if let Err(e) = socket.send(&oack).await {
                        return Outcome::Failed(format!("send failed: {e}"));
                    }
                }
                Step::SendBlocks { first, last } => {
                    let (window_start, _) = transfer.block_range(first, len);
                    let (_, window_end) = transfer.block_range(last, len);
                    let window = match content.range(window_start, window_end).await {
                        Ok(w) => w,
                        Err(e) => return Outcome::Failed(format!("read failed: {e}")),
                    };
                    // With GSO, consecutive full-size packets leave in one system call;
                    // the kernel cuts the buffer into datagrams of `segment` bytes.
                    let per_send = if gso { max_segments(segment) } else { 1 };
                    let mut b = first;
                    while b <= last {
                        packet.clear();
                        let batch_end = (b + per_send - 1).min(last);
                        for block in b..=batch_end {
                            let (start, end) = transfer.block_range(block, len);
                            encode_data_header(&mut packet, Transfer::wire_block(block));
                            packet.extend_from_slice(
                                &window[(start - window_start) as usize
                                    ..(end - window_start) as usize],
                            );
                        }
                        if let Err(e) = socket.send(&packet).await {
                            // ICMP unreachable from an earlier send: the client is gone.
                            return client_gone(&transfer, len, event, e);
                        }
                        b = batch_end + 1;
                    }
                }
                Step::Wait => {}
            }
            if Instant::now() > give_up_at {
                event.bytes = transfer.bytes_acked(len);
                return Outcome::Failed("transfer took longer than the total timeout".into());
            }
            timer
                .as_mut()
                .reset(tokio::time::Instant::from_std(transfer.deadline()));
            step = tokio::select! {
                _ = &mut timer => {
                    tracing::debug!(%client, rto_ms = transfer.rto().as_millis() as u64, "tftp retransmission timeout");
                    transfer.on_timeout(Instant::now())
                }
                _ = kick.notified() => {
                    tracing::debug!(%client, "tftp request repeated");
                    transfer.on_duplicate(Instant::now())
                }
                received = socket.recv(&mut buf) => match received {
                    Err(e) => return client_gone(&transfer, len, event, e),
                    Ok(n) => match Packet::parse(&buf[..n]) {
                        Ok(Packet::Ack { block }) => {
                            tracing::trace!(%client, block, "tftp ack");
                            transfer.on_ack(block, Instant::now())
                        }
                        Ok(Packet::Error { code, message }) => {
                            event.bytes = transfer.bytes_acked(len);
                            return Outcome::Aborted(format!("client sent error {code}: {message}"));
                        }
                        Ok(_) | Err(_) => {
                            self.metrics.malformed.fetch_add(1, Ordering::Relaxed);
                            Step::Wait
                        }
                    },
                },
            };
        }
    }
}

/// Turns on UDP generic segmentation offload for packets of `segment` bytes; false where
/// the kernel lacks it (then every packet is its own system call).
fn enable_gso(socket: &UdpSocket, segment: usize) -> bool {
    nix::sys::socket::setsockopt(
        socket,
        nix::sys::socket::sockopt::UdpGsoSegment,
        &(segment as i32),
    )
    .is_ok()
}

/// Packets per GSO send: the kernel allows 64 segments and one UDP datagram's worth of
/// bytes (65,507) per call.
fn max_segments(segment: usize) -> u64 {
    (65_000 / segment).clamp(1, 64) as u64
}

/// The client's port closed (ICMP port unreachable). After the final block that is a
/// client that has everything and did not linger for our retransmission.
fn client_gone(
    transfer: &Transfer,
    len: u64,
    event: &mut TransferEvent,
    e: std::io::Error,
) -> Outcome {
    event.retransmits = transfer.retransmits;
    if transfer.all_sent() && e.kind() == std::io::ErrorKind::ConnectionRefused {
        event.bytes = len;
        return Outcome::Unconfirmed;
    }
    event.bytes = transfer.bytes_acked(len);
    Outcome::Failed(format!("client unreachable: {e}"))
}

/// A socket of its own for one transfer (RFC 1350 TIDs), sending from the address the
/// request came to, connected so the kernel drops datagrams from anyone else.
async fn bind_reply_socket(local_ip: IpAddr, client: SocketAddr) -> std::io::Result<UdpSocket> {
    let socket = UdpSocket::bind(SocketAddr::new(local_ip, 0)).await?;
    socket.connect(client).await?;
    Ok(socket)
}

async fn reply_error(local_ip: IpAddr, client: SocketAddr, code: ErrorCode, message: &str) {
    if let Ok(socket) = bind_reply_socket(local_ip, client).await {
        send_error(&socket, code, message).await;
    }
}

/// Best effort: an error packet is a courtesy, the client times out anyway if it is lost.
async fn send_error(socket: &UdpSocket, code: ErrorCode, message: &str) {
    let _ = socket.send(&Packet::error(code, message).encode()).await;
}
