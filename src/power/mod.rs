//! Power control through nodes' BMCs: drivers behind one small trait (`Driver`: power
//! state, on, off, graceful off, cycle, a one-time network boot read back, inventory),
//! Redfish over HTTPS (`redfish`) and IPMI 2.0 over RMCP+ (`ipmi`), the
//! credentials they use (`secrets`, never logged or returned), the service that runs an
//! action for a node within its rate limits and records it (`service`), and the loop that
//! carries a reimage to nodes that do not answer (`fallback`).

pub mod fallback;
pub mod ipmi;
pub mod redfish;
pub mod secrets;
pub mod service;
pub mod tls;

use std::time::Duration;

use async_trait::async_trait;

use crate::api::power::{BmcInventory, PowerState};

/// What a driver asks the BMC to do to its machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    On,
    ForceOff,
    GracefulOff,
    /// Off and on again, from on (the service sends `On` to a machine that is off).
    Cycle,
}

/// Why a BMC did not do what was asked. The text is what an operator reads: the BMC's
/// own message where it gave one.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PowerError {
    /// The node's BMC settings or its secret cannot be used.
    #[error("{0}")]
    Config(String),
    #[error("BMC unreachable: {0}")]
    Unreachable(String),
    #[error("BMC did not answer within {} s", .0.as_secs())]
    Timeout(Duration),
    #[error("BMC refused the credentials: {0}")]
    Auth(String),
    #[error("BMC's certificate refused: {0}")]
    Tls(String),
    /// The BMC answered with an error (a Redfish 4xx/5xx, an IPMI completion code).
    #[error("BMC refused: {0}")]
    Refused(String),
    /// The BMC accepted a one-time network boot but reads back something else.
    #[error("{0}")]
    NotKept(String),
}

/// One BMC, reached with its settings and credentials.
#[async_trait]
pub trait Driver: Send + Sync {
    async fn state(&self) -> Result<PowerState, PowerError>;
    async fn act(&self, op: Op) -> Result<(), PowerError>;
    /// Sets a one-time network boot (UEFI where the machine boots UEFI) and reads it back;
    /// returns what the BMC reads back, as text.
    async fn netboot_once(&self) -> Result<String, PowerError>;
    async fn inventory(&self) -> Result<BmcInventory, PowerError>;
    /// The host's NIC MACs, where the BMC reports them (a few more requests: asked for
    /// when a machine is registered by its BMC, not at every status).
    async fn nic_macs(&self) -> Result<Vec<crate::api::Mac>, PowerError> {
        Ok(Vec::new())
    }
    /// Ends what the driver opened on the BMC (a Redfish session: BMCs have few).
    async fn close(&self) {}
}
