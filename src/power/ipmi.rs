//! IPMI 2.0 over RMCP+ (lanplus, cipher suite 3: RAKP-HMAC-SHA1 authentication,
//! HMAC-SHA1-96 integrity, AES-CBC-128 confidentiality), spoken natively through the
//! `ipmi` crate: one session per driver, raised to Administrator, closed at the end
//! (BMCs hold a handful of sessions and refuse more until old ones time out).
//!
//! Why not Debian's `ipmitool`, which this driver first ran (as MAAS and Ironic do): every
//! run loads the 4.7 MB IANA enterprise-number registry and costs about 25 ms of CPU
//! (measured here against ipmi_sim: 29 ms a call, almost all of it CPU), so a fleet-wide
//! status is bound by the server's cores, not by the BMCs; a native session costs about
//! 3 ms of wall time and next to no CPU. Why this crate: retries lost datagrams, closes
//! its sessions, keys zeroized, RustCrypto primitives; ipmi-rs (the other maintained one)
//! cannot close a session. It is young (0.1), so its behaviour is pinned by the tests
//! against OpenIPMI's ipmi_sim, with ipmitool as the independent witness there.

use std::time::Duration;

use async_trait::async_trait;

use super::secrets::Credentials;
use super::{Driver, Op, PowerError};
use crate::api::power::{BmcInventory, BmcQuirk, PowerState};

const NETFN_APP: u8 = 0x06;
const NETFN_CHASSIS: u8 = 0x00;
const SET_SESSION_PRIVILEGE: u8 = 0x3b;
const GET_SYSTEM_GUID: u8 = 0x37;
const GET_CHASSIS_STATUS: u8 = 0x01;
const CHASSIS_CONTROL: u8 = 0x02;
const SET_BOOT_OPTIONS: u8 = 0x08;
const GET_BOOT_OPTIONS: u8 = 0x09;
const ADMINISTRATOR: u8 = 0x04;
/// Boot options parameter 3 (boot flag valid bit clearing) and 5 (boot flags).
const PARAM_VALID_BIT_CLEARING: u8 = 3;
const PARAM_BOOT_FLAGS: u8 = 5;
/// Boot flags byte 1: valid, and EFI; byte 2 bits 5:2: the device, 0001b = PXE.
const FLAG_VALID: u8 = 0x80;
const FLAG_PERSISTENT: u8 = 0x40;
const FLAG_EFI: u8 = 0x20;
const DEVICE_PXE: u8 = 0x04;

pub struct Ipmi {
    host: String,
    port: u16,
    creds: Credentials,
    timeout: Duration,
    /// See `BmcQuirk::BootValidUnreported`.
    boot_valid_unreported: bool,
    session: tokio::sync::Mutex<Option<Client>>,
}

/// The crate's blocking client, run on tokio's blocking pool: its async client's futures
/// are not `Send` (a thread-local RNG held across an await), so they cannot run on the
/// server's multi-threaded runtime. A call is a few milliseconds of waiting on UDP.
type Client = ipmi::blocking::Client;

impl Ipmi {
    pub fn new(address: &str, creds: Credentials, timeout: Duration) -> Result<Self, PowerError> {
        let (host, port) = split_host_port(address).map_err(PowerError::Config)?;
        Ok(Self {
            host,
            port,
            creds,
            timeout,
            boot_valid_unreported: false,
            session: tokio::sync::Mutex::new(None),
        })
    }

    pub fn with_quirks(mut self, quirks: &[BmcQuirk]) -> Self {
        self.boot_valid_unreported = quirks.contains(&BmcQuirk::BootValidUnreported);
        self
    }

    /// Runs `f` on the blocking pool, bounded by the timeout.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T, PowerError> + Send + 'static,
    ) -> Result<T, PowerError> {
        match tokio::time::timeout(self.timeout, tokio::task::spawn_blocking(f)).await {
            Err(_) => Err(PowerError::Timeout(self.timeout)),
            Ok(Err(e)) => Err(PowerError::Refused(format!("the IPMI client failed: {e}"))),
            Ok(Ok(result)) => result,
        }
    }

    /// The session, opened at first use.
    async fn client(&self) -> Result<Client, PowerError> {
        let mut slot = self.session.lock().await;
        if let Some(client) = slot.as_ref() {
            return Ok(client.clone());
        }
        let target = tokio::net::lookup_host((self.host.as_str(), self.port))
            .await
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| PowerError::Unreachable(format!("cannot resolve {}", self.host)))?;
        let (username, password) = (self.creds.username.clone(), self.creds.password.clone());
        let timeout = self.timeout;
        let client = self
            .blocking(move || open(target, &username, &password, timeout))
            .await?;
        *slot = Some(client.clone());
        Ok(client)
    }

    async fn run(&self, netfn: u8, cmd: u8, data: &[u8]) -> Result<Vec<u8>, PowerError> {
        let client = self.client().await?;
        let (data, timeout) = (data.to_vec(), self.timeout);
        self.blocking(move || command(&client, (netfn, cmd), &data, timeout))
            .await
    }
}

/// Opens a session as Administrator.
fn open(
    target: std::net::SocketAddr,
    username: &str,
    password: &str,
    timeout: Duration,
) -> Result<Client, PowerError> {
    // Three tries of a quarter of the timeout each for every packet: a lost datagram is
    // sent again, and the handshake still ends within the timeout (bounded by the caller).
    let per_try = (timeout / 4).max(Duration::from_millis(200));
    let client = Client::builder(target)
        .username(username)
        .password(password)
        .privilege_level(ipmi::PrivilegeLevel::Administrator)
        .timeout(per_try)
        .retries(3)
        .build()
        .map_err(|e| classify(e, timeout))?;
    // A session starts at User privilege whatever was negotiated; chassis control and boot
    // options need more.
    command(
        &client,
        (NETFN_APP, SET_SESSION_PRIVILEGE),
        &[ADMINISTRATOR],
        timeout,
    )
    .map_err(|e| match e {
        PowerError::Refused(why) => {
            PowerError::Auth(format!("the user may not act as Administrator ({why})"))
        }
        e => e,
    })?;
    Ok(client)
}

/// One command on an open session; its data, or the completion code as an error.
fn command(
    client: &Client,
    (netfn, cmd): (u8, u8),
    data: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, PowerError> {
    let response = client
        .send_raw(netfn, cmd, data)
        .map_err(|e| classify(e, timeout))?;
    match response.completion_code {
        0x00 => Ok(response.data),
        cc => Err(PowerError::Refused(format!(
            "command {netfn:#04x}/{cmd:#04x}: completion code {cc:#04x} ({})",
            completion_text(cc)
        ))),
    }
}

/// The IPMI 2.0 generic completion codes (table 5-2), as words.
fn completion_text(cc: u8) -> &'static str {
    match cc {
        0xc0 => "node busy",
        0xc1 => "invalid command",
        0xc3 => "timeout",
        0xc7 | 0xc8 => "request data length invalid",
        0xc9 => "parameter out of range",
        0xcc => "invalid data field in request",
        0xcd => "illegal for this sensor or record",
        0xce => "response could not be provided",
        0xd4 => "insufficient privilege",
        0xd5 => "not supported in present state",
        0x80 => "parameter not supported",
        0x81 => "attempt to set 'set in progress' when not in 'set complete' state",
        0x82 => "attempt to write a read-only parameter",
        _ => "unspecified",
    }
}

/// The crate's error as a `PowerError`.
fn classify(e: ipmi::Error, timeout: Duration) -> PowerError {
    match e {
        ipmi::Error::Timeout => PowerError::Timeout(timeout),
        ipmi::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
            PowerError::Unreachable("nothing answers IPMI there (connection refused)".into())
        }
        ipmi::Error::Io(io) => PowerError::Unreachable(io.to_string()),
        // "RAKP message 2 authentication code mismatch": a wrong password; "RAKP message
        // 2 status != 0": the BMC knows no such user.
        ipmi::Error::AuthenticationFailed(why) => PowerError::Auth(why.to_string()),
        ipmi::Error::InvalidArgument(why) => PowerError::Config(why.to_string()),
        ipmi::Error::CompletionCode { completion_code } => PowerError::Refused(format!(
            "completion code {completion_code:#04x} ({})",
            completion_text(completion_code)
        )),
        // The crate reads an Open Session answer with an error status as too short: what
        // a BMC with no free session sends ("insufficient resources", status 0x01).
        ipmi::Error::Protocol(why) if why.contains("open session") => PowerError::Refused(format!(
            "the BMC opened no session; it may have none free ({why})"
        )),
        other => PowerError::Refused(other.to_string()),
    }
}

/// `HOST` or `HOST:PORT` (623 by default); `[v6]:PORT` for IPv6.
pub fn split_host_port(address: &str) -> Result<(String, u16), String> {
    let bad = || format!("IPMI address {address:?}: expected HOST or HOST:PORT");
    let (host, port) = if let Some(rest) = address.strip_prefix('[') {
        let (h, p) = rest.split_once(']').ok_or_else(bad)?;
        (h, p.strip_prefix(':'))
    } else if address.matches(':').count() == 1 {
        let (h, p) = address.split_once(':').expect("one colon");
        (h, Some(p))
    } else {
        (address, None)
    };
    let port = match port {
        Some(p) => p.parse().map_err(|_| bad())?,
        None => 623,
    };
    let ok = !host.is_empty()
        && !host.starts_with('-')
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':'));
    if !ok {
        return Err(bad());
    }
    Ok((host.to_string(), port))
}

/// Get Chassis Status: byte 1 bit 0 is "power is on".
pub fn parse_power(data: &[u8]) -> PowerState {
    match data.first() {
        Some(b) if b & 1 == 1 => PowerState::On,
        Some(_) => PowerState::Off,
        None => PowerState::Changing,
    }
}

/// Whether Get System Boot Options (parameter 5) shows a network boot for the next boot;
/// with `valid_unreported` (the quirk) the device selector alone decides. What was seen
/// is the text either way.
pub fn parse_boot_flags(data: &[u8], valid_unreported: bool) -> Result<String, String> {
    // Parameter version, the parameter (bit 7: invalid or locked), then the five bytes.
    let [_, param, flags, device, ..] = data else {
        return Err(format!("a short answer ({} bytes)", data.len()));
    };
    if param & 0x7f != PARAM_BOOT_FLAGS {
        return Err(format!("parameter {} instead of 5", param & 0x7f));
    }
    let pxe = (device >> 2) & 0x0f == DEVICE_PXE >> 2;
    let valid = flags & FLAG_VALID != 0 || valid_unreported;
    let seen = format!(
        "{}{}{}",
        if pxe { "pxe" } else { "no pxe" },
        if flags & FLAG_EFI != 0 { " efi" } else { "" },
        if flags & FLAG_PERSISTENT != 0 {
            " persistent"
        } else {
            " once"
        }
    );
    if pxe && valid { Ok(seen) } else { Err(seen) }
}

/// Get System GUID answers the 16 bytes least significant first: reversed, they read
/// as the UUID ipmitool and the host's SMBIOS print.
pub fn format_guid(data: &[u8]) -> Option<String> {
    let bytes: [u8; 16] = data.get(..16)?.try_into().ok()?;
    let hex: String = bytes.iter().rev().map(|b| format!("{b:02x}")).collect();
    Some(format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    ))
}

#[async_trait]
impl Driver for Ipmi {
    async fn state(&self) -> Result<PowerState, PowerError> {
        Ok(parse_power(
            &self.run(NETFN_CHASSIS, GET_CHASSIS_STATUS, &[]).await?,
        ))
    }

    async fn act(&self, op: Op) -> Result<(), PowerError> {
        let control = match op {
            Op::ForceOff => 0,
            Op::On => 1,
            Op::Cycle => 2,
            Op::GracefulOff => 5,
        };
        self.run(NETFN_CHASSIS, CHASSIS_CONTROL, &[control])
            .await
            .map(|_| ())
    }

    async fn netboot_once(&self) -> Result<String, PowerError> {
        // Keep the flag past the BMC's 60 s clearing (the power-on may wait for the pacer),
        // as Ironic does; a BMC without the parameter is fine.
        let _ = self
            .run(
                NETFN_CHASSIS,
                SET_BOOT_OPTIONS,
                &[PARAM_VALID_BIT_CLEARING, 0x08],
            )
            .await;
        // Valid, this boot only, EFI; the network.
        self.run(
            NETFN_CHASSIS,
            SET_BOOT_OPTIONS,
            &[PARAM_BOOT_FLAGS, FLAG_VALID | FLAG_EFI, DEVICE_PXE, 0, 0, 0],
        )
        .await?;
        let flags = self
            .run(NETFN_CHASSIS, GET_BOOT_OPTIONS, &[PARAM_BOOT_FLAGS, 0, 0])
            .await?;
        parse_boot_flags(&flags, self.boot_valid_unreported).map_err(|seen| {
            PowerError::NotKept(format!(
                "the BMC accepted a one-time network boot but reads back {seen}"
            ))
        })
    }

    async fn inventory(&self) -> Result<BmcInventory, PowerError> {
        // The system GUID is the host's SMBIOS UUID (what discovery matches on); a BMC that
        // has none answers an error, and the inventory is then empty, not a failure.
        let uuid = match self.run(NETFN_APP, GET_SYSTEM_GUID, &[]).await {
            Ok(data) => format_guid(&data),
            Err(PowerError::Refused(_)) => None,
            Err(e) => return Err(e),
        };
        Ok(BmcInventory {
            uuid,
            ..BmcInventory::default()
        })
    }

    async fn close(&self) {
        if let Some(client) = self.session.lock().await.take() {
            let _ = self
                .blocking(move || {
                    client.close_session().ok();
                    Ok(())
                })
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_split_and_refuse_option_lookalikes() {
        assert_eq!(
            split_host_port("10.0.0.9").unwrap(),
            ("10.0.0.9".into(), 623)
        );
        assert_eq!(
            split_host_port("bmc-12:9001").unwrap(),
            ("bmc-12".into(), 9001)
        );
        assert_eq!(
            split_host_port("[fd00::9]:623").unwrap(),
            ("fd00::9".into(), 623)
        );
        assert_eq!(split_host_port("fd00::9").unwrap(), ("fd00::9".into(), 623));
        for bad in ["", "-oProxy=x", "a b", "h:99999", "h;rm"] {
            assert!(split_host_port(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn answers_parse() {
        assert_eq!(parse_power(&[0x01, 0, 0]), PowerState::On);
        assert_eq!(parse_power(&[0x00, 0, 0]), PowerState::Off);
        assert_eq!(parse_power(&[]), PowerState::Changing);
        // A BMC that kept all of it: valid, EFI, next boot only, PXE.
        let kept = [0x01, 0x05, 0xa0, 0x04, 0, 0, 0];
        assert_eq!(parse_boot_flags(&kept, false).unwrap(), "pxe efi once");
        // One that reverted the device (bmclib#459's failure, on IPMI).
        for quirk in [false, true] {
            assert_eq!(
                parse_boot_flags(&[0x01, 0x05, 0x80, 0x00, 0, 0, 0], quirk).unwrap_err(),
                "no pxe once"
            );
        }
        // What ipmi_sim reads back after the set above: the selector only.
        let sim = [0x01, 0x05, 0x00, 0x04, 0x00, 0x00, 0x00];
        assert_eq!(parse_boot_flags(&sim, false).unwrap_err(), "pxe once");
        assert_eq!(parse_boot_flags(&sim, true).unwrap(), "pxe once");
        assert!(parse_boot_flags(&[0x01, 0x05], true).is_err());
        assert!(parse_boot_flags(&[0x01, 0x04, 0x80, 0x04, 0, 0, 0], true).is_err());
        // ipmi_sim's GUID a123456789abcdef a123456789abcdef, as `ipmitool mc guid` prints it.
        let guid = [
            0xa1, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0xa1, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ];
        assert_eq!(
            format_guid(&guid).unwrap(),
            "efcdab89-6745-23a1-efcd-ab89674523a1"
        );
        assert_eq!(format_guid(&guid[..15]), None);
    }

    #[test]
    fn errors_are_named() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(matches!(
            classify(ipmi::Error::Io(refused), Duration::from_secs(1)),
            PowerError::Unreachable(_)
        ));
        assert!(matches!(
            classify(
                ipmi::Error::AuthenticationFailed("RAKP message 2 authentication code mismatch"),
                Duration::from_secs(1)
            ),
            PowerError::Auth(_)
        ));
        assert_eq!(
            classify(ipmi::Error::Timeout, Duration::from_secs(3)).to_string(),
            "BMC did not answer within 3 s"
        );
        assert_eq!(
            classify(
                ipmi::Error::CompletionCode {
                    completion_code: 0xd4
                },
                Duration::ZERO
            )
            .to_string(),
            "BMC refused: completion code 0xd4 (insufficient privilege)"
        );
    }
}
