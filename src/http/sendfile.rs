//! A plain TCP connection whose writes of blob bytes go out with sendfile(2).
//!
//! hyper writes a response body from the `Bytes` it is given and cannot sendfile, so a
//! blob's bytes were copied from its mapping into the socket: 40% of the server's CPU
//! while serving a large blob, and 3-4x nginx's CPU per GB. This stream sits under hyper:
//! when a buffer hyper writes lies inside a blob's live mapping (`BlobMaps::file_behind`),
//! the same bytes are sent from the blob's file instead, without a copy through user
//! space. Blobs are immutable, so the file holds exactly the bytes the mapping shows.
//! Anything else (headers, scripts, TLS records) is written as it was.

use std::io::{self, IoSlice};
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use nix::sys::socket::{MsgFlags, sendmsg};
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

use super::blob_maps::BlobMaps;

pub struct SendfileStream {
    tcp: TcpStream,
    maps: Arc<BlobMaps>,
}

impl SendfileStream {
    pub fn new(tcp: TcpStream, maps: Arc<BlobMaps>) -> Self {
        SendfileStream { tcp, maps }
    }

    /// Runs one non-blocking socket call once the socket is writable; WouldBlock waits
    /// for the next readiness.
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        mut send: impl FnMut() -> io::Result<usize>,
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.tcp.poll_write_ready(cx))?;
            match self.tcp.try_io(Interest::WRITABLE, &mut send) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                answer => return Poll::Ready(answer),
            }
        }
    }
}

impl AsyncRead for SendfileStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for SendfileStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    /// The buffers up to the first blob run are written as they are (held back with
    /// MSG_MORE when a blob run follows, so that headers and the body's start share a
    /// segment); a blob run first in line is sent from its file. Either way one call,
    /// and the count of bytes it took, as a short write.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let first_blob = bufs
            .iter()
            .enumerate()
            .find_map(|(i, b)| Some((i, this.maps.file_behind(b)?)));
        match first_blob {
            None => Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs),
            Some((0, behind)) => {
                let len = bufs[0].len();
                // sendfile takes no MSG_NOSIGNAL: a reset peer's EPIPE comes back as an
                // error because Rust's runtime ignores SIGPIPE (as `serve` leaves it).
                this.poll_send(cx, || {
                    let mut offset = behind.offset as libc::off_t;
                    nix::sys::sendfile::sendfile(&this.tcp, behind.file(), Some(&mut offset), len)
                        .map_err(io::Error::from)
                })
            }
            Some((n, _)) => {
                let before = &bufs[..n];
                this.poll_send(cx, || {
                    sendmsg::<()>(
                        this.tcp.as_raw_fd(),
                        before,
                        &[],
                        // nix names no MSG_MORE; the kernel's flag, from libc.
                        MsgFlags::from_bits_retain(libc::MSG_MORE) | MsgFlags::MSG_NOSIGNAL,
                        None,
                    )
                    .map_err(io::Error::from)
                })
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}
