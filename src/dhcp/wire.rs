//! Untrusted DHCP bytes, checked before anything else reads them: the fixed header, the
//! magic cookie, and every option's length, with RFC 3396 concatenation and RFC 2132
//! option overload (options continued in `file` and `sname`). A packet that fails any
//! check is dropped with a named reason and counted; nothing past this point sees it.
//!
//! Why our own scan next to dhcproto: dhcproto keeps only the first architecture of
//! option 93, keeps 175 as opaque bytes, and checks some fixed lengths only with
//! `debug_assert!` (a malformed option 94 would panic a debug build). This walk is the
//! gate; dhcproto then decodes the packet it let through and encodes our replies.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

pub const MAGIC_COOKIE: [u8; 4] = [99, 130, 83, 99];
/// The BOOTP header before the options.
pub const HEADER_LEN: usize = 236;
/// Larger datagrams are refused: no client needs more (RFC 2131 clients must accept 576).
pub const MAX_PACKET: usize = 1500;

/// Why a packet was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Malformed {
    TooShort,
    TooLong,
    NotRequest,
    NotEthernet,
    NoMagicCookie,
    /// An option's length runs past the end of its field.
    OptionOverrun,
    /// A fixed-size option with the wrong length.
    BadOptionLength(u8),
    /// No option 53.
    NoMessageType,
}

impl Malformed {
    pub fn as_str(self) -> &'static str {
        match self {
            Malformed::TooShort => "too-short",
            Malformed::TooLong => "too-long",
            Malformed::NotRequest => "not-bootrequest",
            Malformed::NotEthernet => "not-ethernet",
            Malformed::NoMagicCookie => "no-magic-cookie",
            Malformed::OptionOverrun => "option-overrun",
            Malformed::BadOptionLength(_) => "bad-option-length",
            Malformed::NoMessageType => "no-message-type",
        }
    }
}

/// A checked request: header fields and every option's (concatenated) bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub xid: u32,
    pub flags_broadcast: bool,
    pub ciaddr: Ipv4Addr,
    pub giaddr: Ipv4Addr,
    pub chaddr: [u8; 6],
    pub hops: u8,
    pub options: BTreeMap<u8, Vec<u8>>,
}

impl Checked {
    pub fn option(&self, code: u8) -> Option<&[u8]> {
        self.options.get(&code).map(Vec::as_slice)
    }

    pub fn message_type(&self) -> u8 {
        self.options[&53][0]
    }
}

/// Required lengths of the options we read, and of those dhcproto decodes with only a
/// debug assertion. `None`: any length.
fn length_ok(code: u8, len: usize) -> bool {
    match code {
        53 | 52 => len == 1,
        50 | 54 | 51 | 58 | 59 | 152..=155 => len == 4,
        57 => len == 2,
        93 => len >= 2 && len.is_multiple_of(2),
        94 => len == 3,
        97 => len == 17 || len == 0,
        80 => len == 0,
        81 => len >= 3,
        82 => len >= 2,
        _ => true,
    }
}

/// Walks one options field, appending to `out` (RFC 3396: repeated codes concatenate).
fn walk(field: &[u8], out: &mut BTreeMap<u8, Vec<u8>>) -> Result<(), Malformed> {
    let mut i = 0;
    while i < field.len() {
        match field[i] {
            0 => i += 1,
            255 => return Ok(()),
            code => {
                let len = *field.get(i + 1).ok_or(Malformed::OptionOverrun)? as usize;
                let value = field
                    .get(i + 2..i + 2 + len)
                    .ok_or(Malformed::OptionOverrun)?;
                out.entry(code).or_default().extend_from_slice(value);
                i += 2 + len;
            }
        }
    }
    Ok(())
}

/// Checks a request datagram.
pub fn check(bytes: &[u8]) -> Result<Checked, Malformed> {
    if bytes.len() > MAX_PACKET {
        return Err(Malformed::TooLong);
    }
    if bytes.len() < HEADER_LEN + 4 {
        return Err(Malformed::TooShort);
    }
    if bytes[0] != 1 {
        return Err(Malformed::NotRequest);
    }
    if bytes[1] != 1 || bytes[2] != 6 {
        return Err(Malformed::NotEthernet);
    }
    if bytes[HEADER_LEN..HEADER_LEN + 4] != MAGIC_COOKIE {
        return Err(Malformed::NoMagicCookie);
    }
    let ip = |at: usize| Ipv4Addr::new(bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]);
    let mut options = BTreeMap::new();
    walk(&bytes[HEADER_LEN + 4..], &mut options)?;
    // Option overload: more options in `file` (108..236) and/or `sname` (44..108).
    if let Some(overload) = options.get(&52).cloned() {
        if overload.len() != 1 {
            return Err(Malformed::BadOptionLength(52));
        }
        if overload[0] & 1 != 0 {
            walk(&bytes[108..236], &mut options)?;
        }
        if overload[0] & 2 != 0 {
            walk(&bytes[44..108], &mut options)?;
        }
    }
    for (code, value) in &options {
        if !length_ok(*code, value.len()) {
            return Err(Malformed::BadOptionLength(*code));
        }
    }
    if !options.contains_key(&53) {
        return Err(Malformed::NoMessageType);
    }
    let mut chaddr = [0u8; 6];
    chaddr.copy_from_slice(&bytes[28..34]);
    Ok(Checked {
        hops: bytes[3],
        xid: u32::from_be_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]),
        flags_broadcast: bytes[10] & 0x80 != 0,
        ciaddr: ip(12),
        giaddr: ip(24),
        chaddr,
        options,
    })
}

/// Encodes `(code, value)` TLVs, splitting values over 255 bytes (RFC 3396).
pub fn encode_tlvs(items: &[(u8, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (code, value) in items {
        if value.is_empty() {
            out.extend_from_slice(&[*code, 0]);
        }
        for chunk in value.chunks(255) {
            out.push(*code);
            out.push(chunk.len() as u8);
            out.extend_from_slice(chunk);
        }
    }
    out
}

/// Decodes encapsulated TLVs (options 43 and 175); None if they run past the end.
pub fn decode_tlvs(bytes: &[u8]) -> Option<BTreeMap<u8, Vec<u8>>> {
    let mut out = BTreeMap::new();
    walk(bytes, &mut out).ok()?;
    Some(out)
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// A BOOTREQUEST with these options (code, value), in this order.
    pub fn request(mac: [u8; 6], options: &[(u8, &[u8])]) -> Vec<u8> {
        let mut p = vec![0u8; HEADER_LEN];
        p[0] = 1;
        p[1] = 1;
        p[2] = 6;
        p[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        p[28..34].copy_from_slice(&mac);
        p.extend_from_slice(&MAGIC_COOKIE);
        p.extend(encode_tlvs(options));
        p.push(255);
        p
    }

    const MAC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];

    #[test]
    fn a_pxe_discover_is_read_whole() {
        let p = request(
            MAC,
            &[
                (53, &[1]),
                (93, &[0, 7, 0, 16]),
                (60, b"PXEClient:Arch:00007:UNDI:003000"),
            ],
        );
        let c = check(&p).unwrap();
        assert_eq!(c.message_type(), 1);
        assert_eq!(c.chaddr, MAC);
        assert_eq!(c.xid, 0x1234_5678);
        assert_eq!(
            c.option(93),
            Some(&[0u8, 7, 0, 16][..]),
            "every architecture"
        );
    }

    #[test]
    fn long_and_overloaded_options_are_joined() {
        let long = vec![b'x'; 300];
        let mut p = request(MAC, &[(53, &[1]), (52, &[1]), (77, &long)]);
        // Option 60 continued in the `file` field.
        let file = encode_tlvs(&[(60, b"PXEClient")]);
        p[108..108 + file.len()].copy_from_slice(&file);
        p[108 + file.len()] = 255;
        let c = check(&p).unwrap();
        assert_eq!(c.option(77).unwrap().len(), 300);
        assert_eq!(c.option(60), Some(&b"PXEClient"[..]));
    }

    #[test]
    fn each_malformation_is_named() {
        let good = request(MAC, &[(53, &[1])]);
        let cases: Vec<(Vec<u8>, Malformed)> = vec![
            (good[..200].to_vec(), Malformed::TooShort),
            (vec![1; 1501], Malformed::TooLong),
            (
                {
                    let mut p = good.clone();
                    p[0] = 2;
                    p
                },
                Malformed::NotRequest,
            ),
            (
                {
                    let mut p = good.clone();
                    p[2] = 16;
                    p
                },
                Malformed::NotEthernet,
            ),
            (
                {
                    let mut p = good.clone();
                    p[237] = 0;
                    p
                },
                Malformed::NoMagicCookie,
            ),
            (
                {
                    let mut p = good[..good.len() - 1].to_vec();
                    p.extend([60, 40, 1]);
                    p
                },
                Malformed::OptionOverrun,
            ),
            (
                request(MAC, &[(53, &[1]), (94, &[1, 2])]),
                Malformed::BadOptionLength(94),
            ),
            (
                request(MAC, &[(53, &[1]), (93, &[0])]),
                Malformed::BadOptionLength(93),
            ),
            (
                request(MAC, &[(53, &[1, 2])]),
                Malformed::BadOptionLength(53),
            ),
            (request(MAC, &[(12, b"host")]), Malformed::NoMessageType),
        ];
        for (bytes, want) in cases {
            assert_eq!(check(&bytes), Err(want));
        }
    }
}
