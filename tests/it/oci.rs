//! OCI images for the import tests: layers written entry by entry (PAX xattrs, whiteouts,
//! links, and the hostile entries a well-behaved tool never writes), packed as an OCI
//! layout directory; converted by skopeo into the other formats; served by a real
//! registry (Debian's docker-registry) started on loopback.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use sha2::{Digest as _, Sha256};

/// The kernel release of the fixture image.
pub const RELEASE: &str = "6.1.0-99-test-amd64";
/// The fixture kernel's bytes (not a kernel: imports only copy it).
pub const KERNEL: &[u8] = b"fixture kernel image bytes";

/// One layer entry.
pub enum Item {
    Dir(&'static str, u32),
    File {
        path: String,
        mode: u32,
        uid: u64,
        data: Vec<u8>,
        xattrs: Vec<(&'static str, Vec<u8>)>,
    },
    Symlink(&'static str, &'static str),
    HardLink(&'static str, &'static str),
    /// A name written raw into the header, unchecked (`..`, absolute paths).
    Raw(&'static str, tar::EntryType, Option<&'static str>),
}

pub fn file(path: &str, data: &[u8]) -> Item {
    Item::File {
        path: path.to_string(),
        mode: 0o644,
        uid: 0,
        data: data.to_vec(),
        xattrs: Vec::new(),
    }
}

/// An uncompressed layer tar.
pub fn layer(items: &[Item]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let header = |kind: tar::EntryType, mode: u32, uid: u64, size: u64| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(uid);
        h.set_gid(uid);
        h.set_mtime(1_700_000_000);
        h.set_size(size);
        h
    };
    for item in items {
        match item {
            Item::Dir(path, mode) => {
                let mut h = header(tar::EntryType::Directory, *mode, 0, 0);
                b.append_data(&mut h, path, std::io::empty()).unwrap();
            }
            Item::File {
                path,
                mode,
                uid,
                data,
                xattrs,
            } => {
                if !xattrs.is_empty() {
                    let records: Vec<(String, &[u8])> = xattrs
                        .iter()
                        .map(|(k, v)| (format!("SCHILY.xattr.{k}"), v.as_slice()))
                        .collect();
                    b.append_pax_extensions(records.iter().map(|(k, v)| (k.as_str(), *v)))
                        .unwrap();
                }
                let mut h = header(tar::EntryType::Regular, *mode, *uid, data.len() as u64);
                b.append_data(&mut h, path, data.as_slice()).unwrap();
            }
            Item::Symlink(path, target) => {
                let mut h = header(tar::EntryType::Symlink, 0o777, 0, 0);
                b.append_link(&mut h, path, target).unwrap();
            }
            Item::HardLink(path, target) => {
                let mut h = header(tar::EntryType::Link, 0o644, 0, 0);
                b.append_link(&mut h, path, target).unwrap();
            }
            Item::Raw(name, kind, link) => {
                let mut h = tar::Header::new_old();
                h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
                if let Some(l) = link {
                    h.as_old_mut().linkname[..l.len()].copy_from_slice(l.as_bytes());
                }
                h.set_entry_type(*kind);
                h.set_mode(0o644);
                h.set_size(0);
                h.set_cksum();
                b.append(&h, std::io::empty()).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

/// A real ELF object with a `.modinfo` section, as a kernel module has, built by gcc.
pub fn module_with_version(version: &str) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let c = dir.path().join("m.c");
    std::fs::write(
        &c,
        format!(
            "__attribute__((section(\".modinfo\"), used, aligned(1))) static const char v[] = \"version={version}\";\n\
             __attribute__((section(\".modinfo\"), used, aligned(1))) static const char l[] = \"license=NVIDIA\";\n"
        ),
    )
    .unwrap();
    let out = dir.path().join("m.ko");
    let status = Command::new("gcc")
        .args(["-c", "-o"])
        .arg(&out)
        .arg(&c)
        .status()
        .expect("gcc (the test command installs it)");
    assert!(status.success());
    std::fs::read(out).unwrap()
}

/// The fixture root: a kernel and its modules in merged-/usr layout, init, users, a
/// setuid binary, a file capability, a hard link; then a layer with whiteouts.
pub fn base_layers(nvidia: Option<&str>) -> Vec<Vec<u8>> {
    let modules = format!("usr/lib/modules/{RELEASE}");
    let mut dep = String::from(
        "kernel/drivers/net/virtio_net.ko: kernel/net/core/failover.ko\n\
         kernel/net/core/failover.ko:\n\
         kernel/drivers/virtio/virtio_pci.ko:\n\
         kernel/drivers/md/dm-verity.ko: kernel/drivers/md/dm-bufio.ko\n\
         kernel/drivers/md/dm-bufio.ko:\n",
    );
    let mut items = vec![
        Item::Dir("usr", 0o755),
        Item::Dir("usr/lib", 0o755),
        Item::Symlink("lib", "usr/lib"),
        Item::Symlink("bin", "usr/bin"),
        Item::Symlink("sbin", "usr/sbin"),
        file(&format!("boot/vmlinuz-{RELEASE}"), KERNEL),
        file(
            &format!("boot/config-{RELEASE}"),
            b"CONFIG_SQUASHFS=y\nCONFIG_SQUASHFS_ZSTD=y\nCONFIG_DM_VERITY=m\n",
        ),
        file(&format!("{modules}/modules.builtin"), b"kernel/drivers/block/loop.ko\nkernel/fs/squashfs/squashfs.ko\nkernel/fs/overlayfs/overlay.ko\n"),
        file(&format!("{modules}/kernel/drivers/net/virtio_net.ko"), b"virtio_net module"),
        file(&format!("{modules}/kernel/net/core/failover.ko"), b"failover module"),
        file(&format!("{modules}/kernel/drivers/virtio/virtio_pci.ko"), b"virtio_pci module"),
        file(&format!("{modules}/kernel/drivers/md/dm-verity.ko"), b"dm-verity module"),
        file(&format!("{modules}/kernel/drivers/md/dm-bufio.ko"), b"dm-bufio module"),
        Item::File {
            path: "usr/sbin/init".into(),
            mode: 0o755,
            uid: 0,
            data: b"#!/bin/sh\n".to_vec(),
            xattrs: vec![],
        },
        Item::File {
            path: "usr/bin/sudo".into(),
            mode: 0o4755,
            uid: 0,
            data: b"setuid root".to_vec(),
            xattrs: vec![],
        },
        Item::File {
            path: "usr/bin/ping".into(),
            mode: 0o755,
            uid: 0,
            data: b"ping".to_vec(),
            // cap_net_raw+ep, as setcap writes it (VFS_CAP_REVISION_2).
            xattrs: vec![(
                "security.capability",
                vec![1, 0, 0, 2, 0, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            )],
        },
        Item::HardLink("usr/bin/ping4", "usr/bin/ping"),
        Item::File {
            path: "home/user/notes".into(),
            mode: 0o600,
            uid: 1000,
            data: b"mine".to_vec(),
            xattrs: vec![("user.origin", b"fixture".to_vec())],
        },
        file("etc/obsolete", b"to be whited out"),
        file("var/cache/app/old", b"to be hidden by an opaque dir"),
    ];
    if let Some(version) = nvidia {
        dep.push_str("updates/dkms/nvidia.ko:\n");
        items.push(Item::File {
            path: format!("{modules}/updates/dkms/nvidia.ko"),
            mode: 0o644,
            uid: 0,
            data: module_with_version(version),
            xattrs: vec![],
        });
    }
    items.push(file(&format!("{modules}/modules.dep"), dep.as_bytes()));
    let upper = vec![
        file("etc/.wh.obsolete", b""),
        file("var/cache/.wh..wh..opq", b""),
        file("var/cache/fresh", b"new"),
        file("etc/hostname", b"fixture\n"),
    ];
    vec![layer(&items), layer(&upper)]
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Writes an OCI image layout of `layers` (gzip-compressed) at `dir`, named `ref_name`.
/// `tamper` may change a layer blob's bytes after its digest was taken (keeping its
/// name), to make a blob that lies about its content.
pub fn write_layout(dir: &Path, layers: &[Vec<u8>], ref_name: &str) -> PathBuf {
    write_layout_with(dir, layers, ref_name, |_| {}, |_| {})
}

pub fn write_layout_with(
    dir: &Path,
    layers: &[Vec<u8>],
    ref_name: &str,
    edit_config: impl FnOnce(&mut serde_json::Value),
    tamper: impl FnOnce(&mut Vec<Vec<u8>>),
) -> PathBuf {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let put = |bytes: &[u8]| -> (String, usize) {
        let hex = sha256_hex(bytes);
        std::fs::write(blobs.join(&hex), bytes).unwrap();
        (format!("sha256:{hex}"), bytes.len())
    };
    let compressed: Vec<Vec<u8>> = layers.iter().map(|l| gzip_n(l)).collect();
    let mut layer_descs = Vec::new();
    let mut stored = compressed.clone();
    tamper(&mut stored);
    for (original, bytes) in compressed.iter().zip(&stored) {
        let hex = sha256_hex(original);
        std::fs::write(blobs.join(&hex), bytes).unwrap();
        layer_descs.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": format!("sha256:{hex}"),
            "size": original.len(),
        }));
    }
    let mut config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Cmd": ["/sbin/init"]},
        "rootfs": {
            "type": "layers",
            "diff_ids": layers.iter().map(|l| format!("sha256:{}", sha256_hex(l))).collect::<Vec<_>>(),
        },
    });
    edit_config(&mut config);
    let (config_digest, config_size) = put(&serde_json::to_vec(&config).unwrap());
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": layer_descs,
    });
    let (manifest_digest, manifest_size) = put(&serde_json::to_vec(&manifest).unwrap());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest,
            "size": manifest_size,
            "annotations": {"org.opencontainers.image.ref.name": ref_name},
        }],
    });
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    dir.to_path_buf()
}

fn gzip_n(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// A layout directory as a tar (what `skopeo copy ... oci-archive:` writes).
pub fn tar_dir(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.append_dir_all(".", dir).unwrap();
    b.into_inner().unwrap()
}

/// skopeo copy SRC DEST (no signature policy: these images are the test's own).
pub fn skopeo(src: &str, dest: &str) {
    skopeo_as(src, dest, None)
}

/// skopeo copy with a registry login (USER:PASSWORD) for DEST.
pub fn skopeo_as(src: &str, dest: &str, creds: Option<&str>) {
    let mut cmd = Command::new("skopeo");
    cmd.args([
        "--insecure-policy",
        "copy",
        "--quiet",
        "--dest-tls-verify=false",
    ]);
    if let Some(c) = creds {
        cmd.arg(format!("--dest-creds={c}"));
    }
    let out = cmd
        .arg(src)
        .arg(dest)
        .output()
        .expect("skopeo (apt-get install skopeo; the test command installs it)");
    assert!(
        out.status.success(),
        "skopeo copy {src} {dest}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Debian's docker-registry (the CNCF Distribution registry) on 127.0.0.1, storing in a
/// temporary directory; stopped on drop.
pub struct Registry {
    pub addr: String,
    pub storage: tempfile::TempDir,
    child: Child,
}

impl Registry {
    pub fn start() -> Self {
        Self::start_with("")
    }

    /// A registry that demands tokens from `tokens` (Bearer auth).
    pub fn start_with_tokens(tokens: &TokenService) -> Self {
        Self::start_with(&format!(
            "auth:\n  token:\n    realm: {}\n    service: {TOKEN_SERVICE}\n    issuer: {TOKEN_ISSUER}\n    rootcertbundle: {}\n",
            tokens.realm,
            tokens.cert.display()
        ))
    }

    fn start_with(auth: &str) -> Self {
        let storage = tempfile::tempdir().unwrap();
        let port = port_for_a_child();
        let addr = format!("127.0.0.1:{port}");
        let config = storage.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n{auth}",
                storage.path().join("data").display()
            ),
        )
        .unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "docker-registry (apt-get install docker-registry; the test command installs it)",
            );
        let r = Self {
            addr,
            storage,
            child,
        };
        for _ in 0..100 {
            if std::net::TcpStream::connect(&r.addr).is_ok() {
                return r;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("docker-registry did not listen on {}", r.addr);
    }

    /// The registry's stored copy of a blob (to damage it).
    pub fn blob_file(&self, hex: &str) -> PathBuf {
        self.storage
            .path()
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

/// A free port for a program that binds it itself, outside the kernel's ephemeral range:
/// a port from `bind(0)`, dropped and handed on, can be handed to another test's
/// `bind(0)` meanwhile (seen: a registry took the port a `serve` test was about to use).
pub fn port_for_a_child() -> u16 {
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let base = 16_000 + (std::process::id() % 500) as u16;
    for _ in 0..500 {
        let port = base + NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst) % 500;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in 16000-16999 for a child server");
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A token service for the registry's Bearer auth, as Docker Hub's or Harbor's: on
/// `GET /token?service=..&scope=repository:NAME:ACTIONS` with the right Basic login it
/// answers a JWT (RS256, its certificate in `x5c`) granting the asked actions; without
/// it, 401. The registry trusts its certificate (`rootcertbundle`).
pub struct TokenService {
    pub realm: String,
    pub cert: PathBuf,
    _dir: tempfile::TempDir,
}

pub const TOKEN_SERVICE: &str = "bootfleet-test-registry";
pub const TOKEN_ISSUER: &str = "bootfleet-test-issuer";

impl TokenService {
    pub async fn start(user: &'static str, password: &'static str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (key, cert) = (dir.path().join("key.pem"), dir.path().join("cert.pem"));
        let status = Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=bootfleet-test-token",
                "-keyout",
            ])
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .stderr(Stdio::null())
            .status()
            .expect("openssl (the test command installs it)");
        assert!(status.success());
        let der = Command::new("openssl")
            .args(["x509", "-outform", "DER", "-in"])
            .arg(&cert)
            .output()
            .unwrap()
            .stdout;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let realm = format!("http://{}/token", listener.local_addr().unwrap());
        let expected = format!(
            "Basic {}",
            base64(format!("{user}:{password}").as_bytes(), STANDARD)
        );
        let key_path = key.clone();
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            loop {
                let Ok((mut conn, _)) = listener.accept().await else {
                    return;
                };
                let mut raw = Vec::new();
                let mut buf = [0u8; 4096];
                while !raw.windows(4).any(|w| w == b"\r\n\r\n") && raw.len() < 16384 {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => raw.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&raw).into_owned();
                let authorized = head.lines().any(|l| {
                    l.to_ascii_lowercase().starts_with("authorization:")
                        && l[14..].trim() == expected
                });
                let scope = head
                    .split_whitespace()
                    .nth(1)
                    .and_then(|target| target.split_once("scope="))
                    .map(|(_, s)| {
                        s.split('&')
                            .next()
                            .unwrap_or("")
                            .replace("%3A", ":")
                            .replace("%2C", ",")
                            .replace("%2F", "/")
                    })
                    .unwrap_or_default();
                let answer = if authorized {
                    let token = jwt(&key_path, &der, &scope);
                    let body = format!(
                        r#"{{"token":"{token}","access_token":"{token}","expires_in":300}}"#
                    );
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                } else {
                    "HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                        .to_string()
                };
                let _ = conn.write_all(answer.as_bytes()).await;
            }
        });
        Self {
            realm,
            cert,
            _dir: dir,
        }
    }
}

const STANDARD: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
const URL_SAFE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// base64 with `alphabet`; padded with the standard one, unpadded with the URL-safe one
/// (as JWTs are).
fn base64(bytes: &[u8], alphabet: &[u8; 64]) -> String {
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(alphabet[(n >> (18 - 6 * i)) as usize & 63] as char);
        }
        if alphabet == STANDARD {
            out.push_str(&"=".repeat(3 - chunk.len()));
        }
    }
    out
}

/// An RS256 JWT the Distribution registry accepts: issuer, audience and the access the
/// scope asks for (`repository:NAME:ACTION,ACTION`), signed by `key` (openssl).
fn jwt(key: &Path, cert_der: &[u8], scope: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mut parts = scope.splitn(3, ':');
    let (kind, name, actions) = (
        parts.next().unwrap_or(""),
        parts.next().unwrap_or(""),
        parts.next().unwrap_or(""),
    );
    let header =
        serde_json::json!({ "typ": "JWT", "alg": "RS256", "x5c": [base64(cert_der, STANDARD)] });
    let claims = serde_json::json!({
        "iss": TOKEN_ISSUER, "sub": "tester", "aud": TOKEN_SERVICE,
        "exp": now + 300, "nbf": now - 10, "iat": now, "jti": format!("{now}-{}", rand_u64()),
        "access": [{ "type": kind, "name": name, "actions": actions.split(',').filter(|a| !a.is_empty()).collect::<Vec<_>>() }],
    });
    let input = format!(
        "{}.{}",
        base64(header.to_string().as_bytes(), URL_SAFE),
        base64(claims.to_string().as_bytes(), URL_SAFE)
    );
    let mut child = Command::new("openssl")
        .args(["dgst", "-sha256", "-sign"])
        .arg(key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let signature = child.wait_with_output().unwrap().stdout;
    format!("{input}.{}", base64(&signature, URL_SAFE))
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(7);
    h.finish()
}
