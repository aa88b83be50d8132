//! A TFTP read client that behaves like firmware (options, windows, retransmission on
//! timeout), for the benchmarks and the boot-storm simulator.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};
use tokio::net::UdpSocket;

use super::packet::{Packet, Request};
use crate::api::Digest;

#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub blksize: Option<u16>,
    pub windowsize: Option<u16>,
    /// Wait this long for the next packet before re-sending the last ACK (or the RRQ).
    pub timeout: Duration,
    pub max_retries: u32,
    /// Send from this address (a simulated node's leased address) rather than any.
    pub local_ip: Option<std::net::IpAddr>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            blksize: Some(1468),
            windowsize: None,
            timeout: Duration::from_secs(1),
            max_retries: 10,
            local_ip: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Fetched {
    pub len: u64,
    pub digest: Digest,
    pub duration: Duration,
    /// Times this client re-sent a request or an ACK after a timeout.
    pub timeouts: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("server sent error {code}: {message}")]
    Server { code: u16, message: String },
    #[error("no answer after {0} retries")]
    TimedOut(u32),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

pub async fn fetch(
    server: SocketAddr,
    name: &str,
    opts: &ClientOptions,
) -> Result<Fetched, FetchError> {
    let started = Instant::now();
    let local: SocketAddr = match opts.local_ip {
        Some(ip) => SocketAddr::new(ip, 0),
        None if server.is_ipv4() => "0.0.0.0:0".parse().expect("valid"),
        None => "[::]:0".parse().expect("valid"),
    };
    let socket = UdpSocket::bind(local).await?;
    let mut options = Vec::new();
    if let Some(b) = opts.blksize {
        options.push(("blksize".to_string(), b.to_string()));
    }
    if let Some(w) = opts.windowsize {
        options.push(("windowsize".to_string(), w.to_string()));
    }
    let rrq = Packet::Rrq(Request {
        filename: name.into(),
        mode: "octet".into(),
        options,
    })
    .encode();
    socket.send_to(&rrq, server).await?;

    let mut peer: Option<SocketAddr> = None;
    let mut blksize = 512usize;
    let mut window = 1u64;
    let mut next: u64 = 1; // absolute number of the next block we want
    let mut in_window = 0u64;
    let mut last_sent: Vec<u8> = rrq;
    let mut hasher = Sha256::new();
    let mut len = 0u64;
    let mut timeouts = 0u32;
    let mut retries = 0u32;
    let mut nak_sent_for = 0u64;
    let mut buf = vec![0u8; 65536];
    // Measured from the last progress or ACK, not the last packet: a stream of
    // duplicates must not keep a client that is missing a block quiet forever.
    let mut deadline = tokio::time::Instant::now() + opts.timeout;
    loop {
        let received = tokio::time::timeout_at(deadline, socket.recv_from(&mut buf)).await;
        let (n, from) = match received {
            Err(_) => {
                retries += 1;
                timeouts += 1;
                if retries > opts.max_retries {
                    return Err(FetchError::TimedOut(retries - 1));
                }
                socket.send_to(&last_sent, peer.unwrap_or(server)).await?;
                deadline = tokio::time::Instant::now() + opts.timeout;
                continue;
            }
            Ok(r) => r?,
        };
        // The first answer fixes the server's transfer port; others are strays.
        match peer {
            None if from.ip() == server.ip() => peer = Some(from),
            Some(p) if p == from => {}
            _ => continue,
        }
        let to = peer.expect("set above");
        let Ok(packet) = Packet::parse(&buf[..n]) else {
            continue;
        };
        match packet {
            Packet::Oack { options } if next == 1 => {
                for (k, v) in options {
                    match (k.as_str(), v.parse::<u64>()) {
                        ("blksize", Ok(b)) => blksize = b as usize,
                        ("windowsize", Ok(w)) => window = w.max(1),
                        _ => {}
                    }
                }
                last_sent = Packet::Ack { block: 0 }.encode();
                socket.send_to(&last_sent, to).await?;
                retries = 0;
                deadline = tokio::time::Instant::now() + opts.timeout;
            }
            Packet::Data { block, data } => {
                if block == (next & 0xffff) as u16 {
                    retries = 0;
                    deadline = tokio::time::Instant::now() + opts.timeout;
                    hasher.update(&data);
                    len += data.len() as u64;
                    next += 1;
                    in_window += 1;
                    let last = data.len() < blksize;
                    if last || in_window >= window {
                        in_window = 0;
                        last_sent = Packet::Ack { block }.encode();
                        socket.send_to(&last_sent, to).await?;
                    }
                    if last {
                        return Ok(Fetched {
                            len,
                            digest: Digest::from_hasher(hasher),
                            duration: started.elapsed(),
                            timeouts,
                        });
                    }
                } else if nak_sent_for != next {
                    // A gap or a duplicate: say once where we are (RFC 7440).
                    nak_sent_for = next;
                    in_window = 0;
                    last_sent = Packet::Ack {
                        block: ((next - 1) & 0xffff) as u16,
                    }
                    .encode();
                    socket.send_to(&last_sent, to).await?;
                }
            }
            Packet::Error { code, message } => return Err(FetchError::Server { code, message }),
            _ => {}
        }
    }
}
