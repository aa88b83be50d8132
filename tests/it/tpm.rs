//! TPM-rooted attestation against real TPMs: swtpm, manufactured with an EK certificate
//! from its local CA, driven through tpm2-tools by the real agent (or by the agent's TPM
//! module, where a test must misbehave); the firmware's event log written by the test
//! and extended into the TPM's PCRs as OVMF would; the server's verdicts.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};

use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

use crate::agent::{booted, node_root, readings_file, run_agent_with};
use crate::fake_node::{FakeNode, healthy};
use crate::harness::*;
use bootfleet::tpm::eventlog::{self, kind};

const TOOLS: &str = "apt-get install swtpm swtpm-tools tpm2-tools";

fn require() {
    for tool in [
        "swtpm",
        "swtpm_setup",
        "swtpm_localca",
        "tpm2_createek",
        "tpm2_quote",
    ] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(found, "{tool} is missing: {TOOLS}");
    }
}

/// A local CA that manufactures TPMs (swtpm_localca's state: a root and an
/// intermediate), in its own directory.
pub(crate) struct Ca(tempfile::TempDir);

impl Ca {
    pub(crate) fn new() -> Self {
        Ca(tempfile::tempdir().unwrap())
    }
    /// The PEM files an operator would list in `[tpm] ek_ca_files`. Made with the first
    /// TPM.
    pub(crate) fn files(&self) -> Vec<PathBuf> {
        let d = self.0.path();
        vec![
            d.join("swtpm-localca-rootca-cert.pem"),
            d.join("issuercert.pem"),
        ]
    }
}

/// One software TPM 2.0, listening on a Unix socket; killed on drop.
pub(crate) struct Swtpm {
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Swtpm {
    /// Manufactures a TPM (RSA EK, its certificate signed by `ca`) and powers it on.
    pub(crate) fn new(ca: &Ca) -> Self {
        require();
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let cfg = d.join("cfg");
        std::fs::create_dir_all(cfg.join("state")).unwrap();
        let localca = cfg.join("swtpm-localca.conf");
        let c = ca.0.path().display();
        std::fs::write(
            &localca,
            format!(
                "statedir = {c}\nsigningkey = {c}/signkey.pem\nissuercert = {c}/issuercert.pem\ncertserial = {c}/certserial\n"
            ),
        )
        .unwrap();
        let options = cfg.join("swtpm-localca.options");
        std::fs::write(
            &options,
            "--platform-manufacturer bootfleet\n--platform-version 2.1\n--platform-model QEMU\n",
        )
        .unwrap();
        let setup = cfg.join("swtpm_setup.conf");
        std::fs::write(
            &setup,
            format!(
                "create_certs_tool = /usr/bin/swtpm_localca\ncreate_certs_tool_config = {}\ncreate_certs_tool_options = {}\n",
                localca.display(),
                options.display()
            ),
        )
        .unwrap();
        // XDG_CONFIG_HOME: swtpm's tools read nothing of this machine's configuration.
        let out = Command::new("swtpm_setup")
            .args([
                "--tpm2",
                "--create-ek-cert",
                "--lock-nvram",
                "--pcr-banks",
                "sha256",
            ])
            .arg("--tpmstate")
            .arg(cfg.join("state"))
            .arg("--config")
            .arg(&setup)
            .env("XDG_CONFIG_HOME", &cfg)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "swtpm_setup: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let mut tpm = Swtpm { dir, child: None };
        tpm.power_on();
        tpm
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("sock")
    }

    /// tpm2-tools' way to reach it (its control socket is `<socket>.ctrl`).
    fn tcti(&self) -> String {
        format!("swtpm:path={}", self.socket().display())
    }

    /// Powers the TPM off (losing power: no TPM2_Shutdown) and on again as a QEMU
    /// machine's TPM: its control socket only, started by the firmware. Returns QEMU's
    /// arguments for it (a TIS TPM).
    pub(crate) fn for_qemu(&mut self) -> Vec<String> {
        let ctrl = self.dir.path().join("qemu-ctrl.sock");
        self.start(&[], &ctrl, None);
        [
            "-chardev",
            &format!("socket,id=chrtpm,path={}", ctrl.display()),
            "-tpmdev",
            "emulator,id=tpm0,chardev=chrtpm",
            "-device",
            "tpm-tis,tpmdev=tpm0",
        ]
        .map(String::from)
        .to_vec()
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Powered on for tpm2-tools: its command socket and control socket, started.
    fn power_on(&mut self) {
        let sock = self.socket();
        let ctrl = PathBuf::from(format!("{}.ctrl", sock.display()));
        self.start(&["--flags", "startup-clear"], &ctrl, Some(&sock));
    }

    /// (Re)starts swtpm on its state with a control socket at `ctrl` and, for tools, a
    /// command socket at `server`; waits until they are open.
    fn start(&mut self, flags: &[&str], ctrl: &Path, server: Option<&Path>) {
        self.stop();
        for path in std::iter::once(ctrl).chain(server) {
            let _ = std::fs::remove_file(path);
        }
        let mut cmd = Command::new("swtpm");
        cmd.args(["socket", "--tpm2"]).args(flags);
        cmd.arg("--tpmstate").arg(format!(
            "dir={}",
            self.dir.path().join("cfg/state").display()
        ));
        if let Some(server) = server {
            cmd.arg("--server")
                .arg(format!("type=unixio,path={}", server.display()));
        }
        cmd.arg("--ctrl")
            .arg(format!("type=unixio,path={}", ctrl.display()));
        self.child = Some(cmd.spawn().expect("swtpm starts"));
        for _ in 0..200 {
            if ctrl.exists() && server.is_none_or(Path::exists) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("swtpm did not open {}", ctrl.display());
    }

    /// A reboot: the TPM restarts with cleared PCRs, then the firmware measures `log`.
    /// The OS shuts the TPM down first, as a clean reboot does: a TPM that loses power
    /// without TPM2_Shutdown counts it against its dictionary-attack lockout.
    fn boot(&mut self, log: &[Measured]) {
        self.tool("tpm2_shutdown", &[]);
        self.power_on();
        for (pcr, kind, digest, _) in log {
            if *kind != kind::NO_ACTION {
                self.tool(
                    "tpm2_pcrextend",
                    &[&format!("{pcr}:sha256={}", hex::encode(digest))],
                );
            }
        }
    }

    /// Runs a tpm2-tools command against this TPM; it must succeed.
    fn tool(&self, tool: &str, args: &[&str]) {
        let out = Command::new(tool)
            .args(args)
            .env("TPM2TOOLS_TCTI", self.tcti())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{tool}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Swtpm {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One event of a firmware log: PCR, type, SHA-256 digest, data.
type Measured = (u32, u32, [u8; 32], Vec<u8>);

fn sha256(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

/// What OVMF logs for a network boot of iPXE then a kernel (the shape a real OVMF boot
/// here logged: separators in PCRs 0-7, the boot option's action and iPXE then the
/// kernel twice in PCR 4, the Linux stub's load options in PCR 9).
fn ovmf_log(ipxe: [u8; 32], kernel: [u8; 32]) -> Vec<Measured> {
    const EV_S_CRTM_VERSION: u32 = 0x8;
    const EV_EVENT_TAG: u32 = 0x6;
    let separator = || (sha256(&[0; 4]), vec![0u8; 4]);
    let mut log: Vec<Measured> = vec![(0, EV_S_CRTM_VERSION, sha256(b"OVMF"), b"OVMF".to_vec())];
    let action = b"Calling EFI Application from Boot Option".to_vec();
    log.push((4, kind::EFI_ACTION, sha256(&action), action));
    for pcr in 0..8 {
        let (d, data) = separator();
        log.push((pcr, kind::SEPARATOR, d, data));
    }
    for app in [ipxe, kernel, kernel] {
        log.push((
            4,
            kind::EFI_BOOT_SERVICES_APPLICATION,
            app,
            b"image load event".to_vec(),
        ));
    }
    log.push((
        9,
        EV_EVENT_TAG,
        sha256(b"vmlinuz console=ttyS0"),
        b"LOADED_IMAGE::LoadOptions".to_vec(),
    ));
    log
}

fn log_bytes(log: &[Measured]) -> Vec<u8> {
    let events: Vec<(u32, u32, [u8; 32], &[u8])> = log
        .iter()
        .map(|(p, k, d, data)| (*p, *k, *d, data.as_slice()))
        .collect();
    eventlog::write(&events)
}

/// A PE image that is not one of the iPXE binaries: iPXE's own with its last byte
/// changed (still a valid PE, another Authenticode digest), standing in for a kernel
/// with an EFI stub.
fn pe_kernel(variant: u8) -> Vec<u8> {
    let mut pe = std::fs::read("/usr/lib/ipxe/ipxe.efi").expect("iPXE: apt-get install ipxe");
    *pe.last_mut().unwrap() ^= variant;
    pe
}

pub(crate) fn authenticode(pe: &[u8]) -> [u8; 32] {
    bootfleet::tpm::authenticode_sha256(pe).unwrap()
}

fn snponly() -> [u8; 32] {
    authenticode(&std::fs::read("/usr/lib/ipxe/snponly.efi").expect("iPXE: apt-get install ipxe"))
}

async fn tpm_server(ca: &Ca) -> TestServer {
    let files = ca.files();
    TestServer::start_configured(move |cfg| {
        cfg.lifecycle.validation_reimages = 0;
        cfg.boots.burst = 20; // one node reboots often here
        cfg.tpm.policy = bootfleet::tpm::TpmPolicy::Required;
        cfg.tpm.ek_ca_files = files;
        cfg.ipxe_dir = "/usr/lib/ipxe".into();
    })
    .await
}

/// The attestation verdict the agent printed.
fn attest_answer(out: &str) -> Value {
    out.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["step"] == "attest")
        .unwrap_or_else(|| panic!("no attest step in:\n{out}"))["answer"]
        .clone()
}

#[tokio::test]
async fn an_agent_quotes_with_its_tpm_and_a_kernel_not_the_images_fails_naming_pcr_4() {
    let ca = Ca::new();
    let mut tpm = Swtpm::new(&ca);
    let server = tpm_server(&ca).await;
    let kernel = pe_kernel(1);
    server
        .publish_query(good_bundle("hgx", "1", &kernel), "?tag=hgx:stable")
        .await;
    let mac = "52-54-00-70-00-01";
    let agent_with = |tpm: &Swtpm, log: &Path| {
        vec![
            "--tpm-tcti".to_string(),
            tpm.tcti(),
            "--tpm-event-log".into(),
            log.display().to_string(),
        ]
    };

    // 1. The boot the image names: iPXE, then its kernel. Attested, ready; the node's
    // page shows the quoted PCRs and what each measurement matched.
    let (node, boot) = booted(&server, mac, "hgx:stable").await;
    let root = node_root(&boot, "");
    let log = ovmf_log(snponly(), authenticode(&kernel));
    tpm.boot(&log);
    let log_file = root.path().join("eventlog");
    std::fs::write(&log_file, log_bytes(&log)).unwrap();
    let readings = readings_file(root.path(), &healthy());
    let args = agent_with(&tpm, &log_file);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out) = run_agent_with(root.path(), Some(&readings), &args, &[]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(attest_answer(&out)["passed"], true, "{out}");
    assert_eq!(node.state().await, "ready", "{out}");
    let detail = node.node().await;
    let findings = &detail["boots"][0]["tpm"];
    assert_eq!(findings["pcrs"].as_object().unwrap().len(), 9, "{findings}");
    let matched: Vec<&str> = findings["measurements"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["matched"].as_str().unwrap_or("(none)"))
        .collect();
    assert_eq!(
        matched,
        ["snponly.efi", "kernel vmlinuz", "kernel vmlinuz"],
        "{findings}"
    );
    let (_, events) = server.json("/api/v1/events?since=0&limit=1000").await;
    let enrolled: Vec<&Value> = events["events"]
        .as_array()
        .map(|e| e.iter().filter(|e| e["kind"] == "tpm.enrolled").collect())
        .unwrap_or_default();
    assert_eq!(enrolled.len(), 1, "{events}");
    assert_eq!(enrolled[0]["data"]["certified"], true, "{events}");

    // 2. The same node boots another kernel (the firmware measured it: the TPM says
    // so), while its agent reports exactly the expected facts: attestation fails naming
    // PCR 4 and the digest.
    let other = authenticode(&pe_kernel(2));
    let (node, boot) = booted(&server, mac, "hgx:stable").await;
    let root = node_root(&boot, "");
    let log = ovmf_log(snponly(), other);
    tpm.boot(&log);
    let log_file = root.path().join("eventlog");
    std::fs::write(&log_file, log_bytes(&log)).unwrap();
    let args = agent_with(&tpm, &log_file);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_, out) = run_agent_with(root.path(), None, &args, &[]).await;
    let verdict = attest_answer(&out);
    assert_eq!(verdict["passed"], false, "{out}");
    let pcr4 = verdict["mismatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["field"] == "tpm.pcr4")
        .unwrap_or_else(|| panic!("no PCR 4 mismatch: {verdict}"));
    assert!(
        pcr4["found"]
            .as_str()
            .unwrap()
            .contains(&hex::encode(other)),
        "{pcr4}"
    );
    assert_eq!(node.state().await, "attestation-failed");
    let timeline = &node.node().await["boots"][0];
    assert_eq!(timeline["stopped_at"], "attested", "{timeline}");
    assert!(
        timeline["tpm"]["measurements"][1]["matched"].is_null(),
        "{timeline}"
    );

    // 3. The TPM measured the other kernel, and the log the agent sends is forged to show
    // the image's: it does not replay to the quoted PCR 4.
    let (_, boot) = booted(&server, mac, "hgx:stable").await;
    let root = node_root(&boot, "");
    tpm.boot(&ovmf_log(snponly(), other));
    let forged = root.path().join("eventlog");
    std::fs::write(
        &forged,
        log_bytes(&ovmf_log(snponly(), authenticode(&kernel))),
    )
    .unwrap();
    let args = agent_with(&tpm, &forged);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_, out) = run_agent_with(root.path(), None, &args, &[]).await;
    let verdict = attest_answer(&out);
    assert_eq!(verdict["passed"], false, "{out}");
    let fields: Vec<&str> = verdict["mismatches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, ["tpm.pcr4"], "{verdict}");
    assert!(
        verdict["mismatches"][0]["found"]
            .as_str()
            .unwrap()
            .starts_with("the event log replays to"),
        "{verdict}"
    );
    server.stop().await;
}

/// A node's TPM conversation done by hand, so that a test can change one part.
struct Conversation<'a> {
    node: &'a FakeNode<'a>,
    boot: crate::fake_node::Boot,
}

impl Conversation<'_> {
    async fn challenge(&self, tpm: &bootfleet_agent::tpm::Tpm) -> (u16, Value) {
        self.challenge_with(&tpm.keys().unwrap()).await
    }

    /// A challenge for keys made before (the same AK again).
    async fn challenge_with(&self, keys: &bootfleet_agent::tpm::Keys) -> (u16, Value) {
        let body = json!({
            "boot_id": self.boot.id,
            "mac": self.node.colons(),
            "ek_public": hex::encode(&keys.ek_public),
            "ek_certificate": keys.ek_certificate.as_deref().map(hex::encode),
            "ak_public": hex::encode(&keys.ak_public),
        });
        self.node
            .agent_post("/api/v1/agent/tpm/challenge", &self.boot.token, body)
            .await
    }

    /// Opens the credential, quotes with `quoter`'s AK: the evidence.
    fn evidence(
        &self,
        tpm: &bootfleet_agent::tpm::Tpm,
        quoter: &bootfleet_agent::tpm::Tpm,
        answer: &Value,
        log: &[u8],
    ) -> (Vec<u8>, Value) {
        let credential = hex::decode(answer["credential"].as_str().unwrap()).unwrap();
        let secret = tpm.activate(&credential).unwrap();
        let nonce = bootfleet::api::agent::tpm_nonce(&secret, &self.boot.id);
        let quote = quoter
            .quote(&nonce, &bootfleet::tpm::verify::QUOTED_PCRS)
            .unwrap();
        (
            secret.clone(),
            json!({
                "secret": hex::encode(&secret),
                "attest": hex::encode(&quote.attest),
                "signature": hex::encode(&quote.signature),
                "pcrs": quote.pcrs.iter().map(|(i, v)| (i.to_string(), json!(hex::encode(v)))).collect::<serde_json::Map<String, Value>>(),
                "event_log": hex::encode(log),
            }),
        )
    }

    async fn attest(&self, image: &Value, tpm: Option<Value>) -> Value {
        let artifacts = self.node.fetch_all(&self.boot).await;
        let mut body = json!({
            "boot_id": self.boot.id,
            "mac": self.node.colons(),
            "report": self.node.report(&self.boot, image, &artifacts),
        });
        if let Some(t) = tpm {
            body["tpm"] = t;
        }
        let (status, verdict) = self
            .node
            .agent_post("/api/v1/agent/attest", &self.boot.token, body)
            .await;
        assert_eq!(status, 200, "{verdict}");
        verdict
    }
}

fn fields(verdict: &Value) -> Vec<String> {
    verdict["mismatches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["field"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn replayed_quotes_other_tpms_and_foreign_eks_are_refused() {
    let ca = Ca::new();
    let mut a = Swtpm::new(&ca);
    let mut b = Swtpm::new(&ca);
    let other_ca = Ca::new();
    let c = Swtpm::new(&other_ca);
    let server = tpm_server(&ca).await;
    let kernel = pe_kernel(1);
    let (_, image) = server
        .publish_query(good_bundle("hgx", "1", &kernel), "?tag=hgx:stable")
        .await;
    let log = ovmf_log(snponly(), authenticode(&kernel));
    let log_bytes = log_bytes(&log);
    let work = tempfile::tempdir().unwrap();
    let tpm_a = bootfleet_agent::tpm::Tpm::new(&a.tcti(), &work.path().join("a")).unwrap();
    let tpm_b = bootfleet_agent::tpm::Tpm::new(&b.tcti(), &work.path().join("b")).unwrap();
    let tpm_c = bootfleet_agent::tpm::Tpm::new(&c.tcti(), &work.path().join("c")).unwrap();

    // A good boot with TPM A enrols it; its evidence is kept for a replay.
    let (node, boot) = booted(&server, "52-54-00-70-01-01", "hgx:stable").await;
    let conv = Conversation { node: &node, boot };
    a.boot(&log);
    let (status, answer) = conv.challenge(&tpm_a).await;
    assert_eq!(status, 200, "{answer}");
    let (_, old) = conv.evidence(&tpm_a, &tpm_a, &answer, &log_bytes);
    let verdict = conv.attest(&image, Some(old.clone())).await;
    assert_eq!(verdict["passed"], true, "{verdict}");

    // Next boot: the old quote with this boot's secret: signed by the old boot's AK,
    // not the one this boot's credential was made for.
    let boot = node.boot().await;
    let conv = Conversation { node: &node, boot };
    a.boot(&log);
    let (_, answer) = conv.challenge(&tpm_a).await;
    let (secret, _) = conv.evidence(&tpm_a, &tpm_a, &answer, &log_bytes);
    let mut replay = old.clone();
    replay["secret"] = json!(hex::encode(&secret));
    let verdict = conv.attest(&image, Some(replay)).await;
    assert_eq!(fields(&verdict), ["tpm.quote"], "{verdict}");

    // Next boot, one AK: a quote answering the boot's first challenge, sent after a
    // second challenge replaced it: the same AK's signature, a stale nonce.
    let boot = node.boot().await;
    let conv = Conversation { node: &node, boot };
    a.boot(&log);
    let keys = tpm_a.keys().unwrap();
    let (_, first) = conv.challenge_with(&keys).await;
    let (_, stale) = conv.evidence(&tpm_a, &tpm_a, &first, &log_bytes);
    let (_, second) = conv.challenge_with(&keys).await;
    let credential = hex::decode(second["credential"].as_str().unwrap()).unwrap();
    let secret = tpm_a.activate(&credential).unwrap();
    let mut replay = stale;
    replay["secret"] = json!(hex::encode(&secret));
    let verdict = conv.attest(&image, Some(replay)).await;
    assert_eq!(fields(&verdict), ["tpm.nonce"], "{verdict}");

    // Next boot: the old evidence whole: its secret is not this boot's credential's.
    let boot = node.boot().await;
    let conv = Conversation { node: &node, boot };
    let (_, answer) = conv.challenge(&tpm_a).await;
    assert!(answer["credential"].is_string());
    let verdict = conv.attest(&image, Some(old)).await;
    assert_eq!(fields(&verdict), ["tpm.secret"], "{verdict}");

    // Next boot: A opens the credential, TPM B quotes (the same PCRs, the right nonce):
    // not signed by the AK the credential was made for.
    let boot = node.boot().await;
    let conv = Conversation { node: &node, boot };
    a.boot(&log);
    b.boot(&log);
    tpm_b.keys().unwrap(); // B's own AK, to quote with
    let (_, answer) = conv.challenge(&tpm_a).await;
    let (_, evidence) = conv.evidence(&tpm_a, &tpm_b, &answer, &log_bytes);
    let verdict = conv.attest(&image, Some(evidence)).await;
    assert_eq!(fields(&verdict), ["tpm.quote"], "{verdict}");

    // TPM B in the enrolled node: another EK than the enrolled one, refused (403) with
    // an event saying why.
    let boot = node.boot().await;
    let conv = Conversation { node: &node, boot };
    let (status, answer) = conv.challenge(&tpm_b).await;
    assert_eq!(status, 403, "{answer}");
    assert!(answer.to_string().contains("enrolled with EK"), "{answer}");
    // Without evidence, the required policy fails the boot.
    let verdict = conv.attest(&image, None).await;
    assert_eq!(fields(&verdict), ["tpm"], "{verdict}");

    // TPM C, made by a CA the server does not trust: its EK certificate is refused.
    let (node_c, boot) = booted(&server, "52-54-00-70-01-02", "hgx:stable").await;
    let conv = Conversation {
        node: &node_c,
        boot,
    };
    let (status, answer) = conv.challenge(&tpm_c).await;
    assert_eq!(status, 403, "{answer}");
    assert!(answer.to_string().contains("does not chain"), "{answer}");

    // An AK that is not a restricted signing key (the EK offered as one) is refused.
    let (node_d, boot) = booted(&server, "52-54-00-70-01-03", "hgx:stable").await;
    let conv = Conversation {
        node: &node_d,
        boot,
    };
    let keys = tpm_b.keys().unwrap();
    let body = json!({
        "boot_id": conv.boot.id, "mac": node_d.colons(),
        "ek_public": hex::encode(&keys.ek_public),
        "ek_certificate": keys.ek_certificate.map(hex::encode),
        "ak_public": hex::encode(&keys.ek_public),
    });
    let (status, answer) = node_d
        .agent_post("/api/v1/agent/tpm/challenge", &conv.boot.token, body)
        .await;
    assert_eq!(status, 403, "{answer}");
    assert!(answer.to_string().contains("AK"), "{answer}");

    // A node labelled tpm=off attests without evidence.
    server.label("52:54:00:70:01:03", "tpm", "off").await;
    let verdict = conv.attest(&image, None).await;
    assert_eq!(verdict["passed"], true, "{verdict}");
    server.stop().await;
}

#[tokio::test]
async fn with_pre_registration_only_an_operators_registered_ek_may_attest() {
    let ca = Ca::new();
    let mut a = Swtpm::new(&ca);
    let files = ca.files();
    let server = TestServer::start_configured(move |cfg| {
        cfg.lifecycle.validation_reimages = 0;
        cfg.tpm.policy = bootfleet::tpm::TpmPolicy::Required;
        cfg.tpm.enrolment = bootfleet::tpm::Enrolment::PreRegistered;
        cfg.tpm.ek_ca_files = files;
        cfg.ipxe_dir = "/usr/lib/ipxe".into();
    })
    .await;
    let kernel = pe_kernel(1);
    let (_, image) = server
        .publish_query(good_bundle("hgx", "1", &kernel), "?tag=hgx:stable")
        .await;
    let log = ovmf_log(snponly(), authenticode(&kernel));
    let log_bytes = log_bytes(&log);
    let work = tempfile::tempdir().unwrap();
    let tpm = bootfleet_agent::tpm::Tpm::new(&a.tcti(), work.path()).unwrap();
    let mac = "52:54:00:70:02:01";
    let route = format!("/api/v1/nodes/{mac}/tpm");

    // Not registered: the challenge is refused, naming the EK it saw.
    let (node, boot) = booted(&server, "52-54-00-70-02-01", "hgx:stable").await;
    let conv = Conversation { node: &node, boot };
    a.boot(&log);
    let keys = tpm.keys().unwrap();
    let (status, answer) = conv.challenge_with(&keys).await;
    assert_eq!(status, 403, "{answer}");
    assert!(
        answer.to_string().contains("no EK is registered"),
        "{answer}"
    );

    // Bad registrations are refused whole.
    for body in [
        json!({}),
        json!({ "ek_name": "00ff" }),
        json!({ "ek_public": "zz" }),
        json!({ "ek_public": hex::encode(&keys.ak_public) }),
    ] {
        let r = server.put(&route).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 400, "{body}: {}", r.text().await.unwrap());
    }
    // The operator registers the EK (its public area, as tpm2_createek writes it).
    let r = server
        .put(&route)
        .json(&json!({ "ek_public": hex::encode(&keys.ek_public) }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let enrolled: Value = r.json().await.unwrap();
    assert_eq!(enrolled["certified"], false, "{enrolled}");
    let (status, shown) = server.json(&route).await;
    assert_eq!((status, &shown["ek_name"]), (200, &enrolled["ek_name"]));
    let (status, answer) = conv.challenge_with(&keys).await;
    assert_eq!(status, 200, "{answer}");
    let (_, evidence) = conv.evidence(&tpm, &tpm, &answer, &log_bytes);
    let verdict = conv.attest(&image, Some(evidence)).await;
    assert_eq!(verdict["passed"], true, "{verdict}");

    // Forgotten (a new board): the next challenge is refused until a new registration.
    let r = server.delete(&route).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let boot = node.boot().await;
    let conv = Conversation { node: &node, boot };
    a.boot(&log);
    let keys = tpm.keys().unwrap();
    let (status, _) = conv.challenge_with(&keys).await;
    assert_eq!(status, 403);
    let (status, _) = server.json(&route).await;
    assert_eq!(status, 404);
    // Both changes are in the event log, with who made them.
    let (_, page) = server.json("/api/v1/events?since=0&limit=1000").await;
    let tpm_events: Vec<(&str, &str)> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"].as_str().unwrap().starts_with("tpm."))
        .map(|e| {
            (
                e["kind"].as_str().unwrap(),
                e["actor"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        tpm_events,
        [("tpm.enrolled", "admin"), ("tpm.forgotten", "admin")],
        "{page}"
    );
    server.stop().await;
}
