//! The firmware's measured-boot event log (TCG PC Client Platform Firmware Profile,
//! crypto-agile format, as Linux exposes it at
//! `/sys/kernel/security/tpm0/binary_bios_measurements`): parsed with bounds on every
//! length, and replayed into the SHA-256 PCR values it claims to produce.
//!
//! Layout: one legacy TCG_PCR_EVENT header (its data a "Spec ID Event03" naming the
//! digest sizes), then TCG_PCR_EVENT2 records: pcr u32, type u32, digest count u32,
//! {alg u16, digest}×count, event size u32, event bytes; all little-endian.

use std::collections::BTreeMap;

use super::wire::alg;

/// Event types this crate names (PFP §10.4.1).
pub mod kind {
    pub const NO_ACTION: u32 = 0x0000_0003;
    pub const SEPARATOR: u32 = 0x0000_0004;
    pub const EFI_BOOT_SERVICES_APPLICATION: u32 = 0x8000_0003;
    pub const EFI_ACTION: u32 = 0x8000_0007;
}

/// The most events and bytes a log may hold: a real OVMF boot logs about 40 events in
/// 4 KiB; a server must not be made to allocate without bound by a node.
pub const MAX_LOG_BYTES: usize = 1 << 20;
const MAX_EVENT_BYTES: usize = 64 << 10;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub pcr: u32,
    pub kind: u32,
    /// The SHA-256 digest extended, when the event carries one.
    pub sha256: Option<[u8; 32]>,
    pub data: Vec<u8>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LogError {
    #[error("the event log is {0} bytes, more than {MAX_LOG_BYTES}")]
    TooBig(usize),
    #[error("the event log is truncated in event {0}")]
    Truncated(usize),
    #[error("the event log does not start with a crypto-agile Spec ID event")]
    NotCryptoAgile,
    #[error("event {0}: digest algorithm 0x{1:04x} is not named in the log's header")]
    UnknownAlgorithm(usize, u16),
    #[error("event {0}: {1} bytes of event data, more than {MAX_EVENT_BYTES}")]
    EventTooBig(usize, usize),
}

struct Le<'a> {
    rest: &'a [u8],
    event: usize,
}

impl<'a> Le<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], LogError> {
        if self.rest.len() < n {
            return Err(LogError::Truncated(self.event));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    fn u16(&mut self) -> Result<u16, LogError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32, LogError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
}

/// Parses a whole crypto-agile log. The header event is not returned.
pub fn parse(log: &[u8]) -> Result<Vec<Event>, LogError> {
    if log.len() > MAX_LOG_BYTES {
        return Err(LogError::TooBig(log.len()));
    }
    let mut r = Le {
        rest: log,
        event: 0,
    };
    // TCG_PCR_EVENT: pcr, type, sha1[20], size, data.
    let (_pcr, kind) = (r.u32()?, r.u32()?);
    r.take(20)?;
    let size = r.u32()? as usize;
    let header = r.take(size)?;
    if kind != kind::NO_ACTION || !header.starts_with(b"Spec ID Event03\0") {
        return Err(LogError::NotCryptoAgile);
    }
    let sizes = digest_sizes(header).ok_or(LogError::NotCryptoAgile)?;
    let mut events = Vec::new();
    while !r.rest.is_empty() {
        r.event = events.len() + 1;
        let pcr = r.u32()?;
        let kind = r.u32()?;
        let count = r.u32()?;
        let mut sha256 = None;
        for _ in 0..count.min(16) {
            let a = r.u16()?;
            let size = *sizes
                .get(&a)
                .ok_or(LogError::UnknownAlgorithm(r.event, a))?;
            let digest = r.take(size as usize)?;
            if a == alg::SHA256 && digest.len() == 32 {
                sha256 = Some(digest.try_into().expect("32 bytes"));
            }
        }
        let size = r.u32()? as usize;
        if size > MAX_EVENT_BYTES {
            return Err(LogError::EventTooBig(r.event, size));
        }
        let data = r.take(size)?.to_vec();
        events.push(Event {
            pcr,
            kind,
            sha256,
            data,
        });
    }
    Ok(events)
}

/// The digest sizes the Spec ID event declares: after the 16-byte signature,
/// platformClass u32, three version bytes, uintnSize u8, numberOfAlgorithms u32, then
/// {algorithmId u16, digestSize u16} each.
fn digest_sizes(header: &[u8]) -> Option<BTreeMap<u16, u16>> {
    let rest = header.get(16 + 4 + 3 + 1..)?;
    let n = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    if n > 16 {
        return None;
    }
    let mut sizes = BTreeMap::new();
    for i in 0..n {
        let at = 4 + i * 4;
        let a = u16::from_le_bytes(rest.get(at..at + 2)?.try_into().ok()?);
        let s = u16::from_le_bytes(rest.get(at + 2..at + 4)?.try_into().ok()?);
        sizes.insert(a, s);
    }
    Some(sizes)
}

/// The SHA-256 PCR values the events produce: each PCR starts at zeros and is
/// extended with every event's digest but EV_NO_ACTION's. A StartupLocality
/// EV_NO_ACTION on PCR 0 sets that PCR's last byte to the locality (PFP §10.4.5.3).
pub fn replay(events: &[Event]) -> BTreeMap<u32, [u8; 32]> {
    use sha2::{Digest as _, Sha256};
    let mut pcrs: BTreeMap<u32, [u8; 32]> = BTreeMap::new();
    for e in events {
        if e.kind == kind::NO_ACTION {
            if e.pcr == 0 && e.data.starts_with(b"StartupLocality\0") && e.data.len() > 16 {
                pcrs.entry(0).or_default()[31] = e.data[16];
            }
            continue;
        }
        let Some(digest) = e.sha256 else { continue };
        let pcr = pcrs.entry(e.pcr).or_default();
        let mut h = Sha256::new();
        h.update(*pcr);
        h.update(digest);
        *pcr = h.finalize().into();
    }
    pcrs
}

/// A crypto-agile log with a SHA-256 bank only, for tests and fixtures: the Spec ID
/// header, then `events` as (pcr, type, digest, data).
pub fn write(events: &[(u32, u32, [u8; 32], &[u8])]) -> Vec<u8> {
    let mut spec = b"Spec ID Event03\0".to_vec();
    spec.extend_from_slice(&0u32.to_le_bytes()); // platform class: client
    spec.extend_from_slice(&[0, 2, 0, 2]); // minor, major, errata, uintn size
    spec.extend_from_slice(&1u32.to_le_bytes());
    spec.extend_from_slice(&alg::SHA256.to_le_bytes());
    spec.extend_from_slice(&32u16.to_le_bytes());
    spec.push(0); // vendor info size
    let mut out = Vec::new();
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&kind::NO_ACTION.to_le_bytes());
    out.extend_from_slice(&[0; 20]);
    out.extend_from_slice(&(spec.len() as u32).to_le_bytes());
    out.extend_from_slice(&spec);
    for (pcr, kind, digest, data) in events {
        out.extend_from_slice(&pcr.to_le_bytes());
        out.extend_from_slice(&kind.to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&alg::SHA256.to_le_bytes());
        out.extend_from_slice(digest);
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(data);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest as _, Sha256};

    fn h(b: &[u8]) -> [u8; 32] {
        Sha256::digest(b).into()
    }

    #[test]
    fn a_written_log_parses_back_and_replays_like_a_tpm() {
        let log = write(&[
            (4, kind::EFI_ACTION, h(b"Calling EFI Application"), b"x"),
            (4, kind::SEPARATOR, h(&[0; 4]), &[0; 4]),
            (7, kind::SEPARATOR, h(&[0; 4]), &[0; 4]),
        ]);
        let events = parse(&log).unwrap();
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].pcr, 4);
        let pcrs = replay(&events);
        let mut pcr4 = [0u8; 32];
        for d in [h(b"Calling EFI Application"), h(&[0; 4])] {
            pcr4 = h(&[pcr4.as_slice(), d.as_slice()].concat());
        }
        assert_eq!(pcrs[&4], pcr4);
        assert_eq!(pcrs.len(), 2);
    }

    #[test]
    fn every_truncation_is_an_error_never_a_panic() {
        let log = write(&[(4, kind::SEPARATOR, h(&[0; 4]), &[0; 4])]);
        // A log cut right after its header is a log with no events; any other cut is
        // half an event.
        let header = write(&[]).len();
        for cut in (0..log.len()).filter(|c| *c != header) {
            assert!(parse(&log[..cut]).is_err(), "cut at {cut}");
        }
        assert_eq!(parse(&log[..header]), Ok(vec![]));
        let mut big = log.clone();
        let at = big.len() - 8; // the event size field of the last event
        big[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse(&big).is_err());
    }

    #[test]
    fn a_sha1_only_log_is_not_crypto_agile() {
        let mut log = write(&[]);
        log[32..47].copy_from_slice(b"Spec ID Event02");
        assert_eq!(parse(&log), Err(LogError::NotCryptoAgile));
    }
}
