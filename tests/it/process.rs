//! The real binary: CLI against a spawned server, SIGTERM shutdown, and `kill -9` mid-publish.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::harness::*;

pub struct ServerProcess {
    child: Child,
    pub url: String,
    lines: std::sync::mpsc::Receiver<String>,
}

impl ServerProcess {
    pub fn spawn(data: &Path) -> Self {
        Self::spawn_configured(data, None)
    }

    /// With a settings file (`serve --config`).
    pub fn spawn_configured(data: &Path, config: Option<&Path>) -> Self {
        let mut args = vec![
            "--data-dir",
            data.to_str().unwrap(),
            "serve",
            "--log-format",
            "json",
        ];
        if let Some(c) = config {
            args.extend(["--config", c.to_str().unwrap()]);
        }
        let mut child = Command::new(bin())
            .args(&args)
            .env("BOOTFLEET_LISTEN", "127.0.0.1:0")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn bootfleet serve");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        // Owned from here on, so a failed start still kills and reaps the child.
        let mut server = Self {
            child,
            url: String::new(),
            lines,
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while server.url.is_empty() {
            let line = server
                .lines
                .recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
                .expect("server logs its listening address within 30 s");
            let v: serde_json::Value = serde_json::from_str(&line).expect("JSON log line");
            if let Some(addr) = v["fields"]["addr"].as_str() {
                server.url = format!("http://{addr}");
            }
        }
        server
    }

    /// Every log line the server wrote so far (after its start).
    pub fn log_lines(&self) -> Vec<String> {
        self.lines.try_iter().collect()
    }

    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the CLI; returns (success, stdout, stderr).
pub fn cli(server: &ServerProcess, data: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin())
        .args([
            "--server",
            &server.url,
            "--data-dir",
            data.to_str().unwrap(),
        ])
        .args(args)
        .env_remove("BOOTFLEET_TOKEN")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn cli_json(server: &ServerProcess, data: &Path, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--output", "json"];
    all.extend_from_slice(args);
    let (ok, stdout, stderr) = cli(server, data, &all);
    assert!(ok, "bootfleet {args:?} failed: {stderr}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}"))
}

fn write_image_dir(dir: &Path, version: &str, kernel: &[u8]) {
    std::fs::create_dir_all(dir.join("boot")).unwrap();
    let text = manifest("demo", version).replace("\"vmlinuz\"", "\"boot/vmlinuz\"");
    std::fs::write(dir.join("manifest.toml"), text).unwrap();
    std::fs::write(dir.join("boot/vmlinuz"), kernel).unwrap();
    std::fs::write(dir.join("initrd.img"), b"initrd").unwrap();
}

#[test]
fn cli_publishes_tags_rolls_back_verifies_and_collects() {
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");
    let server = ServerProcess::spawn(&data);

    let v1_dir = work.path().join("v1");
    write_image_dir(&v1_dir, "1.0", &noise(500_000, 31));
    let v1 = cli_json(
        &server,
        &data,
        &[
            "image",
            "publish",
            v1_dir.to_str().unwrap(),
            "--tag",
            "demo:stable",
        ],
    );
    assert_eq!(v1["created"], true);
    assert_eq!(v1["tag"]["tag"], "demo:stable");

    // The same content as a .tar.gz file publishes to the same digest.
    let tgz = work.path().join("v1.tar.gz");
    let status = Command::new("tar")
        .args([
            "-czf",
            tgz.to_str().unwrap(),
            "-C",
            v1_dir.to_str().unwrap(),
            ".",
        ])
        .status()
        .unwrap();
    assert!(status.success());
    let again = cli_json(&server, &data, &["image", "publish", tgz.to_str().unwrap()]);
    assert_eq!(again["digest"], v1["digest"]);
    assert_eq!(again["created"], false);

    let v2_dir = work.path().join("v2");
    write_image_dir(&v2_dir, "2.0", &noise(500_000, 32));
    let v2 = cli_json(
        &server,
        &data,
        &["image", "publish", v2_dir.to_str().unwrap()],
    );
    let moved = cli_json(&server, &data, &["image", "tag", "demo:2.0", "demo:stable"]);
    assert_eq!(moved["from"], v1["digest"]);
    let rollback = cli_json(
        &server,
        &data,
        &[
            "image",
            "tag",
            v1["digest"].as_str().unwrap(),
            "demo:stable",
        ],
    );
    assert_eq!(rollback["digest"], v1["digest"]);
    let history = cli_json(&server, &data, &["image", "history", "demo:stable"]);
    assert_eq!(history.as_array().unwrap().len(), 3);
    assert_eq!(history[1]["to"], v2["digest"]);
    assert!(history[2]["actor"].as_str().unwrap().starts_with("admin ("));
    // Each move names versions, not only digests.
    assert_eq!(history[1]["from_version"], "1.0");
    assert_eq!(history[1]["to_version"], "2.0");
    assert_eq!(history[2]["to_version"], "1.0");
    let (ok, text, _) = cli(&server, &data, &["image", "history", "demo:stable"]);
    assert!(
        ok && text.contains("1.0 (sha256:") && text.contains("-> 2.0 (sha256:"),
        "{text}"
    );

    let shown = cli_json(&server, &data, &["image", "show", "demo:stable"]);
    assert_eq!(shown["version"], "1.0");
    // A digest prefix (12 digits here) names the one image it begins.
    let v1_digest = v1["digest"].as_str().unwrap();
    let short = &v1_digest[..7 + 12];
    let by_prefix = cli_json(&server, &data, &["image", "show", short]);
    assert_eq!(by_prefix["digest"], v1["digest"]);
    let assigned = cli_json(
        &server,
        &data,
        &["node", "assign", "52-54-00-aa-bb-02", short],
    );
    assert_eq!(assigned["assigned"], v1["digest"], "stored whole");
    assert_eq!(shown["artifacts"][0]["path"], "boot/vmlinuz");
    let list = cli_json(&server, &data, &["image", "list"]);
    assert_eq!(list.as_array().unwrap().len(), 2);

    let (ok, text, _) = cli(&server, &data, &["image", "list"]);
    assert!(
        ok && text.contains("demo") && text.contains("stable"),
        "{text}"
    );

    // Other content under a taken version: refused, exit status non-zero, both digests named.
    write_image_dir(&v1_dir, "1.0", b"different kernel");
    let (ok, _, stderr) = cli(
        &server,
        &data,
        &["image", "publish", v1_dir.to_str().unwrap()],
    );
    assert!(!ok);
    assert!(
        stderr.contains("409") && stderr.contains(v1["digest"].as_str().unwrap()),
        "{stderr}"
    );

    // Nodes: register by assignment, label, boot (as iPXE would fetch), inspect.
    let mac = "52-54-00-aa-bb-01";
    let assigned = cli_json(&server, &data, &["node", "assign", mac, "demo:stable"]);
    assert_eq!(assigned["assigned"], "demo:stable");
    cli_json(
        &server,
        &data,
        &["node", "label", mac, "rack=r1", "sku=hgx"],
    );
    let labelled = cli_json(&server, &data, &["node", "label", mac, "sku-"]);
    assert_eq!(labelled["labels"], serde_json::json!({ "rack": "r1" }));
    let script = Command::new("curl")
        .args(["-sf", &format!("{}/boot/node.ipxe?mac={mac}", server.url)])
        .output()
        .expect("curl is installed (scripts/test installs it)");
    let script = String::from_utf8_lossy(&script.stdout);
    assert!(script.contains("bootfleet.token="), "{script}");
    let shown = cli_json(&server, &data, &["node", "show", mac]);
    assert_eq!(shown["state"], "provisioning");
    assert_eq!(shown["boots"][0]["image"], v1["digest"]);
    let history = cli_json(&server, &data, &["node", "history", mac]);
    assert_eq!(history.as_array().unwrap().len(), 2);
    let (ok, text, _) = cli(&server, &data, &["node", "list"]);
    assert!(
        ok && text.contains("52:54:00:aa:bb:01") && text.contains("provisioning"),
        "{text}"
    );
    cli_json(
        &server,
        &data,
        &["node", "assign", "52-54-00-aa-bb-02", "demo:1.0"],
    );
    let count = |args: &[&str]| {
        let mut all = vec!["node", "list"];
        all.extend_from_slice(args);
        cli_json(&server, &data, &all).as_array().unwrap().len()
    };
    assert_eq!(count(&[]), 2);
    assert_eq!(count(&["--selector", "rack=r1"]), 1);
    assert_eq!(count(&["-l", "!rack", "--image", "demo:1.0"]), 1);
    assert_eq!(count(&["--state", "provisioning,ready"]), 1);
    let (ok, _, stderr) = cli(&server, &data, &["node", "list", "--state", "redy"]);
    assert!(!ok && stderr.contains("not a node state"), "{stderr}");
    let reimaged = cli_json(
        &server,
        &data,
        &[
            "node",
            "reimage",
            mac,
            "--reason",
            "XID 79",
            "--idempotency-key",
            "t-1",
        ],
    );
    assert_eq!(reimaged["outcome"], "accepted");
    assert_eq!(reimaged["node"]["state"], "reimaging");
    let (ok, _, stderr) = cli(&server, &data, &["node", "label", mac, "nonsense"]);
    assert!(!ok && stderr.contains("key=value"), "{stderr}");

    // Many nodes at once: MACs, or a selector; one result per node.
    let (b2, b3) = ("52-54-00-aa-bb-02", "52-54-00-aa-bb-03");
    let bulk = cli_json(&server, &data, &["node", "assign", b2, b3, "demo:stable"]);
    let results = bulk.as_array().unwrap();
    assert_eq!(results.len(), 2, "{bulk}");
    assert!(
        results
            .iter()
            .all(|r| r["answer"]["assigned"] == "demo:stable"),
        "{bulk}"
    );
    assert_eq!(count(&["--image", "demo:stable"]), 3);
    cli_json(&server, &data, &["node", "label", b3, "rack=r2"]);
    let by_selector = cli_json(
        &server,
        &data,
        &["node", "reimage", "-l", "rack=r2", "--reason", "rollout 9"],
    );
    assert_eq!(by_selector[0]["mac"], "52:54:00:aa:bb:03", "{by_selector}");
    assert_eq!(
        by_selector[0]["answer"]["outcome"], "accepted",
        "{by_selector}"
    );
    // One node refused does not stop the others; the command fails and says how many.
    let (ok, text, stderr) = cli(
        &server,
        &data,
        &[
            "node",
            "reimage",
            "52-54-00-ff-ff-fe",
            b2,
            "--reason",
            "rollout 9",
        ],
    );
    assert!(!ok && stderr.contains("1 of 2"), "{stderr}");
    assert!(
        text.contains("52:54:00:ff:ff:fe: error") && text.contains("52:54:00:aa:bb:02: accepted"),
        "{text}"
    );
    let (ok, _, stderr) = cli(
        &server,
        &data,
        &["node", "reimage", "-l", "rack=r404", "--reason", "x"],
    );
    assert!(!ok && stderr.contains("no node matches"), "{stderr}");
    let (ok, _, stderr) = cli(
        &server,
        &data,
        &["node", "assign", b2, "-l", "rack=r2", "demo:stable"],
    );
    assert!(!ok && stderr.contains("not both"), "{stderr}");

    // An inventory: checked whole first (a bad row sends nothing), then one result a node.
    let inventory = data.join("inventory.csv");
    let rows = [
        "mac,image,labels",
        "52:54:00:aa:cc:01,demo:stable,rack=r7;sku=hgx",
        "52:54:00:aa:cc:02,demo:1.0,rack=r7",
        "not-a-mac,demo:1.0,",
    ];
    std::fs::write(&inventory, rows.join("\n")).unwrap();
    let file = inventory.to_str().unwrap();
    let (ok, _, stderr) = cli(&server, &data, &["node", "import", file]);
    assert!(!ok && stderr.contains("line 4"), "{stderr}");
    assert_eq!(count(&["-l", "rack=r7"]), 0, "nothing was sent");
    std::fs::write(&inventory, rows[..3].join("\n")).unwrap();
    let imported = cli_json(&server, &data, &["node", "import", file]);
    assert_eq!(imported.as_array().unwrap().len(), 2, "{imported}");
    assert_eq!(imported[0]["answer"]["labels"]["sku"], "hgx", "{imported}");
    assert_eq!(count(&["-l", "rack=r7", "--image", "demo:stable"]), 1);

    // Removing: refused for a node that runs a boot (b3 is reimaging) unless forced.
    let (ok, text, stderr) = cli(&server, &data, &["node", "rm", b3]);
    assert!(
        !ok && text.contains("409") && text.contains("reimaging"),
        "{text} {stderr}"
    );
    let removed = cli_json(
        &server,
        &data,
        &["node", "rm", b3, "--force", "--reason", "RMA 12"],
    );
    assert_eq!(
        removed[0]["answer"]["mac"], "52:54:00:aa:bb:03",
        "{removed}"
    );
    let (ok, _, _) = cli(&server, &data, &["node", "show", b3]);
    assert!(!ok, "a removed node is gone");

    let verify = cli_json(&server, &data, &["image", "verify"]);
    assert_eq!(verify["quarantined"], serde_json::json!([]));
    let gc = cli_json(&server, &data, &["image", "gc"]);
    assert_eq!(gc["removed"], serde_json::json!([]));

    // Removing images: refused while a tag, an assignment or a running node uses one
    // (the refusal names them); an unused one goes, and gc then frees its blobs.
    let (ok, text, stderr) = cli(&server, &data, &["image", "rm", "demo:1.0"]);
    assert!(!ok && stderr.contains("409"), "{text} {stderr}");
    assert!(
        stderr.contains("tags point at it: demo:stable")
            && stderr.contains("nodes are assigned it"),
        "{stderr}"
    );
    let removed = cli_json(&server, &data, &["image", "rm", "demo:2.0"]);
    assert_eq!(removed["digest"], v2["digest"]);
    let (ok, _, _) = cli(&server, &data, &["image", "show", "demo:2.0"]);
    assert!(!ok, "a removed image is gone");
    let gc = cli_json(&server, &data, &["image", "gc"]);
    assert!(!gc["removed"].as_array().unwrap().is_empty(), "{gc}");
    assert_eq!(
        cli_json(&server, &data, &["image", "list"])
            .as_array()
            .unwrap()
            .len(),
        1
    );

    // A wrong token is refused with a hint; a missing server is named.
    let (ok, _, stderr) = cli(
        &server,
        &data,
        &["--token", "0123456789abcdef-wrong", "image", "list"],
    );
    assert!(!ok && stderr.contains("403"), "{stderr}");
    let (ok, _, stderr) = cli(&server, work.path(), &["image", "list"]);
    assert!(
        !ok && stderr.contains("401") && stderr.contains("--token"),
        "{stderr}"
    );
}

#[test]
fn sigterm_shuts_down_cleanly() {
    let work = tempfile::tempdir().unwrap();
    let server = ServerProcess::spawn(work.path());
    let pid = server.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let mut server = server;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "server did not exit on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    let logs: Vec<String> = server.lines.try_iter().collect();
    assert!(
        logs.iter().any(|l| l.contains("shut down cleanly")),
        "{logs:?}"
    );
}

/// `kill -9` at several moments of a publish: after a restart the image is whole or absent,
/// no temp file remains, and verify is clean.
#[test]
fn kill_9_during_publish_leaves_a_consistent_store() {
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");
    let bundle = work.path().join("big.tar");
    std::fs::write(&bundle, good_bundle("big", "1", &noise(48 << 20, 41))).unwrap();
    let mut outcomes = Vec::new();
    for delay_ms in [30u64, 80, 150, 250, 1000] {
        let server = ServerProcess::spawn(&data);
        let mut publish = Command::new(bin())
            .args([
                "--server",
                &server.url,
                "--data-dir",
                data.to_str().unwrap(),
            ])
            .args(["image", "publish", bundle.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        server.kill9();
        let _ = publish.wait();
        let had_temps = std::fs::read_dir(data.join("blobs/sha256"))
            .unwrap()
            .any(|e| e.unwrap().file_name().to_string_lossy().starts_with('.'));

        let server = ServerProcess::spawn(&data);
        let leftovers: Vec<_> = std::fs::read_dir(data.join("blobs/sha256"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(
            leftovers.is_empty(),
            "temp files survived a restart: {leftovers:?}"
        );
        let verify = cli_json(&server, &data, &["image", "verify"]);
        assert_eq!(verify["quarantined"], serde_json::json!([]), "{verify}");
        assert_eq!(verify["missing"], serde_json::json!([]), "{verify}");
        let images = cli_json(&server, &data, &["image", "list"]);
        let published = images.as_array().unwrap().len();
        assert!(published <= 1);
        if published == 1 {
            let shown = cli_json(&server, &data, &["image", "show", "big:1"]);
            assert_eq!(shown["artifacts"][0]["size"], 48 << 20);
        }
        outcomes.push((delay_ms, had_temps, published));
        // Start the next round from scratch so each delay hits a fresh publish.
        let _ = cli_json(&server, &data, &["image", "gc"]);
        drop(server);
        if published == 1 {
            std::fs::remove_dir_all(&data).unwrap();
        }
    }
    eprintln!("(delay ms, temp files at the kill, image present after restart): {outcomes:?}");
    // Some kill must have hit a publish in flight, with blobs half-received.
    assert!(outcomes.iter().any(|o| o.1 && o.2 == 0), "{outcomes:?}");
}

/// The server binary ships no load generator; `bootfleet-bench` has them all.
#[test]
fn load_generators_live_in_their_own_binary() {
    let help = |bin: &std::path::Path| {
        let out = std::process::Command::new(bin)
            .arg("--help")
            .output()
            .unwrap();
        assert!(out.status.success(), "{} --help failed", bin.display());
        String::from_utf8(out.stdout).unwrap()
    };
    let server = help(bin());
    assert!(
        !server.contains("bench"),
        "bootfleet --help lists bench:\n{server}"
    );
    let bench = help(std::path::Path::new(env!("CARGO_BIN_EXE_bootfleet-bench")));
    for command in ["tftp", "storm-setup", "storm", "http", "bound"] {
        assert!(
            bench.lines().any(|l| l.trim_start().starts_with(command)),
            "bootfleet-bench --help lacks {command}:\n{bench}"
        );
    }
}

/// `bootfleet node list | head` with the reader gone: the CLI ends quietly (no panic,
/// no backtrace, not exit status 101), as Unix tools do on a closed pipe.
#[test]
fn a_closed_pipe_ends_the_cli_quietly() {
    let data = tempfile::tempdir().unwrap();
    let server = ServerProcess::spawn(data.path());
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(bin())
        .args([
            "--server",
            &server.url,
            "--data-dir",
            data.path().to_str().unwrap(),
            "node",
            "list",
        ])
        .env_remove("BOOTFLEET_TOKEN")
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_ne!(out.status.code(), Some(101), "{stderr}");
    drop(server);
}

/// A second `serve` on a busy port fails before it creates anything: no data directory,
/// no token.
#[test]
fn serve_on_a_busy_port_leaves_nothing_behind() {
    let data = tempfile::tempdir().unwrap();
    let server = ServerProcess::spawn(data.path());
    let addr = server.url.trim_start_matches("http://").to_string();
    let other = tempfile::tempdir().unwrap();
    let fresh = other.path().join("data");
    let out = Command::new(bin())
        .args([
            "--data-dir",
            fresh.to_str().unwrap(),
            "serve",
            "--listen",
            &addr,
        ])
        .env_remove("BOOTFLEET_LISTEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot listen on"), "{stderr}");
    assert!(!fresh.exists(), "the data directory was created");
    drop(server);
}

/// Every flag of the agent says what it is in `--help` (the server's CLI is checked by a
/// unit test over its clap definition).
#[test]
fn every_agent_flag_has_help() {
    let out = Command::new(env!("CARGO_BIN_EXE_bootfleet-agent"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = help.lines().collect();
    let mut flags = 0;
    for (i, line) in lines.iter().enumerate() {
        if line.trim_start().starts_with("--") || line.trim_start().starts_with("-h") {
            flags += 1;
            let next = lines.get(i + 1).map_or("", |l| l.trim());
            assert!(!next.is_empty(), "{line:?} has no help:\n{help}");
        }
    }
    assert!(flags > 10, "{help}");
}

/// Runs the CLI with exactly `args` (no --server, no --data-dir); returns the exit
/// status and stderr.
fn cli_bare(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(bin())
        .args(args)
        .env_remove("BOOTFLEET_TOKEN")
        .env_remove("BOOTFLEET_SERVER")
        .env_remove("BOOTFLEET_DATA_DIR")
        .env_remove("BOOTFLEET_CONFIG")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Admin commands find the server and its token from the server's settings file, fail
/// with an exit status per class of failure, and with --output json say so in JSON.
#[test]
fn admin_commands_take_the_config_and_fail_by_class() {
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");
    let server = ServerProcess::spawn(&data);
    let addr = server.url.trim_start_matches("http://");
    let config = work.path().join("bootfleet.toml");
    std::fs::write(
        &config,
        format!("listen = \"{addr}\"\ndata_dir = \"{}\"\n", data.display()),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let (code, stdout, stderr) =
        cli_bare(&["--config", config, "--output", "json", "image", "list"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout.trim(), "[]");

    // Not found: 3, a JSON error on stderr.
    let (code, _, stderr) = cli_bare(&[
        "--config",
        config,
        "--output",
        "json",
        "node",
        "show",
        "52:54:00:99:99:99",
    ]);
    assert_eq!(code, 3, "{stderr}");
    let error: serde_json::Value = serde_json::from_str(stderr.trim()).unwrap();
    assert_eq!(
        (error["class"].as_str(), error["status"].as_u64()),
        (Some("not-found"), Some(404))
    );
    // Refused: 4, naming where the token came from.
    let (code, _, stderr) = cli_bare(&["--config", config, "--token", "nope", "image", "list"]);
    assert_eq!(code, 4, "{stderr}");
    assert!(
        stderr.contains("token: --token or BOOTFLEET_TOKEN"),
        "{stderr}"
    );
    let (code, _, stderr) = cli_bare(&[
        "--server",
        &server.url,
        "--data-dir",
        "/nonexistent",
        "image",
        "list",
    ]);
    assert_eq!(code, 4, "{stderr}");
    assert!(
        stderr.contains("cannot read /nonexistent/admin.token"),
        "{stderr}"
    );
    // Unreachable: 5. Usage: 2.
    let (code, _, stderr) = cli_bare(&[
        "--server",
        "http://127.0.0.1:1",
        "--output",
        "json",
        "image",
        "list",
    ]);
    assert_eq!(code, 5, "{stderr}");
    assert!(stderr.contains("\"unreachable\""), "{stderr}");
    let (code, _, stderr) = cli_bare(&["--server", "ftp://x", "image", "list"]);
    assert_eq!(code, 2, "{stderr}");
}

/// `bootfleet serve --config FILE`, the README's way (the global after the subcommand),
/// serves on the file's address from the file's data directory.
///
/// The port is picked free and then released, so another test's server can take it in
/// between: a server that could not bind exits, and the test tries a fresh port. Being up
/// means the token file is in the config's data_dir *and* our child answers on the port.
#[test]
fn serve_reads_the_config_given_after_the_subcommand() {
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("from-config");
    let config = work.path().join("bootfleet.toml");
    let mut outcome = String::from("never tried");
    for _attempt in 0..3 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        std::fs::write(
            &config,
            format!(
                "listen = \"127.0.0.1:{port}\"\ndata_dir = \"{}\"\n",
                data.display()
            ),
        )
        .unwrap();
        let mut child = Command::new(bin())
            .args(["serve", "--config", config.to_str().unwrap()])
            .current_dir(work.path())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        outcome = loop {
            if let Ok(Some(status)) = child.try_wait() {
                break format!("the server exited ({status}) on port {port}");
            }
            let listening = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
            if listening && data.join("admin.token").is_file() {
                break "up".to_string();
            }
            if std::time::Instant::now() > deadline {
                break format!(
                    "after 20 s: listening on {port}: {listening}, token in the config's \
                     data_dir: {}",
                    data.join("admin.token").is_file()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let exited_early = child.try_wait().ok().flatten().is_some();
        let _ = child.kill();
        let _ = child.wait();
        if outcome == "up" && !exited_early {
            return;
        }
        if !exited_early {
            break;
        }
    }
    panic!("serve --config did not come up from the file: {outcome}");
}

/// Shell completions and man pages come from the command line's own definition: the
/// bash script parses, names every command; a page is written for each command.
#[test]
fn completions_and_man_pages_cover_every_command() {
    let (code, bash, err) = cli_bare(&["completions", "bash"]);
    assert_eq!(code, 0, "{err}");
    for word in [
        "rollout",
        "revalidate",
        "completions",
        "--selector",
        "--watch",
    ] {
        assert!(bash.contains(word), "{word} not completed");
    }
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("bootfleet.bash");
    std::fs::write(&script, &bash).unwrap();
    let checked = Command::new("bash")
        .arg("-n")
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        checked.status.success(),
        "{}",
        String::from_utf8_lossy(&checked.stderr)
    );
    let (code, zsh, _) = cli_bare(&["completions", "zsh"]);
    assert_eq!(code, 0);
    assert!(zsh.starts_with("#compdef bootfleet"), "{zsh}");
    let (code, _, err) = cli_bare(&["completions", "tcsh"]);
    assert_eq!(code, 2, "an unknown shell is a usage error: {err}");

    let pages = dir.path().join("man");
    let (code, _, err) = cli_bare(&["man", pages.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let page = std::fs::read_to_string(pages.join("bootfleet-node-show.1")).unwrap();
    assert!(page.starts_with(".ie") || page.contains(".TH"), "{page}");
    assert!(page.contains("watch"), "{page}");
    for name in [
        "bootfleet.1",
        "bootfleet-serve.1",
        "bootfleet-rollout-start.1",
        "bootfleet-image-import.1",
    ] {
        assert!(pages.join(name).is_file(), "{name} missing");
    }
    let serve = std::fs::read_to_string(pages.join("bootfleet-serve.1")).unwrap();
    assert!(
        !serve.contains("\\-\\-token"),
        "serve's page lists the admin globals"
    );
}

/// `bootfleet openapi` prints, without a server, the checked-in document.
#[test]
fn openapi_prints_the_checked_in_document() {
    let (code, doc, err) = cli_bare(&["openapi"]);
    assert_eq!(code, 0, "{err}");
    let checked_in =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json")).unwrap();
    assert!(
        doc == checked_in,
        "bootfleet openapi differs from docs/openapi.json"
    );
}

/// `node show --watch --until ready` follows a node through its boot and ends when it is
/// ready, one JSON view per change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_show_watches_a_boot_until_ready() {
    let server = TestServer::start().await;
    let (status, image) = server
        .publish(good_bundle("demo", "1.0", &noise(10_000, 3)))
        .await;
    assert_eq!(status, 201, "{image}");
    let node = crate::fake_node::FakeNode::new(&server, "52-54-00-00-40-01");
    node.script().await;
    server.assign("52-54-00-00-40-01", "demo:1.0").await;
    let watcher = tokio::process::Command::new(bin())
        .args([
            "--server",
            &format!("http://{}", server.addr),
            "--token",
            &server.token,
            "--output",
            "json",
            "node",
            "show",
            "52:54:00:00:40:01",
            "--watch",
            "--every",
            "50ms",
            "--until",
            "ready",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    node.boot_to_ready(&image).await;
    let out = tokio::time::timeout(Duration::from_secs(30), watcher.wait_with_output())
        .await
        .expect("the watch ends once the node is ready")
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let states: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["state"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(
        states.first().map(String::as_str),
        Some("discovered"),
        "{states:?}"
    );
    assert_eq!(
        states.last().map(String::as_str),
        Some("ready"),
        "{states:?}"
    );
    let (code, _, err) = cli_bare(&["node", "show", "52:54:00:00:40:01", "--until", "ready"]);
    assert_eq!(code, 2, "--until needs --watch: {err}");
    let (code, _, err) = cli_bare(&[
        "node",
        "show",
        "52:54:00:00:40:01",
        "--watch",
        "--until",
        "sleeping",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("one of discovered"), "{err}");
}
