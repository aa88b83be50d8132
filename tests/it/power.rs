//! Power control against real BMC emulators: sushy-tools' Redfish emulator (fake driver,
//! over HTTPS with a certificate of our own CA) driven through the real binary and CLI.
//! The emulator is started once for this test binary and shared; each test uses systems
//! of its own. The test command installs sushy-tools into a venv (scripts/test).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use crate::process::{ServerProcess, cli, cli_json};

/// The password the emulator accepts; tests grep for it everywhere it must not be.
const PASSWORD: &str = "bmc-pw-7f3a9c";
/// Systems the shared emulator has: one per test that needs one.
const SYSTEMS: usize = 8;

pub struct Sushy {
    pub port: u16,
    pub dir: PathBuf,
    /// SHA-256 of the emulator's certificate (DER), hex.
    pub fingerprint: String,
}

static SHARED: OnceLock<Sushy> = OnceLock::new();

fn emulator_bin() -> PathBuf {
    super::harness::venv_tool(
        "sushy",
        "sushy-emulator",
        "sushy-tools 2.2.0",
        "BOOTFLEET_SUSHY_EMULATOR",
    )
}

fn sh(dir: &Path, script: &str) {
    let out = Command::new("sh")
        .args(["-c", script])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The system UUID of system `n` of the shared emulator.
pub fn system_uuid(n: usize) -> String {
    format!("00000000-0000-4000-8000-{n:012}")
}

pub fn shared() -> &'static Sushy {
    SHARED.get_or_init(start)
}

fn start() -> Sushy {
    let bin = emulator_bin();
    let dir = tempfile::Builder::new()
        .prefix("bootfleet-sushy-")
        .tempdir()
        .unwrap()
        .keep();
    // A CA of our own and a leaf for 127.0.0.1 that it signed.
    sh(
        &dir,
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.pem -days 30 -subj /CN=bootfleet-test-ca 2>/dev/null && \
         openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout bmc.key -out bmc.csr -subj /CN=127.0.0.1 2>/dev/null && \
         printf 'subjectAltName=IP:127.0.0.1\\nbasicConstraints=CA:FALSE\\n' > ext && \
         openssl x509 -req -in bmc.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out bmc.pem -days 30 -extfile ext 2>/dev/null && \
         openssl x509 -in bmc.pem -outform der | sha256sum | cut -d' ' -f1 > bmc.fp",
    );
    let python = bin.parent().unwrap().join("python");
    let hash = Command::new(&python)
        .args([
            "-c",
            &format!(
                "import bcrypt; print(bcrypt.hashpw(b'{PASSWORD}', bcrypt.gensalt(4)).decode())"
            ),
        ])
        .output()
        .unwrap();
    assert!(
        hash.status.success(),
        "bcrypt: {}",
        String::from_utf8_lossy(&hash.stderr)
    );
    std::fs::write(
        dir.join("htpasswd"),
        format!("admin:{}\n", String::from_utf8_lossy(&hash.stdout).trim()),
    )
    .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let systems: Vec<String> = (0..SYSTEMS)
        .map(|n| {
            format!(
                "{{'uuid': '{}', 'name': 'node{n}', 'power_state': 'On', 'nics': [{{'mac': '52:54:00:aa:00:{n:02x}', 'ip': '127.0.0.1'}}]}}",
                system_uuid(n)
            )
        })
        .collect();
    let d = dir.display();
    std::fs::write(
        dir.join("sushy.conf"),
        format!(
            "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'\nSUSHY_EMULATOR_LISTEN_PORT = {port}\n\
             SUSHY_EMULATOR_SSL_CERT = '{d}/bmc.pem'\nSUSHY_EMULATOR_SSL_KEY = '{d}/bmc.key'\n\
             SUSHY_EMULATOR_AUTH_FILE = '{d}/htpasswd'\nSUSHY_EMULATOR_FAKE_DRIVER = True\n\
             SUSHY_EMULATOR_STATE_DIR = '{d}/state'\n\
             SUSHY_EMULATOR_FAKE_SYSTEMS = [{}]\n",
            systems.join(", ")
        ),
    )
    .unwrap();
    // A watchdog stops the emulator and removes its files once this test binary is gone.
    let script = format!(
        "{bin} --config {d}/sushy.conf --fake >>{d}/log 2>&1 & s=$!; \
         while [ -d /proc/{me} ]; do sleep 0.5; done; kill $s 2>/dev/null; wait $s; rm -rf {d}",
        bin = bin.display(),
        me = std::process::id(),
    );
    crate::harness::run_detached(Command::new("sh"), &script, "sushy-emulator");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "sushy-emulator did not start: {}",
            std::fs::read_to_string(dir.join("log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let fingerprint = std::fs::read_to_string(dir.join("bmc.fp"))
        .unwrap()
        .trim()
        .to_string();
    Sushy {
        port,
        dir,
        fingerprint,
    }
}

impl Sushy {
    pub fn url(&self, system: usize) -> String {
        format!(
            "https://127.0.0.1:{}/redfish/v1/Systems/{}",
            self.port,
            system_uuid(system)
        )
    }
}

/// A data directory with the credentials `good` (right password) and `bad`, and the CA,
/// in its secrets directory; and a settings file with `extra` in it.
fn data_dir(extra: &str) -> (tempfile::TempDir, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let data = tempfile::tempdir().unwrap();
    let secrets = data.path().join("secrets");
    std::fs::create_dir(&secrets).unwrap();
    for (name, pw) in [("good", PASSWORD), ("bad", "not-the-password")] {
        let p = secrets.join(name);
        std::fs::write(&p, format!("username = \"admin\"\npassword = \"{pw}\"\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    std::fs::copy(shared().dir.join("ca.pem"), secrets.join("ca.pem")).unwrap();
    let config = data.path().join("bootfleet.toml");
    std::fs::write(
        &config,
        format!("[power]\ntimeout_secs = 3\nstarts_per_minute = 6000\n{extra}"),
    )
    .unwrap();
    (data, config)
}

fn mac(n: usize) -> String {
    format!("52:54:00:bb:00:{n:02x}")
}

/// Registers node `n` by setting its BMC with `args`, and labels its rack.
fn node_with_bmc(server: &ServerProcess, data: &Path, n: usize, args: &[&str]) {
    let m = mac(n);
    let mut all = vec!["node", "bmc", "set", &m];
    all.extend_from_slice(args);
    let (ok, _, err) = cli(server, data, &all);
    assert!(ok, "bmc set {args:?}: {err}");
    let rack = format!("rack=r{}", n / 4);
    let (ok, _, err) = cli(server, data, &["node", "label", &m, &rack]);
    assert!(ok, "label: {err}");
}

fn events_of(server: &ServerProcess, data: &Path, n: usize) -> Vec<serde_json::Value> {
    let v = cli_json(server, data, &["node", "events", &mac(n)]);
    v["events"].as_array().cloned().unwrap_or_default()
}

#[test]
fn redfish_status_cycle_and_one_time_network_boot_read_back() {
    let sushy = shared();
    let (data, config) = data_dir("");
    let server = ServerProcess::spawn_configured(data.path(), Some(&config));
    let d = data.path();
    let url = sushy.url(0);
    node_with_bmc(
        &server,
        d,
        0,
        &[
            "--redfish",
            &url,
            "--credential",
            "good",
            "--fingerprint",
            &sushy.fingerprint,
        ],
    );

    let status = cli_json(&server, d, &["node", "power", "status", &mac(0)]);
    let s = &status[0]["answer"];
    assert_eq!(s["state"], "on", "{status}");
    assert_eq!(s["inventory"]["uuid"], system_uuid(0), "{status}");

    let done = cli_json(
        &server,
        d,
        &["node", "power", "cycle", &mac(0), "--reason", "hung kernel"],
    );
    let a = &done[0]["answer"];
    assert_eq!(a["action"], "cycle", "{done}");
    assert_eq!(
        a["netboot"], "Pxe Continuous",
        "sushy keeps overrides continuous: {done}"
    );
    assert_eq!(
        a["node_state"], "reimaging",
        "a cycle counts against the budget: {done}"
    );

    // The emulator itself says what it was told.
    let raw = Command::new("curl")
        .args(["-sk", "-u", &format!("admin:{PASSWORD}"), &url])
        .output()
        .unwrap();
    let raw: serde_json::Value = serde_json::from_slice(&raw.stdout).unwrap();
    assert_eq!(raw["Boot"]["BootSourceOverrideTarget"], "Pxe", "{raw}");

    let show = cli_json(&server, d, &["node", "show", &mac(0)]);
    let power = show["power"].as_array().unwrap();
    assert_eq!(power[0]["action"], "cycle");
    assert_eq!(power[0]["outcome"], "ok");
    assert_eq!(power[0]["reason"], "hung kernel");
    // The cycle opens the node's next boot: shown until a script is served.
    let pending = show["preboot"].as_array().unwrap();
    assert_eq!(pending[0]["step"], "power cycle (bmc)", "{show}");
    assert_eq!(pending[0]["outcome"], "ok", "{show}");
    let history = show["history"].as_array().unwrap();
    assert!(
        history.iter().any(|h| h["reason"]
            .as_str()
            .unwrap()
            .contains("power cycle through the BMC: hung kernel")),
        "{show}"
    );
    // The text view says the same, without the credential's contents.
    let (ok, text, err) = cli(&server, d, &["node", "show", &mac(0)]);
    assert!(ok, "{err}");
    assert!(
        text.contains(&format!("bmc:      redfish {url} (credential good)")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("cycle") && l.contains("ok") && l.contains("(hung kernel)")),
        "{text}"
    );
    let kinds: Vec<String> = events_of(&server, d, 0)
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_string())
        .collect();
    assert!(
        kinds.contains(&"node.power".to_string()) && kinds.contains(&"node.bmc".to_string()),
        "{kinds:?}"
    );

    // A CA pin works as well as a fingerprint; off then goes through.
    node_with_bmc(
        &server,
        d,
        0,
        &["--redfish", &url, "--credential", "good", "--ca", "ca.pem"],
    );
    let off = cli_json(
        &server,
        d,
        &["node", "power", "off", &mac(0), "--reason", "maintenance"],
    );
    assert_eq!(off[0]["answer"]["action"], "off", "{off}");
    // The fake driver applies a change 1-11 s later.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let st = cli_json(&server, d, &["node", "power", "status", &mac(0)]);
        if st[0]["answer"]["state"] == "off" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "still {st}");
        std::thread::sleep(Duration::from_millis(500));
    }
    let on = cli_json(
        &server,
        d,
        &[
            "node",
            "power",
            "on",
            &mac(0),
            "--reason",
            "back",
            "--no-netboot",
        ],
    );
    assert_eq!(on[0]["answer"]["netboot"], serde_json::Value::Null, "{on}");
}

#[test]
fn redfish_failures_are_clear_recorded_and_change_nothing() {
    let sushy = shared();
    let (data, config) = data_dir("");
    let server = ServerProcess::spawn_configured(data.path(), Some(&config));
    let d = data.path();
    // A BMC that accepts connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    let closed_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let zeros = "00".repeat(32);
    let nope = format!("https://127.0.0.1:{}/redfish/v1/Systems/nope", sushy.port);
    let url = sushy.url(1);
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--redfish".into(),
                url.clone(),
                "--credential".into(),
                "bad".into(),
                "--fingerprint".into(),
                sushy.fingerprint.clone(),
            ],
            "refused the credentials",
        ),
        (
            vec![
                "--redfish".into(),
                format!("https://127.0.0.1:{closed_port}"),
                "--credential".into(),
                "good".into(),
                "--insecure".into(),
            ],
            "unreachable",
        ),
        (
            vec![
                "--redfish".into(),
                format!("https://127.0.0.1:{silent_port}"),
                "--credential".into(),
                "good".into(),
                "--insecure".into(),
            ],
            "did not answer within 3 s",
        ),
        (
            vec![
                "--redfish".into(),
                nope,
                "--credential".into(),
                "good".into(),
                "--fingerprint".into(),
                sushy.fingerprint.clone(),
            ],
            "404 Fake system nope was not found",
        ),
        (
            vec![
                "--redfish".into(),
                url.clone(),
                "--credential".into(),
                "good".into(),
                "--fingerprint".into(),
                zeros,
            ],
            "not the pinned",
        ),
        (
            vec![
                "--redfish".into(),
                url.clone(),
                "--credential".into(),
                "missing".into(),
                "--insecure".into(),
            ],
            "secret \"missing\"",
        ),
    ];
    for (i, (args, want)) in cases.iter().enumerate() {
        let n = 10 + i;
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        node_with_bmc(&server, d, n, &args);
        let before = cli_json(&server, d, &["node", "show", &mac(n)]);
        let (ok, stdout, stderr) = cli(
            &server,
            d,
            &["node", "power", "cycle", &mac(n), "--reason", "test"],
        );
        assert!(!ok, "case {i} should fail: {stdout}");
        assert!(
            stdout.contains(want),
            "case {i}: want {want:?} in {stdout} {stderr}"
        );
        let after = cli_json(&server, d, &["node", "show", &mac(n)]);
        assert_eq!(
            before["state"], after["state"],
            "case {i}: the node changed"
        );
        assert_eq!(after["power"][0]["action"], "cycle");
        assert!(
            after["power"][0]["outcome"]
                .as_str()
                .unwrap()
                .contains(want),
            "case {i}: {after}"
        );
        let power_events: Vec<_> = events_of(&server, d, n)
            .into_iter()
            .filter(|e| e["kind"] == "node.power")
            .collect();
        assert_eq!(power_events.len(), 1, "case {i}");
        assert!(
            power_events[0]["data"]["outcome"]
                .as_str()
                .unwrap()
                .contains(want),
            "case {i}"
        );
    }
    drop(silent);

    // Settings that cannot work are refused when set.
    let (ok, _, err) = cli(
        &server,
        d,
        &[
            "node",
            "bmc",
            "set",
            &mac(10),
            "--redfish",
            "http://10.0.0.1",
            "--credential",
            "good",
        ],
    );
    assert!(!ok && err.contains("plain http"), "{err}");
    let (ok, _, err) = cli(
        &server,
        d,
        &[
            "node",
            "bmc",
            "set",
            &mac(10),
            "--ipmi",
            "10.0.0.1",
            "--credential",
            "../admin.token",
        ],
    );
    assert!(!ok && err.contains("invalid secret name"), "{err}");

    // The password is nowhere: not in API output, events, the log or the database.
    let mut seen = String::new();
    for n in 10..10 + cases.len() {
        seen.push_str(&cli_json(&server, d, &["node", "show", &mac(n)]).to_string());
        seen.push_str(&serde_json::to_string(&events_of(&server, d, n)).unwrap());
    }
    seen.push_str(&cli_json(&server, d, &["node", "list"]).to_string());
    seen.push_str(&server.log_lines().join("\n"));
    seen.push_str(&String::from_utf8_lossy(
        &std::fs::read(d.join("bootfleet.db")).unwrap(),
    ));
    if let Ok(wal) = std::fs::read(d.join("bootfleet.db-wal")) {
        seen.push_str(&String::from_utf8_lossy(&wal));
    }
    assert!(
        seen.contains("node.power"),
        "the check looked at the events"
    );
    for secret in [PASSWORD, "not-the-password"] {
        assert!(!seen.contains(secret), "{secret} leaked");
    }
}

#[test]
fn the_budget_holds_for_power_actions_over_a_selector() {
    let sushy = shared();
    let (data, config) = data_dir("[reimage]\nmax_total = 4\nmax_per_group = 4\n");
    let server = ServerProcess::spawn_configured(data.path(), Some(&config));
    let d = data.path();
    // Twenty nodes, their BMCs spread over the emulator's systems 2..8, registered by an
    // inventory file with BMC columns (one IPMI row only checks the column's form).
    let mut csv = String::from("mac,labels,bmc,bmc_credential,bmc_fingerprint\n");
    for n in 0..20 {
        let url = sushy.url(2 + n % 6);
        csv += &format!(
            "{},batch=b1 rack=r{},{url},good,{}\n",
            mac(0x40 + n),
            n / 4,
            sushy.fingerprint
        );
    }
    csv += &format!("{},,ipmi://127.0.0.1:1623,good,\n", mac(0x60));
    let file = d.join("rack.csv");
    std::fs::write(&file, csv).unwrap();
    let (ok, _, err) = cli(&server, d, &["node", "import", file.to_str().unwrap()]);
    assert!(ok, "{err}");
    let ipmi = cli_json(&server, d, &["node", "show", &mac(0x60)]);
    assert_eq!(ipmi["bmc"]["protocol"], "ipmi", "{ipmi}");
    assert_eq!(ipmi["bmc"]["address"], "127.0.0.1:1623", "{ipmi}");
    let (ok, stdout, _) = cli(
        &server,
        d,
        &[
            "--output",
            "json",
            "node",
            "power",
            "cycle",
            "--selector",
            "batch=b1",
            "--reason",
            "kernel fix",
            "--concurrency",
            "8",
        ],
    );
    assert!(!ok, "over the budget the command fails");
    let results: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let results = results.as_array().unwrap();
    let done = results.iter().filter(|r| r["answer"].is_object()).count();
    let refused: Vec<_> = results.iter().filter_map(|r| r["error"].as_str()).collect();
    assert_eq!((done, refused.len()), (4, 16), "{stdout}");
    assert!(
        refused.iter().all(|e| e.contains("disruption budget")),
        "{refused:?}"
    );
    let reimaging = cli_json(&server, d, &["node", "list", "--state", "reimaging"]);
    assert_eq!(reimaging.as_array().unwrap().len(), 4);
    // Refused nodes were not touched: no power record.
    let untouched = results.iter().find(|r| r["error"].is_string()).unwrap()["mac"]
        .as_str()
        .unwrap()
        .to_string();
    let show = cli_json(&server, d, &["node", "show", &untouched]);
    assert_eq!(show["power"].as_array().unwrap().len(), 0, "{show}");
}

#[test]
fn a_machine_registered_by_its_bmc_alone_is_powered_on_and_matched_when_it_boots() {
    let sushy = shared();
    let (data, config) = data_dir("");
    let server = ServerProcess::spawn_configured(data.path(), Some(&config));
    let d = data.path();
    let add = |system: usize| {
        let url = sushy.url(system);
        cli_json(
            &server,
            d,
            &[
                "node",
                "bmc",
                "add",
                "--redfish",
                &url,
                "--credential",
                "good",
                "--fingerprint",
                &sushy.fingerprint,
            ],
        )
    };
    // The emulator's system 7 has one NIC; what its BMC says is what is kept.
    let seven = add(7);
    assert_eq!(seven["uuid"], system_uuid(7), "{seven}");
    assert_eq!(
        seven["macs"],
        serde_json::json!(["52:54:00:aa:00:07"]),
        "{seven}"
    );
    add(6);
    let list = cli_json(&server, d, &["node", "bmc", "list"]);
    assert_eq!(list.as_array().unwrap().len(), 2, "{list}");
    // No node exists yet, and none was made up.
    assert_eq!(
        cli_json(&server, d, &["node", "list"])
            .as_array()
            .unwrap()
            .len(),
        0
    );

    let id = seven["id"].to_string();
    let on = cli_json(
        &server,
        d,
        &["node", "bmc", "power", &id, "on", "--reason", "first boot"],
    );
    assert_eq!(on["netboot"], "Pxe Continuous", "{on}");
    let (ok, _, err) = cli(
        &server,
        d,
        &["node", "bmc", "power", "999", "on", "--reason", "x"],
    );
    assert!(
        !ok && err.contains("no machine registered by its BMC with id 999"),
        "{err}"
    );

    // The machine network-boots with the NIC its BMC named: it is that node, with its BMC.
    let script = |query: &str| {
        let out = Command::new("curl")
            .args(["-sf", &format!("{}/boot/node.ipxe?{query}", server.url)])
            .output()
            .unwrap();
        assert!(out.status.success(), "boot script for {query}");
    };
    script("mac=52-54-00-aa-00-07");
    let node = cli_json(&server, d, &["node", "show", "52:54:00:aa:00:07"]);
    assert_eq!(node["bmc"]["address"], sushy.url(7), "{node}");
    // The other is matched by its system UUID, booting from a NIC its BMC did not list.
    script(&format!("mac=52-54-00-aa-01-06&uuid={}", system_uuid(6)));
    let node = cli_json(&server, d, &["node", "show", "52:54:00:aa:01:06"]);
    assert_eq!(node["bmc"]["address"], sushy.url(6), "{node}");
    assert_eq!(
        cli_json(&server, d, &["node", "bmc", "list"]),
        serde_json::json!([])
    );
    for (mac, by) in [("52:54:00:aa:00:07", "mac"), ("52:54:00:aa:01:06", "uuid")] {
        let events = cli_json(&server, d, &["node", "events", mac]);
        let matched: Vec<&serde_json::Value> = events["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["kind"] == "bmc.matched")
            .collect();
        assert_eq!(matched.len(), 1, "{events}");
        assert_eq!(matched[0]["data"]["by"], by, "{events}");
    }
    // An unknown MAC with no UUID is an ordinary discovery, with no BMC.
    script("mac=52-54-00-aa-02-01");
    let node = cli_json(&server, d, &["node", "show", "52:54:00:aa:02:01"]);
    assert!(node["bmc"].is_null(), "{node}");
}
