//! Receive buffers for the UDP sockets that take a power-on burst (DHCP, the TFTP
//! listener, and the storm simulator's shared DHCP client socket): the burst waits in the
//! buffer instead of being dropped, since every dropped request costs its node the
//! firmware's back-off (4 s for a PXE DISCOVER).

use std::os::fd::AsFd;

/// What each service asks for: about 3,500 queued datagrams (each takes about 2.3 KiB of
/// buffer with its skb).
pub const BURST: usize = 8 << 20;

/// Sets `socket`'s receive buffer to `bytes`: past net.core.rmem_max (Debian's is
/// 208 KiB, about 90 datagrams) with SO_RCVBUFFORCE where we may (CAP_NET_ADMIN), else as
/// much as rmem_max allows.
pub fn grow(socket: &impl AsFd, bytes: usize) -> std::io::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    if setsockopt(socket, sockopt::RcvBufForce, &bytes).is_err() {
        setsockopt(socket, sockopt::RcvBuf, &bytes).map_err(std::io::Error::from)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_buffer_grows_to_at_least_what_rmem_max_allows() {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        super::grow(&socket, super::BURST).unwrap();
        let rmem_max: usize = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // Linux reports twice what was set (the other half is its bookkeeping).
        let got: usize =
            nix::sys::socket::getsockopt(&socket, nix::sys::socket::sockopt::RcvBuf).unwrap();
        assert!(
            got >= super::BURST.min(rmem_max),
            "{got} bytes, rmem_max {rmem_max}"
        );
    }
}
