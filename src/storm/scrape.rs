//! The scrape benchmark (`bootfleet-bench scrape`): N simulated nodes boot once over HTTP
//! and send one heartbeat with their 8 GPUs' readings; then `/metrics`, `/metrics/gpus`
//! and, for the same fleet, the JSON node list (`/api/v1/nodes`) are each fetched
//! `rounds` times in turn. Reports each one's time (median, worst) and size, and the
//! scrape's time as a ratio of the JSON list's.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures_util::StreamExt;

use super::node::{Behaviour, NodeResult, client, from_script_shared, heartbeat};
use super::setup::{mac, mac_string};

#[derive(Debug, Clone)]
pub struct ScrapeBench {
    pub nodes: u32,
    pub rounds: u32,
    /// Boots in flight at once while the fleet is built.
    pub concurrency: usize,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Fetched {
    pub path: String,
    pub median_ms: f64,
    pub max_ms: f64,
    pub bytes: usize,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ScrapeReport {
    pub nodes: u32,
    pub gpus: usize,
    pub build_secs: f64,
    pub fetched: Vec<Fetched>,
}

impl std::fmt::Display for ScrapeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} nodes, {} GPUs reporting (built in {:.1} s)",
            self.nodes, self.gpus, self.build_secs
        )?;
        let list = self.fetched.iter().find(|x| x.path == "/api/v1/nodes");
        for x in &self.fetched {
            let ratio = list.map_or(String::new(), |l| {
                format!(", {:.2}x the JSON list's time", x.median_ms / l.median_ms)
            });
            writeln!(
                f,
                "{:<16} median {:>8.1} ms, worst {:>8.1} ms, {:>10} bytes{ratio}",
                x.path, x.median_ms, x.max_ms, x.bytes
            )?;
        }
        Ok(())
    }
}

/// Boots node `i` once and sends one heartbeat with its GPUs' readings.
async fn boot_once(http: reqwest::Client, base: String, i: u32, b: Behaviour) -> bool {
    let m = mac(i);
    let url = format!(
        "{base}/boot/node.ipxe?mac={}",
        mac_string(m).replace(':', "-")
    );
    let mut r = NodeResult::default();
    match from_script_shared(&http, &url, &b, m, &mut r).await {
        Ok(Some(booted)) => heartbeat(&http, &b, &booted, &mut r).await.is_ok(),
        _ => false,
    }
}

pub async fn run(server: &str, token: &str, bench: ScrapeBench) -> anyhow::Result<ScrapeReport> {
    let base = server.trim_end_matches('/').to_string();
    super::setup::setup(&base, token, bench.nodes, 0.0625, 0.0625, None).await?;
    let http = client(None).map_err(anyhow::Error::msg)?;
    let started = Instant::now();
    let behaviour = Behaviour::for_storm_image();
    let booted = futures_util::stream::iter(0..bench.nodes)
        .map(|i| boot_once(http.clone(), base.clone(), i, behaviour.clone()))
        .buffer_unordered(bench.concurrency.max(1))
        .filter(|ok| std::future::ready(*ok))
        .count()
        .await;
    anyhow::ensure!(
        booted == bench.nodes as usize,
        "only {booted} of {} nodes booted",
        bench.nodes
    );
    let build_secs = started.elapsed().as_secs_f64();
    let admin = crate::http_client::builder()
        .timeout(Duration::from_secs(300))
        .build()?;
    let paths = ["/metrics", "/metrics/gpus", "/api/v1/nodes"];
    let mut times: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut sizes: BTreeMap<&str, usize> = BTreeMap::new();
    let mut gpus = 0;
    for _ in 0..bench.rounds.max(1) {
        for path in paths {
            let t = Instant::now();
            let r = admin
                .get(format!("{base}{path}"))
                .bearer_auth(token)
                .send()
                .await?;
            anyhow::ensure!(r.status().is_success(), "GET {path}: {}", r.status());
            let body = r.bytes().await?;
            times
                .entry(path)
                .or_default()
                .push(t.elapsed().as_secs_f64() * 1000.0);
            sizes.insert(path, body.len());
            if path == "/metrics/gpus" {
                gpus = body
                    .split(|b| *b == b'\n')
                    .filter(|l| l.starts_with(b"bootfleet_gpu_info{"))
                    .count();
            }
        }
    }
    let fetched = paths
        .iter()
        .map(|p| {
            let mut t = times.remove(p).unwrap_or_default();
            t.sort_by(f64::total_cmp);
            Fetched {
                path: p.to_string(),
                median_ms: t.get(t.len() / 2).copied().unwrap_or(0.0),
                max_ms: t.last().copied().unwrap_or(0.0),
                bytes: sizes.get(p).copied().unwrap_or(0),
            }
        })
        .collect();
    Ok(ScrapeReport {
        nodes: bench.nodes,
        gpus,
        build_secs,
        fetched,
    })
}
