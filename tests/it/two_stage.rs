//! Two-stage stateless boot of a real OS (issue 15), end to end: images/debian/build.sh
//! builds a pinned Debian bookworm root with systemd and the agent as a unit, packed as
//! an OCI layout; bootfleet imports it (squashfs + dm-verity, the image's own kernel and
//! a stage-1 initramfs of its modules); QEMU machines network-boot it. iPXE loads only the
//! kernel and stage 1, stage 1 fetches the root by digest, checks it, mounts it through
//! dm-verity under a tmpfs overlay with the node's overlay files, and switch_roots into
//! systemd, where the agent attests with the verity root hash it runs on.
//!
//! All HTTP passes a proxy that cuts the first download of the root halfway: stage 1
//! must resume it. Then one byte of the stored root is flipped: the next node's stage 1
//! refuses it, the boot stops with the reason in its timeline and never reaches ready.
//! Needs root, QEMU, OVMF, mmdebstrap and a Debian mirror (the test command installs the
//! tools).

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::e2e::{Firmware, boot_until, lab_with, require, segment_number, sh, wait_for};
use crate::harness::{TestServer, strings};

/// The Debian image as an OCI layout, built (or taken from the recipe's cache) once per
/// test binary, with the agent these tests built.
fn debian_layout() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("debian-oci");
            let _ = std::fs::remove_dir_all(&out);
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/images/debian/build.sh");
            let agent = env!("CARGO_BIN_EXE_bootfleet-agent");
            sh(&format!("{script} {} {agent}", out.display()));
            out
        })
        .clone()
}

/// A TCP proxy in front of the server that cuts the first download of `cut_path`
/// after `cut_after` bytes of its answer (once), as a flaky network would.
async fn cutting_proxy(
    listen: &str,
    upstream: std::net::SocketAddr,
    cut_path: String,
    cut_after: u64,
) -> Arc<AtomicBool> {
    let listener = tokio::net::TcpListener::bind(listen).await.unwrap();
    let cut = Arc::new(AtomicBool::new(false));
    let done = cut.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                return;
            };
            let (cut_path, done) = (cut_path.clone(), done.clone());
            tokio::spawn(async move {
                let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                // The first request's head says what this connection is for.
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16384 {
                    match client.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let cutting = !done.load(Ordering::SeqCst)
                    && String::from_utf8_lossy(&head).contains(&cut_path);
                if String::from_utf8_lossy(&head).contains(&cut_path) {
                    eprintln!(
                        "proxy: a root download (cutting: {cutting}): {}",
                        String::from_utf8_lossy(&head).lines().next().unwrap_or("")
                    );
                }
                if server.write_all(&head).await.is_err() {
                    return;
                }
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = tokio::spawn(async move { tokio::io::copy(&mut cr, &mut sw).await });
                let mut sent = 0u64;
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match sr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if cutting && sent + n as u64 > cut_after {
                        done.store(true, Ordering::SeqCst);
                        eprintln!("proxy: cut after {sent} bytes");
                        break; // drop both halves: the connection is cut mid-body
                    }
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    sent += n as u64;
                }
                up.abort();
            });
        }
    });
    cut
}

/// Flips one byte of a stored blob in place (no truncation: the server may have it
/// mapped).
fn flip_byte(path: &Path, at: u64) {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0u8];
    f.seek(SeekFrom::Start(at)).unwrap();
    std::io::Read::read_exact(&mut f, &mut byte).unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&[byte[0] ^ 0x01]).unwrap();
}

fn artifact(image: &Value, role: &str) -> Value {
    image["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["role"] == role)
        .unwrap_or_else(|| panic!("no {role} in {image}"))
        .clone()
}

async fn import(server: &TestServer, layout: &Path) -> Value {
    let spec = json!({
        "name": "debian", "version": "12", "tag": "debian:stable",
        "cmdline": "console=ttyS0,115200n8 panic=10 systemd.journald.forward_to_console=1",
        "validation": { "gpus": 0 },
    })
    .to_string();
    let body = crate::oci::tar_dir(layout);
    let r = server
        .post("/api/v1/images/import")
        .query(&[("spec", spec.as_str())])
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let out: Value = r.json().await.unwrap();
    assert_eq!(status, 201, "{out}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debian_root_boots_in_two_stages_resumes_a_cut_and_refuses_a_flipped_byte() {
    require();
    let layout = tokio::task::spawn_blocking(debian_layout).await.unwrap();
    let n = segment_number(9);
    let proxy = format!("10.88.{n}.1:{}", 19_000 + n);
    let proxy_url = format!("http://{proxy}");
    let (mut segment, server) = lab_with(
        n,
        bootfleet::dhcp::decide::Mode::Authoritative,
        Default::default(),
        move |cfg| {
            cfg.dhcp.http_url = Some(proxy_url);
            // Every request reaches the server from the proxy's address.
            cfg.boots.bind_to_address = false;
            cfg.images.agent = env!("CARGO_BIN_EXE_bootfleet-agent").into();
        },
    )
    .await;
    segment.memory_mb = 1024;
    let imported = import(&server, &layout).await;
    assert_eq!(imported["import"]["kernel_release"], "6.1.0-57-cloud-amd64");
    let digest = imported["digest"].as_str().unwrap().to_string();
    let (_, image) = server.json(&format!("/api/v1/images/{digest}")).await;
    let rootfs = artifact(&image, "rootfs");
    let rootfs_hex = rootfs["digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:")
        .to_string();
    let size = rootfs["size"].as_u64().unwrap();
    let cut = cutting_proxy(
        &proxy,
        server.addr,
        format!("/blobs/sha256/{rootfs_hex}"),
        size / 8,
    )
    .await;

    // BIOS: QEMU's iPXE ROM -> script -> kernel + stage 1 -> the root (cut, resumed) ->
    // systemd -> the agent as a unit -> attested on the verity root hash -> ready.
    let bios = format!("52:54:00:e5:{n:02x}:01");
    server.assign(&bios, "debian:stable").await;
    let (node, vm) = boot_until(
        &mut segment,
        &server,
        &bios,
        Firmware::Bios,
        Duration::from_secs(420),
        "two-stage BIOS boot to ready",
        |n| n["state"] == "ready",
    )
    .await;
    eprintln!(
        "two-stage: BIOS power-on to ready {:?} (QEMU TCG)",
        vm.powered.elapsed()
    );
    assert_eq!(node["boots"][0]["image"], digest.as_str());
    let steps = strings(&node["boots"][0]["steps"], "step");
    let from = steps
        .iter()
        .position(|s| *s == "script")
        .expect("a script step");
    assert_eq!(
        steps[from..],
        [
            "script",
            "kernel",
            "initrd stage1.img",
            "stage1 rootfs",
            "attested",
            "validated"
        ],
        "{node}"
    );
    assert!(
        cut.load(Ordering::SeqCst),
        "the proxy never cut the root's download"
    );
    let serial = vm.serial();
    for line in [
        "bootfleet stage 1: root fetched and its sha256 checked",
        "bootfleet stage 1: overlay of",
        "bootfleet stage 1: switching to the image's root",
        "Hostname set to <node-525400e5",
        // The agent, as a systemd unit of the image, attested and was answered.
        "bootfleet-agent[",
        r#""passed":true},"status":200,"step":"attest""#,
    ] {
        assert!(
            serial.contains(line),
            "{line:?} not on the console:\n{serial}"
        );
    }
    // The node's overlay (its keys, its machine-id) went to its stage 1; the token stays
    // readable on the node, so after the boot attested no one gets the overlay with it.
    let token = serial
        .split_whitespace()
        .find_map(|w| w.strip_prefix("bootfleet.token="))
        .expect("the token on the command line")
        .to_string();
    let r = server
        .http
        .get(server.url("/boot/overlay"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "the overlay after attestation");
    let resumed = serial
        .lines()
        .find(|l| l.contains("root fetched and its sha256 checked"))
        .unwrap();
    assert!(
        !resumed.contains(" 0 resumes"),
        "the cut was not resumed: {resumed}"
    );

    // UEFI: OVMF's PXE -> iPXE over TFTP -> the same image, on another node.
    segment.power_off();
    let uefi = format!("52:54:00:e5:{n:02x}:02");
    server.assign(&uefi, "debian:stable").await;
    let (_, vm) = boot_until(
        &mut segment,
        &server,
        &uefi,
        Firmware::Uefi,
        Duration::from_secs(420),
        "two-stage UEFI boot to ready",
        |n| n["state"] == "ready",
    )
    .await;
    eprintln!(
        "two-stage: UEFI power-on to ready {:?} (QEMU TCG)",
        vm.powered.elapsed()
    );

    // A node with a local root cache (label rootfs-cache=FS_LABEL, an ext4 disk): its
    // first boot fetches the root into the cache, its next (a reimage) reads it there.
    segment.power_off();
    let disk_dir = tempfile::tempdir().unwrap();
    let disk = disk_dir.path().join("cache.img");
    sh(&format!(
        "truncate -s 512M {d} && mkfs.ext4 -q -F -L bootfleet-cache {d}",
        d = disk.display()
    ));
    segment.extra_args = vec![
        "-drive".into(),
        format!("file={},if=virtio,format=raw", disk.display()),
    ];
    let cached = format!("52:54:00:e5:{n:02x}:04");
    server.assign(&cached, "debian:stable").await;
    server
        .label(&cached, "rootfs-cache", "bootfleet-cache")
        .await;
    let (node, vm) = boot_until(
        &mut segment,
        &server,
        &cached,
        Firmware::Bios,
        Duration::from_secs(420),
        "a first boot that fills the node's root cache",
        |n| n["state"] == "ready",
    )
    .await;
    assert!(
        vm.serial().contains("root kept in the node's cache"),
        "{}",
        vm.serial()
    );
    let first_boot = node["boots"][0]["id"].clone();
    let r = server
        .post(&format!("/api/v1/nodes/{cached}/reimage"))
        .json(&json!({ "reason": "reboot onto the cached root" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let node = wait_for(
        &server,
        &cached,
        &vm.log(),
        Duration::from_secs(420),
        "a reboot from the node's root cache",
        |n| n["state"] == "ready" && n["boots"][0]["id"] != first_boot,
    )
    .await;
    assert!(
        vm.serial().contains("root from the node's cache"),
        "{}",
        vm.serial()
    );
    let steps = node["boots"][0]["steps"].as_array().unwrap();
    let root = steps.iter().find(|s| s["step"] == "stage1 rootfs").unwrap();
    assert_eq!(root["outcome"], "from the node's cache", "{node}");
    segment.extra_args.clear();

    // One flipped byte in the stored root: stage 1 refuses it by its sha256, the boot
    // fails attestation naming stage 1, and the node never reaches ready.
    segment.power_off();
    flip_byte(&server.blob_dir().join(&rootfs_hex), size / 2);
    let flipped = format!("52:54:00:e5:{n:02x}:03");
    server.assign(&flipped, "debian:stable").await;
    let (node, vm) = boot_until(
        &mut segment,
        &server,
        &flipped,
        Firmware::Bios,
        Duration::from_secs(300),
        "a flipped byte stops the boot",
        |n| n["state"] == "attestation-failed",
    )
    .await;
    let steps = node["boots"][0]["steps"].as_array().unwrap();
    let attested = steps.iter().find(|s| s["step"] == "attested").unwrap();
    let outcome = attested["outcome"].as_str().unwrap();
    assert!(
        outcome.contains("stage1") && outcome.contains(&rootfs_hex),
        "the timeline does not name the failure: {node}"
    );
    assert!(
        vm.serial().contains("bootfleet stage 1:"),
        "{}",
        vm.serial()
    );
    // It stays out of ready (it reboots after 30 s and fails the same way).
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (_, still) = server.json(&format!("/api/v1/nodes/{flipped}")).await;
    assert_ne!(still["state"], "ready", "{still}");
    server.stop().await;
}
