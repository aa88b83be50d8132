//! Answers router solicitations on the boot segment with `ra::advertisement`: a raw
//! ICMPv6 socket bound to the boot interface and joined to all-routers (ff02::2). Each
//! solicitation from a link-local address is answered to its sender, so a storm of
//! booting nodes costs one small datagram each; one from the unspecified address is
//! answered to all nodes, at most once in 3 s (RFC 4861 MIN_DELAY_BETWEEN_RAS). Once a
//! real router is heard advertising on the segment (a lifetime, or M or O set), we stop
//! answering for good: iPXE gets its answer from it, and ours must not contradict it.
//! The kernel passes us router solicitations and advertisements only (ICMP6_FILTER), and
//! each comes with the hop limit it arrived with: one below 255 was forwarded by a
//! router (RFC 4861 6.1.1, 6.1.2), so it is dropped and counted, and a forwarded
//! advertisement does not silence us.

use std::net::{Ipv6Addr, SocketAddrV6};
use std::os::fd::AsRawFd;
use std::sync::Arc;

use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrIn6, recvmsg, setsockopt, sockopt};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use tokio::io::unix::AsyncFd;
use tokio_util::sync::CancellationToken;

use super::metrics::DhcpMetrics;
use super::ra;

const ALL_ROUTERS: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 2);
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);

pub struct RaServer {
    socket: AsyncFd<Socket>,
    ifindex: u32,
    advertisement: Vec<u8>,
    metrics: Arc<DhcpMetrics>,
    /// When we last advertised to all nodes.
    last_multicast: std::sync::Mutex<Option<std::time::Instant>>,
    /// A real router was heard: we answer no more.
    router_heard: std::sync::atomic::AtomicBool,
}

/// RFC 4861 10: MIN_DELAY_BETWEEN_RAS.
const MULTICAST_EVERY: std::time::Duration = std::time::Duration::from_secs(3);

impl RaServer {
    /// Opens the socket on `interface` (needs CAP_NET_RAW, as port 67 needs root). Call
    /// inside the runtime that will serve it.
    pub fn bind(interface: &str, metrics: Arc<DhcpMetrics>) -> std::io::Result<Self> {
        let ifindex = nix::net::if_::if_nametoindex(interface)?;
        let socket = Socket::new(Domain::IPV6, Type::RAW, Some(Protocol::ICMPV6))?;
        socket.bind_device(Some(interface.as_bytes()))?;
        socket.join_multicast_v6(&ALL_ROUTERS, ifindex)?;
        // Receivers take neighbour discovery messages only with hop limit 255 (RFC 4861
        // 6.1.2): proof that they were not forwarded.
        socket.set_multicast_hops_v6(255)?;
        socket.set_unicast_hops_v6(255)?;
        socket.set_multicast_if_v6(ifindex)?;
        socket.set_multicast_loop_v6(false)?;
        setsockopt(&socket, sockopt::Ipv6RecvHopLimit, &true)?;
        pass_only_router_discovery(&socket)?;
        socket.set_nonblocking(true)?;
        // SAFETY: the AsyncFd owns the socket, so its descriptor stays open and the same
        // for the AsyncFd's whole life.
        let socket = unsafe { AsyncFd::register(socket) }.map_err(std::io::Error::from)?;
        Ok(Self {
            socket,
            ifindex,
            advertisement: ra::advertisement(interface_mac(interface)),
            metrics,
            last_multicast: Default::default(),
            router_heard: Default::default(),
        })
    }

    /// Answers until `stop`.
    pub async fn serve(self, stop: CancellationToken) {
        let mut buf = [0u8; 1500];
        loop {
            let ready = tokio::select! {
                r = self.socket.readable() => r,
                () = stop.cancelled() => return,
            };
            let mut ready = match ready {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "router solicitation socket failed; no longer answering");
                    return;
                }
            };
            let received = ready.try_io(|s| receive(s.get_ref(), &mut buf));
            match received {
                Err(_would_block) => continue,
                Ok(Ok((len, from, hop_limit))) => {
                    self.answer(&buf[..len], from, hop_limit);
                }
                Ok(Err(e)) => tracing::debug!(error = %e, "router solicitation receive failed"),
            }
        }
    }

    fn answer(&self, msg: &[u8], from: Option<SocketAddrV6>, hop_limit: Option<i32>) {
        if hop_limit != Some(ra::HOP_LIMIT) {
            // Forwarded (or of unknown origin): not from this link.
            self.metrics.count("malformed.ra-hop-limit");
            return;
        }
        if ra::real_router(msg) {
            if !self
                .router_heard
                .swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                tracing::info!(router = ?from, "an IPv6 router advertises on the boot segment: no longer answering router solicitations");
            }
            return;
        }
        match ra::parse_solicitation(msg) {
            Ok(_) => {}
            // The filter passes advertisements too (a real router's, above; ours
            // looped back from another server's): only solicitations are answered.
            Err(ra::Dropped::NotSolicitation) => return,
            Err(why) => {
                self.metrics.count(&format!("malformed.{}", why.reason()));
                return;
            }
        }
        if self.router_heard.load(std::sync::atomic::Ordering::Relaxed) {
            self.metrics.count("ignored.router-present");
            return;
        }
        let to = match from.map(|a| *a.ip()) {
            Some(ip) if ip.is_unicast_link_local() => ip,
            Some(ip) if !ip.is_unspecified() => {
                // An advertisement must come from our link-local address, which a
                // reply to a routable one would not.
                self.metrics.count("ignored.rs-not-link-local");
                return;
            }
            _ => {
                let now = std::time::Instant::now();
                let mut last = self.last_multicast.lock().expect("not poisoned");
                if last.is_some_and(|at| now.duration_since(at) < MULTICAST_EVERY) {
                    self.metrics.count("ignored.ra-rate-limited");
                    return;
                }
                *last = Some(now);
                ALL_NODES
            }
        };
        let to = SockAddr::from(SocketAddrV6::new(to, 0, 0, self.ifindex));
        match self.socket.get_ref().send_to(&self.advertisement, &to) {
            Ok(_) => self.metrics.count("router-advertisement"),
            Err(e) => {
                self.metrics.count("ignored.ra-send-failed");
                tracing::debug!(error = %e, "cannot send a router advertisement");
            }
        }
    }
}

/// One datagram: its length, its sender and the hop limit it arrived with.
fn receive(
    socket: &Socket,
    buf: &mut [u8],
) -> std::io::Result<(usize, Option<SocketAddrV6>, Option<i32>)> {
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!(libc::c_int);
    let msg = recvmsg::<SockaddrIn6>(
        socket.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::empty(),
    )?;
    let hop_limit = msg.cmsgs()?.find_map(|c| match c {
        ControlMessageOwned::Ipv6HopLimit(h) => Some(h),
        _ => None,
    });
    Ok((msg.bytes, msg.address.map(SocketAddrV6::from), hop_limit))
}

/// Has the kernel pass up router solicitations and advertisements only, so that the
/// rest of the segment's neighbour discovery never wakes us (RFC 3542 3.2: a set bit
/// blocks its type).
fn pass_only_router_discovery(socket: &Socket) -> std::io::Result<()> {
    // linux/icmpv6.h: ICMPV6_FILTER at level SOL_ICMPV6 (= IPPROTO_ICMPV6); neither libc
    // nor nix names it.
    const ICMPV6_FILTER: libc::c_int = 1;
    let mut blocked = [u32::MAX; 8];
    for t in [ra::ROUTER_SOLICITATION, ra::ROUTER_ADVERTISEMENT] {
        blocked[usize::from(t >> 5)] &= !(1u32 << (t & 31));
    }
    // SAFETY: `blocked` is the kernel's struct icmp6_filter (eight u32 words), alive
    // for the call, and its size is what is passed.
    let done = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_ICMPV6,
            ICMPV6_FILTER,
            blocked.as_ptr().cast(),
            std::mem::size_of_val(&blocked) as libc::socklen_t,
        )
    };
    if done == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The interface's MAC (its sysfs `address`), for the advertisement's source option.
fn interface_mac(interface: &str) -> Option<[u8; 6]> {
    let text = std::fs::read_to_string(format!("/sys/class/net/{interface}/address")).ok()?;
    let bytes: Vec<u8> = text
        .trim()
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .ok()?;
    bytes.try_into().ok()
}
