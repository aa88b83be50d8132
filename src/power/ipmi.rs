//! IPMI 2.0 over RMCP+ (lanplus) through Debian's `ipmitool`. Why a tool and not a crate:
//! no maintained Rust crate speaks RMCP+ with the cipher suites BMCs ship (ipmi-rs has
//! RMCP+ as work in progress and few users), while ipmitool is what MAAS and Ironic's
//! ipmitool driver run against every vendor, carries their quirks, and is one apt package.
//! A process per call costs a few milliseconds, small beside a BMC's own answer time.
//!
//! The password reaches ipmitool in its environment (`-E`, `IPMI_PASSWORD`), never in
//! its arguments, which any local user can read in /proc.

use std::time::Duration;

use async_trait::async_trait;

use super::secrets::Credentials;
use super::{Driver, Op, PowerError};
use crate::api::Mac;
use crate::api::power::{BmcInventory, BmcQuirk, PowerState};

/// The RMCP+ cipher suite asked for (see `Ipmi::run`).
const CIPHER_SUITE: &str = "3";

pub struct Ipmi {
    host: String,
    port: u16,
    creds: Credentials,
    timeout: Duration,
    /// The program to run (`ipmitool`; a test may point elsewhere).
    program: String,
    /// See `BmcQuirk::BootValidUnreported`.
    boot_valid_unreported: bool,
}

impl Ipmi {
    pub fn new(address: &str, creds: Credentials, timeout: Duration) -> Result<Self, PowerError> {
        let (host, port) = split_host_port(address).map_err(PowerError::Config)?;
        Ok(Self {
            host,
            port,
            creds,
            timeout,
            program: "ipmitool".into(),
            boot_valid_unreported: false,
        })
    }

    pub fn with_quirks(mut self, quirks: &[BmcQuirk]) -> Self {
        self.boot_valid_unreported = quirks.contains(&BmcQuirk::BootValidUnreported);
        self
    }

    /// Runs `ipmitool ... args`; its standard output, or its error as text.
    async fn run(&self, args: &[&str]) -> Result<String, PowerError> {
        // ipmitool's own retry: -R 1 makes two tries of -N seconds each; a third of the
        // timeout each leaves room to tell "no answer" (unreachable) from our timeout.
        let per_try = (self.timeout.as_secs() / 3).max(1).to_string();
        let port = self.port.to_string();
        let mut cmd = tokio::process::Command::new(&self.program);
        // Cipher suite 3 (RAKP-HMAC-SHA1, HMAC-SHA1-96, AES-CBC-128), MAAS's default and
        // the one BMCs most widely ship: without -C, ipmitool first asks Get Channel
        // Cipher Suites, which some BMCs (and ipmi_sim) never answer, and stalls 10 s.
        cmd.args([
            "-I",
            "lanplus",
            "-C",
            CIPHER_SUITE,
            "-H",
            &self.host,
            "-p",
            &port,
            "-U",
        ])
        .arg(&self.creds.username)
        // -v: only then does ipmitool say why a session failed ("RAKP 2 HMAC is
        // invalid" for a wrong password) rather than "Unable to establish" for every cause.
        .args(["-E", "-v", "-N", &per_try, "-R", "1"])
        .args(args)
        .env("IPMI_PASSWORD", &self.creds.password)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
        let out = match tokio::time::timeout(self.timeout, cmd.output()).await {
            Err(_) => return Err(PowerError::Timeout(self.timeout)),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(PowerError::Config(
                    "ipmitool is not installed (apt-get install ipmitool)".into(),
                ));
            }
            Ok(Err(e)) => return Err(PowerError::Config(format!("cannot run ipmitool: {e}"))),
            Ok(Ok(out)) => out,
        };
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            return Ok(stdout);
        }
        Err(classify(&String::from_utf8_lossy(&out.stderr)))
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

/// What `-v` adds to ipmitool's standard error that says nothing about a failure.
const CHATTER: [&str; 4] = [
    "Loading IANA PEN Registry",
    "Running Get VSO Capabilities",
    "Invalid completion code received: Invalid command",
    "Discovered IPMB address",
];

/// ipmitool's error text as a `PowerError`.
fn classify(stderr: &str) -> PowerError {
    let text = stderr
        .lines()
        .map(|l| l.trim().trim_start_matches("> ").trim())
        .filter(|l| !l.is_empty() && !CHATTER.iter().any(|c| l.starts_with(c)))
        .collect::<Vec<_>>()
        .join("; ");
    let lower = text.to_ascii_lowercase();
    if lower.contains("rakp") || lower.contains("unauthorized name") || lower.contains("password") {
        PowerError::Auth(text)
    } else if lower.contains("unable to establish")
        || lower.contains("no response")
        || lower.contains("get auth capabilities error")
    {
        PowerError::Unreachable(text)
    } else {
        PowerError::Refused(text)
    }
}

/// `Chassis Power is on` as a state.
pub fn parse_power(stdout: &str) -> PowerState {
    let s = stdout.to_ascii_lowercase();
    if s.contains("power is on") {
        PowerState::On
    } else if s.contains("power is off") {
        PowerState::Off
    } else {
        PowerState::Changing
    }
}

/// Whether `chassis bootparam get 5` shows a network boot for the next boot; with
/// `valid_unreported` (the quirk) the device selector alone decides.
pub fn parse_boot_flags(stdout: &str, valid_unreported: bool) -> Result<String, String> {
    let pxe = stdout.contains("Force PXE");
    let valid = stdout.contains("Boot Flag Valid") || valid_unreported;
    let efi = stdout.contains("BIOS EFI boot");
    let once = stdout.contains("next boot");
    let seen = format!(
        "{}{}{}",
        if pxe { "pxe" } else { "no pxe" },
        if efi { " efi" } else { "" },
        if once { " once" } else { " persistent" }
    );
    if pxe && valid { Ok(seen) } else { Err(seen) }
}

/// `fru print 0` fields as inventory.
pub fn parse_fru(stdout: &str) -> BmcInventory {
    // The first name present wins: the product's fields before the board's.
    let field = |names: &[&str]| {
        names.iter().find_map(|name| {
            stdout.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == *name && !v.trim().is_empty()).then(|| v.trim().to_string())
            })
        })
    };
    BmcInventory {
        manufacturer: field(&["Product Manufacturer", "Board Mfg"]),
        model: field(&["Product Name", "Board Product"]),
        serial: field(&["Product Serial", "Board Serial"]),
        bios_version: None,
        uuid: None,
        macs: Vec::<Mac>::new(),
    }
}

#[async_trait]
impl Driver for Ipmi {
    async fn state(&self) -> Result<PowerState, PowerError> {
        Ok(parse_power(
            &self.run(&["chassis", "power", "status"]).await?,
        ))
    }

    async fn act(&self, op: Op) -> Result<(), PowerError> {
        let verb = match op {
            Op::On => "on",
            Op::ForceOff => "off",
            Op::GracefulOff => "soft",
            Op::Cycle => "cycle",
        };
        self.run(&["chassis", "power", verb]).await.map(|_| ())
    }

    async fn netboot_once(&self) -> Result<String, PowerError> {
        // Without options=persistent the flag holds for the next boot only.
        self.run(&["chassis", "bootdev", "pxe", "options=efiboot"])
            .await?;
        let flags = self.run(&["chassis", "bootparam", "get", "5"]).await?;
        parse_boot_flags(&flags, self.boot_valid_unreported).map_err(|seen| {
            PowerError::NotKept(format!(
                "the BMC accepted a one-time network boot but reads back {seen}"
            ))
        })
    }

    async fn inventory(&self) -> Result<BmcInventory, PowerError> {
        // A BMC without FRU data answers an error: inventory is then empty, not a failure.
        match self.run(&["fru", "print", "0"]).await {
            Ok(out) => Ok(parse_fru(&out)),
            Err(PowerError::Refused(_)) => Ok(BmcInventory::default()),
            Err(e) => Err(e),
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
    fn outputs_parse() {
        assert_eq!(parse_power("Chassis Power is on\n"), PowerState::On);
        assert_eq!(parse_power("Chassis Power is off\n"), PowerState::Off);
        let flags = "Boot parameter version: 1\nBoot parameter 5 is valid/unlocked\nBoot parameter data: e004000000\n Boot Flags :\n   - Boot Flag Valid\n   - Options apply to only next boot\n   - BIOS EFI boot \n   - Boot Device Selector : Force PXE\n";
        assert_eq!(parse_boot_flags(flags, false).unwrap(), "pxe efi once");
        for quirk in [false, true] {
            assert!(
                parse_boot_flags(
                    "   - Boot Flag Invalid\n   - Boot Device Selector : No override\n",
                    quirk
                )
                .is_err()
            );
        }
        // What ipmi_sim reads back after `bootdev pxe options=efiboot`: the selector only.
        let sim = "Boot parameter data: 0004000000\n Boot Flags :\n   - Boot Flag Invalid\n   - Options apply to only next boot\n   - BIOS PC Compatible (legacy) boot \n   - Boot Device Selector : Force PXE\n";
        assert_eq!(parse_boot_flags(sim, false).unwrap_err(), "pxe once");
        assert_eq!(parse_boot_flags(sim, true).unwrap(), "pxe once");
        let fru = "FRU Device Description : Builtin FRU Device (ID 0)\n Board Mfg             : Acme\n Product Manufacturer  : Acme GPU\n Product Name          : HGX-8\n Product Serial        : SN123\n";
        let inv = parse_fru(fru);
        assert_eq!(inv.manufacturer.as_deref(), Some("Acme GPU"));
        assert_eq!(inv.model.as_deref(), Some("HGX-8"));
        assert_eq!(inv.serial.as_deref(), Some("SN123"));
        assert!(matches!(
            classify("Error: Unable to establish IPMI v2 / RMCP+ session\n"),
            PowerError::Unreachable(_)
        ));
        // ipmitool -v's standard error, as ipmitool 1.8.19 writes it against ipmi_sim.
        let wrong_password = "Loading IANA PEN Registry...\n> RAKP 2 HMAC is invalid\nError: Unable to establish IPMI v2 / RMCP+ session\n";
        match classify(wrong_password) {
            PowerError::Auth(text) => assert_eq!(
                text,
                "RAKP 2 HMAC is invalid; Error: Unable to establish IPMI v2 / RMCP+ session"
            ),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            classify(
                "Loading IANA PEN Registry...\nRAKP 2 message indicates an error : unauthorized name\n"
            ),
            PowerError::Auth(_)
        ));
        assert!(matches!(
            classify(
                "Loading IANA PEN Registry...\nGet Auth Capabilities error\nError issuing Get Channel Authentication Capabilities request\nError: Unable to establish IPMI v2 / RMCP+ session\n"
            ),
            PowerError::Unreachable(_)
        ));
    }
}
