//! The boot-storm simulator against a real server: simulated nodes on a bridge go through
//! DHCP (authoritative), TFTP, iPXE DHCP, scripts, downloads (some cut and resumed),
//! attest, validate and heartbeats, and every one ends ready on the server.

use std::time::Duration;

use bootfleet::dhcp::decide::Mode;
use bootfleet::storm::{self, Storm, dhcp::Segment, node::Behaviour, node::Phase};

use crate::dhcp_net::{Lab, client_socket};
use crate::harness::TestServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_storm_boots_every_node_to_ready_through_the_whole_protocol() {
    let mut lab = Lab::new();
    let ns = lab.host("storm", Some(2));
    let ip = lab.ip(1);
    let settings = lab.settings(Mode::Authoritative);
    let server = TestServer::start_configured(move |cfg| {
        cfg.listen = format!("{ip}:8080").parse().unwrap();
        cfg.tftp_listen = Some(format!("{ip}:69").parse().unwrap());
        cfg.ipxe_dir = "/usr/lib/ipxe".into();
        cfg.dhcp = settings;
        // The simulated nodes' HTTP comes from this process's address, not from each
        // node's lease (bench/storm.sh routes the pool and binds each node's; here one
        // namespace holds them all).
        cfg.boots.bind_to_address = false;
    })
    .await;
    assert!(
        std::path::Path::new("/usr/lib/ipxe/undionly.kpxe").exists(),
        "undionly.kpxe is missing: apt-get install ipxe"
    );
    let nodes = 24;
    let urls = storm::setup::setup(
        &format!("http://{}", server.addr),
        &server.token,
        nodes,
        0.25,
        0.5,
        None,
    )
    .await
    .unwrap();
    assert_eq!(urls.len(), 2);

    let segment = Segment::from_socket(client_socket(&ns), 67).unwrap();
    let report = storm::run(
        Storm {
            nodes,
            ramp: Duration::from_secs(1),
            cut_every: 4,
            deadline: Duration::from_secs(120),
            behaviour: Behaviour {
                heartbeat_every: Duration::from_millis(200),
                ..Behaviour::for_storm_image()
            },
            measure: vec![std::process::id()],
        },
        segment,
    )
    .await
    .unwrap();
    assert_eq!(report.completed, nodes as usize, "{report}");
    assert!(report.failures.is_empty(), "{report}");
    for phase in [
        Phase::DhcpPxe,
        Phase::Tftp,
        Phase::DhcpIpxe,
        Phase::Script,
        Phase::Kernel,
        Phase::Initrd,
        Phase::Attest,
        Phase::Validate,
        Phase::Ready,
    ] {
        assert_eq!(report.phases[&phase].count, nodes as usize, "{phase:?}");
    }
    assert_eq!(report.phases[&Phase::Heartbeat].count, 2 * nodes as usize);
    assert_eq!(
        report.retries["download cut and resumed"],
        u64::from(nodes / 4)
    );
    let bytes_each = (0.25 * 1048576.0) as u64 + (0.5 * 1048576.0) as u64;
    assert_eq!(report.http_bytes, u64::from(nodes) * bytes_each, "{report}");
    assert!(
        report
            .server
            .as_ref()
            .is_some_and(|s| s.peak_rss_mib > 0.0 && s.peak_anon_mib > 0.0)
    );

    // The server agrees: every node ready, its boot attested and validated.
    let (_, list) = server.json("/api/v1/nodes").await;
    let ready = list
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["state"] == "ready")
        .count();
    assert_eq!(ready, nodes as usize, "{list}");

    // And its metrics: DHCP answered each node twice (PXE, then iPXE), TFTP sent each its
    // iPXE, and every phase of every boot was timed.
    let metrics = server.text("/metrics").await;
    let sample = |name: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} not in {metrics}"))
    };
    let n = f64::from(nodes);
    assert!(
        sample(r#"bootfleet_dhcp_packets_total{outcome="ack",reason=""}"#) >= 2.0 * n,
        "{metrics}"
    );
    assert!(sample(r#"bootfleet_tftp_transfers_total{outcome="completed"}"#) >= n);
    for phase in [
        "dhcp", "tftp", "script", "kernel", "initrd", "attest", "validate", "ready",
    ] {
        let count = sample(&format!(
            r#"bootfleet_boot_phase_duration_seconds_count{{phase="{phase}"}}"#
        ));
        assert!(count >= n, "{phase}: {count}");
    }
    server.stop().await;
}
