//! Any datagram through the DHCP gate, classification and both modes' decisions: the
//! same path `tests/it/dhcp_fuzz.rs` drives on every test run (`dhcp::exercise`).
#![no_main]

use std::net::Ipv4Addr;

use bootfleet::dhcp::exercise::exercise;
use bootfleet::dhcp::leases::{Leases, PoolConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut leases = Leases::new(&PoolConfig {
        start: Ipv4Addr::new(10, 9, 0, 100),
        end: Ipv4Addr::new(10, 9, 0, 110),
        reservations: Default::default(),
        lease_secs: 600,
    })
    .unwrap();
    exercise(data, &mut leases, 0);
});
