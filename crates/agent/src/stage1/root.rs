//! Stage 1's job from end to end: the root blob named on the kernel command line fetched
//! (progress on the console), checked, attached read-only and put under dm-verity as
//! `bootfleet-root`; and, later in the real root, which root hash the node runs on.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bootfleet_api::Digest;
use bootfleet_api::image::{VERITY_BLOCK, Verity};

use super::{FetchOptions, Stage1Error, VerityParams, attach_loop, blob_url, create_verity};
use crate::boot_params::BootParams;

/// The dm device the root is read through.
pub const ROOT_DEVICE: &str = "bootfleet-root";

/// What the boot script put on the command line for stage 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootBlob {
    pub digest: Digest,
    pub size: u64,
    pub verity: Verity,
}

impl RootBlob {
    pub fn from_params(p: &BootParams) -> Result<Self, String> {
        let missing = |w: &str| {
            format!("no bootfleet.{w}= on the kernel command line (not a two-stage image?)")
        };
        Ok(Self {
            digest: p.rootfs.ok_or_else(|| missing("rootfs"))?,
            size: p.rootfs_size.ok_or_else(|| missing("rootfs_size"))?,
            verity: p.verity.clone().ok_or_else(|| missing("verity"))?,
        })
    }
}

/// The device-mapper form of the manifest's verity parameters.
pub fn verity_params(v: &Verity) -> VerityParams {
    VerityParams {
        data_blocks: v.data_blocks,
        hash_start_block: v.hash_offset / VERITY_BLOCK,
        data_block_size: VERITY_BLOCK as u32,
        hash_block_size: VERITY_BLOCK as u32,
        algorithm: v.algorithm.clone(),
        root_hash: v.root_hash.clone(),
        salt: v.salt.clone(),
    }
}

/// The root as a verified device to mount: from the node's cache directory `cache` when
/// it holds this digest (no download; dm-verity checks every block read), else fetched
/// into the cache (kept for the next boot) or, without one, into `dir` (RAM).
pub async fn prepare(
    client: &reqwest::Client,
    server: &str,
    boot: &str,
    root: &RootBlob,
    dir: &Path,
    cache: Option<&Path>,
) -> Result<PathBuf, Stage1Error> {
    if let Some(cache) = cache {
        let cached = cache.join(format!("{}.rootfs", root.digest.hex()));
        if std::fs::metadata(&cached).is_ok_and(|m| m.len() == root.size) {
            // A local disk reads a root in seconds: check it whole, so a damaged copy is
            // fetched again now instead of failing reads in the running system.
            match sha256_of(&cached) {
                Ok(found) if found == root.digest => {
                    eprintln!(
                        "bootfleet stage 1: root from the node's cache {} (not fetched; its sha256 checked, dm-verity checks every block)",
                        cached.display()
                    );
                    return verified_device(&cached, root);
                }
                Ok(found) => eprintln!(
                    "bootfleet stage 1: the cached root hashes to {found}, not {}: fetching it again",
                    root.digest
                ),
                Err(e) => eprintln!(
                    "bootfleet stage 1: cannot read the cached root ({e}): fetching it again"
                ),
            }
        }
        // A root fetched for another image is stale: make room before fetching.
        prune(cache, &cached);
        match fetch(client, server, boot, root, &cached).await {
            Ok(()) => {
                eprintln!("bootfleet stage 1: root kept in the node's cache for the next boot");
                return verified_device(&cached, root);
            }
            // A full or failing cache disk must not stop the boot: RAM, as without one.
            Err(e @ Stage1Error::Io { .. }) => {
                eprintln!("bootfleet stage 1: cannot cache the root ({e}); fetching it into RAM");
            }
            Err(e) => return Err(e),
        }
    }
    let dest = dir.join("rootfs.img");
    fetch(client, server, boot, root, &dest).await?;
    verified_device(&dest, root)
}

fn sha256_of(path: &Path) -> std::io::Result<Digest> {
    use sha2::Digest as _;
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(Digest::from_hasher(hasher));
        }
        hasher.update(&buf[..n]);
    }
}

/// Removes the cached roots of other digests, and leftovers of an interrupted fetch.
fn prune(cache: &Path, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(cache) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path != keep && (name.ends_with(".rootfs") || name.ends_with(".rootfs.part")) {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// Fetches the root blob to `dest` (replacing whatever a stage 1 before left there),
/// its sha256 checked, with progress on the console.
async fn fetch(
    client: &reqwest::Client,
    server: &str,
    boot: &str,
    root: &RootBlob,
    dest: &Path,
) -> Result<(), Stage1Error> {
    let _ = std::fs::remove_file(dest);
    let mut part = dest.as_os_str().to_owned();
    part.push(".part");
    let _ = std::fs::remove_file(&part);
    let (progress, mut seen) = tokio::sync::watch::channel(0u64);
    let size = root.size;
    let started = Instant::now();
    let reporter = tokio::spawn(async move {
        let mut last = Instant::now();
        while seen.changed().await.is_ok() {
            if last.elapsed() >= Duration::from_secs(5) {
                let done = *seen.borrow();
                eprintln!(
                    "bootfleet stage 1: {} of {} MiB of the root ({:.0} s)",
                    done >> 20,
                    size >> 20,
                    started.elapsed().as_secs_f64()
                );
                last = Instant::now();
            }
        }
    });
    let options = FetchOptions {
        progress: Some(progress),
        ..FetchOptions::default()
    };
    let url = blob_url(server, &root.digest, boot);
    let fetched = super::fetch_blob(client, &url, root.size, &root.digest, dest, &options).await;
    reporter.abort();
    let stats = fetched?;
    eprintln!(
        "bootfleet stage 1: root fetched and its sha256 checked: {} MiB in {:.1} s ({} streams, {} resumes)",
        stats.bytes >> 20,
        stats.seconds,
        stats.streams,
        stats.resumes
    );
    Ok(())
}

/// `file` attached read-only and put under dm-verity with the manifest's root hash.
fn verified_device(file: &Path, root: &RootBlob) -> Result<PathBuf, Stage1Error> {
    // The loop detaches when its last holder closes it: keep it until dm-verity holds it.
    let device = attach_loop(file, true)?;
    let verified = create_verity(ROOT_DEVICE, device.path(), &verity_params(&root.verity))?;
    drop(device);
    Ok(verified)
}

/// The root hash of the dm-verity device the node's root is read through, as the kernel
/// reports it; None when there is no such device (a single-stage image).
pub fn booted_root_hash() -> Option<String> {
    let table = super::table_of(ROOT_DEVICE).ok()?;
    let line = table.lines().find(|l| l.contains(" verity "))?;
    super::VerityTable::parse(line)
        .ok()
        .map(|t| t.params.root_hash)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_verity_becomes_the_dm_table() {
        let v = Verity {
            root_hash: "ab".repeat(32),
            hash_offset: 8 << 20,
            data_blocks: 2048,
            algorithm: "sha256".into(),
            salt: "-".into(),
        };
        let p = verity_params(&v);
        assert_eq!(p.hash_start_block, 2048);
        assert_eq!(
            p.table("7:0", "7:0"),
            format!("1 7:0 7:0 4096 4096 2048 2048 sha256 {} -", "ab".repeat(32))
        );
        let missing = RootBlob::from_params(&BootParams::default()).unwrap_err();
        assert!(missing.contains("bootfleet.rootfs="), "{missing}");
    }
}
