//! Firmware-like DHCP for simulated nodes: every node shares one socket on port 68 (as
//! every machine on a segment shares the broadcast domain); replies are routed to the
//! node waiting on their transaction id. Retransmission follows the firmware's schedule,
//! so a lost packet costs what it costs a real machine.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dhcproto::v4::{self, DhcpOption, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable, Decoder, Encodable, Encoder};
use tokio::net::UdpSocket;
use tokio::sync::mpsc;

/// Who is asking: a PXE ROM (BIOS) or the iPXE it loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Asker {
    Pxe,
    Ipxe,
}

/// Waits between retransmissions. PXE 2.1 spec: 4, 8, 16, 32 s, then the ROM gives up
/// (PXE-E51). iPXE: exponential from 1 s, capped at 10 s, for about 15 s in all.
pub fn schedule(asker: Asker) -> &'static [u64] {
    match asker {
        Asker::Pxe => &[4, 8, 16, 32],
        Asker::Ipxe => &[1, 2, 4, 8],
    }
}

/// What an ACK gave the node.
#[derive(Debug, Clone)]
pub struct Bound {
    pub ip: Ipv4Addr,
    pub server: Ipv4Addr,
    /// next-server (siaddr), for TFTP.
    pub next_server: Ipv4Addr,
    /// Option 67, else the BOOTP file field.
    pub file: Option<String>,
    /// Transmissions that went unanswered.
    pub retransmits: u32,
    /// NAKs that sent the node back to DISCOVER.
    pub naks: u32,
}

/// How many NAKs a node takes before it gives up: RFC 2131 3.1 sends a NAKed client
/// back to INIT, and firmware does so a few times before it reports a boot failure.
const NAK_RESTARTS: u32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum DhcpError {
    #[error("no offer after {0} transmissions")]
    NoOffer(u32),
    #[error("no ack after {0} transmissions")]
    NoAck(u32),
    #[error("nak: {0}")]
    Nak(String),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// The shared socket's receive buffer: a reply to each of 10,000 nodes at once (about
/// 2.3 KiB of buffer each with its skb), with room to spare.
const SEGMENT_BUFFER: usize = 64 << 20;

type Waiters = Arc<Mutex<HashMap<u32, mpsc::UnboundedSender<Message>>>>;

/// The segment's shared client socket and the demultiplexer behind it.
#[derive(Clone)]
pub struct Segment {
    socket: Arc<UdpSocket>,
    waiters: Waiters,
    server: SocketAddr,
    /// Replies nobody waited for (late duplicates, retransmitted offers).
    pub strays: Arc<std::sync::atomic::AtomicU64>,
}

/// What the reply router needs of its segment: the nodes waiting (gone with the segment)
/// and the count of replies nobody waited for.
struct Router {
    waiters: std::sync::Weak<Mutex<HashMap<u32, mpsc::UnboundedSender<Message>>>>,
    strays: Arc<std::sync::atomic::AtomicU64>,
}

impl Router {
    async fn route(self, socket: UdpSocket) {
        let mut buf = vec![0u8; 1500];
        loop {
            let received =
                tokio::time::timeout(Duration::from_secs(1), socket.recv_from(&mut buf)).await;
            let Some(waiters) = self.waiters.upgrade() else {
                return;
            };
            let (n, _) = match received {
                Ok(Ok(got)) => got,
                Err(_) => continue,
                Ok(Err(e)) => {
                    // Not expected of an unconnected UDP socket; never spin on it.
                    tracing::debug!(error = %e, "the DHCP router cannot receive");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let Ok(msg) = Message::decode(&mut Decoder::new(&buf[..n])) else {
                continue;
            };
            if msg.opcode() != Opcode::BootReply {
                continue;
            }
            let sent = waiters
                .lock()
                .expect("not poisoned")
                .get(&msg.xid())
                .map(|tx| tx.send(msg).is_ok());
            if sent != Some(true) {
                self.strays
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
}

impl Segment {
    /// Binds port `client_port` on `interface` and starts routing replies.
    pub fn open(interface: &str, client_port: u16, server_port: u16) -> std::io::Result<Self> {
        use socket2::{Domain, Protocol, Socket, Type};
        let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
        s.set_reuse_address(true)?;
        s.set_broadcast(true)?;
        s.bind_device(Some(interface.as_bytes()))?;
        s.bind(&SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, client_port)).into())?;
        Self::from_socket(s.into(), server_port)
    }

    /// Uses `socket` (bound to the clients' port, broadcast allowed; made elsewhere, for
    /// example inside another network namespace) and starts routing replies.
    pub fn from_socket(socket: std::net::UdpSocket, server_port: u16) -> std::io::Result<Self> {
        let s = socket2::Socket::from(socket);
        // A storm's replies to every node arrive in bursts on this one socket, where a
        // real fleet has a NIC a machine: a buffer that drops them would count the
        // simulator's losses as the server's. SO_RCVBUF alone stops at rmem_max (208 KiB
        // on Debian, under a hundred replies), hence SO_RCVBUFFORCE where we may.
        crate::udp_buffer::grow(&s, SEGMENT_BUFFER)?;
        // Linux reports twice what it grants.
        let granted = s.recv_buffer_size()? / 2;
        if granted < SEGMENT_BUFFER {
            tracing::warn!(
                granted,
                wanted = SEGMENT_BUFFER,
                "the simulated segment's receive buffer is short (SO_RCVBUFFORCE needs \
                 CAP_NET_ADMIN): replies it drops count as the server's losses"
            );
        }
        s.set_nonblocking(true)?;
        let receiving: std::net::UdpSocket = s.try_clone()?.into();
        let socket = Arc::new(UdpSocket::from_std(s.into())?);
        let seg = Self {
            socket,
            waiters: Default::default(),
            server: SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::BROADCAST, server_port)),
            strays: Default::default(),
        };
        // Replies are routed on a thread of their own: on the nodes' runtime, behind
        // thousands of ready node tasks, the router waited seconds for its turn, and
        // nodes timed out on replies that had arrived (a real NIC does not wait for its
        // neighbours' firmware). The node is woken through its channel. The thread ends
        // within a second of the segment's last handle.
        let router = Router {
            waiters: Arc::downgrade(&seg.waiters),
            strays: seg.strays.clone(),
        };
        std::thread::Builder::new()
            .name("dhcp-router".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for the DHCP router");
                rt.block_on(async move {
                    match UdpSocket::from_std(receiving) {
                        Ok(socket) => router.route(socket).await,
                        Err(e) => tracing::error!(error = %e, "the DHCP router cannot start"),
                    }
                })
            })?;
        Ok(seg)
    }

    /// A full DISCOVER-OFFER-REQUEST-ACK for `mac`, as `asker` does it.
    pub async fn dora(&self, mac: [u8; 6], asker: Asker) -> Result<Bound, DhcpError> {
        let xid: u32 = rand::random();
        let (tx, mut rx) = mpsc::unbounded_channel();
        self.waiters.lock().expect("not poisoned").insert(xid, tx);
        let mut naks = 0;
        let result = loop {
            match self.exchange(mac, asker, xid, &mut rx).await {
                Err(DhcpError::Nak(_)) if naks < NAK_RESTARTS => naks += 1,
                Ok(bound) => break Ok(Bound { naks, ..bound }),
                Err(e) => break Err(e),
            }
        };
        self.waiters.lock().expect("not poisoned").remove(&xid);
        result
    }

    async fn exchange(
        &self,
        mac: [u8; 6],
        asker: Asker,
        xid: u32,
        rx: &mut mpsc::UnboundedReceiver<Message>,
    ) -> Result<Bound, DhcpError> {
        let mut retransmits = 0;
        let discover = packet(mac, xid, asker, MessageType::Discover, None);
        let offer = self
            .send_until(&discover, asker, rx, &mut retransmits, |m| {
                kind(m) == Some(MessageType::Offer)
            })
            .await?
            .ok_or(DhcpError::NoOffer(retransmits))?;
        let server_id = server_id(&offer).unwrap_or(offer.siaddr());
        let request = packet(
            mac,
            xid,
            asker,
            MessageType::Request,
            Some((offer.yiaddr(), server_id)),
        );
        let ack = self
            .send_until(&request, asker, rx, &mut retransmits, |m| {
                matches!(kind(m), Some(MessageType::Ack | MessageType::Nak))
            })
            .await?
            .ok_or(DhcpError::NoAck(retransmits))?;
        if kind(&ack) == Some(MessageType::Nak) {
            let why = match ack.opts().get(OptionCode::Message) {
                Some(DhcpOption::Message(m)) => m.clone(),
                _ => String::new(),
            };
            return Err(DhcpError::Nak(why));
        }
        // Both are C strings to firmware: dnsmasq ends option 67 with a NUL, and the
        // BOOTP field is padded with them; nothing from the first NUL on is the name.
        let c_string = |bytes: &[u8]| {
            let name = bytes.split(|&b| b == 0).next().unwrap_or_default();
            Some(String::from_utf8_lossy(name).into_owned()).filter(|n| !n.is_empty())
        };
        let file = match ack.opts().get(OptionCode::BootfileName) {
            Some(DhcpOption::BootfileName(f)) => c_string(f),
            _ => c_string(ack.fname().unwrap_or_default()),
        };
        Ok(Bound {
            ip: ack.yiaddr(),
            server: server_id,
            next_server: ack.siaddr(),
            file,
            retransmits,
            naks: 0,
        })
    }

    /// Sends `bytes`, then waits per the schedule for a reply `wanted` accepts,
    /// re-sending after each wait. None when the schedule runs out.
    async fn send_until(
        &self,
        bytes: &[u8],
        asker: Asker,
        rx: &mut mpsc::UnboundedReceiver<Message>,
        retransmits: &mut u32,
        wanted: impl Fn(&Message) -> bool,
    ) -> Result<Option<Message>, DhcpError> {
        for (i, &secs) in schedule(asker).iter().enumerate() {
            if i > 0 {
                *retransmits += 1;
            }
            self.socket.send_to(bytes, self.server).await?;
            // RFC 2131 4.1: randomised by up to a second either way (here: up to +1 s,
            // so the first wait is never shorter than the firmware's).
            let jitter = Duration::from_millis(rand::random_range(0..1000));
            let until = tokio::time::Instant::now() + Duration::from_secs(secs) + jitter;
            loop {
                match tokio::time::timeout_at(until, rx.recv()).await {
                    Ok(Some(m)) if wanted(&m) => return Ok(Some(m)),
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => break,
                }
            }
        }
        *retransmits += 1;
        Ok(None)
    }
}

fn kind(m: &Message) -> Option<MessageType> {
    match m.opts().get(OptionCode::MessageType) {
        Some(DhcpOption::MessageType(t)) => Some(*t),
        _ => None,
    }
}

fn server_id(m: &Message) -> Option<Ipv4Addr> {
    match m.opts().get(OptionCode::ServerIdentifier) {
        Some(DhcpOption::ServerIdentifier(ip)) => Some(*ip),
        _ => None,
    }
}

/// The machine UUID a node sends in option 97, derived from its MAC.
fn machine_uuid(mac: [u8; 6]) -> Vec<u8> {
    let mut id = vec![0u8; 17];
    id[1..5].copy_from_slice(b"stor");
    id[11..17].copy_from_slice(&mac);
    id
}

/// A DISCOVER or REQUEST as a BIOS PXE ROM or iPXE sends it (the options seen on the wire
/// in ../shared/netboot-lab-notes.md).
pub fn packet(
    mac: [u8; 6],
    xid: u32,
    asker: Asker,
    kind: MessageType,
    requested: Option<(Ipv4Addr, Ipv4Addr)>,
) -> Vec<u8> {
    let mut m = Message::default();
    m.set_opcode(Opcode::BootRequest)
        .set_xid(xid)
        .set_flags(v4::Flags::default().set_broadcast())
        .set_chaddr(&mac);
    let o = m.opts_mut();
    o.insert(DhcpOption::MessageType(kind));
    o.insert(DhcpOption::ParameterRequestList(vec![
        OptionCode::SubnetMask,
        OptionCode::Router,
        OptionCode::DomainNameServer,
        OptionCode::VendorExtensions,
        OptionCode::ClassIdentifier,
        OptionCode::TFTPServerName,
        OptionCode::BootfileName,
    ]));
    o.insert(DhcpOption::MaxMessageSize(1472));
    o.insert(DhcpOption::ClassIdentifier(
        b"PXEClient:Arch:00000:UNDI:002001".to_vec(),
    ));
    o.insert(DhcpOption::ClientSystemArchitecture(v4::Architecture(0)));
    o.insert(DhcpOption::ClientNetworkInterface(1, 2, 1));
    o.insert(DhcpOption::ClientMachineIdentifier(machine_uuid(mac)));
    if asker == Asker::Ipxe {
        o.insert(DhcpOption::UserClass(b"iPXE".to_vec()));
        // iPXE's feature list (175): HTTP (0x13) and bzImage (0x18).
        o.insert(DhcpOption::Unknown(v4::UnknownOption::new(
            OptionCode::Unknown(175),
            vec![0x13, 1, 1, 0x18, 1, 1],
        )));
    }
    if let Some((ip, server)) = requested {
        o.insert(DhcpOption::RequestedIpAddress(ip));
        o.insert(DhcpOption::ServerIdentifier(server));
    }
    let mut out = Vec::with_capacity(400);
    m.encode(&mut Encoder::new(&mut out))
        .expect("a message we built encodes");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dhcp::classify::{BootClass, classify};
    use crate::dhcp::wire::check;

    /// What we send is what our own server classifies as the firmware we imitate.
    #[test]
    fn simulated_packets_classify_as_the_firmware_they_imitate() {
        let mac = [2, 0xbf, 0, 0, 0, 1];
        for (asker, class) in [
            (Asker::Pxe, BootClass::Bios),
            (Asker::Ipxe, BootClass::Ipxe),
        ] {
            let bytes = packet(mac, 7, asker, MessageType::Discover, None);
            let req = check(&bytes).expect("well formed");
            assert_eq!((req.xid, req.chaddr), (7, mac));
            let c = classify(&req);
            assert_eq!(c.class, Some(class));
            assert!(c.uuid.is_some());
        }
    }
}
