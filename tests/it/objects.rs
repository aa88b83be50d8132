//! Blobs on a real S3 server (`s3s-fs`): published through one server and served by
//! another, each blob verified before it is ever served from a server's cache; a damaged
//! object is refused; the object store going away costs only what no cache holds, with
//! 503 and Retry-After, and recovery when it returns; the cache stays under its bound,
//! evicting the least recently served; TFTP fills from it as HTTP does; blobs larger
//! than a part go up in parts; `image gc` removes objects no image needs once they are
//! older than the grace; the object store may be HTTPS with a private CA.

use crate::harness::{TestServer, good_bundle, noise};

/// The digest of `name:version`'s kernel, as the server lists it.
pub(crate) async fn kernel_digest(server: &TestServer, reference: &str) -> String {
    let (status, image) = server.json(&format!("/api/v1/images/{reference}")).await;
    assert_eq!(status, 200, "{image}");
    image["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["role"] == "kernel")
        .unwrap()["digest"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The bucket a `[blobs]` config names.
fn bucket_of(blobs: &bootfleet::image::objects::ObjectsConfig) -> String {
    let rest = blobs.url.as_deref().unwrap().strip_prefix("s3://").unwrap();
    rest.split('/').next().unwrap().to_string()
}

fn blob_url(digest: &str) -> String {
    format!("/blobs/sha256/{}", digest.strip_prefix("sha256:").unwrap())
}

async fn get_blob(server: &TestServer, digest: &str) -> reqwest::Response {
    server.get(&blob_url(digest)).send().await.unwrap()
}

fn drop_from_cache(server: &TestServer, digest: &str) {
    let path = server
        .blob_dir()
        .join(digest.strip_prefix("sha256:").unwrap());
    std::fs::remove_file(path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_image_published_through_one_server_boots_through_another() {
    let s3 = crate::s3::shared();
    let creds = tempfile::tempdir().unwrap();
    let blobs = s3.config(creds.path());
    let bucket = bucket_of(&blobs);
    let url = crate::pg::database().await;
    let (servers, _shared) =
        crate::servers::cluster(2, &url, |cfg| cfg.blobs = blobs.clone()).await;
    let (a, b) = (&servers[0], &servers[1]);
    let kernel = noise(3 << 20, 7);
    let (status, published) = a
        .publish_query(good_bundle("demo", "1", &kernel), "?tag=demo:stable")
        .await;
    assert_eq!(status, 201);
    let digest = kernel_digest(b, "demo:stable").await;
    assert!(
        s3.object_path(&bucket, &digest).is_file(),
        "the object store holds it"
    );
    assert!(
        !b.blob_dir().join(&digest[7..]).exists(),
        "b has not served it yet"
    );
    // Many nodes at once ask b for a blob it does not hold: one fill, every one served.
    let gets = (0..8).map(|_| async { get_blob(b, &digest).await });
    for r in futures_util::future::join_all(gets).await {
        assert_eq!(r.status(), 200);
        assert_eq!(r.bytes().await.unwrap().as_ref(), kernel.as_slice());
    }
    assert!(
        b.blob_dir().join(&digest[7..]).is_file(),
        "b's cache holds it"
    );
    assert!(
        b.blob_dir_entries().iter().all(|n| !n.starts_with(".tmp")),
        "no temp left: {:?}",
        b.blob_dir_entries()
    );
    // Assigned through a, a node boots through b to ready: script, blobs, attestation,
    // validation; a sees it ready.
    let mac = "52-54-00-40-00-01";
    a.assign(mac, "demo:stable").await;
    crate::fake_node::FakeNode::new(b, mac)
        .boot_to_ready(&published)
        .await;
    let (_, node) = a.json(&format!("/api/v1/nodes/{mac}")).await;
    assert_eq!(node["state"], "ready", "{node}");
    for s in servers {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_object_is_never_served() {
    let s3 = crate::s3::shared();
    let creds = tempfile::tempdir().unwrap();
    let blobs = s3.config(creds.path());
    let bucket = bucket_of(&blobs);
    let server = TestServer::start_configured(|cfg| cfg.blobs = blobs.clone()).await;
    let kernel = noise(1 << 20, 8);
    let (status, _) = server
        .publish_query(good_bundle("demo", "1", &kernel), "?tag=demo:stable")
        .await;
    assert_eq!(status, 201);
    let digest = kernel_digest(&server, "demo:stable").await;
    drop_from_cache(&server, &digest);
    // Someone flips bytes in the bucket: same length, other content.
    let object = s3.object_path(&bucket, &digest);
    let mut damaged = kernel.clone();
    damaged[4096] ^= 0xff;
    std::fs::write(&object, &damaged).unwrap();
    let r = get_blob(&server, &digest).await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "5");
    let body = r.text().await.unwrap();
    assert!(body.contains("damaged"), "{body}");
    assert!(
        server
            .blob_dir_entries()
            .iter()
            .all(|n| !n.contains(&digest[7..]) && !n.starts_with(".tmp")),
        "nothing of it kept: {:?}",
        server.blob_dir_entries()
    );
    // verify re-hashes the bucket's copies and names the damaged one.
    let report = server.post_json("/api/v1/blobs/verify").await;
    assert_eq!(
        report["damaged_objects"],
        serde_json::json!([digest]),
        "{report}"
    );
    assert_eq!(report["missing"], serde_json::json!([]), "{report}");
    // Repaired in the bucket: served again.
    std::fs::write(&object, &kernel).unwrap();
    let r = get_blob(&server, &digest).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.bytes().await.unwrap().as_ref(), kernel.as_slice());
    let report = server.post_json("/api/v1/blobs/verify").await;
    assert_eq!(report["damaged_objects"], serde_json::json!([]), "{report}");
    // An object gone from the bucket is named missing, though the cache holds it.
    std::fs::remove_file(&object).unwrap();
    let report = server.post_json("/api/v1/blobs/verify").await;
    assert_eq!(report["missing"], serde_json::json!([digest]), "{report}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_object_store_going_away_costs_only_what_no_cache_holds() {
    let s3 = crate::s3::start();
    let creds = tempfile::tempdir().unwrap();
    let blobs = s3.config(creds.path());
    let server = TestServer::start_configured(|cfg| cfg.blobs = blobs.clone()).await;
    let (one, two) = (noise(1 << 20, 9), noise(1 << 20, 10));
    for (version, kernel) in [("1", &one), ("2", &two)] {
        let (status, _) = server.publish(good_bundle("demo", version, kernel)).await;
        assert_eq!(status, 201);
    }
    let cached = kernel_digest(&server, "demo:1").await;
    let uncached = kernel_digest(&server, "demo:2").await;
    drop_from_cache(&server, &uncached);

    s3.kill();
    let r = get_blob(&server, &cached).await;
    assert_eq!(r.status(), 200, "what the cache holds is served");
    assert_eq!(r.bytes().await.unwrap().as_ref(), one.as_slice());
    let r = get_blob(&server, &uncached).await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "5");
    assert!(r.text().await.unwrap().contains("unreachable"));
    // A publish cannot reach the object store: refused, and no image row is written.
    let (status, body) = server
        .publish(good_bundle("demo", "3", &noise(4096, 11)))
        .await;
    assert_eq!(status, 503, "{body}");
    let (_, images) = server.json("/api/v1/images").await;
    assert_eq!(images.as_array().unwrap().len(), 2);

    s3.restart();
    let r = get_blob(&server, &uncached).await;
    assert_eq!(r.status(), 200, "recovered once the object store is back");
    assert_eq!(r.bytes().await.unwrap().as_ref(), two.as_slice());
    server.stop().await;
}

/// Each cached kernel's size; the cache holds two and a half of them.
const CACHED: usize = 256 << 10;

/// A server whose cache holds 2.5 kernels, with `n` images published through it (their
/// kernels' digests) and its cache emptied.
async fn server_with_a_small_cache(
    n: u64,
    seed: u64,
) -> (
    TestServer,
    Vec<String>,
    bootfleet::image::objects::ObjectsConfig,
    tempfile::TempDir,
) {
    let s3 = crate::s3::shared();
    let creds = tempfile::tempdir().unwrap();
    let mut blobs = s3.config(creds.path());
    blobs.cache_max_bytes = Some((CACHED * 2 + CACHED / 2) as u64);
    let server = TestServer::start_configured(|cfg| cfg.blobs = blobs.clone()).await;
    let mut digests = Vec::new();
    for i in 0..n {
        let (status, _) = server
            .publish(good_bundle(
                "demo",
                &i.to_string(),
                &noise(CACHED, seed + i),
            ))
            .await;
        assert_eq!(status, 201);
        digests.push(kernel_digest(&server, &format!("demo:{i}")).await);
    }
    for name in server.blob_dir_entries() {
        std::fs::remove_file(server.blob_dir().join(name)).unwrap();
    }
    (server, digests, blobs, creds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_stays_under_its_bound() {
    let (server, digests, blobs, _creds) = server_with_a_small_cache(4, 20).await;
    for d in &digests {
        assert_eq!(get_blob(&server, d).await.status(), 200);
        // Distinct fill times for the eviction order (mtime).
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let held: u64 = server
        .blob_dir_entries()
        .iter()
        .map(|n| std::fs::metadata(server.blob_dir().join(n)).unwrap().len())
        .sum();
    assert!(held <= blobs.cache_max_bytes.unwrap(), "{held} bytes held");
    assert!(
        server.blob_dir().join(&digests[3][7..]).is_file(),
        "the newest stays"
    );
    assert!(
        !server.blob_dir().join(&digests[0][7..]).exists(),
        "the oldest went"
    );
    // An evicted blob is filled again on demand.
    assert_eq!(get_blob(&server, &digests[0]).await.status(), 200);
    server.stop().await;
}

/// Sets a cached blob's mtime `secs` into the past (as if filled or served then).
fn age(server: &TestServer, digest: &str, secs: u64) {
    let file = std::fs::File::open(server.blob_dir().join(&digest[7..])).unwrap();
    file.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(secs))
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_evicts_the_least_recently_served() {
    let (server, digests, _blobs, _creds) = server_with_a_small_cache(3, 40).await;
    for d in &digests[..2] {
        assert_eq!(get_blob(&server, d).await.status(), 200);
    }
    // Blob 0 was filled first but is served again after blob 1: it stays, 1 goes.
    age(&server, &digests[0], 300);
    age(&server, &digests[1], 200);
    assert_eq!(get_blob(&server, &digests[0]).await.status(), 200);
    assert_eq!(get_blob(&server, &digests[2]).await.status(), 200);
    let held = |d: &String| server.blob_dir().join(&d[7..]).is_file();
    assert!(held(&digests[0]), "served last-but-one: kept");
    assert!(!held(&digests[1]), "served longest ago: evicted");
    assert!(held(&digests[2]), "the newest fill stays");
    server.stop().await;
}

/// A free UDP port on loopback for a server's TFTP.
fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `curl tftp://...`: the file's bytes, or curl's complaint.
async fn tftp_get(port: u16, name: &str) -> Result<Vec<u8>, String> {
    let out = tokio::process::Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "20",
            &format!("tftp://127.0.0.1:{port}/{name}"),
        ])
        .output()
        .await
        .expect("curl (the test command installs it)");
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tftp_fills_a_blob_from_the_object_store_and_never_serves_a_damaged_one() {
    let s3 = crate::s3::start();
    let creds = tempfile::tempdir().unwrap();
    let blobs = s3.config(creds.path());
    let bucket = bucket_of(&blobs);
    let port = free_udp_port();
    let server = TestServer::start_configured(|cfg| {
        cfg.blobs = blobs.clone();
        cfg.tftp_listen = Some(format!("127.0.0.1:{port}").parse().unwrap());
    })
    .await;
    let kernel = noise(700 << 10, 12);
    let (status, _) = server.publish(good_bundle("demo", "1", &kernel)).await;
    assert_eq!(status, 201);
    let digest = kernel_digest(&server, "demo:1").await;
    let name = blob_url(&digest)[1..].to_string();
    drop_from_cache(&server, &digest);
    // GRUB's names carry the boot: `?boot=` is split off before the blob is looked up.
    let got = tftp_get(port, &format!("{name}?boot=nonesuch"))
        .await
        .unwrap();
    assert!(
        got == kernel,
        "TFTP served the object store's bytes after filling"
    );
    assert!(
        server.blob_dir().join(&digest[7..]).is_file(),
        "now in the cache"
    );

    drop_from_cache(&server, &digest);
    let object = s3.object_path(&bucket, &digest);
    let mut damaged = kernel.clone();
    damaged[100] ^= 1;
    std::fs::write(&object, &damaged).unwrap();
    let e = tftp_get(port, &name).await.unwrap_err();
    assert!(
        !server.blob_dir().join(&digest[7..]).exists(),
        "not kept: {e}"
    );

    std::fs::write(&object, &kernel).unwrap();
    s3.kill();
    let e = tftp_get(port, &name).await.unwrap_err();
    assert!(!e.is_empty(), "the object store away: the transfer fails");
    s3.restart();
    assert!(tftp_get(port, &name).await.unwrap() == kernel, "recovered");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_larger_than_a_part_goes_up_in_parts() {
    let s3 = crate::s3::shared();
    let creds = tempfile::tempdir().unwrap();
    let mut blobs = s3.config(creds.path());
    blobs.part_bytes = Some(5 << 20);
    let bucket = bucket_of(&blobs);
    let server = TestServer::start_configured(|cfg| cfg.blobs = blobs.clone()).await;
    // Three parts: two whole, one short.
    let kernel = noise((11 << 20) + 3, 13);
    let (status, body) = server.publish(good_bundle("demo", "1", &kernel)).await;
    assert_eq!(status, 201, "{body}");
    let digest = kernel_digest(&server, "demo:1").await;
    let object = std::fs::read(s3.object_path(&bucket, &digest)).unwrap();
    assert!(object == kernel, "the parts make the blob, in order");
    let etag = s3.etag(&bucket, &digest).await;
    assert!(
        etag.ends_with("-3\""),
        "uploaded in three parts: ETag {etag}"
    );
    drop_from_cache(&server, &digest);
    let r = get_blob(&server, &digest).await;
    assert_eq!(r.status(), 200);
    assert!(r.bytes().await.unwrap().as_ref() == kernel.as_slice());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_removes_the_objects_no_image_needs_once_past_the_grace() {
    let s3 = crate::s3::shared();
    let creds = tempfile::tempdir().unwrap();
    let mut blobs = s3.config(creds.path());
    blobs.gc_grace_secs = Some(0);
    let bucket = bucket_of(&blobs);
    let server = TestServer::start_configured(|cfg| cfg.blobs = blobs.clone()).await;
    let (one, two) = (noise(300 << 10, 14), noise(300 << 10, 15));
    for (version, kernel) in [("1", &one), ("2", &two)] {
        let (status, _) = server.publish(good_bundle("demo", version, kernel)).await;
        assert_eq!(status, 201);
    }
    let gone = kernel_digest(&server, "demo:1").await;
    let kept = kernel_digest(&server, "demo:2").await;
    let r = server.delete("/api/v1/images/demo:1").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let report = server.post_json("/api/v1/blobs/gc").await;
    let removed: Vec<&str> = report["objects_removed"]
        .as_array()
        .unwrap_or_else(|| panic!("{report}"))
        .iter()
        .map(|d| d.as_str().unwrap())
        .collect();
    assert!(removed.contains(&gone.as_str()), "{report}");
    assert!(!removed.contains(&kept.as_str()), "{report}");
    assert!(
        report["object_bytes_freed"].as_u64().unwrap() >= 300 << 10,
        "{report}"
    );
    assert!(
        !s3.object_path(&bucket, &gone).exists(),
        "its object is gone"
    );
    assert!(s3.object_path(&bucket, &kept).exists(), "the other stays");
    let report = server.post_json("/api/v1/blobs/verify").await;
    assert_eq!(report["missing"], serde_json::json!([]), "{report}");
    let (_, page) = server.json("/api/v1/events?limit=1000").await;
    let collected = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "blobs.collected")
        .unwrap_or_else(|| panic!("no blobs.collected event: {page}"));
    assert!(
        collected["data"]["objects_removed"].as_u64() >= Some(1),
        "{collected}"
    );
    server.stop().await;

    // With the default grace (a day), a fresh object is kept though nothing needs it:
    // another server's publish may have uploaded it and not yet written its row.
    let creds = tempfile::tempdir().unwrap();
    let blobs = s3.config(creds.path());
    let bucket = bucket_of(&blobs);
    let server = TestServer::start_configured(|cfg| cfg.blobs = blobs.clone()).await;
    let (status, _) = server.publish(good_bundle("demo", "3", &one)).await;
    assert_eq!(status, 201);
    let r = server.delete("/api/v1/images/demo:3").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let report = server.post_json("/api/v1/blobs/gc").await;
    assert_eq!(report["objects_removed"], serde_json::json!([]), "{report}");
    assert!(s3.object_path(&bucket, &gone).exists(), "young: kept");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_object_store_may_be_https_with_a_private_ca() {
    let s3 = crate::s3::shared();
    let front = s3.tls_front();
    let creds = tempfile::tempdir().unwrap();
    let mut blobs = s3.config(creds.path());
    blobs.endpoint = Some(front.endpoint.clone());
    blobs.ca_file = Some(front.ca_file.clone());
    let server = TestServer::start_configured(|cfg| cfg.blobs = blobs.clone()).await;
    let kernel = noise(1 << 20, 16);
    let (status, body) = server.publish(good_bundle("demo", "1", &kernel)).await;
    assert_eq!(status, 201, "{body}");
    let digest = kernel_digest(&server, "demo:1").await;
    drop_from_cache(&server, &digest);
    let r = get_blob(&server, &digest).await;
    assert_eq!(r.status(), 200);
    assert!(r.bytes().await.unwrap().as_ref() == kernel.as_slice());
    server.stop().await;

    // Without the CA, the front's certificate is not trusted: nothing is published.
    let creds = tempfile::tempdir().unwrap();
    let mut blobs = s3.config(creds.path());
    blobs.endpoint = Some(front.endpoint.clone());
    let server = TestServer::start_configured(|cfg| cfg.blobs = blobs.clone()).await;
    let (status, body) = server
        .publish(good_bundle("demo", "1", &noise(4096, 17)))
        .await;
    assert_ne!(status, 201, "{body}");
    let (_, images) = server.json("/api/v1/images").await;
    assert_eq!(images, serde_json::json!([]));
    server.stop().await;
}
