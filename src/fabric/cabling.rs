//! A node's InfiniBand ports, as its agent reported them at validation (each adapter's
//! node GUID, and what each cable reaches), against the declared topology. Only adapters
//! the topology declares are checked; for those, every declared port must be reported
//! and reach the declared node and port. A peer the agent could not read fails: an
//! unread cable is never taken for a right one.

use crate::api::agent::{Failure, IbPortSample};

use super::topology::{End, Topology};

const CHECK: &str = "ib-cabling";

use crate::api::agent::ib_guid as guid;

fn named(end: &End) -> String {
    if end.description.is_empty() {
        format!("{:#018x} port {}", end.guid, end.port)
    } else {
        format!(
            "\"{}\" ({:#018x}) port {}",
            end.description, end.guid, end.port
        )
    }
}

fn fail(reason: String) -> Failure {
    Failure {
        check: CHECK.into(),
        gpu: None,
        reason,
    }
}

/// Every cabling fault in `ports`, named by port.
pub fn check(ports: &[IbPortSample], topology: &Topology) -> Vec<Failure> {
    let mut failures = Vec::new();
    let mut adapters = std::collections::BTreeMap::new();
    for p in ports {
        let Some(adapter) = p.node_guid.as_deref().and_then(guid) else {
            continue;
        };
        let number = p
            .port
            .rsplit('/')
            .next()
            .and_then(|n| n.parse::<u32>().ok());
        adapters
            .entry(adapter)
            .or_insert_with(std::collections::BTreeSet::new)
            .extend(number);
        let Some(want) = number.and_then(|n| topology.link(adapter, n)) else {
            continue;
        };
        match &p.peer {
            None => failures.push(fail(format!(
                "InfiniBand port {}: what its cable reaches could not be read (bootfleet-agent --ib-peers, infiniband-diags); the topology has it at {}",
                p.port,
                named(want)
            ))),
            Some(peer) if guid(&peer.guid) == Some(want.guid) && peer.port == want.port => {}
            Some(peer) => {
                let found = End {
                    guid: guid(&peer.guid).unwrap_or_default(),
                    port: peer.port,
                    description: peer.description.clone().unwrap_or_default(),
                };
                failures.push(fail(format!(
                    "InfiniBand port {} reaches {}, the topology has it at {} (a swapped or moved cable)",
                    p.port,
                    named(&found),
                    named(want)
                )));
            }
        }
    }
    for (adapter, reported) in &adapters {
        for port in topology.ports(*adapter).difference(reported) {
            let want = topology.link(*adapter, *port).expect("a declared port");
            failures.push(fail(format!(
                "InfiniBand port {port} of adapter {adapter:#018x} is cabled to {} in the topology but was not reported",
                named(want)
            )));
        }
    }
    failures
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::agent::IbPeer;

    const DECLARED: &str = "Ca 2 \"H-0000000000100000\" # \"node1\"\n\
        [1](100001) \"S-0000000000200000\"[1] # lid 0 lmc 0 \"leaf1\" lid 0 4xNDR\n\
        [2](100002) \"S-0000000000200000\"[2] # lid 0 lmc 0 \"leaf1\" lid 0 4xNDR\n";

    fn port(n: u32, peer: Option<(u64, u32)>) -> IbPortSample {
        IbPortSample {
            port: format!("mlx5_0/{n}"),
            state: Some("ACTIVE".into()),
            node_guid: Some("0x0000000000100000".into()),
            peer: peer.map(|(g, p)| IbPeer {
                guid: format!("{g:#018x}"),
                port: p,
                description: Some("leaf1".into()),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn cabled_as_declared_passes_and_a_swap_is_named() {
        let t = super::super::topology::parse(DECLARED).unwrap();
        let right = [port(1, Some((0x200000, 1))), port(2, Some((0x200000, 2)))];
        assert!(check(&right, &t).is_empty());
        let swapped = [port(1, Some((0x200000, 2))), port(2, Some((0x200000, 1)))];
        let f = check(&swapped, &t);
        assert_eq!(f.len(), 2, "{f:?}");
        assert!(
            f[0].reason.starts_with("InfiniBand port mlx5_0/1 reaches \"leaf1\" (0x0000000000200000) port 2, the topology has it at \"leaf1\" (0x0000000000200000) port 1"),
            "{}",
            f[0].reason
        );
    }

    #[test]
    fn an_unread_peer_or_a_missing_port_fails_and_strangers_are_not_judged() {
        let t = super::super::topology::parse(DECLARED).unwrap();
        let f = check(&[port(1, None)], &t);
        assert_eq!(f.len(), 2, "{f:?}");
        assert!(f[0].reason.contains("could not be read"), "{f:?}");
        assert!(
            f[1].reason
                .starts_with("InfiniBand port 2 of adapter 0x0000000000100000"),
            "{f:?}"
        );
        let mut stranger = port(1, Some((0x999, 9)));
        stranger.node_guid = Some("0x0000000000777777".into());
        assert!(
            check(&[stranger], &t).is_empty(),
            "not in the topology: not judged"
        );
    }
}
