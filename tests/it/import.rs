//! Image import (issue 15): an OCI image, from a layout, an oci-archive, a docker-archive
//! or a real registry, becomes a two-stage image: a squashfs root with its dm-verity tree,
//! the image's kernel, a stage-1 initramfs of the image's own modules, pins read from the
//! content. Hostile images are refused whole and leave nothing.

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use crate::harness::TestServer;
use crate::oci::{self, Item, RELEASE};

async fn server() -> TestServer {
    TestServer::start_configured(|cfg| {
        cfg.images.agent = env!("CARGO_BIN_EXE_bootfleet-agent").into();
    })
    .await
}

fn spec(name: &str, version: &str, extra: Value) -> String {
    let mut v = json!({ "name": name, "version": version, "cmdline": "console=ttyS0" });
    if let (Value::Object(base), Value::Object(more)) = (&mut v, extra) {
        base.extend(more);
    }
    v.to_string()
}

/// Uploads an archive (or a layout as a tar) for import.
async fn import_archive(s: &TestServer, body: Vec<u8>, spec: &str) -> (u16, Value) {
    let r = s
        .post("/api/v1/images/import")
        .query(&[("spec", spec)])
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

async fn import_pull(s: &TestServer, request: Value) -> (u16, Value) {
    let r = s
        .post("/api/v1/images/import")
        .json(&request)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

fn imports_left(s: &TestServer) -> usize {
    std::fs::read_dir(s.data.path().join("imports"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Nothing of a refused import stays: no blob, no temp file, no image, no staging.
async fn assert_nothing_left(s: &TestServer) {
    s.assert_empty().await;
    assert_eq!(imports_left(s), 0, "staging directories left behind");
    let r = s.http.get(s.url("/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200, "the server keeps serving");
}

/// Where the blob of `role` of the image `outcome` names is stored.
async fn blob(s: &TestServer, outcome: &Value, role: &str) -> std::path::PathBuf {
    let (_, image) = s
        .json(&format!(
            "/api/v1/images/{}",
            outcome["digest"].as_str().unwrap()
        ))
        .await;
    let artifact = image["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["role"] == role)
        .unwrap_or_else(|| panic!("no {role} in {image}"))
        .clone();
    let hex = artifact["digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:");
    s.blob_dir().join(hex)
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_oci_image_becomes_a_verified_two_stage_image() {
    let s = server().await;
    let dir = tempfile::tempdir().unwrap();
    let layout = oci::write_layout(dir.path(), &oci::base_layers(Some("550.127.05")), "v1");
    let (status, out) = import_archive(
        &s,
        oci::tar_dir(&layout),
        &spec(
            "fixture",
            "1",
            json!({ "validation": { "gpus": 0 }, "tag": "fixture:stable" }),
        ),
    )
    .await;
    assert_eq!(status, 201, "{out}");
    let report = &out["import"];
    assert_eq!(report["kernel_release"], RELEASE);
    assert_eq!(report["pins"]["kernel"], RELEASE);
    assert_eq!(report["pins"]["nvidia-driver"], "550.127.05");
    assert_eq!(report["derived_pins"], json!(["kernel", "nvidia-driver"]));
    assert_eq!(report["compressor"], "zstd");
    // Dependencies first; loop, squashfs and overlay are built in.
    assert_eq!(
        report["stage1_modules"],
        json!([
            "virtio_pci",
            "failover",
            "virtio_net",
            "dm_bufio",
            "dm_verity"
        ])
    );
    assert_eq!(out["tag"]["tag"], "fixture:stable");

    // The manifest names the three artifacts and the verity parameters.
    let (_, image) = s
        .json(&format!(
            "/api/v1/images/{}",
            out["digest"].as_str().unwrap()
        ))
        .await;
    let manifest = image["manifest"].as_str().unwrap();
    assert!(manifest.contains("[rootfs.verity]"), "{manifest}");
    assert!(
        manifest.contains(report["verity_root_hash"].as_str().unwrap()),
        "{manifest}"
    );
    assert!(
        manifest.contains("nvidia-driver = \"550.127.05\""),
        "{manifest}"
    );

    // The kernel is the image's own.
    assert_eq!(
        std::fs::read(blob(&s, &out, "kernel").await).unwrap(),
        oci::KERNEL
    );

    // The rootfs: its hash tree verifies against the root hash, by veritysetup.
    let rootfs = blob(&s, &out, "rootfs").await;
    let verity: Value = {
        let parsed: toml::Value = toml::from_str(manifest).unwrap();
        serde_json::to_value(&parsed["rootfs"]["verity"]).unwrap()
    };
    let verify = |file: &Path, root: &str| {
        Command::new("veritysetup")
            .args(["verify", "--no-superblock", "--salt=-"])
            .arg(format!("--data-blocks={}", verity["data-blocks"]))
            .arg(format!("--hash-offset={}", verity["hash-offset"]))
            .arg(file)
            .arg(file)
            .arg(root)
            .status()
            .expect("veritysetup (cryptsetup-bin)")
            .success()
    };
    assert!(verify(&rootfs, verity["root-hash"].as_str().unwrap()));
    assert!(
        !verify(&rootfs, &"0".repeat(64)),
        "a wrong root hash must fail"
    );

    // Its content: layers merged, whiteouts applied, owners, modes, links, capabilities.
    let listing = run(Command::new("unsquashfs").arg("-lln").arg(&rootfs));
    let line = |path: &str| {
        listing
            .lines()
            .find(|l| {
                l.ends_with(&format!("squashfs-root/{path}"))
                    || l.contains(&format!("squashfs-root/{path} ->"))
            })
            .unwrap_or_else(|| panic!("{path} not in\n{listing}"))
            .to_string()
    };
    assert!(
        line("usr/bin/sudo").starts_with("-rwsr-xr-x 0/0"),
        "{}",
        line("usr/bin/sudo")
    );
    assert!(line("home/user/notes").starts_with("-rw------- 1000/1000"));
    assert!(line("lib").contains("-> usr/lib"));
    assert!(line("etc/hostname").starts_with("-rw-r--r-- 0/0"));
    assert!(line("var/cache/fresh").starts_with("-"));
    for gone in ["etc/obsolete", "var/cache/app", ".wh."] {
        assert!(!listing.contains(gone), "{gone} should be gone:\n{listing}");
    }
    let unpacked = tempfile::tempdir().unwrap();
    let root = unpacked.path().join("root");
    run(Command::new("unsquashfs")
        .arg("-q")
        .arg("-d")
        .arg(&root)
        .arg(&rootfs));
    let ping = std::fs::metadata(root.join("usr/bin/ping")).unwrap();
    let ping4 = std::fs::metadata(root.join("usr/bin/ping4")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(ping.ino(), ping4.ino(), "a hard link stays one inode");
    assert_eq!(
        xattr(&root.join("usr/bin/ping"), "security.capability").len(),
        20
    );
    assert_eq!(
        xattr(&root.join("home/user/notes"), "user.origin"),
        b"fixture"
    );

    // Stage 1: busybox, the agent, /init and the modules in load order.
    let stage1 = cpio_names(&std::fs::read(blob(&s, &out, "initrd").await).unwrap());
    for want in [
        "init",
        "bin/busybox",
        "bin/bootfleet-agent",
        "lib/modules/stage1/000-virtio_pci.ko",
        "lib/modules/stage1/004-dm_verity.ko",
        "dev/console",
    ] {
        assert!(
            stage1.iter().any(|n| n == want),
            "{want} not in stage 1: {stage1:?}"
        );
    }

    // The same content again, a second later (what differed by the clock would show):
    // the same digest, nothing new.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let (status, again) = import_archive(
        &s,
        oci::tar_dir(&layout),
        &spec("fixture", "1", json!({ "validation": { "gpus": 0 } })),
    )
    .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["digest"], out["digest"]);
    assert_eq!(imports_left(&s), 0);
    s.stop().await;
}

fn xattr(path: &Path, name: &str) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let p = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    let mut buf = vec![0u8; 256];
    let len =
        unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(
        len >= 0,
        "{name} on {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    buf.truncate(len as usize);
    buf
}

fn cpio_names(gz: &[u8]) -> Vec<String> {
    let mut r = flate2::read::GzDecoder::new(gz);
    let mut names = Vec::new();
    loop {
        let entry = cpio::newc::Reader::new(&mut r).unwrap();
        if entry.entry().is_trailer() {
            return names;
        }
        names.push(entry.entry().name().to_string());
        entry.finish().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_source_gives_the_same_digest() {
    let s = server().await;
    let work = tempfile::tempdir().unwrap();
    let layout = oci::write_layout(&work.path().join("layout"), &oci::base_layers(None), "v1");
    let spec = spec("same", "1", json!({}));
    let (status, from_layout) = import_archive(&s, oci::tar_dir(&layout), &spec).await;
    assert_eq!(status, 201, "{from_layout}");
    let digest = from_layout["digest"].clone();

    let oci_archive = work.path().join("image.oci.tar");
    oci::skopeo(
        &format!("oci:{}:v1", layout.display()),
        &format!("oci-archive:{}", oci_archive.display()),
    );
    let docker_archive = work.path().join("image.docker.tar");
    oci::skopeo(
        &format!("oci:{}:v1", layout.display()),
        &format!("docker-archive:{}:same:v1", docker_archive.display()),
    );
    for archive in [&oci_archive, &docker_archive] {
        let (status, out) = import_archive(&s, std::fs::read(archive).unwrap(), &spec).await;
        assert_eq!(status, 200, "{}: {out}", archive.display());
        assert_eq!(out["digest"], digest, "{}", archive.display());
    }

    let registry = oci::Registry::start();
    oci::skopeo(
        &format!("oci:{}:v1", layout.display()),
        &format!("docker://{}/fixtures/same:v1", registry.addr),
    );
    let (status, out) = import_pull(
        &s,
        json!({ "name": "same", "version": "1", "cmdline": "console=ttyS0",
                "source": format!("docker://{}/fixtures/same:v1", registry.addr), "plain_http": true }),
    )
    .await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["digest"], digest);
    assert_eq!(imports_left(&s), 0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_imports_a_layout_directory() {
    let s = server().await;
    let work = tempfile::tempdir().unwrap();
    let layout = oci::write_layout(&work.path().join("layout"), &oci::base_layers(None), "v1");
    let pins = work.path().join("extra.toml");
    std::fs::write(
        &pins,
        format!("[pins]\nkernel = \"{RELEASE}\"\n[validation]\ngpus = 0\n"),
    )
    .unwrap();
    let out = Command::new(crate::harness::bin())
        .args([
            "--server",
            &s.url(""),
            "--token",
            &s.token,
            "--output",
            "json",
            "image",
            "import",
        ])
        .arg(format!("oci:{}:v1", layout.display()))
        .args([
            "--name",
            "cli",
            "--version",
            "2",
            "--tag",
            "cli:stable",
            "--manifest",
        ])
        .arg(&pins)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["name"], "cli");
    assert_eq!(v["import"]["derived_pins"], json!([]));
    assert_eq!(v["tag"]["tag"], "cli:stable");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn pins_that_the_content_contradicts_are_refused_naming_both() {
    let s = server().await;
    let dir = tempfile::tempdir().unwrap();
    let layout = oci::write_layout(dir.path(), &oci::base_layers(Some("550.127.05")), "v1");
    let (status, out) = import_archive(
        &s,
        oci::tar_dir(&layout),
        &spec(
            "pinned",
            "1",
            json!({ "pins": { "nvidia-driver": "535.216.03" } }),
        ),
    )
    .await;
    assert_eq!(status, 400, "{out}");
    let e = out["error"].as_str().unwrap();
    assert!(e.contains("535.216.03") && e.contains("550.127.05"), "{e}");
    assert_nothing_left(&s).await;
    s.stop().await;
}

/// A hostile layer (second in the image) refused with the reason given.
async fn refused(s: &TestServer, upper: Vec<Item>, needle: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut layers = oci::base_layers(None);
    layers.push(oci::layer(&upper));
    let layout = oci::write_layout(dir.path(), &layers, "v1");
    let (status, out) =
        import_archive(s, oci::tar_dir(&layout), &spec("hostile", "1", json!({}))).await;
    assert_eq!(status, 400, "{needle}: {out}");
    let e = out["error"].as_str().unwrap();
    assert!(e.contains(needle), "expected {needle:?} in {e:?}");
    assert_nothing_left(s).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_images_are_refused_whole() {
    let s = server().await;
    refused(
        &s,
        vec![Item::Raw("../etc/passwd", tar::EntryType::Regular, None)],
        "'..'",
    )
    .await;
    refused(
        &s,
        vec![Item::Raw(
            "etc/../../.wh.etc",
            tar::EntryType::Regular,
            None,
        )],
        "'..'",
    )
    .await;
    refused(
        &s,
        vec![
            Item::Symlink("escape", "/"),
            Item::Raw("escape/etc/shadow", tar::EntryType::Regular, None),
        ],
        "symbolic link",
    )
    .await;
    refused(
        &s,
        vec![Item::Raw("dev/sda", tar::EntryType::Block, None)],
        "device files",
    )
    .await;
    refused(
        &s,
        vec![Item::Raw(
            "usr/bin/x",
            tar::EntryType::Link,
            Some("../../etc/shadow"),
        )],
        "'..'",
    )
    .await;

    // A layer blob whose bytes are not what its name says.
    let dir = tempfile::tempdir().unwrap();
    let layout = oci::write_layout_with(
        dir.path(),
        &oci::base_layers(None),
        "v1",
        |_| {},
        |layers| layers[1][20] ^= 0xff,
    );
    let (status, out) =
        import_archive(&s, oci::tar_dir(&layout), &spec("hostile", "1", json!({}))).await;
    assert_eq!(status, 400, "{out}");
    assert!(
        out["error"]
            .as_str()
            .unwrap()
            .contains("truncated or altered"),
        "{out}"
    );
    assert_nothing_left(&s).await;

    // A config whose diff_ids do not match the layers' content.
    let dir = tempfile::tempdir().unwrap();
    let layout = oci::write_layout_with(
        dir.path(),
        &oci::base_layers(None),
        "v1",
        |config| config["rootfs"]["diff_ids"][0] = json!(format!("sha256:{}", "0".repeat(64))),
        |_| {},
    );
    let (status, out) =
        import_archive(&s, oci::tar_dir(&layout), &spec("hostile", "1", json!({}))).await;
    assert_eq!(status, 400, "{out}");
    assert!(
        out["error"].as_str().unwrap().contains("image config says"),
        "{out}"
    );
    assert_nothing_left(&s).await;

    // Not an image at all.
    let (status, out) =
        import_archive(&s, b"garbage".to_vec(), &spec("hostile", "1", json!({}))).await;
    assert_eq!(status, 400, "{out}");
    assert_nothing_left(&s).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_truncated_blob_from_the_registry_is_refused() {
    let s = server().await;
    let work = tempfile::tempdir().unwrap();
    let layers = oci::base_layers(None);
    let layout = oci::write_layout(&work.path().join("layout"), &layers, "v1");
    let registry = oci::Registry::start();
    let source = format!("docker://{}/fixtures/cut:v1", registry.addr);
    oci::skopeo(&format!("oci:{}:v1", layout.display()), &source);
    // Cut the registry's stored copy of the first layer in half.
    let index: Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let manifest_hex = index["manifests"][0]["digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:")
        .to_string();
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(layout.join("blobs/sha256").join(&manifest_hex)).unwrap(),
    )
    .unwrap();
    let layer_hex = manifest["layers"][0]["digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:")
        .to_string();
    let stored = registry.blob_file(&layer_hex);
    let bytes = std::fs::read(&stored).unwrap();
    std::fs::write(&stored, &bytes[..bytes.len() / 2]).unwrap();
    let (status, out) = import_pull(
        &s,
        json!({ "name": "cut", "version": "1", "source": source, "plain_http": true }),
    )
    .await;
    assert_eq!(status, 400, "{out}");
    assert!(
        out["error"]
            .as_str()
            .unwrap()
            .contains("truncated or altered"),
        "{out}"
    );
    assert_nothing_left(&s).await;

    // An image the registry does not have, and a registry that is not there.
    let (status, out) = import_pull(&s, json!({ "name": "x", "version": "1", "source": format!("docker://{}/none:v1", registry.addr), "plain_http": true })).await;
    assert_eq!(status, 400, "{out}");
    assert!(out["error"].as_str().unwrap().contains("404"), "{out}");
    drop(registry);
    let (status, out) = import_pull(
        &s,
        json!({ "name": "x", "version": "1", "source": source, "plain_http": true }),
    )
    .await;
    assert_eq!(status, 502, "{out}");
    assert_nothing_left(&s).await;
    s.stop().await;
}

/// A bundle that claims a verity root hash must carry the tree that proves it.
#[tokio::test(flavor = "multi_thread")]
async fn a_bundle_rootfs_must_prove_its_verity_root_hash() {
    let s = server().await;
    let dir = tempfile::tempdir().unwrap();
    let rootfs = dir.path().join("rootfs.squashfs");
    std::fs::write(&rootfs, crate::harness::noise(8 * 4096, 7)).unwrap();
    let out = run(Command::new("veritysetup")
        .args([
            "format",
            "--no-superblock",
            "--salt=-",
            "--data-blocks=8",
            "--hash-offset=32768",
        ])
        .arg(&rootfs)
        .arg(&rootfs));
    let root = out
        .lines()
        .find_map(|l| l.strip_prefix("Root hash:"))
        .unwrap()
        .trim()
        .to_string();
    let bundle = |root_hash: &str| {
        let manifest = format!(
            "name = \"verity\"\nversion = \"{}\"\n[boot]\nkernel = \"vmlinuz\"\ninitrds = [\"initrd.img\"]\nrootfs = \"rootfs.squashfs\"\n\
             [rootfs]\nformat = \"squashfs\"\n[rootfs.verity]\nroot-hash = \"{root_hash}\"\nhash-offset = 32768\ndata-blocks = 8\nalgorithm = \"sha256\"\nsalt = \"-\"\n",
            &root_hash[..8]
        );
        crate::harness::tar_of(&[
            crate::harness::file("manifest.toml", manifest.as_bytes()),
            crate::harness::file("vmlinuz", b"kernel"),
            crate::harness::file("initrd.img", b"initrd"),
            crate::harness::file("rootfs.squashfs", &std::fs::read(&rootfs).unwrap()),
        ])
    };
    let (status, out) = s.publish(bundle(&"0".repeat(64))).await;
    assert_eq!(status, 400, "{out}");
    assert!(
        out["error"].as_str().unwrap().contains("does not prove"),
        "{out}"
    );
    s.assert_empty().await;
    let (status, out) = s.publish(bundle(&root)).await;
    assert_eq!(status, 201, "{out}");
    s.stop().await;
}

/// A registry behind Bearer token auth (a real docker-registry trusting a token service's
/// certificate): the server does the token dance with the login named by the request,
/// kept in its secrets directory; a wrong or missing login is refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_registry_behind_token_auth_is_pulled_with_a_secret_login() {
    let s = server().await;
    let tokens = oci::TokenService::start("puller", "s3cret-pass").await;
    let registry = oci::Registry::start_with_tokens(&tokens);
    let work = tempfile::tempdir().unwrap();
    let layout = oci::write_layout(&work.path().join("layout"), &oci::base_layers(None), "v1");
    let source = format!("docker://{}/fixtures/auth:v1", registry.addr);
    let push = tokio::task::spawn_blocking({
        let (layout, source) = (layout.clone(), source.clone());
        move || {
            oci::skopeo_as(
                &format!("oci:{}:v1", layout.display()),
                &source,
                Some("puller:s3cret-pass"),
            )
        }
    });
    push.await.unwrap();
    let secrets = s.data.path().join("secrets");
    std::fs::create_dir_all(&secrets).unwrap();
    let write_secret = |name: &str, registry: &str, password: &str| {
        use std::os::unix::fs::PermissionsExt;
        let path = secrets.join(name);
        std::fs::write(
            &path,
            format!(
                "registry = \"{registry}\"\nusername = \"puller\"\npassword = \"{password}\"\n"
            ),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    };
    write_secret("registry", &registry.addr, "s3cret-pass");
    write_secret("wrong", &registry.addr, "guess");
    // A login is for its own registry: never sent to another one a request names.
    write_secret("elsewhere", "registry.example:5000", "s3cret-pass");
    let request = |credential: Option<&str>| {
        let mut r = json!({ "name": "auth", "version": "1", "source": source, "plain_http": true });
        if let Some(c) = credential {
            r["registry_credential"] = json!(c);
        }
        r
    };
    for (credential, needle) in [
        (None, "refused the login"),
        (Some("wrong"), "refused the login"),
        (Some("elsewhere"), "its own registry only"),
    ] {
        let (status, out) = import_pull(&s, request(credential)).await;
        assert_eq!(status, 400, "{out}");
        let e = out["error"].as_str().unwrap();
        assert!(e.contains(needle), "{e}");
        assert!(
            !e.contains("guess") && !e.contains("s3cret"),
            "a password in {e}"
        );
    }
    assert_nothing_left(&s).await;
    let (status, out) = import_pull(&s, request(Some("registry"))).await;
    assert_eq!(status, 201, "{out}");
    assert!(!out.to_string().contains("s3cret"));
    s.stop().await;
}
