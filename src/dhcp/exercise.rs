//! One datagram through the whole pure path, as fuzzers and property tests drive it:
//! check -> classify -> decide (both modes, both ports, with and without a forced
//! chainload) -> encode -> decode again. Shared by `fuzz/fuzz_targets/dhcp_packet.rs`
//! and `tests/it/dhcp_fuzz.rs`, so the fuzz target builds whenever the tests do.

use std::net::Ipv4Addr;

use dhcproto::{Decodable, Decoder, v4};

use super::classify::classify;
use super::decide::{BootFiles, Decision, Mode, NodeView, Port, Settings, decide};
use super::leases::Leases;
use super::reply::{encode, relay_info};
use super::wire::check;

/// The settings datagrams are judged with.
pub fn settings(mode: Mode) -> Settings {
    Settings {
        mode,
        server_ip: Ipv4Addr::new(10, 9, 0, 1),
        http_base: "http://10.9.0.1:8080".into(),
        files: BootFiles::default(),
        subnet_mask: Ipv4Addr::new(255, 255, 255, 0),
        router: None,
        dns: vec![],
    }
}

/// Runs `bytes` through everything at time `now`; returns whether it passed the gate.
/// Panics if any reply we encode does not decode to the request's transaction.
pub fn exercise(bytes: &[u8], leases: &mut Leases, now: i64) -> bool {
    let Ok(req) = check(bytes) else { return false };
    let client = classify(&req);
    let relay = relay_info(bytes);
    for mode in [Mode::Proxy, Mode::Authoritative] {
        for (port, chainload) in [Port::Dhcp, Port::PxeServer]
            .into_iter()
            .flat_map(|p| [(p, false), (p, true)])
        {
            let node = NodeView {
                bootable: true,
                local_boot: false,
                chainload,
            };
            let s = settings(mode);
            if let Decision::Reply(r) = decide(&req, &client, &node, &s, Some(leases), port, now) {
                let out = encode(&req, &r, s.server_ip, relay.clone());
                let msg = v4::Message::decode(&mut Decoder::new(&out)).expect("our reply decodes");
                assert_eq!(msg.xid(), req.xid);
            }
        }
    }
    true
}
