//! Slurm from Debian, started once for this test binary on loopback: munged with a key
//! of its own, slurmctld and one slurmd (NodeName bfnode1), each beside a watchdog that
//! stops it when the test binary exits. The tests take the cluster in turn (each drains
//! bfnode1 and must hand it back). A job running on the node keeps a rollout from
//! reimaging it, and a health rule from revalidating it, until the job ends; the node is
//! handed back to Slurm (RESUME) once it is ready again.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::*;
use crate::oci::port_for_a_child;
use crate::rollout::{Fleet, all_events, mac_of, wait_rollout};

pub struct Slurm {
    /// Removed by munged's watchdog once the test binary has exited.
    dir: PathBuf,
}

static SHARED: std::sync::OnceLock<Slurm> = std::sync::OnceLock::new();
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The cluster, started on first use, for the caller alone while it holds the guard.
async fn cluster() -> (&'static Slurm, tokio::sync::MutexGuard<'static, ()>) {
    let turn = TURN.lock().await;
    let slurm = tokio::task::spawn_blocking(|| SHARED.get_or_init(Slurm::start))
        .await
        .unwrap();
    (slurm, turn)
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
        let cluster = Self { dir: dir.keep() };
        let d = cluster.dir.clone();
        let socket = d.join("munge.sock");
        cluster.spawn(
            "munged",
            &[
                "--foreground".to_string(),
                "--force".into(),
                format!("--socket={}", socket.display()),
                format!("--key-file={}", d.join("munge.key").display()),
                format!("--pid-file={}", d.join("munged.pid").display()),
                format!("--log-file={}", d.join("munged.log").display()),
                format!("--seed-file={}", d.join("munged.seed").display()),
            ],
            // The last to go (slurmctld and slurmd stop within a second of it).
            &format!("sleep 2; rm -rf {}", d.display()),
        );
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
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        cluster.spawn("slurmctld", &args(&["-D", "-f", c]), "");
        cluster.spawn("slurmd", &args(&["-D", "-f", c, "-N", "bfnode1"]), "");
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
        self.dir.join("slurm.conf")
    }

    /// Starts `program args` beside a watchdog that stops it once this test binary
    /// has exited (the cluster is shared, so no test's end stops it).
    fn spawn(&self, program: &str, args: &[String], then: &str) {
        let script = format!(
            "SLURM_CONF={conf} {program} {args} >/dev/null 2>&1 & p=$!; \
             while [ -d /proc/{me} ] && kill -0 $p 2>/dev/null; do sleep 0.5; done; \
             kill $p 2>/dev/null; wait $p; {then}",
            conf = self.conf().display(),
            program = sbin(program).display(),
            args = args.join(" "),
            me = std::process::id(),
        );
        crate::harness::run_detached(Command::new("sh"), &script, program);
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

    /// A job of `secs` seconds on bfnode1, once it runs; its id.
    pub fn start_job(&self, secs: u32) -> String {
        let wrap = format!("sleep {secs}");
        let job = self.run(
            "sbatch",
            &[
                "--parsable",
                "--output=/dev/null",
                "-w",
                "bfnode1",
                "--wrap",
                &wrap,
            ],
        );
        let job = job.trim().to_string();
        wait_for(|| self.job(&job) == "R", 30, "the job running");
        job
    }

    /// The job's state letter in squeue (R, PD), or "" once it has left the queue.
    pub fn job(&self, id: &str) -> String {
        self.run("squeue", &["-h", "-j", id, "-o", "%t"])
            .trim()
            .to_string()
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
    let (slurm, _turn) = cluster().await;
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
    let job = slurm.start_job(6);
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
}

/// A health rule's revalidation waits for the node's drain: corrected ECC climbing on a
/// node running a job drains it in Slurm and leaves it ready (no burn-in under the job);
/// once the job ends the node is sent to validate, and once ready again it is handed
/// back to Slurm. Each step is a `health.drain` event, in that order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_health_revalidation_waits_for_the_drain_and_hands_the_node_back() {
    use crate::fake_node::{FakeNode, healthy};
    use crate::health::{Sick, heartbeat_body};
    let (slurm, _turn) = cluster().await;
    let conf = slurm.conf();
    let server = TestServer::start_configured(|cfg| {
        cfg.rollouts.tick_ms = 100;
        cfg.drain.slurm.conf = Some(conf);
        cfg.health.rules = vec![bootfleet::health::Rule::new(
            "ecc-rising",
            // More than 100 corrected errors in 10 s.
            bootfleet::health::Condition::EccCorrectedRate {
                per_hour: 36_000.0,
                over_secs: 10,
            },
            bootfleet::health::Action::Revalidate,
        )];
    })
    .await;
    let (status, image) = server
        .publish_query(good_bundle("gpu", "1", &noise(4096, 3)), "?tag=gpu:stable")
        .await;
    assert_eq!(status, 201, "{image}");
    let mac = "52-54-00-31-00-01";
    let node = FakeNode::new(&server, mac);
    node.script().await;
    server.assign(mac, "gpu:stable").await;
    for (key, value) in [("scheduler", "slurm"), ("slurm-node", "bfnode1")] {
        server.label(mac, key, value).await;
    }
    let boot = node.boot_to_ready(&image).await;
    let (boot, node) = (&boot, &node);
    let beat = |sick: Option<Sick>, round: u64| async move {
        let body = heartbeat_body(boot, mac, sick, round);
        let (status, answer) = node
            .agent_post("/api/v1/agent/heartbeat", &boot.token, body)
            .await;
        assert_eq!(status, 200, "{answer}");
        answer["action"].as_str().unwrap().to_string()
    };

    let job = slurm.start_job(6);

    // Corrected ECC climbing: the verdict asks for a drain, not a validation.
    for round in 1..=3 {
        assert_eq!(beat(Some(Sick::EccRising), round).await, "none");
    }
    let verdicts = server
        .json(&format!("/api/v1/events?since=0&limit=1000&node={mac}"))
        .await
        .1;
    assert!(
        verdicts["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "health.verdict" && e["data"]["rule"] == "ecc-rising"),
        "no verdict: {verdicts}"
    );
    // While the job runs: drained in Slurm, ready here, never told to validate.
    let mut seen_drain = false;
    let mut last_seq_while_running = 0;
    while slurm.job(&job) == "R" {
        assert_eq!(beat(None, 0).await, "none", "revalidated while its job ran");
        assert_eq!(node.state().await, "ready");
        seen_drain |= slurm.state().contains("DRAIN") && slurm.job(&job) == "R";
        last_seq_while_running = server.json("/api/v1/events?since=0&limit=1000").await.1["events"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()["seq"]
            .as_i64()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(seen_drain, "Slurm never showed the drain while the job ran");

    // Once drained, a heartbeat asks for the revalidation; it passes; the node goes back.
    let revalidated = |what: &'static str| async move {
        let deadline = Instant::now() + Duration::from_secs(30);
        while beat(None, 0).await != "revalidate" {
            assert!(
                Instant::now() < deadline,
                "{what}: never asked to revalidate"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert_eq!(node.state().await, "validating");
        let (status, verdict) = node.validate(boot, healthy()).await;
        assert_eq!(
            (status, &verdict["passed"]),
            (200, &json!(true)),
            "{verdict}"
        );
        wait_for(|| !slurm.state().contains("DRAIN"), 30, what);
    };
    revalidated("the job is over: bfnode1 handed back to Slurm").await;

    let (_, page) = server
        .json(&format!("/api/v1/events?since=0&limit=1000&node={mac}"))
        .await;
    let steps: Vec<(String, i64)> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "health.drain")
        .map(|e| {
            (
                e["data"]["step"].as_str().unwrap().to_string(),
                e["seq"].as_i64().unwrap(),
            )
        })
        .collect();
    let names: Vec<&str> = steps.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(
        names,
        ["queued", "asked", "revalidating", "resumed"],
        "{page}"
    );
    assert!(
        steps[2].1 > last_seq_while_running,
        "sent to validate while the job ran"
    );
    assert_eq!(node.state().await, "ready");

    // An admin's revalidation of a node in service drains it first too.
    let answer = server
        .post_json(&format!("/api/v1/nodes/{mac}/revalidate"))
        .await;
    assert_eq!(answer["outcome"], "draining", "{answer}");
    revalidated("bfnode1 handed back after the admin's revalidation").await;
    server.stop().await;
}
