//! The DHCP socket loop: receive, check, classify, look the node up, decide, encode,
//! send where the client can hear it. Leases live in memory and are saved in batches
//! every `FLUSH_EVERY`, so no packet waits on a database write.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;

use super::chain::{Chain, ChainMemory, ChainPolicy};
use super::classify::{BootClass, classify};
use super::decide::{Decision, NAK, NodeView, Port, Reply, Settings, decide};
use super::directory::{AddressBook, LeaseJournal, NodeDirectory, WireAddress, Witnessed};
use super::leases::{Lease, Leases};
use super::metrics::DhcpMetrics;
use super::pools::{Pool, choose};
use super::reply::{encode, relay_info};
use super::wire::{Checked, MAX_PACKET, check};
use crate::api::Mac;

const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// Datagrams handled at once per socket.
const IN_FLIGHT: usize = 256;

pub const CLIENT_PORT: u16 = 68;
pub const SERVER_PORT: u16 = 67;

pub struct DhcpServer {
    pub settings: Settings,
    /// Authoritative mode's pools (`pools`); empty in proxy mode.
    pub pools: Vec<Pool>,
    /// What is known of each node (the node service).
    pub directory: Arc<dyn NodeDirectory>,
    /// Where bound leases are saved.
    pub journal: Arc<dyn LeaseJournal>,
    pub metrics: Arc<DhcpMetrics>,
    /// `[dhcp] chainload`, and what each MAC was last given under it.
    pub chain_policy: ChainPolicy,
    pub chain: Mutex<ChainMemory>,
    /// Where relayed replies go (a relay agent listens on 67).
    pub relay_port: u16,
    /// Where replies to clients go.
    pub client_port: u16,
    /// Proxy mode: the address each network-booting MAC asked the site's server for.
    pub requested: Mutex<super::requested::Requested>,
    /// Authoritative mode: which slice of every pool this server gives out.
    pub slices: Slices,
    /// Other slices' clients' DISCOVERs seen once (`balance`).
    pub first_sightings: Mutex<super::balance::FirstSightings>,
    /// One lease save at a time (the periodic one and a slice change's): two batches of
    /// one MAC committed out of order would leave the older row.
    pub saving: tokio::sync::Mutex<()>,
}

/// `[dhcp] slices`: the pools cut into `of` slices, of which this server holds one at a
/// time (or none: it then leaves every authoritative request to the others).
pub struct Slices {
    pub of: u32,
    /// The slice held plus one; 0: none.
    held: std::sync::atomic::AtomicU32,
    /// The slices some server holds, a bit each (0: not known).
    live: std::sync::atomic::AtomicU64,
}

impl Slices {
    /// One server, the whole pool, always.
    pub fn whole() -> Self {
        Self {
            of: 1,
            held: 1.into(),
            live: 0.into(),
        }
    }

    /// `of` slices, none held yet.
    pub fn of(of: u32) -> Self {
        Self {
            of,
            held: 0.into(),
            live: 0.into(),
        }
    }

    pub fn held(&self) -> Option<u32> {
        self.held.load(Ordering::Acquire).checked_sub(1)
    }

    /// The slices some server holds now (from the role leases).
    pub fn set_live(&self, live: &[usize]) {
        let mask = live
            .iter()
            .filter(|k| **k < 64)
            .fold(0u64, |m, k| m | (1 << k));
        self.live.store(mask, Ordering::Release);
    }
}

/// A UDP socket for DHCP: broadcast allowed, address reusable (one per interface), and
/// bound to `interface` (SO_BINDTODEVICE) when given, so we answer only on that segment.
pub fn bind(addr: SocketAddrV4, interface: Option<&str>) -> std::io::Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
    socket.set_reuse_address(true)?;
    socket.set_broadcast(true)?;
    crate::udp_buffer::grow(&socket, crate::udp_buffer::BURST)?;
    if let Some(dev) = interface {
        socket.bind_device(Some(dev.as_bytes()))?;
    }
    socket.bind(&SocketAddr::V4(addr).into())?;
    socket.set_nonblocking(true)?;
    UdpSocket::from_std(socket.into())
}

impl DhcpServer {
    /// What the directory knows of the client; nothing for a client that does not
    /// network-boot; None when the directory cannot answer.
    async fn node_view(
        &self,
        req: &Checked,
        uuid: Option<&str>,
        network_boot: bool,
    ) -> Option<NodeView> {
        if !network_boot {
            return Some(NodeView::default());
        }
        let mut view = self
            .directory
            .node_view(Mac::from(req.chaddr), uuid)
            .await?;
        // Here: whether the node is to be chainloaded at all; `handle` decides whether
        // this transaction gets the binary.
        view.chainload |= self.chain_policy == ChainPolicy::Always;
        Some(view)
    }

    /// Handles one datagram; returns the reply and where it goes.
    pub async fn handle(
        &self,
        bytes: &[u8],
        from: SocketAddr,
        port: Port,
    ) -> Option<(Vec<u8>, SocketAddr)> {
        let req = match check(bytes) {
            Ok(r) => r,
            Err(why) => {
                self.metrics.count(&format!("malformed.{}", why.as_str()));
                tracing::debug!(%from, reason = why.as_str(), "dropped a malformed DHCP packet");
                return None;
            }
        };
        let client = classify(&req);
        if self.pools.is_empty() && client.class.is_some() {
            self.witness_request(&req);
        }
        let Some(mut node) = self
            .node_view(&req, client.uuid.as_deref(), client.class.is_some())
            .await
        else {
            // A booting node we cannot look up: stay silent, so a server that can
            // answers (and the node retries), rather than tell it "no boot file".
            self.metrics.count("dropped.directory_unavailable");
            return None;
        };
        node.chainload = node.chainload
            && node.bootable
            && !node.local_boot
            && client.class == Some(BootClass::Ipxe)
            && self.chain.lock().expect("not poisoned").choose(
                req.chaddr,
                req.xid,
                crate::clock::now_ms(),
            ) == Chain::Binary;
        let pool = match (self.pools.is_empty(), choose(&self.pools, req.giaddr)) {
            (true, _) => None,
            (false, Some(pool)) => Some(pool),
            (false, None) => {
                self.metrics.count("ignored.no_pool_for_segment");
                return None;
            }
        };
        if pool.is_some() {
            let Some(held) = self.slices.held() else {
                // A standby: the servers holding the slices answer.
                self.metrics.count("ignored.no_slice_held");
                return None;
            };
            const DISCOVER: u8 = 1;
            if self.slices.of > 1
                && req.message_type() == DISCOVER
                && super::balance::first_answerer(
                    &req.chaddr,
                    self.slices.of,
                    self.slices.live.load(Ordering::Acquire),
                ) != held
                && !self
                    .first_sightings
                    .lock()
                    .expect("not poisoned")
                    .seen_again(req.chaddr, req.xid, crate::clock::now_ms())
            {
                // Another slice's client: its server answers first.
                self.metrics.count("ignored.another_slices_client");
                return None;
            }
        }
        let relayed;
        let settings = match pool {
            Some(p) if p.router_is_relay => {
                relayed = Settings {
                    router: Some(req.giaddr),
                    ..p.settings.clone()
                };
                &relayed
            }
            Some(p) => &p.settings,
            None => &self.settings,
        };
        let decision = {
            let mut leases = pool.map(|p| p.leases.lock().expect("not poisoned"));
            decide(
                &req,
                &client,
                &node,
                settings,
                leases.as_deref_mut(),
                port,
                crate::clock::now_ms(),
            )
        };
        let reply = match decision {
            Decision::Reply(r) => r,
            Decision::Ignore(why) => {
                self.metrics.count(&format!("ignored.{why}"));
                return None;
            }
            Decision::Done(what) => {
                self.metrics.count(what);
                return None;
            }
        };
        if node.chainload {
            self.metrics.count("chainload");
        }
        if client.class.is_some() {
            let (step, outcome) = timeline_step(&reply, client.class, port);
            self.directory
                .answered(Mac::from(req.chaddr), step, outcome);
        }
        self.metrics.count(match reply.message_type {
            super::decide::OFFER => "offer",
            NAK => "nak",
            _ => "ack",
        });
        let relay = if req.option(82).is_some() {
            relay_info(bytes)
        } else {
            None
        };
        let out = encode(&req, &reply, self.settings.server_ip, relay);
        Some((out, self.destination(&req, &reply, from, port)))
    }

    /// Proxy mode: remembers the address a booting client's DHCPREQUEST names.
    fn witness_request(&self, req: &Checked) {
        const REQUEST: u8 = 3;
        if req.message_type() != REQUEST {
            return;
        }
        let asked = req
            .option(50)
            .and_then(|o| <[u8; 4]>::try_from(o).ok())
            .map(Ipv4Addr::from)
            .unwrap_or(req.ciaddr);
        self.requested.lock().expect("not poisoned").record(
            req.chaddr,
            asked,
            crate::clock::now_ms(),
        );
    }

    /// RFC 2131 4.1: through the relay; to a configured client by unicast; else broadcast
    /// (we cannot unicast to an address the client does not hold yet without ARP help).
    fn destination(
        &self,
        req: &Checked,
        reply: &Reply,
        from: SocketAddr,
        port: Port,
    ) -> SocketAddr {
        if port == Port::PxeServer {
            return from;
        }
        if !req.giaddr.is_unspecified() {
            return SocketAddr::V4(SocketAddrV4::new(req.giaddr, self.relay_port));
        }
        if reply.message_type != NAK && !req.ciaddr.is_unspecified() {
            return SocketAddr::V4(SocketAddrV4::new(req.ciaddr, self.client_port));
        }
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::BROADCAST, self.client_port))
    }

    /// Serves `socket` (on `port`'s role) until `stop`. Datagrams are handled
    /// concurrently, up to `IN_FLIGHT` at once: each may wait on a node lookup, and one
    /// at a time a power-on burst overflows the socket buffer, costing every dropped
    /// node the firmware's 4 s back-off.
    pub async fn serve(self: Arc<Self>, socket: UdpSocket, port: Port, stop: CancellationToken) {
        let socket = Arc::new(socket);
        let in_flight = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
        let mut buf = vec![0u8; MAX_PACKET + 1];
        loop {
            let (n, from) = tokio::select! {
                r = socket.recv_from(&mut buf) => match r {
                    Ok(v) => v,
                    Err(e) => {
                        tracing::warn!(error = %e, "DHCP receive failed");
                        continue;
                    }
                },
                () = stop.cancelled() => return,
            };
            let Ok(permit) = in_flight.clone().acquire_owned().await else {
                return;
            };
            let (server, socket, datagram) = (self.clone(), socket.clone(), buf[..n].to_vec());
            tokio::spawn(async move {
                if let Some((reply, to)) = server.handle(&datagram, from, port).await
                    && let Err(e) = socket.send_to(&reply, to).await
                {
                    // Counted; at debug, since a flood of them (a client that vanished,
                    // a full buffer) would otherwise fill the log (11.7 MB in 60 s).
                    server.metrics.count("send-error");
                    tracing::debug!(%to, error = %e, "cannot send a DHCP reply");
                }
                drop(permit);
            });
        }
    }

    /// Saves the leases changed since the last save; false when a save failed (its
    /// changes are kept for the next).
    pub async fn save_changes(&self) -> bool {
        let _one = self.saving.lock().await;
        let mut saved = true;
        for pool in &self.pools {
            let (keep, gone) = pool.leases.lock().expect("not poisoned").take_changes();
            if let Err(e) = self.journal.save(&keep, &gone).await {
                tracing::warn!(error = %e, "cannot save DHCP leases; retrying");
                pool.leases
                    .lock()
                    .expect("not poisoned")
                    .requeue(&keep, &gone);
                saved = false;
            }
        }
        saved
    }

    /// Gives out `index`'s slice of every pool from now on, with the leases `saved` in
    /// it (from the shared store: those its last holder bound), or nothing (`None`).
    pub fn take_slice(&self, index: Option<u32>, saved: &[Lease]) -> Result<(), String> {
        let Some(index) = index else {
            self.slices.held.store(0, Ordering::Release);
            return Ok(());
        };
        let slice = super::leases::Slice {
            index,
            of: self.slices.of,
        };
        let mut cut = Vec::with_capacity(self.pools.len());
        for pool in &self.pools {
            let mut leases = Leases::sliced(&pool.config, slice)?;
            leases.load(saved.iter().copied());
            cut.push(leases);
        }
        for (pool, leases) in self.pools.iter().zip(cut) {
            let (start, end) = leases.range();
            tracing::info!(slice = index, of = slice.of, %start, %end, "DHCP gives out this slice of the pool");
            *pool.leases.lock().expect("not poisoned") = leases;
        }
        self.slices.held.store(index + 1, Ordering::Release);
        Ok(())
    }

    /// Saves lease changes every `FLUSH_EVERY`, and once more at `stop`.
    pub async fn persist(self: Arc<Self>, stop: CancellationToken) {
        if self.pools.is_empty() {
            return;
        }
        loop {
            let stopping = tokio::select! {
                () = tokio::time::sleep(FLUSH_EVERY) => false,
                () = stop.cancelled() => true,
            };
            self.save_changes().await;
            if stopping {
                return;
            }
        }
    }
}

/// An answer as a boot timeline step: `dhcp offer`, `ipxe dhcp ack`, `pxe (4011) ack`,
/// and what it gave (address, boot file).
fn timeline_step(reply: &Reply, class: Option<BootClass>, port: Port) -> (String, String) {
    let kind = match reply.message_type {
        super::decide::OFFER => "offer",
        NAK => "nak",
        _ => "ack",
    };
    let who = match (port, class) {
        (Port::PxeServer, _) => "pxe (4011)",
        (_, Some(BootClass::Ipxe)) => "ipxe dhcp",
        _ => "dhcp",
    };
    let mut given = Vec::new();
    if !reply.yiaddr.is_unspecified() {
        given.push(reply.yiaddr.to_string());
    }
    given.extend(reply.file.clone());
    let outcome = if given.is_empty() {
        "ok".to_string()
    } else {
        given.join(", ")
    };
    (format!("{who} {kind}"), outcome)
}

impl AddressBook for DhcpServer {
    fn address_of(&self, mac: Mac, now_ms: i64) -> Option<WireAddress> {
        let hw = mac.octets();
        if self.pools.is_empty() {
            let ip = self
                .requested
                .lock()
                .expect("not poisoned")
                .get(&hw, now_ms)?;
            return Some(WireAddress {
                ip,
                how: Witnessed::Requested,
            });
        }
        self.pools.iter().find_map(|pool| {
            let leases = pool.leases.lock().expect("not poisoned");
            let lease = leases.lease(&hw)?;
            (lease.bound && lease.expires_ms > now_ms).then_some(WireAddress {
                ip: lease.ip,
                how: Witnessed::Leased,
            })
        })
    }

    fn mac_at(&self, ip: Ipv4Addr, now_ms: i64) -> Option<Mac> {
        if self.pools.is_empty() {
            let requested = self.requested.lock().expect("not poisoned");
            return requested.mac_at(ip, now_ms).map(Mac::from);
        }
        self.pools.iter().find_map(|pool| {
            let leases = pool.leases.lock().expect("not poisoned");
            let lease = leases.holder(ip)?;
            (lease.bound && lease.expires_ms > now_ms).then_some(Mac::from(lease.mac))
        })
    }
}
