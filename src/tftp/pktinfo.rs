//! IP_PKTINFO on a UDP socket bound to 0.0.0.0: which local address a datagram came to.
//! The only unsafe-free way to learn it is recvmsg with a control message (nix).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;

use nix::sys::socket::{
    ControlMessageOwned, MsgFlags, SockaddrStorage, recvmsg, setsockopt, sockopt,
};
use tokio::io::Interest;
use tokio::net::UdpSocket;

pub fn enable(socket: &UdpSocket) -> std::io::Result<()> {
    if socket.local_addr()?.is_ipv4() {
        setsockopt(socket, sockopt::Ipv4PacketInfo, &true).map_err(std::io::Error::from)?;
    }
    Ok(())
}

/// Receives one datagram: (length, sender, local address it was sent to if known).
pub async fn recv(
    socket: &UdpSocket,
    buf: &mut [u8],
    want_destination: bool,
) -> std::io::Result<(usize, SocketAddr, Option<IpAddr>)> {
    if !want_destination {
        let (n, from) = socket.recv_from(buf).await?;
        return Ok((n, from, None));
    }
    loop {
        socket.readable().await?;
        let result = socket.try_io(Interest::READABLE, || {
            let mut iov = [std::io::IoSliceMut::new(buf)];
            let mut cmsg = nix::cmsg_space!(nix::libc::in_pktinfo);
            let msg = recvmsg::<SockaddrStorage>(
                socket.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::empty(),
            )
            .map_err(std::io::Error::from)?;
            let from = msg
                .address
                .and_then(|a| {
                    a.as_sockaddr_in()
                        .map(|s| SocketAddr::from(std::net::SocketAddrV4::from(*s)))
                })
                .ok_or_else(|| std::io::Error::other("datagram without an IPv4 source"))?;
            let mut to = None;
            if let Ok(cmsgs) = msg.cmsgs() {
                for c in cmsgs {
                    if let ControlMessageOwned::Ipv4PacketInfo(info) = c {
                        to = Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                            info.ipi_addr.s_addr,
                        ))));
                    }
                }
            }
            Ok((msg.bytes, from, to))
        });
        match result {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            other => return other,
        }
    }
}
