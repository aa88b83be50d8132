//! Proxy mode's witness of client addresses: the address each network-booting MAC asked
//! the site's DHCP server for (option 50, or `ciaddr` once it holds one), as seen in its
//! broadcast DHCPREQUEST. Pure and bounded; time is an argument.

use std::collections::HashMap;
use std::net::Ipv4Addr;

use super::leases::HwAddr;

/// A request is trusted as a witness this long: we do not see the other server's
/// lease time, and a node fetches its script seconds after its request.
pub const REQUEST_HOLD_MS: i64 = 60 * 60_000;

/// Entries kept; past it the oldest half is dropped (a flood of forged MACs must not
/// grow memory).
pub const MAX_REQUESTS: usize = 100_000;

#[derive(Default)]
pub struct Requested {
    by_mac: HashMap<HwAddr, (Ipv4Addr, i64)>,
    /// Who asked for each address last (TFTP knows its clients by address).
    by_ip: HashMap<Ipv4Addr, HwAddr>,
}

impl Requested {
    pub fn record(&mut self, mac: HwAddr, ip: Ipv4Addr, now_ms: i64) {
        if ip.is_unspecified() || ip.is_broadcast() {
            return;
        }
        if self.by_mac.len() >= MAX_REQUESTS && !self.by_mac.contains_key(&mac) {
            self.drop_oldest_half();
        }
        if let Some((old, _)) = self.by_mac.insert(mac, (ip, now_ms))
            && old != ip
            && self.by_ip.get(&old) == Some(&mac)
        {
            self.by_ip.remove(&old);
        }
        self.by_ip.insert(ip, mac);
    }

    /// The MAC that last asked for `ip`, while its request is a witness.
    pub fn mac_at(&self, ip: Ipv4Addr, now_ms: i64) -> Option<HwAddr> {
        let mac = self.by_ip.get(&ip)?;
        (self.get(mac, now_ms) == Some(ip)).then_some(*mac)
    }

    pub fn get(&self, mac: &HwAddr, now_ms: i64) -> Option<Ipv4Addr> {
        let (ip, at) = self.by_mac.get(mac)?;
        (now_ms - at < REQUEST_HOLD_MS).then_some(*ip)
    }

    fn drop_oldest_half(&mut self) {
        let mut times: Vec<i64> = self.by_mac.values().map(|(_, at)| *at).collect();
        let mid = times.len() / 2;
        let (_, cut, _) = times.select_nth_unstable(mid);
        let cut = *cut;
        self.by_mac.retain(|_, (_, at)| *at > cut);
        let by_mac = &self.by_mac;
        self.by_ip
            .retain(|ip, mac| by_mac.get(mac).is_some_and(|(held, _)| held == ip));
    }

    pub fn len(&self) -> usize {
        self.by_mac.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_mac.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_a_witness_until_it_is_an_hour_old() {
        let mut r = Requested::default();
        let mac = [2, 0, 0, 0, 0, 1];
        r.record(mac, Ipv4Addr::new(10, 0, 0, 5), 1_000);
        assert_eq!(r.get(&mac, 2_000), Some(Ipv4Addr::new(10, 0, 0, 5)));
        assert_eq!(r.get(&mac, 1_000 + REQUEST_HOLD_MS), None);
        r.record(mac, Ipv4Addr::UNSPECIFIED, 3_000);
        assert_eq!(r.get(&mac, 3_000), Some(Ipv4Addr::new(10, 0, 0, 5)));
        assert_eq!(r.mac_at(Ipv4Addr::new(10, 0, 0, 5), 3_000), Some(mac));
        // Asked for another address since: the old one is no longer this MAC's.
        r.record(mac, Ipv4Addr::new(10, 0, 0, 9), 4_000);
        assert_eq!(r.mac_at(Ipv4Addr::new(10, 0, 0, 5), 4_000), None);
        assert_eq!(r.mac_at(Ipv4Addr::new(10, 0, 0, 9), 4_000), Some(mac));
    }

    #[test]
    fn a_flood_of_macs_stays_bounded() {
        let mut r = Requested::default();
        for i in 0..(MAX_REQUESTS as u32 + 10) {
            let b = i.to_be_bytes();
            r.record(
                [2, 0, b[0], b[1], b[2], b[3]],
                Ipv4Addr::new(10, 0, 0, 1),
                i64::from(i),
            );
        }
        assert!(r.len() <= MAX_REQUESTS, "{}", r.len());
        let newest = (MAX_REQUESTS as u32 + 9).to_be_bytes();
        assert!(
            r.get(&[2, 0, newest[0], newest[1], newest[2], newest[3]], 0)
                .is_some()
        );
    }
}
