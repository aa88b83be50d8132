//! DHCP against real peers over a real (namespaced) network the test builds and removes:
//! a bridge in the root namespace carries our server; client namespaces hang off it by
//! veth. Peers: busybox udhcpc (lease, renew, release), Kea's perfdhcp (DORA under load),
//! dnsmasq as the site's DHCP server next to our proxy, and a scripted PXE client for
//! every boot class. Needs root, iproute2, busybox-static, kea-admin, dnsmasq-base (the
//! README test command installs them).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bootfleet::dhcp::decide::Mode;
use bootfleet::dhcp::leases::PoolConfig;
use dhcproto::{Decodable, Decoder, v4};

use crate::harness::*;

fn sh(cmd: &str) -> String {
    let out = Command::new("bash").args(["-c", cmd]).output().unwrap();
    assert!(
        out.status.success(),
        "`{cmd}` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn require(tools: &[(&str, &str)]) {
    assert!(
        sh("id -u").trim() == "0",
        "the DHCP network tests need root (network namespaces): run `sudo ./scripts/test`"
    );
    for (tool, package) in tools {
        assert!(
            Command::new("bash")
                .args(["-c", &format!("command -v {tool}")])
                .output()
                .unwrap()
                .status
                .success(),
            "{tool} is missing: apt-get install {package}"
        );
    }
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A bridge (our server's segment, 10.77.N.1/24) and namespaces attached to it.
pub(crate) struct Lab {
    n: u32,
    bridge: String,
    namespaces: Vec<String>,
    children: Vec<Child>,
}

impl Lab {
    pub(crate) fn new() -> Self {
        let n = (std::process::id() % 40) * 6 + NEXT.fetch_add(1, Ordering::Relaxed) % 6 + 1;
        let bridge = format!("bfb{n}");
        sh(&format!(
            "ip link del {bridge} 2>/dev/null; ip link add {bridge} type bridge && ip addr add 10.77.{n}.1/24 dev {bridge} && ip link set {bridge} up"
        ));
        Self {
            n,
            bridge,
            namespaces: vec![],
            children: vec![],
        }
    }

    pub(crate) fn ip(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, self.n as u8, host)
    }

    /// A namespace with `eth0` on the bridge (and `address`, when given).
    pub(crate) fn host(&mut self, role: &str, address: Option<u8>) -> String {
        let ns = format!("bf{}{role}", self.n);
        let veth = format!("bfv{}{}", self.n, &role[..1]);
        sh(&format!(
            "ip netns del {ns} 2>/dev/null; ip link del {veth} 2>/dev/null; ip netns add {ns} && ip link add {veth} type veth peer name eth0 netns {ns} && ip link set {veth} master {b} up && ip -n {ns} link set lo up && ip -n {ns} link set eth0 up",
            b = self.bridge
        ));
        if let Some(a) = address {
            sh(&format!(
                "ip -n {ns} addr add 10.77.{}.{a}/24 dev eth0",
                self.n
            ));
        }
        self.namespaces.push(ns.clone());
        ns
    }

    fn spawn(&mut self, ns: &str, cmd: &str) {
        let child = Command::new("ip")
            .args(["netns", "exec", ns, "bash", "-c", cmd])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        self.children.push(child);
    }

    pub(crate) fn settings(&self, mode: Mode) -> bootfleet::config::DhcpFileConfig {
        bootfleet::config::DhcpFileConfig {
            mode: Some(mode),
            interface: Some(self.bridge.clone()),
            server_ip: Some(self.ip(1)),
            http_url: Some(format!("http://{}:8080", self.ip(1))),
            pool: Some(PoolConfig {
                start: self.ip(100),
                end: self.ip(250),
                reservations: Default::default(),
                lease_secs: 600,
            }),
            ..Default::default()
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .status();
    }
}

/// A UDP socket on port 68 inside `ns`, bound to its eth0, broadcast allowed.
pub(crate) fn client_socket(ns: &str) -> UdpSocket {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        // setns changes only this thread; the socket keeps the namespace it was made in.
        let f = std::fs::File::open(path).unwrap();
        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None).unwrap();
        s.set_reuse_address(true).unwrap();
        s.set_broadcast(true).unwrap();
        s.bind_device(Some(b"eth0")).unwrap();
        s.bind(&SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 68)).into())
            .unwrap();
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        UdpSocket::from(s)
    })
    .join()
    .unwrap()
}

/// A request as firmware builds it; `options` after 53.
fn request(mac: [u8; 6], xid: u32, kind: v4::MessageType, options: Vec<v4::DhcpOption>) -> Vec<u8> {
    use dhcproto::Encodable;
    let mut m = v4::Message::new_with_id(
        xid,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        &mac,
    );
    m.set_flags(v4::Flags::default().set_broadcast());
    m.opts_mut().insert(v4::DhcpOption::MessageType(kind));
    for o in options {
        m.opts_mut().insert(o);
    }
    m.to_vec().unwrap()
}

/// Broadcasts `packet` and collects the replies to `xid` for `wait`.
fn exchange(sock: &UdpSocket, packet: &[u8], xid: u32, wait: Duration) -> Vec<v4::Message> {
    sock.send_to(packet, "255.255.255.255:67").unwrap();
    let deadline = Instant::now() + wait;
    let mut got = Vec::new();
    let mut buf = [0u8; 1500];
    while Instant::now() < deadline {
        if let Ok((n, _)) = sock.recv_from(&mut buf)
            && let Ok(m) = v4::Message::decode(&mut Decoder::new(&buf[..n]))
            && m.xid() == xid
        {
            got.push(m);
        }
    }
    got
}

fn class_options(vendor: &[u8], arch: Option<u16>, ipxe: bool) -> Vec<v4::DhcpOption> {
    let mut o = vec![v4::DhcpOption::ClassIdentifier(vendor.to_vec())];
    if let Some(a) = arch {
        o.push(v4::DhcpOption::ClientSystemArchitecture(a.into()));
    }
    if ipxe {
        o.push(v4::DhcpOption::UserClass(b"iPXE".to_vec()));
    }
    o
}

fn file_of(m: &v4::Message) -> String {
    match m.opts().get(v4::OptionCode::BootfileName) {
        Some(v4::DhcpOption::BootfileName(f)) => String::from_utf8_lossy(f).into_owned(),
        _ => String::new(),
    }
}

fn server_id(m: &v4::Message) -> Option<Ipv4Addr> {
    match m.opts().get(v4::OptionCode::ServerIdentifier) {
        Some(v4::DhcpOption::ServerIdentifier(ip)) => Some(*ip),
        _ => None,
    }
}

/// A boot class as the scripted client plays it: name, option 60, option 93, sends
/// user class iPXE, and the end of the boot file it must get.
type Class = (&'static str, &'static [u8], Option<u16>, bool, &'static str);

const CLASSES: [Class; 5] = [
    (
        "bios",
        b"PXEClient:Arch:00000:UNDI:002001",
        Some(0),
        false,
        "undionly.kpxe",
    ),
    (
        "uefi-x64",
        b"PXEClient:Arch:00007:UNDI:003000",
        Some(7),
        false,
        "snponly.efi",
    ),
    (
        "uefi-arm64",
        b"PXEClient:Arch:00011:UNDI:003000",
        Some(11),
        false,
        "arm64/snponly.efi",
    ),
    (
        "uefi-http",
        b"HTTPClient:Arch:00016:UNDI:003000",
        Some(16),
        false,
        "/ipxe/snponly.efi",
    ),
    (
        "ipxe",
        b"PXEClient:Arch:00000:UNDI:002001",
        None,
        true,
        "/boot.ipxe",
    ),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_mode_next_to_a_site_dhcp_server_answers_every_boot_class() {
    require(&[("ip", "iproute2"), ("dnsmasq", "dnsmasq-base")]);
    let mut lab = Lab::new();
    let site = lab.host("site", Some(2));
    let client = lab.host("cli", None);
    let n = lab.n;
    lab.spawn(&site, &format!("exec dnsmasq --keep-in-foreground --port=0 --interface=eth0 --bind-interfaces --dhcp-range=10.77.{n}.50,10.77.{n}.60,1h --dhcp-leasefile=/dev/null --no-ping"));
    let settings = lab.settings(Mode::Proxy);
    let server = TestServer::start_configured(|cfg| cfg.dhcp = settings).await;
    server
        .publish_query(good_bundle("demo", "1", b"k"), "?tag=demo:stable")
        .await;
    let sock = client_socket(&client);
    // dnsmasq takes a moment to bind.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (i, (name, vendor, arch, ipxe, file)) in CLASSES.iter().enumerate() {
        let mac = [0x52, 0x54, 0, 0x77, n as u8, i as u8];
        let mac_text = format!("52-54-00-77-{:02x}-{:02x}", n, i);
        server.assign(&mac_text, "demo:stable").await;
        let xid = 0x1000 + i as u32;
        let packet = request(
            mac,
            xid,
            v4::MessageType::Discover,
            class_options(vendor, *arch, *ipxe),
        );
        let replies = tokio::task::block_in_place(|| {
            exchange(&sock, &packet, xid, Duration::from_millis(1500))
        });
        let ours: Vec<&v4::Message> = replies
            .iter()
            .filter(|m| server_id(m) == Some(lab.ip(1)))
            .collect();
        let site_offers: Vec<&v4::Message> = replies
            .iter()
            .filter(|m| server_id(m) == Some(lab.ip(2)))
            .collect();
        assert_eq!(
            ours.len(),
            1,
            "{name}: one proxy offer from us: {replies:?}"
        );
        assert_eq!(
            ours[0].yiaddr(),
            Ipv4Addr::UNSPECIFIED,
            "{name}: a proxy gives no address"
        );
        assert!(
            file_of(ours[0]).ends_with(file),
            "{name}: {}",
            file_of(ours[0])
        );
        assert_eq!(
            site_offers.len(),
            1,
            "{name}: the site's server still offers the address"
        );
        let leased = u32::from(site_offers[0].yiaddr());
        assert!((u32::from(lab.ip(50))..=u32::from(lab.ip(60))).contains(&leased));
    }
    // A plain DHCP client, and a PXE client with nothing assigned: the site answers, we
    // stay silent; the unassigned one is recorded as discovered.
    for (i, options) in [
        class_options(b"udhcp 1.35.0", None, false),
        class_options(CLASSES[0].1, Some(0), false),
    ]
    .into_iter()
    .enumerate()
    {
        let mac = [0x52, 0x54, 0, 0x78, n as u8, i as u8];
        let xid = 0x2000 + i as u32;
        let packet = request(mac, xid, v4::MessageType::Discover, options);
        let replies = tokio::task::block_in_place(|| {
            exchange(&sock, &packet, xid, Duration::from_millis(1500))
        });
        assert!(
            replies.iter().all(|m| server_id(m) != Some(lab.ip(1))),
            "we answered: {replies:?}"
        );
        assert_eq!(replies.len(), 1, "the site answered");
    }
    let (status, node) = server
        .json(&format!("/api/v1/nodes/52-54-00-78-{n:02x}-01"))
        .await;
    assert_eq!((status, node["state"].as_str()), (200, Some("discovered")));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authoritative_mode_serves_udhcpc_perfdhcp_and_pxe_clients() {
    require(&[
        ("ip", "iproute2"),
        ("busybox", "busybox-static"),
        ("perfdhcp", "kea-admin"),
    ]);
    let mut lab = Lab::new();
    let client = lab.host("cli", None);
    let n = lab.n;
    let settings = lab.settings(Mode::Authoritative);
    let server = TestServer::start_configured(|cfg| cfg.dhcp = settings).await;
    server
        .publish_query(good_bundle("demo", "1", b"k"), "?tag=demo:stable")
        .await;
    let db = bootfleet::store::sqlite::open(&server.data.path().join("bootfleet.db"))
        .await
        .unwrap();

    // Scripted PXE clients: DISCOVER -> OFFER (address + boot file) -> REQUEST -> ACK.
    let sock = client_socket(&client);
    for (i, (name, vendor, arch, ipxe, file)) in CLASSES.iter().enumerate() {
        let mac = [0x52, 0x54, 0, 0x79, n as u8, i as u8];
        server
            .assign(&format!("52-54-00-79-{n:02x}-{i:02x}"), "demo:stable")
            .await;
        let xid = 0x3000 + i as u32;
        let discover = request(
            mac,
            xid,
            v4::MessageType::Discover,
            class_options(vendor, *arch, *ipxe),
        );
        let offers = tokio::task::block_in_place(|| {
            exchange(&sock, &discover, xid, Duration::from_millis(800))
        });
        assert_eq!(offers.len(), 1, "{name}: {offers:?}");
        let offered = offers[0].yiaddr();
        assert!(file_of(&offers[0]).ends_with(file), "{name}");
        let mut opts = class_options(vendor, *arch, *ipxe);
        opts.push(v4::DhcpOption::ServerIdentifier(lab.ip(1)));
        opts.push(v4::DhcpOption::RequestedIpAddress(offered));
        let req = request(mac, xid + 1, v4::MessageType::Request, opts);
        let acks = tokio::task::block_in_place(|| {
            exchange(&sock, &req, xid + 1, Duration::from_millis(800))
        });
        assert_eq!(acks.len(), 1, "{name}");
        assert_eq!(acks[0].opts().msg_type(), Some(v4::MessageType::Ack));
        assert_eq!(acks[0].yiaddr(), offered);
    }

    // busybox udhcpc: a lease, a renewal (SIGUSR1), a release (SIGUSR2).
    let events = server.data.path().join("udhcpc.events");
    let script = server.data.path().join("udhcpc.sh");
    // Configures the address as a real client would (a renewal is unicast from it).
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$1 $ip\" >> {}\ncase $1 in\n bound|renew) ip addr flush dev eth0; ip addr add $ip/24 dev eth0;;\n deconfig) ip addr flush dev eth0;;\nesac\n",
            events.display()
        ),
    )
    .unwrap();
    sh(&format!("chmod +x {}", script.display()));
    lab.spawn(
        &client,
        &format!(
            "exec busybox udhcpc -f -i eth0 -s {} -t 5 -T 1",
            script.display()
        ),
    );
    let read_events = || std::fs::read_to_string(&events).unwrap_or_default();
    let wait_for = |what: &str| {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !read_events().contains(what) {
            assert!(
                Instant::now() < deadline,
                "no {what:?} from udhcpc: {}",
                read_events()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    tokio::task::block_in_place(|| wait_for("bound 10.77."));
    let ip = read_events()
        .lines()
        .find_map(|l| l.strip_prefix("bound "))
        .unwrap()
        .trim()
        .to_string();
    let pid = lab.children.last().unwrap().id();
    sh(&format!("kill -USR1 {pid}"));
    tokio::task::block_in_place(|| wait_for(&format!("renew {ip}")));
    tokio::time::sleep(Duration::from_millis(1200)).await; // a lease flush
    let saved: Vec<String> = db
        .load_leases()
        .await
        .unwrap()
        .iter()
        .map(|l| l.ip.to_string())
        .collect();
    assert!(saved.contains(&ip), "lease {ip} saved: {saved:?}");
    sh(&format!("kill -USR2 {pid}"));
    tokio::task::block_in_place(|| wait_for("deconfig"));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let saved: Vec<String> = db
        .load_leases()
        .await
        .unwrap()
        .iter()
        .map(|l| l.ip.to_string())
        .collect();
    assert!(!saved.contains(&ip), "released {ip} still saved: {saved:?}");

    // perfdhcp: full DORA for 60 simulated clients; every exchange answered. It acts as a
    // relay (giaddr = its own address), so replies come back to port 67 through it.
    sh(&format!(
        "ip -n {client} addr flush dev eth0 && ip -n {client} addr add 10.77.{n}.5/24 dev eth0"
    ));
    let out = tokio::task::block_in_place(|| {
        sh(&format!(
            "ip netns exec {client} perfdhcp -4 -l eth0 -r 100 -R 60 -n 120 -W 2000000 2>&1 || true"
        ))
    });
    let mut sent_received = Vec::new();
    for line in out.lines() {
        let line = line.trim();
        if let Some(v) = line
            .strip_prefix("sent packets: ")
            .or_else(|| line.strip_prefix("received packets: "))
        {
            sent_received.push(v.trim().parse::<u64>().unwrap());
        }
    }
    assert_eq!(sent_received.len(), 4, "{out}");
    assert!(
        sent_received[0] > 0 && sent_received[0] == sent_received[1],
        "DO: {out}"
    );
    assert!(
        sent_received[2] > 0 && sent_received[2] == sent_received[3],
        "RA: {out}"
    );
    db.close().await;
    server.stop().await;
}

/// Bound leases are saved and come back after a restart: the same client gets the same
/// address from a fresh lease table.
#[tokio::test]
async fn leases_survive_a_restart() {
    use bootfleet::dhcp::directory::LeaseJournal;
    use bootfleet::dhcp::leases::Leases;
    use bootfleet::server::StoreLeases;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bootfleet.db");
    let pool = PoolConfig {
        start: Ipv4Addr::new(10, 1, 0, 10),
        end: Ipv4Addr::new(10, 1, 0, 20),
        reservations: Default::default(),
        lease_secs: 600,
    };
    let mac = [0x52, 0x54, 0, 1, 2, 3];
    let store = bootfleet::store::sqlite::open(&path).await.unwrap();
    let mut leases = Leases::new(&pool).unwrap();
    leases.offer(&[0x52, 0x54, 0, 9, 9, 9], None, 0); // takes .10, never bound
    let ip = leases.offer(&mac, None, 0).unwrap();
    leases.bind(&mac, ip, 0).unwrap();
    let (keep, gone) = leases.take_changes();
    let journal = StoreLeases(store);
    journal.save(&keep, &gone).await.unwrap();
    journal.0.close().await;

    let store = bootfleet::store::sqlite::open(&path).await.unwrap();
    let mut fresh = Leases::new(&pool).unwrap();
    fresh.load(StoreLeases(store.clone()).load().await.unwrap());
    assert_eq!(fresh.lease(&mac).map(|l| l.ip), Some(ip));
    assert_eq!(fresh.offer(&mac, None, 1000), Some(ip));
    assert_eq!(
        fresh.offer(&[0x52, 0x54, 0, 7, 7, 7], Some(ip), 1000),
        Some(Ipv4Addr::new(10, 1, 0, 10)),
        "a bound address is not handed to another client"
    );
    store.close().await;
}

/// Two boot segments behind Debian's `isc-dhcp-relay` (dhcrelay), each in namespaces of
/// its own: one server gives each segment's client an address from that segment's pool
/// (`[[dhcp.subnet]]`, chosen by the relay address), with the relay as its router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_segments_get_addresses_from_their_own_pools() {
    require(&[
        ("ip", "iproute2"),
        ("busybox", "busybox-static"),
        ("dhcrelay", "isc-dhcp-relay"),
    ]);
    let mut lab = Lab::new();
    let n = lab.n;
    let mut settings = lab.settings(Mode::Authoritative);
    let segment = |x: u32| format!("10.{}.{n}", 40 + x);
    for x in 0..2 {
        settings.subnet.push(bootfleet::dhcp::pools::SubnetConfig {
            relay: format!("{}.0/24", segment(x)),
            pool: PoolConfig {
                start: format!("{}.100", segment(x)).parse().unwrap(),
                end: format!("{}.150", segment(x)).parse().unwrap(),
                reservations: Default::default(),
                lease_secs: 600,
            },
            subnet_mask: None,
            router: None,
            dns: vec![],
        });
    }
    let server = TestServer::start_configured(|cfg| cfg.dhcp = settings).await;
    let work = tempfile::tempdir().unwrap();
    let mut clients = Vec::new();
    for x in 0..2u32 {
        // relay: eth0 on our segment; its downstream link to the segment's client.
        // Roles differ in their first letter: it names the veth.
        let relay = lab.host(["p", "q"][x as usize], Some(10 + x as u8));
        let client = format!("bf{n}c{x}");
        let down = format!("bfd{n}{x}");
        sh(&format!(
            "ip netns del {client} 2>/dev/null; ip netns add {client} && \
             ip link add {down} netns {relay} type veth peer name eth0 netns {client} && \
             ip -n {relay} addr add {seg}.1/24 dev {down} && ip -n {relay} link set {down} up && \
             ip -n {client} link set lo up && ip -n {client} link set eth0 up && \
             ip route add {seg}.0/24 via 10.77.{n}.{hop}",
            seg = segment(x),
            hop = 10 + x
        ));
        lab.namespaces.push(client.clone());
        lab.spawn(
            &relay,
            &format!("exec dhcrelay -4 -d -id {down} -iu eth0 10.77.{n}.1"),
        );
        clients.push(client);
    }
    // Each client asks once; the script writes what it was given.
    let results: Vec<String> = clients
        .iter()
        .enumerate()
        .map(|(x, client)| {
            let out = work.path().join(format!("lease{x}"));
            let script = work.path().join(format!("udhcpc{x}.sh"));
            std::fs::write(
                &script,
                format!(
                    "#!/bin/sh\n[ \"$1\" = bound ] && echo \"$ip $router $subnet\" > {}\nexit 0\n",
                    out.display()
                ),
            )
            .unwrap();
            sh(&format!("chmod +x {}", script.display()));
            let got = tokio::task::block_in_place(|| {
                sh(&format!(
                    "ip netns exec {client} busybox udhcpc -f -q -n -i eth0 -t 10 -T 1 -s {} 2>&1 || true",
                    script.display()
                ))
            });
            std::fs::read_to_string(&out)
                .unwrap_or_else(|_| panic!("segment {x} got no lease: {got}"))
        })
        .collect();
    for (x, got) in results.iter().enumerate() {
        let fields: Vec<&str> = got.split_whitespace().collect();
        let seg = segment(x as u32);
        assert_eq!(fields.len(), 3, "{got}");
        let last: u8 = fields[0]
            .strip_prefix(&format!("{seg}."))
            .unwrap_or_else(|| panic!("segment {x} got {got}, not an address of {seg}.0/24"))
            .parse()
            .unwrap();
        assert!((100..=150).contains(&last), "{got}");
        assert_eq!(fields[1], format!("{seg}.1"), "the relay is the router");
        assert_eq!(fields[2], "255.255.255.0");
    }
    server.stop().await;
}

/// A new boot is bound to what DHCP saw of the MAC on the wire: a request from another
/// address than the one the MAC leased (authoritative mode) or asked the site's server
/// for (proxy mode) is refused with 403 and changes nothing; from the leased address the
/// node boots. Before, one unauthenticated GET from anywhere knocked a ready node's
/// attestation out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_boot_must_come_from_the_address_dhcp_saw_the_mac_use() {
    require(&[("ip", "iproute2"), ("curl", "curl")]);
    let mut lab = Lab::new();
    let client = lab.host("grd", None);
    let n = lab.n;
    let settings = lab.settings(Mode::Authoritative);
    let listen: std::net::SocketAddr = format!("{}:0", lab.ip(1)).parse().unwrap();
    let server = TestServer::start_configured(|cfg| {
        cfg.dhcp = settings;
        cfg.listen = listen;
    })
    .await;
    server
        .publish_query(good_bundle("demo", "1", b"k"), "?tag=demo:stable")
        .await;
    let hw = [0x52, 0x54, 0, 0x7a, n as u8, 1];
    let mac = format!("52-54-00-7a-{n:02x}-01");
    server.assign(&mac, "demo:stable").await;

    // iPXE's DORA from the client namespace: the MAC now holds a lease.
    let sock = client_socket(&client);
    let (_, vendor, arch, ipxe, _) = CLASSES[4];
    let discover = request(
        hw,
        0x7a00,
        v4::MessageType::Discover,
        class_options(vendor, arch, ipxe),
    );
    let offers = tokio::task::block_in_place(|| {
        exchange(&sock, &discover, 0x7a00, Duration::from_millis(800))
    });
    assert_eq!(offers.len(), 1, "{offers:?}");
    let leased = offers[0].yiaddr();
    let mut opts = class_options(vendor, arch, ipxe);
    opts.push(v4::DhcpOption::ServerIdentifier(lab.ip(1)));
    opts.push(v4::DhcpOption::RequestedIpAddress(leased));
    let req = request(hw, 0x7a01, v4::MessageType::Request, opts);
    let acks =
        tokio::task::block_in_place(|| exchange(&sock, &req, 0x7a01, Duration::from_millis(800)));
    assert_eq!(acks.len(), 1);
    assert_eq!(acks[0].opts().msg_type(), Some(v4::MessageType::Ack));

    // From the server's own address (any host but the node): refused, nothing recorded.
    let (_, before) = server.json(&format!("/api/v1/nodes/{mac}")).await;
    let script = format!("/boot/node.ipxe?mac={mac}");
    let r = reqwest::get(server.url(&script)).await.unwrap();
    assert_eq!(r.status(), 403);
    let body = r.text().await.unwrap();
    assert!(body.contains(&leased.to_string()), "{body}");
    let (_, node) = server.json(&format!("/api/v1/nodes/{mac}")).await;
    assert_eq!(node["state"], before["state"], "{node}");
    assert_eq!(
        node["boots"], before["boots"],
        "no boot was recorded: {node}"
    );
    // What DHCP did shows before any script: the node got its answers.
    let seen = strings(&node["preboot"], "step");
    assert_eq!(seen, ["ipxe dhcp offer", "ipxe dhcp ack"], "{node}");

    // From the leased address, as the node itself asks: its boot script.
    sh(&format!("ip -n {client} addr add {leased}/24 dev eth0"));
    let out = sh(&format!(
        "ip netns exec {client} curl -s -w '\\n%{{http_code}}' '{}'",
        server.url(&script)
    ));
    assert!(out.ends_with("\n200"), "{out}");
    assert!(out.contains("kernel "), "{out}");
    let (_, node) = server.json(&format!("/api/v1/nodes/{mac}")).await;
    assert_eq!(node["state"], "provisioning", "{node}");
    // The boot's timeline opens with those answers; nothing is left pending.
    let steps = strings(&node["boots"][0]["steps"], "step");
    assert_eq!(
        steps[..3],
        ["ipxe dhcp offer", "ipxe dhcp ack", "script"],
        "{node}"
    );
    let given = node["boots"][0]["steps"][1]["outcome"].as_str().unwrap();
    assert!(given.starts_with(&format!("{leased}, ")), "{given}");
    assert_eq!(node["preboot"], serde_json::json!([]), "{node}");
    server.stop().await;
}

/// Proxy mode sees no lease of ours, but the broadcast DHCPREQUEST names the address
/// the node asked the site's server for: a boot from elsewhere is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_proxy_mode_a_boot_must_come_from_the_address_the_node_asked_for() {
    require(&[("ip", "iproute2")]);
    let mut lab = Lab::new();
    let client = lab.host("prq", None);
    let n = lab.n;
    let settings = lab.settings(Mode::Proxy);
    let server = TestServer::start_configured(|cfg| cfg.dhcp = settings).await;
    server
        .publish_query(good_bundle("demo", "1", b"k"), "?tag=demo:stable")
        .await;
    let hw = [0x52, 0x54, 0, 0x7b, n as u8, 1];
    let mac = format!("52-54-00-7b-{n:02x}-01");
    server.assign(&mac, "demo:stable").await;
    let script = format!("/boot/node.ipxe?mac={mac}");

    // Nothing seen yet: the address cannot be checked, the node boots (and may once).
    let r = reqwest::get(server.url(&script)).await.unwrap();
    assert_eq!(r.status(), 200);

    let sock = client_socket(&client);
    let (_, vendor, arch, ipxe, _) = CLASSES[4];
    let mut opts = class_options(vendor, arch, ipxe);
    opts.push(v4::DhcpOption::ServerIdentifier(lab.ip(9)));
    opts.push(v4::DhcpOption::RequestedIpAddress(lab.ip(42)));
    let req = request(hw, 0x7b01, v4::MessageType::Request, opts);
    // The REQUEST is for the site's server; our proxy only listens.
    tokio::task::block_in_place(|| exchange(&sock, &req, 0x7b01, Duration::from_millis(300)));

    let r = reqwest::get(server.url(&script)).await.unwrap();
    assert_eq!(r.status(), 403);
    let body = r.text().await.unwrap();
    assert!(
        body.contains(&lab.ip(42).to_string()) && body.contains("ask for"),
        "{body}"
    );
    server.stop().await;
}

/// A raw ICMPv6 socket on `ns`'s eth0, as iPXE's IPv6 side: sends router solicitations
/// (to all routers, once a second, as a host does, with hop limit `hops`: 255 from the
/// link itself) until an advertisement comes back, and returns it with its source.
fn solicit_router(
    ns: &str,
    within: Duration,
    hops: u32,
) -> Option<(Vec<u8>, std::net::SocketAddrV6)> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let f = std::fs::File::open(path).unwrap();
        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let ifindex = nix::net::if_::if_nametoindex("eth0").unwrap();
        let s = socket2::Socket::new(
            socket2::Domain::IPV6,
            socket2::Type::RAW,
            Some(socket2::Protocol::ICMPV6),
        )
        .unwrap();
        s.bind_device(Some(b"eth0")).unwrap();
        s.set_multicast_hops_v6(hops).unwrap();
        s.set_multicast_if_v6(ifindex).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let all_routers = std::net::Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 2);
        let to = socket2::SockAddr::from(std::net::SocketAddrV6::new(all_routers, 0, 0, ifindex));
        let solicitation = [133u8, 0, 0, 0, 0, 0, 0, 0];
        let deadline = Instant::now() + within;
        let mut next_send = Instant::now();
        let mut buf = [0u8; 1500];
        while Instant::now() < deadline {
            if Instant::now() >= next_send {
                // Fails while eth0's link-local address is still tentative: try again.
                let _ = s.send_to(&solicitation, &to);
                next_send = Instant::now() + Duration::from_secs(1);
            }
            use std::os::fd::AsRawFd;
            if let Ok((len, Some(from))) =
                nix::sys::socket::recvfrom::<nix::sys::socket::SockaddrIn6>(s.as_raw_fd(), &mut buf)
                && len > 0
                && buf[0] == 134
            {
                return Some((buf[..len].to_vec(), std::net::SocketAddrV6::from(from)));
            }
        }
        None
    })
    .join()
    .unwrap()
}

/// iPXE waits about 16 s for IPv6 at each start where no router advertises: our server
/// answers its solicitations with "not a router, no prefix, no DHCPv6", which ends that
/// wait, from its own link-local address on the boot interface, and counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_solicitations_are_answered_with_no_router_here() {
    require(&[("ip", "iproute2")]);
    let mut lab = Lab::new();
    let client = lab.host("ra", None);
    let settings = lab.settings(Mode::Authoritative);
    let server = TestServer::start_configured(|cfg| cfg.dhcp = settings).await;
    let answer =
        tokio::task::block_in_place(|| solicit_router(&client, Duration::from_secs(10), 255));
    let (ra, from) = answer.expect("no router advertisement within 10 s");
    assert!(
        from.ip().segments()[0] == 0xfe80,
        "an advertisement comes from a link-local address: {from}"
    );
    assert_eq!(ra[1], 0, "code");
    assert_eq!(
        ra[5], 0,
        "M and O clear: iPXE runs no DHCPv6 and stops waiting"
    );
    assert_eq!(
        &ra[6..8],
        &[0, 0],
        "router lifetime 0: not a default router"
    );
    assert!(
        ra[16..].chunks(8).all(|option| option[0] != 3),
        "no prefix information: no address is made from it"
    );
    // As a router would have forwarded it (the link is up now): no answer.
    let forwarded =
        tokio::task::block_in_place(|| solicit_router(&client, Duration::from_secs(3), 64));
    assert!(
        forwarded.is_none(),
        "a forwarded solicitation was answered: {forwarded:?}"
    );
    // Counted once sent: the advertisement can reach us before the count is made.
    let counted = |metrics: &str| {
        [
            "outcome=\"router-advertisement\"",
            "outcome=\"malformed\",reason=\"ra-hop-limit\"",
        ]
        .iter()
        .all(|labels| {
            metrics
                .lines()
                .any(|l| l.starts_with("bootfleet_dhcp_packets_total{") && l.contains(labels))
        })
    };
    let mut metrics = server.text("/metrics").await;
    for _ in 0..50 {
        if counted(&metrics) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        metrics = server.text("/metrics").await;
    }
    assert!(counted(&metrics), "{metrics}");
    server.stop().await;
}

/// Which half of the lab's pool (.100-.250 cut into 2 slices: .100-.174, .175-.250).
fn half(ip: Ipv4Addr) -> u32 {
    if ip.octets()[3] <= 174 { 0 } else { 1 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_authoritative_servers_split_the_pool_and_a_standby_takes_over_a_slice() {
    require(&[("ip", "iproute2")]);
    let mut lab = Lab::new();
    let client = lab.host("cli", None);
    let n = lab.n;
    // Three servers on one segment, each with its own address (its server identifier).
    for host in [2, 3] {
        sh(&format!(
            "ip addr add {}/24 dev {}",
            lab.ip(host),
            lab.bridge
        ));
    }
    let url = crate::pg::database().await;
    let next = std::sync::atomic::AtomicU8::new(1);
    let base = lab.settings(Mode::Authoritative);
    let (mut servers, _shared) = crate::servers::cluster(3, &url, |cfg| {
        let host = next.fetch_add(1, Ordering::Relaxed);
        cfg.dhcp = bootfleet::config::DhcpFileConfig {
            server_ip: Some(lab.ip(host)),
            slices: Some(2),
            ..base.clone()
        };
    })
    .await;
    let sock = client_socket(&client);
    let send = |packet: &[u8], xid: u32| {
        tokio::task::block_in_place(|| exchange(&sock, packet, xid, Duration::from_millis(600)))
    };
    let discover =
        |mac: [u8; 6], xid: u32| send(&request(mac, xid, v4::MessageType::Discover, vec![]), xid);
    let mac = |i: u8| [0x52, 0x54, 0, 0x7a, n as u8, i];
    let owner = |m: [u8; 6]| bootfleet::dhcp::balance::owner(&m, 2);
    // Clients of each slice (the MAC picks the slice whose server answers first).
    let of_slice = |k: u32| (0..=255u8).map(mac).filter(move |m| owner(*m) == k);
    let clients: Vec<[u8; 6]> = of_slice(0).take(3).chain(of_slice(1).take(3)).collect();

    // The first two servers take the two slices; the third holds none and is silent.
    // Until each server has read that the other holds its slice (every 5 s), both may
    // answer a client: wait for a round where each client hears one server, each its own.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut xid = 0x5000;
    let mut by_server = std::collections::HashMap::new();
    loop {
        let mut offers = Vec::new();
        for m in [clients[0], clients[3]] {
            xid += 1;
            offers.push(discover(m, xid));
        }
        for o in offers.iter().flatten() {
            by_server.insert(server_id(o).unwrap(), half(o.yiaddr()));
        }
        let settled = offers.iter().all(|o| o.len() == 1)
            && server_id(&offers[0][0]) != server_id(&offers[1][0]);
        if settled {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the slices were not taken: {by_server:?}"
        );
    }
    assert!(!by_server.contains_key(&lab.ip(3)), "the standby is silent");
    assert_ne!(
        by_server[&lab.ip(1)],
        by_server[&lab.ip(2)],
        "disjoint slices"
    );

    // Each client is answered by its slice's server alone, and gets its own address.
    let mut bound = Vec::new();
    for (i, m) in clients.iter().enumerate() {
        xid += 2;
        let offers = discover(*m, xid);
        assert_eq!(
            offers.len(),
            1,
            "client {i}: one offer, from its slice's server"
        );
        let offer = &offers[0];
        assert_eq!(half(offer.yiaddr()), owner(*m), "client {i}");
        let id = server_id(offer).unwrap();
        let opts = vec![
            v4::DhcpOption::ServerIdentifier(id),
            v4::DhcpOption::RequestedIpAddress(offer.yiaddr()),
        ];
        let acks = send(
            &request(*m, xid + 1, v4::MessageType::Request, opts),
            xid + 1,
        );
        assert_eq!(acks.len(), 1, "client {i}: {acks:?}");
        assert_eq!(acks[0].opts().msg_type(), Some(v4::MessageType::Ack));
        assert_eq!(acks[0].yiaddr(), offer.yiaddr());
        bound.push((*m, offer.yiaddr(), id));
    }
    let distinct: std::collections::HashSet<_> = bound.iter().map(|b| b.1).collect();
    assert_eq!(
        distinct.len(),
        bound.len(),
        "no address given twice: {bound:?}"
    );

    // A DISCOVER sent again (its server silent, as when it is down) is answered by the
    // other slice's server too, from its own slice.
    xid += 2;
    let m = mac(200);
    let packet = request(m, xid, v4::MessageType::Discover, vec![]);
    assert_eq!(send(&packet, xid).len(), 1);
    let again = send(&packet, xid);
    let halves: std::collections::HashSet<u32> = again.iter().map(|o| half(o.yiaddr())).collect();
    assert_eq!(
        halves.len(),
        2,
        "both slices offer a retransmitted DISCOVER: {again:?}"
    );

    // A client asking again for its address (INIT-REBOOT: no server named) hears its
    // own server's ACK and no NAK from the other.
    let (m, ip, id) = bound[0];
    xid += 1;
    let req = request(
        m,
        xid,
        v4::MessageType::Request,
        vec![v4::DhcpOption::RequestedIpAddress(ip)],
    );
    let replies = send(&req, xid);
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].opts().msg_type(), Some(v4::MessageType::Ack));
    assert_eq!(server_id(&replies[0]), Some(id));

    // The first server stops: the standby takes its slice with its leases, so a client
    // of the first gets its own address again, now from the standby.
    let first = servers.remove(0);
    first.stop().await;
    let (m, ip, _) = *bound.iter().find(|b| b.2 == lab.ip(1)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let taken_over = loop {
        xid += 1;
        let offers = discover(m, xid);
        if let Some(o) = offers.iter().find(|o| server_id(o) == Some(lab.ip(3))) {
            break o.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the standby did not take the slice over: {offers:?}"
        );
    };
    assert_eq!(
        taken_over.yiaddr(),
        ip,
        "the lease went over with the slice"
    );
    for s in servers {
        s.stop().await;
    }
}
