//! Blob serving (Range, conditional requests), verify/quarantine, and garbage collection.

use bootfleet::api::Digest;

use crate::harness::*;

async fn publish_kernel(server: &TestServer, kernel: &[u8]) -> String {
    let (status, body) = server.publish(good_bundle("n", "1", kernel)).await;
    assert_eq!(status, 201, "{body}");
    Digest::of(kernel).hex()
}

#[tokio::test]
async fn serves_whole_ranges_and_conditionals() {
    let server = TestServer::start().await;
    let kernel = noise(3 << 20, 21); // over several 1 MiB chunks
    let hex = publish_kernel(&server, &kernel).await;
    let url = server.url(&format!("/blobs/sha256/{hex}"));
    let http = bootfleet::http_client::builder().build().unwrap();
    let etag = format!("\"sha256:{hex}\"");

    let r = http.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["etag"], etag.as_str());
    assert_eq!(
        r.headers()["content-length"],
        kernel.len().to_string().as_str()
    );
    assert!(
        r.headers()["cache-control"]
            .to_str()
            .unwrap()
            .contains("immutable")
    );
    assert_eq!(r.headers()["accept-ranges"], "bytes");
    assert_eq!(r.bytes().await.unwrap().as_ref(), kernel.as_slice());

    let r = http.head(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["content-length"],
        kernel.len().to_string().as_str()
    );
    assert!(r.bytes().await.unwrap().is_empty());

    // Resume an interrupted download across a chunk boundary.
    let start = (1 << 20) - 10;
    let r = http
        .get(&url)
        .header("range", format!("bytes={start}-"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    assert_eq!(
        r.headers()["content-range"],
        format!("bytes {start}-{}/{}", kernel.len() - 1, kernel.len()).as_str()
    );
    assert_eq!(r.bytes().await.unwrap().as_ref(), &kernel[start..]);

    let r = http
        .get(&url)
        .header("range", "bytes=-100")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    assert_eq!(
        r.bytes().await.unwrap().as_ref(),
        &kernel[kernel.len() - 100..]
    );

    let r = http
        .get(&url)
        .header("range", "bytes=10-19")
        .send()
        .await
        .unwrap();
    assert_eq!(r.bytes().await.unwrap().as_ref(), &kernel[10..20]);

    let r = http
        .get(&url)
        .header("range", format!("bytes={}-", kernel.len()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 416);
    assert_eq!(
        r.headers()["content-range"],
        format!("bytes */{}", kernel.len()).as_str()
    );

    let r = http
        .get(&url)
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 304);

    let r = http
        .get(&url)
        .header("range", "bytes=0-9")
        .header("if-range", "\"something-else\"")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "a stale If-Range gets the whole blob");

    let r = http
        .get(server.url("/blobs/sha256/XYZ"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = http
        .get(server.url(&format!("/blobs/sha256/{}", "0".repeat(64))))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = http
        .get(server.url("/blobs/sha256/..%2F..%2Fbootfleet.db"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "no path escapes the blob directory");
    server.stop().await;
}

/// A small blob, once kept in memory, is answered before routing (`http::small_blobs`):
/// the same answer and the same count in `/metrics` as the router's, and never a blob
/// removed since it was kept.
#[tokio::test]
async fn small_blobs_answered_before_routing_are_the_routers_answer() {
    let server = TestServer::start().await;
    let kernel = b"a small kernel, kept in memory".to_vec();
    let hex = publish_kernel(&server, &kernel).await;
    let url = server.url(&format!("/blobs/sha256/{hex}"));
    let http = bootfleet::http_client::builder().build().unwrap();
    let answer = |r: reqwest::Response| async move {
        let status = r.status();
        let mut headers: Vec<(String, String)> = r
            .headers()
            .iter()
            .filter(|(name, _)| *name != "date")
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_string()))
            .collect();
        headers.sort();
        (status, headers, r.bytes().await.unwrap())
    };
    // The first read keeps it (the router's path); the next ones are answered from memory.
    let routed = answer(http.get(&url).send().await.unwrap()).await;
    assert_eq!(routed.0, 200);
    assert_eq!(routed.2.as_ref(), kernel.as_slice());
    for _ in 0..3 {
        assert_eq!(answer(http.get(&url).send().await.unwrap()).await, routed);
    }
    let head = answer(http.head(&url).send().await.unwrap()).await;
    assert_eq!((head.0, &head.1), (routed.0, &routed.1), "HEAD, routed");
    // A boot's download still goes through the router, which ends its connection.
    let boot = http
        .get(format!("{url}?boot=0123456789abcdef"))
        .send()
        .await
        .unwrap();
    assert_eq!(boot.headers()["connection"], "close");
    // Conditions and ranges, too.
    let r = http
        .get(&url)
        .header("range", "bytes=2-6")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    assert_eq!(r.bytes().await.unwrap().as_ref(), &kernel[2..7]);
    let etag = format!("\"sha256:{hex}\"");
    let r = http
        .get(&url)
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 304);
    let route = r#"route="/blobs/sha256/{hex}""#;
    assert_eq!(
        server
            .metric(&format!(
                r#"bootfleet_http_requests_total{{{route},method="GET",code="2xx"}}"#
            ))
            .await,
        6,
        "four whole, one boot's, one range"
    );
    assert_eq!(
        server
            .metric(&format!("bootfleet_http_response_bytes_total{{{route}}}"))
            .await,
        6 * kernel.len() as u64 + 5,
        "as announced: five whole, the HEAD's length, a range of 5"
    );
    assert_eq!(
        server
            .metric(&format!(
                "bootfleet_http_request_duration_seconds_count{{{route}}}"
            ))
            .await,
        8
    );

    // Quarantined after it was kept: never answered from memory again.
    std::fs::write(
        server.blob_dir().join(&hex),
        b"a small kernel that has rotted",
    )
    .unwrap();
    let report = server.post_json("/api/v1/blobs/verify").await;
    assert_eq!(
        report["quarantined"],
        serde_json::json!([format!("sha256:{hex}")])
    );
    assert_eq!(http.get(&url).send().await.unwrap().status(), 404);
    server.stop().await;
}

#[tokio::test]
async fn verify_quarantines_corrupt_blobs_and_their_images_are_never_handed_out() {
    let server = TestServer::start().await;
    let kernel = b"a kernel that will rot".to_vec();
    let hex = publish_kernel(&server, &kernel).await;
    let clean = server.post_json("/api/v1/blobs/verify").await;
    assert_eq!(clean["checked"], 2);
    assert_eq!(clean["quarantined"], serde_json::json!([]));

    std::fs::write(server.blob_dir().join(&hex), b"a kernel that has rotted").unwrap();
    let report: serde_json::Value = server.post_json("/api/v1/blobs/verify").await;
    let digest = format!("sha256:{hex}");
    assert_eq!(report["quarantined"], serde_json::json!([digest]));
    assert_eq!(report["missing"], serde_json::json!([digest]));
    let r = reqwest::get(server.url(&format!("/blobs/sha256/{hex}")))
        .await
        .unwrap();
    assert_eq!(r.status(), 404, "a quarantined blob is never served");
    assert!(
        server
            .data
            .path()
            .join("quarantine/sha256")
            .join(&hex)
            .exists()
    );

    // The image is broken: listed so, an event says so, and no node is handed it.
    let (_, images) = server.json("/api/v1/images").await;
    let broken = images[0]["broken"].as_str().unwrap_or_default().to_string();
    assert!(
        broken.contains("quarantined") && broken.contains(&hex),
        "{images}"
    );
    let (_, page) = server.json("/api/v1/events").await;
    let kinds: Vec<&str> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == "image.broken").count(),
        1,
        "{page}"
    );
    // A second verify finds the same: no second event.
    server.post_json("/api/v1/blobs/verify").await;
    let (_, page) = server.json("/api/v1/events").await;
    assert_eq!(page["events"].as_array().unwrap().len(), kinds.len());
    server.assign("52:54:00:00:00:0b", "n:1").await;
    let node_script = || async {
        reqwest::get(server.url("/boot/node.ipxe?mac=52-54-00-00-00-0b"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let script = node_script().await;
    assert!(
        script.contains("is broken") && !script.contains("\nkernel "),
        "{script}"
    );

    // Publishing the image again restores the blob, and the image.
    let (status, _) = server.publish(good_bundle("n", "1", &kernel)).await;
    assert_eq!(status, 200);
    let (_, images) = server.json("/api/v1/images").await;
    assert!(images[0].get("broken").is_none(), "{images}");
    let script = node_script().await;
    assert!(script.contains("\nkernel "), "{script}");
    let r = reqwest::get(server.url(&format!("/blobs/sha256/{hex}")))
        .await
        .unwrap();
    assert_eq!(r.bytes().await.unwrap().as_ref(), kernel.as_slice());
    let report: serde_json::Value = server.post_json("/api/v1/blobs/verify").await;
    assert_eq!(report["missing"], serde_json::json!([]));
    server.stop().await;
}

#[tokio::test]
async fn gc_removes_only_unreferenced_blobs() {
    let server = TestServer::start().await;
    let hex = publish_kernel(&server, b"kept kernel").await;
    let orphan = b"nobody needs me";
    let orphan_hex = Digest::of(orphan).hex();
    std::fs::write(server.blob_dir().join(&orphan_hex), orphan).unwrap();
    // Served (a small blob: read once and kept in memory), a range of it too.
    let http = bootfleet::http_client::builder().build().unwrap();
    let url = server.url(&format!("/blobs/sha256/{orphan_hex}"));
    let r = http.get(&url).send().await.unwrap();
    assert_eq!(r.bytes().await.unwrap().as_ref(), orphan);
    let r = http
        .get(&url)
        .header("range", "bytes=5-8")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    assert_eq!(r.bytes().await.unwrap().as_ref(), &orphan[5..9]);
    let report: serde_json::Value = server.post_json("/api/v1/blobs/gc").await;
    assert_eq!(
        report["removed"],
        serde_json::json!([format!("sha256:{orphan_hex}")])
    );
    assert_eq!(report["bytes_freed"], orphan.len());
    assert!(server.blob_dir().join(&hex).exists());
    assert_eq!(server.blob_dir_entries().len(), 2);
    let r = http.get(&url).send().await.unwrap();
    assert_eq!(
        r.status(),
        404,
        "collected, though its bytes were kept in memory"
    );
    server.stop().await;
}

#[tokio::test]
async fn gc_during_publishes_never_loses_a_blob() {
    let server = TestServer::start().await;
    let mut publishes = Vec::new();
    for i in 0..8u64 {
        let bundle = good_bundle("n", &format!("{i}"), &noise(200_000, 100 + i));
        let req = server.post("/api/v1/images").body(bundle);
        publishes.push(tokio::spawn(async move {
            let r = req.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }));
    }
    for _ in 0..20 {
        let r = server.post("/api/v1/blobs/gc").send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    for p in publishes {
        let (status, body) = p.await.unwrap();
        assert_eq!(status, 201, "{body}");
    }
    let report: serde_json::Value = server.post_json("/api/v1/blobs/verify").await;
    assert_eq!(report["missing"], serde_json::json!([]), "{report}");
    assert_eq!(report["checked"], 9, "8 kernels and one shared initrd");
    server.stop().await;
}

/// UEFI HTTP boot fetches the iPXE binary over HTTP from the TFTP root, by checked name.
#[tokio::test]
async fn ipxe_binaries_are_served_over_http_and_names_cannot_escape() {
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("snponly.efi"), b"MZ efi bytes").unwrap();
    let dir = root.path().to_path_buf();
    let server = TestServer::start_configured(|cfg| cfg.ipxe_dir = dir).await;
    let r = reqwest::get(server.url("/ipxe/snponly.efi")).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/efi");
    assert_eq!(r.bytes().await.unwrap().as_ref(), b"MZ efi bytes");
    assert_eq!(
        reqwest::get(server.url("/ipxe/ipxe.efi"))
            .await
            .unwrap()
            .status(),
        404
    );
    for bad in [
        "/ipxe/..%2Fadmin.token",
        "/ipxe/a/..%2F..%2Fbootfleet.db",
        "/ipxe/%5Cx",
    ] {
        let status = reqwest::get(server.url(bad)).await.unwrap().status();
        assert_eq!(status, 400, "{bad}");
    }
    server.stop().await;
}

/// Blob bodies go out with sendfile on plain connections, under hyper: what the client
/// reads must still be exactly the response stream hyper meant, in order. Three
/// keep-alive requests written at once (headers of the next must not overtake a body),
/// a client that reads slowly (the socket fills, sendfile stops short and resumes), and
/// concurrent downloads of overlapping ranges of one blob.
#[tokio::test]
async fn blob_bodies_sent_from_the_file_arrive_whole_and_in_order() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = TestServer::start().await;
    let kernel = noise((5 << 20) + 123, 77);
    let hex = publish_kernel(&server, &kernel).await;
    let path = format!("/blobs/sha256/{hex}");

    // Pipelined on one connection, read slowly: whole blob, a range across a slot
    // boundary, then a small non-blob answer.
    let mut tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let host = server.addr;
    let start = (2 << 20) - 7;
    let requests = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n\
         GET {path} HTTP/1.1\r\nHost: {host}\r\nRange: bytes={start}-{}\r\n\r\n\
         GET /healthz HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n",
        start + 1_500_000
    );
    tcp.write_all(requests.as_bytes()).await.unwrap();
    // Nothing read for a while: the server's sends stop on a full socket.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = tcp.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
        if got.len() < 2 << 20 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }
    let mut rest = &got[..];
    let mut bodies = Vec::new();
    for _ in 0..3 {
        let end = rest
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a response head");
        let head = std::str::from_utf8(&rest[..end])
            .unwrap()
            .to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .expect("a content-length")
            .parse()
            .unwrap();
        let body = &rest[end + 4..end + 4 + len];
        bodies.push((head.lines().next().unwrap().to_string(), body.to_vec()));
        rest = &rest[end + 4 + len..];
    }
    assert!(
        rest.is_empty(),
        "{} bytes after the last response",
        rest.len()
    );
    assert_eq!(bodies[0].0, "http/1.1 200 ok");
    assert!(bodies[0].1 == kernel, "the whole blob, byte for byte");
    assert_eq!(bodies[1].0, "http/1.1 206 partial content");
    assert!(
        bodies[1].1 == kernel[start..=start + 1_500_000],
        "the range"
    );
    assert_eq!(bodies[2].0, "http/1.1 200 ok");

    // Concurrent ranged downloads of the same blob, each checked.
    let http = bootfleet::http_client::builder().build().unwrap();
    let url = server.url(&path);
    let downloads = (0..12).map(|i| {
        let (http, url) = (http.clone(), url.clone());
        let from = i * 400_000 + i;
        async move {
            let r = http
                .get(&url)
                .header("range", format!("bytes={from}-"))
                .send()
                .await
                .unwrap();
            (from, r.bytes().await.unwrap())
        }
    });
    for (from, body) in futures_util::future::join_all(downloads).await {
        assert!(body[..] == kernel[from..], "range from {from}");
    }
    server.stop().await;
}
