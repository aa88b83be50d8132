//! `bootfleet bench ...`: load generators for the benchmarks in BENCHMARKS.md.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Subcommand;
use serde::Serialize;

use super::output::{OutputFormat, emit};
use crate::digest::Digest;
use crate::tftp::client::{ClientOptions, fetch};

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// N concurrent TFTP reads of one file; reports throughput, latency, failures.
    Tftp {
        /// TFTP server address, for example 127.0.0.1:69.
        #[arg(long)]
        target: SocketAddr,
        #[arg(long)]
        file: String,
        #[arg(long, default_value_t = 1)]
        clients: usize,
        /// Total transfers (default: one per client).
        #[arg(long)]
        transfers: Option<usize>,
        #[arg(long)]
        blksize: Option<u16>,
        #[arg(long)]
        windowsize: Option<u16>,
        /// Client retransmission timeout in milliseconds.
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
        /// Expected sha256 of the file (sha256:<hex>): a mismatch counts as a failure.
        #[arg(long)]
        expect: Option<Digest>,
    },
}

#[derive(Debug, Serialize)]
struct TftpReport {
    transfers: usize,
    completed: usize,
    failed: usize,
    wrong_bytes: usize,
    bytes: u64,
    seconds: f64,
    mb_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    client_timeouts: u64,
    errors: Vec<String>,
}

pub async fn run(cmd: BenchCommand, out: OutputFormat) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Tftp {
            target,
            file,
            clients,
            transfers,
            blksize,
            windowsize,
            timeout_ms,
            expect,
        } => {
            let opts = ClientOptions {
                blksize,
                windowsize,
                timeout: Duration::from_millis(timeout_ms),
                max_retries: 10,
            };
            let total = transfers.unwrap_or(clients);
            let queue = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let started = Instant::now();
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..clients.max(1) {
                let (queue, opts, file) = (queue.clone(), opts.clone(), file.clone());
                tasks.spawn(async move {
                    let mut results = Vec::new();
                    while queue.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < total {
                        results.push(fetch(target, &file, &opts).await);
                    }
                    results
                });
            }
            let mut report = TftpReport {
                transfers: total,
                completed: 0,
                failed: 0,
                wrong_bytes: 0,
                bytes: 0,
                seconds: 0.0,
                mb_per_s: 0.0,
                p50_ms: 0.0,
                p99_ms: 0.0,
                max_ms: 0.0,
                client_timeouts: 0,
                errors: Vec::new(),
            };
            let mut durations = Vec::new();
            while let Some(results) = tasks.join_next().await {
                for r in results? {
                    match r {
                        Ok(f) if expect.is_none_or(|d| d == f.digest) => {
                            report.completed += 1;
                            report.bytes += f.len;
                            report.client_timeouts += f.timeouts as u64;
                            durations.push(f.duration.as_secs_f64() * 1000.0);
                        }
                        Ok(_) => report.wrong_bytes += 1,
                        Err(e) => {
                            report.failed += 1;
                            if report.errors.len() < 5 {
                                report.errors.push(e.to_string());
                            }
                        }
                    }
                }
            }
            report.seconds = started.elapsed().as_secs_f64();
            report.mb_per_s = report.bytes as f64 / report.seconds / 1e6;
            durations.sort_by(|a, b| a.total_cmp(b));
            let pct = |p: f64| {
                durations
                    .get(((durations.len() as f64 - 1.0) * p).round() as usize)
                    .copied()
                    .unwrap_or(0.0)
            };
            report.p50_ms = pct(0.5);
            report.p99_ms = pct(0.99);
            report.max_ms = pct(1.0);
            emit(out, &report, |r| {
                println!(
                    "{} transfers: {} completed, {} failed, {} wrong bytes; {:.2} s, {:.1} MB/s; p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; {} client timeouts",
                    r.transfers,
                    r.completed,
                    r.failed,
                    r.wrong_bytes,
                    r.seconds,
                    r.mb_per_s,
                    r.p50_ms,
                    r.p99_ms,
                    r.max_ms,
                    r.client_timeouts
                );
                for e in &r.errors {
                    println!("  error: {e}");
                }
            })?;
            if report.failed + report.wrong_bytes > 0 {
                anyhow::bail!("{} transfers failed", report.failed + report.wrong_bytes);
            }
            Ok(())
        }
    }
}
