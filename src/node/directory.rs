//! The node service's answers to DHCP (`dhcp::directory`): the node view of a client,
//! recording a MAC seen for the first time, and the label rules for what a node is
//! given (`boot=local`, `ipxe=chainload`), written once here for every path.

use std::collections::BTreeMap;

use async_trait::async_trait;

use crate::api::{Mac, NodeState};
use crate::dhcp::decide::NodeView;
use crate::dhcp::directory::NodeDirectory;
use crate::node::controller::NodeController;
use crate::store::Store;

/// Label `boot=local`: the node boots from its own disk; we hand it no boot file.
pub fn boots_locally(labels: &BTreeMap<String, String>) -> bool {
    labels.get("boot").is_some_and(|v| v == "local")
}

/// Label `ipxe=chainload`: the node's own iPXE is replaced by ours before its script.
pub fn wants_chainload(labels: &BTreeMap<String, String>) -> bool {
    labels.get("ipxe").is_some_and(|v| v == "chainload")
}

/// Label `rootfs-cache=FS_LABEL`: a two-stage boot keeps its verified root on the node's
/// file system with that label (ext4), keyed by digest, so a reboot into the same image
/// reads it from there instead of the network (dm-verity still checks every block).
pub fn rootfs_cache(labels: &BTreeMap<String, String>) -> Option<&str> {
    labels
        .get("rootfs-cache")
        .map(String::as_str)
        .filter(|l| valid_fs_label(l))
}

/// An ext4 file-system label that is safe on a kernel command line: 1 to 16 characters
/// from A-Z a-z 0-9 . _ - (a space would start another boot parameter).
pub fn valid_fs_label(label: &str) -> bool {
    (1..=16).contains(&label.len())
        && label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Label `hostname=NAME`: the node's host name in a two-stage boot's overlay, when it is
/// one.
pub use crate::api::refs::is_hostname as valid_hostname;

/// The directory over the store: known nodes from the store's DHCP cache (memory, for
/// nearly every packet), new MACs recorded as discovered.
pub struct StoreDirectory {
    pub store: Store,
    pub controller: NodeController,
    /// Where DHCP's answers go, to open the node's next boot timeline.
    pub preboot: std::sync::Arc<crate::node::preboot::Preboot>,
}

#[async_trait]
impl NodeDirectory for StoreDirectory {
    async fn node_view(&self, mac: Mac, uuid: Option<&str>) -> Option<NodeView> {
        // A known node with a UUID is answered from memory: the first UUID is kept, so
        // a packet naming another one would change nothing.
        let known = match self.store.node_for_dhcp(&mac).await {
            Ok(Some(node)) if uuid.is_none() || node.uuid.is_some() => Ok(Some(node)),
            _ => self
                .controller
                .discover(&mac, uuid, "first seen in DHCP")
                .await
                .map(|found| found.map(|(node, _)| node)),
        };
        match known {
            // Past the discovery cap: not recorded, not answered.
            Ok(None) => None,
            Ok(Some(node)) => Some(NodeView {
                bootable: node.assigned.is_some() && node.state != NodeState::Quarantined,
                local_boot: boots_locally(&node.labels),
                chainload: wants_chainload(&node.labels),
            }),
            Err(e) => {
                tracing::warn!(%mac, error = %e, "cannot look the node up; not answering it");
                None
            }
        }
    }

    fn answered(&self, mac: Mac, step: String, outcome: String) {
        self.preboot
            .record(mac, step, outcome, crate::clock::now_ms());
    }
}
