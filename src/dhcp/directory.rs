//! What the DHCP server asks of the rest of the server, as two small traits: the node
//! directory (what is known of a client, told what DHCP saw) and the lease journal (where
//! bound leases are kept). DHCP imports no store and reads no label: the node service
//! answers both, and the label rules live there.

use async_trait::async_trait;

use super::decide::NodeView;
use super::leases::{HwAddr, Lease};
use crate::api::Mac;

#[async_trait]
pub trait NodeDirectory: Send + Sync {
    /// What is known of the network-booting client `mac` (with the machine UUID its
    /// firmware sent), recording it when it is new. `chainload` in the answer says the
    /// node itself asks to be chainloaded; the server's `[dhcp] chainload` adds to it.
    /// None when the directory cannot answer (its store is unreachable): the packet is
    /// dropped, so that another server sharing the segment answers instead of this one
    /// answering "no boot file".
    async fn node_view(&self, mac: Mac, uuid: Option<&str>) -> Option<NodeView>;
}

#[async_trait]
pub trait LeaseJournal: Send + Sync {
    /// The bound leases saved before.
    async fn load(&self) -> Result<Vec<Lease>, String>;
    /// Saves a batch of changes: leases to keep, MACs whose lease is gone.
    async fn save(&self, keep: &[Lease], gone: &[HwAddr]) -> Result<(), String>;
}
