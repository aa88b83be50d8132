//! Several servers on one PostgreSQL state, each a whole server (HTTP, services, its
//! own tasks) in this process: what one writes the others serve, the disruption budget
//! holds across them, every server reads one event order, and exactly one sends
//! webhooks, handing over when it stops.

use std::sync::{Arc, Mutex};

use crate::harness::{TestServer, good_bundle};

/// Servers sharing `url`, the admin token and `configure`'s settings.
pub async fn cluster(
    n: usize,
    url: &str,
    configure: impl Fn(&mut bootfleet::config::ServerConfig),
) -> (Vec<TestServer>, tempfile::TempDir) {
    let shared = tempfile::tempdir().unwrap();
    let token = shared.path().join("admin.token");
    std::fs::write(&token, "cluster-admin-token-0123456789\n").unwrap();
    let mut servers = Vec::new();
    for _ in 0..n {
        servers.push(
            TestServer::start_configured(|cfg| {
                cfg.store.url = Some(url.to_string());
                cfg.admin_token_file = Some(token.clone());
                configure(cfg);
            })
            .await,
        );
    }
    (servers, shared)
}

fn mac(rack: u8, i: u8) -> String {
    format!("52-54-00-30-{rack:02x}-{i:02x}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_servers_share_one_state_and_one_disruption_budget() {
    use bootfleet::node::reimage::DisruptionBudget;
    let url = crate::pg::database().await;
    let (servers, _shared) = cluster(2, &url, |cfg| {
        cfg.budget = DisruptionBudget {
            max_total: 10,
            group_label: Some("rack".into()),
            max_per_group: 1,
            ..Default::default()
        };
    })
    .await;
    let (a, b) = (&servers[0], &servers[1]);
    let (status, _) = a
        .publish_query(good_bundle("demo", "1", b"k1"), "?tag=demo:stable")
        .await;
    assert_eq!(status, 201);
    // Published through a, resolved by b.
    let (status, image) = b.json("/api/v1/images/demo:stable").await;
    assert_eq!(status, 200, "{image}");
    let macs: Vec<String> = (1..=8).map(|i| mac(1, i)).collect();
    for (i, m) in macs.iter().enumerate() {
        let (writer, other) = if i % 2 == 0 { (a, b) } else { (b, a) };
        writer.assign(m, "demo:stable").await;
        other.label(m, "rack", "r1").await;
    }
    // Every node of the rack asked to reimage at once, through both servers.
    let asks = macs.iter().enumerate().map(|(i, m)| {
        let server = &servers[i % 2];
        async move {
            server
                .post(&format!("/api/v1/nodes/{m}/reimage"))
                .json(&serde_json::json!({ "reason": "driver drift" }))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    });
    let mut statuses = futures_util::future::join_all(asks).await;
    statuses.sort();
    let mut expected = vec![202];
    expected.extend([429; 7]);
    assert_eq!(
        statuses, expected,
        "one slot in rack r1, across both servers"
    );
    // Both servers list the same nodes, one of them reimaging.
    for s in [a, b] {
        let (_, nodes) = s.json("/api/v1/nodes").await;
        let states: Vec<&str> = nodes
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["state"].as_str().unwrap())
            .collect();
        assert_eq!(states.len(), 8);
        assert_eq!(states.iter().filter(|s| **s == "reimaging").count(), 1);
    }
    // One event log: the same events, in the same order, from either server.
    let (_, from_a) = a.json("/api/v1/events?limit=1000").await;
    let (_, from_b) = b.json("/api/v1/events?limit=1000").await;
    assert_eq!(from_a, from_b);
    let seqs: Vec<i64> = from_a["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    for s in servers {
        s.stop().await;
    }
}

#[derive(Clone, Default)]
struct Hooks(Arc<Mutex<Vec<i64>>>);

async fn receive(
    axum::extract::State(hooks): axum::extract::State<Hooks>,
    body: axum::body::Bytes,
) -> axum::http::StatusCode {
    let delivery: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let mut got = hooks.0.lock().unwrap();
    for e in delivery["events"].as_array().unwrap() {
        got.push(e["seq"].as_i64().unwrap());
    }
    axum::http::StatusCode::NO_CONTENT
}

/// Waits until the receiver holds `n` events.
async fn received(hooks: &Hooks, n: usize) -> Vec<i64> {
    for _ in 0..600 {
        if hooks.0.lock().unwrap().len() >= n {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    hooks.0.lock().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_server_sends_webhooks_and_another_takes_over_when_it_stops() {
    let hooks = Hooks::default();
    let app = axum::Router::new()
        .route("/hook", axum::routing::post(receive))
        .with_state(hooks.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let secrets = tempfile::tempdir().unwrap();
    let secret_file = secrets.path().join("hook.secret");
    std::fs::write(&secret_file, "s3cret-s3cret-s3cret\n").unwrap();
    let url = crate::pg::database().await;
    let (mut servers, _shared) = cluster(3, &url, |cfg| {
        cfg.webhooks = vec![bootfleet::events::webhook::WebhookConfig {
            url: hook_url.clone(),
            secret_file: secret_file.clone(),
            ca_file: None,
        }];
    })
    .await;
    let (status, _) = servers[0]
        .publish_query(good_bundle("demo", "1", b"k1"), "?tag=demo:stable")
        .await;
    assert_eq!(status, 201);
    // The publish is one event; each new node two (its discovery, its assignment).
    for i in 1..=5 {
        servers[i as usize % 3]
            .assign(&mac(2, i), "demo:stable")
            .await;
    }
    let got = received(&hooks, 11).await;
    assert_eq!(
        got,
        (1..=11).collect::<Vec<_>>(),
        "each event once, in order, from one sender"
    );
    // Stop every server but the last, whoever was sending: the last takes over.
    for s in servers.drain(..2) {
        s.stop().await;
    }
    let last = servers.pop().unwrap();
    for i in 6..=8 {
        last.assign(&mac(2, i), "demo:stable").await;
    }
    let got = received(&hooks, 17).await;
    assert_eq!(got, (1..=17).collect::<Vec<_>>());
    last.stop().await;
}

/// The database goes away under a running server: it is not ready, API calls answer 503
/// with Retry-After (not 500), DHCP's directory gives no answer (so the packet is
/// dropped and another server may answer); when the database returns, all recover.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_whose_store_is_unreachable_says_so_and_recovers() {
    use bootfleet::dhcp::directory::NodeDirectory as _;
    let url = crate::pg::database().await;
    let (servers, _shared) = cluster(1, &url, |_| {}).await;
    let server = &servers[0];
    let mac = mac(3, 1);
    let (status, _) = server
        .publish_query(good_bundle("demo", "1", b"k1"), "?tag=demo:stable")
        .await;
    assert_eq!(status, 201);
    server.assign(&mac, "demo:stable").await;
    let directory_store = {
        let u = bootfleet::store::StoreUrl::parse(&url).unwrap();
        bootfleet::store::open(&u, None, None).await.unwrap()
    };
    let directory = bootfleet::node::directory::StoreDirectory {
        preboot: Default::default(),
        store: directory_store.clone(),
        controller: bootfleet::node::controller::NodeController::new(directory_store.clone()),
    };
    let node_mac: bootfleet::api::Mac = mac.parse().unwrap();
    assert!(directory.node_view(node_mac, None).await.is_some());
    let ready = || async {
        server
            .get("/readyz")
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    assert_eq!(ready().await, 200);

    crate::pg::set_reachable(&url, false).await;
    assert_eq!(ready().await, 503);
    let r = server.get("/api/v1/nodes").send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "5");
    let body = r.text().await.unwrap();
    assert!(body.contains("unreachable"), "{body}");
    assert!(
        directory.node_view(node_mac, None).await.is_none(),
        "no answer rather than a wrong one"
    );

    crate::pg::set_reachable(&url, true).await;
    let mut back = false;
    for _ in 0..100 {
        if ready().await == 200 {
            back = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(back, "ready again once the database is back");
    let (status, nodes) = server.json("/api/v1/nodes").await;
    assert_eq!(status, 200);
    assert_eq!(nodes.as_array().unwrap().len(), 1);
    assert!(directory.node_view(node_mac, None).await.is_some());
    directory_store.close().await;
    for s in servers {
        s.stop().await;
    }
}
