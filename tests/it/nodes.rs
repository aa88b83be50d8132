//! A fake node drives the boot routes: discovery, assignment, boot scripts by digest,
//! boot records, state history; and the admin node API.

use bootfleet::api::Digest;

use crate::fake_node::FakeNode;
use crate::harness::*;

const MAC: &str = "52-54-00-00-00-01";
const MAC_COLONS: &str = "52:54:00:00:00:01";

async fn script(server: &TestServer, path: &str) -> (u16, String) {
    let r = reqwest::get(server.url(path)).await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

fn field<'a>(script: &'a str, key: &str) -> &'a str {
    script
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .unwrap_or_else(|| panic!("{key} not in {script}"))
}

#[tokio::test]
async fn a_node_is_discovered_assigned_and_boots_its_image_by_digest() {
    let server = TestServer::start().await;
    let (status, entry) = script(&server, "/boot.ipxe").await;
    assert_eq!(status, 200);
    let host = server.addr.to_string();
    assert!(
        entry.contains(&format!(
            "chain --autofree http://{host}/boot/node.ipxe?mac=${{mac:hexhyp}}"
        )),
        "{entry}"
    );

    // First contact: recorded as discovered, told to wait.
    let node_path = format!("/boot/node.ipxe?mac={MAC}&uuid=&arch=x86_64&platform=pcbios");
    let (status, first) = script(&server, &node_path).await;
    assert_eq!(status, 200);
    assert!(first.contains("new to bootfleet"), "{first}");
    let (_, node) = server.json(&format!("/api/v1/nodes/{MAC_COLONS}")).await;
    assert_eq!(node["state"], "discovered");
    assert_eq!(node["history"].as_array().unwrap().len(), 1);
    let (_, again) = script(&server, &node_path).await;
    assert!(again.contains("no image is assigned"), "{again}");

    // Assigning something unpublished is refused; a published tag is accepted.
    let assign = |image: &str| {
        server
            .put(&format!("/api/v1/nodes/{MAC}/image"))
            .json(&serde_json::json!({ "image": image }))
            .send()
    };
    assert_eq!(assign("demo:stable").await.unwrap().status(), 404);
    let kernel_v1 = noise(50_000, 101);
    let (_, v1) = server
        .publish_query(good_bundle("demo", "1", &kernel_v1), "?tag=demo:stable")
        .await;
    assert_eq!(assign("demo:stable").await.unwrap().status(), 200);

    let (_, boot1) = script(&server, &node_path).await;
    let kernel_url = format!(
        "http://{host}/blobs/sha256/{}",
        Digest::of(&kernel_v1).hex()
    );
    assert!(
        boot1.contains(&format!("kernel {kernel_url}?boot=")),
        "{boot1}"
    );
    assert!(
        boot1.contains(" initrd=initrd.img console=ttyS0 quiet "),
        "{boot1}"
    );
    assert!(
        boot1.contains("initrd --name initrd.img http://"),
        "{boot1}"
    );
    assert!(
        boot1.contains(&format!("bootfleet.server=http://{host} ")),
        "{boot1}"
    );
    let boot_id = field(&boot1, "bootfleet.boot=").to_string();
    let token = field(&boot1, "bootfleet.token=").to_string();
    // The token names its boot, then 32 random bytes.
    assert_eq!(token.len(), boot_id.len() + 1 + 64);
    assert!(token.starts_with(&format!("{boot_id}.")));
    // The node can fetch exactly what the script names.
    let fetched = reqwest::get(&kernel_url)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(fetched.as_ref(), kernel_v1.as_slice());

    let (_, node) = server.json(&format!("/api/v1/nodes/{MAC_COLONS}")).await;
    assert_eq!(node["state"], "provisioning");
    assert_eq!(node["assigned"], "demo:stable");
    assert_eq!(node["boots"][0]["id"], boot_id.as_str());
    assert_eq!(node["boots"][0]["image"], v1["digest"]);
    let last = node["history"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["from"], "discovered");
    assert_eq!(last["to"], "provisioning");
    assert!(
        last["reason"].as_str().unwrap().contains(&boot_id),
        "{last}"
    );
    // The token is stored only as its hash.
    let db = std::fs::read(server.data.path().join("bootfleet.db")).unwrap();
    let wal = std::fs::read(server.data.path().join("bootfleet.db-wal")).unwrap_or_default();
    for bytes in [&db, &wal] {
        assert!(
            !bytes.windows(token.len()).any(|w| w == token.as_bytes()),
            "token stored in clear"
        );
    }

    // The tag moves: the next boot follows it, with a new boot id and token.
    let kernel_v2 = noise(50_000, 102);
    let (_, v2) = server
        .publish_query(good_bundle("demo", "2", &kernel_v2), "?tag=demo:stable")
        .await;
    let (_, boot2) = script(&server, &node_path).await;
    assert!(boot2.contains(&Digest::of(&kernel_v2).hex()), "{boot2}");
    assert_ne!(field(&boot2, "bootfleet.boot="), boot_id);
    assert_ne!(field(&boot2, "bootfleet.token="), token);
    let (_, node) = server.json(&format!("/api/v1/nodes/{MAC_COLONS}")).await;
    assert_eq!(node["boots"][0]["image"], v2["digest"]);
    assert_eq!(node["boots"].as_array().unwrap().len(), 2);
    server.stop().await;
}

#[tokio::test]
async fn bad_boot_requests_and_labels_are_refused_with_reasons() {
    let server = TestServer::start().await;
    for (path, needle) in [
        ("/boot/node.ipxe", "mac is required"),
        ("/boot/node.ipxe?mac=zz-54-00-00-00-01", "invalid MAC"),
        ("/boot/node.ipxe?mac=52-54-00", "invalid MAC"),
    ] {
        let r = reqwest::get(server.url(path)).await.unwrap();
        assert_eq!(r.status(), 400, "{path}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert!(body["error"].as_str().unwrap().contains(needle), "{body}");
    }
    let (status, _) = server.json("/api/v1/nodes/52:54:00:00:00:09").await;
    assert_eq!(status, 404);

    script(&server, &format!("/boot/node.ipxe?mac={MAC}")).await;
    let label = |body: serde_json::Value| {
        server
            .http
            .patch(server.url(&format!("/api/v1/nodes/{MAC}/labels")))
            .bearer_auth(&server.token)
            .json(&body)
            .send()
    };
    let r = label(serde_json::json!({ "set": { "rack": "r12", "sku": "hgx-h100" } }))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r: serde_json::Value = label(serde_json::json!({ "remove": ["sku"] }))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["labels"], serde_json::json!({ "rack": "r12" }));
    let r = label(serde_json::json!({ "set": { "bad key": "x" } }))
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // Invisible and text-direction characters would make two labels look alike.
    for value in ["r1\u{200B}2", "\u{202E}21r", "r12\u{FEFF}", "r\u{2066}12"] {
        let r = label(serde_json::json!({ "set": { "rack": value } }))
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{value:?}");
    }
    // One separator throughout, two hex digits a pair.
    for bad in ["52:54-00:00:00:01", "+2-54-00-00-00-01"] {
        let r = reqwest::get(server.url(&format!("/boot/node.ipxe?mac={bad}")))
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{bad}");
    }
    let (_, list) = server.json("/api/v1/nodes").await;
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["mac"], MAC_COLONS);
    server.stop().await;
}

/// The agent's attestation: bound to its boot, used once, judged against the manifest.
#[tokio::test]
async fn attestation_is_bound_to_its_boot_and_names_every_mismatch() {
    let server = TestServer::start().await;
    let kernel = noise(20_000, 111);
    let (_, image) = server
        .publish_query(good_bundle("demo", "1", &kernel), "?tag=demo:stable")
        .await;
    server.assign(MAC, "demo:stable").await;
    let fake = crate::fake_node::FakeNode::new(&server, MAC);
    let boot = fake.boot().await;
    fake.fetch_all(&boot).await;
    let boot_id = boot.id.clone();
    let token = boot.token.clone();
    let cmdline = boot.cmdline.clone();
    let report = |kernel_release: &str, driver: &str| {
        serde_json::json!({
            "image_digest": image["digest"],
            "kernel_release": kernel_release,
            "cmdline": cmdline,
            "versions": { "nvidia-driver": driver },
            "artifacts": [format!("sha256:{}", Digest::of(&kernel).hex()), format!("sha256:{}", Digest::of(b"initrd bytes").hex())],
        })
    };
    let attest = |token: &str, mac: &str, boot_id: &str, report: serde_json::Value| {
        server
            .http
            .post(server.url("/api/v1/agent/attest"))
            .bearer_auth(token)
            .json(&serde_json::json!({ "boot_id": boot_id, "mac": mac, "report": report }))
            .send()
    };
    let good = report("6.1.0-28-cloud-amd64", "550.127.05");

    // Forged token, another node's claim: refused, nothing recorded.
    let r = attest(&"0".repeat(64), MAC, &boot_id, good.clone())
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let r = attest(&token, "52:54:00:00:00:99", &boot_id, good.clone())
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert!(
        r.text()
            .await
            .unwrap()
            .contains("belongs to 52:54:00:00:00:01")
    );
    let r = server
        .http
        .post(server.url("/api/v1/agent/attest"))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    let r = attest(&token, MAC, &boot_id, good.clone()).await.unwrap();
    assert_eq!(r.status(), 200);
    let verdict: serde_json::Value = r.json().await.unwrap();
    assert_eq!(verdict["passed"], true, "{verdict}");
    let (_, node) = server.json(&format!("/api/v1/nodes/{MAC_COLONS}")).await;
    assert_eq!(node["state"], "booted");

    // Retried, even with another report: the verdict first given, nothing rewritten.
    let mut other = good.clone();
    other["kernel_release"] = serde_json::json!("5.10.0-0-amd64");
    let r = attest(&token, MAC, &boot_id, other).await.unwrap();
    assert_eq!(r.status(), 200);
    let again: serde_json::Value = r.json().await.unwrap();
    assert_eq!(again, verdict);

    // A new boot: the old token has expired; a drifted report fails with named reasons.
    let boot2 = fake.boot().await;
    fake.fetch_all(&boot2).await;
    let boot2_id = boot2.id.clone();
    let token2 = boot2.token.clone();
    let r = attest(&token, MAC, &boot_id, good.clone()).await.unwrap();
    assert_eq!(r.status(), 403);
    let mut bad = report("6.1.0-27-cloud-amd64", "535.104.05");
    bad["cmdline"] = serde_json::json!(cmdline.replace(&boot_id, &boot2_id));
    let verdict: serde_json::Value = attest(&token2, MAC, &boot2_id, bad)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(verdict["passed"], false);
    let fields: Vec<&str> = verdict["mismatches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, ["pins.kernel", "pins.nvidia-driver"], "{verdict}");
    let (_, node) = server.json(&format!("/api/v1/nodes/{MAC_COLONS}")).await;
    assert_eq!(node["state"], "attestation-failed");
    assert!(
        node["state_reason"]
            .as_str()
            .unwrap()
            .contains("expected 550.127.05, found 535.104.05"),
        "{node}"
    );
    server.stop().await;
}

/// Removing an image takes its boots with it. A node whose newest boot ran it must not
/// get the boot before as its newest again: that boot's token stays refused.
#[tokio::test]
async fn removing_an_image_does_not_bring_back_an_older_boots_token() {
    let server = TestServer::start().await;
    let mut images = Vec::new();
    for (version, seed) in [("1", 121), ("2", 122)] {
        let (status, image) = server
            .publish(good_bundle("demo", version, &noise(20_000, seed)))
            .await;
        assert_eq!(status, 201, "{image}");
        images.push(image);
    }
    let fake = FakeNode::new(&server, MAC);
    server.assign(MAC, "demo:1").await;
    let first = fake.boot().await;
    server.assign(MAC, "demo:2").await;
    let second = fake.boot().await;
    // Nothing fetched: attestation fails, and a failed node runs nothing its image needs.
    let (status, verdict) = fake
        .attest(&second, fake.report(&second, &images[1], &[]))
        .await;
    assert_eq!(
        (status, &verdict["passed"]),
        (200, &serde_json::json!(false)),
        "{verdict}"
    );
    server.assign(MAC, "demo:1").await;
    let r = server.delete("/api/v1/images/demo:2").send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());

    let (status, answer) = fake
        .attest(&first, fake.report(&first, &images[0], &[]))
        .await;
    assert_eq!(
        status, 403,
        "the first boot's token is good again: {answer}"
    );
    // The node boots on as before: a new boot, a new token.
    let third = fake.boot().await;
    let (status, verdict) = fake
        .attest(&third, fake.report(&third, &images[0], &[]))
        .await;
    assert_eq!(status, 200, "{verdict}");
    server.stop().await;
}

/// Reimage: a reason, the disruption budget (overall and per rack), idempotency keys, and
/// the heartbeat that tells the node to reboot.
#[tokio::test]
async fn reimage_obeys_the_budget_is_idempotent_and_reaches_the_node() {
    use bootfleet::node::reimage::DisruptionBudget;
    let server = TestServer::start_configured(|cfg| {
        cfg.budget = DisruptionBudget {
            max_total: 2,
            group_label: Some("rack".into()),
            max_per_group: 1,
            ..Default::default()
        };
    })
    .await;
    let (_, image) = server
        .publish_query(good_bundle("demo", "1", b"k1"), "?tag=demo:stable")
        .await;
    let macs = [
        "52-54-00-00-01-01",
        "52-54-00-00-01-02",
        "52-54-00-00-02-01",
        "52-54-00-00-09-01",
    ];
    let racks = [Some("r1"), Some("r1"), Some("r2"), None];
    let mut tokens = Vec::new();
    for (mac, rack) in macs.iter().zip(racks) {
        server.assign(mac, "demo:stable").await;
        if let Some(rack) = rack {
            server
                .http
                .patch(server.url(&format!("/api/v1/nodes/{mac}/labels")))
                .bearer_auth(&server.token)
                .json(&serde_json::json!({ "set": { "rack": rack } }))
                .send()
                .await
                .unwrap();
        }
        // Booted and attested: heartbeats come only after attestation.
        let fake = FakeNode::new(&server, mac);
        let boot = fake.boot().await;
        let digests = fake.fetch_all(&boot).await;
        let (status, verdict) = fake
            .attest(&boot, fake.report(&boot, &image, &digests))
            .await;
        assert_eq!(status, 200, "{verdict}");
        tokens.push((boot.id.clone(), boot.token.clone()));
    }
    let reimage = |mac: &str, key: Option<&str>| {
        let mut r = server
            .post(&format!("/api/v1/nodes/{mac}/reimage"))
            .json(&serde_json::json!({ "reason": "driver drift on GPU 3" }));
        if let Some(k) = key {
            r = r.header("idempotency-key", k);
        }
        r.send()
    };
    let first = reimage(macs[0], Some("k-1")).await.unwrap();
    assert_eq!(first.status(), 202);
    let first_body = first.text().await.unwrap();
    assert!(first_body.contains("\"accepted\""), "{first_body}");
    // Same key: the same answer, nothing new.
    let again = reimage(macs[0], Some("k-1")).await.unwrap();
    assert_eq!(again.status(), 202);
    assert_eq!(again.text().await.unwrap(), first_body);
    assert_eq!(
        reimage(macs[1], Some("k-1")).await.unwrap().status(),
        409,
        "a key belongs to one node"
    );
    // Rack r1 already has one node down.
    let r = reimage(macs[1], None).await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "60");
    assert!(r.text().await.unwrap().contains("rack=r1"));
    assert_eq!(reimage(macs[2], None).await.unwrap().status(), 202);
    // Two down overall: the budget's total.
    let r = reimage(macs[3], None).await.unwrap();
    assert_eq!(r.status(), 429);
    assert!(
        r.text()
            .await
            .unwrap()
            .contains("most allowed at once is 2")
    );
    let r = server
        .post(&format!("/api/v1/nodes/{}/reimage", macs[3]))
        .json(&serde_json::json!({ "reason": " " }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = server
        .post("/api/v1/nodes/52-54-00-00-07-07/reimage")
        .json(&serde_json::json!({ "reason": "x" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    // The heartbeat answers "reboot" to a reimaging node, "none" to the others.
    let heartbeat = |mac: &str, (boot, token): &(String, String)| {
        server
            .http
            .post(server.url("/api/v1/agent/heartbeat"))
            .bearer_auth(token)
            .json(&serde_json::json!({ "boot_id": boot, "mac": mac }))
            .send()
    };
    let answer: serde_json::Value = heartbeat(macs[0], &tokens[0])
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["action"], "reboot");
    let answer: serde_json::Value = heartbeat(macs[1], &tokens[1])
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["action"], "none");
    assert_eq!(
        heartbeat(macs[1], &tokens[0]).await.unwrap().status(),
        403,
        "another boot's token"
    );
    // The node reboots: a new boot, provisioning again, the reimage slot is free.
    let (_, boot) = script(&server, &format!("/boot/node.ipxe?mac={}", macs[0])).await;
    let fresh = (
        field(&boot, "bootfleet.boot=").to_string(),
        field(&boot, "bootfleet.token=").to_string(),
    );
    // Not attested yet: its heartbeats are refused (a boot that never attested cannot
    // be heard as alive).
    let r = heartbeat(macs[0], &fresh).await.unwrap();
    assert_eq!(r.status(), 409);
    assert!(
        r.text()
            .await
            .unwrap()
            .contains("has not passed attestation")
    );
    assert_eq!(
        heartbeat(macs[0], &tokens[0]).await.unwrap().status(),
        403,
        "the old boot's token expired"
    );
    let (_, node) = server.json(&format!("/api/v1/nodes/{}", macs[0])).await;
    assert_eq!(node["state"], "provisioning");
    let tos = strings(&node["history"], "to");
    assert_eq!(
        tos,
        [
            "discovered",
            "provisioning",
            "booted",
            "reimaging",
            "provisioning"
        ]
    );
    assert!(
        node["history"][3]["reason"]
            .as_str()
            .unwrap()
            .contains("driver drift on GPU 3")
    );
    assert_eq!(
        reimage(macs[1], None).await.unwrap().status(),
        202,
        "r1 has room again"
    );
    server.stop().await;
}

/// `boot=local` is one rule for every path: the HTTP boot route hands such a node no
/// image either (it exits to the firmware's next boot device) and opens no boot.
#[tokio::test]
async fn a_node_labelled_boot_local_gets_no_image_over_http() {
    let server = TestServer::start().await;
    let (status, body) = server.publish(good_bundle("n", "1", b"kernel")).await;
    assert_eq!(status, 201, "{body}");
    server.assign(MAC_COLONS, "n:1").await;
    let r = server
        .http
        .patch(server.url(&format!("/api/v1/nodes/{MAC_COLONS}/labels")))
        .bearer_auth(&server.token)
        .json(&serde_json::json!({ "set": { "boot": "local" } }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (status, text) = script(&server, &format!("/boot/node.ipxe?mac={MAC}")).await;
    assert_eq!(status, 200);
    assert!(text.contains("\nexit"), "{text}");
    assert!(!text.contains("kernel "), "{text}");
    let (_, node) = server.json(&format!("/api/v1/nodes/{MAC_COLONS}")).await;
    assert_eq!(node["state"], "discovered", "{node}");
    assert_eq!(node["boots"].as_array().map(Vec::len), Some(0), "{node}");
    server.stop().await;
}

/// The UUID a node first reports is kept: anyone on the boot network can ask for a
/// script in a node's name, and must not rewrite what the node is known by.
#[tokio::test]
async fn the_first_uuid_seen_is_kept() {
    let server = TestServer::start().await;
    let first = "4C4C4544-0042-3510-8052-B4C04F4E3232";
    let ask =
        |uuid: &str| reqwest::get(server.url(&format!("/boot/node.ipxe?mac={MAC}&uuid={uuid}")));
    // Not UUIDs: nothing stored.
    for junk in [
        "",
        "00000000-0000-0000-0000-000000000000",
        "not-a-uuid",
        "4c4c4544",
    ] {
        assert_eq!(ask(junk).await.unwrap().status(), 200);
    }
    let (_, node) = server.json(&format!("/api/v1/nodes/{MAC_COLONS}")).await;
    assert_eq!(node["uuid"], serde_json::Value::Null, "{node}");
    assert_eq!(ask(first).await.unwrap().status(), 200);
    assert_eq!(
        ask("11111111-2222-3333-4444-555555555555")
            .await
            .unwrap()
            .status(),
        200
    );
    let (_, node) = server.json(&format!("/api/v1/nodes/{MAC_COLONS}")).await;
    assert_eq!(node["uuid"], first.to_ascii_lowercase(), "{node}");
    server.stop().await;
}

/// Overlapping tries with one Idempotency-Key all get the first answer: the key is
/// claimed before the decision, not looked up before it and saved after.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_tries_with_one_key_get_one_answer() {
    let server = TestServer::start().await;
    let (status, body) = server.publish(good_bundle("demo", "1", b"kernel")).await;
    assert_eq!(status, 201, "{body}");
    server.assign(MAC_COLONS, "demo:1").await;
    let (status, _) = script(&server, &format!("/boot/node.ipxe?mac={MAC}")).await;
    assert_eq!(status, 200);
    let tries = (0..5).map(|_| async {
        let r = server
            .post(&format!("/api/v1/nodes/{MAC_COLONS}/reimage"))
            .header("idempotency-key", "rollout-7/node-1")
            .json(&serde_json::json!({ "reason": "rollout 7" }))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    });
    let answers = futures_util::future::join_all(tries).await;
    let first = answers[0].clone();
    assert_eq!(first.0, 202, "{}", first.1);
    assert!(first.1.contains("\"accepted\""), "{}", first.1);
    for answer in &answers {
        assert_eq!(answer, &first);
    }
    server.stop().await;
}

/// Unknown MACs cannot grow the node table without bound: past `[discovery]
/// max_unassigned` a new MAC gets the unknown-node script and is not recorded.
#[tokio::test]
async fn new_macs_past_the_discovery_cap_are_answered_but_not_recorded() {
    let server = TestServer::start_configured(|cfg| cfg.discovery.max_unassigned = 2).await;
    for i in 1..=5 {
        let (status, text) =
            script(&server, &format!("/boot/node.ipxe?mac=52-54-00-00-0c-0{i}")).await;
        assert_eq!(status, 200, "{text}");
    }
    let (_, nodes) = server.json("/api/v1/nodes").await;
    let macs: Vec<&str> = nodes
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["mac"].as_str().unwrap())
        .collect();
    assert_eq!(macs, ["52:54:00:00:0c:01", "52:54:00:00:0c:02"]);
    // An admin's registration is not capped.
    let (status, body) = server.publish(good_bundle("demo", "1", b"kernel")).await;
    assert_eq!(status, 201, "{body}");
    server.assign("52:54:00:00:0c:09", "demo:1").await;
    let (_, nodes) = server.json("/api/v1/nodes").await;
    assert_eq!(nodes.as_array().unwrap().len(), 3);
    server.stop().await;
}
