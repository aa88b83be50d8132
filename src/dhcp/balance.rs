//! Which server answers a client's DISCOVER when several hold slices of one pool (Kea's
//! load balancing, RFC 3074's idea): the client's MAC picks a slice, and that slice's
//! holder answers at once; the others answer only a DISCOVER they see a second time (the
//! client retransmitted: its own server is silent or gone). One offer per client instead
//! of one per server halves the DHCP work of a storm on two servers, and a dead server
//! costs its clients one retransmit, not an address. Pure: time is an argument.

use std::collections::HashMap;

use super::leases::HwAddr;

/// A first sighting is forgotten after this long (a client retransmits within seconds).
const REMEMBER_MS: i64 = 30_000;
/// Most first sightings kept; past it the oldest half is dropped (a flood of made-up
/// MACs costs a few answers, not memory).
const MAX_REMEMBERED: usize = 65_536;

/// The slice (0..`of`) whose holder answers `mac` first: FNV-1a over the MAC, so that
/// sequential MACs spread evenly.
pub fn owner(mac: &HwAddr, of: u32) -> u32 {
    fnv(mac) % of.max(1)
}

fn fnv(mac: &HwAddr) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in mac {
        h = (h ^ u32::from(*b)).wrapping_mul(0x0100_0193);
    }
    h
}

/// The slice whose holder answers `mac` first among the slices held now (`live`, a bit
/// per slice; none known: all): a dead server's clients go to the living at once, not
/// after a retransmit. Servers read the holders every few seconds, so for a moment two
/// may both answer (two offers) or neither (the retransmit path).
pub fn first_answerer(mac: &HwAddr, of: u32, live: u64) -> u32 {
    let held: Vec<u32> = (0..of.min(64)).filter(|k| live & (1 << k) != 0).collect();
    if held.is_empty() {
        return owner(mac, of);
    }
    held[fnv(mac) as usize % held.len()]
}

/// DISCOVERs of other slices' clients seen once, by (MAC, xid).
#[derive(Default)]
pub struct FirstSightings {
    seen: HashMap<(HwAddr, u32), i64>,
}

impl FirstSightings {
    /// Whether this DISCOVER was seen before (answer it now); else remembers it.
    pub fn seen_again(&mut self, mac: HwAddr, xid: u32, now_ms: i64) -> bool {
        if let Some(at) = self.seen.remove(&(mac, xid))
            && now_ms - at < REMEMBER_MS
        {
            return true;
        }
        if self.seen.len() >= MAX_REMEMBERED {
            let mut ages: Vec<i64> = self.seen.values().copied().collect();
            ages.sort_unstable();
            let cut = ages[ages.len() / 2];
            self.seen.retain(|_, at| *at > cut);
        }
        self.seen.insert((mac, xid), now_ms);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_macs_spread_over_the_slices() {
        let mut counts = [0u32; 3];
        for i in 0..3000u32 {
            let b = i.to_be_bytes();
            counts[owner(&[2, 0xbf, b[0], b[1], b[2], b[3]], 3) as usize] += 1;
        }
        for c in counts {
            assert!((800..1200).contains(&c), "{counts:?}");
        }
        assert_eq!(owner(&[1, 2, 3, 4, 5, 6], 1), 0);
    }

    #[test]
    fn a_dead_slices_clients_go_to_the_living() {
        let macs: Vec<HwAddr> = (0..300u32)
            .map(|i| {
                let b = i.to_be_bytes();
                [2, 0, 0, b[1], b[2], b[3]]
            })
            .collect();
        for m in &macs {
            assert_eq!(
                first_answerer(m, 3, 0b111),
                owner(m, 3),
                "all held: the owner"
            );
            assert_ne!(first_answerer(m, 3, 0b101), 1, "slice 1 is held by none");
            assert_eq!(first_answerer(m, 3, 0), owner(m, 3), "none known: all");
        }
        let to_two = macs
            .iter()
            .filter(|m| first_answerer(m, 3, 0b101) == 2)
            .count();
        assert!(
            (100..200).contains(&to_two),
            "spread over the living: {to_two}"
        );
    }

    #[test]
    fn a_partner_answers_a_retransmitted_discover_only() {
        let mut s = FirstSightings::default();
        let mac = [2, 0, 0, 0, 0, 1];
        assert!(
            !s.seen_again(mac, 7, 0),
            "first sighting: left to its server"
        );
        assert!(
            s.seen_again(mac, 7, 4_000),
            "retransmitted: its server is silent"
        );
        assert!(!s.seen_again(mac, 8, 5_000), "another exchange starts over");
        assert!(!s.seen_again(mac, 9, 0));
        assert!(
            !s.seen_again(mac, 9, 40_000),
            "too long ago: a first sighting again"
        );
    }

    #[test]
    fn memory_stays_bounded() {
        let mut s = FirstSightings::default();
        for i in 0..(MAX_REMEMBERED as u32 + 10) {
            s.seen_again([0; 6], i, i64::from(i));
        }
        assert!(s.seen.len() <= MAX_REMEMBERED);
    }
}
