//! Forced iPXE chainloading, pure: whether an iPXE client gets our iPXE binary (over TFTP)
//! or its boot script. A NIC ROM that is itself iPXE (QEMU's, many vendors' builds) and the
//! binary we chainload send identical DHCP requests, so the answer depends on what this MAC
//! was last given, remembered per DHCP transaction (xid).

use std::collections::HashMap;

/// `[dhcp] chainload`: which iPXE clients are first handed our iPXE binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ChainPolicy {
    /// Only firmware that is not iPXE gets the binary; an iPXE ROM gets the script at once.
    #[default]
    NonIpxe,
    /// Every iPXE client gets our binary first (an old or feature-poor ROM iPXE is
    /// replaced by ours), then the script. Per node: label `ipxe=chainload`.
    Always,
}

/// What an iPXE client gets in this transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chain {
    /// Our iPXE binary for its firmware class.
    Binary,
    /// The HTTP boot script.
    Script,
}

#[derive(Debug, Clone, Copy)]
struct Last {
    xid: u32,
    gave: Chain,
    at_ms: i64,
}

/// Per MAC, what its last DHCP transaction was given. A retransmission or the REQUEST of
/// the same exchange (same xid) gets the same answer. A new transaction soon after the
/// binary was given is the chainloaded iPXE: it gets the script. Anything else (a new
/// power-on, or the binary given too long ago) starts over with the binary.
///
/// Why not the TFTP transfer's completion as the signal: it needs the client's address
/// mapped to its MAC, which proxy mode never learns, and a missed signal loops the node
/// forever. Here the worst case is a ROM that retries DHCP after a failed TFTP: it gets
/// the script and boots with its own iPXE.
#[derive(Debug, Default)]
pub struct ChainMemory {
    last: HashMap<[u8; 6], Last>,
}

/// How long after the binary was given a new transaction counts as the chainloaded iPXE.
/// Covers the TFTP transfer and iPXE's start (about 3 s) with a wide margin.
pub const CHAIN_WINDOW_MS: i64 = 120_000;

/// Entries past this age are dropped when the table is large.
const FORGET_AFTER_MS: i64 = 10 * CHAIN_WINDOW_MS;
const PRUNE_ABOVE: usize = 4096;

impl ChainMemory {
    /// The answer for `mac`'s transaction `xid` at `now_ms`, remembered.
    pub fn choose(&mut self, mac: [u8; 6], xid: u32, now_ms: i64) -> Chain {
        let gave = match self.last.get(&mac) {
            Some(l) if l.xid == xid && now_ms - l.at_ms < CHAIN_WINDOW_MS => l.gave,
            Some(l) if l.gave == Chain::Binary && now_ms - l.at_ms < CHAIN_WINDOW_MS => {
                Chain::Script
            }
            _ => Chain::Binary,
        };
        if self.last.len() >= PRUNE_ABOVE {
            self.last.retain(|_, l| now_ms - l.at_ms < FORGET_AFTER_MS);
        }
        self.last.insert(
            mac,
            Last {
                xid,
                gave,
                at_ms: now_ms,
            },
        );
        gave
    }

    pub fn len(&self) -> usize {
        self.last.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0, 9];

    #[test]
    fn rom_gets_the_binary_then_the_chainloaded_ipxe_gets_the_script() {
        let mut m = ChainMemory::default();
        // The ROM's DISCOVER, a retransmission, and its REQUEST: one transaction.
        assert_eq!(m.choose(MAC, 1, 0), Chain::Binary);
        assert_eq!(m.choose(MAC, 1, 1_000), Chain::Binary);
        assert_eq!(m.choose(MAC, 1, 1_100), Chain::Binary);
        // Our iPXE, a few seconds later: the script, for its DISCOVER and REQUEST.
        assert_eq!(m.choose(MAC, 2, 5_000), Chain::Script);
        assert_eq!(m.choose(MAC, 2, 5_100), Chain::Script);
        // The next power-on: the ROM again, so the binary again.
        assert_eq!(m.choose(MAC, 3, 60_000), Chain::Binary);
        assert_eq!(m.choose(MAC, 4, 64_000), Chain::Script);
    }

    #[test]
    fn a_binary_given_long_ago_does_not_count_and_macs_are_separate() {
        let mut m = ChainMemory::default();
        assert_eq!(m.choose(MAC, 1, 0), Chain::Binary);
        let other = [0x52, 0x54, 0, 0, 0, 10];
        assert_eq!(m.choose(other, 7, 1_000), Chain::Binary);
        // The chainload never came (machine powered off): start over.
        assert_eq!(m.choose(MAC, 2, CHAIN_WINDOW_MS + 1), Chain::Binary);
        assert_eq!(m.choose(other, 8, 2_000), Chain::Script);
    }

    #[test]
    fn the_table_is_pruned_of_old_entries() {
        let mut m = ChainMemory::default();
        for i in 0..PRUNE_ABOVE as u32 {
            let b = i.to_be_bytes();
            m.choose([2, 0, b[0], b[1], b[2], b[3]], i, 0);
        }
        m.choose(MAC, 1, FORGET_AFTER_MS + 1);
        assert_eq!(m.len(), 1);
    }
}
