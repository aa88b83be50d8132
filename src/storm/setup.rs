//! The storm's fixtures: a synthetic image (random kernel and initrd of chosen sizes,
//! pins, an 8-GPU validation policy) published to the server, every simulated MAC assigned
//! to it, and the same bytes laid out for the reference web server.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;

/// The pins the storm image declares and its simulated agents report.
pub const KERNEL_RELEASE: &str = "6.1.0-storm-amd64";
pub const DRIVER: &str = "550.127.05";
pub const TAG: &str = "storm:stable";

/// Simulated node `i`'s MAC: locally administered, prefix 02:bf.
pub fn mac(i: u32) -> [u8; 6] {
    let b = i.to_be_bytes();
    [0x02, 0xbf, b[0], b[1], b[2], b[3]]
}

pub fn mac_string(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// `len` reproducible pseudo-random bytes (xorshift; only incompressibility matters).
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn manifest(version: &str) -> String {
    format!(
        "name = \"storm\"\nversion = \"{version}\"\n\n[boot]\nkernel = \"vmlinuz\"\ninitrds = [\"initrd.img\"]\n\
         cmdline = \"console=ttyS0 quiet\"\n\n[pins]\nkernel = \"{KERNEL_RELEASE}\"\nnvidia-driver = \"{DRIVER}\"\n\n\
         [validation]\ngpus = 8\ngpu-model = \"H100\"\n"
    )
}

fn bundle(version: &str, kernel: &[u8], initrd: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in [
        ("manifest.toml", manifest(version).as_bytes()),
        ("vmlinuz", kernel),
        ("initrd.img", initrd),
    ] {
        let mut h = tar::Header::new_ustar();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(0);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, name, data)?;
    }
    Ok(b.into_inner()?)
}

/// Publishes version `version` of the storm image (with these kernel and initrd bytes)
/// and points `tag` at it; publishing it again is harmless.
pub async fn publish(
    http: &reqwest::Client,
    base: &str,
    token: &str,
    version: &str,
    tag: &str,
    kernel: &[u8],
    initrd: &[u8],
) -> anyhow::Result<()> {
    let r = http
        .post(format!("{base}/api/v1/images?tag={tag}"))
        .bearer_auth(token)
        .body(bundle(version, kernel, initrd)?)
        .send()
        .await
        .context("cannot reach the server")?;
    let status = r.status();
    let image: serde_json::Value = r.json().await?;
    anyhow::ensure!(
        status.is_success() || status == 409,
        "publish refused ({status}): {image}"
    );
    Ok(())
}

/// Publishes the storm image under `TAG`, assigns it to nodes `0..nodes`, and writes the
/// kernel and initrd into `reference_dir` (for nginx) when given. Returns the blob URLs.
pub async fn setup(
    server: &str,
    token: &str,
    nodes: u32,
    kernel_mib: f64,
    initrd_mib: f64,
    reference_dir: Option<&Path>,
) -> anyhow::Result<Vec<String>> {
    let kernel = noise((kernel_mib * 1048576.0) as usize, 1);
    let initrd = noise((initrd_mib * 1048576.0) as usize, 2);
    if let Some(dir) = reference_dir {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("vmlinuz"), &kernel)?;
        std::fs::write(dir.join("initrd.img"), &initrd)?;
    }
    let http = crate::http_client::builder()
        .timeout(Duration::from_secs(300))
        .build()?;
    let base = server.trim_end_matches('/');
    publish(&http, base, token, "1", TAG, &kernel, &initrd).await?;
    let assigned = futures_util::stream::iter(0..nodes)
        .map(|i| {
            let (http, url) = (
                http.clone(),
                format!("{base}/api/v1/nodes/{}/image", mac_string(mac(i))),
            );
            async move {
                let r = http
                    .put(&url)
                    .bearer_auth(token)
                    .json(&crate::api::node::AssignRequest { image: TAG.into() })
                    .send()
                    .await?;
                anyhow::ensure!(r.status().is_success(), "assign: {}", r.status());
                Ok(())
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<anyhow::Result<()>>>()
        .await;
    assigned.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
    let digest = |data: &[u8]| crate::api::Digest::of(data).hex();
    Ok(vec![
        format!("{base}/blobs/sha256/{}", digest(&kernel)),
        format!("{base}/blobs/sha256/{}", digest(&initrd)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_are_distinct_and_locally_administered() {
        assert_eq!(mac_string(mac(258)), "02:bf:00:00:01:02");
        assert_ne!(mac(1), mac(1 << 24));
        assert_eq!(noise(1000, 3), noise(1000, 3));
        assert_ne!(noise(64, 3), noise(64, 4));
    }
}
