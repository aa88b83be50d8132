//! Cabling checked at validation against a simulated InfiniBand fabric (Debian's
//! ibsim-utils: `ibsim` and its `umad2sim` preload; infiniband-diags: `ibnetdiscover`,
//! `smpquery`, `ibstat`). The operator's declared topology is what `ibnetdiscover`
//! printed of the fabric cabled right; then two nodes' cables are swapped on the leaf
//! switch, and the real agent of each node asks its port's peer with a directed-route SMP
//! through the simulator. A node on a swapped cable fails validation naming its port and
//! both ends (and, allowed no reimages, is quarantined); a node cabled right is ready.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::agent::{booted, node_root, readings_file, run_agent_with};
use crate::fake_node::{healthy, validation_failure};
use crate::harness::*;

const UMAD2SIM: &str = "/usr/lib/x86_64-linux-gnu/umad2sim/libumad2sim.so";

/// Three single-port nodes on one leaf switch, `node1` and `node2` on `first` and
/// `second` of its ports.
fn net(first: u32, second: u32) -> String {
    format!(
        "Switch 8 \"leaf1\"\n[{first}] \"node1\"[1]\n[{second}] \"node2\"[1]\n[3] \"node3\"[1]\n\n\
         Hca 1 \"node1\"\n[1] \"leaf1\"[{first}]\n\n\
         Hca 1 \"node2\"\n[1] \"leaf1\"[{second}]\n\n\
         Hca 1 \"node3\"\n[1] \"leaf1\"[3]\n"
    )
}

/// An `ibsim` serving `net`, stopped when dropped. Its sockets are abstract and fixed by
/// name, so one runs at a time: this file's test is the only one that starts it.
struct Sim(Child);

impl Sim {
    fn start(dir: &Path, name: &str, net: &str) -> Self {
        let file = dir.join(name);
        std::fs::write(&file, net).unwrap();
        let child = Command::new("ibsim")
            .arg("-s")
            .arg(&file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("ibsim runs (apt-get install ibsim-utils)");
        let sim = Sim(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !sim.query("leaf1", "ibnetdiscover", &[]).0 {
            assert!(Instant::now() < deadline, "ibsim did not answer");
            std::thread::sleep(Duration::from_millis(100));
        }
        sim
    }

    /// Runs `program args` attached to the simulator as `node`: (success, stdout).
    fn query(&self, node: &str, program: &str, args: &[&str]) -> (bool, String) {
        let out = Command::new(program)
            .args(args)
            .env("LD_PRELOAD", UMAD2SIM)
            .env("SIM_HOST", node)
            .output()
            .unwrap_or_else(|e| panic!("{program}: {e} (apt-get install infiniband-diags)"));
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `ibstat`'s `Node GUID: 0x0000000000100000` as sysfs writes it: `0000:0000:0010:0000`.
fn sysfs_guid(ibstat: &str) -> String {
    let hex = ibstat
        .lines()
        .find_map(|l| l.trim().strip_prefix("Node GUID: 0x"))
        .unwrap_or_else(|| panic!("no Node GUID in {ibstat}"));
    (0..4)
        .map(|i| &hex[i * 4..i * 4 + 4])
        .collect::<Vec<_>>()
        .join(":")
}

/// A `smpquery` that goes to the simulator as `SIM_HOST`, first on the agent's PATH.
fn preloaded_smpquery(dir: &Path) -> PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let real = ["/usr/sbin/smpquery", "/usr/bin/smpquery"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("smpquery is missing: apt-get install infiniband-diags");
    let script = bin.join("smpquery");
    std::fs::write(
        &script,
        format!("#!/bin/sh\nLD_PRELOAD={UMAD2SIM} exec {real} \"$@\"\n"),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swapped_cable_fails_validation_naming_its_port_and_both_ends() {
    assert!(
        Path::new(UMAD2SIM).exists(),
        "{UMAD2SIM} is missing: apt-get install ibsim-utils"
    );
    let dir = tempfile::tempdir().unwrap();
    // The declaration: the fabric as discovered while cabled right.
    let declared = dir.path().join("fabric.topo");
    {
        let sim = Sim::start(dir.path(), "right.net", &net(1, 2));
        let (ok, topo) = sim.query("leaf1", "ibnetdiscover", &[]);
        assert!(ok && topo.contains("Ca\t1"), "{topo}");
        std::fs::write(&declared, topo).unwrap();
    }
    // Then node1's and node2's cables trade places on the leaf.
    let sim = Sim::start(dir.path(), "swapped.net", &net(2, 1));
    let server = TestServer::start_configured(|cfg| {
        cfg.lifecycle.validation_reimages = 0;
        cfg.fabric.topology = Some(declared.clone());
    })
    .await;
    server
        .publish_query(good_bundle("ib", "1", b"kernel"), "?tag=ib:stable")
        .await;
    let path = format!(
        "{}:{}",
        preloaded_smpquery(dir.path()).display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for (sim_node, mac, cabled_right) in [
        ("node3", "52-54-00-40-00-03", true),
        ("node1", "52-54-00-40-00-01", false),
    ] {
        let (node, boot) = booted(&server, mac, "ib:stable").await;
        let root = node_root(&boot, "");
        let w = |p: &str, s: &str| {
            let path = root.path().join(p);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, s).unwrap();
        };
        let (ok, ibstat) = sim.query(sim_node, "ibstat", &[]);
        assert!(ok, "{ibstat}");
        w(
            "sys/class/infiniband/ibsim0/node_guid",
            &sysfs_guid(&ibstat),
        );
        w("sys/class/infiniband/ibsim0/ports/1/state", "4: ACTIVE\n");
        w(
            "sys/class/infiniband/ibsim0/ports/1/rate",
            "100 Gb/sec (4X EDR)\n",
        );
        let readings = readings_file(root.path(), &healthy());
        let envs = [("PATH", path.clone().into()), ("SIM_HOST", sim_node.into())];
        let (code, out) =
            run_agent_with(root.path(), Some(&readings), &["--ib-peers"], &envs).await;
        let detail = node.node().await;
        if cabled_right {
            assert_eq!(code, 0, "{out}");
            assert_eq!(detail["state"], "ready", "{out}");
        } else {
            // A reimage cannot mend a cable: with none allowed, hands on it.
            assert_eq!(detail["state"], "quarantined", "{out}");
            let reason = validation_failure(&detail);
            assert!(
                reason.contains(
                    "InfiniBand port ibsim0/1 reaches \"leaf1\" (0x0000000000200000) port 2, the topology has it at \"leaf1\" (0x0000000000200000) port 1"
                ),
                "{reason}"
            );
        }
    }
    drop(sim);
    server.stop().await;
}
