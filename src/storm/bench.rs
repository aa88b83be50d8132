//! `bootfleet-bench ...`: the load generators for the benchmarks in BENCHMARKS.md (a
//! binary of its own: an operator's `bootfleet` ships none).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Subcommand;
use serde::Serialize;

use crate::api::Digest;
use crate::cli::output::{OutputFormat, emit};
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
    /// Publishes the storm image (random kernel and initrd, an 8-GPU policy) as
    /// storm:stable and assigns it to the storm's MACs (02:bf:00:00:00:00 onward).
    /// Prints the kernel and initrd blob URLs, one per line.
    StormSetup {
        #[arg(long, default_value_t = 1000)]
        nodes: u32,
        #[arg(long, default_value_t = 1.0)]
        kernel_mib: f64,
        #[arg(long, default_value_t = 4.0)]
        initrd_mib: f64,
        /// Also write vmlinuz and initrd.img here, for a reference web server.
        #[arg(long)]
        reference_dir: Option<std::path::PathBuf>,
    },
    /// N simulated nodes power on and boot through the whole protocol: DHCP as a PXE
    /// ROM, TFTP, DHCP as iPXE, boot script, kernel and initrd (some cut and resumed with
    /// Range), attest, validate, heartbeats. Run it where the nodes' DHCP broadcasts
    /// reach the server (a namespace joined to the server's by a veth pair); reports
    /// per-phase latency percentiles, failures by cause, and the server's CPU and memory.
    Storm {
        #[arg(long, default_value_t = 1000)]
        nodes: u32,
        /// Interface the nodes' DHCP goes out on.
        #[arg(long)]
        interface: String,
        /// The DHCP server's port.
        #[arg(long, default_value_t = 67)]
        server_port: u16,
        /// The nodes' DHCP port.
        #[arg(long, default_value_t = 68)]
        client_port: u16,
        /// Spread power-on evenly over this long, for example 10s [default: all at once].
        #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
        ramp: Duration,
        /// Every Nth node cuts its kernel download halfway and resumes it (0: none).
        #[arg(long, default_value_t = 10)]
        cut_every: u32,
        /// Heartbeats each node sends after validation.
        #[arg(long, default_value_t = 2)]
        heartbeats: u32,
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        heartbeat_every: Duration,
        /// Send each node's TFTP and HTTP from the address DHCP gave it (the pool must be
        /// routed to this machine: `ip route add local <pool> dev lo`).
        #[arg(long)]
        bind_leased: bool,
        /// Stop after the downloads (a reference stack with no agent API).
        #[arg(long)]
        no_agent: bool,
        /// A node not done within this long counts as failed.
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        deadline: Duration,
        /// PIDs of the server under test: their CPU time and peak RSS are reported.
        #[arg(long, value_delimiter = ',')]
        measure_pid: Vec<u32>,
    },
    /// A rollout over N simulated nodes that boot over HTTP and reboot when asked (after
    /// --boot-delay, a machine's firmware and kernel start): the time from its start to
    /// its end against the sum of its waves' durations, the controller's overhead.
    Rollout {
        #[arg(long, default_value_t = 5000)]
        nodes: u32,
        /// Nodes per wave: a count or a share (10%).
        #[arg(long, default_value = "10%")]
        wave: String,
        #[arg(long, default_value_t = 500)]
        max_unavailable: u32,
        /// A simulated reboot's firmware and kernel start, before the boot script.
        #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
        boot_delay: Duration,
        /// Between a node's heartbeats (how soon it hears of its reimage).
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        heartbeat_every: Duration,
        /// Give up after this long.
        #[arg(long, default_value = "30m", value_parser = humantime::parse_duration)]
        deadline: Duration,
        /// PIDs of the server under test: their CPU time is reported.
        #[arg(long, value_delimiter = ',')]
        measure_pid: Vec<u32>,
    },
    /// `/metrics` and `/metrics/gpus` against the JSON node list, for a fleet of N
    /// simulated nodes booted once over HTTP, each with 8 GPUs reporting in a heartbeat.
    Scrape {
        #[arg(long, default_value_t = 10_000)]
        nodes: u32,
        /// Fetches of each path, in turn.
        #[arg(long, default_value_t = 20)]
        rounds: u32,
        /// Boots in flight at once while the fleet is built.
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
    },
    /// Heartbeats from N simulated 8-GPU nodes at a steady rate, without and then with
    /// every GPU's and InfiniBand port's readings: the server's CPU per heartbeat and
    /// its memory, each phase.
    Telemetry {
        #[arg(long, default_value_t = 10_000)]
        nodes: u32,
        /// Each node's heartbeat interval.
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        every: Duration,
        /// Intervals each phase lasts.
        #[arg(long, default_value_t = 6)]
        rounds: u32,
        /// Requests in flight at most.
        #[arg(long, default_value_t = 256)]
        concurrency: usize,
        /// The server's PID: its CPU time and memory are reported.
        #[arg(long)]
        measure_pid: u32,
    },
    /// Quote verification on one thread: a TPM (`--tcti`, tpm2-tools' syntax, such as
    /// swtpm:path=SOCKET) measures an OVMF-sized boot log and quotes it once; the
    /// server's checks of that evidence then run for `--seconds`.
    QuoteVerify {
        #[arg(long)]
        tcti: String,
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
    },
    /// The HTTP phase alone: N clients, each on its own connection, download every URL
    /// at once; every Nth cuts its first download halfway and resumes it.
    Http {
        #[arg(long, required = true)]
        url: Vec<String>,
        #[arg(long, default_value_t = 1000)]
        nodes: usize,
        #[arg(long, default_value_t = 10)]
        cut_every: usize,
    },
    /// The loopback bound for the HTTP phase: the same bytes over the same number of TCP
    /// connections, from memory to a reader, with no protocol.
    Bound {
        #[arg(long, default_value_t = 1000)]
        connections: usize,
        /// Bytes per connection (kernel + initrd).
        #[arg(long)]
        bytes: u64,
    },
}

/// Thousands of simulated nodes hold thousands of sockets: lift the soft limit to the hard.
fn raise_open_files_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
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

/// The storm commands; `server`, `token` and `data_dir` are the global admin options.
/// The admin token: given, or read from the server's data directory as the CLI does.
fn admin_token(
    server: &str,
    token: Option<String>,
    data_dir: Option<&std::path::Path>,
) -> anyhow::Result<String> {
    let target = crate::cli::client::Target::resolve(
        Some(server.to_string()),
        token,
        data_dir.map(std::path::Path::to_path_buf),
        None,
        None,
    )?;
    let client = crate::cli::client::Client::new(target)?;
    client
        .token()
        .map(str::to_string)
        .ok_or_else(|| anyhow::anyhow!("no admin token: --token or BOOTFLEET_TOKEN"))
}

pub async fn run(
    cmd: BenchCommand,
    out: OutputFormat,
    server: &str,
    token: Option<String>,
    data_dir: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    use crate::storm;
    match cmd {
        BenchCommand::StormSetup {
            nodes,
            kernel_mib,
            initrd_mib,
            reference_dir,
        } => {
            let token = admin_token(server, token, data_dir)?;
            let token = token.as_str();
            let urls = storm::setup::setup(
                server,
                token,
                nodes,
                kernel_mib,
                initrd_mib,
                reference_dir.as_deref(),
            )
            .await?;
            emit(out, &urls, |u| println!("{}", u.join("\n")))
        }
        BenchCommand::Storm {
            nodes,
            interface,
            server_port,
            client_port,
            ramp,
            cut_every,
            heartbeats,
            heartbeat_every,
            bind_leased,
            no_agent,
            deadline,
            measure_pid,
        } => {
            raise_open_files_limit();
            let behaviour = storm::node::Behaviour {
                heartbeats,
                heartbeat_every,
                bind_leased,
                no_agent,
                ..storm::node::Behaviour::for_storm_image()
            };
            let segment = storm::dhcp::Segment::open(&interface, client_port, server_port)
                .map_err(|e| {
                    anyhow::anyhow!(
                        "cannot open the nodes' DHCP socket on {interface} port {client_port}: {e}"
                    )
                })?;
            let report = storm::run(
                storm::Storm {
                    nodes,
                    ramp,
                    cut_every,
                    deadline,
                    behaviour,
                    measure: measure_pid,
                },
                segment,
            )
            .await?;
            emit(out, &report, |r| print!("{r}"))
        }
        BenchCommand::Rollout {
            nodes,
            wave,
            max_unavailable,
            boot_delay,
            heartbeat_every,
            deadline,
            measure_pid,
        } => {
            raise_open_files_limit();
            let token = admin_token(server, token, data_dir)?;
            let token = token.as_str();
            let bench = storm::rollout::RolloutBench {
                nodes,
                wave,
                max_unavailable,
                boot_delay,
                heartbeat_every,
                deadline,
                measure: measure_pid,
            };
            let report = storm::rollout::run(server, token, bench).await?;
            emit(out, &report, |r| print!("{r}"))
        }
        BenchCommand::Scrape {
            nodes,
            rounds,
            concurrency,
        } => {
            raise_open_files_limit();
            let token = admin_token(server, token, data_dir)?;
            let bench = storm::scrape::ScrapeBench {
                nodes,
                rounds,
                concurrency,
            };
            let report = storm::scrape::run(server, &token, bench).await?;
            emit(out, &report, |r| print!("{r}"))
        }
        BenchCommand::Telemetry {
            nodes,
            every,
            rounds,
            concurrency,
            measure_pid,
        } => {
            raise_open_files_limit();
            let token = admin_token(server, token, data_dir)?;
            let bench = storm::telemetry::TelemetryBench {
                nodes,
                every,
                rounds,
                concurrency,
                server_pid: measure_pid,
            };
            let report = storm::telemetry::run(server, &token, bench).await?;
            emit(out, &report, |r| print!("{r}"))
        }
        BenchCommand::QuoteVerify { tcti, seconds } => {
            let report = tokio::task::spawn_blocking(move || {
                storm::quote::run(&tcti, Duration::from_secs_f64(seconds))
            })
            .await??;
            emit(out, &report, |r| print!("{r}"))
        }
        BenchCommand::Http {
            url,
            nodes,
            cut_every,
        } => {
            raise_open_files_limit();
            let r = storm::copy::http_phase(&url, nodes, cut_every).await;
            emit(out, &r, |r| println!("http: {r}"))
        }
        BenchCommand::Bound { connections, bytes } => {
            raise_open_files_limit();
            let r = storm::copy::loopback_bound(connections, bytes).await?;
            emit(out, &r, |r| println!("loopback bound: {r}"))
        }
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
                local_ip: None,
            };
            let total = transfers.unwrap_or(clients);
            let report = tftp_load(target, &file, clients, total, &opts, expect).await?;
            emit(out, &report, print_tftp)?;
            if report.failed + report.wrong_bytes > 0 {
                anyhow::bail!("{} transfers failed", report.failed + report.wrong_bytes);
            }
            Ok(())
        }
    }
}

/// `total` TFTP reads of `file` from `target` by `clients` concurrent clients.
async fn tftp_load(
    target: SocketAddr,
    file: &str,
    clients: usize,
    total: usize,
    opts: &ClientOptions,
    expect: Option<Digest>,
) -> anyhow::Result<TftpReport> {
    let queue = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients.max(1) {
        let (queue, opts, file) = (queue.clone(), opts.clone(), file.to_string());
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
    Ok(report)
}

fn print_tftp(r: &TftpReport) {
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
}
