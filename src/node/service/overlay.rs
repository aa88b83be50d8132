//! A two-stage boot's per-node overlay, for stage 1 (the boot token is its credential):
//! rendered from the node's record and its boot's image, as the tar stage 1 applies.

use super::attest::{AttestError, Caller};
use super::{BootError, NodeService};
use crate::boot::overlay::{OverlayImage, OverlayNode, tar};

impl NodeService {
    pub async fn overlay(&self, caller: &Caller) -> Result<Vec<u8>, AttestError> {
        let boot = caller.boot();
        // Stage 1 fetches it before the image runs; the token stays readable on the node
        // (/proc/cmdline) for the agent, so once the boot has attested, no one gets the
        // node's files (keys among them) with it.
        if boot.attested() {
            return Err(AttestError::Refused(
                super::attest::Refusal::OverlayAfterAttest,
            ));
        }
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
                known_name: node
                    .hostname
                    .as_deref()
                    .filter(|h| crate::node::directory::valid_hostname(h)),
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
