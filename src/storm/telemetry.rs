//! The telemetry benchmark (`bootfleet-bench telemetry`): N simulated 8-GPU nodes boot
//! once over HTTP, then heartbeat at a steady rate (each node once an interval) for a
//! phase without telemetry (facts only) and a phase with every GPU's and InfiniBand
//! port's readings, in the same run. Reports each phase's rate, latency, the server's CPU
//! per heartbeat and share of a core, and its anonymous memory after.

use std::time::{Duration, Instant};

use futures_util::StreamExt;

use super::node::{Behaviour, Booted, NodeResult, client, from_script_shared, heartbeat};
use super::setup::{mac, mac_string};

#[derive(Debug, Clone)]
pub struct TelemetryBench {
    pub nodes: u32,
    /// Each node's heartbeat interval.
    pub every: Duration,
    /// Intervals a phase lasts.
    pub rounds: u32,
    pub concurrency: usize,
    /// The server's PID, for its CPU time and memory.
    pub server_pid: u32,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Phase {
    pub telemetry: bool,
    pub heartbeats: u64,
    pub failed: u64,
    pub secs: f64,
    pub per_sec: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub server_cpu_secs: f64,
    pub cpu_us_per_heartbeat: f64,
    pub cores: f64,
    pub anon_mib_after: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct TelemetryReport {
    pub nodes: u32,
    pub every_secs: f64,
    pub phases: Vec<Phase>,
}

impl std::fmt::Display for TelemetryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} nodes x 8 GPUs, a heartbeat each every {:.0} s",
            self.nodes, self.every_secs
        )?;
        for p in &self.phases {
            writeln!(
                f,
                "{:<17} {:>7} heartbeats ({} failed) in {:>5.1} s = {:>6.0}/s, p50 {:>6.1} ms, p99 {:>6.1} ms; server {:>6.1} CPU s = {:>5.0} us/heartbeat, {:.2} cores; anon {:>6.1} MiB",
                if p.telemetry {
                    "with telemetry"
                } else {
                    "without telemetry"
                },
                p.heartbeats,
                p.failed,
                p.secs,
                p.per_sec,
                p.p50_ms,
                p.p99_ms,
                p.server_cpu_secs,
                p.cpu_us_per_heartbeat,
                p.cores,
                p.anon_mib_after
            )?;
        }
        if let [without, with] = self.phases.as_slice() {
            writeln!(
                f,
                "telemetry costs {:.2}x the CPU per heartbeat of the facts alone",
                with.cpu_us_per_heartbeat / without.cpu_us_per_heartbeat
            )?;
        }
        Ok(())
    }
}

async fn boot_once(http: reqwest::Client, base: String, i: u32, b: Behaviour) -> Option<Booted> {
    let m = mac(i);
    let url = format!(
        "{base}/boot/node.ipxe?mac={}",
        mac_string(m).replace(':', "-")
    );
    let mut r = NodeResult::default();
    from_script_shared(&http, &url, &b, m, &mut r)
        .await
        .ok()
        .flatten()
}

/// One phase: every node heartbeats once an interval, spread evenly over it.
async fn phase(
    http: &reqwest::Client,
    fleet: &[Booted],
    b: &Behaviour,
    bench: &TelemetryBench,
) -> anyhow::Result<Phase> {
    let cpu_before = super::procstat::cpu_secs(bench.server_pid)?;
    let started = Instant::now();
    let total = fleet.len() as u64 * u64::from(bench.rounds);
    let gap = bench.every.as_secs_f64() / fleet.len().max(1) as f64;
    let results: Vec<Option<f64>> = futures_util::stream::iter(0..total)
        .map(|k| {
            let booted = &fleet[(k % fleet.len() as u64) as usize];
            let due = started + Duration::from_secs_f64(gap * k as f64);
            async move {
                tokio::time::sleep_until(due.into()).await;
                let t = Instant::now();
                let mut r = NodeResult::default();
                let ok = heartbeat(http, b, booted, &mut r).await.is_ok();
                ok.then(|| t.elapsed().as_secs_f64() * 1000.0)
            }
        })
        .buffer_unordered(bench.concurrency.max(1))
        .collect()
        .await;
    let secs = started.elapsed().as_secs_f64();
    let server_cpu_secs = super::procstat::cpu_secs(bench.server_pid)? - cpu_before;
    let mut ms: Vec<f64> = results.iter().flatten().copied().collect();
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| {
        ms.get(((ms.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    Ok(Phase {
        telemetry: b.telemetry,
        heartbeats: ms.len() as u64,
        failed: total - ms.len() as u64,
        secs,
        per_sec: ms.len() as f64 / secs,
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        server_cpu_secs,
        cpu_us_per_heartbeat: server_cpu_secs * 1e6 / ms.len().max(1) as f64,
        cores: server_cpu_secs / secs,
        anon_mib_after: super::procstat::anon_rss_mib(bench.server_pid)?,
    })
}

pub async fn run(
    server: &str,
    token: &str,
    bench: TelemetryBench,
) -> anyhow::Result<TelemetryReport> {
    let base = server.trim_end_matches('/').to_string();
    super::setup::setup(&base, token, bench.nodes, 0.0625, 0.0625, None).await?;
    let http = client(None).map_err(anyhow::Error::msg)?;
    let behaviour = Behaviour::for_storm_image();
    let fleet: Vec<Booted> = futures_util::stream::iter(0..bench.nodes)
        .map(|i| boot_once(http.clone(), base.clone(), i, behaviour.clone()))
        .buffer_unordered(bench.concurrency.max(1))
        .filter_map(std::future::ready)
        .collect()
        .await;
    anyhow::ensure!(
        fleet.len() == bench.nodes as usize,
        "only {} of {} nodes booted",
        fleet.len(),
        bench.nodes
    );
    let mut phases = Vec::new();
    for telemetry in [false, true] {
        let b = Behaviour {
            telemetry,
            ..behaviour.clone()
        };
        phases.push(phase(&http, &fleet, &b, &bench).await?);
    }
    Ok(TelemetryReport {
        nodes: bench.nodes,
        every_secs: bench.every.as_secs_f64(),
        phases,
    })
}
