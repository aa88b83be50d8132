//! Who may start a new boot of a MAC. Boot requests carry no secret (firmware has none),
//! so a new boot is tied to what the server saw of the MAC on the wire: the request must
//! come from the address DHCP saw that MAC hold (authoritative mode) or ask for (proxy
//! mode), and one MAC starts at most `[boots] burst` boots at once and one more every
//! `every_secs` after. Without this, anyone on the boot network could knock any node's
//! attestation out with one unauthenticated GET. Pure apart from its memory of recent
//! boots; time is an argument.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;

use serde::Deserialize;

use crate::api::Mac;
use crate::dhcp::directory::{WireAddress, Witnessed};

/// `[boots]` in the settings file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BootsPolicy {
    /// A new boot must come from the address DHCP saw its MAC hold or ask for. Turn off
    /// only where boot requests reach the server through a proxy or NAT [default: true].
    pub bind_to_address: bool,
    /// New boots one MAC may start at once [default: 5].
    pub burst: u32,
    /// After the burst, one more new boot per this many seconds; sooner requests get 429
    /// and the entry script retries in 10 s [default: 10].
    pub every_secs: u64,
}

impl Default for BootsPolicy {
    fn default() -> Self {
        Self {
            bind_to_address: true,
            burst: 5,
            every_secs: 10,
        }
    }
}

/// Why a request may not start a boot now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The request came from another address than DHCP saw the MAC use.
    Elsewhere {
        mac: Mac,
        from: IpAddr,
        seen: WireAddress,
    },
    /// The MAC's allowance of new boots is spent.
    TooSoon { mac: Mac, retry_after_secs: u64 },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Elsewhere { mac, from, seen } => {
                let how = match seen.how {
                    Witnessed::Leased => "lease",
                    Witnessed::Requested => "ask for",
                };
                write!(
                    f,
                    "a boot of {mac} must come from {}, the address DHCP saw it {how}; this request came from {from}",
                    seen.ip
                )
            }
            Self::TooSoon {
                mac,
                retry_after_secs,
            } => write!(
                f,
                "{mac} started too many boots; the next may start in {retry_after_secs} s"
            ),
        }
    }
}

impl std::error::Error for Refusal {}

/// Entries kept before spent ones are dropped.
const MAX_TRACKED: usize = 100_000;

pub struct BootGuard {
    policy: BootsPolicy,
    /// Per MAC, when its allowance is next whole (GCRA's theoretical arrival time).
    next_free_ms: Mutex<HashMap<Mac, i64>>,
}

impl BootGuard {
    pub fn new(policy: BootsPolicy) -> Self {
        Self {
            policy,
            next_free_ms: Mutex::default(),
        }
    }

    /// Admits a new boot of `mac` requested from `from` (None: the caller is not on a
    /// socket, as in tests of the service), given what DHCP saw of the MAC; counts it
    /// against the MAC's allowance.
    pub fn admit(
        &self,
        mac: &Mac,
        from: Option<IpAddr>,
        seen: Option<WireAddress>,
        now_ms: i64,
    ) -> Result<(), Refusal> {
        if self.policy.bind_to_address
            && let (Some(from), Some(seen)) = (from, seen)
            && from.to_canonical() != IpAddr::V4(seen.ip)
        {
            return Err(Refusal::Elsewhere {
                mac: *mac,
                from: from.to_canonical(),
                seen,
            });
        }
        let every = i64::try_from(self.policy.every_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
        let tolerance = every.saturating_mul(i64::from(self.policy.burst.max(1)) - 1);
        let mut next = self.next_free_ms.lock().expect("not poisoned");
        let tat = next.get(mac).copied().unwrap_or(now_ms).max(now_ms);
        if tat - now_ms > tolerance {
            let wait_ms = tat - now_ms - tolerance;
            return Err(Refusal::TooSoon {
                mac: *mac,
                retry_after_secs: u64::try_from((wait_ms + 999) / 1000).unwrap_or(1).max(1),
            });
        }
        if next.len() >= MAX_TRACKED && !next.contains_key(mac) {
            // Spent entries are the same as absent ones.
            next.retain(|_, t| *t > now_ms);
            if next.len() >= MAX_TRACKED {
                next.clear();
            }
        }
        next.insert(*mac, tat.saturating_add(every));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: &str = "52:54:00:00:00:01";

    fn leased(ip: [u8; 4]) -> Option<WireAddress> {
        Some(WireAddress {
            ip: ip.into(),
            how: Witnessed::Leased,
        })
    }

    #[test]
    fn a_boot_must_come_from_the_address_dhcp_saw() {
        let guard = BootGuard::new(BootsPolicy::default());
        let mac: Mac = MAC.parse().unwrap();
        let lease = leased([10, 0, 0, 7]);
        let rogue = "10.0.0.66".parse().ok();
        let err = guard.admit(&mac, rogue, lease, 0).unwrap_err();
        assert!(matches!(err, Refusal::Elsewhere { .. }));
        assert!(err.to_string().contains("10.0.0.7"), "{err}");
        // The same address as an IPv4-mapped IPv6 peer (a listener on [::]).
        let mapped = "::ffff:10.0.0.7".parse().ok();
        guard.admit(&mac, mapped, lease, 0).unwrap();
        // Nothing seen on the wire (DHCP elsewhere): the address cannot be checked.
        guard.admit(&mac, rogue, None, 0).unwrap();
        // Off: where requests come through a proxy.
        let off = BootGuard::new(BootsPolicy {
            bind_to_address: false,
            ..Default::default()
        });
        off.admit(&mac, rogue, lease, 0).unwrap();
    }

    #[test]
    fn a_mac_starts_a_burst_of_boots_then_one_per_interval() {
        let guard = BootGuard::new(BootsPolicy {
            burst: 3,
            every_secs: 10,
            ..Default::default()
        });
        let mac: Mac = MAC.parse().unwrap();
        let other: Mac = "52:54:00:00:00:02".parse().unwrap();
        for _ in 0..3 {
            guard.admit(&mac, None, None, 1_000).unwrap();
        }
        let err = guard.admit(&mac, None, None, 1_000).unwrap_err();
        assert_eq!(
            err,
            Refusal::TooSoon {
                mac,
                retry_after_secs: 10
            }
        );
        // Another MAC has its own allowance.
        guard.admit(&other, None, None, 1_000).unwrap();
        // A refused request does not spend the allowance: 10 s later one more may start.
        guard.admit(&mac, None, None, 11_000).unwrap();
        assert!(guard.admit(&mac, None, None, 11_000).is_err());
        // After a quiet spell the whole burst is back.
        for _ in 0..3 {
            guard.admit(&mac, None, None, 100_000).unwrap();
        }
    }
}
