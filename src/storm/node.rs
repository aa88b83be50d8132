//! One simulated node's boot, phase by phase, behaving like the firmware, iPXE and the
//! agent it imitates: DHCP as a PXE ROM, TFTP of the boot file, DHCP again as iPXE, the
//! boot script over HTTP, kernel and initrds (some cut on purpose and resumed with Range),
//! then attest, validate and heartbeats as `bootfleet-agent` would.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use crate::api::Mac;
use crate::api::agent::{
    AttestReport, AttestRequest, HeartbeatAnswer, HeartbeatRequest, NextAction, NodeFacts,
    ValidateRequest, ValidationReport, ValidationVerdict, Verdict,
};
use futures_util::StreamExt;

use super::dhcp::{Asker, Segment};
use crate::tftp::client::{ClientOptions, fetch};
use bootfleet_agent::run::Servers;

/// The steps of a boot, in order; `Ready` is power-on to validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    DhcpPxe,
    Tftp,
    DhcpIpxe,
    Script,
    Kernel,
    Initrd,
    Attest,
    Validate,
    Heartbeat,
    Ready,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::DhcpPxe => "dhcp (pxe)",
            Phase::Tftp => "tftp",
            Phase::DhcpIpxe => "dhcp (ipxe)",
            Phase::Script => "script",
            Phase::Kernel => "kernel",
            Phase::Initrd => "initrd",
            Phase::Attest => "attest",
            Phase::Validate => "validate",
            Phase::Heartbeat => "heartbeat",
            Phase::Ready => "power-on to ready",
        }
    }
}

/// How every simulated node behaves.
#[derive(Debug, Clone)]
pub struct Behaviour {
    pub heartbeats: u32,
    pub heartbeat_every: Duration,
    /// Bind TCP and TFTP sockets to the address DHCP gave (a local route makes the pool
    /// ours), so the server sees one address per node.
    pub bind_leased: bool,
    /// Stop after the downloads: the reference stack has no agent API.
    pub no_agent: bool,
    pub tftp: ClientOptions,
    /// PXE attempts (DHCP + TFTP) before the ROM gives up.
    pub pxe_attempts: u32,
    /// The pins the simulated agent reports (what the storm image pins).
    pub kernel_release: String,
    pub versions: BTreeMap<String, String>,
    /// The loaded modules the agent reports at attestation and in each heartbeat's facts
    /// (a GPU server's hundred and more, as the real agent sends them).
    pub modules: ModuleList,
    /// The validation report, with GPU UUIDs made per node.
    pub gpu_report: ValidationReport,
    /// Heartbeats carry each GPU's and InfiniBand port's readings (as the agent's do);
    /// off, only the facts (for the telemetry benchmark's baseline).
    pub telemetry: bool,
    /// Failed boots a node starts over from power-on (after `reboot_after`), as our
    /// boot script reboots a node whose boot failed and the server reimages a node whose
    /// attestation or validation failed; 0: a failure is final.
    pub reboots: u32,
    pub reboot_after: Duration,
}

/// A module list and its digest (sent in its place while the server names it as the
/// baseline's), made together so that they cannot disagree.
#[derive(Debug, Clone)]
pub struct ModuleList {
    pub list: BTreeMap<String, String>,
    pub sha256: crate::api::Digest,
}

impl ModuleList {
    pub fn new(list: BTreeMap<String, String>) -> Self {
        let sha256 = crate::api::agent::modules_digest(&list);
        Self { list, sha256 }
    }
}

/// What one node's boot came to.
#[derive(Debug, Default, Clone)]
pub struct NodeResult {
    pub phases: Vec<(Phase, Duration)>,
    /// The phase that failed and why; None when the node reached its last heartbeat.
    pub failure: Option<(Phase, String)>,
    pub retries: BTreeMap<&'static str, u32>,
    pub http_bytes: u64,
}

impl NodeResult {
    fn retry(&mut self, kind: &'static str, n: u32) {
        if n > 0 {
            *self.retries.entry(kind).or_default() += n;
        }
    }
}

pub(crate) struct Failed(pub Phase, pub String);

fn hexhyp(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join("-")
}

/// Boots node `mac`; `cut` makes it cut its kernel download halfway and resume it.
pub async fn boot(segment: &Segment, b: &Behaviour, mac: [u8; 6], cut: bool) -> NodeResult {
    let mut r = NodeResult::default();
    let power_on = Instant::now();
    let mut rebooted = 0;
    while let Err(Failed(phase, why)) = run(segment, b, mac, cut, &mut r, power_on).await {
        if rebooted == b.reboots {
            r.failure = Some((phase, why));
            break;
        }
        rebooted += 1;
        r.retry("reboot after a failed boot", 1);
        tracing::debug!(phase = phase.name(), %why, "boot failed; the node starts over");
        tokio::time::sleep(b.reboot_after).await;
    }
    r
}

/// One DORA as `asker`, timed as `phase`, its retransmits and NAKs counted.
async fn dhcp(
    segment: &Segment,
    mac: [u8; 6],
    asker: Asker,
    phase: Phase,
    r: &mut NodeResult,
) -> Result<super::dhcp::Bound, Failed> {
    let t = Instant::now();
    let bound = segment
        .dora(mac, asker)
        .await
        .map_err(|e| Failed(phase, e.to_string()))?;
    r.phases.push((phase, t.elapsed()));
    r.retry("dhcp retransmit", bound.retransmits);
    r.retry("dhcp nak", bound.naks);
    Ok(bound)
}

async fn run(
    segment: &Segment,
    b: &Behaviour,
    mac: [u8; 6],
    cut: bool,
    r: &mut NodeResult,
    power_on: Instant,
) -> Result<(), Failed> {
    let (url, leased) = pxe(segment, b, mac, r).await?;
    let local = b.bind_leased.then_some(leased);
    let http = client(local).map_err(|e| Failed(Phase::Script, e))?;
    let agent_http = agent_client(local).map_err(|e| Failed(Phase::Attest, e))?;
    let clients = Clients {
        ipxe: &http,
        agent: &agent_http,
    };
    match from_script(clients, &url, b, mac, cut, r, power_on).await? {
        Some(booted) => heartbeats(&agent_http, b, &booted, r).await,
        None => Ok(()),
    }
}

/// The PXE ROM and iPXE's DHCP: the script URL, and the address iPXE leased.
async fn pxe(
    segment: &Segment,
    b: &Behaviour,
    mac: [u8; 6],
    r: &mut NodeResult,
) -> Result<(String, std::net::Ipv4Addr), Failed> {
    // The PXE ROM: DHCP, then the boot file over TFTP; a failed TFTP restarts PXE.
    let mut attempt = 0;
    loop {
        attempt += 1;
        let bound = dhcp(segment, mac, Asker::Pxe, Phase::DhcpPxe, r).await?;
        let file = bound
            .file
            .clone()
            .ok_or_else(|| Failed(Phase::DhcpPxe, "no boot file offered".into()))?;
        let t = Instant::now();
        let mut opts = b.tftp.clone();
        if b.bind_leased {
            opts.local_ip = Some(IpAddr::V4(bound.ip));
        }
        let tftp_server = SocketAddr::new(IpAddr::V4(bound.next_server), 69);
        match fetch(tftp_server, &file, &opts).await {
            Ok(f) => {
                r.phases.push((Phase::Tftp, t.elapsed()));
                r.retry("tftp timeout", f.timeouts);
                break;
            }
            Err(e) if attempt < b.pxe_attempts => {
                r.retry("pxe restart after tftp failure", 1);
                tracing::debug!(error = %e, "tftp failed; the ROM starts over");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(Failed(Phase::Tftp, e.to_string())),
        }
    }

    // iPXE: DHCP again, now as iPXE, for the script URL. Its address is the one iPXE
    // talks HTTP from: with several servers it may come from another than the ROM's.
    let bound = dhcp(segment, mac, Asker::Ipxe, Phase::DhcpIpxe, r).await?;
    let url = bound
        .file
        .filter(|f| f.starts_with("http://"))
        .ok_or_else(|| Failed(Phase::DhcpIpxe, "no script URL for iPXE".into()))?;
    Ok((url, bound.ip))
}

/// A node's HTTP client (iPXE's), sending from `local` when given.
pub fn client(local: Option<std::net::Ipv4Addr>) -> Result<reqwest::Client, String> {
    client_keeping(local, 1)
}

/// The node's agent's client: as `bootfleet-agent`'s, it keeps no connection between
/// calls (they are seconds to a heartbeat period apart), so an agent holds none of the
/// server's connection slots between them.
pub fn agent_client(local: Option<std::net::Ipv4Addr>) -> Result<reqwest::Client, String> {
    client_keeping(local, 0)
}

fn client_keeping(
    local: Option<std::net::Ipv4Addr>,
    idle: usize,
) -> Result<reqwest::Client, String> {
    let mut http = crate::http_client::shared_roots_builder()?
        .timeout(Duration::from_secs(120))
        .pool_max_idle_per_host(idle);
    if let Some(ip) = local {
        http = http.local_address(IpAddr::V4(ip));
    }
    http.build().map_err(|e| e.to_string())
}

/// A booted node, as its agent knows itself.
pub struct Booted {
    servers: Servers,
    token: String,
    boot: String,
    mac: Mac,
    args: String,
    uuids: Vec<String>,
    /// The baseline's module digest the last heartbeat's answer named.
    baseline_modules: std::sync::Mutex<Option<crate::api::Digest>>,
}

impl Booted {
    fn agent<'a>(&'a self, http: &'a reqwest::Client) -> Agent<'a> {
        Agent {
            http,
            servers: &self.servers,
            token: self.token.clone(),
            boot: self.boot.clone(),
            mac: self.mac,
        }
    }
}

/// A node's two HTTP clients: iPXE's (scripts and downloads) and its agent's.
#[derive(Clone, Copy)]
pub(crate) struct Clients<'a> {
    pub ipxe: &'a reqwest::Client,
    pub agent: &'a reqwest::Client,
}

impl<'a> Clients<'a> {
    /// One client for both (benchmarks whose nodes share a pool).
    pub fn one(http: &'a reqwest::Client) -> Self {
        Self {
            ipxe: http,
            agent: http,
        }
    }
}

/// `from_script` for benchmarks whose nodes share one client, no download cut, timed
/// from now.
pub(crate) async fn from_script_shared(
    http: &reqwest::Client,
    url: &str,
    b: &Behaviour,
    mac: [u8; 6],
    r: &mut NodeResult,
) -> Result<Option<Booted>, Failed> {
    from_script(Clients::one(http), url, b, mac, false, r, Instant::now()).await
}

/// From the boot script at `url` to validated: the script (and the one it chains to),
/// kernel and initrds, attest, validate. None when the behaviour has no agent.
pub(crate) async fn from_script(
    clients: Clients<'_>,
    url: &str,
    b: &Behaviour,
    mac: [u8; 6],
    cut: bool,
    r: &mut NodeResult,
    power_on: Instant,
) -> Result<Option<Booted>, Failed> {
    let http = clients.ipxe;
    // The script: the entry script chains to the node's own.
    let t = Instant::now();
    let mut script = get_text(http, url, r)
        .await
        .map_err(|e| Failed(Phase::Script, e))?;
    if let Some(next) = chained(&script, mac) {
        script = get_text(http, &next, r)
            .await
            .map_err(|e| Failed(Phase::Script, e))?;
    }
    r.phases.push((Phase::Script, t.elapsed()));
    let plan = parse_script(&script).map_err(|e| Failed(Phase::Script, e))?;

    let t = Instant::now();
    r.http_bytes += download(http, &plan.kernel, cut, r)
        .await
        .map_err(|e| Failed(Phase::Kernel, e))?;
    r.phases.push((Phase::Kernel, t.elapsed()));
    let t = Instant::now();
    for initrd in &plan.initrds {
        r.http_bytes += download(http, initrd, false, r)
            .await
            .map_err(|e| Failed(Phase::Initrd, e))?;
    }
    r.phases.push((Phase::Initrd, t.elapsed()));
    if b.no_agent {
        r.phases.push((Phase::Ready, power_on.elapsed()));
        return Ok(None);
    }

    // The agent, from the kernel command line.
    let arg = |name: &str| {
        plan.args
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("bootfleet.{name}=")))
            .map(str::to_string)
            .ok_or_else(|| {
                Failed(
                    Phase::Attest,
                    format!("bootfleet.{name} not on the command line"),
                )
            })
    };
    let others: Vec<String> = arg("servers")
        .map(|s| s.split(',').map(String::from).collect())
        .unwrap_or_default();
    let servers = Servers::new(&arg("server")?, &others);
    let agent = Agent {
        http: clients.agent,
        servers: &servers,
        token: arg("token")?,
        boot: arg("boot")?,
        mac: arg("mac")?
            .parse()
            .map_err(|e: crate::api::MacError| Failed(Phase::Attest, e.to_string()))?,
    };
    let t = Instant::now();
    let attest = AttestRequest {
        boot_id: agent.boot.clone(),
        mac: agent.mac,
        report: AttestReport {
            image_digest: arg("image")?
                .parse()
                .map_err(|e: crate::api::DigestError| Failed(Phase::Attest, e.to_string()))?,
            kernel_release: b.kernel_release.clone(),
            cmdline: plan.args.clone(),
            versions: b.versions.clone(),
            artifacts: Vec::new(),
            modules: b.modules.list.clone(),
            verity_root_hash: None,
            stage1_failure: None,
        },
        tpm: None,
    };
    let verdict: Verdict = agent
        .post("attest", &attest, r)
        .await
        .map_err(|e| Failed(Phase::Attest, e))?;
    if !verdict.passed {
        // The cause is the mismatched fields (their values name the node's blobs).
        let fields: Vec<&str> = verdict
            .mismatches
            .iter()
            .map(|m| m.field.as_str())
            .collect();
        return Err(Failed(
            Phase::Attest,
            format!("refused: {}", fields.join(", ")),
        ));
    }
    r.phases.push((Phase::Attest, t.elapsed()));

    let t = Instant::now();
    let mut report = b.gpu_report.clone();
    let mut uuids = Vec::new();
    for (i, g) in report.gpus.iter_mut().enumerate() {
        g.uuid = format!("GPU-{}-{i}", hexhyp(mac));
        uuids.push(g.uuid.clone());
    }
    let validate = ValidateRequest {
        boot_id: agent.boot.clone(),
        mac: agent.mac,
        report,
    };
    let verdict: ValidationVerdict = agent
        .post("validate", &validate, r)
        .await
        .map_err(|e| Failed(Phase::Validate, e))?;
    // Ready is what the server says: a refused validation is a failed node.
    if !verdict.passed {
        let why: Vec<&str> = verdict.failures.iter().map(|f| f.reason.as_str()).collect();
        return Err(Failed(
            Phase::Validate,
            format!("refused: {}", why.join("; ")),
        ));
    }
    r.phases.push((Phase::Validate, t.elapsed()));
    r.phases.push((Phase::Ready, power_on.elapsed()));

    let (token, boot, mac) = (agent.token, agent.boot, agent.mac);
    Ok(Some(Booted {
        servers,
        token,
        boot,
        mac,
        args: plan.args,
        uuids,
        baseline_modules: Default::default(),
    }))
}

/// Readings of the node's GPUs as a healthy H100 node reports them (synthetic: steady
/// temperatures and power, no errors).
fn gpu_samples(uuids: &[String]) -> Vec<crate::api::agent::GpuSample> {
    uuids
        .iter()
        .enumerate()
        .map(|(i, uuid)| crate::api::agent::GpuSample {
            index: i as u32,
            uuid: uuid.clone(),
            name: "NVIDIA H100 80GB HBM3".into(),
            pci_bus_id: Some(format!("00000000:{:02X}:00.0", 0x18 + 0x10 * i)),
            temperature_c: Some(34 + i as u32),
            power_w: Some(71.5 + i as f64),
            ecc: Some(Default::default()),
            sm_clock_mhz: Some(1980),
            sm_clock_max_mhz: Some(1980),
            throttle_reasons: Some(vec![]),
            row_remap: Some(Default::default()),
            pcie_replay: Some(0),
            nvlink_errors: Some(0),
            ..Default::default()
        })
        .collect()
}

/// One InfiniBand port a GPU, as an HGX node has them: up at 400 Gb/s, no errors.
fn ib_samples(count: usize) -> Vec<crate::api::agent::IbPortSample> {
    (0..count)
        .map(|i| crate::api::agent::IbPortSample {
            port: format!("mlx5_{i}/1"),
            state: Some("ACTIVE".into()),
            rate_gbps: Some(400.0),
            width: Some("4X".into()),
            link_downed: Some(0),
            symbol_errors: Some(0),
            link_error_recovery: Some(0),
            rcv_errors: Some(0),
            ..Default::default()
        })
        .collect()
}

/// One heartbeat as the agent sends it; the server's answer.
pub(crate) async fn heartbeat(
    http: &reqwest::Client,
    b: &Behaviour,
    booted: &Booted,
    r: &mut NodeResult,
) -> Result<NextAction, Failed> {
    let t = Instant::now();
    // As the agent: the list's digest alone while it is the baseline's last named.
    let known = *booted.baseline_modules.lock().expect("not poisoned");
    let unchanged = known == Some(b.modules.sha256);
    let heartbeat = HeartbeatRequest {
        boot_id: booted.boot.clone(),
        mac: booted.mac,
        facts: Some(NodeFacts {
            kernel_release: Some(b.kernel_release.clone()),
            cmdline: Some(booted.args.clone()),
            versions: b.versions.clone(),
            modules: if unchanged {
                BTreeMap::new()
            } else {
                b.modules.list.clone()
            },
            modules_sha256: unchanged.then_some(b.modules.sha256),
            gpus: Some(booted.uuids.clone()),
        }),
        gpus: if b.telemetry {
            gpu_samples(&booted.uuids)
        } else {
            vec![]
        },
        ib_ports: if b.telemetry {
            ib_samples(booted.uuids.len())
        } else {
            vec![]
        },
    };
    let answer: HeartbeatAnswer = booted
        .agent(http)
        .post("heartbeat", &heartbeat, r)
        .await
        .map_err(|e| Failed(Phase::Heartbeat, e))?;
    r.phases.push((Phase::Heartbeat, t.elapsed()));
    *booted.baseline_modules.lock().expect("not poisoned") = answer.baseline_modules_sha256;
    Ok(answer.action)
}

/// `b.heartbeats` heartbeats; anything but "none" in answer is a failure in a storm.
async fn heartbeats(
    http: &reqwest::Client,
    b: &Behaviour,
    booted: &Booted,
    r: &mut NodeResult,
) -> Result<(), Failed> {
    for i in 0..b.heartbeats {
        if i > 0 {
            tokio::time::sleep(b.heartbeat_every).await;
        }
        let action = heartbeat(http, b, booted, r).await?;
        if action != NextAction::None {
            return Err(Failed(
                Phase::Heartbeat,
                format!("heartbeat answered {action:?}"),
            ));
        }
    }
    Ok(())
}

/// iPXE's own back-off between failed fetches in our scripts, roughly.
const HTTP_RETRY_DELAYS: [u64; 5] = [1, 2, 4, 8, 16];

/// A 503 with Retry-After is waited out and fetched again, as iPXE's HTTP core does by
/// itself, this many times at most; it is not one of the script's own retries.
const HTTP_503_RETRIES: u32 = 60;

async fn get_text(http: &reqwest::Client, url: &str, r: &mut NodeResult) -> Result<String, String> {
    let mut last = String::new();
    let mut waited_out = 0;
    for (i, delay) in std::iter::once(0).chain(HTTP_RETRY_DELAYS).enumerate() {
        if i > 0 {
            r.retry("http retry", 1);
            tokio::time::sleep(Duration::from_secs(delay)).await;
        }
        loop {
            match http.get(url).send().await {
                Ok(resp) if resp.status().is_success() => match resp.text().await {
                    Ok(t) => return Ok(t),
                    Err(e) => last = e.to_string(),
                },
                Ok(resp) => {
                    last = format!("{url}: {}", resp.status());
                    if resp.status() == 503
                        && waited_out < HTTP_503_RETRIES
                        && let Some(after) = retry_after(&resp)
                    {
                        waited_out += 1;
                        r.retry("http 503 retry-after", 1);
                        tokio::time::sleep(after).await;
                        continue;
                    }
                }
                Err(e) => last = format!("{url}: {e}"),
            }
            break;
        }
    }
    Err(last)
}

/// A response's Retry-After in seconds.
fn retry_after(resp: &reqwest::Response) -> Option<Duration> {
    let secs = resp.headers().get(reqwest::header::RETRY_AFTER)?;
    secs.to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
        .map(Duration::from_secs)
}

/// The URL an entry script chains to, with the iPXE variables it uses filled in.
fn chained(script: &str, mac: [u8; 6]) -> Option<String> {
    let line = script
        .lines()
        .find_map(|l| l.trim().strip_prefix("chain "))?;
    let url = line.split_whitespace().find(|w| w.starts_with("http://"))?;
    Some(
        url.replace("${mac:hexhyp}", &hexhyp(mac))
            // A BIOS machine's iPXE; the UUID is left out, as for a board without one.
            .replace("${uuid}", "")
            .replace("${buildarch}", "i386")
            .replace("${platform}", "pcbios"),
    )
}

#[derive(Debug, PartialEq, Eq)]
pub struct ScriptPlan {
    pub kernel: String,
    pub args: String,
    pub initrds: Vec<String>,
}

/// The first `kernel` line (URL and arguments) and every `initrd` URL, in order; retry
/// labels repeat the same lines, so each URL is taken once.
pub fn parse_script(script: &str) -> Result<ScriptPlan, String> {
    let mut kernel = None;
    let mut initrds: Vec<String> = Vec::new();
    for line in script.lines().map(str::trim) {
        let line = line.split(" && ").next().unwrap_or(line);
        if let Some(rest) = line.strip_prefix("kernel ") {
            if kernel.is_none() {
                let mut words = rest.splitn(2, ' ');
                let url = words.next().unwrap_or_default().to_string();
                let args = words.next().unwrap_or_default().trim().to_string();
                kernel = Some((url, args));
            }
        } else if let Some(rest) = line.strip_prefix("initrd ") {
            let url = rest
                .split_whitespace()
                .find(|w| w.starts_with("http://"))
                .ok_or_else(|| format!("initrd line without a URL: {line}"))?;
            if !initrds.iter().any(|u| u == url) {
                initrds.push(url.to_string());
            }
        }
    }
    let (kernel, args) = kernel.ok_or("no kernel line in the boot script")?;
    Ok(ScriptPlan {
        kernel,
        args,
        initrds,
    })
}

/// Downloads `url` whole; with `cut`, drops the connection halfway and fetches the rest
/// with a Range request, as iPXE does after an interrupted download. Returns the bytes.
async fn download(
    http: &reqwest::Client,
    url: &str,
    cut: bool,
    r: &mut NodeResult,
) -> Result<u64, String> {
    let mut have = 0u64;
    let mut total: Option<u64> = None;
    let mut cut_pending = cut;
    let mut failures = 0usize;
    loop {
        let mut req = http.get(url);
        if have > 0 {
            req = req.header(reqwest::header::RANGE, format!("bytes={have}-"));
        }
        let outcome: Result<bool, String> = async {
            let resp = req.send().await.map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            match (have, status) {
                (0, 200) => total = resp.content_length(),
                (_, 206) => {}
                _ => return Err(format!("{url}: {status} for bytes {have}-")),
            }
            let len = total.ok_or("no Content-Length")?;
            let mut stream = resp.bytes_stream();
            while let Some(chunk) = stream.next().await {
                have += chunk.map_err(|e| e.to_string())?.len() as u64;
                if cut_pending && have >= len / 2 {
                    return Ok(false); // dropped on purpose
                }
            }
            Ok(have == len)
        }
        .await;
        match outcome {
            Ok(true) => return Ok(have),
            Ok(false) if cut_pending => {
                cut_pending = false;
                r.retry("download cut and resumed", 1);
            }
            Ok(false) => return Err(format!("{url}: short body ({have} bytes)")),
            Err(e) => {
                if failures >= HTTP_RETRY_DELAYS.len() {
                    return Err(e);
                }
                r.retry("http retry", 1);
                tokio::time::sleep(Duration::from_secs(HTTP_RETRY_DELAYS[failures])).await;
                failures += 1;
            }
        }
    }
}

/// `download`, for the HTTP-phase benchmark.
pub async fn download_for_bench(
    http: &reqwest::Client,
    url: &str,
    cut: bool,
    r: &mut NodeResult,
) -> Result<u64, String> {
    download(http, url, cut, r).await
}

struct Agent<'a> {
    http: &'a reqwest::Client,
    servers: &'a Servers,
    token: String,
    boot: String,
    mac: Mac,
}

impl Agent<'_> {
    /// POSTs to /api/v1/agent/`route` until a definite answer, as the agent retries
    /// (5xx and 429 back off from 1 s to 30 s); Ok only for 200.
    async fn post<T: serde::de::DeserializeOwned>(
        &self,
        route: &str,
        body: &impl serde::Serialize,
        r: &mut NodeResult,
    ) -> Result<T, String> {
        let mut wait = Duration::from_secs(1);
        for _ in 0..8 {
            let server = self.servers.current().to_string();
            let url = format!("{server}/api/v1/agent/{route}");
            let sent = self
                .http
                .post(&url)
                .bearer_auth(&self.token)
                .json(body)
                .send()
                .await;
            match sent {
                Ok(resp) if resp.status() == 200 => {
                    return resp.json().await.map_err(|e| e.to_string());
                }
                Ok(resp) if !(resp.status().is_server_error() || resp.status() == 429) => {
                    let status = resp.status();
                    let text = resp.text().await.unwrap_or_default();
                    return Err(format!("{route}: {status}: {text}"));
                }
                Ok(resp) => {
                    // As the agent: back-off with jitter, never sooner than Retry-After.
                    let asked = retry_after(&resp);
                    let pause =
                        bootfleet_agent::run::retry_wait(wait, asked, rand::random::<f64>());
                    if resp.status().is_server_error() {
                        self.servers.failed(&server);
                    }
                    r.retry("agent retry", 1);
                    tokio::time::sleep(pause).await;
                    wait = (wait * 2).min(Duration::from_secs(30));
                    continue;
                }
                Err(_) => self.servers.failed(&server),
            }
            r.retry("agent retry", 1);
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(30));
        }
        Err(format!("{route}: no definite answer after 8 tries"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_boot_script_gives_the_kernel_its_arguments_and_each_initrd_once() {
        let script = "#!ipxe\n:kernel_try1\nkernel http://s/blobs/sha256/aa console=ttyS0 bootfleet.boot=12 && goto kernel_done ||\n\
            :kernel_try2\nkernel http://s/blobs/sha256/aa console=ttyS0 bootfleet.boot=12 && goto kernel_done ||\n\
            :initrd1_try1\ninitrd --name initrd.img http://s/blobs/sha256/bb && goto initrd1_done ||\n\
            :initrd1_try2\ninitrd --name initrd.img http://s/blobs/sha256/bb && goto initrd1_done ||\nboot ||\n";
        assert_eq!(
            parse_script(script).unwrap(),
            ScriptPlan {
                kernel: "http://s/blobs/sha256/aa".into(),
                args: "console=ttyS0 bootfleet.boot=12".into(),
                initrds: vec!["http://s/blobs/sha256/bb".into()],
            }
        );
        assert!(parse_script("#!ipxe\nboot\n").is_err());
    }

    #[test]
    fn the_entry_script_chain_gets_the_ipxe_variables_filled_in() {
        let entry = "#!ipxe\n:fetch\nchain --autofree http://s/boot/node.ipxe?mac=${mac:hexhyp}&uuid=${uuid}&arch=${buildarch}&platform=${platform} || goto failed\n";
        assert_eq!(
            chained(entry, [2, 0xbf, 0, 0, 1, 0xff]).unwrap(),
            "http://s/boot/node.ipxe?mac=02-bf-00-00-01-ff&uuid=&arch=i386&platform=pcbios"
        );
        assert_eq!(chained("#!ipxe\nkernel http://x\n", [0; 6]), None);
    }
}
