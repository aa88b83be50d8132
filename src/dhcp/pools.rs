//! Address pools in authoritative mode: the server's own segment (`[dhcp.pool]`) and one
//! per boot segment behind a DHCP relay (`[[dhcp.subnet]]`), chosen by the relay address
//! a relayed request carries (giaddr, RFC 2131 4.3.1), so one server can serve many
//! racks' segments. Pure: which pool a request belongs to.

use std::net::Ipv4Addr;
use std::sync::Mutex;

use super::decide::Settings;
use super::leases::{Leases, PoolConfig};

/// `[[dhcp.subnet]]`: a segment behind a relay.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubnetConfig {
    /// The segment, `10.40.0.0/24`: requests whose relay address (giaddr) is inside it
    /// get addresses from `pool`.
    pub relay: String,
    pub pool: PoolConfig,
    /// [default: the prefix of `relay`]
    pub subnet_mask: Option<Ipv4Addr>,
    /// [default: the relay address of the request]
    pub router: Option<Ipv4Addr>,
    #[serde(default)]
    pub dns: Vec<Ipv4Addr>,
}

/// An IPv4 network, `address/prefix`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Net {
    base: u32,
    prefix: u8,
}

impl Net {
    pub fn parse(s: &str) -> Result<Self, String> {
        let (addr, prefix) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not ADDRESS/PREFIX"))?;
        let addr: Ipv4Addr = addr.parse().map_err(|e| format!("{s:?}: {e}"))?;
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= 32)
            .ok_or_else(|| format!("{s:?}: the prefix must be 0-32"))?;
        let net = Self {
            base: u32::from(addr) & Self::mask_bits(prefix),
            prefix,
        };
        if net.base != u32::from(addr) {
            return Err(format!("{s:?} has host bits set; the network is {net}"));
        }
        Ok(net)
    }

    fn mask_bits(prefix: u8) -> u32 {
        u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0)
    }

    pub fn mask(&self) -> Ipv4Addr {
        Ipv4Addr::from(Self::mask_bits(self.prefix))
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & Self::mask_bits(self.prefix) == self.base
    }
}

impl std::fmt::Display for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", Ipv4Addr::from(self.base), self.prefix)
    }
}

/// One pool with the answers that go with it.
pub struct Pool {
    /// None: the server's own segment (requests that were not relayed).
    pub relay: Option<Net>,
    /// The server's settings with this segment's mask, router and DNS.
    pub settings: Settings,
    /// Whether `router` defaults to the request's relay address.
    pub router_is_relay: bool,
    pub leases: Mutex<Leases>,
    /// What `leases` was made from, to cut it again when the server's slice changes.
    pub config: PoolConfig,
}

impl Pool {
    /// The pool for a relayed segment; `base` is the server's own settings.
    pub fn relayed(cfg: &SubnetConfig, base: &Settings) -> Result<Self, String> {
        let net = Net::parse(&cfg.relay).map_err(|e| format!("[[dhcp.subnet]] relay {e}"))?;
        for end in [cfg.pool.start, cfg.pool.end] {
            if !net.contains(end) {
                return Err(format!(
                    "[[dhcp.subnet]] {net}: pool address {end} is outside the segment"
                ));
            }
        }
        let leases = Leases::new(&cfg.pool).map_err(|e| format!("[[dhcp.subnet]] {net}: {e}"))?;
        Ok(Self {
            relay: Some(net),
            settings: Settings {
                subnet_mask: cfg.subnet_mask.unwrap_or(net.mask()),
                router: cfg.router,
                dns: if cfg.dns.is_empty() {
                    base.dns.clone()
                } else {
                    cfg.dns.clone()
                },
                ..base.clone()
            },
            router_is_relay: cfg.router.is_none(),
            leases: Mutex::new(leases),
            config: cfg.pool.clone(),
        })
    }

    /// The server's own segment's pool.
    pub fn local(config: &PoolConfig, settings: Settings) -> Result<Self, String> {
        Ok(Self {
            relay: None,
            settings,
            router_is_relay: false,
            leases: Mutex::new(Leases::new(config).map_err(|e| format!("[dhcp.pool] {e}"))?),
            config: config.clone(),
        })
    }
}

/// Refuses pools whose ranges overlap, or relayed segments that overlap: both would
/// load the same saved lease and could give one address to two clients.
pub fn check_disjoint(local: Option<&PoolConfig>, subnets: &[SubnetConfig]) -> Result<(), String> {
    let mut ranges: Vec<(u32, u32, String)> = Vec::new();
    if let Some(p) = local {
        ranges.push((p.start.into(), p.end.into(), "[dhcp.pool]".into()));
    }
    for s in subnets {
        let name = format!("[[dhcp.subnet]] {}", s.relay);
        ranges.push((s.pool.start.into(), s.pool.end.into(), name));
    }
    for (i, a) in ranges.iter().enumerate() {
        for b in &ranges[i + 1..] {
            if a.0 <= b.1 && b.0 <= a.1 {
                return Err(format!("the pools of {} and {} overlap", a.2, b.2));
            }
        }
    }
    let nets: Vec<Net> = subnets
        .iter()
        .map(|s| Net::parse(&s.relay))
        .collect::<Result<_, _>>()?;
    for (i, a) in nets.iter().enumerate() {
        for b in &nets[i + 1..] {
            if a.contains(Ipv4Addr::from(b.base)) || b.contains(Ipv4Addr::from(a.base)) {
                return Err(format!("[[dhcp.subnet]] segments {a} and {b} overlap"));
            }
        }
    }
    Ok(())
}

/// The pool a request belongs to: the relayed segment its relay address is in; else the
/// local pool, when the request was not relayed, or was relayed from inside our own
/// segment (perfdhcp does), or no relayed segment is configured at all. None: no pool
/// serves that segment (the request is ignored).
pub fn choose(pools: &[Pool], giaddr: Ipv4Addr) -> Option<&Pool> {
    let local = pools.iter().find(|p| p.relay.is_none());
    if giaddr.is_unspecified() {
        return local;
    }
    if let Some(p) = pools
        .iter()
        .find(|p| p.relay.is_some_and(|n| n.contains(giaddr)))
    {
        return Some(p);
    }
    let any_relayed = pools.iter().any(|p| p.relay.is_some());
    local.filter(|p| !any_relayed || local_net(&p.settings).contains(giaddr))
}

/// Our own segment: the server's address under its subnet mask.
fn local_net(s: &Settings) -> Net {
    let mask = u32::from(s.subnet_mask);
    Net {
        base: u32::from(s.server_ip) & mask,
        prefix: mask.leading_ones() as u8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn networks_parse_contain_and_refuse_host_bits() {
        let n = Net::parse("10.40.0.0/24").unwrap();
        assert!(n.contains("10.40.0.1".parse().unwrap()));
        assert!(!n.contains("10.41.0.1".parse().unwrap()));
        assert_eq!(n.mask(), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(
            Net::parse("0.0.0.0/0").unwrap().mask(),
            Ipv4Addr::UNSPECIFIED
        );
        assert!(
            Net::parse("10.40.0.1/24")
                .unwrap_err()
                .contains("host bits")
        );
        assert!(Net::parse("10.40.0.0/33").is_err());
        assert!(Net::parse("10.40.0.0").is_err());
    }

    fn subnet(relay: &str, start: &str, end: &str) -> SubnetConfig {
        SubnetConfig {
            relay: relay.into(),
            pool: PoolConfig {
                start: start.parse().unwrap(),
                end: end.parse().unwrap(),
                reservations: Default::default(),
                lease_secs: 600,
            },
            subnet_mask: None,
            router: None,
            dns: vec![],
        }
    }

    #[test]
    fn overlapping_pools_and_segments_are_refused() {
        let a = subnet("10.40.0.0/24", "10.40.0.100", "10.40.0.150");
        let b = subnet("10.41.0.0/24", "10.41.0.100", "10.41.0.150");
        assert_eq!(check_disjoint(None, &[a.clone(), b.clone()]), Ok(()));
        let wide = subnet("10.40.0.0/16", "10.40.1.100", "10.40.1.150");
        assert!(
            check_disjoint(None, &[a.clone(), wide])
                .unwrap_err()
                .contains("segments")
        );
        let local = a.pool.clone();
        assert!(
            check_disjoint(Some(&local), &[a])
                .unwrap_err()
                .contains("pools")
        );
    }
}
