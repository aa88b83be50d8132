//! What the DHCP server asks of the rest of the server, as two small traits: the node
//! directory (what is known of a client, told what DHCP saw) and the lease journal (where
//! bound leases are kept). DHCP imports no store and reads no label: the node service
//! answers both, and the label rules live there.

use async_trait::async_trait;

use super::decide::NodeView;
use super::leases::Lease;
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

    /// DHCP answered the network-booting client `mac` (`step`: `dhcp offer`, `ipxe dhcp
    /// ack`...; `outcome`: what it was given), for the node's boot timeline. Called per
    /// answer, so it must not wait on anything.
    fn answered(&self, _mac: Mac, _step: String, _outcome: String) {}
}

#[async_trait]
pub trait LeaseJournal: Send + Sync {
    /// The bound leases saved before.
    async fn load(&self) -> Result<Vec<Lease>, String>;
    /// Saves a batch of changes: leases to keep, and leases that ended (forgotten only
    /// while the saved lease of that MAC still names that address: with several servers,
    /// another may have bound the client since).
    async fn save(&self, keep: &[Lease], gone: &[Lease]) -> Result<(), String>;
}

/// How DHCP came to know a client's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Witnessed {
    /// It holds a lease from us (authoritative mode): the strong witness.
    Leased,
    /// It asked another server for this address (proxy mode: option 50 or `ciaddr` of
    /// its DHCPREQUEST). Anyone on the segment can send such a request in its name.
    Requested,
}

/// What DHCP saw of a client on the wire: the address it holds or asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireAddress {
    pub ip: std::net::Ipv4Addr,
    pub how: Witnessed,
}

/// DHCP's answer to "which address does this MAC use?", asked by the node service
/// before it starts a boot for a request that names the MAC.
pub trait AddressBook: Send + Sync {
    /// The address `mac` holds or asked for, when DHCP knows it and it has not expired.
    fn address_of(&self, mac: Mac, now_ms: i64) -> Option<WireAddress>;
    /// The MAC that holds or asked for `ip` (who a TFTP client is).
    fn mac_at(&self, ip: std::net::Ipv4Addr, now_ms: i64) -> Option<Mac>;
}
