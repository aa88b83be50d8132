//! The rollout benchmark (`bootfleet-bench rollout`): N simulated nodes boot over HTTP
//! (script, kernel, initrd, attest, validate, as `node` does after iPXE) and heartbeat as
//! the agent does; asked to reboot, each waits `boot_delay` (a machine's firmware and
//! kernel start) and boots again. One rollout moves them all to a second image, and the
//! time from its start to its end is set against the sum of its waves' own durations
//! (each wave: its first node reimaged to its last node ready): what is left over is the
//! controller's (judging, starting the next wave).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use super::node::{Behaviour, NodeResult, client, from_script_shared, heartbeat};
use super::setup::{mac, mac_string, noise, publish};
use crate::api::agent::NextAction;
use crate::api::event::{Event, EventPage};
use crate::api::rollout::{Rollout, RolloutRequest, RolloutState};

#[derive(Debug, Clone)]
pub struct RolloutBench {
    pub nodes: u32,
    pub wave: String,
    pub max_unavailable: u32,
    pub boot_delay: Duration,
    pub heartbeat_every: Duration,
    pub deadline: Duration,
    /// Processes whose CPU time is reported (the server under test).
    pub measure: Vec<u32>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct WaveTime {
    pub wave: u32,
    pub nodes: usize,
    /// First node reimaged to last node ready.
    pub secs: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct RolloutReport {
    pub nodes: u32,
    pub state: RolloutState,
    /// rollout.started to its end.
    pub total_secs: f64,
    pub waves: Vec<WaveTime>,
    pub waves_sum_secs: f64,
    /// total / sum - 1, in percent.
    pub overhead_pct: f64,
    /// A node ready to its step judged done, mean and worst.
    pub judge_mean_ms: f64,
    pub judge_max_ms: f64,
    /// Failed boots of simulated nodes (retried).
    pub boot_failures: u64,
    /// The server's CPU seconds during the rollout.
    pub server_cpu_secs: Option<f64>,
}

impl std::fmt::Display for RolloutReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "rollout of {} nodes: {}", self.nodes, self.state)?;
        for w in &self.waves {
            writeln!(
                f,
                "  wave {:>3}: {:>5} nodes, {:>7.2} s",
                w.wave, w.nodes, w.secs
            )?;
        }
        writeln!(f, "start to end:      {:.2} s", self.total_secs)?;
        writeln!(f, "sum of the waves:  {:.2} s", self.waves_sum_secs)?;
        writeln!(f, "controller overhead: {:.2} %", self.overhead_pct)?;
        writeln!(
            f,
            "ready to judged done: mean {:.0} ms, worst {:.0} ms",
            self.judge_mean_ms, self.judge_max_ms
        )?;
        if let Some(cpu) = self.server_cpu_secs {
            writeln!(f, "server CPU during the rollout: {cpu:.2} s")?;
        }
        writeln!(f, "node boot failures (retried): {}", self.boot_failures)
    }
}

/// One simulated node: boots, heartbeats, and boots again when asked, until `stop`.
async fn node(
    base: String,
    i: u32,
    b: Behaviour,
    delay: Duration,
    failures: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: CancellationToken,
) {
    let m = mac(i);
    let url = format!(
        "{base}/boot/node.ipxe?mac={}",
        mac_string(m).replace(':', "-")
    );
    let Ok(http) = client(None) else { return };
    let mut first = true;
    let run = async {
        loop {
            if !first {
                tokio::time::sleep(delay).await;
            }
            first = false;
            let mut r = NodeResult::default();
            let booted = match from_script_shared(&http, &url, &b, m, &mut r).await {
                Ok(Some(booted)) => booted,
                Ok(None) | Err(_) => {
                    failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    continue;
                }
            };
            loop {
                tokio::time::sleep(b.heartbeat_every).await;
                match heartbeat(&http, &b, &booted, &mut r).await {
                    Ok(NextAction::Reboot) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        }
    };
    tokio::select! {
        () = run => {}
        () = stop.cancelled() => {}
    }
}

struct Api {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Api {
    async fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .send()
            .await?;
        anyhow::ensure!(r.status().is_success(), "GET {path}: {}", r.status());
        Ok(r.json().await?)
    }

    async fn events_after(&self, mut since: i64) -> anyhow::Result<Vec<Event>> {
        let mut out = Vec::new();
        loop {
            let page: EventPage = self
                .get(&format!("/api/v1/events?since={since}&limit=1000"))
                .await?;
            if page.events.is_empty() {
                return Ok(out);
            }
            since = page.next;
            out.extend(page.events);
        }
    }
}

fn at(e: &Event) -> anyhow::Result<SystemTime> {
    humantime::parse_rfc3339_weak(&e.at).with_context(|| format!("event time {:?}", e.at))
}

fn secs(from: SystemTime, to: SystemTime) -> f64 {
    to.duration_since(from).unwrap_or_default().as_secs_f64()
}

pub async fn run(server: &str, token: &str, bench: RolloutBench) -> anyhow::Result<RolloutReport> {
    let base = server.trim_end_matches('/').to_string();
    let api = Api {
        http: crate::http_client::builder()
            .timeout(Duration::from_secs(300))
            .build()?,
        base: base.clone(),
        token: token.to_string(),
    };
    // Two versions of a small image; every node assigned the first and labelled.
    super::setup::setup(&base, token, bench.nodes, 0.25, 0.25, None).await?;
    let (kernel, initrd) = (noise(262_144, 11), noise(262_144, 12));
    publish(&api.http, &base, token, "2", "storm:next", &kernel, &initrd).await?;
    let labelled = futures_util::stream::iter(0..bench.nodes)
        .map(|i| {
            let url = format!("{base}/api/v1/nodes/{}/labels", mac_string(mac(i)));
            let body = crate::api::node::LabelRequest {
                set: BTreeMap::from([
                    ("pool".to_string(), "bench".to_string()),
                    ("rack".to_string(), format!("r{:02}", i % 50)),
                ]),
                remove: vec![],
            };
            let req = api.http.patch(url).bearer_auth(token).json(&body);
            async move {
                req.send()
                    .await
                    .map(|r| r.status().is_success())
                    .unwrap_or(false)
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<bool>>()
        .await;
    anyhow::ensure!(labelled.iter().all(|ok| *ok), "labelling the nodes failed");

    let stop = CancellationToken::new();
    let failures = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let behaviour = Behaviour {
        heartbeat_every: bench.heartbeat_every,
        ..Behaviour::for_storm_image()
    };
    let tasks: Vec<_> = (0..bench.nodes)
        .map(|i| {
            tokio::spawn(node(
                base.clone(),
                i,
                behaviour.clone(),
                bench.boot_delay,
                failures.clone(),
                stop.clone(),
            ))
        })
        .collect();
    let outcome = drive(&api, &bench, &failures).await;
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    outcome
}

/// Every node ready, then the rollout, then its figures from the event log.
async fn drive(
    api: &Api,
    bench: &RolloutBench,
    failures: &std::sync::atomic::AtomicU64,
) -> anyhow::Result<RolloutReport> {
    let deadline = Instant::now() + bench.deadline;
    loop {
        let ready: Vec<serde_json::Value> = api.get("/api/v1/nodes?state=ready").await?;
        if ready.len() >= bench.nodes as usize {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {} nodes got ready",
            ready.len()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let cpu_before = bench
        .measure
        .iter()
        .map(|p| super::procstat::cpu_secs(*p).unwrap_or(0.0))
        .sum::<f64>();
    let req = RolloutRequest {
        image: "storm:next".into(),
        selector: "pool=bench".into(),
        nodes: vec![],
        canary: 0,
        wave: bench.wave.clone(),
        max_unavailable: bench.max_unavailable,
        pause_after_canary: false,
        timeout_secs: 3600,
        max_failures: 0,
        on_failure: crate::api::rollout::OnFailure::Halt,
        reason: "bench: rollout".into(),
    };
    let r = api
        .http
        .post(format!("{}/api/v1/rollouts", api.base))
        .bearer_auth(&api.token)
        .json(&req)
        .send()
        .await?;
    anyhow::ensure!(
        r.status().is_success(),
        "rollout refused: {}",
        r.text().await?
    );
    let started: Rollout = r.json().await?;
    let end = loop {
        let r: Rollout = api.get(&format!("/api/v1/rollouts/{}", started.id)).await?;
        if r.state != RolloutState::Running {
            break r;
        }
        anyhow::ensure!(Instant::now() < deadline, "the rollout did not end in time");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let cpu_after = bench
        .measure
        .iter()
        .map(|p| super::procstat::cpu_secs(*p).unwrap_or(0.0))
        .sum::<f64>();
    // The whole log: a node's readiness counts only after its reimage for this rollout.
    let events = api.events_after(0).await?;
    let mut report = figures(&end, &events)?;
    report.boot_failures = failures.load(std::sync::atomic::Ordering::Relaxed);
    report.server_cpu_secs = (!bench.measure.is_empty()).then_some(cpu_after - cpu_before);
    Ok(report)
}

/// The figures, from the rollout as it ended and the event log since before it began.
fn figures(end: &Rollout, events: &[Event]) -> anyhow::Result<RolloutReport> {
    let id = end.id;
    let mine = |e: &Event| e.data.get("rollout").and_then(|r| r.as_i64()) == Some(id);
    let find = |kind: &str| events.iter().find(|e| e.kind == kind && mine(e));
    let started = at(find("rollout.started").context("no rollout.started event")?)?;
    let ended = events
        .iter()
        .rev()
        .find(|e| {
            mine(e)
                && e.kind.starts_with("rollout.")
                && !e.kind.starts_with("rollout.node-")
                && e.kind != "rollout.wave-started"
        })
        .context("no end event")?;
    let ended = at(ended)?;
    let wave_of: HashMap<String, u32> = end
        .nodes
        .iter()
        .map(|n| (n.mac.to_string(), n.wave))
        .collect();
    // Per node: reimaged, ready after it, judged done.
    let mut reimaged: HashMap<&str, SystemTime> = HashMap::new();
    let mut ready: HashMap<&str, SystemTime> = HashMap::new();
    let mut done: HashMap<&str, SystemTime> = HashMap::new();
    for e in events {
        let Some(node) = e.node.as_ref() else {
            continue;
        };
        let Some(mac) = wave_of
            .get_key_value(&node.to_string())
            .map(|(k, _)| k.as_str())
        else {
            continue;
        };
        if e.kind == "rollout.node-reimaging" && mine(e) {
            reimaged.entry(mac).or_insert(at(e)?);
        } else if e.kind == "rollout.node-done" && mine(e) {
            done.insert(mac, at(e)?);
        } else if e.kind == "node.state"
            && e.data.get("to").and_then(|t| t.as_str()) == Some("ready")
            && reimaged.contains_key(mac)
        {
            ready.entry(mac).or_insert(at(e)?);
        }
    }
    let mut per_wave: BTreeMap<u32, (Option<SystemTime>, Option<SystemTime>, usize)> =
        BTreeMap::new();
    for (mac, wave) in &wave_of {
        let w = per_wave.entry(*wave).or_insert((None, None, 0));
        w.2 += 1;
        if let Some(t) = reimaged.get(mac.as_str()) {
            w.0 = Some(w.0.map_or(*t, |f: SystemTime| f.min(*t)));
        }
        if let Some(t) = ready.get(mac.as_str()) {
            w.1 = Some(w.1.map_or(*t, |l: SystemTime| l.max(*t)));
        }
    }
    let waves: Vec<WaveTime> = per_wave
        .into_iter()
        .map(|(wave, (first, last, nodes))| WaveTime {
            wave,
            nodes,
            secs: match (first, last) {
                (Some(f), Some(l)) => secs(f, l),
                _ => 0.0,
            },
        })
        .collect();
    let sum: f64 = waves.iter().map(|w| w.secs).sum();
    let total = secs(started, ended);
    let judged: Vec<f64> = done
        .iter()
        .filter_map(|(mac, d)| ready.get(mac).map(|r| secs(*r, *d) * 1000.0))
        .collect();
    Ok(RolloutReport {
        nodes: end.nodes.len() as u32,
        state: end.state,
        total_secs: total,
        overhead_pct: if sum > 0.0 {
            (total / sum - 1.0) * 100.0
        } else {
            0.0
        },
        waves_sum_secs: sum,
        waves,
        judge_mean_ms: judged.iter().sum::<f64>() / judged.len().max(1) as f64,
        judge_max_ms: judged.iter().copied().fold(0.0, f64::max),
        boot_failures: 0,
        server_cpu_secs: None,
    })
}
