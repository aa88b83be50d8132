//! `ibnetdiscover`'s text, read for what the cabling plan needs: each host channel
//! adapter's ports and, for each, the node and port at the other end. Switch records are
//! the same cables seen from the other side, so only `Ca` records are read. A hand-written
//! file needs only those, for example:
//!
//! ```text
//! Ca 1 "H-506b4b03005c2a18"   # "node01 mlx5_0"
//! [1](506b4b03005c2a19)  "S-7cfe900300a0b1c0"[17]   # lid 5 lmc 0 "leaf-07" lid 1 4xNDR
//! ```

use std::collections::{BTreeMap, BTreeSet};

/// The far end of one declared cable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct End {
    pub guid: u64,
    pub port: u32,
    /// Its node description, as the declaration names it (a switch's name).
    pub description: String,
}

/// Every adapter port's declared cable, by the adapter's node GUID and its port number.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    links: BTreeMap<(u64, u32), End>,
}

impl Topology {
    /// Where `port` of the adapter `guid` should be cabled to.
    pub fn link(&self, guid: u64, port: u32) -> Option<&End> {
        self.links.get(&(guid, port))
    }

    /// The declared ports of the adapter `guid` (empty when it is not declared).
    pub fn ports(&self, guid: u64) -> BTreeSet<u32> {
        self.links
            .range((guid, 0)..=(guid, u32::MAX))
            .map(|((_, p), _)| *p)
            .collect()
    }

    pub fn len(&self) -> usize {
        self.links.len()
    }

    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
    }
}

/// A node id as ibnetdiscover writes it: `"H-<hex>"` (adapter), `"S-<hex>"` (switch),
/// `"R-<hex>"` (router); its GUID.
fn node_id(quoted: &str) -> Option<u64> {
    let id = quoted.trim_matches('"');
    let hex = id
        .get(2..)
        .filter(|_| matches!(&id[..2], "H-" | "S-" | "R-"))?;
    u64::from_str_radix(hex, 16).ok()
}

/// The first `"..."` in `s`, and what follows it.
fn quoted(s: &str) -> Option<(&str, &str)> {
    let start = s.find('"')?;
    let len = s[start + 1..].find('"')?;
    let end = start + 1 + len;
    Some((&s[start..=end], &s[end + 1..]))
}

/// `[N]` at the start of `s`: N, and what follows.
fn bracketed(s: &str) -> Option<(u32, &str)> {
    let inner = s.strip_prefix('[')?;
    let (n, rest) = inner.split_once(']')?;
    Some((n.trim().parse().ok()?, rest))
}

/// One port line of a `Ca` record: its port and the far end.
fn port_line(line: &str) -> Option<(u32, End)> {
    let (port, rest) = bracketed(line)?;
    let (remote, rest) = quoted(rest)?;
    let (remote_port, rest) = bracketed(rest.trim_start())?;
    let description = rest
        .split_once('#')
        .and_then(|(_, comment)| quoted(comment))
        .map(|(q, _)| q.trim_matches('"').to_string())
        .unwrap_or_default();
    Some((
        port,
        End {
            guid: node_id(remote)?,
            port: remote_port,
            description,
        },
    ))
}

/// Reads `text`; an adapter record that does not read is an error with its line.
pub fn parse(text: &str) -> Result<Topology, String> {
    let mut topology = Topology::default();
    // The adapter whose record is being read; None inside switch and router records.
    let mut adapter: Option<u64> = None;
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let bad = |what: &str| format!("line {}: {what}: {line:?}", n + 1);
        let word = line.split_whitespace().next().unwrap_or_default();
        match word {
            "Ca" => {
                let (id, _) = quoted(line).ok_or_else(|| bad("an adapter with no id"))?;
                adapter = Some(node_id(id).ok_or_else(|| bad("not an adapter id (H-<hex>)"))?);
            }
            "Switch" | "Rt" => adapter = None,
            _ if line.starts_with('[') => {
                let Some(guid) = adapter else { continue };
                let (port, end) = port_line(line).ok_or_else(|| bad("not a port line"))?;
                if topology.links.insert((guid, port), end).is_some() {
                    return Err(bad("a port declared twice"));
                }
            }
            _ => {}
        }
    }
    if topology.is_empty() {
        return Err("no adapter port is cabled in it (no Ca record with a port line)".into());
    }
    Ok(topology)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As infiniband-diags 44 printed it for ibsim's net.2sw2path4hca2port (trimmed).
    const DISCOVERED: &str = r#"
#
# Topology file: generated on Sun Dec  6 15:20:01 2026
#
vendid=0x0
devid=0x0
sysimgguid=0x200001
switchguid=0x200001(200001)
Switch	8 "S-0000000000200001"		# "Switch2" base port 0 lid 0 lmc 0
[1]	"H-0000000000100003"[1](100004) 		# "Hca2" lid 0 4xSDR
[3]	"S-0000000000200000"[3]		# "Switch1" lid 0 4xSDR

vendid=0x0
devid=0x0
sysimgguid=0x100003
caguid=0x100003
Ca	2 "H-0000000000100003"		# "Hca2"
[1](100004) 	"S-0000000000200001"[1]		# lid 0 lmc 0 "Switch2" lid 0 4xSDR
[2](100005) 	"S-0000000000200001"[2]		# lid 0 lmc 0 "Switch2" lid 0 4xSDR
"#;

    #[test]
    fn adapter_ports_and_their_far_ends_are_read() {
        let t = parse(DISCOVERED).unwrap();
        assert_eq!(t.len(), 2, "switch records are not read: {t:?}");
        let end = t.link(0x100003, 2).unwrap();
        assert_eq!((end.guid, end.port), (0x200001, 2));
        assert_eq!(end.description, "Switch2");
        assert_eq!(t.ports(0x100003), BTreeSet::from([1, 2]));
        assert!(t.ports(0x200001).is_empty());
    }

    #[test]
    fn a_record_that_does_not_read_is_refused_with_its_line() {
        let e = parse("Ca 1 \"H-00aa\"\n[x] \"S-01\"[1]\n").unwrap_err();
        assert!(e.starts_with("line 2: not a port line"), "{e}");
        let e = parse("Ca 1 \"node\"\n").unwrap_err();
        assert!(e.contains("not an adapter id"), "{e}");
        let e = parse("Ca 1 \"H-01\"\n[1] \"S-02\"[1]\n[1] \"S-02\"[2]\n").unwrap_err();
        assert!(e.contains("declared twice"), "{e}");
        assert!(
            parse("Switch 8 \"S-02\"\n[1] \"H-01\"[1]\n").is_err(),
            "nothing to check"
        );
    }
}
