//! Any datagram through the DHCP gate, classification and both modes' decisions.
#![no_main]

use std::net::Ipv4Addr;

use bootfleet::dhcp::classify::classify;
use bootfleet::dhcp::decide::{BootFiles, Decision, Mode, NodeView, Port, Settings, decide};
use bootfleet::dhcp::leases::{Leases, PoolConfig};
use bootfleet::dhcp::reply::{encode, relay_info};
use bootfleet::dhcp::wire::check;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(req) = check(data) else { return };
    let client = classify(&req);
    let mut leases = Leases::new(&PoolConfig {
        start: Ipv4Addr::new(10, 0, 0, 10),
        end: Ipv4Addr::new(10, 0, 0, 20),
        reservations: Default::default(),
        lease_secs: 600,
    })
    .unwrap();
    for mode in [Mode::Proxy, Mode::Authoritative] {
        let s = Settings {
            mode,
            server_ip: Ipv4Addr::new(10, 0, 0, 1),
            http_base: "http://10.0.0.1:8080".into(),
            files: BootFiles::default(),
            subnet_mask: Ipv4Addr::new(255, 255, 255, 0),
            router: None,
            dns: vec![],
        };
        let node = NodeView { bootable: true, local_boot: false };
        if let Decision::Reply(r) = decide(&req, &client, &node, &s, Some(&mut leases), Port::Dhcp, 0) {
            encode(&req, &r, s.server_ip, relay_info(data));
        }
    }
});
