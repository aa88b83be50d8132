//! TFTP against real clients from Debian (tftp-hpa, atftp, curl), on loopback and under
//! 5% random UDP loss in a network namespace the test creates and removes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bootfleet::api::Digest;
use bootfleet::tftp::files::FileSource;
use bootfleet::tftp::metrics::TftpMetrics;
use bootfleet::tftp::server::{TftpServer, TftpSettings};
use tokio_util::sync::CancellationToken;

use crate::harness::{bin, noise};

/// Fails (never skips) when a peer tool is missing, saying what to install.
pub fn require(tool: &str, package: &str) {
    let found = std::process::Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        found,
        "{tool} is missing: apt-get install {package} (scripts/test installs it)"
    );
}

struct Tftp {
    port: u16,
    dir: tempfile::TempDir,
    metrics: Arc<TftpMetrics>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    events: tokio::sync::mpsc::UnboundedReceiver<bootfleet::tftp::metrics::TransferEvent>,
}

impl Tftp {
    async fn start(files: &[(&str, Vec<u8>)]) -> Self {
        Self::start_with(files, TftpSettings::default()).await
    }

    async fn start_with(files: &[(&str, Vec<u8>)], settings: TftpSettings) -> Self {
        let dir = tempfile::tempdir().unwrap();
        for (name, bytes) in files {
            std::fs::write(dir.path().join(name), bytes).unwrap();
        }
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let port = socket.local_addr().unwrap().port();
        let metrics = Arc::new(TftpMetrics::default());
        let (tx, events) = tokio::sync::mpsc::unbounded_channel();
        let server = Arc::new(TftpServer::new(
            Arc::new(FileSource::new(Some(dir.path().to_path_buf()), None)),
            settings,
            metrics.clone(),
            Some(tx),
        ));
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(server.run(socket, shutdown.clone()));
        Self {
            port,
            dir,
            metrics,
            shutdown,
            task,
            events,
        }
    }

    fn out(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("out-{name}"))
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap().unwrap();
    }
}

async fn run(cmd: &str, args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new(cmd)
        .args(args)
        .output()
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn same_file(a: &Path, expected: &[u8]) {
    let got = std::fs::read(a).unwrap_or_default();
    assert_eq!(got.len(), expected.len(), "{}", a.display());
    assert_eq!(Digest::of(&got), Digest::of(expected), "{}", a.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_clients_fetch_exact_bytes() {
    require("tftp", "tftp-hpa");
    require("atftp", "atftp");
    require("curl", "curl");
    let small = noise(70_000, 51); // undionly.kpxe-sized
    let exact = noise(512 * 40, 52); // a multiple of the block size: ends with an empty block
    let big = noise(34 << 20, 53); // over 65535 blocks of 512: block numbers roll over
    let mut server = Tftp::start(&[
        ("undionly.kpxe", small.clone()),
        ("exact.bin", exact.clone()),
        ("big.bin", big.clone()),
    ])
    .await;
    let port = server.port.to_string();

    let out = server.out("hpa");
    let (ok, text) = run(
        "tftp",
        &[
            "127.0.0.1",
            &port,
            "-m",
            "binary",
            "-c",
            "get",
            "undionly.kpxe",
            out.to_str().unwrap(),
        ],
    )
    .await;
    assert!(ok, "{text}");
    same_file(&out, &small);

    let out = server.out("hpa-exact");
    let (ok, text) = run(
        "tftp",
        &[
            "127.0.0.1",
            &port,
            "-m",
            "binary",
            "-c",
            "get",
            "exact.bin",
            out.to_str().unwrap(),
        ],
    )
    .await;
    assert!(ok, "{text}");
    same_file(&out, &exact);

    let out = server.out("atftp");
    let (ok, text) = run(
        "atftp",
        &[
            "--option",
            "blksize 1428",
            "--option",
            "tsize 0",
            "--option",
            "windowsize 4",
            "-g",
            "-r",
            "undionly.kpxe",
            "-l",
            out.to_str().unwrap(),
            "127.0.0.1",
            &port,
        ],
    )
    .await;
    assert!(ok, "{text}");
    same_file(&out, &small);

    // 34 MiB in 512-byte blocks, windowed: 69,632 blocks, so numbers wrap past 65535.
    let out = server.out("atftp-big");
    let (ok, text) = run(
        "atftp",
        &[
            "--option",
            "windowsize 16",
            "-g",
            "-r",
            "big.bin",
            "-l",
            out.to_str().unwrap(),
            "127.0.0.1",
            &port,
        ],
    )
    .await;
    assert!(ok, "{text}");
    same_file(&out, &big);

    let out = server.out("curl");
    let url = format!("tftp://127.0.0.1:{port}/undionly.kpxe");
    let (ok, text) = run(
        "curl",
        &[
            "-sS",
            "--tftp-blksize",
            "1468",
            &url,
            "-o",
            out.to_str().unwrap(),
        ],
    )
    .await;
    assert!(ok, "{text}");
    same_file(&out, &small);

    // Every transfer produced an event with its size.
    let mut events = Vec::new();
    while let Ok(e) = server.events.try_recv() {
        events.push(e);
    }
    while events.len() < 5 {
        events.push(server.events.recv().await.unwrap());
    }
    assert!(
        events
            .iter()
            .all(|e| e.outcome == bootfleet::tftp::metrics::Outcome::Completed),
        "{events:?}"
    );
    assert!(
        events
            .iter()
            .any(|e| e.file == "big.bin" && e.bytes == big.len() as u64)
    );
    assert_eq!(server.metrics.completed.load(Ordering::Relaxed), 5);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_writes_escapes_and_garbage_and_keeps_serving() {
    require("tftp", "tftp-hpa");
    let file = noise(3000, 61);
    let server = Tftp::start(&[("ok.bin", file.clone())]).await;
    let port = server.port.to_string();
    let tftp = |args: Vec<String>| {
        let port = port.clone();
        async move {
            let mut all = vec![
                "127.0.0.1".to_string(),
                port,
                "-m".into(),
                "binary".into(),
                "-c".into(),
            ];
            all.extend(args);
            let refs: Vec<&str> = all.iter().map(String::as_str).collect();
            run("tftp", &refs).await
        }
    };
    let out = server.out("x");
    let o = out.to_str().unwrap().to_string();
    for (name, needle) in [
        ("../etc/passwd", "'..' is not allowed"),
        // A leading `/` names the TFTP root (GRUB asks for `/grub/grub.cfg`), never the
        // host's: /etc/passwd is looked for in the root, and is not there.
        ("/etc/passwd", "etc/passwd: file not found"),
        ("/../etc/passwd", "'..' is not allowed"),
        ("a\\b", "backslashes"),
        ("missing.bin", "not found"),
    ] {
        let (_, text) = tftp(vec!["get".into(), name.into(), o.clone()]).await;
        assert!(text.contains(needle), "{name}: {text}");
    }
    let (_, text) = tftp(vec!["put".into(), o.clone(), "up.bin".into()]).await;
    assert!(text.contains("read-only"), "{text}");
    assert!(!server.dir.path().join("up.bin").exists());

    // Garbage on the request port is dropped and counted.
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    for junk in [
        &b""[..],
        b"\x00",
        b"\x00\x09zz",
        b"\x00\x01noterminator",
        b"\x00\x04\x00\x01",
        b"\xff\xff\xff",
    ] {
        sock.send_to(junk, ("127.0.0.1", server.port)).unwrap();
    }
    let overlong = format!("\x00\x01{}\x00octet\x00", "a".repeat(1200));
    sock.send_to(overlong.as_bytes(), ("127.0.0.1", server.port))
        .unwrap();

    let (ok, text) = tftp(vec!["get".into(), "ok.bin".into(), o.clone()]).await;
    assert!(ok, "still serving: {text}");
    same_file(&out, &file);
    let m = &server.metrics;
    assert_eq!(m.refused_paths.load(Ordering::Relaxed), 3);
    assert_eq!(m.refused_writes.load(Ordering::Relaxed), 1);
    assert!(m.malformed.load(Ordering::Relaxed) >= 7, "{}", m.snapshot());
    server.stop().await;
}

/// A network namespace with loopback up and an nftables rule dropping 5% of UDP datagrams
/// at random; removed on drop.
pub struct LossyNamespace {
    pub name: String,
}

impl LossyNamespace {
    pub fn create(tag: &str, percent_one_in: u32) -> Self {
        require("ip", "iproute2");
        require("nft", "nftables");
        assert!(
            nix_is_root(),
            "network-namespace tests need root: run the README test command as root (sudo ./scripts/test)"
        );
        let name = format!("bf-{tag}-{}", std::process::id());
        let sh = |cmd: &str| {
            let s = std::process::Command::new("sh")
                .args(["-c", cmd])
                .status()
                .unwrap();
            assert!(s.success(), "{cmd}");
        };
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &name])
            .status();
        sh(&format!("ip netns add {name}"));
        let ns = Self { name };
        sh(&format!("ip -n {} link set lo up", ns.name));
        sh(&format!(
            "ip netns exec {} nft -f - <<'EOF'\ntable inet loss {{\n  chain input {{\n    type filter hook input priority 0;\n    meta l4proto udp numgen random mod {percent_one_in} == 0 counter drop\n  }}\n}}\nEOF",
            ns.name
        ));
        ns
    }

    pub fn exec(&self, cmd: &str, args: &[&str]) -> std::process::Command {
        let mut c = std::process::Command::new("ip");
        c.args(["netns", "exec", &self.name, cmd]).args(args);
        c
    }

    pub fn dropped(&self) -> u64 {
        let out = self
            .exec("nft", &["list", "table", "inet", "loss"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        text.split("packets ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for LossyNamespace {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

#[test]
fn transfers_complete_under_five_percent_loss() {
    require("curl", "curl");
    require("atftp", "atftp");
    let ns = LossyNamespace::create("tftp", 20);
    let work = tempfile::tempdir().unwrap();
    let ipxe = work.path().join("ipxe");
    std::fs::create_dir(&ipxe).unwrap();
    // 30 transfers at once: 10 lockstep (curl) and 20 windowed (atftp, whose own 5 s
    // timeout our retransmission ceiling must exceed).
    let files: Vec<(String, Vec<u8>)> = (0..30)
        .map(|i| {
            (
                format!("f{i}.bin"),
                noise(300_000 + i * 1000, 70 + i as u64),
            )
        })
        .collect();
    for (name, bytes) in &files {
        std::fs::write(ipxe.join(name), bytes).unwrap();
    }
    let mut server = ns
        .exec(
            bin().to_str().unwrap(),
            &[
                "--data-dir",
                work.path().join("data").to_str().unwrap(),
                "serve",
            ],
        )
        .args([
            "--listen",
            "127.0.0.1:8080",
            "--tftp-listen",
            "127.0.0.1:69",
            "--ipxe-dir",
            ipxe.to_str().unwrap(),
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let guard = scopeguard(move || {
        let _ = server.kill();
        let _ = server.wait();
    });
    // Wait for the TFTP port (a lost probe is retried by curl itself).
    let mut up = false;
    for _ in 0..50 {
        if ns
            .exec(
                "curl",
                &[
                    "-s",
                    "-o",
                    "/dev/null",
                    "--max-time",
                    "2",
                    "tftp://127.0.0.1/f0.bin",
                ],
            )
            .status()
            .unwrap()
            .success()
        {
            up = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(up, "TFTP server did not come up in the namespace");
    // All at once: a third lockstep (curl), two thirds windowed (atftp).
    let fetch = |i: usize, name: &str, out: &std::path::Path| {
        let mut child = if i.is_multiple_of(3) {
            let url = format!("tftp://127.0.0.1/{name}");
            ns.exec(
                "curl",
                &[
                    "-sS",
                    "--max-time",
                    "120",
                    "--tftp-blksize",
                    "1468",
                    &url,
                    "-o",
                    out.to_str().unwrap(),
                ],
            )
        } else {
            ns.exec(
                "atftp",
                &[
                    "--option",
                    "blksize 1468",
                    "--option",
                    "windowsize 8",
                    "-g",
                    "-r",
                    name,
                    "-l",
                    out.to_str().unwrap(),
                    "127.0.0.1",
                    "69",
                ],
            )
        };
        child
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let children: Vec<_> = files
        .iter()
        .enumerate()
        .map(|(i, (name, _))| {
            let out = work.path().join(format!("got-{name}"));
            let child = fetch(i, name, &out);
            (i, name.clone(), out, child)
        })
        .collect();
    let mut atftp_oack_aborts = 0;
    for (i, name, out, child) in children {
        let mut result = child.wait_with_output().unwrap();
        let said = |r: &std::process::Output| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&r.stdout),
                String::from_utf8_lossy(&r.stderr)
            )
        };
        // atftp 0.8 aborts when it receives an OACK again after acknowledging one: the
        // server's retransmission when the client's ACK 0 was lost, as RFC 2347 asks.
        // That is the client's defect; that one fetch runs again, and must succeed.
        if !result.status.success() && said(&result).contains("unexpected OACK") {
            atftp_oack_aborts += 1;
            result = fetch(i, &name, &out).wait_with_output().unwrap();
        }
        assert!(
            result.status.success(),
            "{name}: client failed under loss: {}",
            said(&result)
        );
        let expected = &files.iter().find(|(n, _)| *n == name).unwrap().1;
        same_file(&out, expected);
    }
    assert!(
        atftp_oack_aborts <= 2,
        "{atftp_oack_aborts} atftp fetches hit the duplicate-OACK abort: more than loss explains"
    );
    assert!(
        ns.dropped() > 0,
        "the loss rule dropped nothing: the test proved nothing"
    );
    drop(guard);
}

/// Runs `f` on drop (teardown that also runs when an assertion fails).
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

/// A client that asks and then never answers: its transfer ends (retries run out) with a
/// failed event, and while it holds the only slot, others are told "busy" and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_clients_time_out_and_the_cap_refuses_others() {
    use bootfleet::tftp::packet::{Packet, Request};
    let settings = TftpSettings {
        max_transfers: 1,
        max_retries: 2,
        ..TftpSettings::default()
    };
    let mut server = Tftp::start_with(&[("f.bin", noise(100_000, 81))], settings).await;
    let rrq = |name: &str| {
        Packet::Rrq(Request {
            filename: name.into(),
            mode: "octet".into(),
            options: vec![],
        })
        .encode()
    };
    let silent = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    silent
        .send_to(&rrq("f.bin"), ("127.0.0.1", server.port))
        .await
        .unwrap();
    let mut buf = [0u8; 2048];
    let (n, _) = silent.recv_from(&mut buf).await.unwrap();
    assert!(matches!(
        Packet::parse(&buf[..n]),
        Ok(Packet::Data { block: 1, .. })
    ));

    let other = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    other
        .send_to(&rrq("f.bin"), ("127.0.0.1", server.port))
        .await
        .unwrap();
    let (n, _) = other.recv_from(&mut buf).await.unwrap();
    match Packet::parse(&buf[..n]).unwrap() {
        Packet::Error { message, .. } => assert!(message.contains("busy"), "{message}"),
        p => panic!("expected a busy error, got {p:?}"),
    }
    assert_eq!(server.metrics.refused_busy.load(Ordering::Relaxed), 1);

    // The silent client never ACKs: after its retries the transfer ends, failed.
    let event = tokio::time::timeout(std::time::Duration::from_secs(30), server.events.recv())
        .await
        .expect("the abandoned transfer ends")
        .unwrap();
    assert!(
        matches!(event.outcome, bootfleet::tftp::metrics::Outcome::Failed(_)),
        "{event:?}"
    );
    assert_eq!(event.retransmits, 2);
    assert_eq!(event.bytes, 0);
    assert_eq!(server.metrics.failed.load(Ordering::Relaxed), 1);
    server.stop().await;
}
