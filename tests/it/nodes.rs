//! A fake node drives the boot routes: discovery, assignment, boot scripts by digest,
//! boot records, state history; and the admin node API.

use bootfleet::digest::Digest;

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
        boot1.contains(&format!(
            "kernel {kernel_url} initrd=initrd.img console=ttyS0 quiet "
        )),
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
    assert_eq!(token.len(), 64);
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
    let (_, list) = server.json("/api/v1/nodes").await;
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["mac"], MAC_COLONS);
    server.stop().await;
}

/// Two writers read the node at the same version: one change lands, the other is told.
#[tokio::test]
async fn concurrent_state_changes_one_wins_one_is_told() {
    use bootfleet::node::state::NodeState;
    use bootfleet::store::nodes::CasOutcome;
    let dir = tempfile::tempdir().unwrap();
    let store = bootfleet::store::Store::open(&dir.path().join("db")).await.unwrap();
    let mac = MAC.parse().unwrap();
    let (node, _) = store.discover(&mac, None, "test").await.unwrap();
    let a = store.set_state(&mac, node.version, node.state, NodeState::Provisioning, "writer a");
    let b = store.set_state(&mac, node.version, node.state, NodeState::Reimaging, "writer b");
    let (a, b) = tokio::join!(a, b);
    let outcomes = [a.unwrap(), b.unwrap()];
    let done = outcomes.iter().filter(|o| matches!(o, CasOutcome::Done(_))).count();
    let stale = outcomes.iter().filter(|o| matches!(o, CasOutcome::Stale)).count();
    assert_eq!((done, stale), (1, 1), "{outcomes:?}");
    let history = store.node_history(&mac).await.unwrap();
    assert_eq!(history.len(), 2, "one history row for the one change that landed");
    store.close().await;
}
