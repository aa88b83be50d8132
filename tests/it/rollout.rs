//! Rollouts against fake nodes that behave as the agent does: boot what their script
//! names, attest, validate (an image listed as bad fails validation: 7 GPUs of 8),
//! heartbeat, and reboot when asked. The rules are checked from the event log, not from
//! the controller's own counters.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::fake_node::{healthy, parse_boot};
use crate::harness::*;

/// Fake nodes running as tasks against a server whose address may change (a restart).
pub struct Fleet {
    pub base: Arc<RwLock<String>>,
    pub token: String,
    /// Images (digests) whose validation fails.
    pub bad: Arc<RwLock<HashSet<String>>>,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    http: reqwest::Client,
}

pub fn mac_of(i: usize) -> String {
    format!("52-54-00-42-{:02x}-{:02x}", i / 256, i % 256)
}

impl Fleet {
    pub fn new(base: &str, token: &str) -> Self {
        Self {
            base: Arc::new(RwLock::new(base.to_string())),
            token: token.to_string(),
            bad: Default::default(),
            stop: CancellationToken::new(),
            tasks: Vec::new(),
            http: bootfleet::http_client::builder().build().unwrap(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base.read().unwrap())
    }

    pub async fn admin(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut req = self
            .http
            .request(method, self.url(path))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Registers node `i` (assigned `image`, with `labels`) and starts its agent.
    pub async fn add(&mut self, i: usize, image: &str, labels: &[(&str, String)]) {
        let mac = mac_of(i);
        let (s, _) = self
            .admin(
                reqwest::Method::PUT,
                &format!("/api/v1/nodes/{mac}/image"),
                Some(json!({ "image": image })),
            )
            .await;
        assert_eq!(s, 200);
        let set: BTreeMap<&str, &String> = labels.iter().map(|(k, v)| (*k, v)).collect();
        let (s, _) = self
            .admin(
                reqwest::Method::PATCH,
                &format!("/api/v1/nodes/{mac}/labels"),
                Some(json!({ "set": set })),
            )
            .await;
        assert_eq!(s, 200);
        let agent = Agent {
            mac,
            base: self.base.clone(),
            bad: self.bad.clone(),
            http: self.http.clone(),
        };
        let stop = self.stop.clone();
        self.tasks.push(tokio::spawn(async move {
            tokio::select! {
                () = agent.run() => {}
                () = stop.cancelled() => {}
            }
        }));
    }

    pub async fn stop(self) {
        self.stop.cancel();
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

struct Agent {
    mac: String,
    base: Arc<RwLock<String>>,
    bad: Arc<RwLock<HashSet<String>>>,
    http: reqwest::Client,
}

impl Agent {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base.read().unwrap())
    }

    /// Boots, then heartbeats until asked to reboot; again and again. A server that
    /// does not answer (restarting) is waited for.
    async fn run(&self) {
        loop {
            if self.boot_once().await.is_none() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }

    async fn post(&self, route: &str, token: &str, body: Value) -> Option<(u16, Value)> {
        let r = self
            .http
            .post(self.url(route))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await
            .ok()?;
        let status = r.status().as_u16();
        Some((status, r.json().await.unwrap_or(Value::Null)))
    }

    async fn boot_once(&self) -> Option<()> {
        let r = self
            .http
            .get(self.url(&format!("/boot/node.ipxe?mac={}", self.mac)))
            .send()
            .await
            .ok()?;
        if r.status() != 200 {
            return None;
        }
        let script = r.text().await.ok()?;
        if !script.lines().any(|l| l.starts_with("kernel ")) {
            return None; // quarantined or unassigned: nothing to boot
        }
        let digest = script
            .lines()
            .nth(1)?
            .rsplit_once('(')?
            .1
            .trim_end_matches(')')
            .to_string();
        let boot = parse_boot(script);
        let mut artifacts = Vec::new();
        for url in &boot.urls {
            let bytes = self.http.get(url).send().await.ok()?.bytes().await.ok()?;
            artifacts.push(bootfleet::api::Digest::of(&bytes).to_string());
        }
        let colons = self.mac.replace('-', ":");
        let report = json!({
            "image_digest": digest,
            "kernel_release": "6.1.0-28-cloud-amd64",
            "cmdline": boot.cmdline,
            "versions": { "nvidia-driver": "550.127.05" },
            "modules": { "nvidia": "550.127.05" },
            "artifacts": artifacts,
        });
        let body = json!({ "boot_id": boot.id, "mac": colons, "report": report });
        let (s, _) = self.post("/api/v1/agent/attest", &boot.token, body).await?;
        if s != 200 {
            return None;
        }
        let mut gpus = healthy();
        if self.bad.read().unwrap().contains(&digest) {
            gpus["gpus"].as_array_mut().unwrap().pop();
        }
        let body = json!({ "boot_id": boot.id, "mac": colons, "report": gpus });
        self.post("/api/v1/agent/validate", &boot.token, body)
            .await?;
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let body = json!({ "boot_id": boot.id, "mac": colons });
            match self
                .post("/api/v1/agent/heartbeat", &boot.token, body)
                .await
            {
                Some((200, answer)) if answer["action"] == "reboot" => return Some(()),
                Some((200, _)) | None => continue,
                // Our boot is no longer the node's (a stale token): boot afresh.
                Some(_) => return Some(()),
            }
        }
    }
}

impl Fleet {
    /// Starts a rollout (201 or the test fails); its answer.
    pub async fn start_rollout(&self, body: Value) -> Value {
        let (s, started) = self
            .admin(reqwest::Method::POST, "/api/v1/rollouts", Some(body))
            .await;
        assert_eq!(s, 201, "{started}");
        started
    }

    /// The newest event's seq.
    pub async fn head(&self) -> i64 {
        all_events(self)
            .await
            .last()
            .map_or(0, |e| e["seq"].as_i64().unwrap())
    }
}

/// Every event so far, oldest first.
pub async fn all_events(fleet: &Fleet) -> Vec<Value> {
    let mut out = Vec::new();
    let mut since = 0;
    loop {
        let (s, page) = fleet
            .admin(
                reqwest::Method::GET,
                &format!("/api/v1/events?since={since}&limit=1000"),
                None,
            )
            .await;
        assert_eq!(s, 200, "{page}");
        let events = page["events"].as_array().unwrap().clone();
        if events.is_empty() {
            return out;
        }
        since = page["next"].as_i64().unwrap();
        out.extend(events);
    }
}

/// Polls the rollout until `done` holds for it (or panics after `secs`).
pub async fn wait_rollout(
    fleet: &Fleet,
    id: i64,
    secs: u64,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let (s, r) = fleet
            .admin(
                reqwest::Method::GET,
                &format!("/api/v1/rollouts/{id}"),
                None,
            )
            .await;
        if s == 200 && done(&r) {
            return r;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "rollout {id} never got there: {r:#}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until every node of the fleet is ready.
async fn wait_ready(fleet: &Fleet, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (_, nodes) = fleet
            .admin(reqwest::Method::GET, "/api/v1/nodes?state=ready", None)
            .await;
        if nodes.as_array().map_or(0, Vec::len) >= n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every node got ready: {nodes}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn publish(server: &TestServer, version: &str, tag: &str) -> Value {
    let (s, img) = server
        .publish_query(
            good_bundle(
                "gpu",
                version,
                &noise(4096, u64::from(version.as_bytes()[0])),
            ),
            &format!("?tag=gpu:{tag}"),
        )
        .await;
    assert!(s == 200 || s == 201, "{img}");
    img
}

fn fast(cfg: &mut bootfleet::config::ServerConfig) {
    cfg.rollouts.tick_ms = 100;
}

/// What the event log says: per node state changes after `from_seq`, replayed.
struct Replay {
    /// The most nodes out of ready at once, and the most reimaging per rack at once.
    max_unready: usize,
    max_reimaging_per_rack: usize,
    /// When each node first became reimaging (event seq), and how many times it did.
    reimaged_at: HashMap<String, Vec<i64>>,
}

fn replay(events: &[Value], from_seq: i64, racks: &HashMap<String, String>) -> Replay {
    let mut state: HashMap<String, String> = HashMap::new();
    let mut out = Replay {
        max_unready: 0,
        max_reimaging_per_rack: 0,
        reimaged_at: HashMap::new(),
    };
    for e in events {
        if e["kind"] != "node.state" {
            continue;
        }
        let mac = e["node"].as_str().unwrap().to_string();
        let to = e["data"]["to"].as_str().unwrap().to_string();
        state.insert(mac.clone(), to.clone());
        if e["seq"].as_i64().unwrap() <= from_seq {
            continue;
        }
        if to == "reimaging" {
            out.reimaged_at
                .entry(mac.clone())
                .or_default()
                .push(e["seq"].as_i64().unwrap());
        }
        let unready = state.values().filter(|s| *s != "ready").count();
        out.max_unready = out.max_unready.max(unready);
        let mut per_rack: HashMap<&str, usize> = HashMap::new();
        for (m, s) in &state {
            if s == "reimaging" {
                *per_rack.entry(racks[m].as_str()).or_default() += 1;
            }
        }
        out.max_reimaging_per_rack = out
            .max_reimaging_per_rack
            .max(per_rack.values().copied().max().unwrap_or(0));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_nodes_move_in_waves_within_the_budget_and_every_one_ends_ready_on_the_new_digest() {
    let server = TestServer::start_configured(fast).await;
    publish(&server, "1", "stable").await;
    let v2 = publish(&server, "2", "next").await;
    let mut fleet = Fleet::new(&server.url(""), &server.token);
    let mut racks = HashMap::new();
    for i in 0..30 {
        let rack = format!("r{}", i % 3);
        racks.insert(mac_of(i).replace('-', ":"), rack.clone());
        fleet
            .add(
                i,
                "gpu:stable",
                &[("rack", rack), ("sku", "hgx-h100".into())],
            )
            .await;
    }
    wait_ready(&fleet, 30).await;
    let head = fleet.head().await;

    let started = fleet
        .start_rollout(
            json!({ "image": "gpu:next", "selector": "sku=hgx-h100", "canary": 2, "wave": "10%",
                         "max_unavailable": 3, "timeout_secs": 60, "reason": "driver 550.127" }),
        )
        .await;
    let id = started["id"].as_i64().unwrap();
    assert_eq!(started["digest"], v2["digest"]);
    assert_eq!(
        started["waves"].as_array().unwrap().len(),
        11,
        "2 canaries, then 28 in waves of 3"
    );
    let done = wait_rollout(&fleet, id, 120, |r| r["state"] != "running").await;
    assert_eq!(done["state"], "finished", "{done:#}");
    assert!(
        done["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n["status"] == "done"),
        "{done:#}"
    );

    // Every node is ready on the new digest, by its own record.
    for i in 0..30 {
        let (_, node) = fleet
            .admin(
                reqwest::Method::GET,
                &format!("/api/v1/nodes/{}", mac_of(i)),
                None,
            )
            .await;
        assert_eq!(node["state"], "ready");
        assert_eq!(node["boots"][0]["image"], v2["digest"], "{node:#}");
        assert_eq!(node["assigned"], "gpu:next");
    }

    // The log: the budget held at every instant, each node reimaged once, and no wave
    // began before the one before it was done.
    let events = all_events(&fleet).await;
    let r = replay(&events, head, &racks);
    assert!(
        r.max_unready <= 3,
        "{} nodes out of ready at once",
        r.max_unready
    );
    assert!(
        r.max_reimaging_per_rack <= 2,
        "{} reimaging in one rack",
        r.max_reimaging_per_rack
    );
    assert_eq!(r.reimaged_at.len(), 30);
    assert!(
        r.reimaged_at.values().all(|v| v.len() == 1),
        "{:?}",
        r.reimaged_at
    );
    let wave_of: HashMap<String, u64> = done["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["mac"].as_str().unwrap().to_string(),
                n["wave"].as_u64().unwrap(),
            )
        })
        .collect();
    let mut last_done_of_wave: HashMap<u64, i64> = HashMap::new();
    for e in &events {
        if e["kind"] == "rollout.node-done" {
            let w = wave_of[e["node"].as_str().unwrap()];
            last_done_of_wave.insert(w, e["seq"].as_i64().unwrap());
        }
    }
    for (mac, seqs) in &r.reimaged_at {
        let w = wave_of[mac];
        if w > 0 {
            assert!(
                seqs[0] > last_done_of_wave[&(w - 1)],
                "{mac} (wave {w}) began before wave {} was done",
                w - 1
            );
        }
    }
    let kinds: HashSet<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    for k in [
        "rollout.started",
        "rollout.wave-started",
        "rollout.node-reimaging",
        "rollout.node-done",
        "rollout.finished",
    ] {
        assert!(kinds.contains(k), "no {k} event");
    }
    // The nodes are free for another rollout.
    let (s, again) = fleet
        .admin(
            reqwest::Method::POST,
            "/api/v1/rollouts",
            Some(json!({ "image": "gpu:stable", "selector": "rack=r0", "reason": "back" })),
        )
        .await;
    assert_eq!(s, 201, "{again}");
    fleet.stop().await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bad_image_halts_after_the_canaries_and_rolls_them_back_touching_no_other_node() {
    let server = TestServer::start_configured(fast).await;
    let v1 = publish(&server, "1", "stable").await;
    let bad = publish(&server, "2", "next").await;
    let mut fleet = Fleet::new(&server.url(""), &server.token);
    fleet
        .bad
        .write()
        .unwrap()
        .insert(bad["digest"].as_str().unwrap().to_string());
    for i in 0..10 {
        fleet
            .add(
                i,
                "gpu:stable",
                &[("rack", format!("r{}", i % 2)), ("pool", "a".into())],
            )
            .await;
    }
    wait_ready(&fleet, 10).await;
    let head = fleet.head().await;
    let started = fleet
        .start_rollout(
            json!({ "image": "gpu:next", "selector": "pool=a", "canary": 2, "wave": "4",
                         "max_unavailable": 2, "timeout_secs": 60, "on_failure": "rollback",
                         "reason": "driver 560 beta" }),
        )
        .await;
    let id = started["id"].as_i64().unwrap();
    let end = wait_rollout(&fleet, id, 120, |r| r["state"] == "rolled-back").await;
    let canaries: Vec<&Value> = end["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["wave"] == 0)
        .collect();
    assert_eq!(canaries.len(), 2);
    for c in &canaries {
        assert_eq!(c["status"], "rolled-back", "{end:#}");
        assert_eq!(c["previous_digest"], v1["digest"]);
    }
    assert!(
        end["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["wave"] != 0)
            .all(|n| n["status"] == "pending"),
        "{end:#}"
    );
    // The canaries are ready on the old digest again.
    for c in &canaries {
        let (_, node) = fleet
            .admin(
                reqwest::Method::GET,
                &format!("/api/v1/nodes/{}", c["mac"].as_str().unwrap()),
                None,
            )
            .await;
        assert_eq!(node["state"], "ready", "{node:#}");
        assert_eq!(node["boots"][0]["image"], v1["digest"]);
    }
    // The log: the halt names the failure; no node but the canaries was reimaged.
    let events = all_events(&fleet).await;
    let halted = events
        .iter()
        .find(|e| e["kind"] == "rollout.halted")
        .expect("a halted event");
    assert!(
        halted["data"]["reason"]
            .as_str()
            .unwrap()
            .contains("rolling back"),
        "{halted}"
    );
    let failed = events
        .iter()
        .find(|e| e["kind"] == "rollout.node-failed")
        .expect("a failed node");
    assert!(
        failed["data"]["reason"]
            .as_str()
            .unwrap()
            .contains("validation-failed"),
        "{failed}"
    );
    let canary_macs: HashSet<&str> = canaries
        .iter()
        .map(|c| c["mac"].as_str().unwrap())
        .collect();
    let touched: HashSet<&str> = events
        .iter()
        .filter(|e| {
            e["seq"].as_i64().unwrap() > head
                && e["kind"] == "node.state"
                && e["data"]["to"] == "reimaging"
        })
        .map(|e| e["node"].as_str().unwrap())
        .collect();
    assert_eq!(touched, canary_macs);
    fleet.stop().await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_rollouts_are_refused_and_admin_actions_follow_the_states() {
    let server = TestServer::start_configured(fast).await;
    publish(&server, "1", "stable").await;
    publish(&server, "2", "next").await;
    // No agents: the nodes never come back, so the first rollout stays running.
    for i in 0..4 {
        server.assign(&mac_of(i), "gpu:stable").await;
        let labels = json!({ "set": { "rack": if i < 2 { "r1" } else { "r2" }, "sku": "h100" } });
        let r = server
            .http
            .patch(server.url(&format!("/api/v1/nodes/{}/labels", mac_of(i))))
            .bearer_auth(&server.token)
            .json(&labels)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let fleet = Fleet::new(&server.url(""), &server.token);
    let start =
        |selector: &str| json!({ "image": "gpu:next", "selector": selector, "reason": "test" });
    let (s, a) = fleet
        .admin(
            reqwest::Method::POST,
            "/api/v1/rollouts",
            Some(start("rack=r1")),
        )
        .await;
    assert_eq!(s, 201, "{a}");
    let a = a["id"].as_i64().unwrap();
    let (s, refused) = fleet
        .admin(
            reqwest::Method::POST,
            "/api/v1/rollouts",
            Some(start("sku=h100")),
        )
        .await;
    assert_eq!(s, 409, "{refused}");
    assert!(
        refused["error"]
            .as_str()
            .unwrap()
            .contains(&format!("rollout {a}")),
        "{refused}"
    );
    // Nothing of the refused one was kept.
    let (_, list) = fleet
        .admin(reqwest::Method::GET, "/api/v1/rollouts", None)
        .await;
    assert_eq!(list.as_array().unwrap().len(), 1);
    // Bad requests, each with its reason.
    for (body, needle) in [
        (
            json!({ "image": "gpu:next", "selector": "rack=r9", "reason": "x" }),
            "no node matches",
        ),
        (
            json!({ "image": "gpu:nope", "selector": "rack=r2", "reason": "x" }),
            "gpu:nope",
        ),
        (
            json!({ "image": "gpu:next", "selector": "", "reason": "x" }),
            "selector",
        ),
        (
            json!({ "image": "gpu:next", "selector": "rack=r2", "reason": "x", "wave": "0%" }),
            "wave",
        ),
        (
            json!({ "image": "gpu:next", "selector": "rack=r2", "reason": "x", "canary": 3 }),
            "canaries",
        ),
        (
            json!({ "image": "gpu:next", "selector": "rack=r2", "reason": " " }),
            "reason",
        ),
    ] {
        let (s, e) = fleet
            .admin(
                reqwest::Method::POST,
                "/api/v1/rollouts",
                Some(body.clone()),
            )
            .await;
        assert!(s == 400 || s == 404, "{body}: {s} {e}");
        assert!(e["error"].as_str().unwrap().contains(needle), "{body}: {e}");
    }
    let act = |verb: &str| {
        (
            reqwest::Method::POST,
            format!("/api/v1/rollouts/{a}/{verb}"),
            Some(json!({ "reason": "ops" })),
        )
    };
    let (m, p, b) = act("resume");
    assert_eq!(
        fleet.admin(m, &p, b).await.0,
        409,
        "a running rollout does not resume"
    );
    let (m, p, b) = act("pause");
    let (s, paused) = fleet.admin(m, &p, b).await;
    assert_eq!((s, paused["state"].as_str()), (200, Some("paused")));
    let (m, p, b) = act("abort");
    let (s, aborted) = fleet.admin(m, &p, b).await;
    assert_eq!((s, aborted["state"].as_str()), (200, Some("aborted")));
    let (m, p, b) = act("pause");
    assert_eq!(fleet.admin(m, &p, b).await.0, 409);
    let (m, p, b) = act("launch");
    assert_eq!(fleet.admin(m, &p, b).await.0, 404);
    // Aborted, it holds nothing: the wider rollout may start now.
    let (s, b2) = fleet
        .admin(
            reqwest::Method::POST,
            "/api/v1/rollouts",
            Some(start("sku=h100")),
        )
        .await;
    assert_eq!(s, 201, "{b2}");
    assert_eq!(
        fleet
            .admin(reqwest::Method::GET, "/api/v1/rollouts/999", None)
            .await
            .0,
        404
    );
    // Without the token, nothing.
    let r = reqwest::get(server.url("/api/v1/rollouts")).await.unwrap();
    assert_eq!(r.status(), 401);
    server.stop().await;
}

/// The real binary, killed with SIGKILL while nodes are in flight, started again on the
/// same data: the rollout goes on where it was (once the dead server's role lapses) and
/// ends with every node done, none reimaged twice, none skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_killed_mid_rollout_finishes_it_after_restart_reimaging_no_node_twice() {
    use crate::process::ServerProcess;
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");
    let config = work.path().join("bootfleet.toml");
    std::fs::write(&config, "[rollouts]\ntick_ms = 100\n").unwrap();
    let server = ServerProcess::spawn_configured(&data, Some(&config));
    let token = std::fs::read_to_string(data.join("admin.token"))
        .unwrap()
        .trim()
        .to_string();
    let mut fleet = Fleet::new(&server.url, &token);
    for (version, tag) in [("1", "stable"), ("2", "next")] {
        let r = bootfleet::http_client::builder()
            .build()
            .unwrap()
            .post(fleet.url(&format!("/api/v1/images?tag=gpu:{tag}")))
            .bearer_auth(&token)
            .body(good_bundle(
                "gpu",
                version,
                &noise(4096, u64::from(version.as_bytes()[0])),
            ))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    }
    for i in 0..12 {
        fleet
            .add(
                i,
                "gpu:stable",
                &[("rack", format!("r{}", i % 3)), ("pool", "k".into())],
            )
            .await;
    }
    wait_ready(&fleet, 12).await;
    let head = fleet.head().await;
    let started = fleet
        .start_rollout(
            json!({ "image": "gpu:next", "selector": "pool=k", "canary": 1, "wave": "2",
                         "max_unavailable": 2, "timeout_secs": 120, "reason": "kernel fix" }),
        )
        .await;
    let id = started["id"].as_i64().unwrap();
    let done = |r: &Value| {
        r["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["status"] == "done")
            .count()
    };
    let mid = wait_rollout(&fleet, id, 60, |r| done(r) >= 4).await;
    server.kill9();
    assert!(
        done(&mid) < 12,
        "the kill came too late to test anything: {mid:#}"
    );

    let server = ServerProcess::spawn_configured(&data, Some(&config));
    *fleet.base.write().unwrap() = server.url.clone();
    // The dead server's role lapses within 20 s; then the new one goes on.
    let end = wait_rollout(&fleet, id, 90, |r| r["state"] != "running").await;
    assert_eq!(end["state"], "finished", "{end:#}");
    assert_eq!(done(&end), 12, "{end:#}");
    let events = all_events(&fleet).await;
    let mut reimaged: HashMap<&str, usize> = HashMap::new();
    for e in &events {
        if e["seq"].as_i64().unwrap() > head
            && e["kind"] == "node.state"
            && e["data"]["to"] == "reimaging"
        {
            *reimaged.entry(e["node"].as_str().unwrap()).or_default() += 1;
        }
    }
    assert_eq!(reimaged.len(), 12, "{reimaged:?}");
    assert!(
        reimaged.values().all(|n| *n == 1),
        "a node was reimaged twice: {reimaged:?}"
    );
    // The CLI, as an operator uses it, against the restarted server.
    use crate::process::{cli, cli_json};
    let shown = cli_json(&server, &data, &["rollout", "show", &id.to_string()]);
    assert_eq!(
        (
            shown["state"].as_str(),
            shown["nodes"].as_array().unwrap().len()
        ),
        (Some("finished"), 12)
    );
    let (ok, text, err) = cli(&server, &data, &["rollout", "list"]);
    assert!(
        ok && text.contains("finished") && text.contains("pool=k"),
        "{text}{err}"
    );
    let (ok, text, err) = cli(&server, &data, &["rollout", "show", &id.to_string()]);
    assert!(
        ok && text.contains("(canary)") && text.contains("done"),
        "{text}{err}"
    );
    let back = cli_json(
        &server,
        &data,
        &[
            "rollout",
            "start",
            "gpu:stable",
            "--node",
            &mac_of(0).replace('-', ":"),
            "--reason",
            "back to 1",
        ],
    );
    assert_eq!(back["nodes"].as_array().unwrap().len(), 1);
    let (ok, _, err) = cli(
        &server,
        &data,
        &["rollout", "pause", &back["id"].to_string()],
    );
    assert!(
        !ok && err.contains("reason"),
        "an action without --reason: {err}"
    );
    let (ok, _, err) = cli(
        &server,
        &data,
        &["rollout", "start", "gpu:stable", "--reason", "x"],
    );
    assert!(!ok && err.contains("--selector"), "{err}");
    fleet.stop().await;
    drop(server);
}

/// A drain hook that records what it is told in `dir` and says drained once
/// `dir/<mac>.free` exists.
fn hook_script(dir: &std::path::Path) -> std::path::PathBuf {
    let script = dir.join("hook.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nd={d}\nm=$(echo \"$BOOTFLEET_NODE_MAC\" | tr : -)\ncase \"$1\" in\n\
             drain) printf '%s\\n%s\\n' \"$BOOTFLEET_NODE_LABELS\" \"$BOOTFLEET_REASON\" > $d/$m.draining ;;\n\
             status) if [ -e $d/$m.free ]; then echo drained; else echo draining; fi ;;\n\
             resume) touch $d/$m.resumed ;;\n*) exit 2 ;;\nesac\n",
            d = dir.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

/// The hook scheduler: an operator's program asked to drain, polled for its status, and
/// told to resume, with the node in its environment; a drain past the drain timeout is
/// skipped (and handed back); a label naming no scheduler fails that node alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hook_drains_and_resumes_nodes_and_a_slow_drain_is_skipped() {
    let hooks = tempfile::tempdir().unwrap();
    let dir = hooks.path().to_path_buf();
    let script = hook_script(&dir);
    let server = TestServer::start_configured(|cfg| {
        cfg.rollouts.tick_ms = 100;
        cfg.drain.timeout_secs = 8;
        cfg.drain.hook = Some(bootfleet::rollout::drain::hook::HookSettings {
            command: script.clone(),
            timeout_secs: 10,
        });
    })
    .await;
    publish(&server, "1", "stable").await;
    publish(&server, "2", "next").await;
    let mut fleet = Fleet::new(&server.url(""), &server.token);
    for i in 0..3 {
        fleet
            .add(
                i,
                "gpu:stable",
                &[("scheduler", "hook".into()), ("pool", "h".into())],
            )
            .await;
    }
    fleet
        .add(
            3,
            "gpu:stable",
            &[("scheduler", "pbs".into()), ("pool", "h".into())],
        )
        .await;
    wait_ready(&fleet, 4).await;
    let started = fleet
        .start_rollout(
            json!({ "image": "gpu:next", "selector": "pool=h", "wave": "4", "max_unavailable": 4,
                         "max_failures": 1, "timeout_secs": 60, "reason": "hooked" }),
        )
        .await;
    let id = started["id"].as_i64().unwrap();
    let status_of = |r: &Value, i: usize| {
        let mac = mac_of(i).replace('-', ":");
        r["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["mac"] == mac.as_str())
            .unwrap()["status"]
            .as_str()
            .unwrap()
            .to_string()
    };
    // The controller starts the wave's nodes one after another: wait for the fourth too.
    let r = wait_rollout(&fleet, id, 30, |r| {
        (0..3).all(|i| status_of(r, i) == "draining") && status_of(r, 3) != "pending"
    })
    .await;
    assert_eq!(status_of(&r, 3), "failed", "{r:#}");
    // What the hook was told.
    let told = std::fs::read_to_string(dir.join(format!("{}.draining", mac_of(0)))).unwrap();
    assert!(
        told.contains("\"scheduler\":\"hook\"") && told.contains(&format!("rollout {id}")),
        "{told}"
    );
    // Nodes 0 and 1 drain; node 2 never does.
    for i in 0..2 {
        std::fs::write(dir.join(format!("{}.free", mac_of(i))), "").unwrap();
    }
    let end = wait_rollout(&fleet, id, 60, |r| r["state"] != "running").await;
    assert_eq!(end["state"], "finished", "{end:#}");
    assert_eq!(
        [status_of(&end, 0), status_of(&end, 1), status_of(&end, 2)],
        ["done", "done", "skipped"]
    );
    let failed = end["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["status"] == "failed")
        .unwrap();
    assert!(
        failed["reason"]
            .as_str()
            .unwrap()
            .contains("scheduler=pbs names no scheduler"),
        "{failed}"
    );
    for i in 0..3 {
        assert!(
            dir.join(format!("{}.resumed", mac_of(i))).exists(),
            "node {i} not handed back"
        );
        std::fs::remove_file(dir.join(format!("{}.resumed", mac_of(i)))).unwrap();
    }
    // Rolled back: the two it reimaged are drained again first (their scheduler may have
    // given them work since), then go back; the skipped and the failed are not touched.
    let (s, back) = fleet
        .admin(
            reqwest::Method::POST,
            &format!("/api/v1/rollouts/{id}/rollback"),
            Some(json!({ "reason": "driver regressed" })),
        )
        .await;
    assert_eq!(s, 200, "{back}");
    let end = wait_rollout(&fleet, id, 60, |r| r["state"] == "rolled-back").await;
    assert_eq!(
        [
            status_of(&end, 0),
            status_of(&end, 1),
            status_of(&end, 2),
            status_of(&end, 3)
        ],
        ["rolled-back", "rolled-back", "skipped", "failed"],
        "{end:#}"
    );
    for i in 0..2 {
        let told = std::fs::read_to_string(dir.join(format!("{}.draining", mac_of(i)))).unwrap();
        assert!(
            told.contains("rolling back"),
            "node {i} not drained before its rollback: {told}"
        );
        assert!(
            dir.join(format!("{}.resumed", mac_of(i))).exists(),
            "node {i} not handed back"
        );
    }
    assert!(!dir.join(format!("{}.resumed", mac_of(2))).exists());
    fleet.stop().await;
    server.stop().await;
}

/// An admin's reimage of a node with a scheduler waits for its drain (a one-node rollout,
/// answered "draining" with its number; asking again gets the same one); a node without
/// one is reimaged at once, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_manual_reimage_of_a_node_with_a_scheduler_waits_for_its_drain() {
    let hooks = tempfile::tempdir().unwrap();
    let dir = hooks.path().to_path_buf();
    let script = hook_script(&dir);
    let server = TestServer::start_configured(|cfg| {
        cfg.rollouts.tick_ms = 100;
        cfg.drain.hook = Some(bootfleet::rollout::drain::hook::HookSettings {
            command: script.clone(),
            timeout_secs: 10,
        });
    })
    .await;
    publish(&server, "1", "stable").await;
    let mut fleet = Fleet::new(&server.url(""), &server.token);
    fleet
        .add(0, "gpu:stable", &[("scheduler", "hook".into())])
        .await;
    fleet.add(1, "gpu:stable", &[]).await;
    wait_ready(&fleet, 2).await;
    let reimage = |i: usize| {
        let path = format!("/api/v1/nodes/{}/reimage", mac_of(i));
        (path, json!({ "reason": "XID 79 on GPU 3" }))
    };
    let (p, b) = reimage(0);
    let (s, first) = fleet
        .admin(reqwest::Method::POST, &p, Some(b.clone()))
        .await;
    assert_eq!(
        (s, first["outcome"].as_str()),
        (202, Some("draining")),
        "{first}"
    );
    let id = first["rollout"].as_i64().unwrap();
    let (_, again) = fleet.admin(reqwest::Method::POST, &p, Some(b)).await;
    assert_eq!(
        (again["outcome"].as_str(), again["rollout"].as_i64()),
        (Some("draining"), Some(id))
    );
    let r = wait_rollout(&fleet, id, 30, |r| r["nodes"][0]["status"] == "draining").await;
    assert_eq!(r["spec"]["reason"], "reimage: XID 79 on GPU 3");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, node) = fleet
        .admin(
            reqwest::Method::GET,
            &format!("/api/v1/nodes/{}", mac_of(0)),
            None,
        )
        .await;
    assert_eq!(node["state"], "ready", "reimaged before its drain");
    std::fs::write(dir.join(format!("{}.free", mac_of(0))), "").unwrap();
    let end = wait_rollout(&fleet, id, 30, |r| r["state"] != "running").await;
    assert_eq!(
        (end["state"].as_str(), end["nodes"][0]["status"].as_str()),
        (Some("finished"), Some("done")),
        "{end:#}"
    );
    assert!(dir.join(format!("{}.resumed", mac_of(0))).exists());
    // No scheduler: at once.
    let (p, b) = reimage(1);
    let (s, now) = fleet.admin(reqwest::Method::POST, &p, Some(b)).await;
    assert_eq!(
        (s, now["outcome"].as_str()),
        (202, Some("accepted")),
        "{now}"
    );
    assert!(now.get("rollout").is_none());
    fleet.stop().await;
    server.stop().await;
}

/// What the drain endpoint below was sent, and whether it says drained yet.
#[derive(Clone, Default)]
struct DrainEndpoint {
    calls: Arc<std::sync::Mutex<Vec<Value>>>,
    free: Arc<std::sync::atomic::AtomicBool>,
}

/// An operator's drain endpoint: refuses a call whose signature does not verify with the
/// shared secret, records the rest, says draining until freed.
async fn drain_endpoint(
    axum::extract::State(ep): axum::extract::State<DrainEndpoint>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> (axum::http::StatusCode, String) {
    let signature = headers
        .get(bootfleet::events::webhook::SIGNATURE_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if bootfleet::events::webhook::verify(b"drain-s3cret", signature, &body).is_none() {
        return (axum::http::StatusCode::UNAUTHORIZED, "bad signature".into());
    }
    let call: Value = serde_json::from_slice(&body).unwrap();
    let action = call["action"].as_str().unwrap().to_string();
    ep.calls.lock().unwrap().push(call);
    let state = if ep.free.load(std::sync::atomic::Ordering::SeqCst) {
        "drained"
    } else {
        "draining"
    };
    match action.as_str() {
        "status" => (
            axum::http::StatusCode::OK,
            json!({ "state": state }).to_string(),
        ),
        _ => (axum::http::StatusCode::NO_CONTENT, String::new()),
    }
}

/// The webhook scheduler: signed calls to the operator's endpoint (which checks them),
/// the drain waited for, the node handed back after ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_signed_webhook_drains_and_resumes_a_node() {
    let ep = DrainEndpoint::default();
    let app = axum::Router::new()
        .route("/drain", axum::routing::post(drain_endpoint))
        .with_state(ep.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/drain", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let secrets = tempfile::tempdir().unwrap();
    let secret_file = secrets.path().join("drain.secret");
    std::fs::write(&secret_file, "drain-s3cret\n").unwrap();
    let server = TestServer::start_configured(|cfg| {
        cfg.rollouts.tick_ms = 100;
        cfg.drain.webhook = Some(bootfleet::rollout::drain::webhook::WebhookSettings {
            url: url.clone(),
            secret_file: secret_file.clone(),
            timeout_secs: 5,
        });
    })
    .await;
    publish(&server, "1", "stable").await;
    publish(&server, "2", "next").await;
    let mut fleet = Fleet::new(&server.url(""), &server.token);
    fleet
        .add(
            0,
            "gpu:stable",
            &[
                ("scheduler", "webhook".into()),
                ("k8s-node", "gpu-a1".into()),
            ],
        )
        .await;
    wait_ready(&fleet, 1).await;
    let body = json!({ "image": "gpu:next", "nodes": [mac_of(0).replace('-', ":")], "reason": "webhooked" });
    let (s, started) = fleet
        .admin(reqwest::Method::POST, "/api/v1/rollouts", Some(body))
        .await;
    assert_eq!(s, 201, "{started}");
    let id = started["id"].as_i64().unwrap();
    wait_rollout(&fleet, id, 30, |r| r["nodes"][0]["status"] == "draining").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, node) = fleet
        .admin(
            reqwest::Method::GET,
            &format!("/api/v1/nodes/{}", mac_of(0)),
            None,
        )
        .await;
    assert_eq!(node["state"], "ready", "reimaged before its drain");
    ep.free.store(true, std::sync::atomic::Ordering::SeqCst);
    let end = wait_rollout(&fleet, id, 30, |r| r["state"] != "running").await;
    assert_eq!(
        (end["state"].as_str(), end["nodes"][0]["status"].as_str()),
        (Some("finished"), Some("done")),
        "{end:#}"
    );
    let calls = ep.calls.lock().unwrap().clone();
    let actions: Vec<&str> = calls
        .iter()
        .map(|c| c["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions.first(), Some(&"drain"), "{actions:?}");
    assert_eq!(actions.last(), Some(&"resume"), "{actions:?}");
    assert!(actions.contains(&"status"));
    assert_eq!(calls[0]["node"]["labels"]["k8s-node"], "gpu-a1");
    assert!(calls[0]["reason"].as_str().unwrap().contains("webhooked"));
    fleet.stop().await;
    server.stop().await;
}

/// The same controller on PostgreSQL: waves, the budget and every node ready on the new
/// digest, from the event log.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rollout_runs_on_postgresql_too() {
    let url = crate::pg::database().await;
    let server = TestServer::start_configured(|cfg| {
        cfg.rollouts.tick_ms = 100;
        cfg.store.url = Some(url);
    })
    .await;
    publish(&server, "1", "stable").await;
    let v2 = publish(&server, "2", "next").await;
    let mut fleet = Fleet::new(&server.url(""), &server.token);
    let mut racks = HashMap::new();
    for i in 0..8 {
        let rack = format!("r{}", i % 2);
        racks.insert(mac_of(i).replace('-', ":"), rack.clone());
        fleet
            .add(i, "gpu:stable", &[("rack", rack), ("pg", "y".into())])
            .await;
    }
    wait_ready(&fleet, 8).await;
    let head = fleet.head().await;
    let body = json!({ "image": "gpu:next", "selector": "pg=y", "canary": 1, "wave": "3",
                       "max_unavailable": 2, "timeout_secs": 60, "reason": "on postgres" });
    let (s, started) = fleet
        .admin(reqwest::Method::POST, "/api/v1/rollouts", Some(body))
        .await;
    assert_eq!(s, 201, "{started}");
    let id = started["id"].as_i64().unwrap();
    let end = wait_rollout(&fleet, id, 120, |r| r["state"] != "running").await;
    assert_eq!(end["state"], "finished", "{end:#}");
    let events = all_events(&fleet).await;
    let r = replay(&events, head, &racks);
    assert!(r.max_unready <= 2, "{} out of ready at once", r.max_unready);
    assert!(
        r.reimaged_at.values().all(|v| v.len() == 1) && r.reimaged_at.len() == 8,
        "{:?}",
        r.reimaged_at
    );
    for i in 0..8 {
        let (_, node) = fleet
            .admin(
                reqwest::Method::GET,
                &format!("/api/v1/nodes/{}", mac_of(i)),
                None,
            )
            .await;
        assert_eq!(node["boots"][0]["image"], v2["digest"]);
    }
    fleet.stop().await;
    server.stop().await;
}
