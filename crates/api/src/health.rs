//! Fleet health as the API shows it: a node's recent readings (from its heartbeats) and
//! the verdicts of the server's `[health]` rules on them. The rules are the server's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One rule's verdict on one GPU, port or node, with the readings that tripped it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthVerdict {
    /// The rule (`[health] rules`), as named in its config.
    pub rule: String,
    /// `flag`, `degrade`, `revalidate`, `reimage` or `quarantine`.
    pub action: String,
    /// What it is about: `gpu 3 (GPU-...)`, `port mlx5_0/1`, or `node`.
    pub subject: String,
    /// In words, with the figures.
    pub summary: String,
    /// The readings that tripped the rule, by name.
    pub readings: BTreeMap<String, serde_json::Value>,
    /// When it was given (RFC 3339).
    pub at: String,
}

/// One GPU in one heartbeat, kept compact.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuReading {
    pub index: u32,
    pub temperature_c: Option<u32>,
    pub power_w: Option<f64>,
    pub sm_clock_mhz: Option<u32>,
    /// Throttle reasons now; None when they could not be read.
    pub throttle_reasons: Option<Vec<String>>,
    pub ecc_corrected: Option<u64>,
    pub ecc_uncorrected: Option<u64>,
    pub xids: u64,
}

/// One InfiniBand port in one heartbeat.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PortReading {
    pub port: String,
    pub state: Option<String>,
    pub rate_gbps: Option<f64>,
    pub link_downed: Option<u64>,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HealthReading {
    pub at: String,
    pub gpus: Vec<GpuReading>,
    pub ports: Vec<PortReading>,
}

/// `GET /api/v1/nodes/{mac}/health`, and `health` in a node's detail: what this server
/// heard of the node's current boot.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeHealth {
    pub boot_id: String,
    /// The newest readings, oldest first (`[health] keep_readings` of them).
    pub readings: Vec<HealthReading>,
    /// The verdicts that hold now (a condition that cleared drops its verdict; an XID's
    /// stays for the boot).
    pub verdicts: Vec<HealthVerdict>,
}
