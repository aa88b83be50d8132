//! The address pool and its leases, in memory and pure (time is an argument). The server
//! persists what changed in batches (`take_changes`), never one write per packet.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::Ipv4Addr;

pub type HwAddr = [u8; 6];

/// An offer is held this long for the client's REQUEST.
pub const OFFER_HOLD_MS: i64 = 60_000;
/// A declined address (in use by someone else) is left alone this long.
pub const DECLINE_HOLD_MS: i64 = 10 * 60_000;

#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    pub start: Ipv4Addr,
    pub end: Ipv4Addr,
    /// MAC -> fixed address (inside or outside the pool; never handed to another).
    #[serde(default)]
    pub reservations: BTreeMap<String, Ipv4Addr>,
    /// [default: 3600]
    #[serde(default = "default_lease_secs")]
    pub lease_secs: u32,
}

fn default_lease_secs() -> u32 {
    3600
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub mac: HwAddr,
    pub ip: Ipv4Addr,
    pub expires_ms: i64,
    /// Acknowledged (false: only offered).
    pub bound: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The address is not ours to give this client (NAK).
    NotYours,
    /// The address is in another server's slice of the pool: that server answers, this
    /// one stays silent (a NAK would undo the other's ACK).
    Partners,
}

/// Which part of every pool a server gives out when several authoritative servers share
/// a segment (`[dhcp] slices`): part `index` (from 0) of `of` contiguous parts. Disjoint
/// parts are what keep two servers from giving one address to two clients without a
/// store write per packet (ISC's and Kea's failover split pools the same way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slice {
    pub index: u32,
    pub of: u32,
}

/// The addresses of `slice` of the pool `start..=end` (as u32s).
pub fn slice_range(start: u32, end: u32, slice: Slice) -> Result<(u32, u32), String> {
    let size = u64::from(end - start) + 1;
    let (index, of) = (u64::from(slice.index), u64::from(slice.of));
    if of == 0 || index >= of {
        return Err(format!("slice {index} of {of} does not exist"));
    }
    if size < of {
        return Err(format!(
            "a pool of {size} addresses cannot be cut into {of} slices"
        ));
    }
    let at = |k: u64| start + u32::try_from(size * k / of).expect("within the pool");
    Ok((at(index), at(index + 1) - 1))
}

pub struct Leases {
    /// What this server gives out: the pool, or its slice of it.
    start: u32,
    end: u32,
    /// The whole pool (other servers' slices included).
    whole: (u32, u32),
    lease_ms: i64,
    reserved_for: HashMap<HwAddr, Ipv4Addr>,
    reserved_ips: HashSet<Ipv4Addr>,
    by_mac: HashMap<HwAddr, Lease>,
    by_ip: HashMap<Ipv4Addr, HwAddr>,
    declined: HashMap<Ipv4Addr, i64>,
    /// Where the next free-address search starts.
    cursor: u32,
    changed: HashSet<HwAddr>,
    /// Leases that ended since the last save, by MAC: their rows are deleted only while
    /// they still name that address (another server may have bound the client since).
    ended: HashMap<HwAddr, Lease>,
}

/// A MAC in config form (aa:bb:cc:dd:ee:ff or with hyphens).
pub fn parse_hw(s: &str) -> Option<HwAddr> {
    let mac: crate::api::Mac = s.parse().ok()?;
    Some(mac.octets())
}

impl Leases {
    pub fn new(cfg: &PoolConfig) -> Result<Self, String> {
        let (start, end) = (u32::from(cfg.start), u32::from(cfg.end));
        if start > end {
            return Err(format!(
                "pool start {} is after its end {}",
                cfg.start, cfg.end
            ));
        }
        let mut reserved_for = HashMap::new();
        for (mac, ip) in &cfg.reservations {
            let hw = parse_hw(mac).ok_or_else(|| format!("reservation {mac:?} is not a MAC"))?;
            reserved_for.insert(hw, *ip);
        }
        let reserved_ips: HashSet<Ipv4Addr> = reserved_for.values().copied().collect();
        if reserved_ips.len() != reserved_for.len() {
            return Err("two reservations share an address".into());
        }
        Ok(Self {
            start,
            end,
            whole: (start, end),
            lease_ms: i64::from(cfg.lease_secs.max(60)) * 1000,
            reserved_for,
            reserved_ips,
            by_mac: HashMap::new(),
            by_ip: HashMap::new(),
            declined: HashMap::new(),
            cursor: start,
            changed: HashSet::new(),
            ended: HashMap::new(),
        })
    }

    /// The pool of which this server gives out only `slice`.
    pub fn sliced(cfg: &PoolConfig, slice: Slice) -> Result<Self, String> {
        let mut leases = Self::new(cfg)?;
        let (start, end) = slice_range(leases.start, leases.end, slice)?;
        leases.start = start;
        leases.end = end;
        leases.cursor = start;
        Ok(leases)
    }

    /// The addresses this server gives out.
    pub fn range(&self) -> (Ipv4Addr, Ipv4Addr) {
        (Ipv4Addr::from(self.start), Ipv4Addr::from(self.end))
    }

    pub fn lease_secs(&self) -> u32 {
        (self.lease_ms / 1000) as u32
    }

    /// Restores persisted leases (at start): those of this pool (its range or its
    /// reservations); the store holds every pool's.
    pub fn load(&mut self, leases: impl IntoIterator<Item = Lease>) {
        for l in leases {
            let ip = u32::from(l.ip);
            if !(self.start..=self.end).contains(&ip) && !self.reserved_ips.contains(&l.ip) {
                continue;
            }
            self.by_ip.insert(l.ip, l.mac);
            self.by_mac.insert(l.mac, l);
        }
    }

    pub fn lease(&self, mac: &HwAddr) -> Option<&Lease> {
        self.by_mac.get(mac)
    }

    /// The lease (offered or bound) of whoever holds `ip`.
    pub fn holder(&self, ip: Ipv4Addr) -> Option<&Lease> {
        self.by_mac.get(self.by_ip.get(&ip)?)
    }

    fn in_pool(&self, ip: Ipv4Addr) -> bool {
        (self.start..=self.end).contains(&u32::from(ip))
    }

    /// Whether `ip` may go to `mac` now.
    fn available(&self, ip: Ipv4Addr, mac: &HwAddr, now: i64) -> bool {
        if let Some(reserved) = self.reserved_for.get(mac) {
            return *reserved == ip;
        }
        if !self.in_pool(ip) || self.reserved_ips.contains(&ip) {
            return false;
        }
        if self.declined.get(&ip).is_some_and(|until| *until > now) {
            return false;
        }
        match self.by_ip.get(&ip) {
            None => true,
            Some(holder) if holder == mac => true,
            Some(holder) => self.by_mac.get(holder).is_none_or(|l| l.expires_ms <= now),
        }
    }

    fn put(&mut self, lease: Lease) {
        if let Some(old) = self.by_mac.insert(lease.mac, lease)
            && old.ip != lease.ip
            && self.by_ip.get(&old.ip) == Some(&lease.mac)
        {
            self.by_ip.remove(&old.ip);
        }
        if let Some(prev) = self.by_ip.insert(lease.ip, lease.mac)
            && prev != lease.mac
        {
            // An expired lease of another client: its address is reused.
            if let Some(old) = self.by_mac.remove(&prev) {
                self.ended.insert(prev, old);
            }
            self.changed.insert(prev);
        }
        self.ended.remove(&lease.mac);
        self.changed.insert(lease.mac);
    }

    /// The address to offer `mac`, holding it for the REQUEST; None if the pool is full.
    pub fn offer(
        &mut self,
        mac: &HwAddr,
        requested: Option<Ipv4Addr>,
        now: i64,
    ) -> Option<Ipv4Addr> {
        let current = self.by_mac.get(mac).copied();
        let ip = if let Some(ip) = self.reserved_for.get(mac) {
            *ip
        } else if let Some(l) = current.filter(|l| self.available(l.ip, mac, now)) {
            l.ip
        } else if let Some(ip) = requested.filter(|ip| self.available(*ip, mac, now)) {
            ip
        } else {
            self.next_free(mac, now)?
        };
        let keep_bound = current.filter(|l| l.ip == ip && l.bound && l.expires_ms > now);
        self.put(match keep_bound {
            Some(l) => l,
            None => Lease {
                mac: *mac,
                ip,
                expires_ms: now + OFFER_HOLD_MS,
                bound: false,
            },
        });
        Some(ip)
    }

    fn next_free(&mut self, mac: &HwAddr, now: i64) -> Option<Ipv4Addr> {
        let size = self.end - self.start + 1;
        for i in 0..size {
            let n = self.start + (self.cursor - self.start + i) % size;
            let ip = Ipv4Addr::from(n);
            if self.available(ip, mac, now) {
                self.cursor = if n == self.end { self.start } else { n + 1 };
                return Some(ip);
            }
        }
        None
    }

    /// Binds `ip` to `mac` (a REQUEST: selecting, init-reboot, renewing, rebinding).
    pub fn bind(&mut self, mac: &HwAddr, ip: Ipv4Addr, now: i64) -> Result<Lease, Refused> {
        if !self.available(ip, mac, now) {
            let partners = (self.whole.0..=self.whole.1).contains(&u32::from(ip))
                && !self.in_pool(ip)
                && !self.reserved_for.contains_key(mac);
            return Err(if partners {
                Refused::Partners
            } else {
                Refused::NotYours
            });
        }
        let lease = Lease {
            mac: *mac,
            ip,
            expires_ms: now + self.lease_ms,
            bound: true,
        };
        self.put(lease);
        Ok(lease)
    }

    /// Forgets `mac`'s lease if it holds `ip` (RELEASE, or an offer another server won).
    pub fn release(&mut self, mac: &HwAddr, ip: Option<Ipv4Addr>) {
        if let Some(l) = self.by_mac.get(mac).copied()
            && ip.is_none_or(|ip| ip == l.ip)
        {
            self.by_mac.remove(mac);
            if self.by_ip.get(&l.ip) == Some(mac) {
                self.by_ip.remove(&l.ip);
            }
            self.ended.insert(*mac, l);
            self.changed.insert(*mac);
        }
    }

    /// The client found `ip` in use: leave it alone for a while.
    pub fn decline(&mut self, mac: &HwAddr, ip: Ipv4Addr, now: i64) {
        self.release(mac, Some(ip));
        self.declined.insert(ip, now + DECLINE_HOLD_MS);
    }

    /// Marks a batch changed again (its save failed; the next batch retries it).
    pub fn requeue(&mut self, keep: &[Lease], gone: &[Lease]) {
        self.changed.extend(keep.iter().map(|l| l.mac));
        for l in gone {
            if !self.by_mac.contains_key(&l.mac) {
                self.ended.entry(l.mac).or_insert(*l);
                self.changed.insert(l.mac);
            }
        }
    }

    /// Leases changed since the last call: (to store, ended: to delete where they still
    /// name their address).
    pub fn take_changes(&mut self) -> (Vec<Lease>, Vec<Lease>) {
        let mut keep = Vec::new();
        let mut gone = Vec::new();
        for mac in self.changed.drain() {
            match self.by_mac.get(&mac) {
                Some(l) if l.bound => keep.push(*l),
                Some(_) => {} // offers are not persisted
                None => gone.extend(self.ended.remove(&mac)),
            }
        }
        self.ended.clear();
        (keep, gone)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn slices_cut_a_pool_into_disjoint_parts_that_cover_it() {
        let (start, end) = (100, 250);
        let mut next = start;
        for index in 0..3 {
            let (lo, hi) = slice_range(start, end, Slice { index, of: 3 }).unwrap();
            assert_eq!(lo, next, "contiguous, no gap, no overlap");
            next = hi + 1;
        }
        assert_eq!(next, end + 1, "the last slice ends the pool");
        assert!(slice_range(1, 2, Slice { index: 0, of: 3 }).is_err());
        assert!(slice_range(1, 9, Slice { index: 3, of: 3 }).is_err());
    }

    #[test]
    fn a_slice_offers_its_own_and_leaves_its_partners_addresses_unanswered() {
        let cfg = PoolConfig {
            start: Ipv4Addr::new(10, 0, 0, 10),
            end: Ipv4Addr::new(10, 0, 0, 19),
            reservations: Default::default(),
            lease_secs: 600,
        };
        let mut second = Leases::sliced(&cfg, Slice { index: 1, of: 2 }).unwrap();
        assert_eq!(
            second.range(),
            (Ipv4Addr::new(10, 0, 0, 15), Ipv4Addr::new(10, 0, 0, 19))
        );
        let mac = [2, 0, 0, 0, 0, 1];
        assert_eq!(
            second.offer(&mac, Some(Ipv4Addr::new(10, 0, 0, 11)), 0),
            Some(Ipv4Addr::new(10, 0, 0, 15)),
            "a requested address in the other slice is not offered"
        );
        assert_eq!(
            second.bind(&mac, Ipv4Addr::new(10, 0, 0, 12), 0),
            Err(Refused::Partners)
        );
        assert_eq!(
            second.bind(&mac, Ipv4Addr::new(10, 0, 1, 12), 0),
            Err(Refused::NotYours)
        );
        // Saved leases of the other slice are not this server's to keep.
        second.load([Lease {
            mac: [2, 0, 0, 0, 0, 2],
            ip: Ipv4Addr::new(10, 0, 0, 10),
            expires_ms: 1_000_000,
            bound: true,
        }]);
        assert!(second.holder(Ipv4Addr::new(10, 0, 0, 10)).is_none());
    }

    use super::*;

    fn pool(reservations: &[(&str, &str)]) -> Leases {
        Leases::new(&PoolConfig {
            start: "10.0.0.10".parse().unwrap(),
            end: "10.0.0.12".parse().unwrap(),
            reservations: reservations
                .iter()
                .map(|(m, ip)| (m.to_string(), ip.parse().unwrap()))
                .collect(),
            lease_secs: 600,
        })
        .unwrap()
    }

    fn mac(n: u8) -> HwAddr {
        [0x52, 0x54, 0, 0, 0, n]
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn offers_bind_and_the_pool_runs_out() {
        let mut p = pool(&[]);
        assert_eq!(p.offer(&mac(1), None, 0), Some(ip("10.0.0.10")));
        assert_eq!(
            p.offer(&mac(1), None, 0),
            Some(ip("10.0.0.10")),
            "same client, same offer"
        );
        assert_eq!(
            p.offer(&mac(2), Some(ip("10.0.0.12")), 0),
            Some(ip("10.0.0.12")),
            "requested"
        );
        assert_eq!(p.offer(&mac(3), None, 0), Some(ip("10.0.0.11")));
        assert_eq!(p.offer(&mac(4), None, 0), None, "full");
        // An offer not taken expires and its address is reused.
        assert_eq!(
            p.offer(&mac(4), Some(ip("10.0.0.10")), OFFER_HOLD_MS + 1),
            Some(ip("10.0.0.10"))
        );
        assert!(
            p.bind(&mac(1), ip("10.0.0.10"), OFFER_HOLD_MS + 1).is_err(),
            "taken meanwhile"
        );
        let l = p.bind(&mac(4), ip("10.0.0.10"), OFFER_HOLD_MS + 2).unwrap();
        assert_eq!(l.expires_ms, OFFER_HOLD_MS + 2 + 600_000);
    }

    #[test]
    fn reservations_release_decline_and_changes() {
        let mut p = pool(&[("52:54:00:00:00:09", "10.0.0.99")]);
        assert_eq!(p.offer(&mac(9), None, 0), Some(ip("10.0.0.99")));
        assert!(
            p.bind(&mac(9), ip("10.0.0.10"), 0).is_err(),
            "reserved clients get their address only"
        );
        assert!(p.bind(&mac(1), ip("10.0.0.99"), 0).is_err());
        assert!(
            p.bind(&mac(1), ip("10.0.0.50"), 0).is_err(),
            "outside the pool"
        );
        p.bind(&mac(1), ip("10.0.0.11"), 0).unwrap();
        let (keep, gone) = p.take_changes();
        assert_eq!(
            (keep.len(), gone.len()),
            (1, 0),
            "offers are not persisted, binds are"
        );
        p.release(&mac(1), Some(ip("10.0.0.11")));
        let (keep, gone) = p.take_changes();
        assert!(keep.is_empty());
        assert_eq!(
            gone.iter().map(|l| (l.mac, l.ip)).collect::<Vec<_>>(),
            vec![(mac(1), ip("10.0.0.11"))],
            "the ended lease, with the address its row must still name"
        );
        p.decline(&mac(2), ip("10.0.0.10"), 0);
        assert_eq!(
            p.offer(&mac(2), Some(ip("10.0.0.10")), 1),
            Some(ip("10.0.0.11"))
        );
        assert!(
            Leases::new(&PoolConfig {
                start: ip("10.0.0.9"),
                end: ip("10.0.0.1"),
                reservations: Default::default(),
                lease_secs: 60
            })
            .is_err()
        );
    }
}
