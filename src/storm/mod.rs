//! The boot-storm simulator (`bootfleet-bench storm`): N nodes power on together and go
//! through the whole boot against a running server: DHCP as a PXE ROM, TFTP of the boot
//! file, DHCP as iPXE, the boot script, kernel and initrd (some cut and resumed), then
//! attest, validate and heartbeats. `dhcp` is the shared firmware-like DHCP client,
//! `node` one node's boot, `report` the figures (pure), `setup` the image and assignments,
//! `copy` the HTTP phase alone and its loopback bound, `procstat` the server's cost,
//! `rollout` a rollout over simulated nodes and its controller's overhead.

pub mod bench;
pub mod copy;
pub mod dhcp;
pub mod node;
pub mod procstat;
pub mod quote;
pub mod report;
pub mod rollout;
pub mod scrape;
pub mod setup;
pub mod telemetry;

use std::time::{Duration, Instant};

use node::Behaviour;
use report::{Report, ServerCost};

/// One storm: who, how many, how they behave.
#[derive(Debug, Clone)]
pub struct Storm {
    pub nodes: u32,
    /// Power-on is spread evenly over this long (0: all at once).
    pub ramp: Duration,
    /// Every Nth node cuts its kernel download halfway (0: none).
    pub cut_every: u32,
    /// A node still booting after this long counts as failed.
    pub deadline: Duration,
    pub behaviour: Behaviour,
    /// Processes whose CPU time and peak memory are reported (the server under test).
    pub measure: Vec<u32>,
}

impl Behaviour {
    /// Nodes of the storm image (`setup`): its pins, a healthy 8-GPU report, two
    /// heartbeats a second apart, firmware-like TFTP, three PXE attempts.
    pub fn for_storm_image() -> Self {
        Self {
            heartbeats: 2,
            heartbeat_every: Duration::from_secs(1),
            bind_leased: false,
            no_agent: false,
            tftp: crate::tftp::client::ClientOptions::default(),
            pxe_attempts: 3,
            kernel_release: setup::KERNEL_RELEASE.into(),
            versions: [("nvidia-driver".to_string(), setup::DRIVER.to_string())].into(),
            modules: node::ModuleList::new(gpu_server_modules()),
            gpu_report: gpu_report(),
            telemetry: true,
            reboots: 0,
            reboot_after: Duration::from_secs(30),
        }
    }
}

/// The healthy 8-GPU validation report every simulated node sends.
pub fn gpu_report() -> crate::api::agent::ValidationReport {
    serde_json::from_str(include_str!(
        "../../tests/fixtures/gpu/hgx-h100-healthy.json"
    ))
    .expect("the fixture is JSON")
}

/// The loaded modules every simulated node reports: a GPU server's (a composed fixture;
/// "-" in it is a module without a version).
pub fn gpu_server_modules() -> std::collections::BTreeMap<String, String> {
    include_str!("../../tests/fixtures/gpu/hgx-h100-modules.synthesised.txt")
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split_once(' '))
        .map(|(name, version)| {
            let version = if version == "-" { "" } else { version };
            (name.to_string(), version.to_string())
        })
        .collect()
}

/// The highest summed RssAnon of `pids`, sampled every 50 ms until `stop`: /proc keeps
/// no peak of it (VmHWM is the peak of all resident pages, mapped files included).
async fn sample_peak_anon(pids: Vec<u32>, stop: tokio_util::sync::CancellationToken) -> f64 {
    let mut peak: f64 = 0.0;
    loop {
        let now: f64 = pids
            .iter()
            .filter_map(|&p| procstat::anon_rss_mib(p).ok())
            .sum();
        peak = peak.max(now);
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(50)) => {}
            () = stop.cancelled() => return peak,
        }
    }
}

/// Runs `storm` with its nodes' DHCP on `segment`; returns the report.
pub async fn run(storm: Storm, segment: dhcp::Segment) -> anyhow::Result<Report> {
    let cpu_before: Vec<f64> = storm
        .measure
        .iter()
        .map(|&p| procstat::cpu_secs(p))
        .collect::<std::io::Result<_>>()?;
    let stop_sampling = tokio_util::sync::CancellationToken::new();
    let sampler = tokio::spawn(sample_peak_anon(
        storm.measure.clone(),
        stop_sampling.clone(),
    ));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let behaviour = std::sync::Arc::new(storm.behaviour.clone());
    for i in 0..storm.nodes {
        let (segment, behaviour) = (segment.clone(), behaviour.clone());
        let at = storm
            .ramp
            .mul_f64(f64::from(i) / f64::from(storm.nodes.max(1)));
        let cut = storm.cut_every > 0 && i % storm.cut_every == 0;
        let deadline = storm.deadline;
        tasks.spawn(async move {
            tokio::time::sleep_until(tokio::time::Instant::from_std(started + at)).await;
            let boot = node::boot(&segment, &behaviour, setup::mac(i), cut);
            match tokio::time::timeout(deadline, boot).await {
                Ok(r) => r,
                Err(_) => node::NodeResult {
                    failure: Some((node::Phase::Ready, format!("not done within {deadline:?}"))),
                    ..Default::default()
                },
            }
        });
    }
    let mut results = Vec::with_capacity(storm.nodes as usize);
    while let Some(r) = tasks.join_next().await {
        results.push(r?);
    }
    let wall = started.elapsed();
    stop_sampling.cancel();
    let peak_anon_mib = sampler.await?;
    let server = if storm.measure.is_empty() {
        None
    } else {
        let mut cost = ServerCost {
            peak_anon_mib,
            ..Default::default()
        };
        for (&pid, before) in storm.measure.iter().zip(cpu_before) {
            cost.cpu_secs += procstat::cpu_secs(pid)? - before;
            cost.peak_rss_mib += procstat::peak_rss_mib(pid)?;
        }
        Some(cost)
    };
    let strays = segment.strays.load(std::sync::atomic::Ordering::Relaxed);
    Ok(report::build(&results, wall, strays, server))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_simulated_nodes_report_a_gpu_servers_modules() {
        let modules = super::gpu_server_modules();
        assert_eq!(modules.len(), 162);
        assert_eq!(modules["nvidia"], super::setup::DRIVER, "the image's pin");
        assert_eq!(modules["drm"], "", "in-tree: no version");
    }
}
