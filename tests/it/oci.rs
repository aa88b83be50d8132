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
    let out = Command::new("skopeo")
        .args([
            "--insecure-policy",
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
        ])
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
        let storage = tempfile::tempdir().unwrap();
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let addr = format!("127.0.0.1:{port}");
        let config = storage.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n",
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

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
