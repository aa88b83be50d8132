//! Whole lifecycles driven by a fake node and agent: discovery to ready, drift to reimage
//! to ready on a new digest, silence to unreachable and back, failed validation, refused
//! reports; and what watchers see: the events API, the SSE stream, signed webhooks, and
//! the boot timeline.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::fake_node::{FakeNode, gpu_uuids, healthy, validation_failure};
use crate::harness::*;

async fn publish_tagged(server: &TestServer, version: &str, seed: u64) -> Value {
    let (status, image) = server
        .publish_query(
            good_bundle("demo", version, &noise(30_000, seed)),
            "?tag=demo:stable",
        )
        .await;
    assert_eq!(status, 201, "{image}");
    image
}

async fn events(server: &TestServer, query: &str) -> Vec<Value> {
    let (status, page) = server.json(&format!("/api/v1/events{query}")).await;
    assert_eq!(status, 200, "{page}");
    page["events"].as_array().unwrap().clone()
}

/// The `to` of every node.state event, in order.
fn transitions(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["kind"] == "node.state")
        .map(|e| e["data"]["to"].as_str().unwrap().to_string())
        .collect()
}

/// Reads server-sent events until `until` holds for one; returns all read.
async fn read_sse(response: reqwest::Response, until: impl Fn(&Value) -> bool) -> Vec<Value> {
    let mut body = response.bytes_stream();
    let mut text = String::new();
    let mut got = Vec::new();
    let read = async {
        while let Some(chunk) = body.next().await {
            text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
            while let Some(end) = text.find("\n\n") {
                let frame: String = text.drain(..end + 2).collect();
                let data: Option<Value> = frame
                    .lines()
                    .find_map(|l| l.strip_prefix("data: "))
                    .map(|d| serde_json::from_str(d).unwrap());
                let id = frame.lines().find_map(|l| l.strip_prefix("id: "));
                if let Some(event) = data {
                    assert_eq!(id, Some(event["seq"].to_string().as_str()), "{frame}");
                    let done = until(&event);
                    got.push(event);
                    if done {
                        return;
                    }
                }
            }
        }
        panic!("the stream ended early");
    };
    tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .expect("the awaited event came within 20 s");
    got
}

#[tokio::test]
async fn discovery_to_ready_with_events_a_stream_and_a_timeline() {
    let server = TestServer::start().await;
    let stream = server
        .get("/api/v1/events/stream?since=0")
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    assert_eq!(stream.headers()["content-type"], "text/event-stream");

    let image = publish_tagged(&server, "1", 1).await;
    let node = FakeNode::new(&server, "52-54-00-10-00-01");
    assert!(node.script().await.contains("new to bootfleet"));
    assert_eq!(node.state().await, "discovered");
    server.assign(&node.mac, "demo:stable").await;
    let boot = node.boot_to_ready(&image).await;

    // Same facts as attested: no drift, nothing to do.
    let facts = json!({ "kernel_release": "6.1.0-28-cloud-amd64", "cmdline": boot.cmdline,
        "versions": { "nvidia-driver": "550.127.05" }, "modules": { "nvidia": "550.127.05" },
        "gpus": gpu_uuids(8) });
    let (status, answer) = node.heartbeat(&boot, Some(facts)).await;
    let attested: std::collections::BTreeMap<String, String> =
        [("nvidia".to_string(), "550.127.05".to_string())].into();
    let listed = bootfleet::api::agent::modules_digest(&attested).to_string();
    assert_eq!(
        (status, &answer),
        (
            200,
            &json!({ "action": "none", "baseline_modules_sha256": listed })
        ),
        "the baseline's module list named by its digest"
    );

    // The state changes (the assignment is an event of its own, by the admin).
    let all: Vec<Value> = events(&server, "?since=0")
        .await
        .into_iter()
        .filter(|e| e["kind"] == "node.state")
        .collect();
    assert_eq!(
        transitions(&all),
        [
            "discovered",
            "provisioning",
            "booted",
            "validating",
            "ready"
        ]
    );
    let seqs: Vec<i64> = all.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    assert!(all.iter().all(|e| e["node"] == node.colons().as_str()));
    // Paging and filtering.
    let page = events(&server, &format!("?since={}&limit=2", seqs[1])).await;
    assert_eq!(transitions(&page), ["booted", "validating"]);
    assert!(events(&server, "?node=52-54-00-99-99-99").await.is_empty());
    assert_eq!(server.json("/api/v1/events?limit=0").await.0, 400);
    assert_eq!(server.json("/api/v1/events?node=nonsense").await.0, 400);

    // The stream saw the same, live.
    let streamed = read_sse(stream, |e| e["data"]["to"] == "ready").await;
    assert_eq!(transitions(&streamed), transitions(&all));
    // A reconnect resumes after Last-Event-ID.
    let resumed = server
        .get("/api/v1/events/stream")
        .header("last-event-id", seqs[2].to_string())
        .send()
        .await
        .unwrap();
    let rest = read_sse(resumed, |e| e["data"]["to"] == "ready").await;
    assert_eq!(transitions(&rest), ["validating", "ready"]);
    let r = server
        .get("/api/v1/events/stream")
        .header("last-event-id", "x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    // The boot as a timeline, by API and by CLI.
    assert!(boot.kernel_line().contains(&format!("?boot={} ", boot.id)));
    let detail = node.node().await;
    assert!(detail.as_object().unwrap().contains_key("bmc"), "{detail}");
    let timeline = &detail["boots"][0];
    assert_eq!(timeline["id"], boot.id.as_str());
    let steps: Vec<&str> = timeline["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["step"].as_str().unwrap())
        .collect();
    assert_eq!(
        steps,
        [
            "script",
            "kernel",
            "initrd initrd.img",
            "attested",
            "validated"
        ]
    );
    assert_eq!(timeline["stopped_at"], Value::Null);
    // tokio's Command: a blocking wait would stall the in-process server it talks to.
    let out = tokio::process::Command::new(bin())
        .args(["node", "show", &node.mac, "--server", &server.url("")])
        .env("BOOTFLEET_TOKEN", &server.token)
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("reached ready"), "{text}");
    assert!(text.contains("initrd initrd.img"), "{text}");
    let out = tokio::process::Command::new(bin())
        .args(["node", "events", &node.mac, "--output", "json"])
        .args(["--server", &server.url("")])
        .env("BOOTFLEET_TOKEN", &server.token)
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let page: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        transitions(page["events"].as_array().unwrap()),
        transitions(&all)
    );
    server.stop().await;
}

/// A heartbeat may send the digest its last answer named in place of its module list
/// (some 5 KB on a GPU server): the same list, no drift; another digest, no drift either
/// but the baseline's named again (the agent then sends its list, which names what
/// differs).
#[tokio::test]
async fn a_heartbeat_may_send_its_module_lists_digest_in_its_place() {
    let server = TestServer::start().await;
    let image = publish_tagged(&server, "1", 1).await;
    let node = FakeNode::new(&server, "52-54-00-10-00-0d");
    node.script().await;
    server.assign(&node.mac, "demo:stable").await;
    let boot = node.boot_to_ready(&image).await;
    let attested: std::collections::BTreeMap<String, String> =
        [("nvidia".to_string(), "550.127.05".to_string())].into();
    let listed = bootfleet::api::agent::modules_digest(&attested).to_string();
    let mut facts = json!({ "kernel_release": "6.1.0-28-cloud-amd64", "cmdline": boot.cmdline,
        "versions": { "nvidia-driver": "550.127.05" }, "modules": {}, "modules_sha256": listed,
        "gpus": gpu_uuids(8) });
    let unchanged = json!({ "action": "none", "baseline_modules_sha256": listed });
    let (status, answer) = node.heartbeat(&boot, Some(facts.clone())).await;
    assert_eq!((status, &answer), (200, &unchanged));
    let mut other = attested.clone();
    other.insert("nouveau".into(), String::new());
    facts["modules_sha256"] = json!(bootfleet::api::agent::modules_digest(&other).to_string());
    let (_, answer) = node.heartbeat(&boot, Some(facts.clone())).await;
    assert_eq!(
        answer, unchanged,
        "not a drift: the baseline's digest named again"
    );
    assert_eq!(node.state().await, "ready");
    // The list itself names what differs.
    facts["modules"] = json!({ "nvidia": "550.127.05", "nouveau": "" });
    let (_, answer) = node.heartbeat(&boot, Some(facts)).await;
    assert_eq!(
        answer["drift"],
        json!([{ "field": "modules.nouveau", "was": "(absent)", "now": "" }]),
        "{answer}"
    );
    assert_eq!(node.state().await, "drifted");
    server.stop().await;
}

#[tokio::test]
async fn drift_is_named_and_by_policy_reimages_to_ready_on_a_new_digest() {
    use bootfleet::node::policy::DriftAction;
    let server = TestServer::start_configured(|cfg| {
        cfg.lifecycle
            .drift_by_label
            .insert("pool=batch".into(), DriftAction::Reimage);
    })
    .await;
    let v1 = publish_tagged(&server, "1", 2).await;
    let batch = FakeNode::new(&server, "52-54-00-10-00-02");
    let training = FakeNode::new(&server, "52-54-00-10-00-03");
    for n in [&batch, &training] {
        server.assign(&n.mac, "demo:stable").await;
    }
    server.label(&batch.mac, "pool", "batch").await;
    let b1 = batch.boot_to_ready(&v1).await;
    let t1 = training.boot_to_ready(&v1).await;

    // A new version is tagged; then both nodes report another driver and a lost GPU.
    let v2 = publish_tagged(&server, "2", 3).await;
    let drifted = |boot: &crate::fake_node::Boot| {
        json!({ "kernel_release": "6.1.0-28-cloud-amd64", "cmdline": boot.cmdline,
            "versions": { "nvidia-driver": "535.104.05" },
            "gpus": gpu_uuids(7) })
    };
    // Flag only (the default): drifted, with the differences named; nothing to do.
    let (status, answer) = training.heartbeat(&t1, Some(drifted(&t1))).await;
    assert_eq!(status, 200);
    assert_eq!(answer["action"], "none");
    let fields: Vec<&str> = answer["drift"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, ["versions.nvidia-driver", "gpus"]);
    let node = training.node().await;
    assert_eq!(node["state"], "drifted");
    let reason = node["state_reason"].as_str().unwrap();
    assert!(
        reason.contains("versions.nvidia-driver: was 550.127.05, now 535.104.05")
            && reason.contains(&format!("gpus: was {}, now (absent)", gpu_uuids(8)[7])),
        "{reason}"
    );

    // pool=batch reimages: drifted, then reimaging; the answer is "reboot".
    let (_, answer) = batch.heartbeat(&b1, Some(drifted(&b1))).await;
    assert_eq!(answer["action"], "reboot", "{answer}");
    assert_eq!(batch.state().await, "reimaging");
    // It reboots, boots the newly tagged image, and is ready again.
    let b2 = batch.boot_to_ready(&v2).await;
    let node = batch.node().await;
    assert_eq!(node["boots"][0]["id"], b2.id.as_str());
    assert_eq!(node["boots"][0]["image"], v2["digest"]);
    let tos = strings(&node["history"], "to");
    assert_eq!(
        tos,
        [
            "discovered",
            "provisioning",
            "booted",
            "validating",
            "ready",
            "drifted",
            "reimaging",
            "provisioning",
            "booted",
            "validating",
            "ready"
        ]
    );
    // The first boot's token died with it.
    assert_eq!(batch.heartbeat(&b1, None).await.0, 403);
    server.stop().await;
}

#[tokio::test]
async fn attestation_compares_what_this_boot_actually_fetched() {
    let server = TestServer::start().await;
    let image = publish_tagged(&server, "1", 4).await;
    let node = FakeNode::new(&server, "52-54-00-10-00-04");
    server.assign(&node.mac, "demo:stable").await;
    let boot = node.boot().await;
    // The kernel only in part (a broken download), the initrd not at all; a made-up boot
    // id is served but recorded nowhere.
    let r = server
        .http
        .get(&boot.urls[0])
        .header("range", "bytes=0-99")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    r.bytes().await.unwrap();
    let bogus = boot.urls[1].replace(&boot.id, "0000000000000000");
    assert_eq!(reqwest::get(&bogus).await.unwrap().status(), 200);
    let artifacts = [
        bootfleet::api::Digest::of(&noise(30_000, 4)),
        bootfleet::api::Digest::of(b"initrd bytes"),
    ];
    let (status, verdict) = node
        .attest(&boot, node.report(&boot, &image, &artifacts))
        .await;
    assert_eq!(status, 200);
    let found: Vec<(&str, &str)> = verdict["mismatches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["field"].as_str().unwrap(), m["found"].as_str().unwrap()))
        .collect();
    assert_eq!(
        found,
        [
            ("fetched.vmlinuz", "100 of 30000 bytes fetched by this boot"),
            ("fetched.initrd.img", "never fetched by this boot")
        ]
    );
    let detail = node.node().await;
    assert_eq!(detail["state"], "attestation-failed");
    assert_eq!(detail["boots"][0]["stopped_at"], "kernel");
    // Attested, but failed: its validation is refused.
    let (status, answer) = node.validate(&boot, healthy()).await;
    assert_eq!(status, 409, "{answer}");
    assert!(
        answer.to_string().contains("has not passed attestation"),
        "{answer}"
    );
    server.stop().await;
}

/// Heartbeats that change nothing write nothing: what was heard is stored in one write
/// per flush (a sixth of the timeout), and a node that keeps beating stays ready past
/// its timeout many times over.
#[tokio::test]
async fn a_beating_node_stays_ready_and_its_heartbeats_are_stored_in_batches() {
    let server = TestServer::start_configured(|cfg| {
        cfg.lifecycle.heartbeat_timeout_secs = 2;
    })
    .await;
    let image = publish_tagged(&server, "1", 6).await;
    let node = FakeNode::new(&server, "52-54-00-10-00-06");
    server.assign(&node.mac, "demo:stable").await;
    let boot = node.boot_to_ready(&image).await;
    let before = server.metric("bootfleet_store_writes_total").await;
    // 40 heartbeats over 4 s: twice the timeout, eight flushes (one every 333 ms).
    for _ in 0..40 {
        let (status, answer) = node.heartbeat(&boot, None).await;
        assert_eq!((status, answer["action"].as_str()), (200, Some("none")));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(node.state().await, "ready");
    let writes = server.metric("bootfleet_store_writes_total").await - before;
    // Two writes a heartbeat before (its time, and the revalidation flag).
    assert!(writes <= 16, "{writes} writes for 40 heartbeats");
    server.stop().await;
}

#[tokio::test]
async fn a_silent_node_becomes_unreachable_and_is_revalidated_when_back() {
    let server = TestServer::start_configured(|cfg| {
        cfg.lifecycle.heartbeat_timeout_secs = 1;
    })
    .await;
    let image = publish_tagged(&server, "1", 5).await;
    let node = FakeNode::new(&server, "52-54-00-10-00-05");
    server.assign(&node.mac, "demo:stable").await;
    let boot = node.boot_to_ready(&image).await;
    let mut waited = 0;
    while node.state().await != "unreachable" {
        waited += 1;
        assert!(waited < 100, "still {} after 10 s", node.state().await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reason = node.node().await["state_reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        reason.contains("silent for") && reason.contains("while ready"),
        "{reason}"
    );

    // It speaks again: revalidate before ready.
    let (_, answer) = node.heartbeat(&boot, None).await;
    assert_eq!(answer["action"], "revalidate");
    assert_eq!(node.state().await, "validating");
    let (_, verdict) = node.validate(&boot, healthy()).await;
    assert_eq!(verdict["passed"], true);
    assert_eq!(node.state().await, "ready");

    // An admin asks for revalidation: the next heartbeat (only) says so.
    let r = server
        .post(&format!("/api/v1/nodes/{}/revalidate", node.mac))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(node.heartbeat(&boot, None).await.1["action"], "revalidate");
    assert_eq!(node.heartbeat(&boot, None).await.1["action"], "none");
    let r = server
        .post("/api/v1/nodes/52-54-00-99-99-99/revalidate")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    server.stop().await;
}

#[tokio::test]
async fn failed_validation_reimages_then_quarantines_and_is_never_ready() {
    let server = TestServer::start_configured(|cfg| cfg.lifecycle.validation_reimages = 1).await;
    let image = publish_tagged(&server, "1", 6).await;
    let node = FakeNode::new(&server, "52-54-00-10-00-06");
    server.assign(&node.mac, "demo:stable").await;
    let boot = node.boot().await;
    // Validation before attestation is refused.
    let (status, _) = node.validate(&boot, healthy()).await;
    assert_eq!(status, 409);
    let artifacts = node.fetch_all(&boot).await;
    node.attest(&boot, node.report(&boot, &image, &artifacts))
        .await;
    // A GPU image on a machine without GPUs.
    let no_gpu = json!({ "nvml_error": "NVML unavailable: libnvidia-ml.so.1: cannot open shared object file", "gpus": [] });
    let (status, verdict) = node.validate(&boot, no_gpu).await;
    assert_eq!(status, 200);
    assert_eq!(verdict["passed"], false);
    let detail = node.node().await;
    assert_eq!(detail["boots"][0]["stopped_at"], "validated");
    let reason = validation_failure(&detail);
    assert!(reason.contains("expected 8 GPUs, found 0"), "{reason}");
    // The failure policy: reimage (attempt 1 of 1), and the heartbeat says reboot.
    assert_eq!(detail["state"], "reimaging");
    assert!(
        detail["state_reason"]
            .as_str()
            .unwrap()
            .contains("attempt 1 of 1")
    );
    assert_eq!(node.heartbeat(&boot, None).await.1["action"], "reboot");

    // Second boot: one GPU answers NVML with "Unknown Error": quarantined.
    let boot = node.boot().await;
    let artifacts = node.fetch_all(&boot).await;
    node.attest(&boot, node.report(&boot, &image, &artifacts))
        .await;
    let mut eight = healthy();
    eight["gpus"][3]["error"] = json!("Unknown Error");
    let (_, verdict) = node.validate(&boot, eight).await;
    assert_eq!(verdict["failures"][0]["gpu"], 3, "{verdict}");
    let detail = node.node().await;
    assert_eq!(detail["state"], "quarantined");
    assert!(
        detail["state_reason"]
            .as_str()
            .unwrap()
            .contains("GPU 3: NVML: Unknown Error"),
        "{detail}"
    );
    // A quarantined node is held: its next script boots nothing.
    assert!(node.script().await.contains("quarantined"));
    server.stop().await;
}

/// Recorded readings of an 8-GPU HGX H100 node with one fault each drive the real
/// judgement through the API; each ends in the right state with the right named reason,
/// and none ends ready.
#[tokio::test]
async fn every_gpu_fault_fixture_is_named_and_none_is_ready() {
    let server = TestServer::start_configured(|cfg| cfg.lifecycle.validation_reimages = 0).await;
    // [validation] is the manifest's last table: these keys extend it.
    let manifest_extra = "pcie-gen = 5\npcie-width = 16\nnvlinks = 18\ndcgm-level = 2\n";
    let mut entries = good_entries("hgx", "1", b"k");
    let text = String::from_utf8(entries[0].data.clone()).unwrap() + manifest_extra;
    entries[0].data = text.into_bytes();
    let (status, image) = server
        .publish_query(tar_of(&entries), "?tag=hgx:stable")
        .await;
    assert_eq!(status, 201, "{image}");
    type Fault = (&'static str, fn(&mut Value), &'static str);
    let faults: [Fault; 10] = [
        ("healthy", |_| {}, ""),
        (
            "one GPU missing",
            |r| {
                r["gpus"].as_array_mut().unwrap().pop();
            },
            "expected 8 GPUs, found 7",
        ),
        (
            "uncorrected ECC",
            |r| r["gpus"][2]["ecc"]["volatile_uncorrected"] = json!(4),
            "GPU 2: 4 uncorrected ECC errors",
        ),
        (
            "row remap pending",
            |r| r["gpus"][5]["row_remap"]["pending"] = json!(true),
            "GPU 5: row remapping pending",
        ),
        (
            "PCIe downtrained to x8",
            |r| r["gpus"][1]["pcie"]["width_current"] = json!(8),
            "GPU 1: PCIe x8 (max x16), expected at least x16",
        ),
        (
            "an NVLink down",
            |r| r["gpus"][6]["nvlinks"][11]["active"] = json!(false),
            "GPU 6: NVLink 11 down",
        ),
        (
            "XID 79",
            |r| r["xids"] = json!([{ "code": 79, "pci_bus_id": "0000:9a:00", "line": "NVRM: Xid (PCI:0000:9a:00): 79, pid=1234, GPU has fallen off the bus." }]),
            "XID 79 on 0000:9a:00",
        ),
        (
            "NVML Unknown Error",
            |r| r["gpus"][7]["error"] = json!("Unknown Error"),
            "GPU 7: NVML: Unknown Error",
        ),
        (
            "driver not the pinned one",
            |r| r["driver_version"] = json!("535.104.05"),
            "driver 535.104.05 is loaded, the image pins 550.127.05",
        ),
        (
            "DCGM diag failing one test",
            |r| {
                r["dcgm"][2] =
                    json!({ "name": "memory", "passed": false, "detail": "DBE detected on GPU 3" })
            },
            "DCGM memory failed: DBE detected on GPU 3",
        ),
    ];
    for (i, (name, fault, reason)) in faults.iter().enumerate() {
        let node = FakeNode::new(&server, &format!("52-54-00-20-00-{i:02x}"));
        server.assign(&node.mac, "hgx:stable").await;
        let boot = node.boot().await;
        let artifacts = node.fetch_all(&boot).await;
        let (status, v) = node
            .attest(&boot, node.report(&boot, &image, &artifacts))
            .await;
        assert_eq!((status, &v["passed"]), (200, &json!(true)), "{name}: {v}");
        let mut report = healthy();
        fault(&mut report);
        let (status, verdict) = node.validate(&boot, report).await;
        assert_eq!(status, 200, "{name}: {verdict}");
        let detail = node.node().await;
        if reason.is_empty() {
            assert_eq!(detail["state"], "ready", "{name}: {verdict}");
            continue;
        }
        assert_eq!(verdict["passed"], false, "{name}");
        assert_eq!(detail["state"], "quarantined", "{name}");
        let got = validation_failure(&detail);
        assert!(got.contains(reason), "{name}: {got}");
        assert_eq!(
            verdict["failures"].as_array().unwrap().len(),
            1,
            "{name}: exactly one failure: {verdict}"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn refused_reports_and_reimages_are_events() {
    use bootfleet::node::reimage::DisruptionBudget;
    let server = TestServer::start_configured(|cfg| {
        cfg.budget = DisruptionBudget {
            max_total: 1,
            group_label: None,
            max_per_group: 1,
            ..Default::default()
        };
    })
    .await;
    publish_tagged(&server, "1", 7).await;
    let a = FakeNode::new(&server, "52-54-00-10-00-07");
    let b = FakeNode::new(&server, "52-54-00-10-00-08");
    for n in [&a, &b] {
        server.assign(&n.mac, "demo:stable").await;
    }
    let boot_a = a.boot().await;
    let mut forged = boot_a.clone();
    forged.token = "f".repeat(64);
    assert_eq!(a.heartbeat(&forged, None).await.0, 403);
    // b claims a's boot.
    assert_eq!(b.heartbeat(&boot_a, None).await.0, 403);
    for n in [&a, &b] {
        let r = server
            .post(&format!("/api/v1/nodes/{}/reimage", n.mac))
            .json(&json!({ "reason": "test" }))
            .send()
            .await
            .unwrap();
        assert!(r.status() == 202 || r.status() == 429);
    }
    let all = events(&server, "?since=0").await;
    let refused: Vec<(String, String)> = all
        .iter()
        .filter(|e| {
            !["node.state", "node.assigned", "image.published"]
                .contains(&e["kind"].as_str().unwrap())
        })
        .map(|e| {
            (
                e["kind"].as_str().unwrap().to_string(),
                e["node"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        refused,
        // The forged token is not an event (anyone can send one); b's claim, made with
        // a real token, is.
        [
            ("report.refused".to_string(), b.colons()),
            ("reimage.refused".to_string(), b.colons()),
        ]
    );
    let claimed = all
        .iter()
        .find(|e| e["kind"] == "report.refused" && e["node"] == b.colons().as_str())
        .unwrap();
    assert!(
        claimed["data"]["reason"]
            .as_str()
            .unwrap()
            .contains("belongs to 52:54:00:10:00:07"),
        "{claimed}"
    );
    server.stop().await;
}

/// (signature header, body) of one webhook request.
type Delivery = (String, Vec<u8>);

#[derive(Clone, Default)]
struct Receiver {
    /// Every request, failed or not.
    got: Arc<Mutex<Vec<Delivery>>>,
    fail_first: Arc<Mutex<usize>>,
}

async fn receive(
    axum::extract::State(rx): axum::extract::State<Receiver>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::http::StatusCode {
    let signature = headers
        .get(bootfleet::events::webhook::SIGNATURE_HEADER)
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    rx.got.lock().unwrap().push((signature, body.to_vec()));
    let mut fail = rx.fail_first.lock().unwrap();
    if *fail > 0 {
        *fail -= 1;
        return axum::http::StatusCode::SERVICE_UNAVAILABLE;
    }
    axum::http::StatusCode::NO_CONTENT
}

#[tokio::test]
async fn webhooks_get_every_event_in_order_signed_and_retried() {
    let receiver = Receiver {
        fail_first: Arc::new(Mutex::new(2)),
        ..Default::default()
    };
    let app = axum::Router::new()
        .route("/hook", axum::routing::post(receive))
        .with_state(receiver.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let secrets = tempfile::tempdir().unwrap();
    let secret_file = secrets.path().join("hook.secret");
    std::fs::write(&secret_file, "s3cret-s3cret-s3cret\n").unwrap();
    let server = TestServer::start_configured(|cfg| {
        cfg.webhooks = vec![bootfleet::events::webhook::WebhookConfig {
            url: hook_url.clone(),
            secret_file: secret_file.clone(),
            ca_file: None,
        }];
    })
    .await;
    let image = publish_tagged(&server, "1", 8).await;
    let node = FakeNode::new(&server, "52-54-00-10-00-09");
    server.assign(&node.mac, "demo:stable").await;
    node.boot_to_ready(&image).await;

    let delivered = || -> Vec<Value> {
        let got = receiver.got.lock().unwrap();
        let mut seen = Vec::<Value>::new();
        // Skip the failed attempts: the receiver answered 503 to the first two.
        for (signature, body) in got.iter().skip(2) {
            assert!(
                bootfleet::events::webhook::verify(b"s3cret-s3cret-s3cret", signature, body)
                    .is_some(),
                "bad signature {signature}"
            );
            let batch: Value = serde_json::from_slice(body).unwrap();
            for e in batch["events"].as_array().unwrap() {
                if !seen.iter().any(|s| s["seq"] == e["seq"]) {
                    seen.push(e.clone());
                }
            }
        }
        seen
    };
    let mut waited = 0;
    while !transitions(&delivered()).contains(&"ready".to_string()) {
        waited += 1;
        assert!(waited < 300, "not delivered in 30 s: {:?}", delivered());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seen = delivered();
    assert_eq!(
        transitions(&seen),
        [
            "discovered",
            "provisioning",
            "booted",
            "validating",
            "ready"
        ],
        "in order, none lost"
    );
    let seqs: Vec<i64> = seen.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    // The failed attempts are retried from the same first event (the batch may have grown
    // meanwhile).
    let got = receiver.got.lock().unwrap().clone();
    let first_seq =
        |body: &[u8]| serde_json::from_slice::<Value>(body).unwrap()["events"][0]["seq"].clone();
    assert_eq!(first_seq(&got[0].1), first_seq(&got[1].1));
    assert_eq!(first_seq(&got[0].1), first_seq(&got[2].1));
    server.stop().await;
}
