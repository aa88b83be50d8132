//! A two-stage boot's per-node overlay, for stage 1 (the boot token is its credential):
//! rendered from the node's record and its boot's image, as the tar stage 1 applies.

use super::attest::{AttestError, Caller};
use super::{BootError, NodeService};
use crate::boot::overlay::{OverlayImage, OverlayNode, tar};

impl NodeService {
    pub async fn overlay(&self, caller: &Caller) -> Result<Vec<u8>, AttestError> {
        let boot = caller.boot();
        let node = self
            .store
            .node(&boot.mac)
            .await?
            .ok_or_else(|| AttestError::NotNow(format!("node {} is gone", boot.mac)))?;
        let image = self
            .image(&boot.image)
            .await?
            .ok_or_else(|| AttestError::NotNow(format!("image {} is gone", boot.image)))?;
        let files = self
            .overlay
            .render(&OverlayNode {
                mac: boot.mac,
                known_name: node.hostname.as_deref(),
                labels: &node.labels,
                image: OverlayImage {
                    name: &image.record.name,
                    version: &image.record.version,
                    digest: boot.image,
                },
            })
            .map_err(|e| AttestError::Boot(BootError::from(e)))?;
        Ok(tar(&files))
    }
}
