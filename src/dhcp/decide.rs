//! The DHCP decision, pure: a checked request, who the client is, what we know of the
//! node, the settings and (authoritative mode) the lease table in, a reply or a named
//! reason to stay silent out. No sockets, no clock, no database.

use std::net::Ipv4Addr;

use super::classify::{BootClass, Client};
use super::leases::{Leases, Refused};
use super::wire::{Checked, encode_tlvs};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Off,
    /// Boot information only, to PXE and HTTP-boot clients, next to the site's DHCP.
    Proxy,
    /// Addresses from a pool and reservations, plus boot information.
    Authoritative,
}

/// Boot file names, relative to the TFTP root (the iPXE directory).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BootFiles {
    pub bios: String,
    pub uefi_x64: String,
    pub uefi_arm64: String,
}

impl Default for BootFiles {
    fn default() -> Self {
        Self {
            bios: "undionly.kpxe".into(),
            // snponly.efi starts in 0.07 s, ipxe.efi in about 4.3 s (lab notes).
            uefi_x64: "snponly.efi".into(),
            uefi_arm64: "arm64/snponly.efi".into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub mode: Mode,
    /// Our address as clients reach it: server identifier, next-server.
    pub server_ip: Ipv4Addr,
    /// Base URL of our HTTP service, as clients reach it.
    pub http_base: String,
    pub files: BootFiles,
    pub subnet_mask: Ipv4Addr,
    pub router: Option<Ipv4Addr>,
    pub dns: Vec<Ipv4Addr>,
}

/// What the store says about the client's MAC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeView {
    /// Has an image assigned (or a default applies): it gets a boot file.
    pub bootable: bool,
    /// Marked to boot from its local disk (label `boot=local`): no boot file, and in
    /// proxy mode no answer at all.
    pub local_boot: bool,
    /// An iPXE client that is to get our iPXE binary for its firmware rather than its
    /// script (`[dhcp] chainload = "always"`, decided per transaction by `chain`).
    pub chainload: bool,
}

/// The port a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Port {
    Dhcp,
    /// 4011: PXE boot-server discovery (EDK2 asks here after a proxy offer without a file).
    PxeServer,
}

pub const OFFER: u8 = 2;
pub const ACK: u8 = 5;
pub const NAK: u8 = 6;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub message_type: u8,
    pub yiaddr: Ipv4Addr,
    pub siaddr: Ipv4Addr,
    /// The BOOTP `file` field (also option 67).
    pub file: Option<String>,
    /// Options besides 53 and 54, in the order we want them.
    pub options: Vec<(u8, Vec<u8>)>,
    /// The boot class the reply was made for (for metrics and logs).
    pub class: Option<BootClass>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Reply(Reply),
    /// Stay silent, for this reason (counted).
    Ignore(&'static str),
    /// A lease was released or declined: nothing to send.
    Done(&'static str),
}

const DISCOVER: u8 = 1;
const REQUEST: u8 = 3;
const DECLINE: u8 = 4;
const RELEASE: u8 = 7;
const INFORM: u8 = 8;

fn ip_opt(req: &Checked, code: u8) -> Option<Ipv4Addr> {
    let b = req.option(code)?;
    Some(Ipv4Addr::new(b[0], b[1], b[2], b[3]))
}

/// Encoded options, in the order they are to be sent.
type Options = Vec<(u8, Vec<u8>)>;

/// The boot file and the options that go with it, for a client that should network-boot.
fn boot_info(
    client: &Client,
    node: &NodeView,
    s: &Settings,
) -> Option<(String, Options, BootClass)> {
    let class = match client.class? {
        BootClass::Ipxe if node.chainload => client.firmware?,
        class => class,
    };
    if node.local_boot || !node.bootable {
        return None;
    }
    let base = s.http_base.trim_end_matches('/');
    let (file, vendor) = match class {
        BootClass::Ipxe => (format!("{base}/boot.ipxe"), "PXEClient"),
        BootClass::Bios => (s.files.bios.clone(), "PXEClient"),
        BootClass::UefiX64 => (s.files.uefi_x64.clone(), "PXEClient"),
        BootClass::UefiArm64 => (s.files.uefi_arm64.clone(), "PXEClient"),
        // UEFI HTTP boot takes a URL and needs option 60 "HTTPClient" echoed, or the
        // firmware drops the offer.
        BootClass::HttpX64 => (format!("{base}/ipxe/{}", s.files.uefi_x64), "HTTPClient"),
        BootClass::HttpArm64 => (format!("{base}/ipxe/{}", s.files.uefi_arm64), "HTTPClient"),
    };
    let mut options = vec![(60, vendor.as_bytes().to_vec())];
    if class != BootClass::Ipxe && !matches!(class, BootClass::HttpX64 | BootClass::HttpArm64) {
        // TFTP server name as text, for ROMs that read 66 rather than siaddr.
        options.push((66, s.server_ip.to_string().into_bytes()));
    }
    options.push((67, file.clone().into_bytes()));
    if matches!(
        class,
        BootClass::Bios | BootClass::UefiX64 | BootClass::UefiArm64
    ) {
        // Without it OVMF asks port 4011 after the ACK too, and waits 1 s more before
        // its TFTP (measured: bench/boot.sh STEPS=1, UEFI).
        options.push((43, pxe_vendor_options()));
    }
    Some((file, options, class))
}

/// PXE vendor options (43): discovery control 8 = "boot from the file in this offer, no
/// boot-server discovery". EDK2 takes a proxy offer with 60 PXEClient and 43 as a PXE
/// offer; without 43 it treats it as BINL and asks port 4011 first.
fn pxe_vendor_options() -> Vec<u8> {
    let mut v = encode_tlvs(&[(6, &[8])]);
    v.push(255);
    v
}

/// Echoes the machine UUID (97): the PXE spec wants it back in proxy replies, and some
/// ROMs drop replies without it.
fn uuid_echo(req: &Checked) -> Option<(u8, Vec<u8>)> {
    req.option(97)
        .filter(|u| !u.is_empty())
        .map(|u| (97, u.to_vec()))
}

pub fn decide(
    req: &Checked,
    client: &Client,
    node: &NodeView,
    s: &Settings,
    leases: Option<&mut Leases>,
    port: Port,
    now_ms: i64,
) -> Decision {
    match s.mode {
        Mode::Off => Decision::Ignore("dhcp off"),
        Mode::Proxy => proxy(req, client, node, s, port),
        Mode::Authoritative => match leases {
            Some(leases) => authoritative(req, client, node, s, leases, port, now_ms),
            None => Decision::Ignore("no pool"),
        },
    }
}

fn proxy(req: &Checked, client: &Client, node: &NodeView, s: &Settings, port: Port) -> Decision {
    if client.class.is_none() {
        return Decision::Ignore("not a network-boot client");
    }
    let message_type = match (req.message_type(), port) {
        (DISCOVER, Port::Dhcp) => OFFER,
        // Firmware asking us directly after our offer (4011), or iPXE re-asking on 67.
        (REQUEST, Port::PxeServer) | (INFORM, Port::PxeServer) => ACK,
        (REQUEST, Port::Dhcp) => return Decision::Ignore("request for the site's DHCP server"),
        _ => return Decision::Ignore("message type not answered in proxy mode"),
    };
    let Some((file, mut options, class)) = boot_info(client, node, s) else {
        return Decision::Ignore(if node.local_boot {
            "local boot"
        } else {
            "nothing to boot"
        });
    };
    options.extend(uuid_echo(req));
    Decision::Reply(Reply {
        message_type,
        yiaddr: Ipv4Addr::UNSPECIFIED,
        siaddr: s.server_ip,
        file: Some(file),
        options,
        class: Some(class),
    })
}

fn address_options(s: &Settings, lease_secs: u32) -> Vec<(u8, Vec<u8>)> {
    let mut o = vec![(1, s.subnet_mask.octets().to_vec())];
    if let Some(r) = s.router {
        o.push((3, r.octets().to_vec()));
    }
    if !s.dns.is_empty() {
        o.push((6, s.dns.iter().flat_map(|d| d.octets()).collect()));
    }
    o.push((51, lease_secs.to_be_bytes().to_vec()));
    o.push((58, (lease_secs / 2).to_be_bytes().to_vec()));
    o.push((59, (lease_secs / 8 * 7).to_be_bytes().to_vec()));
    o
}

fn authoritative(
    req: &Checked,
    client: &Client,
    node: &NodeView,
    s: &Settings,
    leases: &mut Leases,
    port: Port,
    now: i64,
) -> Decision {
    if port == Port::PxeServer {
        return proxy(req, client, node, s, port);
    }
    let mac = req.chaddr;
    let ours = |req: &Checked| ip_opt(req, 54).is_none_or(|id| id == s.server_ip);
    let with_boot = |mut options: Vec<(u8, Vec<u8>)>, yiaddr: Ipv4Addr, message_type: u8| {
        let boot = boot_info(client, node, s);
        let class = boot.as_ref().map(|b| b.2);
        let file = boot.map(|(file, boot_options, class)| {
            options.extend(boot_options);
            if class == BootClass::Ipxe {
                // 175.176 = 1: iPXE need not wait ~3 s for a proxyDHCP offer.
                let mut v = encode_tlvs(&[(176, &[1])]);
                v.push(255);
                options.push((175, v));
            }
            file
        });
        options.extend(uuid_echo(req));
        Decision::Reply(Reply {
            message_type,
            yiaddr,
            siaddr: s.server_ip,
            file,
            options,
            class,
        })
    };
    match req.message_type() {
        DISCOVER => match leases.offer(&mac, ip_opt(req, 50), now) {
            Some(ip) => with_boot(address_options(s, leases.lease_secs()), ip, OFFER),
            None => Decision::Ignore("pool exhausted"),
        },
        REQUEST => {
            if !ours(req) {
                // The client chose another server: free what we offered.
                leases.release(&mac, None);
                return Decision::Done("client chose another server");
            }
            let wanted = ip_opt(req, 50).or((!req.ciaddr.is_unspecified()).then_some(req.ciaddr));
            let Some(wanted) = wanted else {
                return Decision::Ignore("request names no address");
            };
            match leases.bind(&mac, wanted, now) {
                Ok(lease) => with_boot(address_options(s, leases.lease_secs()), lease.ip, ACK),
                Err(Refused::Partners) => Decision::Ignore("another server's slice"),
                Err(Refused::NotYours) => Decision::Reply(Reply {
                    message_type: NAK,
                    yiaddr: Ipv4Addr::UNSPECIFIED,
                    siaddr: Ipv4Addr::UNSPECIFIED,
                    file: None,
                    options: vec![(56, format!("{wanted} is not yours").into_bytes())],
                    class: None,
                }),
            }
        }
        RELEASE => {
            leases.release(&mac, Some(req.ciaddr));
            Decision::Done("released")
        }
        DECLINE => match ip_opt(req, 50) {
            Some(ip) => {
                leases.decline(&mac, ip, now);
                Decision::Done("declined")
            }
            None => Decision::Ignore("decline names no address"),
        },
        INFORM => {
            let mut options = address_options(s, leases.lease_secs());
            options.retain(|(code, _)| !matches!(code, 51 | 58 | 59));
            with_boot(options, Ipv4Addr::UNSPECIFIED, ACK)
        }
        _ => Decision::Ignore("message type not answered"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dhcp::classify::classify;
    use crate::dhcp::leases::PoolConfig;
    use crate::dhcp::wire::{check, tests::request};

    const MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0, 7];
    /// Options as (code, value), the way a client class sends them.
    type Wire = &'static [(u8, &'static [u8])];
    const BIOS: &[(u8, &[u8])] = &[(60, b"PXEClient:Arch:00000:UNDI:002001"), (93, &[0, 0])];
    const UEFI: &[(u8, &[u8])] = &[(60, b"PXEClient:Arch:00007:UNDI:003000"), (93, &[0, 7])];
    const ARM64: &[(u8, &[u8])] = &[(60, b"PXEClient:Arch:00011:UNDI:003000"), (93, &[0, 11])];
    const HTTP: &[(u8, &[u8])] = &[(60, b"HTTPClient:Arch:00016:UNDI:003000"), (93, &[0, 16])];
    const IPXE: &[(u8, &[u8])] = &[(60, b"PXEClient:Arch:00000:UNDI:002001"), (77, b"iPXE")];
    const BOOTABLE: NodeView = NodeView {
        bootable: true,
        local_boot: false,
        chainload: false,
    };

    fn settings(mode: Mode) -> Settings {
        Settings {
            mode,
            server_ip: "10.9.0.1".parse().unwrap(),
            http_base: "http://10.9.0.1:8080".into(),
            files: BootFiles::default(),
            subnet_mask: "255.255.255.0".parse().unwrap(),
            router: Some("10.9.0.254".parse().unwrap()),
            dns: vec!["10.9.0.53".parse().unwrap()],
        }
    }

    fn pool() -> Leases {
        Leases::new(&PoolConfig {
            start: "10.9.0.100".parse().unwrap(),
            end: "10.9.0.199".parse().unwrap(),
            reservations: Default::default(),
            lease_secs: 3600,
        })
        .unwrap()
    }

    fn ask(
        mode: Mode,
        kind: u8,
        class: &[(u8, &[u8])],
        extra: &[(u8, &[u8])],
        node: NodeView,
        leases: Option<&mut Leases>,
        port: Port,
    ) -> Decision {
        let mut options: Vec<(u8, &[u8])> = vec![(53, std::slice::from_ref(&kind))];
        options.extend_from_slice(class);
        options.extend_from_slice(extra);
        let req = check(&request(MAC, &options)).unwrap();
        decide(
            &req,
            &classify(&req),
            &node,
            &settings(mode),
            leases,
            port,
            0,
        )
    }

    fn reply(d: Decision) -> Reply {
        match d {
            Decision::Reply(r) => r,
            other => panic!("expected a reply, got {other:?}"),
        }
    }

    fn opt(r: &Reply, code: u8) -> Option<&[u8]> {
        r.options
            .iter()
            .find(|(c, _)| *c == code)
            .map(|(_, v)| v.as_slice())
    }

    #[test]
    fn proxy_mode_gives_each_class_its_boot_file_and_never_an_address() {
        let uuid = [0u8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];
        let cases: [(Wire, &str, &[u8], bool); 5] = [
            (BIOS, "undionly.kpxe", b"PXEClient", true),
            (UEFI, "snponly.efi", b"PXEClient", true),
            (ARM64, "arm64/snponly.efi", b"PXEClient", true),
            (
                HTTP,
                "http://10.9.0.1:8080/ipxe/snponly.efi",
                b"HTTPClient",
                false,
            ),
            (IPXE, "http://10.9.0.1:8080/boot.ipxe", b"PXEClient", false),
        ];
        for (class, file, vendor, pxe_options) in cases {
            let r = reply(ask(
                Mode::Proxy,
                1,
                class,
                &[(97, &uuid)],
                BOOTABLE,
                None,
                Port::Dhcp,
            ));
            assert_eq!(r.message_type, OFFER);
            assert_eq!(
                r.yiaddr,
                Ipv4Addr::UNSPECIFIED,
                "a proxy never hands out addresses"
            );
            assert_eq!(r.file.as_deref(), Some(file));
            assert_eq!(opt(&r, 67), Some(file.as_bytes()));
            // Quirk (UEFI HTTP boot, EDK2): option 60 must name the client's own class.
            assert_eq!(opt(&r, 60), Some(vendor));
            // Quirk (EDK2 proxy offers): option 43 with discovery control 8, or EDK2
            // treats the offer as BINL and insists on port 4011 first.
            assert_eq!(opt(&r, 43).is_some(), pxe_options, "{file}");
            // Quirk (PXE spec, some ROMs): the machine UUID is echoed.
            assert_eq!(opt(&r, 97), Some(&uuid[..]));
            assert_eq!(r.siaddr, "10.9.0.1".parse::<Ipv4Addr>().unwrap());
        }
        assert_eq!(
            opt(
                &reply(ask(Mode::Proxy, 1, BIOS, &[], BOOTABLE, None, Port::Dhcp)),
                43
            ),
            Some(&[6, 1, 8, 255][..])
        );
    }

    #[test]
    fn proxy_mode_stays_out_of_the_way() {
        let ignore = |d: Decision| match d {
            Decision::Ignore(why) => why,
            other => panic!("expected silence, got {other:?}"),
        };
        assert_eq!(
            ignore(ask(
                Mode::Proxy,
                1,
                &[(60, b"udhcp 1.35.0")],
                &[],
                BOOTABLE,
                None,
                Port::Dhcp
            )),
            "not a network-boot client"
        );
        assert_eq!(
            ignore(ask(Mode::Proxy, 3, BIOS, &[], BOOTABLE, None, Port::Dhcp)),
            "request for the site's DHCP server"
        );
        assert_eq!(
            ignore(ask(
                Mode::Proxy,
                1,
                BIOS,
                &[],
                NodeView {
                    bootable: true,
                    local_boot: true,
                    chainload: false,
                },
                None,
                Port::Dhcp
            )),
            "local boot"
        );
        assert_eq!(
            ignore(ask(
                Mode::Proxy,
                1,
                BIOS,
                &[],
                NodeView::default(),
                None,
                Port::Dhcp
            )),
            "nothing to boot"
        );
        assert_eq!(
            ignore(ask(Mode::Off, 1, BIOS, &[], BOOTABLE, None, Port::Dhcp)),
            "dhcp off"
        );
        // Quirk (EDK2 BINL): the firmware asks port 4011 directly; it gets an ACK there.
        let r = reply(ask(
            Mode::Proxy,
            3,
            UEFI,
            &[],
            BOOTABLE,
            None,
            Port::PxeServer,
        ));
        assert_eq!(
            (r.message_type, r.file.as_deref()),
            (ACK, Some("snponly.efi"))
        );
    }

    /// An iPXE client marked for chainloading gets the binary of its firmware class
    /// (from option 60's arch) with TFTP options, in both modes.
    #[test]
    fn an_ipxe_client_to_chainload_gets_the_binary_of_its_firmware() {
        const IPXE_EFI: &[(u8, &[u8])] = &[
            (60, b"PXEClient:Arch:00007:UNDI:003010"),
            (93, &[0, 7]),
            (77, b"iPXE"),
        ];
        let chain = NodeView {
            chainload: true,
            ..BOOTABLE
        };
        for (class, file) in [(IPXE, "undionly.kpxe"), (IPXE_EFI, "snponly.efi")] {
            let r = reply(ask(Mode::Proxy, 1, class, &[], chain, None, Port::Dhcp));
            assert_eq!(r.file.as_deref(), Some(file));
            assert_eq!(opt(&r, 66), Some(&b"10.9.0.1"[..]));
            // PXE discovery control 8: boot this file, ask no boot server (port 4011).
            assert_eq!(opt(&r, 43), Some(&[6, 1, 8, 255][..]));
            let mut leases = pool();
            let r = reply(ask(
                Mode::Authoritative,
                1,
                class,
                &[],
                chain,
                Some(&mut leases),
                Port::Dhcp,
            ));
            assert_eq!(r.file.as_deref(), Some(file));
            assert_eq!(
                r.class,
                Some(if file == "undionly.kpxe" {
                    BootClass::Bios
                } else {
                    BootClass::UefiX64
                })
            );
        }
        // Not marked: the script, as before.
        let r = reply(ask(Mode::Proxy, 1, IPXE, &[], BOOTABLE, None, Port::Dhcp));
        assert_eq!(r.file.as_deref(), Some("http://10.9.0.1:8080/boot.ipxe"));
    }

    #[test]
    fn authoritative_mode_runs_the_lease_protocol() {
        let mut leases = pool();
        let server_id: &[u8] = &[10, 9, 0, 1];
        let other_server: &[u8] = &[10, 9, 0, 2];
        // DISCOVER: an address and, for a bootable PXE client, the boot file.
        let offer = reply(ask(
            Mode::Authoritative,
            1,
            BIOS,
            &[],
            BOOTABLE,
            Some(&mut leases),
            Port::Dhcp,
        ));
        assert_eq!(offer.message_type, OFFER);
        assert_eq!(offer.yiaddr, "10.9.0.100".parse::<Ipv4Addr>().unwrap());
        assert_eq!(offer.file.as_deref(), Some("undionly.kpxe"));
        assert_eq!(opt(&offer, 51), Some(&3600u32.to_be_bytes()[..]));
        assert_eq!(opt(&offer, 3), Some(&[10, 9, 0, 254][..]));
        let yiaddr = offer.yiaddr.octets();
        // REQUEST (selecting): ACK.
        let ack = reply(ask(
            Mode::Authoritative,
            3,
            BIOS,
            &[(54, server_id), (50, &yiaddr)],
            BOOTABLE,
            Some(&mut leases),
            Port::Dhcp,
        ));
        assert_eq!((ack.message_type, ack.yiaddr), (ACK, offer.yiaddr));
        // INIT-REBOOT for an address outside the pool (it moved segments): NAK.
        let nak = reply(ask(
            Mode::Authoritative,
            3,
            &[],
            &[(50, &[10, 9, 0, 50])],
            NodeView::default(),
            Some(&mut pool()),
            Port::Dhcp,
        ));
        assert_eq!(nak.message_type, NAK);
        // A client that chose another server frees our offer.
        assert_eq!(
            ask(
                Mode::Authoritative,
                3,
                &[],
                &[(54, other_server), (50, &yiaddr)],
                NodeView::default(),
                Some(&mut leases),
                Port::Dhcp
            ),
            Decision::Done("client chose another server")
        );
        // iPXE is told not to wait for proxyDHCP (175.176 = 1); no boot file for
        // a plain DHCP client, just the address.
        let mut fresh = pool();
        let r = reply(ask(
            Mode::Authoritative,
            1,
            IPXE,
            &[],
            BOOTABLE,
            Some(&mut fresh),
            Port::Dhcp,
        ));
        assert_eq!(opt(&r, 175), Some(&[176, 1, 1, 255][..]));
        let r = reply(ask(
            Mode::Authoritative,
            1,
            &[(60, b"udhcp 1.35.0")],
            &[],
            NodeView::default(),
            Some(&mut fresh),
            Port::Dhcp,
        ));
        assert_eq!((r.file.as_deref(), opt(&r, 67)), (None, None));
        // INFORM: options, no address, no lease time.
        let r = reply(ask(
            Mode::Authoritative,
            8,
            &[],
            &[],
            NodeView::default(),
            Some(&mut fresh),
            Port::Dhcp,
        ));
        assert_eq!(
            (r.message_type, r.yiaddr, opt(&r, 51)),
            (ACK, Ipv4Addr::UNSPECIFIED, None)
        );
        assert_eq!(
            ask(
                Mode::Authoritative,
                4,
                &[],
                &[(50, &[10, 9, 0, 101])],
                NodeView::default(),
                Some(&mut fresh),
                Port::Dhcp
            ),
            Decision::Done("declined")
        );
    }

    #[test]
    fn replies_put_the_message_type_first_and_are_bootp_sized() {
        use crate::dhcp::reply::{MIN_REPLY, encode};
        use dhcproto::{Decodable, Decoder, v4};
        let mut relay82 = v4::relay::RelayAgentInformation::default();
        relay82.insert(v4::relay::RelayInfo::AgentCircuitId(b"eth1/7".to_vec()));
        let options = vec![
            (53u8, &[1u8][..]),
            (60, b"PXEClient:Arch:00000:UNDI:002001"),
        ];
        let req = check(&request(MAC, &options)).unwrap();
        let r = reply(decide(
            &req,
            &classify(&req),
            &BOOTABLE,
            &settings(Mode::Proxy),
            None,
            Port::Dhcp,
            0,
        ));
        let bytes = encode(
            &req,
            &r,
            "10.9.0.1".parse().unwrap(),
            Some(v4::DhcpOption::RelayAgentInformation(relay82.clone())),
        );
        assert!(bytes.len() >= MIN_REPLY);
        // Quirk (old PXE ROMs): option 53 first, 54 next; 82 stays last.
        assert_eq!(&bytes[240..243], &[53, 1, OFFER]);
        assert_eq!(&bytes[243..245], &[54, 4]);
        let msg = v4::Message::decode(&mut Decoder::new(&bytes)).unwrap();
        assert_eq!(msg.opcode(), v4::Opcode::BootReply);
        assert_eq!(msg.xid(), req.xid);
        assert_eq!(
            msg.fname_str().unwrap().unwrap().trim_end_matches('\0'),
            "undionly.kpxe"
        );
        assert_eq!(
            msg.opts().get(v4::OptionCode::RelayAgentInformation),
            Some(&v4::DhcpOption::RelayAgentInformation(relay82))
        );
    }
}
