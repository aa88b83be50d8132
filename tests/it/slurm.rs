//! Slurm from Debian, started by the test on loopback: munged with a key of its own,
//! slurmctld and one slurmd (NodeName bfnode1). A job running on the node keeps a
//! rollout from reimaging it until the job ends; the node is handed back to Slurm
//! (RESUME) once it is ready on the new image.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::*;
use crate::oci::port_for_a_child;
use crate::rollout::{Fleet, all_events, mac_of, wait_rollout};

pub struct Slurm {
    dir: tempfile::TempDir,
    children: Vec<Child>,
}

fn need(program: &str) {
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()));
    assert!(
        found || Path::new("/usr/sbin").join(program).is_file(),
        "{program} is missing: install Debian's slurmctld, slurmd, slurm-client and munge (scripts/test does)"
    );
}

impl Slurm {
    pub fn start() -> Self {
        for p in [
            "munged",
            "slurmctld",
            "slurmd",
            "scontrol",
            "sbatch",
            "squeue",
        ] {
            need(p);
        }
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let mut key = vec![0u8; 1024];
        use std::io::Read;
        std::fs::File::open("/dev/urandom")
            .unwrap()
            .read_exact(&mut key)
            .unwrap();
        std::fs::write(d.join("munge.key"), key).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(d.join("munge.key"), std::fs::Permissions::from_mode(0o400))
            .unwrap();
        for sub in ["state", "spool"] {
            std::fs::create_dir(d.join(sub)).unwrap();
        }
        let mut cluster = Self {
            dir,
            children: Vec::new(),
        };
        let d = cluster.dir.path().to_path_buf();
        let socket = d.join("munge.sock");
        cluster.spawn(Command::new(sbin("munged")).args([
            "--foreground".to_string(),
            "--force".into(),
            format!("--socket={}", socket.display()),
            format!("--key-file={}", d.join("munge.key").display()),
            format!("--pid-file={}", d.join("munged.pid").display()),
            format!("--log-file={}", d.join("munged.log").display()),
            format!("--seed-file={}", d.join("munged.seed").display()),
        ]));
        wait_for(|| socket.exists(), 10, "munged's socket");
        let (ctld, slurmd) = (port_for_a_child(), port_for_a_child());
        let conf = format!(
            "ClusterName=bf\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={ctld}\nSlurmdPort={slurmd}\n\
             AuthType=auth/munge\nAuthInfo=socket={sock}\nCredType=cred/munge\n\
             SlurmUser=root\nSlurmdUser=root\nStateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\n\
             SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd.pid\n\
             SlurmctldLogFile={d}/slurmctld.log\nSlurmdLogFile={d}/slurmd.log\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\nSchedulerType=sched/builtin\n\
             SelectType=select/linear\nReturnToService=2\nMpiDefault=none\n\
             NodeName=bfnode1 NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN\n\
             PartitionName=debug Nodes=bfnode1 Default=YES MaxTime=INFINITE State=UP\n",
            sock = socket.display(),
            d = d.display(),
        );
        std::fs::write(cluster.conf(), conf).unwrap();
        let conf = cluster.conf();
        let c = conf.to_str().unwrap();
        cluster.spawn(Command::new(sbin("slurmctld")).args(["-D", "-f", c]));
        cluster.spawn(Command::new(sbin("slurmd")).args(["-D", "-f", c, "-N", "bfnode1"]));
        // slurmd registers, then slurmctld counts it as responding: only then does a job start.
        wait_for(
            || {
                let s = cluster.state();
                s.starts_with("IDLE") && !s.contains("NOT_RESPONDING")
            },
            60,
            "bfnode1 idle and responding",
        );
        cluster
    }

    pub fn conf(&self) -> PathBuf {
        self.dir.path().join("slurm.conf")
    }

    fn spawn(&mut self, cmd: &mut Command) {
        let child = cmd
            .env("SLURM_CONF", self.conf())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        self.children.push(child);
    }

    pub fn run(&self, program: &str, args: &[&str]) -> String {
        let out = Command::new(program)
            .args(args)
            .env("SLURM_CONF", self.conf())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// bfnode1's `State=` as scontrol prints it (empty while slurmctld does not answer).
    pub fn state(&self) -> String {
        let out = Command::new("scontrol")
            .args(["show", "node", "bfnode1", "--oneliner"])
            .env("SLURM_CONF", self.conf())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .find_map(|w| w.strip_prefix("State="))
            .unwrap_or("")
            .to_string()
    }

    /// The job's state letter in squeue (R, PD), or "" once it has left the queue.
    pub fn job(&self, id: &str) -> String {
        self.run("squeue", &["-h", "-j", id, "-o", "%t"])
            .trim()
            .to_string()
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for c in self.children.iter_mut().rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn sbin(program: &str) -> PathBuf {
    Path::new("/usr/sbin").join(program)
}

fn wait_for(mut ok: impl FnMut() -> bool, secs: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_running_job_delays_the_drain_and_the_node_is_resumed_after_ready() {
    let slurm = tokio::task::spawn_blocking(Slurm::start).await.unwrap();
    let conf = slurm.conf();
    let server = TestServer::start_configured(|cfg| {
        cfg.rollouts.tick_ms = 100;
        cfg.drain.slurm.conf = Some(conf);
    })
    .await;
    for (version, tag) in [("1", "stable"), ("2", "next")] {
        let bundle = good_bundle(
            "gpu",
            version,
            &noise(4096, u64::from(version.as_bytes()[0])),
        );
        let (s, img) = server
            .publish_query(bundle, &format!("?tag=gpu:{tag}"))
            .await;
        assert!(s == 200 || s == 201, "{img}");
    }
    let mut fleet = Fleet::new(&server.url(""), &server.token);
    let labels = [
        ("scheduler", "slurm".to_string()),
        ("slurm-node", "bfnode1".to_string()),
        ("pool", "s".to_string()),
    ];
    fleet.add(0, "gpu:stable", &labels).await;
    let mac = mac_of(0);
    let node_state = || async {
        let (_, n) = fleet
            .admin(reqwest::Method::GET, &format!("/api/v1/nodes/{mac}"), None)
            .await;
        n["state"].as_str().unwrap_or("").to_string()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while node_state().await != "ready" {
        assert!(Instant::now() < deadline, "the node never got ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A job on the node; then the rollout.
    let job = slurm.run(
        "sbatch",
        &["--parsable", "-w", "bfnode1", "--wrap", "sleep 6"],
    );
    let job = job.trim().to_string();
    wait_for(|| slurm.job(&job) == "R", 30, "the job running");
    let (s, started) = fleet
        .admin(
            reqwest::Method::POST,
            "/api/v1/rollouts",
            Some(
                json!({ "image": "gpu:next", "selector": "pool=s", "max_unavailable": 1,
                         "timeout_secs": 60, "reason": "cuda 12.4" }),
            ),
        )
        .await;
    assert_eq!(s, 201, "{started}");
    let id = started["id"].as_i64().unwrap();

    // While the job runs: Slurm drains the node, bootfleet waits, the node stays ready.
    // The step is written before Slurm is asked (a restart in between asks again), so
    // for a moment bootfleet says draining and Slurm does not yet: wanted is that Slurm
    // shows the drain while the job still runs.
    let mut seen_draining = false;
    let mut last_seq_while_running = 0;
    while slurm.job(&job) == "R" {
        let (_, r) = fleet
            .admin(
                reqwest::Method::GET,
                &format!("/api/v1/rollouts/{id}"),
                None,
            )
            .await;
        let status = r["nodes"][0]["status"].as_str().unwrap_or("").to_string();
        let state = slurm.state();
        if status == "draining" && state.contains("DRAIN") && slurm.job(&job) == "R" {
            seen_draining = true;
        }
        assert_ne!(status, "reimaging", "reimaged while its job ran");
        assert_eq!(
            node_state().await,
            "ready",
            "the node left ready while its job ran"
        );
        last_seq_while_running = all_events(&fleet).await.last().unwrap()["seq"]
            .as_i64()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        seen_draining,
        "never seen draining (bootfleet) and DRAIN (Slurm) while the job ran"
    );

    let end = wait_rollout(&fleet, id, 60, |r| r["state"] != "running").await;
    assert_eq!(end["state"], "finished", "{end:#}");
    assert_eq!(end["nodes"][0]["status"], "done");
    let state = slurm.state();
    assert!(
        !state.contains("DRAIN"),
        "not handed back to Slurm: {state}"
    );

    // The log: drain asked, reimaged only after the job was seen running for the last
    // time, handed back after done.
    let events = all_events(&fleet).await;
    let seq_of = |kind: &str, pred: &dyn Fn(&Value) -> bool| {
        events
            .iter()
            .find(|e| e["kind"] == kind && pred(e))
            .unwrap_or_else(|| panic!("no {kind} event"))["seq"]
            .as_i64()
            .unwrap()
    };
    let draining = seq_of("rollout.node-draining", &|_| true);
    let reimaging = seq_of("node.state", &|e| e["data"]["to"] == "reimaging");
    let done = seq_of("rollout.node-done", &|_| true);
    let resumed = seq_of("rollout.node-resumed", &|e| {
        e["data"]["reason"] == "handed back to its scheduler"
    });
    assert!(draining < reimaging);
    assert!(
        reimaging > last_seq_while_running,
        "reimaged while the job ran"
    );
    assert!(
        reimaging < resumed && resumed < done,
        "handed back before it was ready again"
    );
    // The new boot's timeline opens with the drain that led to it.
    let (_, node) = fleet
        .admin(reqwest::Method::GET, &format!("/api/v1/nodes/{mac}"), None)
        .await;
    let steps: Vec<&str> = node["boots"][0]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["step"].as_str().unwrap())
        .collect();
    assert_eq!(
        steps[..2],
        [
            format!("scheduler drain asked (rollout {id})"),
            format!("scheduler drained (rollout {id})")
        ],
        "{steps:?}"
    );
    fleet.stop().await;
    server.stop().await;
    drop(slurm);
}
