//! The whole mission on a real boot path: QEMU machines network-boot the demo image
//! (images/demo) from an in-process bootfleet over a bridge and tap device the test
//! creates and removes. QEMU's own iPXE NIC ROM does DHCP (bootfleet, authoritative),
//! fetches the boot script, kernel and initrd over HTTP; the initramfs runs
//! bootfleet-agent, which attests and validates (CPU-only image). Then a rollout: the tag
//! moves, a reimage is requested, the agent reboots the VM, and it comes back on the new
//! digest. Needs root, qemu-system-x86, ipxe-qemu, busybox-static, cpio, binutils and a
//! Debian mirror for the pinned kernel package (the README test command installs the rest).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::*;

fn sh(cmd: &str) {
    let out = Command::new("bash").args(["-c", cmd]).output().unwrap();
    assert!(
        out.status.success(),
        "`{cmd}` failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn require() {
    let ok = |c: &str| {
        Command::new("bash")
            .args(["-c", c])
            .output()
            .unwrap()
            .status
            .success()
    };
    assert!(
        ok("[ \"$(id -u)\" = 0 ]"),
        "the E2E tests need root (tap devices): run `sudo ./scripts/test`"
    );
    for (tool, package) in [
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("cpio", "cpio"),
        ("strip", "binutils"),
    ] {
        assert!(
            ok(&format!("command -v {tool}")),
            "{tool} is missing: apt-get install {package}"
        );
    }
    assert!(
        Path::new("/usr/share/qemu/efi-virtio.rom").exists()
            || Path::new("/usr/lib/ipxe/qemu/efi-virtio.rom").exists(),
        "QEMU's iPXE NIC ROM is missing: apt-get install ipxe-qemu"
    );
}

/// Builds demo:VERSION into a fresh directory with the agent these tests built.
fn build_image(version: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join(format!("demo-{version}"));
    let agent = env!("CARGO_BIN_EXE_bootfleet-agent");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/images/demo/build.sh");
    sh(&format!("{script} {} {version} {agent}", out.display()));
    (dir, out)
}

/// Tars a built image directory for the publish API.
fn bundle(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for name in ["manifest.toml", "vmlinuz", "initrd.img"] {
        b.append_path_with_name(dir.join(name), name).unwrap();
    }
    b.into_inner().unwrap()
}

struct Segment {
    bridge: String,
    tap: String,
    vm: Option<Child>,
}

impl Segment {
    fn new(n: u32) -> Self {
        let (bridge, tap) = (format!("bfeb{n}"), format!("bfet{n}"));
        sh(&format!(
            "ip link del {bridge} 2>/dev/null; ip link del {tap} 2>/dev/null; \
             ip link add {bridge} type bridge && ip addr add 10.88.{n}.1/24 dev {bridge} && ip link set {bridge} up && \
             ip tuntap add dev {tap} mode tap && ip link set {tap} master {bridge} up"
        ));
        Self {
            bridge,
            tap,
            vm: None,
        }
    }

    /// Powers on a VM that network-boots (QEMU's iPXE ROM), serial console to `log`.
    fn power_on(&mut self, mac: &str, log: &Path) {
        let vm = Command::new("qemu-system-x86_64")
            .args([
                "-machine",
                "q35,accel=tcg",
                "-m",
                "512",
                "-nographic",
                "-monitor",
                "none",
            ])
            .args(["-serial", &format!("file:{}", log.display())])
            .args([
                "-netdev",
                &format!("tap,id=n0,ifname={},script=no,downscript=no", self.tap),
            ])
            .args(["-device", &format!("virtio-net-pci,netdev=n0,mac={mac}")])
            .args(["-boot", "n"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("qemu starts");
        self.vm = Some(vm);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if let Some(vm) = &mut self.vm {
            let _ = vm.kill();
            let _ = vm.wait();
        }
        let _ = Command::new("ip").args(["link", "del", &self.tap]).status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .status();
    }
}

/// Polls the node until `done` holds (or panics with the serial log after `limit`).
async fn wait_for(
    server: &TestServer,
    mac: &str,
    log: &Path,
    limit: Duration,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let start = Instant::now();
    loop {
        let (_, node) = server.json(&format!("/api/v1/nodes/{mac}")).await;
        if done(&node) {
            return node;
        }
        if start.elapsed() > limit {
            let serial = std::fs::read_to_string(log).unwrap_or_default();
            let tail: Vec<&str> = serial.lines().rev().take(30).collect();
            panic!(
                "{what}: not within {limit:?}; node: {node}\nserial (last lines, newest first):\n{}",
                tail.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_network_boots_the_pinned_image_to_ready_and_rolls_out_to_a_new_version() {
    require();
    let n = 40 + std::process::id() % 40;
    let (_d1, v1_dir) = tokio::task::spawn_blocking(|| build_image("1"))
        .await
        .unwrap();
    let (_d2, v2_dir) = tokio::task::spawn_blocking(|| build_image("2"))
        .await
        .unwrap();
    let mut segment = Segment::new(n);
    let server_ip = format!("10.88.{n}.1");
    let port = 18_000 + n as u16;
    let (ip, bridge) = (server_ip.clone(), segment.bridge.clone());
    let server = TestServer::start_configured(move |cfg| {
        cfg.listen = format!("{ip}:{port}").parse().unwrap();
        cfg.dhcp = bootfleet::config::DhcpFileConfig {
            mode: Some(bootfleet::dhcp::decide::Mode::Authoritative),
            interface: Some(bridge),
            server_ip: Some(ip.parse().unwrap()),
            http_url: Some(format!("http://{ip}:{port}")),
            pool: Some(bootfleet::dhcp::leases::PoolConfig {
                start: format!("10.88.{n}.100").parse().unwrap(),
                end: format!("10.88.{n}.200").parse().unwrap(),
                reservations: Default::default(),
                lease_secs: 600,
            }),
            ..Default::default()
        };
    })
    .await;
    let (status, v1) = server
        .publish_query(bundle(&v1_dir), "?tag=demo:stable")
        .await;
    assert_eq!(status, 201, "{v1}");
    let mac = format!("52:54:00:e2:{n:02x}:01");
    let r = server
        .put(&format!("/api/v1/nodes/{mac}/image"))
        .json(&json!({ "image": "demo:stable" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // (a) Power on: DHCP -> iPXE -> script -> kernel, initrd -> agent -> ready.
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("serial.log");
    let powered = Instant::now();
    segment.power_on(&mac, &log);
    let node = wait_for(
        &server,
        &mac,
        &log,
        Duration::from_secs(150),
        "first boot to ready",
        |n| n["state"] == "ready",
    )
    .await;
    let first_boot = powered.elapsed();
    assert_eq!(node["boots"][0]["image"], v1["digest"]);
    let steps: Vec<&str> = node["boots"][0]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["step"].as_str().unwrap())
        .collect();
    assert_eq!(
        steps,
        [
            "script",
            "kernel",
            "initrd initrd.img",
            "attested",
            "validated"
        ],
        "{node}"
    );
    let tos: Vec<&str> = node["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["to"].as_str().unwrap())
        .collect();
    assert_eq!(
        tos,
        [
            "discovered",
            "provisioning",
            "booted",
            "validating",
            "ready"
        ]
    );

    // (e) Rollout: the tag moves to version 2, a reimage is requested; the agent reboots
    // the VM, which boots the new digest and is ready again.
    let (status, v2) = server
        .publish_query(bundle(&v2_dir), "?tag=demo:stable")
        .await;
    assert_eq!(status, 201, "{v2}");
    assert_ne!(v1["digest"], v2["digest"]);
    let r = server
        .post(&format!("/api/v1/nodes/{mac}/reimage"))
        .json(&json!({ "reason": "roll out demo:2" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let v2_digest = v2["digest"].clone();
    let node = wait_for(
        &server,
        &mac,
        &log,
        Duration::from_secs(180),
        "rollout to ready on demo:2",
        |n| n["state"] == "ready" && n["boots"][0]["image"] == v2_digest,
    )
    .await;
    let history = node["history"].as_array().unwrap();
    let reimage = history.iter().find(|h| h["to"] == "reimaging").unwrap();
    assert!(
        reimage["reason"]
            .as_str()
            .unwrap()
            .contains("roll out demo:2")
    );
    let boots: Vec<&str> = history
        .iter()
        .filter(|h| h["to"] == "provisioning")
        .map(|h| h["reason"].as_str().unwrap())
        .collect();
    assert!(
        boots[0].contains(v1["digest"].as_str().unwrap())
            && boots[1].contains(v2["digest"].as_str().unwrap()),
        "{boots:?}"
    );
    eprintln!("e2e: power-on to ready {first_boot:?} (QEMU TCG)");
    server.stop().await;
}
