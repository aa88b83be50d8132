//! Property tests of the DHCP path on hostile input: random datagrams and mutations of
//! packets shaped like what real firmware sends (option sets from the lab notes) go through
//! check -> classify -> decide (both modes) -> encode. Nothing may panic, every drop has a
//! reason, and every reply we encode decodes again.

use std::net::Ipv4Addr;

use bootfleet::dhcp::exercise::exercise;
use bootfleet::dhcp::leases::{Leases, PoolConfig};

use crate::harness::{Rng, mutate};

fn packet(options: &[(u8, &[u8])], giaddr: [u8; 4]) -> Vec<u8> {
    let mut p = vec![0u8; 236];
    p[0] = 1;
    p[1] = 1;
    p[2] = 6;
    p[4..8].copy_from_slice(&[1, 2, 3, 4]);
    p[24..28].copy_from_slice(&giaddr);
    p[28..34].copy_from_slice(&[0x52, 0x54, 0, 0xaa, 0xbb, 0xcc]);
    p.extend_from_slice(&[99, 130, 83, 99]);
    for (code, value) in options {
        p.push(*code);
        p.push(value.len() as u8);
        p.extend_from_slice(value);
    }
    p.push(255);
    p
}

/// Shapes of real requests: BIOS PXE ROM, OVMF, iPXE with 175, udhcpc, a relayed
/// request with option 82, a UEFI HTTP client.
fn seeds() -> Vec<Vec<u8>> {
    let uuid = [0u8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];
    vec![
        packet(
            &[
                (53, &[1]),
                (57, &[4, 0]),
                (55, &[1, 3, 43, 60, 66, 67, 128]),
                (97, &uuid),
                (94, &[1, 2, 1]),
                (93, &[0, 0]),
                (60, b"PXEClient:Arch:00000:UNDI:002001"),
            ],
            [0; 4],
        ),
        packet(
            &[
                (53, &[1]),
                (57, &[5, 192]),
                (93, &[0, 7]),
                (94, &[1, 3, 0]),
                (60, b"PXEClient:Arch:00007:UNDI:003000"),
                (97, &[0; 17]),
            ],
            [0; 4],
        ),
        packet(
            &[
                (53, &[3]),
                (50, &[10, 9, 0, 100]),
                (54, &[10, 9, 0, 1]),
                (77, b"iPXE"),
                (175, &[177, 5, 1, 0x11, 0x22, 0x33, 0x44, 19, 1, 1]),
                (60, b"PXEClient:Arch:00000:UNDI:002001"),
            ],
            [0; 4],
        ),
        packet(
            &[
                (53, &[1]),
                (61, &[1, 0x52, 0x54, 0, 0xaa, 0xbb, 0xcc]),
                (60, b"udhcp 1.35.0"),
                (12, b"node1"),
                (55, &[1, 3, 6, 12, 15, 28, 42]),
            ],
            [0; 4],
        ),
        packet(
            &[
                (53, &[1]),
                (60, b"PXEClient:Arch:00007:UNDI:003000"),
                (
                    82,
                    &[1, 6, b'e', b't', b'h', b'1', b'/', b'7', 2, 2, 0xab, 0xcd],
                ),
            ],
            [10, 8, 0, 1],
        ),
        packet(
            &[
                (53, &[1]),
                (60, b"HTTPClient:Arch:00016:UNDI:003000"),
                (93, &[0, 16]),
            ],
            [0; 4],
        ),
    ]
}

#[test]
fn random_and_mutated_datagrams_never_panic() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut leases = Leases::new(&PoolConfig {
        start: Ipv4Addr::new(10, 9, 0, 100),
        end: Ipv4Addr::new(10, 9, 0, 110),
        reservations: Default::default(),
        lease_secs: 600,
    })
    .unwrap();
    let seeds = seeds();
    for s in &seeds {
        assert!(exercise(s, &mut leases, 0), "seed is well-formed");
    }
    let mut passed = 0;
    for i in 0..30_000i64 {
        let bytes = if i % 3 == 0 {
            let len = rng.below(1600);
            (0..len).map(|_| rng.next() as u8).collect::<Vec<u8>>()
        } else {
            let mut p = seeds[rng.below(seeds.len())].clone();
            // Insertions go among the options, past the fixed header and cookie.
            mutate(&mut rng, &mut p, 240);
            p
        };
        if exercise(&bytes, &mut leases, i * 1000) {
            passed += 1;
        }
    }
    // The mutations must reach past the gate, or this test tests only the gate.
    assert!(
        passed > 1000,
        "only {passed} mutated datagrams passed the checks"
    );
}
