//! The HTTP phase alone, and its physical bound: N nodes each download the same URLs at
//! once (as after a power event), against bootfleet or a reference web server; and the
//! same bytes over the same number of loopback TCP connections with no protocol at all.

use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, Clone, Serialize)]
pub struct CopyResult {
    pub connections: usize,
    pub bytes: u64,
    pub wall_secs: f64,
    pub gib_per_sec: f64,
    pub failures: usize,
}

impl CopyResult {
    fn new(connections: usize, bytes: u64, wall: Duration, failures: usize) -> Self {
        Self {
            connections,
            bytes,
            wall_secs: wall.as_secs_f64(),
            gib_per_sec: bytes as f64 / (1u64 << 30) as f64 / wall.as_secs_f64(),
            failures,
        }
    }
}

impl std::fmt::Display for CopyResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} connections, {:.2} GiB in {:.2} s: {:.2} GiB/s, {} failed",
            self.connections,
            self.bytes as f64 / (1u64 << 30) as f64,
            self.wall_secs,
            self.gib_per_sec,
            self.failures
        )
    }
}

/// `nodes` clients, each with its own connection, download every URL in `urls` whole;
/// every `cut_every`-th one cuts its first download halfway and resumes it with Range.
pub async fn http_phase(urls: &[String], nodes: usize, cut_every: usize) -> CopyResult {
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..nodes {
        let urls = urls.to_vec();
        let cut = cut_every > 0 && i % cut_every == 0;
        tasks.spawn(async move {
            let http = crate::http_client::builder()
                .timeout(Duration::from_secs(600))
                .build()
                .ok()?;
            let mut r = super::node::NodeResult::default();
            let mut bytes = 0;
            for (n, url) in urls.iter().enumerate() {
                bytes += super::node::download_for_bench(&http, url, cut && n == 0, &mut r)
                    .await
                    .ok()?;
            }
            Some(bytes)
        });
    }
    let (mut bytes, mut failures) = (0, 0);
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(Some(b)) => bytes += b,
            _ => failures += 1,
        }
    }
    CopyResult::new(nodes, bytes, started.elapsed(), failures)
}

/// `connections` loopback TCP connections at once, each carrying `bytes_each` bytes from
/// memory to a reader that discards them: what the machine can move with no protocol.
pub async fn loopback_bound(connections: usize, bytes_each: u64) -> std::io::Result<CopyResult> {
    let listener = crate::server::listen("127.0.0.1:0".parse().expect("an address"))?;
    let addr = listener.local_addr()?;
    let chunk = std::sync::Arc::new(super::setup::noise(1 << 20, 9));
    let sender = tokio::spawn(async move {
        let mut sends = tokio::task::JoinSet::new();
        for _ in 0..connections {
            let (mut sock, _) = listener.accept().await?;
            let chunk = chunk.clone();
            sends.spawn(async move {
                let mut left = bytes_each;
                while left > 0 {
                    let n = left.min(chunk.len() as u64) as usize;
                    sock.write_all(&chunk[..n]).await?;
                    left -= n as u64;
                }
                sock.shutdown().await
            });
        }
        while sends.join_next().await.is_some() {}
        std::io::Result::Ok(())
    });
    let started = Instant::now();
    let mut reads = tokio::task::JoinSet::new();
    for _ in 0..connections {
        reads.spawn(async move {
            let mut sock = tokio::net::TcpStream::connect(addr).await?;
            let mut buf = vec![0u8; 256 << 10];
            let mut got = 0u64;
            loop {
                let n = sock.read(&mut buf).await?;
                if n == 0 {
                    return std::io::Result::Ok(got);
                }
                got += n as u64;
            }
        });
    }
    let (mut bytes, mut failures) = (0, 0);
    while let Some(done) = reads.join_next().await {
        match done {
            Ok(Ok(b)) if b == bytes_each => bytes += b,
            _ => failures += 1,
        }
    }
    let wall = started.elapsed();
    sender.await.map_err(std::io::Error::other)??;
    Ok(CopyResult::new(connections, bytes, wall, failures))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_loopback_bound_moves_every_byte() {
        let r = loopback_bound(4, 3 << 20).await.unwrap();
        assert_eq!((r.bytes, r.failures), (4 * (3 << 20), 0));
        assert!(r.gib_per_sec > 0.0);
    }
}
