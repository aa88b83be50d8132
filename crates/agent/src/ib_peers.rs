//! The far end of each InfiniBand port's cable, asked of the fabric itself: a
//! directed-route SMP out of the port (`smpquery -C DEV -P PORT -D nodeinfo 0,PORT`, from
//! infiniband-diags) answers the neighbour's node GUID and the port the SMP came in by,
//! and `nodedesc` its name. One SMP pair per port, at validation only, and only with
//! `--ib-peers` (it needs root and infiniband-diags in the image). The server compares
//! what it finds with the topology the operator declared; a port whose peer cannot be
//! asked says so (`missing: ["peer"]`), never looking cabled right.

use std::time::Duration;

use bootfleet_api::agent::{IbPeer, IbPortSample};

/// How long one SMP query may take (a healthy fabric answers in milliseconds; an SMP
/// that times out is retried by umad a few times within this).
const QUERY_TIMEOUT: Duration = Duration::from_secs(10);

/// The value of `Key:....value` in smpquery's output.
fn field<'a>(out: &'a str, key: &str) -> Option<&'a str> {
    out.lines().find_map(|l| {
        let rest = l.trim().strip_prefix(key)?;
        Some(rest.trim_start_matches('.').trim()).filter(|v| !v.is_empty())
    })
}

/// A GUID in any spelling as the wire's: `0x` and 16 lower-case hex digits.
pub fn guid(text: &str) -> Option<String> {
    bootfleet_api::agent::ib_guid(text).map(|n| format!("0x{n:016x}"))
}

/// The peer in `nodeinfo`'s and `nodedesc`'s answers.
pub fn parse(nodeinfo: &str, nodedesc: Option<&str>) -> Option<IbPeer> {
    Some(IbPeer {
        guid: guid(field(nodeinfo, "Guid:")?)?,
        port: field(nodeinfo, "LocalPort:")?.parse().ok()?,
        description: nodedesc
            .and_then(|d| field(d, "Node Description:"))
            .map(str::to_string),
    })
}

/// Asks each port's peer; a port that cannot be asked names `peer` as missing.
pub async fn query(samples: &mut [IbPortSample]) {
    for s in samples.iter_mut() {
        let Some((device, port)) = s.port.split_once('/') else {
            s.missing.push("peer".into());
            continue;
        };
        let path = format!("0,{port}");
        let args = |what: &'static str| ["-C", device, "-P", port, "-D", what, path.as_str()];
        let info = match super::checks::run("smpquery", &args("nodeinfo"), QUERY_TIMEOUT).await {
            Ok(info) => info,
            Err(e) => {
                eprintln!(
                    "bootfleet-agent: the peer of InfiniBand port {}: {e}",
                    s.port
                );
                s.missing.push("peer".into());
                continue;
            }
        };
        // Its name is a courtesy: a peer without one is still the peer.
        let desc = super::checks::run("smpquery", &args("nodedesc"), QUERY_TIMEOUT).await;
        match parse(&info, desc.ok().as_deref()) {
            Some(peer) => s.peer = Some(peer),
            None => s.missing.push("peer".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smpquery_answers_parse() {
        // As infiniband-diags 44 prints them (captured from ibsim).
        let info = "# Node info: DR path slid 65535; dlid 65535; 0,1\nBaseVers:........................1\n\
                    NodeType:........................Switch\nNumPorts:........................8\n\
                    Guid:............................0x0000000000200001\n\
                    PortGuid:........................0x0000000000200001\nLocalPort:.......................3\n";
        let desc = "Node Description:.........................MF0;leaf-07:MQM9700/U1\n";
        let peer = parse(info, Some(desc)).unwrap();
        assert_eq!(peer.guid, "0x0000000000200001");
        assert_eq!(peer.port, 3);
        assert_eq!(peer.description.as_deref(), Some("MF0;leaf-07:MQM9700/U1"));
        assert!(
            parse("LocalPort:....1\n", None).is_none(),
            "no GUID, no peer"
        );
        // sysfs writes node_guid in groups of four.
        assert_eq!(
            guid("506b:4b03:005c:2a18").as_deref(),
            Some("0x506b4b03005c2a18")
        );
        assert_eq!(guid("zz"), None);
    }
}
