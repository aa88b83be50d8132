//! Router advertisements that end iPXE's wait for IPv6, pure: a router solicitation
//! checked, and the advertisement that answers it.
//!
//! Why: at every start iPXE configures IPv4 (DHCP) and IPv6 (router solicitations) side
//! by side and uses neither until both finish; on a segment without an IPv6 router its
//! solicitations go unanswered for about 16 s (measured: bench/boot.sh, lab notes). iPXE
//! ends IPv6 autoconfiguration at the first solicited advertisement whose M and O flags
//! are clear (no DHCPv6 to run). Ours says "not a router" (lifetime 0), carries no prefix
//! (no address is made from it) and no hop limit or timers (0: unspecified), so hosts that
//! see it change nothing: RFC 4861 6.3.4 ignores zero fields, and a zero lifetime adds no
//! default route.

use std::fmt;

/// ICMPv6 types (RFC 4861 4.1, 4.2) and the option we read and send (4.6.1).
pub const ROUTER_SOLICITATION: u8 = 133;
pub const ROUTER_ADVERTISEMENT: u8 = 134;
/// The hop limit neighbour discovery is sent with and must arrive with: a message that
/// crossed a router arrives with less (RFC 4861 6.1).
pub const HOP_LIMIT: i32 = 255;
const SOURCE_LINK_LAYER: u8 = 1;

/// A router solicitation as received (the ICMPv6 message; the kernel has checked its
/// checksum).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Solicitation {
    /// The sender's link-layer address option, when it sent one.
    pub source_mac: Option<[u8; 6]>,
}

/// Why a message was not answered: the `reason` of the drop counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// Another ICMPv6 message (neighbour discovery, echo...): not ours to answer.
    NotSolicitation,
    TooShort,
    BadCode,
    /// An option of length 0 or running past the message.
    BadOption,
}

impl Dropped {
    pub fn reason(self) -> &'static str {
        match self {
            Dropped::NotSolicitation => "not-solicitation",
            Dropped::TooShort => "rs-too-short",
            Dropped::BadCode => "rs-bad-code",
            Dropped::BadOption => "rs-bad-option",
        }
    }
}

impl fmt::Display for Dropped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason())
    }
}

/// Whether `msg` is another router's advertisement that hosts act on (a lifetime, or M
/// or O set): a real IPv6 router serves the segment, and ours would contradict it.
pub fn real_router(msg: &[u8]) -> bool {
    msg.len() >= 16
        && msg[0] == ROUTER_ADVERTISEMENT
        && msg[1] == 0
        && (msg[5] & 0xc0 != 0 || msg[6..8] != [0, 0])
}

/// Checks an ICMPv6 message as a router solicitation (RFC 4861 6.1.1: code 0, at least 8
/// bytes, every option of non-zero length within the message).
pub fn parse_solicitation(msg: &[u8]) -> Result<Solicitation, Dropped> {
    match msg.first() {
        Some(&ROUTER_SOLICITATION) => {}
        Some(_) => return Err(Dropped::NotSolicitation),
        None => return Err(Dropped::TooShort),
    }
    if msg.len() < 8 {
        return Err(Dropped::TooShort);
    }
    if msg[1] != 0 {
        return Err(Dropped::BadCode);
    }
    let mut source_mac = None;
    let mut options = &msg[8..];
    while !options.is_empty() {
        let [kind, units, ..] = *options else {
            return Err(Dropped::BadOption);
        };
        let len = usize::from(units) * 8;
        if len == 0 || len > options.len() {
            return Err(Dropped::BadOption);
        }
        if kind == SOURCE_LINK_LAYER && len == 8 {
            source_mac = Some(options[2..8].try_into().expect("six bytes"));
        }
        options = &options[len..];
    }
    Ok(Solicitation { source_mac })
}

/// The answer: an advertisement with every field zero (no hop limit, M and O clear, not
/// a router, no timers) and, when known, our link-layer address. The checksum is left
/// zero for the kernel to fill (raw ICMPv6 sockets always do, RFC 3542 3.1).
pub fn advertisement(our_mac: Option<[u8; 6]>) -> Vec<u8> {
    let mut msg = vec![0u8; 16];
    msg[0] = ROUTER_ADVERTISEMENT;
    if let Some(mac) = our_mac {
        msg.extend_from_slice(&[SOURCE_LINK_LAYER, 1]);
        msg.extend_from_slice(&mac);
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];

    fn solicitation(options: &[u8]) -> Vec<u8> {
        let mut msg = vec![ROUTER_SOLICITATION, 0, 0xab, 0xcd, 0, 0, 0, 0];
        msg.extend_from_slice(options);
        msg
    }

    #[test]
    fn a_solicitation_is_read_with_its_source_address() {
        let with = solicitation(&[1, 1, 0x52, 0x54, 0x00, 0x12, 0x34, 0x56]);
        assert_eq!(
            parse_solicitation(&with),
            Ok(Solicitation {
                source_mac: Some(MAC)
            })
        );
        // From the unspecified address a solicitation carries no such option.
        assert_eq!(
            parse_solicitation(&solicitation(&[])),
            Ok(Solicitation { source_mac: None })
        );
        // An unknown option is skipped (RFC 4861 4.6).
        let unknown = solicitation(&[200, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert!(parse_solicitation(&unknown).is_ok());
    }

    #[test]
    fn anything_else_is_dropped_with_its_reason() {
        assert_eq!(parse_solicitation(&[]), Err(Dropped::TooShort));
        assert_eq!(parse_solicitation(&[133, 0, 0]), Err(Dropped::TooShort));
        assert_eq!(
            parse_solicitation(&[135, 0, 0, 0, 0, 0, 0, 0]),
            Err(Dropped::NotSolicitation)
        );
        assert_eq!(
            parse_solicitation(&[133, 1, 0, 0, 0, 0, 0, 0]),
            Err(Dropped::BadCode)
        );
        // A zero-length option would loop forever; one past the end reads past it.
        assert_eq!(
            parse_solicitation(&solicitation(&[1, 0, 0, 0, 0, 0, 0, 0])),
            Err(Dropped::BadOption)
        );
        assert_eq!(
            parse_solicitation(&solicitation(&[1, 2, 0, 0, 0, 0, 0, 0])),
            Err(Dropped::BadOption)
        );
        assert_eq!(
            parse_solicitation(&solicitation(&[1])),
            Err(Dropped::BadOption)
        );
    }

    #[test]
    fn a_real_router_is_told_from_ours() {
        assert!(!real_router(&advertisement(Some(MAC))));
        let mut managed = advertisement(None);
        managed[5] = 0x80;
        assert!(real_router(&managed));
        let mut default_router = advertisement(None);
        default_router[6..8].copy_from_slice(&1800u16.to_be_bytes());
        assert!(real_router(&default_router));
        assert!(!real_router(&[ROUTER_SOLICITATION, 0, 0, 0, 0, 0, 0, 0]));
    }

    #[test]
    fn the_advertisement_says_no_router_no_prefix_no_dhcpv6() {
        let ra = advertisement(Some(MAC));
        assert_eq!(ra.len(), 24);
        assert_eq!(ra[0], ROUTER_ADVERTISEMENT);
        assert_eq!(ra[1], 0, "code");
        assert_eq!(ra[4], 0, "hop limit unspecified");
        assert_eq!(ra[5], 0, "M and O clear: iPXE ends IPv6 autoconfiguration");
        assert_eq!(
            &ra[6..8],
            &[0, 0],
            "router lifetime 0: not a default router"
        );
        assert_eq!(
            &ra[8..16],
            &[0; 8],
            "reachable and retransmit timers unspecified"
        );
        assert_eq!(&ra[16..], &[1, 1, 0x52, 0x54, 0x00, 0x12, 0x34, 0x56]);
        assert_eq!(advertisement(None).len(), 16);
    }
}
