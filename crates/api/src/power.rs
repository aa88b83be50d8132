//! Power control through a node's BMC as the admin API speaks it: how a node's BMC is
//! reached (never its credentials, only their name), the power actions, and what a BMC
//! answered.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::Mac;

/// The protocol a BMC speaks.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BmcProtocol {
    /// DMTF Redfish over HTTPS.
    Redfish,
    /// IPMI 2.0 over RMCP+ (lanplus).
    Ipmi,
}

impl BmcProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            BmcProtocol::Redfish => "redfish",
            BmcProtocol::Ipmi => "ipmi",
        }
    }
}

/// A node's baseboard management controller. Credentials are never stored here, only the
/// name of the secret that holds them.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bmc {
    pub protocol: BmcProtocol,
    /// Redfish: `https://HOST[:PORT]`, optionally with the system's path
    /// (`/redfish/v1/Systems/ID`) when the BMC manages more than one. IPMI: `HOST[:PORT]`.
    pub address: String,
    /// Name of the secret (a file in the server's secrets directory) holding the
    /// username and password.
    pub credential: Option<String>,
    /// Redfish: name of a PEM file in the secrets directory with the CA (or the BMC's own
    /// self-signed certificate) to trust, instead of the system's roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<String>,
    /// Redfish: the SHA-256 of the BMC's certificate (DER), hex: that certificate and no
    /// other is accepted, whoever signed it (BMCs mostly present self-signed ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// Redfish: accept any certificate (or plain `http://`). Logged at every use.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure: bool,
    /// Ways this BMC departs from its protocol that the driver must work around.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quirks: Vec<BmcQuirk>,
}

/// A known departure of a BMC from its protocol, set per BMC by the operator: a driver
/// never guesses one, because a wrong guess hides a real failure.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BmcQuirk {
    /// IPMI: the BMC applies a one-time boot device but reads the boot flags back with
    /// their "valid" bit clear, so the read-back after `bootdev` can only check the device
    /// selector. OpenIPMI's `ipmi_sim` with a `chassis_control` program does this: it keeps
    /// the selector and drops the rest of the flags byte.
    BootValidUnreported,
}

impl BmcQuirk {
    pub const ALL: [BmcQuirk; 1] = [BmcQuirk::BootValidUnreported];

    pub fn as_str(self) -> &'static str {
        match self {
            BmcQuirk::BootValidUnreported => "boot-valid-unreported",
        }
    }
}

impl std::str::FromStr for BmcQuirk {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|q| q.as_str() == s)
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|q| q.as_str()).collect();
                format!("unknown BMC quirk {s:?} (known: {})", known.join(", "))
            })
    }
}

impl fmt::Display for Bmc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.protocol.as_str(), self.address)
    }
}

/// `PUT /api/v1/nodes/{mac}/bmc` takes a `Bmc`; `DELETE` forgets it.
pub type BmcRequest = Bmc;

/// What a power request does.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PowerAction {
    On,
    /// Off at once (Redfish `ForceOff`, IPMI `power off`).
    Off,
    /// Ask the OS to shut down (Redfish `GracefulShutdown`, IPMI `power soft`).
    SoftOff,
    /// Off and on again (or on, if it was off): the node boots afresh.
    Cycle,
}

impl PowerAction {
    pub const ALL: [PowerAction; 4] = [
        PowerAction::On,
        PowerAction::Off,
        PowerAction::SoftOff,
        PowerAction::Cycle,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PowerAction::On => "on",
            PowerAction::Off => "off",
            PowerAction::SoftOff => "soft-off",
            PowerAction::Cycle => "cycle",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.as_str() == s)
    }

    /// Whether the action takes a running node down (and so counts against the
    /// disruption budget).
    pub fn disrupts(self) -> bool {
        !matches!(self, PowerAction::On)
    }
}

impl fmt::Display for PowerAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// `POST /api/v1/nodes/{mac}/power`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PowerRequest {
    pub action: PowerAction,
    /// Why, for the node's history and the event log (1-1024 characters).
    pub reason: String,
    /// Set a one-time network boot first (default: yes for `on` and `cycle`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netboot: Option<bool>,
}

/// A machine's power as its BMC reports it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PowerState {
    On,
    Off,
    /// Between the two (Redfish `PoweringOn`/`PoweringOff`), or a value we do not know.
    Changing,
}

impl PowerState {
    pub fn as_str(self) -> &'static str {
        match self {
            PowerState::On => "on",
            PowerState::Off => "off",
            PowerState::Changing => "changing",
        }
    }
}

impl fmt::Display for PowerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// What a BMC tells about its machine for free.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BmcInventory {
    pub manufacturer: Option<String>,
    pub model: Option<String>,
    pub serial: Option<String>,
    pub bios_version: Option<String>,
    /// The SMBIOS UUID, where the BMC reports one.
    pub uuid: Option<String>,
    /// NIC MACs the BMC reports, where it does.
    #[serde(default)]
    pub macs: Vec<Mac>,
}

/// `GET /api/v1/nodes/{mac}/power`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PowerStatus {
    pub node: Mac,
    /// `redfish https://...` or `ipmi host:port`.
    pub bmc: String,
    pub state: PowerState,
    pub inventory: BmcInventory,
}

/// The answer to a power request that the BMC carried out (200).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PowerDone {
    pub node: Mac,
    pub action: PowerAction,
    /// The one-time network boot as read back from the BMC after it was set, when one
    /// was asked for (`pxe once`, or what the BMC kept instead).
    pub netboot: Option<String>,
    /// The node's state afterwards (`reimaging` when the action counted against the
    /// disruption budget).
    pub node_state: crate::NodeState,
}

/// One power action in a node's record, newest first in `NodeDetail.power`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PowerEntry {
    pub at: String,
    /// `on`, `off`, `soft-off`, `cycle`.
    pub action: String,
    /// Who asked and why (`admin: ...`, `reimage: no reboot asked for within 300 s`).
    pub reason: String,
    /// `ok`, or the BMC's error.
    pub outcome: String,
    pub took_ms: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_round_trip_by_name() {
        for a in PowerAction::ALL {
            assert_eq!(PowerAction::parse(a.as_str()), Some(a));
            let json = serde_json::to_string(&a).unwrap();
            assert_eq!(json, format!("\"{a}\""));
        }
        assert!(PowerAction::parse("reset").is_none());
        assert!(!PowerAction::On.disrupts());
        assert!(PowerAction::Cycle.disrupts());
    }

    #[test]
    fn a_bmc_without_tls_options_reads_and_writes_compactly() {
        let b: Bmc = serde_json::from_str(
            r#"{"protocol":"ipmi","address":"10.0.0.9:623","credential":"rack12"}"#,
        )
        .unwrap();
        assert_eq!(b.protocol, BmcProtocol::Ipmi);
        assert!(!b.insecure && b.ca.is_none());
        assert_eq!(
            serde_json::to_string(&b).unwrap(),
            r#"{"protocol":"ipmi","address":"10.0.0.9:623","credential":"rack12"}"#
        );
        assert_eq!(b.to_string(), "ipmi 10.0.0.9:623");
        assert!(serde_json::from_str::<Bmc>(r#"{"protocol":"snmp","address":"x"}"#).is_err());
        assert!(
            serde_json::from_str::<Bmc>(r#"{"protocol":"ipmi","address":"x","password":"p"}"#)
                .is_err()
        );
    }
}

/// A machine known only by its BMC (`POST /api/v1/bmcs` takes a `Bmc`): it can be powered
/// on into network boot before its MAC is known, and is matched to its node when it
/// boots, by a NIC MAC or the system UUID its BMC reported.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BmcRegistration {
    pub id: i64,
    pub bmc: Bmc,
    /// The SMBIOS UUID the BMC reported, lower case.
    pub uuid: Option<String>,
    /// The host's NIC MACs the BMC reported.
    pub macs: Vec<Mac>,
    pub registered: String,
}

/// `POST /api/v1/bmcs/{id}/power` answers this.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisteredPowerDone {
    pub id: i64,
    pub action: PowerAction,
    pub netboot: Option<String>,
}

/// `DELETE /api/v1/bmcs/{id}` answers this.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BmcRemoved {
    /// The registration removed.
    pub removed: i64,
}
