//! Hostile and broken bundles: each is refused with a clear reason, nothing of it remains,
//! and the server keeps serving.

use tar::EntryType;

use crate::harness::*;

/// Publishes `bundle`, expects `status` with `needle` in the reason, then checks the store
/// is untouched and the server still publishes a good bundle.
async fn refused(bundle: Vec<u8>, status: u16, needle: &str) {
    let server = TestServer::start().await;
    let (got, body) = server.publish(bundle).await;
    let reason = body["error"].as_str().unwrap_or_default().to_string();
    assert_eq!(got, status, "status for {needle:?}: {body}");
    assert!(reason.contains(needle), "expected {needle:?} in {reason:?}");
    server.assert_empty().await;
    let (ok, body) = server.publish(good_bundle("n", "1", b"k")).await;
    assert_eq!(ok, 201, "server still publishes after a refusal: {body}");
    server.stop().await;
}

fn with(extra: Entry) -> Vec<u8> {
    let mut entries = good_entries("n", "1", b"kernel");
    entries.push(extra);
    tar_of(&entries)
}

#[tokio::test]
async fn parent_dir_path() {
    refused(with(file("../escape", b"x")), 400, "'..' is not allowed").await;
}

#[tokio::test]
async fn nested_parent_dir_path() {
    refused(
        with(file("a/../../escape", b"x")),
        400,
        "'..' is not allowed",
    )
    .await;
}

#[tokio::test]
async fn absolute_path() {
    refused(with(file("/etc/cron.d/x", b"x")), 400, "absolute paths").await;
}

#[tokio::test]
async fn symlink() {
    refused(
        with(special("link", EntryType::Symlink, Some("/etc/passwd"))),
        400,
        "symbolic links",
    )
    .await;
}

#[tokio::test]
async fn hard_link() {
    refused(
        with(special("hard", EntryType::Link, Some("vmlinuz"))),
        400,
        "hard links",
    )
    .await;
}

#[tokio::test]
async fn char_device() {
    refused(
        with(special("dev", EntryType::Char, None)),
        400,
        "device files",
    )
    .await;
}

#[tokio::test]
async fn block_device() {
    refused(
        with(special("blk", EntryType::Block, None)),
        400,
        "device files",
    )
    .await;
}

#[tokio::test]
async fn fifo() {
    refused(with(special("pipe", EntryType::Fifo, None)), 400, "FIFOs").await;
}

#[tokio::test]
async fn duplicate_name() {
    refused(with(file("vmlinuz", b"other")), 400, "duplicate name").await;
}

#[tokio::test]
async fn duplicate_after_normalisation() {
    refused(with(file("./initrd.img", b"other")), 400, "duplicate name").await;
}

#[tokio::test]
async fn duplicate_manifest() {
    refused(with(file("manifest.toml", b"x")), 400, "duplicate name").await;
}

#[tokio::test]
async fn missing_artifact() {
    let entries = vec![
        file("manifest.toml", manifest("n", "1").as_bytes()),
        file("vmlinuz", b"k"),
    ];
    refused(tar_of(&entries), 400, "boot.initrds \"initrd.img\"").await;
}

#[tokio::test]
async fn unreferenced_artifact() {
    refused(
        with(file("notes.txt", b"x")),
        400,
        "\"notes.txt\" is not named by the manifest",
    )
    .await;
}

#[tokio::test]
async fn no_manifest() {
    refused(tar_of(&[file("vmlinuz", b"k")]), 400, "no manifest.toml").await;
}

#[tokio::test]
async fn toml_error_names_line_and_column() {
    let entries = vec![
        file(
            "manifest.toml",
            b"name = \"n\"\nversion = \"1\"\n[boot\nkernel = \"vmlinuz\"\n",
        ),
        file("vmlinuz", b"k"),
    ];
    refused(tar_of(&entries), 400, "line 3, column").await;
}

#[tokio::test]
async fn invalid_manifest_value() {
    let text = manifest("n", "1").replace("\"550.127.05\"", "550");
    let entries = vec![
        file("manifest.toml", text.as_bytes()),
        file("vmlinuz", b"k"),
        file("initrd.img", b"i"),
    ];
    refused(tar_of(&entries), 400, "invalid type").await;
}

#[tokio::test]
async fn entry_over_the_size_limit() {
    let server = TestServer::start_with(bootfleet::image::bundle::BundleLimits {
        max_artifact_bytes: 1000,
        ..Default::default()
    })
    .await;
    let (status, body) = server.publish(good_bundle("n", "1", &noise(5000, 1))).await;
    assert_eq!(status, 413, "{body}");
    let reason = body["error"].as_str().unwrap();
    assert!(
        reason.contains("5000 bytes, over the limit of 1000"),
        "{reason}"
    );
    server.assert_empty().await;
    server.stop().await;
}

#[tokio::test]
async fn truncated_tar() {
    let bundle = good_bundle("n", "1", &noise(100_000, 2));
    refused(bundle[..60_000].to_vec(), 400, "bundle").await;
}

#[tokio::test]
async fn truncated_gzip() {
    let bundle = gzip(&good_bundle("n", "1", &noise(100_000, 3)));
    let cut = bundle.len() - 20;
    refused(bundle[..cut].to_vec(), 400, "not a readable archive").await;
}

#[tokio::test]
async fn corrupt_gzip() {
    let mut bundle = gzip(&good_bundle("n", "1", &noise(100_000, 4)));
    let middle = bundle.len() / 2;
    bundle[middle] ^= 0xff;
    refused(bundle, 400, "not a readable archive").await;
}

#[tokio::test]
async fn gzip_with_bad_checksum_only() {
    // The tar ends before the gzip trailer: only reading to the true end catches this.
    let mut bundle = gzip(&good_bundle("n", "1", b"kernel"));
    let crc_at = bundle.len() - 8;
    bundle[crc_at] ^= 0xff;
    refused(bundle, 400, "not a readable archive").await;
}

#[tokio::test]
async fn truncated_zstd() {
    let bundle = zstd(&good_bundle("n", "1", &noise(100_000, 5)));
    let cut = bundle.len() / 2;
    refused(bundle[..cut].to_vec(), 400, "not a readable archive").await;
}

#[tokio::test]
async fn garbage() {
    refused(noise(4096, 6), 400, "bundle refused").await;
}

#[tokio::test]
async fn empty_body() {
    refused(Vec::new(), 400, "no manifest.toml").await;
}

#[tokio::test]
async fn client_disconnects_mid_upload() {
    use tokio::io::AsyncWriteExt;
    let server = TestServer::start().await;
    let bundle = good_bundle("n", "1", &noise(4 << 20, 7));
    let mut tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let head = format!(
        "POST /api/v1/images HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\n\r\n",
        server.token,
        bundle.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp.write_all(&bundle[..bundle.len() / 2]).await.unwrap();
    tcp.flush().await.unwrap();
    // Let the server start staging the kernel, then vanish.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    drop(tcp);
    let mut waited = 0;
    while !server.blob_dir_entries().is_empty() && waited < 100 {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        waited += 1;
    }
    server.assert_empty().await;
    let (ok, body) = server.publish(good_bundle("n", "1", b"k")).await;
    assert_eq!(ok, 201, "{body}");
    server.stop().await;
}

/// A manifest whose `[validation]` or `[pins]` does not follow the schema is refused whole
/// at publish, naming the line and the valid keys: it is never read as the defaults (a
/// `gpus = "eight"` image once let a node with no GPUs become ready).
#[tokio::test]
async fn validation_and_pins_follow_their_schema() {
    for (from, to, needle) in [
        ("gpus = 8", "gpus = \"eight\"", "line 14"),
        ("gpus = 8", "gpus = \"eight\"", "invalid type"),
        (
            "gpu-model",
            "gpu_model",
            "unknown field `gpu_model`, expected one of",
        ),
        (
            "nvidia-driver",
            "nvidia_driver",
            "unknown field `nvidia_driver`",
        ),
        ("nvidia-driver", "dcgm", "unknown field `dcgm`"),
    ] {
        let mut entries = good_entries("n", "1", b"kernel");
        let text = manifest("n", "1").replace(from, to);
        entries[0] = file("manifest.toml", text.as_bytes());
        refused(tar_of(&entries), 400, needle).await;
    }
}

/// A zstd bundle whose GNU long-name header declares 256 MiB of zeros: a few KB on the
/// wire. Refused at the header, before the name is read; the answer stays small.
#[tokio::test]
async fn a_long_name_header_bomb_is_refused_before_it_is_read() {
    use std::io::Write as _;
    let declared: u64 = 256 << 20;
    let mut header = tar::Header::new_gnu();
    header.as_gnu_mut().unwrap().name[..13].copy_from_slice(b"././@LongLink");
    header.set_entry_type(EntryType::GNULongName);
    header.set_size(declared);
    header.set_mode(0o644);
    header.set_cksum();
    let mut enc = zstd::stream::Encoder::new(Vec::new(), 3).unwrap();
    enc.write_all(header.as_bytes()).unwrap();
    let zeros = vec![b'a'; 1 << 20];
    for _ in 0..(declared >> 20) {
        enc.write_all(&zeros).unwrap();
    }
    enc.write_all(&good_bundle("n", "1", b"k")).unwrap();
    let bundle = enc.finish().unwrap();
    assert!(bundle.len() < 100_000, "{}", bundle.len());
    let server = TestServer::start().await;
    let r = server
        .post("/api/v1/images")
        .body(bundle)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let text = r.text().await.unwrap();
    assert!(text.len() < 4096, "{} bytes of answer", text.len());
    assert!(text.contains("extension header declares"), "{text}");
    server.assert_empty().await;
    server.stop().await;
}

/// A bad manifest in front of a large artifact is refused when the manifest is read,
/// without waiting for (or writing) the rest: the body here never finishes.
#[tokio::test]
async fn a_bad_manifest_is_refused_before_the_artifacts_behind_it() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = TestServer::start().await;
    let mut entries = good_entries("n", "1", &noise(1 << 20, 9));
    entries[0].data = b"name = \"n\"\nversion = \"1\"\n[boot]\nkernel = 7\n".to_vec();
    let prefix = tar_of(&entries[..1]);
    let mut tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let head = format!(
        "POST /api/v1/images HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\n\r\n",
        server.token,
        1u64 << 40
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp.write_all(&prefix).await.unwrap();
    // An artifact header declaring 1 GiB, and a little of it.
    let mut artifact = tar::Header::new_old();
    artifact.as_old_mut().name[..7].copy_from_slice(b"vmlinuz");
    artifact.set_size(1 << 30);
    artifact.set_cksum();
    tcp.write_all(artifact.as_bytes()).await.unwrap();
    tcp.write_all(&noise(64 << 10, 3)).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(std::time::Duration::from_secs(20), tcp.read(&mut answer))
        .await
        .expect("answered while the body was still coming")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    drop(tcp);
    server.assert_empty().await;
    server.stop().await;
}

/// An entry the manifest does not name is refused at its header, before it is written.
#[tokio::test]
async fn an_entry_after_the_manifest_that_it_does_not_name_is_refused() {
    refused(
        with(file("extra.bin", &noise(10_000, 5))),
        400,
        "not named by the manifest",
    )
    .await;
}

/// Artifacts are bounded together, and by the free space they must leave.
#[tokio::test]
async fn a_bundle_is_bounded_in_total_and_by_free_space() {
    let server = TestServer::start_with(bootfleet::image::bundle::BundleLimits {
        max_bundle_bytes: 50_000,
        ..Default::default()
    })
    .await;
    let (status, body) = server
        .publish(good_bundle("n", "1", &noise(60_000, 1)))
        .await;
    assert_eq!(status, 413, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("max_bundle_bytes"),
        "{body}"
    );
    server.assert_empty().await;
    server.stop().await;
    let server = TestServer::start_with(bootfleet::image::bundle::BundleLimits {
        min_free_bytes: u64::MAX / 2,
        ..Default::default()
    })
    .await;
    let (status, body) = server.publish(good_bundle("n", "1", b"k")).await;
    assert_eq!(status, 507, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("bytes free"),
        "{body}"
    );
    server.assert_empty().await;
    server.stop().await;
}
