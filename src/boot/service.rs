//! What a booting node gets: discovery of unknown MACs, the assigned image resolved to a
//! digest, a boot record with a fresh token (stored hashed), the state change, the script.

use sha2::{Digest as _, Sha256};

use super::script::{BootTemplates, ImageBoot, InitrdRef, NodeBoot, TemplateError, blob_url};
use crate::digest::Digest;
use crate::image::manifest::{Manifest, Role};
use crate::image::refs::ImageRef;
use crate::node::controller::{ControlError, NodeController};
use crate::node::mac::Mac;
use crate::node::state::{NodeEvent, NodeState};
use crate::registry::Registry;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Control(#[from] ControlError),
}

pub struct BootService {
    pub registry: Registry,
    pub templates: BootTemplates,
    pub controller: NodeController,
}

/// A fresh random secret as lowercase hex.
fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::fill(&mut buf[..]);
    hex::encode(buf)
}

impl BootService {
    pub fn entry(&self, server: &str) -> Result<String, BootError> {
        Ok(self.templates.entry(server)?)
    }

    /// The script for `mac`, recording what happened.
    pub async fn node_script(
        &self,
        server: &str,
        mac: &Mac,
        uuid: Option<&str>,
    ) -> Result<String, BootError> {
        let store = &self.registry.store;
        let (node, new) = store
            .discover(mac, uuid, "first seen network-booting")
            .await?;
        let hyphens = mac.to_string().replace(':', "-");
        if new {
            return Ok(self.templates.unknown(server, &hyphens)?);
        }
        let Some(assigned) = node.assigned.clone() else {
            return Ok(self.templates.unassigned(server, &hyphens, false)?);
        };
        if node.state == NodeState::Quarantined {
            return Ok(self.templates.held(
                server,
                &hyphens,
                node.state.as_str(),
                &node.state_reason,
            )?);
        }
        let image = match self.resolve_image(server, &assigned).await? {
            Some(image) => image,
            None => {
                let reason = format!("assigned image {assigned} is not published");
                tracing::warn!(%mac, reason, "cannot boot node");
                return Ok(self
                    .templates
                    .held(server, &hyphens, node.state.as_str(), &reason)?);
            }
        };
        let boot_id = random_hex(8);
        let token = random_hex(32);
        store
            .open_boot(
                &boot_id,
                mac,
                &image.digest,
                &Digest::from_hasher(Sha256::new_with_prefix(token.as_bytes())),
            )
            .await?;
        let reason = format!(
            "boot {boot_id}: {}:{} {}",
            image.name, image.version, image.digest
        );
        self.controller
            .apply(mac, NodeEvent::BootStarted, &reason)
            .await?;
        Ok(self.templates.node(&NodeBoot {
            server,
            mac: &hyphens,
            boot_id: &boot_id,
            token: &token,
            image: &image,
        })?)
    }

    /// The assigned REF resolved now (a tag moves between boots), as the script needs it.
    async fn resolve_image(
        &self,
        server: &str,
        assigned: &str,
    ) -> Result<Option<ImageBoot>, BootError> {
        let Ok(reference) = ImageRef::parse(assigned) else {
            return Ok(None);
        };
        let Some(digest) = self.registry.store.resolve(&reference).await? else {
            return Ok(None);
        };
        let store = &self.registry.store;
        let (Some(record), Some(manifest)) = (
            store.image(&digest).await?,
            store.manifest_toml(&digest).await?,
        ) else {
            return Ok(None);
        };
        let Ok(manifest) = Manifest::parse(&manifest) else {
            return Ok(None);
        };
        let kernel = record.artifacts.iter().find(|a| a.role == Role::Kernel);
        let Some(kernel) = kernel else {
            return Ok(None);
        };
        let initrds = record
            .artifacts
            .iter()
            .filter(|a| a.role == Role::Initrd)
            .map(|a| InitrdRef {
                // iPXE names the image after the last path component; UEFI kernels look
                // it up by that name (initrd=<name>).
                name: a.path.rsplit('/').next().unwrap_or(&a.path).to_string(),
                url: blob_url(server, &a.digest),
            })
            .collect();
        Ok(Some(ImageBoot {
            name: record.name,
            version: record.version,
            digest,
            kernel_url: blob_url(server, &kernel.digest),
            initrds,
            cmdline: manifest.cmdline,
        }))
    }
}
