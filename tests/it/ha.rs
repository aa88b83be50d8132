//! Several servers as an operator runs them: four `bootfleet serve` processes, each in a
//! network namespace of its own on one boot segment (a bridge the test builds), sharing
//! PostgreSQL (its Unix socket) and an S3 object store (s3s-fs on the bridge), DHCP
//! authoritative with the pool cut in three slices (the fourth server a standby),
//! `[cluster] servers` naming all. A storm of simulated nodes boots while a slice's
//! server is killed with SIGKILL a third of the way: every node still ends ready, each
//! once, the standby takes the slice over, no address is leased twice, and the event log
//! has no gap.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bootfleet::storm::{self, Storm, dhcp::Segment, node::Behaviour};

use crate::dhcp_net::{Lab, client_socket};

/// One server process in its namespace.
struct Member {
    child: Child,
    log: PathBuf,
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The settings file of the server at `ip` (`peers`: every server's HTTP base).
struct Shared<'a> {
    db: &'a str,
    token: &'a Path,
    s3: &'a str,
    bucket: &'a str,
    peers: &'a [String],
}

fn settings(ip: Ipv4Addr, dir: &Path, shared: &Shared<'_>) -> String {
    let Shared {
        db,
        token,
        s3,
        bucket,
        peers,
    } = shared;
    let peers: Vec<String> = peers.iter().map(|p| format!("{p:?}")).collect();
    format!(
        r#"listen = "{ip}:8080"
admin_token_file = "{token}"
log_format = "json"

[store]
url = "{db}"

[blobs]
url = "s3://{bucket}/fleet"
endpoint = "{s3}"
credentials_file = "{creds}"

[cluster]
servers = [{peers}]

[boots]
# The simulated nodes' HTTP all comes from one namespace's address.
bind_to_address = false

[tftp]
listen = "{ip}:69"
ipxe_dir = "/usr/lib/ipxe"

[dhcp]
mode = "authoritative"
interface = "eth0"
server_ip = "{ip}"
http_url = "http://{ip}:8080"
slices = 3

[dhcp.pool]
start = "10.200.0.10"
end = "10.200.3.250"
lease_secs = 600
"#,
        token = token.display(),
        creds = dir.join("s3.credentials").display(),
        peers = peers.join(", "),
    )
}

/// Starts `bootfleet serve` inside `ns` and waits for its HTTP to answer.
fn spawn(ns: &str, dir: &Path, config: &str, url: &str) -> Member {
    std::fs::create_dir_all(dir.join("data")).unwrap();
    let cfg = dir.join("bootfleet.toml");
    std::fs::write(&cfg, config).unwrap();
    let log = dir.join("serve.log");
    let out = std::fs::File::create(&log).unwrap();
    // `ip netns exec` execs the binary: the child is the server itself (kill -9 hits it).
    let child = Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(crate::harness::bin())
        .args(["--data-dir", dir.join("data").to_str().unwrap(), "serve"])
        .args(["--config", cfg.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(out)
        .spawn()
        .expect("ip netns exec bootfleet serve");
    let mut member = Member { child, log };
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(url.trim_start_matches("http://")).is_err() {
        assert!(
            Instant::now() < deadline && member.child.try_wait().unwrap().is_none(),
            "the server in {ns} did not start: {}",
            std::fs::read_to_string(&member.log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    member
}

/// An admin GET's JSON answer.
async fn get_json(http: &reqwest::Client, url: &str, token: &str) -> serde_json::Value {
    http.get(url)
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Every event, oldest first, read page by page from `url`.
async fn all_events(http: &reqwest::Client, url: &str, token: &str) -> Vec<serde_json::Value> {
    let mut events = Vec::new();
    let mut since = 0;
    loop {
        let page = get_json(
            http,
            &format!("{url}/api/v1/events?since={since}&limit=1000"),
            token,
        )
        .await;
        let page = page["events"].as_array().unwrap();
        let Some(last) = page.last() else {
            return events;
        };
        since = last["seq"].as_i64().unwrap();
        events.extend(page.iter().cloned());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_storm_across_servers_survives_one_killed_and_a_standby_takes_its_slice() {
    assert!(
        Path::new("/usr/lib/ipxe/undionly.kpxe").exists(),
        "undionly.kpxe is missing: apt-get install ipxe"
    );
    let mut lab = Lab::new();
    let storm_ns = lab.host("storm", Some(2));
    // Lab names each veth by its role's first letter: one letter a server.
    let namespaces: Vec<String> = ["xsrv", "ysrv", "zsrv", "wsrv"]
        .iter()
        .zip(11..)
        .map(|(role, host)| lab.host(role, Some(host)))
        .collect();
    let ips: Vec<Ipv4Addr> = (0..4).map(|i| lab.ip(11 + i)).collect();
    let peers: Vec<String> = ips.iter().map(|ip| format!("http://{ip}:8080")).collect();

    let db = crate::pg::database().await;
    let s3 = crate::s3::start_on(&lab.ip(1).to_string());
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin.token");
    let token = "ha-cluster-admin-token-0123456789";
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let blobs = s3.config_for(dir.path(), &format!("ha-{}", std::process::id()));
    let shared = Shared {
        db: &db,
        token: &token_file,
        s3: blobs.endpoint.as_deref().unwrap(),
        bucket: blobs.url.as_deref().unwrap()[5..]
            .split('/')
            .next()
            .unwrap(),
        peers: &peers,
    };
    // Started in turn, so the first three take the three slices and the last stands by.
    let mut members: Vec<Option<Member>> = Vec::new();
    for (i, (ns, ip)) in namespaces.iter().zip(&ips).enumerate() {
        let home = dir.path().join(format!("s{i}"));
        std::fs::create_dir_all(&home).unwrap();
        std::fs::copy(
            dir.path().join("s3.credentials"),
            home.join("s3.credentials"),
        )
        .unwrap();
        members.push(Some(spawn(
            ns,
            &home,
            &settings(*ip, &home, &shared),
            &peers[i],
        )));
    }

    // The image goes in through the first server (its blobs to the bucket); nodes boot
    // through whichever server answers them.
    let nodes = 500;
    storm::setup::setup(&peers[0], token, nodes, 0.25, 0.5, None)
        .await
        .unwrap();
    let segment = Segment::from_socket(client_socket(&storm_ns), 67).unwrap();
    let run = tokio::spawn(storm::run(
        Storm {
            nodes,
            ramp: Duration::from_secs(10),
            cut_every: 0,
            deadline: Duration::from_secs(400),
            behaviour: Behaviour {
                heartbeat_every: Duration::from_millis(500),
                reboots: 3,
                reboot_after: Duration::from_secs(2),
                ..Behaviour::for_storm_image()
            },
            measure: vec![],
        },
        segment,
    ));

    // A third of the way (a third of the nodes ready), the second server dies without a
    // word, its slice held.
    let http = bootfleet::http_client::builder().build().unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
    let ready_at_kill = loop {
        let fleet = get_json(&http, &format!("{}/api/v1/fleet", peers[0]), token).await;
        let ready = fleet["by_state"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "ready")
            .map_or(0, |c| c["count"].as_u64().unwrap());
        if ready >= u64::from(nodes) / 3 {
            break ready;
        }
        assert!(
            Instant::now() < deadline,
            "a third never got ready: {}",
            fleet["by_state"]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut killed = members[1].take().unwrap();
    let killed_pid = killed.child.id();
    let ok = Command::new("kill")
        .args(["-9", &killed.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -9");
    killed.child.wait().unwrap();

    let report = run.await.unwrap().unwrap();
    let logs = || {
        members
            .iter()
            .flatten()
            .map(|m| std::fs::read_to_string(&m.log).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    };
    println!("{ready_at_kill} nodes were ready at the kill\n{report}");
    assert!(
        ready_at_kill < u64::from(nodes),
        "killed before the storm ended"
    );
    assert_eq!(report.completed, nodes as usize, "{report}");
    assert!(report.failures.is_empty(), "{report}");
    // Boots cut short by the kill start over; not every node's.
    let reboots = report
        .retries
        .get("reboot after a failed boot")
        .copied()
        .unwrap_or(0);
    assert!(reboots <= u64::from(nodes) / 3, "{report}");

    // Every node ready, each once, as both survivors read the shared state.
    for url in [&peers[0], &peers[2]] {
        let list = get_json(&http, &format!("{url}/api/v1/nodes"), token).await;
        let list = list.as_array().unwrap();
        let macs: std::collections::HashSet<&str> =
            list.iter().map(|n| n["mac"].as_str().unwrap()).collect();
        assert_eq!(list.len(), nodes as usize, "one row per node");
        assert_eq!(macs.len(), nodes as usize, "no node twice");
        let not_ready: Vec<_> = list.iter().filter(|n| n["state"] != "ready").collect();
        assert!(not_ready.is_empty(), "{not_ready:?}\n{}", logs());
    }
    // The standby took the dead server's slice (its lease lapsed), and no address is
    // leased to two clients.
    let pool = sqlx::PgPool::connect(&db).await.unwrap();
    let standby = format!(":{}:", members[3].as_ref().unwrap().child.id());
    let dead = format!(":{killed_pid}:");
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let holders: Vec<(String, String)> =
            sqlx::query_as("SELECT role, holder FROM leaders WHERE role LIKE 'dhcp-slice/%'")
                .fetch_all(&pool)
                .await
                .unwrap();
        if holders.iter().any(|(_, h)| h.contains(&standby)) {
            assert!(
                !holders.iter().any(|(_, h)| h.contains(&dead)),
                "{holders:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the standby did not take the slice over: {holders:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let twice: Vec<(String, i64)> =
        sqlx::query_as("SELECT ip, COUNT(*) FROM dhcp_leases GROUP BY ip HAVING COUNT(*) > 1")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(twice.is_empty(), "addresses leased twice: {twice:?}");
    pool.close().await;

    // One event order with no gap, whichever server wrote each event.
    let events = all_events(&http, &peers[2], token).await;
    assert!(events.len() > nodes as usize * 3, "{} events", events.len());
    for pair in events.windows(2) {
        assert_eq!(
            pair[1]["seq"].as_i64().unwrap(),
            pair[0]["seq"].as_i64().unwrap() + 1,
            "a gap in the event log: {} then {}",
            pair[0],
            pair[1]
        );
    }
    let _ = std::fs::remove_dir_all(&s3.root);
    drop(members);
    drop(lab);
}
