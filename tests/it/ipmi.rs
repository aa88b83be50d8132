//! Power control over IPMI against OpenIPMI's `ipmi_sim` (Debian `openipmi`), through the
//! real binary, CLI and Debian's `ipmitool`. Each test starts its own `ipmi_sim` on a
//! loopback UDP port; its chassis is a `chassis_control` program (lanserv's protocol:
//! `get power boot`, `set power 1 boot pxe ...`), here a small shell script that keeps
//! the machine's power and boot device in files, or one that starts and kills a QEMU
//! machine (the hung-node test in e2e.rs).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::{ServerProcess, cli, cli_json};

/// The password the simulated BMC accepts; tests grep for it where it must not be.
pub const PASSWORD: &str = "ipmi-pw-51d0e2";

/// A chassis of files: `power` (0 or 1) and `boot`; every `set` is appended to
/// `chassis.log` as `NAME VALUE`. A graceful shutdown turns it off like an OS would.
pub const FILE_CHASSIS: &str = r#"#!/bin/sh
D=$(dirname "$0"); op=$1; shift
if [ "$op" = get ]; then
  for p; do case $p in
    power) echo "power:$(cat "$D/power" 2>/dev/null || echo 0)" ;;
    boot) echo "boot:$(cat "$D/boot" 2>/dev/null || echo none)" ;;
  esac; done
  exit 0
fi
while [ $# -gt 1 ]; do
  echo "$1 $2" >> "$D/chassis.log"
  case $1 in
    power) echo "$2" > "$D/power" ;;
    shutdown) echo 0 > "$D/power" ;;
    boot) echo "$2" > "$D/boot" ;;
  esac
  shift 2
done
"#;

/// One `ipmi_sim` process: a BMC at `127.0.0.1:port` with user `admin`.
pub struct IpmiSim {
    pub port: u16,
    pub dir: tempfile::TempDir,
    child: Child,
}

fn require() {
    for (tool, package) in [("ipmi_sim", "openipmi"), ("ipmitool", "ipmitool")] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .unwrap()
            .status
            .success();
        assert!(found, "{tool} is missing: apt-get install {package}");
    }
}

impl IpmiSim {
    /// Starts a BMC whose chassis is the program `chassis` (its text, written to
    /// `DIR/chassis`; it finds its files next to itself). Waits until it answers.
    pub fn start(chassis: &str) -> Self {
        require();
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::Builder::new()
            .prefix("bootfleet-ipmi-")
            .tempdir()
            .unwrap();
        let d = dir.path();
        let program = d.join("chassis");
        std::fs::write(&program, chassis).unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::create_dir(d.join("state")).unwrap();
        let port = std::net::UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // ipmi_lan(5): one LAN channel on loopback, one admin user; the chassis is the
        // program (ipmi_sim_chassiscontrol), which ipmi_sim runs for every get and set.
        let auths = "none md2 md5 straight";
        let lan = format!(
            "name \"bmc{port}\"\nset_working_mc 0x20\n  startlan 1\n    addr 127.0.0.1 {port}\n    priv_limit admin\n\
             {}    guid a123456789abcdefa123456789abcdef\n  endlan\n  chassis_control \"{}\"\n\
             user 2 true \"admin\" \"{PASSWORD}\" admin 10 {auths}\n",
            ["callback", "user", "operator", "admin"]
                .iter()
                .map(|p| format!("    allowed_auths_{p} {auths}\n"))
                .collect::<String>(),
            program.display()
        );
        std::fs::write(d.join("lan.conf"), lan).unwrap();
        // ipmi_sim_cmd(5): one BMC at IPMB 0x20 with a chassis device.
        std::fs::write(
            d.join("bmc.emu"),
            "mc_setbmc 0x20\nmc_add 0x20 0 no-device-sdrs 0x23 9 8 0x9f 0x1291 0xf02\nmc_enable 0x20\n",
        )
        .unwrap();
        let log = std::fs::File::create(d.join("ipmi_sim.log")).unwrap();
        // -n: no console (it would read commands from stdin).
        let child = Command::new("ipmi_sim")
            .arg("-c")
            .arg(d.join("lan.conf"))
            .arg("-f")
            .arg(d.join("bmc.emu"))
            .arg("-s")
            .arg(d.join("state"))
            .arg("-n")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("ipmi_sim starts (apt-get install openipmi)");
        let sim = Self { port, dir, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !sim.ipmitool(&["mc", "guid"]).0 {
            assert!(
                Instant::now() < deadline,
                "ipmi_sim did not answer: {}",
                std::fs::read_to_string(sim.dir.path().join("ipmi_sim.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        sim
    }

    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `ipmitool` against this BMC as the admin: (success, stdout).
    pub fn ipmitool(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new("ipmitool")
            .args(["-I", "lanplus", "-C", "3", "-N", "1", "-R", "1", "-H"])
            .arg("127.0.0.1")
            .args(["-p", &self.port.to_string(), "-U", "admin", "-E"])
            .args(args)
            .env("IPMI_PASSWORD", PASSWORD)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    /// What the chassis program was told, in order (`FILE_CHASSIS`'s log).
    pub fn chassis_log(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("chassis.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Waits until the chassis log holds `want` (in order) after the first `from` entries.
    /// A boot-device setting that repeats the one set earlier in the same steps counts
    /// once: IPMI runs over UDP, and a request retransmitted after a slow answer (a
    /// loaded machine) can be carried out again, even after the next command; setting
    /// the same device again changes nothing.
    pub fn wait_chassis(&self, from: usize, want: &[&str]) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let log = self.chassis_log();
            let mut boot: Option<&str> = None;
            let tail: Vec<&str> = log
                .iter()
                .skip(from)
                .map(String::as_str)
                .filter(|e| {
                    if !e.starts_with("boot ") {
                        return true;
                    }
                    let again = boot == Some(*e);
                    boot = Some(e);
                    !again
                })
                .collect();
            if tail == want {
                return log;
            }
            assert!(
                Instant::now() < deadline,
                "chassis saw {tail:?}, not {want:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for IpmiSim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A machine the chassis program started (e2e.rs) goes with its BMC.
        if let Ok(pid) = std::fs::read_to_string(self.dir.path().join("qemu.pid")) {
            let _ = Command::new("kill").args(["-9", pid.trim()]).status();
        }
    }
}

/// A data directory whose secrets directory has the credentials `good` and `bad`, and a
/// settings file with `extra` in it.
fn data_dir(extra: &str) -> (tempfile::TempDir, PathBuf) {
    let data = tempfile::tempdir().unwrap();
    write_credentials(
        data.path(),
        &[("good", PASSWORD), ("bad", "not-the-password")],
    );
    let config = data.path().join("bootfleet.toml");
    std::fs::write(
        &config,
        format!("[power]\ntimeout_secs = 4\nstarts_per_minute = 6000\n{extra}"),
    )
    .unwrap();
    (data, config)
}

/// Writes `(name, password)` credentials for user `admin` into `data`/secrets, mode 0600.
pub fn write_credentials(data: &Path, creds: &[(&str, &str)]) {
    use std::os::unix::fs::PermissionsExt;
    let secrets = data.join("secrets");
    std::fs::create_dir_all(&secrets).unwrap();
    for (name, pw) in creds {
        let p = secrets.join(name);
        std::fs::write(&p, format!("username = \"admin\"\npassword = \"{pw}\"\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
}

const MAC: &str = "52:54:00:cc:00:01";

#[test]
fn ipmi_status_on_off_cycle_and_one_time_network_boot_against_ipmi_sim() {
    let sim = IpmiSim::start(FILE_CHASSIS);
    let (data, config) = data_dir("");
    let server = ServerProcess::spawn_configured(data.path(), Some(&config));
    let d = data.path();
    let addr = sim.address();
    let set = |extra: &[&str]| {
        let mut args = vec!["node", "bmc", "set", MAC, "--ipmi", &addr];
        args.extend_from_slice(extra);
        let (ok, _, err) = cli(&server, d, &args);
        assert!(ok, "bmc set: {err}");
    };
    set(&["--credential", "good"]);

    let status = cli_json(&server, d, &["node", "power", "status", MAC]);
    assert_eq!(status[0]["answer"]["state"], "off", "{status}");
    // The system GUID, as `ipmitool mc guid` reads it from the same BMC.
    let (ok, guid) = sim.ipmitool(&["mc", "guid"]);
    assert!(
        ok && guid.contains("efcdab89-6745-23a1-efcd-ab89674523a1"),
        "{guid}"
    );
    assert_eq!(
        status[0]["answer"]["inventory"]["uuid"], "efcdab89-6745-23a1-efcd-ab89674523a1",
        "{status}"
    );
    // Every call closes its session: ipmi_sim holds 63 at once (the 64th open is refused,
    // measured), and 70 calls go through.
    for _ in 0..70 {
        let again = cli_json(&server, d, &["node", "power", "status", MAC]);
        assert_eq!(again[0]["answer"]["state"], "off", "{again}");
    }
    assert_eq!(
        status[0]["answer"]["bmc"],
        format!("ipmi {addr}"),
        "{status}"
    );

    // ipmi_sim keeps only the boot device selector: without the quirk named, the
    // read-back refuses it and the machine is not powered on into an unknown boot.
    let (ok, stdout, _) = cli(
        &server,
        d,
        &["node", "power", "on", MAC, "--reason", "first boot"],
    );
    assert!(!ok, "{stdout}");
    assert!(
        stdout.contains("the BMC accepted a one-time network boot but reads back pxe once"),
        "{stdout}"
    );
    assert_eq!(sim.chassis_log(), ["boot pxe"], "no power-on followed");

    set(&["--credential", "good", "--quirk", "boot-valid-unreported"]);
    let show = cli_json(&server, d, &["node", "show", MAC]);
    assert_eq!(
        show["bmc"]["quirks"],
        serde_json::json!(["boot-valid-unreported"]),
        "{show}"
    );
    let on = cli_json(
        &server,
        d,
        &["node", "power", "on", MAC, "--reason", "first boot"],
    );
    assert_eq!(on[0]["answer"]["netboot"], "pxe once", "{on}");
    sim.wait_chassis(1, &["boot pxe", "power 1"]);
    let status = cli_json(&server, d, &["node", "power", "status", MAC]);
    assert_eq!(status[0]["answer"]["state"], "on", "{status}");

    // A cycle: the boot device first, then off and on again (ipmi_sim turns it back on a
    // second later); the node is counted by the budget as reimaging.
    let cycle = cli_json(
        &server,
        d,
        &["node", "power", "cycle", MAC, "--reason", "hung kernel"],
    );
    assert_eq!(cycle[0]["answer"]["node_state"], "reimaging", "{cycle}");
    sim.wait_chassis(3, &["boot pxe", "power 0", "power 1"]);

    // Graceful and forced off, no network boot for either.
    let soft = cli_json(
        &server,
        d,
        &["node", "power", "soft-off", MAC, "--reason", "drain"],
    );
    assert_eq!(
        soft[0]["answer"]["netboot"],
        serde_json::Value::Null,
        "{soft}"
    );
    sim.wait_chassis(6, &["shutdown 1"]);
    assert_eq!(
        cli_json(&server, d, &["node", "power", "status", MAC])[0]["answer"]["state"],
        "off"
    );
    let show = cli_json(&server, d, &["node", "show", MAC]);
    let actions: Vec<(&str, &str)> = show["power"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["action"].as_str().unwrap(),
                p["outcome"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(actions.len(), 4, "{show}");
    assert_eq!(
        &actions[..3],
        [("soft-off", "ok"), ("cycle", "ok"), ("on", "ok")]
    );
    assert!(actions[3].1.contains("reads back pxe once"), "{show}");
}

#[test]
fn ipmi_failures_are_named_and_the_password_is_nowhere() {
    let sim = IpmiSim::start(FILE_CHASSIS);
    let (data, config) = data_dir("");
    let server = ServerProcess::spawn_configured(data.path(), Some(&config));
    let d = data.path();
    let closed = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let cases = [
        (sim.address(), "bad", "refused the credentials"),
        (format!("127.0.0.1:{closed}"), "good", "unreachable"),
        (sim.address(), "missing", "secret \"missing\""),
    ];
    for (i, (address, credential, want)) in cases.iter().enumerate() {
        let mac = format!("52:54:00:cc:01:{i:02x}");
        let (ok, _, err) = cli(
            &server,
            d,
            &[
                "node",
                "bmc",
                "set",
                &mac,
                "--ipmi",
                address,
                "--credential",
                credential,
            ],
        );
        assert!(ok, "{err}");
        let (ok, stdout, stderr) = cli(
            &server,
            d,
            &["node", "power", "cycle", &mac, "--reason", "test"],
        );
        assert!(!ok, "case {i} should fail: {stdout}");
        assert!(
            stdout.contains(want),
            "case {i}: want {want:?} in {stdout} {stderr}"
        );
        let show = cli_json(&server, d, &["node", "show", &mac]);
        assert_eq!(show["state"], "discovered", "case {i}: the node changed");
        assert!(
            show["power"][0]["outcome"].as_str().unwrap().contains(want),
            "case {i}: {show}"
        );
    }
    assert!(
        sim.chassis_log().is_empty(),
        "the chassis was never touched"
    );
    // The password is in neither the answers, the events, the log nor the database.
    let mut seen = cli_json(&server, d, &["node", "list"]).to_string();
    for i in 0..cases.len() {
        let mac = format!("52:54:00:cc:01:{i:02x}");
        seen += &cli_json(&server, d, &["node", "show", &mac]).to_string();
        seen += &cli_json(&server, d, &["node", "events", &mac]).to_string();
    }
    seen += &server.log_lines().join("\n");
    seen += &String::from_utf8_lossy(&std::fs::read(d.join("bootfleet.db")).unwrap());
    if let Ok(wal) = std::fs::read(d.join("bootfleet.db-wal")) {
        seen += &String::from_utf8_lossy(&wal);
    }
    assert!(
        seen.contains("node.power"),
        "the check looked at the events"
    );
    for secret in [PASSWORD, "not-the-password"] {
        assert!(!seen.contains(secret), "{secret} leaked");
    }
}
