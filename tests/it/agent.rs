//! The real `bootfleet-agent` binary against an in-process server: it reads a recorded
//! /proc and /sys tree (its `--root`) and recorded GPU readings, or real NVML where there
//! is no GPU, and takes nodes to the state their readings deserve.

use std::path::Path;

use serde_json::{Value, json};

use crate::fake_node::{Boot, FakeNode, healthy, validation_failure};
use crate::harness::*;

fn agent_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_bootfleet-agent"))
}

/// A node's /proc, /sys and /dev/kmsg as the agent reads them.
pub(crate) fn node_root(boot: &Boot, kmsg: &str) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let w = |p: &str, s: &str| {
        let path = root.path().join(p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, s).unwrap();
    };
    w("proc/cmdline", &format!("{}\n", boot.cmdline));
    w("proc/sys/kernel/osrelease", "6.1.0-28-cloud-amd64\n");
    w(
        "proc/modules",
        "nvidia 54001664 2 - Live 0x0000000000000000 (POE)\n",
    );
    w("sys/module/nvidia/version", "550.127.05\n");
    w(
        "proc/driver/nvidia/version",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.127.05  Tue Oct  8 03:22:07 UTC 2024\n",
    );
    w("dev/kmsg", kmsg);
    root
}

async fn run_agent(root: &Path, readings: Option<&Path>, extra: &[&str]) -> (i32, String) {
    run_agent_with(root, readings, extra, &[]).await
}

/// As `run_agent`, with `envs` set for the agent (and what it runs).
pub(crate) async fn run_agent_with(
    root: &Path,
    readings: Option<&Path>,
    extra: &[&str],
    envs: &[(&str, std::ffi::OsString)],
) -> (i32, String) {
    let mut cmd = tokio::process::Command::new(agent_bin());
    cmd.arg("--root").arg(root).arg("--once").args(extra);
    cmd.envs(envs.iter().map(|(k, v)| (*k, v)));
    if let Some(r) = readings {
        cmd.arg("--gpu-readings").arg(r);
    }
    // tokio's Command: a blocking wait would stall the in-process server.
    let out = cmd.output().await.unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

pub(crate) fn readings_file(dir: &Path, report: &Value) -> std::path::PathBuf {
    let path = dir.join("readings.json");
    std::fs::write(&path, report.to_string()).unwrap();
    path
}

pub(crate) async fn booted<'a>(
    server: &'a TestServer,
    mac: &str,
    tag: &str,
) -> (FakeNode<'a>, Boot) {
    let node = FakeNode::new(server, mac);
    server.assign(mac, tag).await;
    let boot = node.boot().await;
    node.fetch_all(&boot).await; // what iPXE does before the kernel runs
    (node, boot)
}

#[tokio::test]
async fn the_agent_takes_a_gpu_node_to_ready_and_an_xid_to_quarantine() {
    let server = TestServer::start_configured(|cfg| cfg.lifecycle.validation_reimages = 0).await;
    server
        .publish_query(good_bundle("hgx", "1", b"kernel"), "?tag=hgx:stable")
        .await;
    let (node, boot) = booted(&server, "52-54-00-30-00-01", "hgx:stable").await;
    let root = node_root(
        &boot,
        "6,100,1000,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module 550.127.05\n",
    );
    let readings = readings_file(root.path(), &healthy());
    let (code, out) = run_agent(root.path(), Some(&readings), &[]).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(r#""status":200,"step":"heartbeat""#), "{out}");
    assert_eq!(node.state().await, "ready", "{out}");

    // Same readings, but the kernel log has an XID 79 since boot.
    let (node, boot) = booted(&server, "52-54-00-30-00-02", "hgx:stable").await;
    let root = node_root(
        &boot,
        "4,2000,5000000,-;NVRM: Xid (PCI:0000:5d:00): 79, pid=2314, name=python3, GPU has fallen off the bus.\n",
    );
    let readings = readings_file(root.path(), &healthy());
    let (code, out) = run_agent(root.path(), Some(&readings), &[]).await;
    assert_eq!(code, 0, "{out}");
    let detail = node.node().await;
    assert_eq!(detail["state"], "quarantined", "{out}");
    let reason = validation_failure(&detail);
    assert!(reason.contains("XID 79 on 0000:5d:00"), "{reason}");

    // Their heartbeats carried each GPU's readings: /metrics/gpus shows them, the XID on
    // the GPU at 5d:00 (index 3) only.
    let gpus = server.text("/metrics/gpus").await;
    for line in [
        r#"bootfleet_gpu_temperature_celsius{node="52:54:00:30:00:01",gpu="0"} 31.0"#,
        r#"bootfleet_gpu_power_watts{node="52:54:00:30:00:01",gpu="5"} 73.0"#,
        r#"bootfleet_gpu_ecc_corrected_errors_total{node="52:54:00:30:00:01",gpu="2"} 3"#,
        r#"bootfleet_gpu_xids_total{node="52:54:00:30:00:02",gpu="3"} 1"#,
        r#"bootfleet_gpu_xids_total{node="52:54:00:30:00:02",gpu="2"} 0"#,
        r#"bootfleet_gpu_xids_total{node="52:54:00:30:00:01",gpu="3"} 0"#,
    ] {
        assert!(gpus.lines().any(|l| l == line), "{line} not in {gpus}");
    }
    let info = gpus
        .lines()
        .find(|l| l.starts_with(r#"bootfleet_gpu_info{node="52:54:00:30:00:01",gpu="0","#))
        .unwrap_or_else(|| panic!("no info for GPU 0: {gpus}"));
    assert!(
        info.contains(r#"modelName="NVIDIA H100 80GB HBM3""#),
        "{info}"
    );
    assert!(info.contains(r#"pci_bus_id="00000000:18:00.0""#), "{info}");
    server.stop().await;
}

#[tokio::test]
async fn without_a_gpu_nvml_is_unavailable_a_cpu_image_validates_and_a_gpu_image_fails() {
    let server = TestServer::start_configured(|cfg| cfg.lifecycle.validation_reimages = 0).await;
    // A CPU-only image: no [validation] GPUs, no driver pin.
    let cpu_manifest = "name = \"cpu\"\nversion = \"1\"\n\n[boot]\nkernel = \"vmlinuz\"\ninitrds = [\"initrd.img\"]\ncmdline = \"console=ttyS0 quiet\"\n\n[pins]\nkernel = \"6.1.0-28-cloud-amd64\"\n";
    let mut entries = good_entries("cpu", "1", b"kernel");
    entries[0].data = cpu_manifest.as_bytes().to_vec();
    let (status, image) = server
        .publish_query(tar_of(&entries), "?tag=cpu:stable")
        .await;
    assert_eq!(status, 201, "{image}");
    server
        .publish_query(good_bundle("hgx", "1", b"kernel"), "?tag=hgx:stable")
        .await;
    // The real NVML path: this machine has no NVIDIA driver.
    let (node, boot) = booted(&server, "52-54-00-30-00-03", "cpu:stable").await;
    let root = node_root(&boot, "");
    let (code, out) = run_agent(root.path(), None, &[]).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("NVML unavailable"),
        "the agent says why: {out}"
    );
    assert_eq!(node.state().await, "ready", "{out}");

    let (node, boot) = booted(&server, "52-54-00-30-00-04", "hgx:stable").await;
    let root = node_root(&boot, "");
    let (code, out) = run_agent(root.path(), None, &[]).await;
    assert_eq!(code, 0, "{out}");
    let detail = node.node().await;
    let reason = validation_failure(&detail);
    assert!(reason.contains("expected 8 GPUs, found 0"), "{reason}");
    assert_ne!(detail["state"], "ready");
    server.stop().await;
}

#[tokio::test]
async fn the_agent_reboots_when_a_reimage_is_requested_and_needs_its_boot_parameters() {
    let server = TestServer::start().await;
    server
        .publish_query(good_bundle("hgx", "1", b"kernel"), "?tag=hgx:stable")
        .await;
    let (node, boot) = booted(&server, "52-54-00-30-00-05", "hgx:stable").await;
    let root = node_root(&boot, "");
    let readings = readings_file(root.path(), &healthy());
    let (code, out) = run_agent(root.path(), Some(&readings), &[]).await;
    assert_eq!((code, node.state().await.as_str()), (0, "ready"), "{out}");
    let r = server
        .post(&format!("/api/v1/nodes/{}/reimage", node.mac))
        .json(&json!({ "reason": "rolling to a new driver" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    // Restarted agent: attestation answers the stored verdict, then "reboot".
    let (code, out) = run_agent(root.path(), Some(&readings), &["--no-reboot"]).await;
    assert_eq!(code, 3, "{out}");
    assert!(out.contains(r#""action":"reboot""#), "{out}");

    let empty = tempfile::tempdir().unwrap();
    let (code, out) = run_agent(empty.path(), None, &[]).await;
    assert_eq!(code, 2);
    assert!(out.contains("no server"), "{out}");
    server.stop().await;
}

#[tokio::test]
async fn checks_the_image_asks_for_run_and_a_check_that_cannot_run_fails() {
    let server = TestServer::start_configured(|cfg| cfg.lifecycle.validation_reimages = 0).await;
    let mut entries = good_entries("hgx", "1", b"kernel");
    let text = String::from_utf8(entries[0].data.clone()).unwrap() + "dcgm-level = 1\n";
    entries[0].data = text.into_bytes();
    server
        .publish_query(tar_of(&entries), "?tag=hgx:stable")
        .await;
    let (node, boot) = booted(&server, "52-54-00-30-00-06", "hgx:stable").await;
    assert!(
        boot.cmdline.contains("bootfleet.dcgm=1"),
        "{}",
        boot.cmdline
    );
    let root = node_root(&boot, "");
    let mut readings = healthy();
    readings.as_object_mut().unwrap().remove("dcgm");
    let readings = readings_file(root.path(), &readings);
    // This machine has no dcgmi: the agent says so, and the node is not ready.
    let (code, out) = run_agent(
        root.path(),
        Some(&readings),
        &[
            "--probe",
            "echo 'CUDA error: no CUDA-capable device' >&2; exit 1",
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let detail = node.node().await;
    let reason = validation_failure(&detail);
    assert!(
        reason.contains("DCGM dcgm failed: cannot run dcgmi"),
        "{reason}"
    );
    assert!(
        reason.contains("compute-probe failed") && reason.contains("no CUDA-capable device"),
        "{reason}"
    );
    server.stop().await;
}

/// Heartbeats send the module list's digest while the list is the one the server's answer
/// named, and the list itself once it changes: a module loaded after ready is named.
#[tokio::test]
async fn a_module_loaded_after_ready_is_named_though_heartbeats_send_a_digest() {
    use tokio::io::AsyncBufReadExt as _;
    let server = TestServer::start().await;
    server
        .publish_query(good_bundle("hgx", "1", b"kernel"), "?tag=hgx:stable")
        .await;
    let (node, boot) = booted(&server, "52-54-00-30-00-0d", "hgx:stable").await;
    let root = node_root(
        &boot,
        "6,100,1000,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module 550.127.05\n",
    );
    let readings = readings_file(root.path(), &healthy());
    let mut agent = tokio::process::Command::new(agent_bin())
        .arg("--root")
        .arg(root.path())
        .arg("--gpu-readings")
        .arg(&readings)
        .args(["--heartbeat-secs", "1"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(agent.stdout.take().unwrap()).lines();
    // The first heartbeat sends the list; once an answer named its digest, the digest.
    let mut sent = Vec::new();
    let heard = async {
        while let Some(line) = lines.next_line().await.unwrap() {
            let said: Value = serde_json::from_str(&line).unwrap_or_default();
            if said["step"] == "heartbeat" {
                assert!(
                    said["answer"]["baseline_modules_sha256"].is_string(),
                    "{said}"
                );
                sent.push(said["sent"].as_str().unwrap().to_string());
                if sent.len() == 2 {
                    return;
                }
            }
        }
        panic!("the agent stopped");
    };
    tokio::time::timeout(std::time::Duration::from_secs(30), heard)
        .await
        .expect("two heartbeats answered within 30 s");
    assert_eq!(sent, ["modules", "modules digest"]);
    assert_eq!(node.state().await, "ready", "the digest is the baseline's");

    // A module loads: the next heartbeat sends the list, and the server names the module.
    let modules = root.path().join("proc/modules");
    let mut list = std::fs::read_to_string(&modules).unwrap();
    list.push_str("nouveau 2494464 0 - Live 0x0000000000000000\n");
    std::fs::write(&modules, list).unwrap();
    let mut state = Value::Null;
    for _ in 0..60 {
        state = node.node().await;
        if state["state"] == "drifted" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    assert_eq!(state["state"], "drifted", "{state}");
    let reason = state["state_reason"].as_str().unwrap();
    assert!(reason.contains("modules.nouveau: was (absent)"), "{reason}");
    agent.kill().await.unwrap();
    server.stop().await;
}
