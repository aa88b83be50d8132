//! What one client may hold of the server: bodies read only after the caller is known and
//! only up to a cap, connections capped, headers, idle keep-alive and stalled bodies timed
//! out, and a shutdown that ends within its grace whatever clients do. Raw TCP where a
//! well-behaved HTTP client would hide the attack.

use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::fake_node::FakeNode;
use crate::harness::*;

/// Sends `head` (request line and headers, no blank line yet) announcing a body of
/// `length` bytes and sends only `sent` of them; returns what the server answers, read
/// until it closes or `wait` passes.
async fn announce_body(
    server: &TestServer,
    head: &str,
    length: u64,
    sent: usize,
    wait: Duration,
) -> String {
    let mut tcp = TcpStream::connect(server.addr).await.unwrap();
    let request = format!(
        "{head}\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    );
    tcp.write_all(request.as_bytes()).await.unwrap();
    tcp.write_all(&vec![b' '; sent]).await.unwrap();
    read_until_closed(&mut tcp, wait).await
}

/// What the server sends until it has answered or closed the connection; panics when
/// it does neither within `wait`.
async fn read_until_closed(tcp: &mut TcpStream, wait: Duration) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(wait, async {
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    // An answer to a request whose body we never finish: enough.
                    if got.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
            }
        }
    })
    .await
    .expect("the server neither answered nor closed the connection");
    String::from_utf8_lossy(&got).into_owned()
}

/// True when the server closes `tcp` within `wait` (reads EOF or a reset).
async fn closed_within(tcp: &mut TcpStream, wait: Duration) -> bool {
    let mut buf = [0u8; 1024];
    matches!(
        tokio::time::timeout(wait, async {
            loop {
                match tcp.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => continue,
                }
            }
        })
        .await,
        Ok(())
    )
}

#[tokio::test]
async fn agent_calls_are_judged_from_the_header_before_any_body_is_read() {
    let server = TestServer::start().await;
    // A gigabyte announced, a few bytes sent: the answer comes without the rest.
    let wait = Duration::from_secs(20);
    let anonymous = announce_body(
        &server,
        "POST /api/v1/agent/attest HTTP/1.1",
        1 << 30,
        10,
        wait,
    )
    .await;
    assert!(anonymous.starts_with("HTTP/1.1 401"), "{anonymous}");
    for forged in [
        "0".repeat(64),
        format!("{}.{}", "ab".repeat(8), "0".repeat(64)),
    ] {
        let head =
            format!("POST /api/v1/agent/validate HTTP/1.1\r\nAuthorization: Bearer {forged}");
        let answer = announce_body(&server, &head, 1 << 30, 10, wait).await;
        assert!(answer.starts_with("HTTP/1.1 403"), "{forged}: {answer}");
    }
    // Forged tokens write nothing: no event, no node.
    let (_, page) = server.json("/api/v1/events").await;
    assert_eq!(page["events"], json!([]), "{page}");

    // A real token: the body is read, up to the cap.
    let (status, image) = server
        .publish(good_bundle("demo", "1.0.0", &noise(4096, 1)))
        .await;
    assert_eq!(status, 201, "{image}");
    server.assign("52:54:00:00:00:01", "demo:1.0.0").await;
    let fake = FakeNode::new(&server, "52-54-00-00-00-01");
    fake.script().await;
    let boot = fake.boot().await;
    let head = format!(
        "POST /api/v1/agent/attest HTTP/1.1\r\nAuthorization: Bearer {}",
        boot.token
    );
    let answer = announce_body(&server, &head, 1 << 30, 300 * 1024, wait).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    // Still attestable: the refused body changed nothing.
    let digests = fake.fetch_all(&boot).await;
    let (status, verdict) = fake
        .attest(&boot, fake.report(&boot, &image, &digests))
        .await;
    assert_eq!(status, 200, "{verdict}");
    server.stop().await;
}

#[tokio::test]
async fn admin_bodies_and_labels_are_capped() {
    let server = TestServer::start().await;
    let mac = "52:54:00:00:00:02";
    let r = reqwest::get(server.url("/boot/node.ipxe?mac=52-54-00-00-00-02"))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let patch = |body: String| {
        server
            .http
            .patch(server.url(&format!("/api/v1/nodes/{mac}/labels")))
            .bearer_auth(&server.token)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    // Over the JSON cap: 413, whatever it holds.
    let big = json!({ "set": { "note": "x".repeat(2 << 20) } }).to_string();
    assert_eq!(patch(big).await.unwrap().status(), 413);
    // Labels: 64 fit, the 65th is refused with the reason, in one request or over two.
    let labels = |from: usize, to: usize| {
        let set: serde_json::Map<String, serde_json::Value> =
            (from..to).map(|i| (format!("k{i}"), json!("v"))).collect();
        json!({ "set": set }).to_string()
    };
    let r = patch(labels(0, 65)).await.unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("at most 64 labels"));
    assert_eq!(patch(labels(0, 60)).await.unwrap().status(), 200);
    assert_eq!(patch(labels(60, 65)).await.unwrap().status(), 400);
    assert_eq!(patch(labels(60, 64)).await.unwrap().status(), 200);
    let (_, node) = server.json(&format!("/api/v1/nodes/{mac}")).await;
    assert_eq!(node["labels"].as_object().unwrap().len(), 64);
    server.stop().await;
}

#[tokio::test]
async fn slow_headers_idle_connections_and_stalled_bodies_are_closed() {
    let server = TestServer::start_configured(|cfg| {
        cfg.http.header_timeout_secs = 1;
        cfg.http.body_timeout_secs = 1;
    })
    .await;
    let wait = Duration::from_secs(15);
    // Half a request line, then nothing.
    let mut slow = TcpStream::connect(server.addr).await.unwrap();
    slow.write_all(b"GET /healthz HT").await.unwrap();
    assert!(closed_within(&mut slow, wait).await, "slow headers");
    // Nothing at all.
    let mut silent = TcpStream::connect(server.addr).await.unwrap();
    assert!(closed_within(&mut silent, wait).await, "silent connection");
    // A keep-alive connection left idle after its answer.
    let mut idle = TcpStream::connect(server.addr).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let answer = read_until_closed(&mut idle, wait).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(closed_within(&mut idle, wait).await, "idle keep-alive");
    // A publish whose body stops coming: abandoned, and nothing kept of it.
    let head = "POST /api/v1/images HTTP/1.1\r\nAuthorization: Bearer ".to_string() + &server.token;
    let answer = announce_body(&server, &head, 1 << 20, 1000, wait).await;
    assert!(!answer.starts_with("HTTP/1.1 201"), "{answer}");
    server.assert_empty().await;
    server.stop().await;
}

/// `n` connections, each answered once and kept open (alive): they hold `n` slots.
async fn hold_slots(server: &TestServer, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::new();
    for _ in 0..n {
        let mut tcp = TcpStream::connect(server.addr).await.unwrap();
        tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let answer = read_until_closed(&mut tcp, Duration::from_secs(10)).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        held.push(tcp);
    }
    held
}

/// Each of `asks` on a connection of its own, in order, 100 ms apart (each one in before
/// the next connects); each answer's head comes with its index as it arrives.
async fn ask_each(
    server: &TestServer,
    asks: &[&'static [u8]],
) -> tokio::sync::mpsc::UnboundedReceiver<(usize, String)> {
    let (done_tx, done) = tokio::sync::mpsc::unbounded_channel();
    for (i, ask) in asks.iter().enumerate() {
        let mut tcp = TcpStream::connect(server.addr).await.unwrap();
        tcp.write_all(ask).await.unwrap();
        let done_tx = done_tx.clone();
        tokio::spawn(async move {
            let answer = read_until_closed(&mut tcp, Duration::from_secs(10)).await;
            let _ = done_tx.send((i, answer));
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    done
}

#[tokio::test]
async fn connections_past_the_cap_wait_for_a_free_one() {
    let server = TestServer::start_configured(|cfg| cfg.http.max_connections = 3).await;
    let mut held = hold_slots(&server, 3).await;
    // The fourth is not served while three are open...
    let fourth = tokio::spawn(reqwest::get(server.url("/healthz")));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!fourth.is_finished(), "served past the cap");
    // ...and is as soon as one closes.
    held.pop();
    let r = tokio::time::timeout(Duration::from_secs(10), fourth)
        .await
        .expect("served once a connection closed")
        .unwrap()
        .unwrap();
    assert_eq!(r.status(), 200);
    drop(held);
    server.stop().await;
}

/// Connections past the cap wait in the server, not in the kernel's backlog where a full
/// queue drops handshakes, and are served in the order they came.
#[tokio::test]
async fn connections_past_the_cap_are_served_in_arrival_order() {
    let server = TestServer::start_configured(|cfg| cfg.http.max_connections = 1).await;
    let wait = Duration::from_secs(10);
    let held = hold_slots(&server, 1).await;
    let ask: &'static [u8] = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let mut done = ask_each(&server, &[ask; 4]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(done.try_recv().is_err(), "served past the cap");
    drop(held);
    for want in 0..4 {
        let (i, answer) = tokio::time::timeout(wait, done.recv())
            .await
            .expect("served once the slot is free")
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert_eq!(i, want, "served in the order they came");
    }
    server.stop().await;
}

/// A node agent's call waiting for a slot goes before the boot scripts and downloads that
/// came earlier: it is a node's last step.
#[tokio::test]
async fn a_waiting_agent_call_is_served_before_earlier_connections() {
    let server = TestServer::start_configured(|cfg| cfg.http.max_connections = 2).await;
    let wait = Duration::from_secs(10);
    let mut held = hold_slots(&server, 2).await;
    let asks: [&'static [u8]; 3] = [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"POST /api/v1/agent/heartbeat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope.nope\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    ];
    let mut done = ask_each(&server, &asks).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(done.try_recv().is_err(), "served past the cap");
    held.pop();
    let (first, answer) = tokio::time::timeout(wait, done.recv())
        .await
        .expect("served once a slot is free")
        .unwrap();
    assert_eq!(first, 2, "the agent's call first: {answer}");
    assert!(answer.starts_with("HTTP/1.1 403"), "refused: {answer}");
    for want in [0, 1] {
        let (i, answer) = tokio::time::timeout(wait, done.recv())
            .await
            .expect("the others in turn")
            .unwrap();
        assert_eq!(i, want);
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    drop(held);
    server.stop().await;
}

#[tokio::test]
async fn past_the_keep_alive_limit_responses_close_their_connection() {
    let server = TestServer::start_configured(|cfg| {
        cfg.http.max_connections = 8;
        cfg.http.keep_alive_connections = 1;
    })
    .await;
    let wait = Duration::from_secs(10);
    let ask = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    // One connection open: at the limit, not past it; kept alive.
    let mut first = TcpStream::connect(server.addr).await.unwrap();
    first.write_all(ask).await.unwrap();
    let answer = read_until_closed(&mut first, wait).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        !answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    // A second: past the limit, so its answer ends it.
    let mut second = TcpStream::connect(server.addr).await.unwrap();
    second.write_all(ask).await.unwrap();
    let answer = read_until_closed(&mut second, wait).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    assert!(
        closed_within(&mut second, wait).await,
        "closed after its answer"
    );
    // The first, alone again (once the second's slot is given back), is still kept
    // alive and still served.
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.write_all(ask).await.unwrap();
    let answer = read_until_closed(&mut first, wait).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        !answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    drop(first);
    server.stop().await;
}

#[tokio::test]
async fn shutdown_ends_within_its_grace_whatever_clients_hold() {
    let server = TestServer::start_configured(|cfg| cfg.http.shutdown_grace_secs = 1).await;
    // A publish trickling its body, and a client that sends half a request line.
    let mut publish = TcpStream::connect(server.addr).await.unwrap();
    let head = format!(
        "POST /api/v1/images HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: 1000000\r\n\r\n",
        server.token
    );
    publish.write_all(head.as_bytes()).await.unwrap();
    publish.write_all(&[0u8; 512]).await.unwrap();
    let mut slow = TcpStream::connect(server.addr).await.unwrap();
    slow.write_all(b"GET /healthz HT").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    tokio::time::timeout(Duration::from_secs(20), server.stop())
        .await
        .expect("the server stops within its grace");
    drop((publish, slow));
}

/// A slow upload holds a blocking thread for as long as it lasts; past
/// `max_concurrent_publishes` more wait unread, and blob downloads go on meanwhile.
#[tokio::test]
async fn publishes_past_the_cap_wait_and_downloads_go_on() {
    let server = TestServer::start_with(bootfleet::image::bundle::BundleLimits {
        max_concurrent_publishes: 1,
        ..Default::default()
    })
    .await;
    let kernel = noise(100_000, 4);
    let (status, _) = server.publish(good_bundle("a", "1", &kernel)).await;
    assert_eq!(status, 201);
    // A publish that sends a little and stalls holds the one reader...
    let mut slow = TcpStream::connect(server.addr).await.unwrap();
    let head = format!(
        "POST /api/v1/images HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: 1000000\r\n\r\n",
        server.token
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    slow.write_all(&good_bundle("b", "1", b"k")[..512])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // ...so the next waits,
    let url = server.url("/api/v1/images");
    let token = server.token.clone();
    let next = tokio::spawn(async move {
        bootfleet::http_client::builder()
            .build()
            .unwrap()
            .post(url)
            .bearer_auth(token)
            .body(good_bundle("c", "1", b"kernel c"))
            .send()
            .await
            .unwrap()
            .status()
    });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(!next.is_finished(), "a second publish ran past the cap");
    // while blobs are served.
    let hex = bootfleet::api::Digest::of(&kernel).hex();
    let r = reqwest::get(server.url(&format!("/blobs/sha256/{hex}")))
        .await
        .unwrap();
    assert_eq!(r.bytes().await.unwrap().len(), kernel.len());
    // The stalled upload goes away: the waiting one is read and published.
    drop(slow);
    let status = tokio::time::timeout(Duration::from_secs(20), next)
        .await
        .expect("the waiting publish ran once the reader was free")
        .unwrap();
    assert_eq!(status, 201);
    server.stop().await;
}

/// `/readyz` says not ready while the data directory's disk is full (less free space than
/// a publish keeps back, or a write that cannot commit) and ready again once space is
/// back: a server that answers reads but cannot record boots is not ready.
#[tokio::test]
async fn readyz_fails_while_the_disk_is_full_and_recovers() {
    let fs = crate::harness::Tmpfs::mount("24m");
    let data = fs.path().join("data");
    let server = TestServer::start_configured(|cfg| {
        cfg.data_dir = data;
        cfg.limits.min_free_bytes = 2 << 20;
    })
    .await;
    let ready = || async {
        let r = reqwest::get(server.url("/readyz")).await.unwrap();
        let status = r.status().as_u16();
        (status, r.json::<serde_json::Value>().await.unwrap())
    };
    let (status, body) = ready().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["writes"], "ok", "{body}");

    let filler = fs.path().join("filler");
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&filler).unwrap();
        let chunk = vec![7u8; 64 << 10];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.sync_all();
    }
    let (status, body) = ready().await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["ready"], false);
    assert!(
        body["blobs"].as_str().unwrap().contains("min_free_bytes"),
        "{body}"
    );

    std::fs::remove_file(&filler).unwrap();
    let (status, body) = ready().await;
    assert_eq!(status, 200, "{body}");
    server.stop().await;
}

/// Past `[store] max_queued_writes`, a request that must write is answered 503 with
/// Retry-After: 1 at once (memory stays bounded whatever the load), and a retry goes
/// through: nothing is lost, nothing half-written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_past_the_queue_get_503_with_retry_after_and_a_retry_succeeds() {
    let server = TestServer::start_configured(|cfg| cfg.store.max_queued_writes = Some(1)).await;
    let macs: Vec<String> = (0..200)
        .map(|i| format!("02-00-00-00-{:02x}-{:02x}", i / 256, i % 256))
        .collect();
    let fetch = |mac: String| {
        let request = server.get(&format!("/boot/node.ipxe?mac={mac}"));
        async move {
            let r = request.send().await.unwrap();
            let after = r
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string());
            (mac, r.status().as_u16(), after)
        }
    };
    let first = futures_util::future::join_all(macs.iter().cloned().map(fetch)).await;
    let refused: Vec<String> = first
        .iter()
        .filter(|(_, status, _)| *status != 200)
        .map(|(mac, status, after)| {
            assert_eq!(*status, 503, "{mac}");
            assert_eq!(after.as_deref(), Some("1"), "{mac}");
            mac.clone()
        })
        .collect();
    assert!(
        !refused.is_empty(),
        "200 writers at once with a queue of 1: none refused"
    );
    for mac in &refused {
        let (_, status, _) = fetch(mac.clone()).await;
        assert_eq!(status, 200, "{mac} on retry");
    }
    let (status, nodes) = server.json("/api/v1/nodes").await;
    assert_eq!(status, 200);
    assert_eq!(
        nodes.as_array().map(Vec::len),
        Some(200),
        "every MAC recorded once"
    );
    // Every refused request counted (a background task's refused write may add to it).
    let counted = server.metric("bootfleet_store_writes_refused_total").await as usize;
    assert!(
        counted >= refused.len(),
        "{counted} refusals counted: {} requests refused",
        refused.len()
    );
    server.stop().await;
}
