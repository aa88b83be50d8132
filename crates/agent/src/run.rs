//! The agent's conversation with the server: attest, validate, then heartbeat and carry
//! out the answer. Transient failures (no route, 5xx, 429) are retried with back-off,
//! forever: a node must never give up because the server restarted.

use std::path::PathBuf;
use std::time::Duration;

use bootfleet_api::agent::{
    AttestReport, AttestRequest, HeartbeatAnswer, HeartbeatRequest, NextAction, NodeFacts,
    TpmChallengeAnswer, TpmChallengeRequest, TpmEvidence, ValidateRequest, modules_digest,
};
use bootfleet_api::{Digest, Mac};
use serde::Serialize;
use serde_json::{Value, json};

use super::facts::{SystemFacts, collect};
use super::gpu::GpuSource;

/// The servers an agent talks to: the one its boot script came from first, then the
/// others (`bootfleet.servers=`, from `[cluster] servers`). Any of them answers any call
/// of this boot (they share one state), so a call that finds one gone or failing is
/// tried on the next: a node outlives the server that booted it.
#[derive(Debug)]
pub struct Servers {
    all: Vec<String>,
    turn: std::sync::atomic::AtomicUsize,
}

impl Servers {
    /// `first`, then `others` (each once, trailing `/` dropped).
    pub fn new(first: &str, others: &[String]) -> Self {
        let mut all = vec![first.trim_end_matches('/').to_string()];
        for o in others {
            let o = o.trim_end_matches('/');
            if !o.is_empty() && !all.iter().any(|a| a == o) {
                all.push(o.to_string());
            }
        }
        Self {
            all,
            turn: 0.into(),
        }
    }

    /// The server calls go to now.
    pub fn current(&self) -> &str {
        &self.all[self.turn.load(std::sync::atomic::Ordering::Relaxed) % self.all.len()]
    }

    /// `server` did not answer (or failed): the next call goes to the next server.
    /// Calls failing together on one server move on once, not once each.
    pub fn failed(&self, server: &str) {
        use std::sync::atomic::Ordering::Relaxed;
        let turn = self.turn.load(Relaxed);
        if self.all.len() > 1
            && self.all[turn % self.all.len()] == server
            && self
                .turn
                .compare_exchange(turn, turn + 1, Relaxed, Relaxed)
                .is_ok()
        {
            eprintln!(
                "bootfleet-agent: turning to {}",
                self.all[(turn + 1) % self.all.len()]
            );
        }
    }
}

pub struct Agent {
    pub http: reqwest::Client,
    pub servers: Servers,
    pub boot: String,
    pub token: String,
    pub mac: Mac,
    pub image: Digest,
    /// Where /proc, /sys, /etc and /dev/kmsg are read from.
    pub root: PathBuf,
    pub gpus: Box<dyn GpuSource + Send + Sync>,
    pub heartbeat_every: Duration,
    /// Run DCGM diagnostics at this level during validation.
    pub dcgm_level: Option<u64>,
    /// A compute-probe command (`sh -c`), and how long it may take.
    pub probe: Option<(String, Duration)>,
    /// Performance probes: each figure's name and its command (`sh -c`; the figure is the
    /// last number it prints), each given the compute probe's time.
    pub figures: Vec<(String, String)>,
    /// At validation, ask each InfiniBand port's peer of the fabric (`ib_peers`).
    pub ib_peers: bool,
    /// The TPM to attest with (its TCTI) and the firmware's event log; None: no TPM.
    pub tpm: Option<(String, PathBuf)>,
    /// The digest of the module list the server compares heartbeats with, as its last
    /// answer named it: while the node's list has it, heartbeats send the digest alone.
    /// None at start, so that a restarted agent sends its list once.
    pub baseline_modules: std::sync::Mutex<Option<Digest>>,
}

/// How the conversation ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The server asked for a reboot (a reimage).
    Reboot,
    /// `--once`: one heartbeat was answered.
    Done,
}

const FIRST_RETRY: Duration = Duration::from_secs(1);
const MAX_RETRY: Duration = Duration::from_secs(30);

/// A 503's or 429's Retry-After in seconds (the HTTP-date form is not sent by bootfleet).
fn retry_after(r: &reqwest::Response) -> Option<Duration> {
    let secs = r
        .headers()
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?;
    secs.trim().parse().ok().map(Duration::from_secs)
}

/// The pause before a retry, spread by `jitter` (0 to 1) so that nodes refused together
/// (a storm past the server's write queue) do not come back together: the back-off, from
/// half to one and a half times it; and never sooner than a Retry-After the server sent
/// (from it to one and a half times it).
pub fn retry_wait(backoff: Duration, asked: Option<Duration>, jitter: f64) -> Duration {
    let jitter = jitter.clamp(0.0, 1.0);
    let spread = backoff.mul_f64(0.5 + jitter);
    match asked {
        Some(asked) => spread.max(asked.mul_f64(1.0 + jitter / 2.0)),
        None => spread,
    }
}

/// A number from 0 to 1, different each call and each process: std's hasher keys are
/// random per process, and a counter makes each call's input new. Not for secrets.
fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    static KEYS: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    let mut h = KEYS.get_or_init(Default::default).build_hasher();
    h.write_u64(CALLS.fetch_add(1, Ordering::Relaxed));
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

impl Agent {
    /// POSTs `body` to `route` until the server gives a definite answer.
    async fn post(&self, route: &str, body: &impl Serialize) -> (u16, Value) {
        let mut wait = FIRST_RETRY;
        loop {
            let server = self.servers.current().to_string();
            let url = format!("{server}{route}");
            let sent = self
                .http
                .post(&url)
                .bearer_auth(&self.token)
                .json(body)
                .send()
                .await;
            match sent {
                Ok(r) if !(r.status().is_server_error() || r.status().as_u16() == 429) => {
                    let status = r.status().as_u16();
                    let text = r.text().await.unwrap_or_default();
                    return (
                        status,
                        serde_json::from_str(&text).unwrap_or(Value::String(text)),
                    );
                }
                Ok(r) => {
                    let asked = retry_after(&r);
                    let pause = retry_wait(wait, asked, jitter());
                    eprintln!(
                        "bootfleet-agent: {route}: server answered {}; retrying in {pause:?}",
                        r.status()
                    );
                    // A failing server (5xx: its store gone, its queue full) is left for
                    // the next, which shares its state; a 429 is this node's own pace.
                    if r.status().is_server_error() {
                        self.servers.failed(&server);
                    }
                    tokio::time::sleep(pause).await;
                }
                Err(e) => {
                    let pause = retry_wait(wait, None, jitter());
                    eprintln!("bootfleet-agent: {route}: {e}; retrying in {pause:?}");
                    self.servers.failed(&server);
                    tokio::time::sleep(pause).await;
                }
            }
            wait = (wait * 2).min(MAX_RETRY);
        }
    }

    fn facts(&self) -> SystemFacts {
        collect(&self.root)
    }

    fn say(step: &str, status: u16, answer: &Value) {
        println!(
            "{}",
            json!({ "step": step, "status": status, "answer": answer })
        );
    }

    /// Ok(passed): a failed verdict is not an error here, since the node stays in touch
    /// (heartbeats) for the server to order its reboot.
    pub async fn attest(&self) -> Result<bool, String> {
        // The dm table is the kernel's, not a file under `root`: read only on a real node.
        let verity = if self.root == std::path::Path::new("/") {
            super::stage1::root::booted_root_hash()
        } else {
            None
        };
        self.attest_with(verity, None).await
    }

    /// This node's overlay (a tar the server renders for it), retried like every call.
    pub async fn overlay(&self) -> Result<Vec<u8>, String> {
        let mut wait = FIRST_RETRY;
        for _ in 0..8 {
            let server = self.servers.current().to_string();
            let url = format!("{server}/boot/overlay?boot={}", self.boot);
            match self.http.get(&url).bearer_auth(&self.token).send().await {
                Ok(r) if r.status().is_success() => {
                    let bytes = r.bytes().await.map_err(|e| e.to_string())?;
                    if bytes.len() as u64 > super::stage1::overlay::MAX_OVERLAY_BYTES {
                        return Err(format!(
                            "the overlay is {} bytes, over the limit",
                            bytes.len()
                        ));
                    }
                    return Ok(bytes.to_vec());
                }
                Ok(r) if r.status().is_client_error() && r.status() != 429 => {
                    let status = r.status();
                    let text = r.text().await.unwrap_or_default();
                    return Err(format!("refused ({status}): {text}"));
                }
                Ok(r) => {
                    eprintln!("bootfleet-agent: overlay: {}; retrying", r.status());
                    self.servers.failed(&server);
                }
                Err(e) => {
                    eprintln!("bootfleet-agent: overlay: {e}; retrying");
                    self.servers.failed(&server);
                }
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(MAX_RETRY);
        }
        Err("the server did not answer".into())
    }

    /// Stage 1 could not bring the root up: the boot fails attestation with `why`, so
    /// the server sees where it stopped and applies its failure policy.
    pub async fn attest_stage1_failure(&self, why: String) -> Result<bool, String> {
        self.attest_with(None, Some(why)).await
    }

    async fn attest_with(
        &self,
        verity_root_hash: Option<String>,
        stage1_failure: Option<String>,
    ) -> Result<bool, String> {
        let f = self.facts();
        let stage1_failure_free = stage1_failure.is_none();
        let body = AttestRequest {
            boot_id: self.boot.clone(),
            mac: self.mac,
            report: AttestReport {
                image_digest: self.image,
                kernel_release: f.kernel_release,
                cmdline: f.cmdline,
                versions: f.versions,
                artifacts: Vec::new(),
                modules: f.modules,
                verity_root_hash,
                stage1_failure,
            },
            tpm: match stage1_failure_free {
                true => self.tpm_evidence().await,
                false => None,
            },
        };
        let (status, answer) = self.post("/api/v1/agent/attest", &body).await;
        Self::say("attest", status, &answer);
        // A retry (the agent restarted, an answer was lost) gets the stored verdict with
        // 200; 409 means this boot is not the node's newest or cannot be judged now.
        match status {
            200 => Ok(answer["passed"] == true),
            _ => Err(format!("attestation refused ({status}): {answer}")),
        }
    }

    /// The TPM's answer to this boot's challenge, or None (logged) when there is no TPM
    /// or it could not answer: the server's policy decides what a boot without evidence
    /// is worth.
    async fn tpm_evidence(&self) -> Option<TpmEvidence> {
        let (tcti, log) = self.tpm.clone()?;
        let started = std::time::Instant::now();
        let result = self.tpm_conversation(tcti, log).await;
        match result {
            Ok(evidence) => {
                eprintln!(
                    "bootfleet-agent: tpm: quoted in {} ms",
                    started.elapsed().as_millis()
                );
                Some(evidence)
            }
            Err(why) => {
                eprintln!("bootfleet-agent: tpm: {why}; attesting without TPM evidence");
                None
            }
        }
    }

    async fn tpm_conversation(&self, tcti: String, log: PathBuf) -> Result<TpmEvidence, String> {
        use super::tpm::Tpm;
        let tpm = std::sync::Arc::new(Tpm::new(&tcti, &std::env::temp_dir())?);
        let t = tpm.clone();
        let keys = tokio::task::spawn_blocking(move || t.keys())
            .await
            .map_err(|e| e.to_string())??;
        let ask = TpmChallengeRequest {
            boot_id: self.boot.clone(),
            mac: self.mac,
            ek_public: hex::encode(&keys.ek_public),
            ek_certificate: keys.ek_certificate.as_deref().map(hex::encode),
            ak_public: hex::encode(&keys.ak_public),
        };
        let (status, answer) = self.post("/api/v1/agent/tpm/challenge", &ask).await;
        if status != 200 {
            return Err(format!("challenge refused ({status}): {answer}"));
        }
        let challenge: TpmChallengeAnswer =
            serde_json::from_value(answer).map_err(|e| format!("challenge: {e}"))?;
        let credential = hex::decode(&challenge.credential)
            .map_err(|e| format!("challenge: credential is not hex: {e}"))?;
        let t = tpm.clone();
        let secret = tokio::task::spawn_blocking(move || t.activate(&credential))
            .await
            .map_err(|e| e.to_string())??;
        let nonce = bootfleet_api::agent::tpm_nonce(&secret, &self.boot);
        let t = tpm.clone();
        let pcrs = challenge.pcrs.clone();
        let quote = tokio::task::spawn_blocking(move || t.quote(&nonce, &pcrs))
            .await
            .map_err(|e| e.to_string())??;
        let event_log = std::fs::read(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        Ok(TpmEvidence {
            secret: hex::encode(&secret),
            attest: hex::encode(&quote.attest),
            signature: hex::encode(&quote.signature),
            pcrs: quote
                .pcrs
                .iter()
                .map(|(i, v)| (*i, hex::encode(v)))
                .collect(),
            event_log: hex::encode(&event_log),
        })
    }

    pub async fn validate(&self) -> Result<(), String> {
        let mut report = self.gpus.read();
        report.xids.extend(super::xid::from_kernel_log(&self.root));
        if let Some(level) = self.dcgm_level
            && report.dcgm.is_none()
        {
            report.dcgm = Some(super::checks::dcgm(level).await);
        }
        if let Some((command, timeout)) = &self.probe {
            report
                .checks
                .push(super::checks::probe(command, *timeout).await);
        }
        report.ib_ports = super::facts::ib_samples(&self.root);
        super::facts::ib_node_guids(&self.root, &mut report.ib_ports);
        if self.ib_peers {
            super::ib_peers::query(&mut report.ib_ports).await;
        }
        let timeout = self
            .probe
            .as_ref()
            .map_or(Duration::from_secs(300), |p| p.1);
        for (name, command) in &self.figures {
            match super::checks::figure(name, command, timeout).await {
                Ok(f) => report.figures.push(f),
                Err(failed) => report.checks.push(failed),
            }
        }
        if report.driver_version.is_none() {
            report.driver_version = self.facts().versions.get("nvidia-driver").cloned();
        }
        let (nvml_error, gpus) = (report.nvml_error.clone(), report.gpus.len());
        let body = ValidateRequest {
            boot_id: self.boot.clone(),
            mac: self.mac,
            report,
        };
        let (status, answer) = self.post("/api/v1/agent/validate", &body).await;
        println!(
            "{}",
            json!({ "step": "validate", "status": status, "answer": answer, "gpus": gpus, "nvml_error": nvml_error })
        );
        // A failed validation is the server's to act on (reimage or quarantine): the
        // report was delivered. 409 (the node is being reimaged, say) is not a reason to
        // stop: the heartbeats that follow carry the server's orders.
        match status {
            200 | 409 => Ok(()),
            _ => Err(format!("validation refused ({status}): {answer}")),
        }
    }

    pub async fn heartbeat(&self) -> Result<NextAction, String> {
        let mut f = self.facts();
        // The list's digest alone while it is the baseline's the last answer named.
        let modules_sha256 = modules_digest(&f.modules);
        let unchanged =
            *self.baseline_modules.lock().expect("not poisoned") == Some(modules_sha256);
        if unchanged {
            f.modules.clear();
        }
        let readings = self.gpus.read();
        let xids = super::xid::from_kernel_log(&self.root);
        let samples = super::gpu::samples(&readings.gpus, &xids);
        let gpus: Vec<String> = readings.gpus.into_iter().map(|g| g.uuid).collect();
        let body = HeartbeatRequest {
            boot_id: self.boot.clone(),
            mac: self.mac,
            facts: Some(NodeFacts {
                kernel_release: Some(f.kernel_release),
                cmdline: Some(f.cmdline),
                versions: f.versions,
                modules: f.modules,
                modules_sha256: unchanged.then_some(modules_sha256),
                gpus: Some(gpus),
            }),
            gpus: samples,
            ib_ports: super::facts::ib_samples(&self.root),
        };
        let (status, answer) = self.post("/api/v1/agent/heartbeat", &body).await;
        let sent = if unchanged {
            "modules digest"
        } else {
            "modules"
        };
        println!(
            "{}",
            json!({ "step": "heartbeat", "status": status, "answer": answer, "sent": sent })
        );
        if status != 200 {
            return Err(format!("heartbeat refused ({status}): {answer}"));
        }
        let answer = serde_json::from_value::<HeartbeatAnswer>(answer.clone())
            .map_err(|e| format!("heartbeat answer {answer}: {e}"))?;
        *self.baseline_modules.lock().expect("not poisoned") = answer.baseline_modules_sha256;
        Ok(answer.action)
    }

    /// Attest, validate, then heartbeat until the server says reboot (or once).
    pub async fn run(&self, once: bool) -> Result<Outcome, String> {
        if self.attest().await? {
            self.validate().await?;
        } else {
            eprintln!("bootfleet-agent: attestation failed; waiting for the server's orders");
        }
        loop {
            match self.heartbeat().await? {
                NextAction::Reboot => return Ok(Outcome::Reboot),
                NextAction::Revalidate => self.validate().await?,
                NextAction::None => {}
            }
            if once {
                return Ok(Outcome::Done);
            }
            tokio::time::sleep(self.heartbeat_every).await;
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_failed_server_hands_the_next_call_to_the_next() {
        let servers = Servers::new(
            "http://a:8080/",
            &["http://a:8080".into(), "http://b:8080".into(), "".into()],
        );
        assert_eq!(servers.current(), "http://a:8080");
        servers.failed("http://a:8080");
        assert_eq!(servers.current(), "http://b:8080");
        // A late failure of the one already left does not skip the next.
        servers.failed("http://a:8080");
        assert_eq!(servers.current(), "http://b:8080");
        servers.failed("http://b:8080");
        assert_eq!(servers.current(), "http://a:8080", "round and round");
        let alone = Servers::new("http://a:8080", &[]);
        alone.failed("http://a:8080");
        assert_eq!(alone.current(), "http://a:8080");
    }

    use super::*;

    #[test]
    fn a_retry_waits_for_what_the_server_asked_spread_by_jitter() {
        let s = Duration::from_secs;
        // The back-off alone, from half to one and a half of it.
        assert_eq!(retry_wait(s(4), None, 0.0), s(2));
        assert_eq!(retry_wait(s(4), None, 1.0), s(6));
        // Never sooner than Retry-After, spread above it; a short one does not cut
        // the back-off.
        assert_eq!(retry_wait(s(1), Some(s(10)), 0.0), s(10));
        assert_eq!(retry_wait(s(1), Some(s(10)), 1.0), s(15));
        assert_eq!(retry_wait(s(8), Some(s(1)), 0.5), s(8));
        assert_eq!(retry_wait(s(8), Some(s(1)), 0.0), s(4));
    }

    #[test]
    fn jitter_spreads_over_zero_to_one() {
        let draws: Vec<f64> = (0..1000).map(|_| jitter()).collect();
        assert!(draws.iter().all(|j| (0.0..1.0).contains(j)));
        let low = draws.iter().filter(|j| **j < 0.5).count();
        assert!((350..650).contains(&low), "{low} of 1000 below 0.5");
    }
}
