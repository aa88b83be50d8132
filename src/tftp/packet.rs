//! TFTP wire format (RFC 1350, options RFC 2347): bytes <-> typed packets, no I/O.

use std::fmt;

pub const OP_RRQ: u16 = 1;
pub const OP_WRQ: u16 = 2;
pub const OP_DATA: u16 = 3;
pub const OP_ACK: u16 = 4;
pub const OP_ERROR: u16 = 5;
pub const OP_OACK: u16 = 6;

/// Longest request we parse; a real RRQ with every option is under 200 bytes.
pub const MAX_REQUEST_LEN: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub filename: String,
    pub mode: String,
    /// Option names lower-cased, in the order sent.
    pub options: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Packet {
    Rrq(Request),
    Wrq(Request),
    Data { block: u16, data: Vec<u8> },
    Ack { block: u16 },
    Error { code: u16, message: String },
    Oack { options: Vec<(String, String)> },
}

/// Error codes of RFC 1350 and 2347.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    NotDefined = 0,
    FileNotFound = 1,
    AccessViolation = 2,
    IllegalOperation = 4,
    UnknownTransferId = 5,
    OptionRefused = 8,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    #[error("packet shorter than its opcode")]
    TooShort,
    #[error("packet longer than {MAX_REQUEST_LEN} bytes")]
    TooLong,
    #[error("unknown opcode {0}")]
    UnknownOpcode(u16),
    #[error("string field not terminated by NUL")]
    Unterminated,
    #[error("string field is not UTF-8")]
    NotUtf8,
    #[error("option {0:?} has no value")]
    OptionWithoutValue(String),
    #[error("{0}-byte ACK (must be 4)")]
    BadAckLength(usize),
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} mode {}", self.filename, self.mode)
    }
}

/// Splits NUL-terminated strings; every field must be terminated.
fn strings(mut rest: &[u8]) -> Result<Vec<String>, PacketError> {
    let mut out = Vec::new();
    while !rest.is_empty() {
        let end = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(PacketError::Unterminated)?;
        let s = std::str::from_utf8(&rest[..end]).map_err(|_| PacketError::NotUtf8)?;
        out.push(s.to_string());
        rest = &rest[end + 1..];
    }
    Ok(out)
}

fn request(body: &[u8]) -> Result<Request, PacketError> {
    if body.len() > MAX_REQUEST_LEN {
        return Err(PacketError::TooLong);
    }
    let fields = strings(body)?;
    let mut it = fields.into_iter();
    let filename = it.next().ok_or(PacketError::Unterminated)?;
    let mode = it
        .next()
        .ok_or(PacketError::Unterminated)?
        .to_ascii_lowercase();
    let mut options = Vec::new();
    while let Some(name) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| PacketError::OptionWithoutValue(name.clone()))?;
        options.push((name.to_ascii_lowercase(), value));
    }
    Ok(Request {
        filename,
        mode,
        options,
    })
}

impl Packet {
    pub fn parse(bytes: &[u8]) -> Result<Self, PacketError> {
        if bytes.len() < 2 {
            return Err(PacketError::TooShort);
        }
        let opcode = u16::from_be_bytes([bytes[0], bytes[1]]);
        let body = &bytes[2..];
        let u16_at = |b: &[u8]| -> Result<u16, PacketError> {
            if b.len() < 2 {
                return Err(PacketError::TooShort);
            }
            Ok(u16::from_be_bytes([b[0], b[1]]))
        };
        match opcode {
            OP_RRQ => Ok(Packet::Rrq(request(body)?)),
            OP_WRQ => Ok(Packet::Wrq(request(body)?)),
            OP_DATA => Ok(Packet::Data {
                block: u16_at(body)?,
                data: body[2..].to_vec(),
            }),
            OP_ACK => {
                if body.len() != 2 {
                    return Err(PacketError::BadAckLength(bytes.len()));
                }
                Ok(Packet::Ack {
                    block: u16_at(body)?,
                })
            }
            OP_ERROR => {
                let code = u16_at(body)?;
                // Some clients omit the final NUL of the message; accept that.
                let text = &body[2..];
                let text = text.strip_suffix(&[0]).unwrap_or(text);
                Ok(Packet::Error {
                    code,
                    message: String::from_utf8_lossy(text).into_owned(),
                })
            }
            OP_OACK => {
                let fields = strings(body)?;
                let options = fields
                    .chunks(2)
                    .map(|c| match c {
                        [k, v] => Ok((k.to_ascii_lowercase(), v.clone())),
                        [k] => Err(PacketError::OptionWithoutValue(k.clone())),
                        _ => unreachable!("chunks(2)"),
                    })
                    .collect::<Result<_, _>>()?;
                Ok(Packet::Oack { options })
            }
            other => Err(PacketError::UnknownOpcode(other)),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Packet::Rrq(r) | Packet::Wrq(r) => {
                let op = if matches!(self, Packet::Rrq(_)) {
                    OP_RRQ
                } else {
                    OP_WRQ
                };
                out.extend_from_slice(&op.to_be_bytes());
                for s in [&r.filename, &r.mode] {
                    out.extend_from_slice(s.as_bytes());
                    out.push(0);
                }
                push_options(&mut out, &r.options);
            }
            Packet::Data { block, data } => {
                encode_data_header(&mut out, *block);
                out.extend_from_slice(data);
            }
            Packet::Ack { block } => {
                out.extend_from_slice(&OP_ACK.to_be_bytes());
                out.extend_from_slice(&block.to_be_bytes());
            }
            Packet::Error { code, message } => {
                out.extend_from_slice(&OP_ERROR.to_be_bytes());
                out.extend_from_slice(&code.to_be_bytes());
                out.extend_from_slice(message.as_bytes());
                out.push(0);
            }
            Packet::Oack { options } => {
                out.extend_from_slice(&OP_OACK.to_be_bytes());
                push_options(&mut out, options);
            }
        }
        out
    }

    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Packet::Error {
            code: code as u16,
            message: message.into(),
        }
    }
}

fn push_options(out: &mut Vec<u8>, options: &[(String, String)]) {
    for (k, v) in options {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
}

/// Writes the 4-byte DATA header; the caller appends the payload (avoids a copy).
pub fn encode_data_header(out: &mut Vec<u8>, block: u16) {
    out.extend_from_slice(&OP_DATA.to_be_bytes());
    out.extend_from_slice(&block.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rrq(name: &str, opts: &[(&str, &str)]) -> Packet {
        Packet::Rrq(Request {
            filename: name.into(),
            mode: "octet".into(),
            options: opts
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        })
    }

    #[test]
    fn round_trips() {
        for p in [
            rrq("undionly.kpxe", &[]),
            rrq(
                "ipxe.efi",
                &[("blksize", "1468"), ("tsize", "0"), ("windowsize", "4")],
            ),
            Packet::Data {
                block: 65535,
                data: vec![1, 2, 3],
            },
            Packet::Data {
                block: 0,
                data: vec![],
            },
            Packet::Ack { block: 7 },
            Packet::error(ErrorCode::FileNotFound, "no such file"),
            Packet::Oack {
                options: vec![("blksize".into(), "1428".into())],
            },
        ] {
            assert_eq!(Packet::parse(&p.encode()).unwrap(), p);
        }
    }

    #[test]
    fn real_capture_parses() {
        // An EDK2 (OVMF) RRQ as seen on the wire.
        let bytes =
            b"\x00\x01ipxe.efi\x00octet\x00blksize\x001468\x00windowsize\x004\x00tsize\x000\x00";
        let Packet::Rrq(r) = Packet::parse(bytes).unwrap() else {
            panic!()
        };
        assert_eq!(r.filename, "ipxe.efi");
        assert_eq!(r.options[1], ("windowsize".into(), "4".into()));
    }

    #[test]
    fn refuses_malformed() {
        let check = |b: &[u8], e: PacketError| assert_eq!(Packet::parse(b), Err(e), "{b:?}");
        check(b"", PacketError::TooShort);
        check(b"\x00", PacketError::TooShort);
        check(b"\x00\x09", PacketError::UnknownOpcode(9));
        check(b"\x00\x01file", PacketError::Unterminated);
        check(b"\x00\x01file\x00", PacketError::Unterminated);
        check(
            b"\x00\x01f\x00octet\x00blksize\x00",
            PacketError::OptionWithoutValue("blksize".into()),
        );
        check(b"\x00\x01\xff\xfe\x00octet\x00", PacketError::NotUtf8);
        check(b"\x00\x04\x00", PacketError::BadAckLength(3));
        check(b"\x00\x04\x00\x01\x00", PacketError::BadAckLength(5));
        let mut long = b"\x00\x01".to_vec();
        long.extend(std::iter::repeat_n(b'a', 2000));
        long.push(0);
        check(&long, PacketError::TooLong);
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut x: u64 = 0x9e3779b97f4a7c15;
        for len in 0..600 {
            let bytes: Vec<u8> = (0..len % 64)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 7) as u8 // small values: many opcodes, NULs and short fields
                })
                .collect();
            let _ = Packet::parse(&bytes);
        }
    }
}
