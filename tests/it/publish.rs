//! Publishing: content addressing, idempotence, immutability, tags and their history.

use crate::harness::*;

#[tokio::test]
async fn same_content_same_digest_whatever_the_packaging() {
    let server = TestServer::start().await;
    let kernel = noise(300_000, 11);
    let plain = good_bundle("gpu-node", "2026.12.0", &kernel);
    let (status, first) = server.publish(plain.clone()).await;
    assert_eq!(status, 201, "{first}");
    assert_eq!(first["created"], true);
    let digest = first["digest"].as_str().unwrap().to_string();
    assert!(digest.starts_with("sha256:") && digest.len() == 71);

    // Reversed order, other mtimes, gzip, zstd, an explicit directory entry, `./` prefixes.
    let mut reordered = good_entries("gpu-node", "2026.12.0", &kernel);
    reordered.reverse();
    for e in &mut reordered {
        e.mtime = 42;
        e.name = format!("./{}", e.name);
    }
    reordered.insert(0, special("./", tar::EntryType::Directory, None));
    for bundle in [
        plain.clone(),
        tar_of(&reordered),
        gzip(&plain),
        zstd(&tar_of(&reordered)),
    ] {
        let (status, again) = server.publish(bundle).await;
        assert_eq!(status, 200, "{again}");
        assert_eq!(again["digest"], digest.as_str());
        assert_eq!(again["created"], false);
    }
    let (_, images) = server.json("/api/v1/images").await;
    assert_eq!(images.as_array().unwrap().len(), 1);
    server.stop().await;
}

#[tokio::test]
async fn any_changed_byte_changes_the_digest_and_a_taken_version_is_refused() {
    let server = TestServer::start().await;
    let (_, first) = server
        .publish(good_bundle("gpu-node", "1.0", b"kernel-a"))
        .await;
    let blobs_before = server.blob_dir_entries();
    let (status, body) = server
        .publish(good_bundle("gpu-node", "1.0", b"kernel-b"))
        .await;
    assert_eq!(status, 409, "{body}");
    let reason = body["error"].as_str().unwrap();
    assert!(
        reason.contains(first["digest"].as_str().unwrap()),
        "{reason}"
    );
    // The refused bundle's digest is named too, and none of its blobs were kept.
    assert!(reason.matches("sha256:").count() == 2, "{reason}");
    assert_eq!(server.blob_dir_entries(), blobs_before);

    let (status, other) = server
        .publish(good_bundle("gpu-node", "1.1", b"kernel-b"))
        .await;
    assert_eq!(status, 201);
    assert_ne!(other["digest"], first["digest"]);
    server.stop().await;
}

#[tokio::test]
async fn shared_artifacts_are_stored_once() {
    let server = TestServer::start().await;
    server.publish(good_bundle("a", "1", b"same kernel")).await;
    server.publish(good_bundle("a", "2", b"same kernel")).await;
    // kernel, initrd: shared by both images.
    assert_eq!(server.blob_dir_entries().len(), 2);
    server.stop().await;
}

#[tokio::test]
async fn show_resolves_every_ref_form() {
    let server = TestServer::start().await;
    let (_, published) = server
        .publish_query(good_bundle("gpu-node", "1.0", b"k"), "?tag=gpu-node:stable")
        .await;
    let digest = published["digest"].as_str().unwrap();
    assert_eq!(published["tag"]["tag"], "gpu-node:stable");
    for r in [digest, "gpu-node:1.0", "gpu-node:stable"] {
        let (status, shown) = server.json(&format!("/api/v1/images/{r}")).await;
        assert_eq!(status, 200, "{r}: {shown}");
        assert_eq!(shown["digest"], digest);
        assert_eq!(shown["artifacts"][0]["role"], "kernel");
        assert_eq!(shown["artifacts"][1]["path"], "initrd.img");
        assert!(
            shown["manifest"]
                .as_str()
                .unwrap()
                .contains("nvidia-driver")
        );
        assert_eq!(shown["tags"], serde_json::json!(["gpu-node:stable"]));
    }
    for (r, status) in [
        ("gpu-node:9.9", 404),
        (&format!("sha256:{}", "0".repeat(64)) as &str, 404),
        ("sha256:1234", 400),
        ("no-colon", 400),
        ("Bad:1", 400),
    ] {
        let (got, body) = server.json(&format!("/api/v1/images/{r}")).await;
        assert_eq!(got, status, "{r}: {body}");
        assert!(!body["error"].as_str().unwrap().is_empty());
    }
    server.stop().await;
}

#[tokio::test]
async fn tags_move_with_history_and_roll_back() {
    let server = TestServer::start().await;
    let (_, v1) = server.publish(good_bundle("gpu-node", "1", b"k1")).await;
    let (_, v2) = server.publish(good_bundle("gpu-node", "2", b"k2")).await;
    let tag = |image: &str| {
        server
            .put("/api/v1/tags/gpu-node/stable")
            .header("x-bootfleet-actor", "alice@ops")
            .json(&serde_json::json!({ "image": image }))
            .send()
    };
    let r = tag("gpu-node:1").await.unwrap();
    assert_eq!(r.status(), 200);
    let r: serde_json::Value = tag("gpu-node:2").await.unwrap().json().await.unwrap();
    assert_eq!(r["from"], v1["digest"]);
    assert_eq!(r["changed"], true);
    // Rollback: tag the previous digest again.
    tag(v1["digest"].as_str().unwrap()).await.unwrap();
    let r: serde_json::Value = tag(v1["digest"].as_str().unwrap())
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["changed"], false, "re-tagging is a no-op");

    let (status, history) = server.json("/api/v1/tags/gpu-node/stable/history").await;
    assert_eq!(status, 200);
    let moves: Vec<(serde_json::Value, serde_json::Value)> = history
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["from"].clone(), m["to"].clone()))
        .collect();
    assert_eq!(
        moves,
        vec![
            (serde_json::Value::Null, v1["digest"].clone()),
            (v1["digest"].clone(), v2["digest"].clone()),
            (v2["digest"].clone(), v1["digest"].clone()),
        ]
    );
    assert_eq!(history[0]["actor"], "admin (alice@ops)");
    assert!(history[0]["at"].as_str().unwrap().starts_with("20"));
    let (_, shown) = server.json("/api/v1/images/gpu-node:stable").await;
    assert_eq!(shown["digest"], v1["digest"]);
    server.stop().await;
}

#[tokio::test]
async fn bad_tags_are_refused_with_reasons() {
    let server = TestServer::start().await;
    server.publish(good_bundle("gpu-node", "1", b"k1")).await;
    server.publish(good_bundle("cpu-node", "1", b"k2")).await;
    let put = |path: &str, image: &str| {
        server
            .put(path)
            .json(&serde_json::json!({ "image": image }))
            .send()
    };
    for (path, image, status, needle) in [
        (
            "/api/v1/tags/gpu-node/stable",
            "cpu-node:1",
            400,
            "an image named \"cpu-node\"",
        ),
        (
            "/api/v1/tags/gpu-node/1",
            "gpu-node:1",
            409,
            "is a published version",
        ),
        (
            "/api/v1/tags/gpu-node/st%20able",
            "gpu-node:1",
            400,
            "invalid tag",
        ),
        (
            "/api/v1/tags/gpu-node/stable",
            "gpu-node:9",
            404,
            "no image gpu-node:9",
        ),
        (
            "/api/v1/tags/gpu-node/stable",
            "sha256:xyz",
            400,
            "invalid image reference",
        ),
    ] {
        let r = put(path, image).await.unwrap();
        let got = r.status().as_u16();
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(got, status, "{path} {image}: {body}");
        assert!(body["error"].as_str().unwrap().contains(needle), "{body}");
    }
    let (status, _) = server.json("/api/v1/tags/gpu-node/never/history").await;
    assert_eq!(status, 404);
    // A publish whose --tag names another image is refused before anything is stored.
    let (status, body) = server
        .publish_query(good_bundle("gpu-node", "2", b"k3"), "?tag=cpu-node:stable")
        .await;
    assert_eq!(status, 400, "{body}");
    let (_, images) = server.json("/api/v1/images").await;
    assert_eq!(images.as_array().unwrap().len(), 2);
    // A version may not take a tag's name either.
    let r = put("/api/v1/tags/gpu-node/next", "gpu-node:1")
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (status, body) = server.publish(good_bundle("gpu-node", "next", b"k4")).await;
    assert_eq!(status, 409, "{body}");
    server.stop().await;
}

/// Archives as GNU tar writes them in its other formats: PAX headers and GNU long names
/// (paths over 100 bytes) are read, and the digest does not depend on the format.
#[tokio::test]
async fn pax_and_gnu_long_name_archives_from_real_tar() {
    let server = TestServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let long = format!(
        "boot/{}/vmlinuz",
        ["a-directory-name-of-some-fifty-characters-in-length"; 5].join("/")
    );
    let long = long.as_str();
    assert!(
        long.len() > 256,
        "over what even ustar's prefix field holds"
    );
    let img = dir.path().join("img");
    std::fs::create_dir_all(img.join(long).parent().unwrap()).unwrap();
    std::fs::write(img.join(long), noise(10_000, 91)).unwrap();
    std::fs::write(img.join("initrd.img"), b"initrd").unwrap();
    let text = manifest("fmt", "1").replace("\"vmlinuz\"", &format!("{long:?}"));
    std::fs::write(img.join("manifest.toml"), text).unwrap();
    let mut digests = Vec::new();
    for format in ["gnu", "pax", "posix", "ustar"] {
        let out = dir.path().join(format!("{format}.tar"));
        let status = std::process::Command::new("tar")
            // ustar's refusal is expected below; keep it out of the test log.
            .stderr(std::process::Stdio::null())
            .args([
                &format!("--format={format}"),
                "-cf",
                out.to_str().unwrap(),
                "-C",
                img.to_str().unwrap(),
                ".",
            ])
            .status()
            .expect("tar is installed (scripts/test installs it)");
        if format == "ustar" {
            // ustar cannot hold a path this long; GNU tar says so and fails.
            assert!(!status.success());
            continue;
        }
        assert!(status.success(), "{format}");
        let (status, body) = server.publish(std::fs::read(&out).unwrap()).await;
        assert!(status == 201 || status == 200, "{format}: {body}");
        digests.push(body["digest"].clone());
    }
    assert_eq!(digests.len(), 3);
    assert!(digests.iter().all(|d| *d == digests[0]), "{digests:?}");
    server.stop().await;
}
