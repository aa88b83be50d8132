//! The node service: what a booting node gets (discovery of unknown MACs, the assigned
//! image resolved to a digest, a boot record with a fresh token stored hashed, the state
//! change, the rendered script), and the agent's calls: `attest`, `validate`,
//! `heartbeat`; `fetches` attributes blob downloads to boots, `timeline` reads a boot back
//! as steps. Node state changes go through the controller (`node::controller`).

pub mod admin;

/// The boot program a node script is written for.
pub use crate::boot::script::Loader;
pub mod attest;
pub mod fetches;
pub mod fleet;
pub mod health;
pub mod heartbeat;
pub mod overlay;
pub mod timeline;
pub mod tpm;
pub mod validate;

use std::sync::Arc;

use sha2::{Digest as _, Sha256};

use crate::api::Digest;
use crate::api::Mac;
use crate::api::NodeState;
use crate::api::image::Role;
use crate::api::refs::ImageRef;
use crate::boot::script::{BootTemplates, ImageBoot, InitrdRef, NodeBoot, TemplateError, blob_url};
use crate::image::manifest::Manifest;
use crate::node::boot_guard::Refusal;
use crate::node::controller::{ControlError, NodeController};
use crate::node::state::NodeEvent;
use crate::registry::Registry;
use crate::store::{Attached, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The request may not start a boot (wrong address, or too many boots of its MAC).
    #[error(transparent)]
    Refused(#[from] Refusal),
}

pub struct NodeService {
    pub store: crate::store::Store,
    pub registry: Registry,
    pub templates: BootTemplates,
    /// The operator's per-node overlay files (two-stage images).
    pub overlay: Arc<crate::boot::overlay::Overlay>,
    pub controller: NodeController,
    pub fetches: fetches::FetchRecorder,
    pub reimage: crate::node::reimage::ReimageService,
    pub policy: crate::node::policy::LifecyclePolicy,
    /// Published images never change, so what a boot needs of one is parsed once.
    pub images: ImageCache,
    /// Who may start a new boot of a MAC.
    pub guard: crate::node::boot_guard::BootGuard,
    /// What DHCP saw of each MAC on the wire; set when this server runs DHCP.
    pub addresses: std::sync::OnceLock<Arc<dyn crate::dhcp::directory::AddressBook>>,
    /// DHCP answers and TFTP transfers since each node's last script.
    pub preboot: Arc<crate::node::preboot::Preboot>,
    /// Each node's readings over time and the `[health]` rules' verdicts on them.
    pub health: Arc<crate::health::Health>,
    /// When nodes were last heard, stored in batches (a heartbeat writes nothing itself).
    pub liveness: Arc<crate::node::liveness::Liveness>,
    /// Each node's latest boot's drift baseline, read once (`heartbeat::Baselines`).
    pub baselines: heartbeat::Baselines,
    /// The declared InfiniBand cabling validation checks ports against (`[fabric]`).
    pub fabric: Option<Arc<crate::fabric::topology::Topology>>,
    /// What TPM evidence is checked with (`[tpm]`, the iPXE binaries served).
    pub trust: Arc<crate::tpm::Trust>,
}

/// What a boot needs of an image, parsed once per digest.
pub struct CachedImage {
    pub record: crate::api::image::Image,
    pub manifest: Manifest,
}

/// Images by digest. Bounded: past `IMAGE_CACHE_MAX` entries it starts over (a fleet
/// boots a handful of images at a time, so this is rare and cheap).
#[derive(Default)]
pub struct ImageCache(std::sync::Mutex<std::collections::HashMap<Digest, Arc<CachedImage>>>);

const IMAGE_CACHE_MAX: usize = 256;

impl NodeService {
    /// The image `digest`, from the cache or the store; None if it is not published or
    /// its stored manifest no longer parses.
    pub async fn image(&self, digest: &Digest) -> Result<Option<Arc<CachedImage>>, StoreError> {
        if let Some(hit) = self.images.0.lock().expect("not poisoned").get(digest) {
            return Ok(Some(hit.clone()));
        }
        let store = &self.store;
        let (Some(record), Some(manifest)) = (
            store.image(digest).await?,
            store.manifest_toml(digest).await?,
        ) else {
            return Ok(None);
        };
        let Ok(manifest) = Manifest::parse(&manifest) else {
            return Ok(None);
        };
        let image = Arc::new(CachedImage { record, manifest });
        let mut cache = self.images.0.lock().expect("not poisoned");
        if cache.len() >= IMAGE_CACHE_MAX {
            cache.clear();
        }
        cache.insert(*digest, image.clone());
        Ok(Some(image))
    }
}

static WRONG_ADDRESS: crate::node::sampled::Sampled = crate::node::sampled::Sampled::new(
    "boot requests refused: not from the address DHCP saw the MAC use",
);
static TOO_SOON: crate::node::sampled::Sampled =
    crate::node::sampled::Sampled::new("boot requests refused: too many boots of one MAC");

/// A fresh random secret as lowercase hex.
fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::fill(&mut buf[..]);
    hex::encode(buf)
}

impl NodeService {
    pub fn entry(&self, server: &str) -> Result<String, BootError> {
        Ok(self.templates.ipxe().entry(server)?)
    }

    /// The script for `mac`, for its boot program, asked for from `from`, recording
    /// what happened.
    pub async fn node_script(
        &self,
        server: &str,
        mac: &Mac,
        uuid: Option<&str>,
        from: Option<std::net::IpAddr>,
        loader: crate::boot::script::Loader,
    ) -> Result<String, BootError> {
        let started = std::time::Instant::now();
        let scripts = self.templates.scripts(loader);
        let hyphens = mac.to_string().replace(':', "-");
        let Some((node, new)) = self
            .controller
            .discover(mac, uuid, "first seen network-booting")
            .await?
        else {
            // Past the discovery cap: the unknown script, nothing recorded.
            return Ok(scripts.unknown(server, &hyphens)?);
        };
        if let (Some(seen), Some(kept)) = (uuid, node.uuid.as_deref())
            && !seen.eq_ignore_ascii_case(kept)
        {
            // A replaced board, or a host asking in another node's name.
            tracing::warn!(security = true, %mac, seen, kept, "boot request names another UUID than the node's; the first one seen is kept");
        }
        if new {
            return Ok(scripts.unknown(server, &hyphens)?);
        }
        // The same rule as DHCP's: a node labelled boot=local gets no image on any path.
        if crate::node::directory::boots_locally(&node.labels) {
            return Ok(scripts.unassigned(server, &hyphens, true)?);
        }
        let Some(assigned) = node.assigned.clone() else {
            return Ok(scripts.unassigned(server, &hyphens, false)?);
        };
        if node.state == NodeState::Quarantined {
            return Ok(scripts.held(server, &hyphens, node.state.as_str(), &node.state_reason)?);
        }
        let now = crate::clock::now_ms();
        let seen = self
            .addresses
            .get()
            .and_then(|book| book.address_of(*mac, now));
        if let Err(refusal) = self.guard.admit(mac, from, seen, now) {
            // Counted, not logged one by one: unauthenticated traffic may flood.
            match refusal {
                Refusal::Elsewhere { .. } => WRONG_ADDRESS.note(),
                Refusal::TooSoon { .. } => TOO_SOON.note(),
            }
            tracing::debug!(%mac, reason = %refusal, "boot request refused");
            return Err(refusal.into());
        }
        let boot_id = random_hex(8);
        let image = match self.resolve_image(server, &assigned, &boot_id).await? {
            Ok(image) => image,
            Err(reason) => {
                tracing::warn!(%mac, reason, "cannot boot node");
                return Ok(scripts.held(server, &hyphens, node.state.as_str(), &reason)?);
            }
        };
        // The token names its boot, so agent calls are checked from the header alone.
        let token = format!("{boot_id}.{}", random_hex(32));
        let token_sha256 = Digest::from_hasher(Sha256::new_with_prefix(token.as_bytes()));
        let reason = format!(
            "boot {boot_id}: {}:{} {}",
            image.name, image.version, image.digest
        );
        let preboot = self.preboot.take(mac, now);
        let preboot_json = if preboot.is_empty() {
            None
        } else {
            serde_json::to_string(&preboot).ok()
        };
        let boot = Attached::Boot(crate::store::NewBoot {
            id: &boot_id,
            image: &image.digest,
            token_sha256: &token_sha256,
            preboot_json: preboot_json.as_deref(),
        });
        self.controller
            .apply_with(mac, NodeEvent::BootStarted, &reason, Some(&boot))
            .await?;
        self.time_script(started, &preboot, now);
        Ok(scripts.node(&NodeBoot {
            server,
            mac: &hyphens,
            boot_id: &boot_id,
            token: &token,
            image: &image,
            rootfs_cache: crate::node::directory::rootfs_cache(&node.labels),
        })?)
    }

    /// The script's own time, and DHCP's: its first answer to this request.
    fn time_script(
        &self,
        started: std::time::Instant,
        preboot: &[crate::node::preboot::PrebootStep],
        now_ms: i64,
    ) {
        use crate::metrics::phase;
        let metrics = self.controller.metrics();
        metrics.boot_phase(phase::SCRIPT, started.elapsed().as_secs_f64());
        let first_dhcp = preboot
            .iter()
            .filter(|s| s.step.contains("dhcp"))
            .map(|s| s.at_ms)
            .min();
        if let Some(first) = first_dhcp {
            metrics.boot_phase(phase::DHCP, (now_ms - first) as f64 / 1000.0);
        }
    }

    /// The assigned REF resolved now (a tag moves between boots), as the script needs it.
    async fn resolve_image(
        &self,
        server: &str,
        assigned: &str,
        boot_id: &str,
    ) -> Result<Result<ImageBoot, String>, BootError> {
        let unpublished = || Ok(Err(format!("assigned image {assigned} is not published")));
        let Ok(reference) = ImageRef::parse(assigned) else {
            return unpublished();
        };
        let Some(digest) = self.store.resolve(&reference).await? else {
            return unpublished();
        };
        let Some(image) = self.image(&digest).await? else {
            return unpublished();
        };
        // An image missing a blob is never handed out: the node would 404, retry and
        // reboot in a loop. It waits, held, with the reason.
        let broken = self.store.broken_blobs().await?;
        if let Some(why) = crate::registry::broken_reason(&image.record, &broken) {
            return Ok(Err(why));
        }
        let artifacts = &image.record.artifacts;
        let Some(kernel) = artifacts.iter().find(|a| a.role == Role::Kernel) else {
            return unpublished();
        };
        let initrds = artifacts
            .iter()
            .filter(|a| a.role == Role::Initrd)
            .map(|a| InitrdRef {
                // iPXE names the image after the last path component; UEFI kernels look
                // it up by that name (initrd=<name>).
                name: a.path.rsplit('/').next().unwrap_or(&a.path).to_string(),
                url: blob_url(server, &a.digest, boot_id),
            })
            .collect();
        Ok(Ok(ImageBoot {
            name: image.record.name.clone(),
            version: image.record.version.clone(),
            digest,
            kernel_url: blob_url(server, &kernel.digest, boot_id),
            initrds,
            cmdline: image.manifest.cmdline.clone(),
            dcgm_level: image.manifest.spec.dcgm_level,
            rootfs: rootfs_boot(&image),
        }))
    }
}

/// A two-stage image's root for its script: the rootfs blob and its verity parameters.
fn rootfs_boot(image: &CachedImage) -> Option<crate::boot::script::RootfsBoot> {
    let verity = image.manifest.rootfs_spec.as_ref()?.verity.clone()?;
    let blob = image
        .record
        .artifacts
        .iter()
        .find(|a| a.role == Role::Rootfs)?;
    Some(crate::boot::script::RootfsBoot {
        digest: blob.digest,
        size: blob.size,
        verity,
    })
}
