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

pub(crate) fn sh(cmd: &str) {
    let out = Command::new("bash").args(["-c", cmd]).output().unwrap();
    assert!(
        out.status.success(),
        "`{cmd}` failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub(crate) fn require() {
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

/// Builds demo:VERSION into a fresh directory with the agent these tests built; `env` is
/// put before the command (for example `LATE_MODULE=dummy`).
fn build_image(version: &str, env: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join(format!("demo-{version}"));
    let agent = env!("CARGO_BIN_EXE_bootfleet-agent");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/images/demo/build.sh");
    sh(&format!(
        "{env} {script} {} {version} {agent}",
        out.display()
    ));
    (dir, out)
}

async fn built(version: &'static str, env: &'static str) -> (tempfile::TempDir, PathBuf) {
    tokio::task::spawn_blocking(move || build_image(version, env))
        .await
        .unwrap()
}

/// A segment and a bootfleet serving it: DHCP in `mode`, TFTP for the iPXE binaries.
async fn lab(n: u32, mode: bootfleet::dhcp::decide::Mode) -> (Segment, TestServer) {
    lab_with(n, mode, Default::default(), |_| ()).await
}

/// As `lab`, with `[dhcp] chainload` set and `extra` settings.
pub(crate) async fn lab_with(
    n: u32,
    mode: bootfleet::dhcp::decide::Mode,
    chainload: bootfleet::dhcp::chain::ChainPolicy,
    extra: impl FnOnce(&mut bootfleet::config::ServerConfig),
) -> (Segment, TestServer) {
    let segment = Segment::new(n);
    let ip = format!("10.88.{n}.1");
    let port = 18_000 + n as u16;
    let bridge = segment.bridge.clone();
    let server = TestServer::start_configured(move |cfg| {
        cfg.listen = format!("{ip}:{port}").parse().unwrap();
        cfg.tftp_listen = Some(format!("{ip}:69").parse().unwrap());
        cfg.ipxe_dir = "/usr/lib/ipxe".into();
        cfg.dhcp = bootfleet::config::DhcpFileConfig {
            mode: Some(mode),
            interface: Some(bridge),
            server_ip: Some(ip.parse().unwrap()),
            http_url: Some(format!("http://{ip}:{port}")),
            pool: Some(bootfleet::dhcp::leases::PoolConfig {
                start: format!("10.88.{n}.100").parse().unwrap(),
                end: format!("10.88.{n}.200").parse().unwrap(),
                reservations: Default::default(),
                lease_secs: 600,
            }),
            chainload,
            ..Default::default()
        };
        extra(cfg);
    })
    .await;
    (segment, server)
}

/// Publishes `dir` under demo:stable and assigns it to `mac`; returns the image.
async fn publish_and_assign(server: &TestServer, dir: &Path, mac: &str) -> Value {
    let (status, image) = server.publish_query(bundle(dir), "?tag=demo:stable").await;
    assert_eq!(status, 201, "{image}");
    server.assign(mac, "demo:stable").await;
    image
}

/// Publishes `dir` under demo:stable (the tag `mac` follows) and asks `mac` to reimage
/// for `reason`; returns the new image.
async fn roll_out(server: &TestServer, dir: &Path, mac: &str, reason: &str) -> Value {
    let (status, image) = server.publish_query(bundle(dir), "?tag=demo:stable").await;
    assert_eq!(status, 201, "{image}");
    let r = server
        .post(&format!("/api/v1/nodes/{mac}/reimage"))
        .json(&json!({ "reason": reason }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    image
}

pub(crate) fn segment_number(salt: u32) -> u32 {
    40 + (std::process::id() * 5 + salt) % 160
}

/// Tars a built image directory for the publish API.
fn bundle(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for name in ["manifest.toml", "vmlinuz", "initrd.img"] {
        b.append_path_with_name(dir.join(name), name).unwrap();
    }
    b.into_inner().unwrap()
}

pub(crate) struct Segment {
    bridge: String,
    tap: String,
    /// The VM's memory, MiB (a two-stage image holds its root in RAM).
    pub(crate) memory_mb: u32,
    /// More QEMU arguments for the next VM (a disk).
    pub(crate) extra_args: Vec<String>,
    /// UEFI VMs boot OVMF with Microsoft's keys enrolled: Secure Boot on.
    pub(crate) secure_boot: bool,
    pub(crate) vm: Option<Child>,
    /// Namespaces hanging off the bridge (a site DHCP server), removed on drop.
    namespaces: Vec<String>,
    children: Vec<Child>,
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
            memory_mb: 512,
            extra_args: Vec::new(),
            secure_boot: false,
            vm: None,
            namespaces: vec![],
            children: vec![],
        }
    }

    /// A namespace on the bridge at `address`, running `cmd` (the site's DHCP server).
    fn site(&mut self, n: u32, address: &str, cmd: &str) {
        let ns = format!("bfes{n}");
        let veth = format!("bfev{n}");
        sh(&format!(
            "ip netns del {ns} 2>/dev/null; ip link del {veth} 2>/dev/null; ip netns add {ns} && \
             ip link add {veth} type veth peer name eth0 netns {ns} && ip link set {veth} master {b} up && \
             ip -n {ns} link set lo up && ip -n {ns} link set eth0 up && ip -n {ns} addr add {address}/24 dev eth0",
            b = self.bridge
        ));
        self.namespaces.push(ns.clone());
        let child = Command::new("ip")
            .args(["netns", "exec", &ns, "bash", "-c", cmd])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.children.push(child);
    }

    /// Powers on a UEFI (OVMF) VM whose NIC has no option ROM: OVMF's own PXE fetches
    /// the iPXE EFI binary over TFTP.
    fn power_on_uefi(&mut self, mac: &str, log: &Path, vars: &Path) {
        let (code, vars_template) = if self.secure_boot {
            (
                "/usr/share/OVMF/OVMF_CODE_4M.ms.fd",
                "/usr/share/OVMF/OVMF_VARS_4M.ms.fd",
            )
        } else {
            (
                "/usr/share/OVMF/OVMF_CODE_4M.fd",
                "/usr/share/OVMF/OVMF_VARS_4M.fd",
            )
        };
        std::fs::copy(vars_template, vars).unwrap();
        let vm = Command::new("qemu-system-x86_64")
            .args([
                "-machine",
                "q35,accel=tcg",
                "-m",
                &self.memory_mb.to_string(),
                "-nographic",
                "-monitor",
                "none",
            ])
            .args([
                "-drive",
                &format!("if=pflash,format=raw,readonly=on,file={code}"),
            ])
            .args([
                "-drive",
                &format!("if=pflash,format=raw,file={}", vars.display()),
            ])
            .args(["-serial", &format!("file:{}", log.display())])
            .args([
                "-netdev",
                &format!("tap,id=n0,ifname={},script=no,downscript=no", self.tap),
            ])
            .args([
                "-device",
                &format!("virtio-net-pci,netdev=n0,mac={mac},romfile="),
            ])
            .args(["-boot", "n"])
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("qemu starts");
        self.vm = Some(vm);
    }

    /// QEMU's arguments for a BIOS machine on the tap (QEMU's iPXE ROM), its serial
    /// console appended to `log`, no boot order. SeaBIOS copies the text screen to the
    /// serial port (its `etc/sercon-port`, a little-endian port number), so the log shows
    /// the firmware and iPXE too.
    fn bios_vm_args(&self, mac: &str, log: &Path) -> Vec<String> {
        let sercon = log.with_extension("sercon");
        std::fs::write(&sercon, 0x3f8u16.to_le_bytes()).unwrap();
        let memory = self.memory_mb.to_string();
        [
            "-machine",
            "q35,accel=tcg",
            "-m",
            &memory,
            "-nographic",
            "-monitor",
            "none",
            "-chardev",
            &format!("file,id=serial0,path={},append=on", log.display()),
            "-serial",
            "chardev:serial0",
            "-fw_cfg",
            &format!("name=etc/sercon-port,file={}", sercon.display()),
            "-netdev",
            &format!("tap,id=n0,ifname={},script=no,downscript=no", self.tap),
            "-device",
            &format!("virtio-net-pci,netdev=n0,mac={mac}"),
        ]
        .map(String::from)
        .to_vec()
    }

    /// Powers on a VM that network-boots (QEMU's iPXE ROM), serial console to `log`.
    fn power_on(&mut self, mac: &str, log: &Path) {
        let vm = Command::new("qemu-system-x86_64")
            .args(self.bios_vm_args(mac, log))
            .args(["-boot", "n"])
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("qemu starts");
        self.vm = Some(vm);
    }
}

impl Segment {
    /// Pulls the plug on the VM, if one runs.
    pub(crate) fn power_off(&mut self) {
        if let Some(mut vm) = self.vm.take() {
            let _ = vm.kill();
            let _ = vm.wait();
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.power_off();
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = Command::new("ip").args(["link", "del", &self.tap]).status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .status();
    }
}

/// Polls the node until `done` holds (or panics with the serial log after `limit`).
pub(crate) async fn wait_for(
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

/// The firmware a VM boots with.
#[derive(Clone, Copy)]
pub(crate) enum Firmware {
    /// SeaBIOS with QEMU's iPXE ROM.
    Bios,
    /// OVMF (a fresh copy of its variables per VM).
    Uefi,
}

/// A powered-on VM's serial console and when it was powered on.
pub(crate) struct Vm {
    pub(crate) logs: tempfile::TempDir,
    pub(crate) powered: Instant,
}

impl Vm {
    pub(crate) fn log(&self) -> PathBuf {
        self.logs.path().join("serial.log")
    }

    pub(crate) fn serial(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }
}

/// Powers `mac` on with `firmware` and waits until `done` holds (see `wait_for`).
pub(crate) async fn boot_until(
    segment: &mut Segment,
    server: &TestServer,
    mac: &str,
    firmware: Firmware,
    limit: Duration,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> (Value, Vm) {
    let vm = Vm {
        logs: tempfile::tempdir().unwrap(),
        powered: Instant::now(),
    };
    match firmware {
        Firmware::Bios => segment.power_on(mac, &vm.log()),
        Firmware::Uefi => segment.power_on_uefi(mac, &vm.log(), &vm.logs.path().join("vars.fd")),
    }
    let node = wait_for(server, mac, &vm.log(), limit, what, done).await;
    (node, vm)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_network_boots_the_pinned_image_to_ready_and_rolls_out_to_a_new_version() {
    require();
    let n = segment_number(0);
    let ((_d1, v1_dir), (_d2, v2_dir)) = (built("1", "").await, built("2", "").await);
    let (mut segment, server) = lab(n, bootfleet::dhcp::decide::Mode::Authoritative).await;
    let mac = format!("52:54:00:e2:{n:02x}:01");
    let v1 = publish_and_assign(&server, &v1_dir, &mac).await;

    // (a) Power on: DHCP -> QEMU's iPXE ROM -> script -> kernel, initrd -> agent -> ready.
    let (node, vm) = boot_until(
        &mut segment,
        &server,
        &mac,
        Firmware::Bios,
        Duration::from_secs(240),
        "first boot to ready",
        |n| n["state"] == "ready",
    )
    .await;
    let first_boot = vm.powered.elapsed();
    assert_eq!(node["boots"][0]["image"], v1["digest"]);
    let steps = strings(&node["boots"][0]["steps"], "step");
    // DHCP answers open the timeline (QEMU's ROM is iPXE: DISCOVER, REQUEST).
    let script = steps
        .iter()
        .position(|s| *s == "script")
        .expect("a script step");
    assert!(
        script >= 2 && steps[..script].iter().all(|s| s.starts_with("ipxe dhcp ")),
        "{node}"
    );
    assert_eq!(
        steps[script..],
        [
            "script",
            "kernel",
            "initrd initrd.img",
            "attested",
            "validated"
        ],
        "{node}"
    );
    let tos = strings(&node["history"], "to");
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
    let v2 = roll_out(&server, &v2_dir, &mac, "roll out demo:2").await;
    assert_ne!(v1["digest"], v2["digest"]);
    let v2_digest = v2["digest"].clone();
    let node = wait_for(
        &server,
        &mac,
        &vm.log(),
        Duration::from_secs(240),
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
    eprintln!("e2e: BIOS iPXE ROM power-on to ready {first_boot:?} (QEMU TCG)");
    server.stop().await;
}

/// (b) BIOS chainloading: with `[dhcp] chainload = "always"` QEMU's iPXE ROM is handed
/// `undionly.kpxe` over TFTP, which runs on the ROM's UNDI driver, asks DHCP again and
/// gets the script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bios_vm_chainloads_undionly_over_tftp_then_boots_to_ready() {
    require();
    let n = segment_number(4);
    let (_d, dir) = built("1", "").await;
    let (mut segment, server) = lab_with(
        n,
        bootfleet::dhcp::decide::Mode::Authoritative,
        bootfleet::dhcp::chain::ChainPolicy::Always,
        |_| (),
    )
    .await;
    let mac = format!("52:54:00:e2:{n:02x}:04");
    publish_and_assign(&server, &dir, &mac).await;
    let (node, vm) = boot_until(
        &mut segment,
        &server,
        &mac,
        Firmware::Bios,
        Duration::from_secs(300),
        "chainloaded BIOS boot to ready",
        |n| n["state"] == "ready",
    )
    .await;
    eprintln!(
        "e2e: BIOS ROM -> TFTP undionly.kpxe power-on to ready {:?} (QEMU TCG)",
        vm.powered.elapsed()
    );
    // The screen, as SeaBIOS copied it: the ROM's iPXE, then ours on the UNDI driver.
    let serial = vm.serial();
    let rom = serial.find("using virtio-net").expect("the ROM's iPXE ran");
    let undi = serial[rom..]
        .find("undionly.kpxe")
        .map(|at| rom + at)
        .unwrap_or_else(|| panic!("the ROM did not fetch undionly.kpxe:\n{serial}"));
    assert!(
        serial[undi..].contains("using undionly"),
        "undionly.kpxe did not take over the NIC:\n{serial}"
    );
    assert_eq!(node["boots"].as_array().unwrap().len(), 1, "{node}");
    let steps = strings(&node["boots"][0]["steps"], "step");
    assert_eq!(steps.last(), Some(&"validated"), "{node}");
    // The chainload is on the timeline: the ROM's DHCP, the TFTP transfer of
    // undionly.kpxe, then DHCP again from our iPXE, then the script.
    let at = |name: &str| steps.iter().position(|s| *s == name);
    let tftp = at("tftp undionly.kpxe").unwrap_or_else(|| panic!("no TFTP step: {node}"));
    assert!(tftp < at("script").unwrap(), "{node}");
    assert!(
        steps[..tftp].iter().any(|s| s.contains("dhcp ack")),
        "{node}"
    );
    server.stop().await;
}

/// (c) UEFI: OVMF's own PXE gets snponly.efi over TFTP from bootfleet, iPXE asks DHCP
/// again (now as iPXE) and boots the script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uefi_vm_pxe_boots_ipxe_over_tftp_then_the_image_to_ready() {
    require();
    assert!(
        Path::new("/usr/share/OVMF/OVMF_CODE_4M.fd").exists(),
        "OVMF is missing: apt-get install ovmf"
    );
    let n = segment_number(1);
    let (_d, dir) = built("1", "").await;
    let (mut segment, server) = lab(n, bootfleet::dhcp::decide::Mode::Authoritative).await;
    let mac = format!("52:54:00:e2:{n:02x}:02");
    publish_and_assign(&server, &dir, &mac).await;
    let (node, vm) = boot_until(
        &mut segment,
        &server,
        &mac,
        Firmware::Uefi,
        Duration::from_secs(300),
        "UEFI boot to ready",
        |n| n["state"] == "ready",
    )
    .await;
    eprintln!(
        "e2e: UEFI PXE -> TFTP snponly.efi power-on to ready {:?} (QEMU TCG); steps: {}",
        vm.powered.elapsed(),
        steps_took(&node)
    );
    // OVMF's PXE fetched snponly.efi over TFTP (not its HTTP-boot fallback), and that
    // iPXE drove the NIC through the firmware's SNP.
    let serial = vm.serial();
    for seen in [
        "Start PXE over IPv4",
        "NBP filename is snponly.efi",
        "using SNP",
    ] {
        assert!(
            serial.contains(seen),
            "{seen:?} not on the console:\n{serial}"
        );
    }
    assert!(
        !serial.contains("HTTP Boot"),
        "OVMF fell back to HTTP boot:\n{serial}"
    );
    server.stop().await;
}

/// Changes one byte of the version string of `image`'s kernel blob in place (same size;
/// it still boots, but it is no longer the blob its digest names, nor what Debian
/// signed), behind the server's back. Returns the new bytes.
async fn swap_kernel(server: &TestServer, image: &Value) -> Vec<u8> {
    let kernel = crate::objects::kernel_digest(server, image["digest"].as_str().unwrap()).await;
    let kernel = kernel.trim_start_matches("sha256:");
    let blob = server.blob_dir().join(kernel);
    let mut bytes = std::fs::read(&blob).unwrap();
    let at = bytes
        .windows(13)
        .position(|w| w == b"debian-kernel")
        .expect("the kernel's version string");
    bytes[at] = b'D';
    std::fs::write(&blob, &bytes).unwrap();
    bytes
}

/// The newest boot's steps and what each took, for the log.
fn steps_took(node: &Value) -> String {
    node["boots"][0]["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| format!("{} {} ms", s["step"].as_str().unwrap_or("?"), s["took_ms"]))
        .collect::<Vec<_>>()
        .join(", ")
}

/// (c') UEFI with a TPM (swtpm, EK certificate from its local CA): OVMF measures iPXE and
/// the kernel, the agent quotes, and the boot is attested with TPM evidence. Then the
/// kernel blob the firmware loads is swapped behind the server's back (one harmless byte
/// of its version string): the node boots it, its agent reports exactly the expected
/// facts, and attestation fails naming PCR 4 and the swapped kernel's digest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uefi_vm_with_a_tpm_is_attested_by_its_quote_and_a_swapped_kernel_fails_on_pcr_4() {
    require();
    let ca = crate::tpm::Ca::new();
    let mut tpm = crate::tpm::Swtpm::new(&ca);
    let n = segment_number(6);
    let (_d, dir) = built("1", "TPM=1").await;
    let files = ca.files();
    let (mut segment, server) = lab_with(
        n,
        bootfleet::dhcp::decide::Mode::Authoritative,
        Default::default(),
        move |cfg| {
            cfg.tpm.policy = bootfleet::tpm::TpmPolicy::Required;
            cfg.tpm.ek_ca_files = files;
        },
    )
    .await;
    let mac = format!("52:54:00:e2:{n:02x}:06");
    let image = publish_and_assign(&server, &dir, &mac).await;
    segment.extra_args = tpm.for_qemu();
    let (node, vm) = boot_until(
        &mut segment,
        &server,
        &mac,
        Firmware::Uefi,
        Duration::from_secs(300),
        "UEFI boot with a TPM to ready",
        |n| n["state"] == "ready" || n["state"] == "attestation-failed",
    )
    .await;
    eprintln!(
        "e2e: UEFI + swtpm power-on to attested {:?} (QEMU TCG); steps: {}; agent: {}",
        vm.powered.elapsed(),
        steps_took(&node),
        vm.serial()
            .lines()
            .find(|l| l.contains("tpm: quoted in"))
            .unwrap_or("(no TPM timing)")
    );
    assert_eq!(node["state"], "ready", "{node}\n{}", vm.serial());
    let findings = &node["boots"][0]["tpm"];
    let matched: Vec<&str> = findings["measurements"]
        .as_array()
        .unwrap_or_else(|| panic!("no TPM findings: {node}"))
        .iter()
        .filter_map(|m| m["matched"].as_str())
        .collect();
    assert_eq!(matched.first(), Some(&"snponly.efi"), "{findings}");
    assert_eq!(matched.last(), Some(&"kernel vmlinuz"), "{findings}");

    // Swap the kernel blob in place: same size, one byte of the version string.
    segment.power_off();
    let swapped = crate::tpm::authenticode(&swap_kernel(&server, &image).await);
    segment.extra_args = tpm.for_qemu();
    let (node, vm) = boot_until(
        &mut segment,
        &server,
        &mac,
        Firmware::Uefi,
        Duration::from_secs(300),
        "UEFI boot of a swapped kernel to a verdict",
        // The second boot was judged.
        |n| {
            n["boots"].as_array().is_some_and(|b| {
                b.len() >= 2
                    && b[0]["steps"]
                        .as_array()
                        .is_some_and(|s| s.iter().any(|s| s["step"] == "attested"))
            })
        },
    )
    .await;
    assert_eq!(
        node["state"],
        "attestation-failed",
        "{node}\n{}",
        vm.serial()
    );
    let outcome = node["boots"][0]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["step"] == "attested")
        .map(|s| s["outcome"].as_str().unwrap().to_string())
        .unwrap_or_default();
    assert!(
        outcome.contains("tpm.pcr4") && outcome.contains(&hex::encode(swapped)),
        "{outcome}"
    );
    server.stop().await;
}

/// (c'') UEFI Secure Boot on (OVMF with Microsoft's keys enrolled): OVMF loads Debian's
/// signed shim over TFTP, shim the signed network GRUB, GRUB its configuration from
/// bootfleet (`grub/grub.cfg`, then the node's `boot/node.grub`) and the image's
/// Debian-signed kernel and initrd over TFTP: the node boots to ready. Then the kernel
/// blob is swapped behind the server's back (one byte of its version string): GRUB
/// refuses it (its signature no longer verifies) and the node's timeline stops after
/// the kernel's transfer, unattested.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_boot_vm_boots_the_signed_chain_and_a_tampered_kernel_is_refused() {
    require();
    const SHIM: &str = "/usr/lib/shim/shimx64.efi.signed";
    const GRUB: &str = "/usr/lib/grub/x86_64-efi-signed/grubnetx64.efi.signed";
    for (file, package) in [
        (SHIM, "shim-signed"),
        (GRUB, "grub-efi-amd64-signed"),
        ("/usr/share/OVMF/OVMF_CODE_4M.ms.fd", "ovmf"),
    ] {
        assert!(
            Path::new(file).exists(),
            "{file} is missing: apt-get install {package}"
        );
    }
    // The TFTP directory: shim as the boot file, GRUB under the name shim asks for.
    let tftp = tempfile::tempdir().unwrap();
    std::fs::copy(SHIM, tftp.path().join("shimx64.efi")).unwrap();
    std::fs::copy(GRUB, tftp.path().join("grubx64.efi")).unwrap();
    let n = segment_number(7);
    let (_d, dir) = built("1", "").await;
    let tftp_dir = tftp.path().to_path_buf();
    let (mut segment, server) = lab_with(
        n,
        bootfleet::dhcp::decide::Mode::Authoritative,
        Default::default(),
        move |cfg| {
            cfg.ipxe_dir = tftp_dir;
            cfg.dhcp.files.uefi_x64 = "shimx64.efi".into();
        },
    )
    .await;
    let mac = format!("52:54:00:e2:{n:02x}:07");
    let image = publish_and_assign(&server, &dir, &mac).await;
    segment.secure_boot = true;
    let (node, vm) = boot_until(
        &mut segment,
        &server,
        &mac,
        Firmware::Uefi,
        Duration::from_secs(300),
        "Secure Boot through shim and GRUB to ready",
        |n| n["state"] == "ready",
    )
    .await;
    eprintln!(
        "e2e: Secure Boot, shim -> GRUB -> signed kernel, power-on to ready {:?} (QEMU TCG); steps: {}",
        vm.powered.elapsed(),
        steps_took(&node)
    );
    let serial = vm.serial();
    for seen in [
        "NBP filename is shimx64.efi",
        "Fetching Netboot Image grubx64.efi",
        "secureboot: Secure boot enabled",
    ] {
        assert!(
            serial.contains(seen),
            "{seen:?} not on the console:\n{serial}"
        );
    }

    // The same blob, one byte changed: no longer what Debian signed.
    segment.power_off();
    swap_kernel(&server, &image).await;
    let vm = Vm {
        logs: tempfile::tempdir().unwrap(),
        powered: Instant::now(),
    };
    segment.power_on_uefi(&mac, &vm.log(), &vm.logs.path().join("vars.fd"));
    let refused = Instant::now();
    while !vm.serial().contains("bad shim signature") {
        assert!(
            refused.elapsed() < Duration::from_secs(300),
            "GRUB did not refuse the kernel:\n{}",
            vm.serial()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The timeline shows where it stopped: the kernel arrived whole, and nothing came
    // after it (GRUB's initrd command needs a loaded kernel).
    let (_, node) = server.json(&format!("/api/v1/nodes/{mac}")).await;
    let boot = &node["boots"][0];
    assert_eq!(boot["stopped_at"], "initrd initrd.img", "{boot}");
    let kernel_step = boot["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["step"] == "kernel")
        .unwrap_or_else(|| panic!("no kernel step: {boot}"));
    assert_eq!(kernel_step["outcome"], "ok", "{boot}");
    assert_ne!(node["state"], "ready", "{node}");
    server.stop().await;
}

/// (d) proxyDHCP next to the site's DHCP server (dnsmasq, addresses only): the VM gets
/// its address from dnsmasq and its boot information from bootfleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_dhcp_next_to_a_site_dhcp_server_still_boots_to_ready() {
    require();
    let n = segment_number(2);
    let (_d, dir) = built("1", "").await;
    let (mut segment, server) = lab(n, bootfleet::dhcp::decide::Mode::Proxy).await;
    segment.site(
        n,
        &format!("10.88.{n}.2"),
        &format!("exec dnsmasq --keep-in-foreground --port=0 --interface=eth0 --bind-interfaces --dhcp-range=10.88.{n}.50,10.88.{n}.60,1h --dhcp-leasefile=/dev/null --no-ping"),
    );
    let mac = format!("52:54:00:e2:{n:02x}:03");
    publish_and_assign(&server, &dir, &mac).await;
    let (_, vm) = boot_until(
        &mut segment,
        &server,
        &mac,
        Firmware::Bios,
        Duration::from_secs(240),
        "proxy-mode boot to ready",
        |n| n["state"] == "ready",
    )
    .await;
    let serial = vm.serial();
    assert!(
        serial.contains(&format!("obtained from 10.88.{n}.2")),
        "the address came from the site's server"
    );
    server.stop().await;
}

/// (f) Drift: the node loads a module after it attested; the next heartbeat reports it
/// and the node becomes drifted, with the difference named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_changes_after_attesting_is_drifted_with_the_difference() {
    require();
    let n = segment_number(3);
    let (_d, dir) = built("1", "LATE_MODULE=dummy").await;
    let (mut segment, server) = lab(n, bootfleet::dhcp::decide::Mode::Authoritative).await;
    let mac = format!("52:54:00:e2:{n:02x}:04");
    publish_and_assign(&server, &dir, &mac).await;
    let (node, _vm) = boot_until(
        &mut segment,
        &server,
        &mac,
        Firmware::Bios,
        Duration::from_secs(300),
        "drifted",
        |n| n["state"] == "drifted",
    )
    .await;
    let reason = node["state_reason"].as_str().unwrap();
    assert!(
        reason.contains("modules.dummy: was (absent), now"),
        "{reason}"
    );
    let history = node["history"].as_array().unwrap();
    assert!(
        history.iter().any(|h| h["to"] == "ready"),
        "it was ready before it drifted"
    );
    server.stop().await;
}

/// The chassis of a QEMU machine on the segment's tap, for `ipmi_sim` (see tests/it/ipmi.rs):
/// power 1 starts the machine, power 0 kills it, and the boot device set through IPMI
/// holds for the next power-on only, as on a real BMC. Without a network boot set, the
/// machine boots its (absent) disk and stays in its firmware.
fn qemu_chassis(qemu_args: &[String]) -> String {
    let args: Vec<String> = qemu_args.iter().map(|a| format!("'{a}'")).collect();
    format!(
        r#"#!/bin/sh
D=$(dirname "$0"); op=$1; shift
alive() {{ pid=$(cat "$D/qemu.pid" 2>/dev/null) && grep -qs '^State:[[:space:]]*[^Z]' /proc/$pid/status; }}
if [ "$op" = get ]; then
  for what; do case $what in
    power) if alive; then echo power:1; else echo power:0; fi ;;
    boot) echo "boot:$(cat "$D/boot" 2>/dev/null || echo none)" ;;
  esac; done
  exit 0
fi
while [ $# -gt 1 ]; do
  echo "$1 $2" >> "$D/chassis.log"
  case $1 in
    boot) echo "$2" > "$D/boot" ;;
    power) if [ "$2" = 1 ]; then
        if ! alive; then
          order=c; [ "$(cat "$D/boot" 2>/dev/null)" = pxe ] && order=n; rm -f "$D/boot"
          echo "started boot order=$order" >> "$D/chassis.log"
          setsid sh -c 'echo $$ > "$0/qemu.pid"; exec "$@"' "$D" qemu-system-x86_64 {} -boot order=$order </dev/null >/dev/null 2>&1 &
        fi
      elif alive; then
        kill "$pid"; i=0
        while alive && [ $i -lt 30 ]; do sleep 0.1; i=$((i+1)); done
        kill -9 "$pid" 2>/dev/null
      fi ;;
  esac
  shift 2
done
"#,
        args.join(" ")
    )
}

/// (g) A hung node: the kernel is up but the agent is stopped, so no heartbeat comes and
/// no reboot is asked for. `reimage` then reaches it through its BMC (OpenIPMI's ipmi_sim
/// owning the QEMU machine): a one-time network boot, a power cycle, and the machine boots
/// the new digest to ready. The first power-on goes through the BMC as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_node_is_power_cycled_through_its_bmc_into_the_new_image() {
    require();
    let n = segment_number(5);
    let ((_d1, v1_dir), (_d2, v2_dir)) = (built("1", "HANG_AFTER=10").await, built("2", "").await);
    let (segment, server) = lab_with(
        n,
        bootfleet::dhcp::decide::Mode::Authoritative,
        Default::default(),
        |cfg| cfg.budget.agent_grace_secs = 5,
    )
    .await;
    let mac = format!("52:54:00:e2:{n:02x}:05");
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("serial.log");
    let sim = crate::ipmi::IpmiSim::start(&qemu_chassis(&segment.bios_vm_args(&mac, &log)));
    crate::ipmi::write_credentials(server.data.path(), &[("bmc", crate::ipmi::PASSWORD)]);
    let r = server
        .put(&format!("/api/v1/nodes/{mac}/bmc"))
        .json(&json!({
            "protocol": "ipmi",
            "address": sim.address(),
            "credential": "bmc",
            "quirks": ["boot-valid-unreported"],
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let v1 = publish_and_assign(&server, &v1_dir, &mac).await;
    let power = |action: &'static str, reason: &'static str| {
        server
            .post(&format!("/api/v1/nodes/{mac}/power"))
            .json(&json!({ "action": action, "reason": reason }))
            .send()
    };
    let r = power("on", "first boot").await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let node = wait_for(
        &server,
        &mac,
        &log,
        Duration::from_secs(300),
        "first boot to ready, powered on through the BMC",
        |n| n["state"] == "ready",
    )
    .await;
    assert_eq!(node["boots"][0]["image"], v1["digest"]);
    let steps = strings(&node["boots"][0]["steps"], "step");
    assert_eq!(steps[0], "power on (bmc)", "{node}");

    // The agent stops: a hung node.
    let hung = Instant::now();
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("agent stopped (hung node)")
    {
        assert!(
            hung.elapsed() < Duration::from_secs(120),
            "the agent never stopped"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let v2 = roll_out(&server, &v2_dir, &mac, "roll out demo:2 to a hung node").await;
    let v2_digest = v2["digest"].clone();
    let node = wait_for(
        &server,
        &mac,
        &log,
        Duration::from_secs(300),
        "power cycle through the BMC to ready on demo:2",
        |n| n["state"] == "ready" && n["boots"][0]["image"] == v2_digest,
    )
    .await;
    // The new boot opens with the power cycle; the record names the fallback's reason.
    let steps = strings(&node["boots"][0]["steps"], "step");
    assert_eq!(steps[0], "power cycle (bmc)", "{node}");
    let cycle = node["power"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["action"] == "cycle")
        .unwrap_or_else(|| panic!("no cycle recorded: {node}"));
    assert_eq!(cycle["outcome"], "ok", "{node}");
    assert!(
        cycle["reason"]
            .as_str()
            .unwrap()
            .starts_with("reimage fallback"),
        "{node}"
    );
    let history = node["history"].as_array().unwrap();
    let reimage = history.iter().find(|h| h["to"] == "reimaging").unwrap();
    assert!(
        reimage["reason"]
            .as_str()
            .unwrap()
            .contains("roll out demo:2 to a hung node"),
        "{node}"
    );
    // What the BMC was told: network boot and on; then network boot, off, on.
    let chassis = std::fs::read_to_string(sim.dir.path().join("chassis.log")).unwrap();
    let told: Vec<&str> = chassis.lines().collect();
    assert_eq!(
        told,
        [
            "boot pxe",
            "power 1",
            "started boot order=n",
            "boot pxe",
            "power 0",
            "power 1",
            "started boot order=n"
        ],
        "{chassis}"
    );
    eprintln!(
        "e2e: hung node, reimage to ready on demo:2 through an IPMI power cycle {:?}",
        hung.elapsed()
    );
    drop(sim);
    server.stop().await;
}
