//! One datagram through TFTP's pure path, as fuzzers and property tests drive it: parse
//! -> encode -> parse again (the same packet) -> for a read request, the name check and
//! option negotiation (agreed values inside their limits). Shared by
//! `fuzz/fuzz_targets/tftp_packet.rs` and `tests/it/fuzz.rs`, so the target builds
//! whenever the tests do.

use super::options::{OptionLimits, negotiate};
use super::packet::Packet;

/// Runs `bytes` through everything; returns whether they parsed. Panics if what we
/// encode does not parse back to the same packet, or a negotiation leaves its limits.
pub fn exercise(bytes: &[u8]) -> bool {
    let Ok(packet) = Packet::parse(bytes) else {
        return false;
    };
    let again = Packet::parse(&packet.encode()).expect("what we encode parses");
    assert_eq!(again, packet, "encode then parse gives the packet back");
    if let Packet::Rrq(req) = &packet {
        let _ = super::files::check_name(&req.filename);
        let limits = OptionLimits::default();
        for file_len in [0, 511, 512, 1 << 20, u64::MAX] {
            let n = negotiate(&req.options, file_len, limits);
            assert!(
                (8..=limits.max_blksize).contains(&n.blksize),
                "blksize {}",
                n.blksize
            );
            assert!(
                (1..=limits.max_windowsize).contains(&n.windowsize),
                "windowsize {}",
                n.windowsize
            );
            for (name, _) in &n.oack {
                assert!(
                    req.options.iter().any(|(asked, _)| asked == name),
                    "OACK names {name}, which was not asked for"
                );
            }
        }
    }
    true
}
