//! Fleet health over time, through the HTTP API as agents report it: 100 fake nodes boot
//! to ready and heartbeat with telemetry replayed from a fixture
//! (`tests/fixtures/gpu/hgx-h100-telemetry.synthesised.json`), a few of them going wrong
//! in one way each. Each rule's verdict lands on its node alone, with the readings that
//! tripped it, and its action is carried out; no healthy node is judged. Windows are
//! seconds here (minutes and hours in a fleet): the rules are the same.

use std::time::{Duration, Instant};

use bootfleet::health::{Action, Condition, HealthSettings, Rule};
use futures_util::future::join_all;
use serde_json::{Value, json};

use crate::fake_node::{Boot, FakeNode, healthy};
use crate::harness::{TestServer, good_bundle, noise};

pub(crate) fn telemetry() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/gpu/hgx-h100-telemetry.synthesised.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn rules() -> HealthSettings {
    HealthSettings {
        rules: vec![
            Rule::new(
                "fatal-xid",
                Condition::Xid { codes: vec![79] },
                Action::Quarantine,
            ),
            Rule::new(
                "ecc-rising",
                // More than 100 corrected errors in 10 s.
                Condition::EccCorrectedRate {
                    per_hour: 36_000.0,
                    over_secs: 10,
                },
                Action::Revalidate,
            ),
            Rule::new(
                "ib-flapping",
                Condition::IbLinkDown {
                    count: 5,
                    over_secs: 3600,
                },
                Action::Reimage,
            ),
            Rule::new(
                "hot",
                Condition::Throttled {
                    for_secs: 2,
                    reasons: vec!["HW_THERMAL_SLOWDOWN".into()],
                },
                Action::Flag,
            ),
            Rule::new(
                "blind",
                Condition::ReadingMissing { for_secs: 2 },
                Action::Flag,
            ),
        ],
        keep_readings: 4,
        grey: Default::default(),
    }
}

/// What each sick node does wrong, in round `round` of heartbeats.
#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) enum Sick {
    Hot,
    EccRising,
    Flapping,
    Xid79,
    Blind,
}

const SICK: [Sick; 5] = [
    Sick::Hot,
    Sick::EccRising,
    Sick::Flapping,
    Sick::Xid79,
    Sick::Blind,
];

pub(crate) fn heartbeat_body(boot: &Boot, mac: &str, sick: Option<Sick>, round: u64) -> Value {
    let mut t = telemetry();
    let g = &mut t["gpus"][2];
    match sick {
        Some(Sick::Hot) => {
            g["throttle_reasons"] = json!(["HW_THERMAL_SLOWDOWN"]);
            g["temperature_c"] = json!(91);
            g["sm_clock_mhz"] = json!(1110);
        }
        Some(Sick::EccRising) => {
            g["ecc"]["volatile_corrected"] = json!(60 * round);
        }
        Some(Sick::Flapping) => t["ib_ports"][5]["link_downed"] = json!(round),
        Some(Sick::Xid79) if round >= 2 => {
            g["xids"] = json!(1);
            g["recent_xids"] = json!([79]);
        }
        Some(Sick::Blind) => {
            g["ecc"] = Value::Null;
            g["missing"] = json!(["ecc"]);
        }
        _ => {}
    }
    json!({ "boot_id": boot.id, "mac": mac.replace('-', ":"),
        "gpus": t["gpus"], "ib_ports": t["ib_ports"] })
}

/// A published, tagged image and 100 discovered nodes assigned to it (MACs
/// 52-54-00-OCTET-00-xx).
async fn fleet(server: &TestServer, octet: &str) -> (Value, Vec<String>) {
    fleet_of(server, octet, 100).await
}

/// As `fleet`, of `n` nodes.
async fn fleet_of(server: &TestServer, octet: &str, n: u32) -> (Value, Vec<String>) {
    let (status, image) = server
        .publish_query(
            good_bundle("demo", "1", &noise(20_000, 7)),
            "?tag=demo:stable",
        )
        .await;
    assert_eq!(status, 201, "{image}");
    let macs: Vec<String> = (0..n)
        .map(|i| format!("52-54-00-{octet}-00-{i:02x}"))
        .collect();
    for mac in &macs {
        FakeNode::new(server, mac).script().await;
        server.assign(mac, "demo:stable").await;
    }
    (image, macs)
}

async fn verdicts_of(server: &TestServer, mac: &str) -> Vec<Value> {
    let (status, page) = server
        .json(&format!("/api/v1/events?since=0&limit=1000&node={mac}"))
        .await;
    assert_eq!(status, 200, "{page}");
    page["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "health.verdict" || e["kind"] == "health.ticket")
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_rules_judge_a_fleet_over_time_and_act_on_the_sick_alone() {
    let server = TestServer::start_configured(|cfg| {
        cfg.health = rules();
        // The IB node's reimage must fit the disruption budget.
        cfg.budget.max_total = 10;
    })
    .await;
    let (image, macs) = fleet(&server, "22").await;
    let nodes: Vec<FakeNode> = macs.iter().map(|m| FakeNode::new(&server, m)).collect();
    let mut boots = Vec::new();
    for chunk in nodes.chunks(20) {
        boots.extend(join_all(chunk.iter().map(|n| n.boot_to_ready(&image))).await);
    }
    let sick_of = |i: usize| SICK.get(i).copied();

    let server_ref = &server;
    let start = Instant::now();
    let mut answers: Vec<Vec<Value>> = vec![Vec::new(); nodes.len()];
    let mut hot_first_at = None;
    for round in 0..8u64 {
        let sent = join_all(nodes.iter().zip(&boots).enumerate().map(|(i, (n, b))| {
            let body = heartbeat_body(b, &n.mac, sick_of(i), round);
            async move {
                let r = server_ref
                    .http
                    .post(server_ref.url("/api/v1/agent/heartbeat"))
                    .bearer_auth(&b.token)
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                (r.status().as_u16(), r.json::<Value>().await.unwrap())
            }
        }))
        .await;
        for (i, (status, answer)) in sent.into_iter().enumerate() {
            assert_eq!(status, 200, "node {i} round {round}: {answer}");
            answers[i].push(answer);
        }
        // Thermal throttling: flagged once it lasted 2 s, not before.
        let hot = verdicts_of(&server, &macs[0]).await;
        if hot_first_at.is_none() && !hot.is_empty() {
            hot_first_at = Some(start.elapsed());
        }
        if start.elapsed() < Duration::from_millis(1900) {
            assert!(hot.is_empty(), "flagged before its window: {hot:?}");
        }
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    let hot_at = hot_first_at.expect("the throttling GPU was never flagged");
    assert!(hot_at >= Duration::from_secs(2), "flagged after {hot_at:?}");
    let hot = verdicts_of(&server, &macs[0]).await;
    assert_eq!(hot.len(), 1, "given once while it holds: {hot:?}");
    let v = &hot[0]["data"];
    assert_eq!(
        (v["rule"].as_str(), v["action"].as_str()),
        (Some("hot"), Some("flag"))
    );
    assert!(v["subject"].as_str().unwrap().starts_with("gpu 2 "), "{v}");
    assert_eq!(v["readings"]["temperature_c"], 91);
    assert_eq!(nodes[0].state().await, "ready", "a flag changes nothing");

    // Corrected ECC climbing: revalidated before it fails; a passing validation brings
    // the node back.
    let ecc = verdicts_of(&server, &macs[1]).await;
    assert_eq!(ecc[0]["data"]["rule"], "ecc-rising", "{ecc:?}");
    assert!(
        ecc[0]["data"]["readings"]["corrected_rise"]
            .as_u64()
            .unwrap()
            > 100
    );
    assert!(
        answers[1].iter().any(|a| a["action"] == "revalidate"),
        "{:?}",
        answers[1]
    );
    assert_eq!(nodes[1].state().await, "validating");
    let (status, verdict) = nodes[1].validate(&boots[1], healthy()).await;
    assert_eq!((status, &verdict["passed"]), (200, &json!(true)));

    // A port flapping five times: the configured action, a reimage (the next heartbeat
    // answers reboot).
    let flap = verdicts_of(&server, &macs[2]).await;
    assert_eq!(flap[0]["data"]["subject"], "port mlx5_5/1", "{flap:?}");
    assert_eq!(flap[0]["data"]["readings"]["link_downs"], 5);
    assert!(
        answers[2].iter().any(|a| a["action"] == "reboot"),
        "{:?}",
        answers[2]
    );
    assert_eq!(nodes[2].state().await, "reimaging");

    // XID 79: quarantined, with a ticket that carries the evidence.
    let xid = verdicts_of(&server, &macs[3]).await;
    let ticket = xid
        .iter()
        .find(|e| e["kind"] == "health.ticket")
        .unwrap_or_else(|| panic!("no ticket: {xid:?}"));
    assert_eq!(ticket["data"]["readings"]["xid"], 79);
    assert_eq!(ticket["data"]["rule"], "fatal-xid");
    assert!(
        ticket["data"]["subject"].as_str().unwrap().contains("GPU-"),
        "{ticket}"
    );
    assert_eq!(nodes[3].state().await, "quarantined");

    // A reading missing is never healthy: flagged, and shown as holding.
    let blind = verdicts_of(&server, &macs[4]).await;
    assert_eq!(blind[0]["data"]["readings"]["reading"], "ecc", "{blind:?}");
    let (status, health) = server
        .json(&format!("/api/v1/nodes/{}/health", macs[4]))
        .await;
    assert_eq!(status, 200, "{health}");
    assert_eq!(health["verdicts"][0]["rule"], "blind", "{health}");
    assert_eq!(
        health["readings"].as_array().unwrap().len(),
        4,
        "keep_readings"
    );
    assert_eq!(
        health["readings"][3]["gpus"][2]["ecc_corrected"],
        Value::Null
    );
    // And in the node's detail.
    assert_eq!(
        nodes[4].node().await["health"]["verdicts"][0]["rule"],
        "blind"
    );

    // Counted in /metrics; the readings exported in /metrics/gpus.
    let metrics = server.text("/metrics").await;
    for line in [
        r#"bootfleet_health_verdicts_total{rule="hot",action="flag"} 1"#,
        r#"bootfleet_health_verdicts_total{rule="fatal-xid",action="quarantine"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} not in /metrics");
    }
    let gpus = server.text("/metrics/gpus").await;
    let hot_clock = format!(
        r#"bootfleet_gpu_sm_clock_mhz{{node="{}",gpu="2"}} 1110"#,
        macs[0].replace('-', ":")
    );
    assert!(
        gpus.contains(&hot_clock),
        "{hot_clock} not in /metrics/gpus"
    );

    // No healthy node was judged, and each one's answers were all "none".
    for i in SICK.len()..nodes.len() {
        assert!(
            verdicts_of(&server, &macs[i]).await.is_empty(),
            "node {i} judged"
        );
        assert!(
            answers[i].iter().all(|a| a["action"] == "none"),
            "node {i}: {:?}",
            answers[i]
        );
    }
    drop(nodes);
    server.stop().await;
}

/// Grey failures: 100 nodes validate with a GEMM figure (within 2% of 700 TFLOPS), three
/// at 55-70% of it pass every check yet are found slow, with their figures, by the
/// time the fleet has reported; no healthy node is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_nodes_that_pass_every_check_are_found_against_their_peers() {
    let server = TestServer::start().await;
    let (image, macs) = fleet(&server, "23").await;
    let nodes: Vec<FakeNode> = macs.iter().map(|m| FakeNode::new(&server, m)).collect();
    let slow = [(7usize, 0.55), (42, 0.62), (88, 0.70)];
    let gemm = |i: usize| match slow.iter().find(|(s, _)| *s == i) {
        Some((_, share)) => 700.0 * share,
        None => 700.0 + ((i * 37) % 29) as f64 / 2.0 - 7.0,
    };
    let (image, nodes_ref) = (&image, &nodes);
    for chunk in (0..nodes.len()).collect::<Vec<_>>().chunks(20) {
        join_all(chunk.iter().map(|&i| async move {
            let n = &nodes_ref[i];
            let boot = n.boot().await;
            let artifacts = n.fetch_all(&boot).await;
            let (status, _) = n.attest(&boot, n.report(&boot, image, &artifacts)).await;
            assert_eq!(status, 200);
            let mut report = healthy();
            report["figures"] = json!([{ "name": "gemm_tflops", "value": gemm(i) }]);
            let (status, verdict) = n.validate(&boot, report).await;
            assert_eq!(
                (status, &verdict["passed"]),
                (200, &json!(true)),
                "{verdict}"
            );
        }))
        .await;
    }
    for (i, mac) in macs.iter().enumerate() {
        let found = verdicts_of(&server, mac).await;
        match slow.iter().find(|(s, _)| *s == i) {
            Some((_, share)) => {
                assert_eq!(found.len(), 1, "node {i}: {found:?}");
                let v = &found[0]["data"];
                assert_eq!(v["rule"], "grey-failure");
                assert_eq!(v["readings"]["figure"], "gemm_tflops");
                assert_eq!(v["readings"]["value"], json!(700.0 * share));
                let median = v["readings"]["median"].as_f64().unwrap();
                assert!((690.0..710.0).contains(&median), "{v}");
                // Flagged, not failed: it passed every check.
                assert_eq!(nodes[i].state().await, "ready");
                let (_, health) = server.json(&format!("/api/v1/nodes/{mac}/health")).await;
                assert_eq!(health["verdicts"][0]["rule"], "grey-failure", "{health}");
            }
            None => assert!(found.is_empty(), "healthy node {i} judged: {found:?}"),
        }
    }
    drop(nodes);
    server.stop().await;
}

/// Boots `n` to validation with a GEMM figure of `gemm`; asserts the checks passed.
async fn validate_with_gemm(n: &FakeNode<'_>, image: &Value, gemm: f64) -> Boot {
    let boot = n.boot().await;
    let artifacts = n.fetch_all(&boot).await;
    let (status, _) = n.attest(&boot, n.report(&boot, image, &artifacts)).await;
    assert_eq!(status, 200);
    let mut report = healthy();
    report["figures"] = json!([{ "name": "gemm_tflops", "value": gemm }]);
    let (status, verdict) = n.validate(&boot, report).await;
    assert_eq!(
        (status, &verdict["passed"]),
        (200, &json!(true)),
        "{verdict}"
    );
    boot
}

/// With `[health.grey] action = "degrade"`, a slow node is not left `ready`: it becomes
/// `degraded` (running, counted apart, its heartbeats answered "none") and stays so until
/// a revalidation its peers accept; a drift is still seen on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_node_is_degraded_until_it_revalidates_at_its_peers_speed() {
    let server = TestServer::start_configured(|cfg| {
        cfg.health.grey.action = Action::Degrade;
        cfg.health.rules = vec![Rule::new(
            "hot",
            Condition::Throttled {
                for_secs: 1,
                reasons: vec!["HW_THERMAL_SLOWDOWN".into()],
            },
            Action::Degrade,
        )];
    })
    .await;
    let (image, macs) = fleet_of(&server, "25", 12).await;
    let nodes: Vec<FakeNode> = macs.iter().map(|m| FakeNode::new(&server, m)).collect();
    let (slow, drifting) = (3usize, 5usize);
    let gemm = |i: usize| 700.0 + (i % 5) as f64;
    let mut boots = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        let figure = if i == slow { 420.0 } else { gemm(i) };
        boots.push(validate_with_gemm(n, &image, figure).await);
    }
    // Judged once the group reached ten; degraded, not failed, and said why.
    let node = nodes[slow].node().await;
    assert_eq!(node["state"], "degraded", "{node}");
    let reason = node["state_reason"].as_str().unwrap();
    assert!(reason.contains("grey-failure"), "{reason}");
    for (i, n) in nodes.iter().enumerate() {
        if i != slow {
            assert_eq!(n.state().await, "ready", "node {i}");
        }
    }
    let (_, fleet) = server.json("/api/v1/fleet").await;
    let count = |state: &str| {
        fleet["by_state"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == state)
            .map(|c| c["count"].clone())
    };
    assert_eq!(count("degraded"), Some(json!(1)), "{fleet}");
    assert_eq!(count("ready"), Some(json!(11)), "{fleet}");
    assert!(
        fleet["not_ready"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["state"] == "degraded"),
        "{fleet}"
    );
    let (status, listed) = server.json("/api/v1/nodes?state=degraded").await;
    assert_eq!(status, 200, "{listed}");
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");

    // It keeps running: its heartbeats are answered "none".
    let (status, answer) = nodes[slow].heartbeat(&boots[slow], None).await;
    assert_eq!(
        (status, &answer["action"]),
        (200, &json!("none")),
        "{answer}"
    );

    // An admin asks for a revalidation; its figure is its peers' now: ready again.
    server
        .post_json(&format!("/api/v1/nodes/{}/revalidate", macs[slow]))
        .await;
    let (_, answer) = nodes[slow].heartbeat(&boots[slow], None).await;
    assert_eq!(answer["action"], "revalidate", "{answer}");
    let mut report = healthy();
    report["figures"] = json!([{ "name": "gemm_tflops", "value": 701.0 }]);
    let (status, verdict) = nodes[slow].validate(&boots[slow], report).await;
    assert_eq!(
        (status, &verdict["passed"]),
        (200, &json!(true)),
        "{verdict}"
    );
    assert_eq!(nodes[slow].state().await, "ready");

    // Slow again on a later validation: degraded again; then a drift is still seen.
    let n = &nodes[drifting];
    let mut report = healthy();
    report["figures"] = json!([{ "name": "gemm_tflops", "value": 400.0 }]);
    server
        .post_json(&format!("/api/v1/nodes/{}/revalidate", macs[drifting]))
        .await;
    let (_, answer) = n.heartbeat(&boots[drifting], None).await;
    assert_eq!(answer["action"], "revalidate", "{answer}");
    let (status, verdict) = n.validate(&boots[drifting], report).await;
    assert_eq!(
        (status, &verdict["passed"]),
        (200, &json!(true)),
        "{verdict}"
    );
    assert_eq!(n.state().await, "degraded");
    // A GPU gone from what it attested.
    let facts = json!({ "kernel_release": "6.1.0-28-cloud-amd64", "cmdline": boots[drifting].cmdline,
        "gpus": crate::fake_node::gpu_uuids(7) });
    let (status, answer) = n.heartbeat(&boots[drifting], Some(facts)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(n.state().await, "drifted", "{answer}");

    // A heartbeat rule's degrade outlives a passed revalidation while it still holds.
    let (i, hot, boots, macs) = (8usize, &nodes[8], &boots, &macs);
    let beat = |round: u64| async move {
        let body = heartbeat_body(&boots[i], &macs[i], Some(Sick::Hot), round);
        let (status, answer) = hot
            .agent_post("/api/v1/agent/heartbeat", &boots[i].token, body)
            .await;
        assert_eq!(status, 200, "{answer}");
        answer["action"].as_str().unwrap().to_string()
    };
    beat(1).await;
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    beat(2).await;
    assert_eq!(hot.state().await, "degraded");
    server
        .post_json(&format!("/api/v1/nodes/{}/revalidate", macs[i]))
        .await;
    assert_eq!(beat(3).await, "revalidate");
    let mut report = healthy();
    report["figures"] = json!([{ "name": "gemm_tflops", "value": 702.0 }]);
    let (status, verdict) = hot.validate(&boots[i], report).await;
    assert_eq!(
        (status, &verdict["passed"]),
        (200, &json!(true)),
        "{verdict}"
    );
    let node = hot.node().await;
    assert_eq!(node["state"], "degraded", "{node}");
    assert!(
        node["state_reason"]
            .as_str()
            .unwrap()
            .contains("still holds"),
        "{node}"
    );
    drop(nodes);
    server.stop().await;
}

/// Revalidations behind a drain take turns: with `[drain] revalidations_at_once = 1`,
/// three nodes whose corrected ECC climbs are drained one at a time (an operator's hook
/// scheduler that logs what it is asked), each validated and handed back before the next
/// is drained; no node is told to validate before its drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revalidation_drains_take_turns_within_their_budget() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let hook = dir.path().join("hook");
    std::fs::write(
        &hook,
        format!(
            "#!/bin/sh\nd={d}\nm=$(echo \"$BOOTFLEET_NODE_MAC\" | tr : -)\n\
             case \"$1\" in\n\
             drain) echo \"drain $m\" >> {log}; touch \"$d/$m\" ;;\n\
             status) if [ -e \"$d/$m\" ]; then echo drained; else echo not-draining; fi ;;\n\
             resume) echo \"resume $m\" >> {log}; rm -f \"$d/$m\" ;;\n\
             esac\n",
            d = dir.path().display(),
            log = log.display(),
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    let server = TestServer::start_configured(|cfg| {
        cfg.rollouts.tick_ms = 100;
        cfg.drain.revalidations_at_once = 1;
        cfg.drain.hook = Some(bootfleet::rollout::drain::hook::HookSettings {
            command: hook.clone(),
            timeout_secs: 10,
        });
        cfg.health.rules = vec![Rule::new(
            "ecc-rising",
            Condition::EccCorrectedRate {
                per_hour: 36_000.0,
                over_secs: 10,
            },
            Action::Revalidate,
        )];
    })
    .await;
    let (image, macs) = fleet_of(&server, "26", 3).await;
    let nodes: Vec<FakeNode> = macs.iter().map(|m| FakeNode::new(&server, m)).collect();
    let mut boots = Vec::new();
    for (n, mac) in nodes.iter().zip(&macs) {
        server.label(mac, "scheduler", "hook").await;
        boots.push(n.boot_to_ready(&image).await);
    }
    let beat = |i: usize, sick: Option<Sick>, round: u64| {
        let (n, boot, mac) = (&nodes[i], &boots[i], &macs[i]);
        async move {
            let body = heartbeat_body(boot, mac, sick, round);
            let (status, answer) = n
                .agent_post("/api/v1/agent/heartbeat", &boot.token, body)
                .await;
            assert_eq!(status, 200, "{answer}");
            answer["action"].as_str().unwrap().to_string()
        }
    };
    for i in 0..3 {
        for round in 1..=3 {
            assert_eq!(beat(i, Some(Sick::EccRising), round).await, "none");
        }
    }
    // Each heartbeat round: a node told to revalidate must be the one drained, alone.
    let mut validated = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while validated.len() < 3 {
        assert!(Instant::now() < deadline, "validated only {validated:?}");
        for i in 0..3 {
            if beat(i, None, 0).await != "revalidate" {
                continue;
            }
            let drained = std::fs::read_dir(dir.path())
                .unwrap()
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|f| f.starts_with("52-54-00"))
                .collect::<Vec<_>>();
            assert_eq!(drained, [macs[i].clone()], "told to validate: {i}");
            let (status, verdict) = nodes[i].validate(&boots[i], healthy()).await;
            assert_eq!((status, &verdict["passed"]), (200, &json!(true)));
            validated.insert(i);
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // The last one is handed back too; the log never has two drains outstanding.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.lines().filter(|l| l.starts_with("resume")).count() == 3 {
            let mut out = 0i32;
            for line in text.lines() {
                out += if line.starts_with("drain") { 1 } else { -1 };
                assert!((0..=1).contains(&out), "two drains at once: {text}");
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every node handed back: {text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(nodes);
    server.stop().await;
}

/// Fabric validation at boot: an image that wants two NDR ports at 4X; a node with a
/// cable trained at 1X and half the rate fails validation naming that port, a node with
/// both ports right is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_degraded_infiniband_link_fails_validation_naming_its_port() {
    use crate::harness::{file, tar_of};
    let server = TestServer::start().await;
    let manifest = crate::harness::manifest("fabric", "1").replace(
        "[validation]\n",
        "[validation]\nib-ports = 2\nib-rate-gbps = 400\nib-width = \"4X\"\n",
    );
    let bundle = tar_of(&[
        file("manifest.toml", manifest.as_bytes()),
        file("vmlinuz", &noise(20_000, 9)),
        file("initrd.img", b"initrd bytes"),
    ]);
    let (status, image) = server.publish_query(bundle, "?tag=fabric:stable").await;
    assert_eq!(status, 201, "{image}");
    let port = |i: u32, rate: f64, width: &str| json!({ "port": format!("mlx5_{i}/1"), "state": "ACTIVE", "rate_gbps": rate, "width": width });
    for (mac, ports, ready) in [
        (
            "52-54-00-24-00-01",
            json!([port(0, 400.0, "4X"), port(1, 400.0, "4X")]),
            true,
        ),
        (
            "52-54-00-24-00-02",
            json!([port(0, 400.0, "4X"), port(1, 200.0, "1X")]),
            false,
        ),
    ] {
        let n = FakeNode::new(&server, mac);
        n.script().await;
        server.assign(mac, "fabric:stable").await;
        let boot = n.boot().await;
        let artifacts = n.fetch_all(&boot).await;
        let (status, _) = n.attest(&boot, n.report(&boot, &image, &artifacts)).await;
        assert_eq!(status, 200);
        let mut report = healthy();
        report["ib_ports"] = ports;
        let (status, verdict) = n.validate(&boot, report).await;
        assert_eq!(
            (status, verdict["passed"].as_bool()),
            (200, Some(ready)),
            "{verdict}"
        );
        if !ready {
            let reasons: Vec<&str> = verdict["failures"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f["reason"].as_str().unwrap())
                .collect();
            assert!(
                reasons.iter().any(|r| r.contains("mlx5_1/1 runs at 200")),
                "{reasons:?}"
            );
            assert!(
                reasons.iter().any(|r| r.contains("mlx5_1/1 is 1X")),
                "{reasons:?}"
            );
            assert_ne!(n.state().await, "ready");
        } else {
            assert_eq!(n.state().await, "ready");
        }
    }
    server.stop().await;
}
