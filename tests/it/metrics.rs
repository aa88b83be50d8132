//! `/metrics` as Prometheus sees it: a real Prometheus (Debian's `prometheus`, on
//! loopback) scrapes a server that booted a small fleet of fake nodes, and PromQL through
//! its HTTP API counts what the fleet did. The shipped alert rules pass `promtool`'s
//! checks and unit tests; every query of the shipped dashboard and rules names metrics
//! the server exports and runs in Prometheus.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use crate::fake_node::{FakeNode, healthy};
use crate::harness::*;
use crate::oci::port_for_a_child as free_port;

const PROMETHEUS: &str = "/usr/bin/prometheus";
const PROMTOOL: &str = "/usr/bin/promtool";

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

fn need(tool: &str) {
    assert!(
        Path::new(tool).exists(),
        "{tool} is missing: apt-get install prometheus"
    );
}

/// A Prometheus scraping one bootfleet server every second, with the shipped rules.
struct Prometheus {
    child: Child,
    url: String,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts it; a port taken between picking and binding is retried on another.
    async fn start(target: std::net::SocketAddr, token: &str) -> Prometheus {
        need(PROMETHEUS);
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, token).unwrap();
        std::fs::copy(
            deploy("prometheus/bootfleet.rules.yml"),
            dir.path().join("bootfleet.rules.yml"),
        )
        .unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(&config, scrape_config(target, &token_file)).unwrap();
        let http = reqwest::Client::new();
        for _ in 0..3 {
            let port = free_port();
            let mut child = Command::new(PROMETHEUS)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("tsdb").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let url = format!("http://127.0.0.1:{port}");
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            loop {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                let ready = http.get(format!("{url}/-/ready")).send().await;
                if ready.is_ok_and(|r| r.status() == 200) {
                    return Prometheus {
                        child,
                        url,
                        http,
                        _dir: dir,
                    };
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "Prometheus not ready in 30 s"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        panic!("Prometheus exited at start three times");
    }

    /// The query's result; the query must be valid.
    async fn query(&self, promql: &str) -> Vec<Value> {
        let r: Value = self
            .http
            .get(format!("{}/api/v1/query", self.url))
            .query(&[("query", promql)])
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(r["status"], "success", "{promql}: {r}");
        r["data"]["result"].as_array().unwrap().clone()
    }

    /// The single value of `promql`, once Prometheus has it (None if it never does).
    async fn value(&self, promql: &str) -> Option<f64> {
        let result = self.query(promql).await;
        let v = result.first()?["value"][1].as_str()?;
        v.parse().ok()
    }

    /// Waits for a healthy scrape that started after this call: the second new
    /// `lastScrape` (the first may have been under way already).
    async fn scrape_after_now(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut seen: std::collections::BTreeMap<String, Vec<String>> = Default::default();
        loop {
            let targets: Value = self
                .http
                .get(format!("{}/api/v1/targets", self.url))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let active = targets["data"]["activeTargets"].as_array().unwrap();
            for t in active {
                let url = t["scrapeUrl"].as_str().unwrap_or("").to_string();
                let last = t["lastScrape"].as_str().unwrap_or("").to_string();
                let s = seen.entry(url).or_default();
                if s.last() != Some(&last) {
                    s.push(last);
                }
            }
            let all_fresh = active.iter().all(|t| t["health"] == "up")
                && seen.len() == active.len()
                && seen.values().all(|s| s.len() >= 3);
            if all_fresh && !active.is_empty() {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no healthy scrape in 30 s: {targets}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

fn scrape_config(target: std::net::SocketAddr, token_file: &Path) -> String {
    let job = |name: &str, path: &str| {
        format!(
            "  - job_name: {name}\n    metrics_path: {path}\n    authorization:\n      \
             type: Bearer\n      credentials_file: {}\n    static_configs:\n      \
             - targets: [\"{target}\"]\n",
            token_file.display()
        )
    };
    format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  \
         - bootfleet.rules.yml\nscrape_configs:\n{}{}",
        job("bootfleet", "/metrics"),
        job("bootfleet-gpus", "/metrics/gpus")
    )
}

/// What the server exports: each sample name a query may use (a histogram's
/// `_bucket`, `_sum` and `_count`).
fn exported_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut words = rest.split_whitespace();
            let (Some(name), Some(kind)) = (words.next(), words.next()) else {
                continue;
            };
            if kind == "histogram" {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            } else {
                names.insert(name.to_string());
            }
        }
    }
    names
}

/// The `bootfleet_*` names a PromQL expression uses.
fn names_in(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in expr.match_indices("bootfleet_") {
        let name: String = expr[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        out.insert(name);
    }
    out
}

async fn scrape(server: &TestServer, path: &str, token: &str) -> (u16, String) {
    let r = server
        .http
        .get(server.url(path))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// A heartbeat carrying the readings of the fixture's 8 GPUs, with one XID on GPU 3.
async fn heartbeat_with_gpus(
    server: &TestServer,
    node: &FakeNode<'_>,
    boot: &crate::fake_node::Boot,
) {
    let gpus: Vec<Value> = healthy()["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            json!({
                "index": g["index"], "uuid": g["uuid"], "name": g["name"],
                "pci_bus_id": g["pci_bus_id"], "temperature_c": g["temperature_c"],
                "power_w": g["power_w"], "ecc": g["ecc"],
                "xids": if g["index"] == 3 { 1 } else { 0 },
            })
        })
        .collect();
    let r = server
        .http
        .post(server.url("/api/v1/agent/heartbeat"))
        .bearer_auth(&boot.token)
        .json(&json!({ "boot_id": boot.id, "mac": node.colons(), "gpus": gpus }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
}

/// Five nodes booted (four ready, one failing validation on a missing GPU) and one only
/// discovered; then Prometheus, scraping with the scrape-only token, counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_a_booted_fleet_and_promql_counts_it() {
    let tokens = tempfile::tempdir().unwrap();
    let scrape_token = "scrape-only-token-0123456789";
    std::fs::write(tokens.path().join("metrics.token"), scrape_token).unwrap();
    let token_file = tokens.path().join("metrics.token");
    // A webhook whose receiver never answers (a port nothing listens on): it lags.
    let secret_file = tokens.path().join("webhook.secret");
    std::fs::write(&secret_file, "webhook-secret-0123456789").unwrap();
    let silent = free_port();
    let server = TestServer::start_configured(move |cfg| {
        cfg.metrics.group_labels = vec!["rack".into()];
        cfg.metrics.token_file = Some(token_file);
        cfg.webhooks = vec![bootfleet::events::webhook::WebhookConfig {
            url: format!("http://127.0.0.1:{silent}/hook/s3cret-path"),
            secret_file,
            ca_file: None,
        }];
    })
    .await;
    let (status, image) = server
        .publish(good_bundle("demo", "1.0", &noise(20_000, 7)))
        .await;
    assert_eq!(status, 201, "{image}");
    let digest = image["digest"].as_str().unwrap().to_string();
    let macs: Vec<String> = (1..=6).map(|i| format!("52-54-00-00-10-0{i}")).collect();
    for (i, mac) in macs.iter().enumerate() {
        let node = FakeNode::new(&server, mac);
        node.script().await; // discovered
        if i == 5 {
            continue;
        }
        server
            .label(mac, "rack", if i < 3 { "r1" } else { "r2" })
            .await;
        server.assign(mac, "demo:1.0").await;
        if i < 4 {
            let boot = node.boot_to_ready(&image).await;
            if i == 0 {
                heartbeat_with_gpus(&server, &node, &boot).await;
            }
        } else {
            let boot = node.boot().await;
            let artifacts = node.fetch_all(&boot).await;
            let (status, _) = node
                .attest(&boot, node.report(&boot, &image, &artifacts))
                .await;
            assert_eq!(status, 200);
            let mut seven = healthy();
            seven["gpus"].as_array_mut().unwrap().pop();
            let (status, verdict) = node.validate(&boot, seven).await;
            assert_eq!(
                (status, &verdict["passed"]),
                (200, &json!(false)),
                "{verdict}"
            );
        }
    }
    let failed_state = FakeNode::new(&server, &macs[4]).state().await;

    // The scrape-only token reads /metrics and nothing else.
    let r = server
        .http
        .get(server.url("/api/v1/nodes"))
        .bearer_auth(scrape_token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let (status, text) = scrape(&server, "/metrics", scrape_token).await;
    assert_eq!(status, 200, "{text}");
    let (status, gpu_text) = scrape(&server, "/metrics/gpus", scrape_token).await;
    assert_eq!(status, 200, "{gpu_text}");
    let prometheus = Prometheus::start(server.addr, scrape_token).await;
    prometheus.scrape_after_now().await;

    let v = |q: &'static str| {
        let p = &prometheus;
        async move { p.value(q).await }
    };
    assert_eq!(v(r#"up{job="bootfleet"}"#).await, Some(1.0));
    assert_eq!(v(r#"bootfleet_nodes{state="ready"}"#).await, Some(4.0));
    assert_eq!(v(r#"bootfleet_nodes{state="discovered"}"#).await, Some(1.0));
    let failed = prometheus
        .value(&format!(r#"bootfleet_nodes{{state="{failed_state}"}}"#))
        .await;
    assert_eq!(failed, Some(1.0), "the failed node is {failed_state}");
    assert_eq!(v("sum(bootfleet_nodes)").await, Some(6.0));
    assert_eq!(
        prometheus
            .value(&format!(r#"bootfleet_nodes_by_image{{image="{digest}"}}"#))
            .await,
        Some(5.0)
    );
    assert_eq!(
        v(r#"sum(bootfleet_nodes_by_group{key="rack",value="r1"})"#).await,
        Some(3.0)
    );
    assert_eq!(
        v(r#"bootfleet_nodes_by_group{key="rack",value="r2",state="ready"}"#).await,
        Some(1.0)
    );
    assert_eq!(
        v(r#"bootfleet_attestations_total{result="passed"}"#).await,
        Some(5.0)
    );
    assert_eq!(
        v(r#"bootfleet_validations_total{result="failed"}"#).await,
        Some(1.0)
    );
    assert_eq!(
        v(r#"bootfleet_validation_failures_total{check="gpu-count"}"#).await,
        Some(1.0)
    );
    for (phase, n) in [
        ("script", 5.0),
        ("kernel", 5.0),
        ("attest", 5.0),
        ("validate", 5.0),
        ("ready", 4.0),
    ] {
        let q = format!(r#"bootfleet_boot_phase_duration_seconds_count{{phase="{phase}"}}"#);
        assert_eq!(prometheus.value(&q).await, Some(n), "{phase}");
    }
    assert_eq!(
        v(r#"sum(bootfleet_node_transitions_total{to="ready"})"#).await,
        Some(4.0)
    );
    assert_eq!(
        v(r#"sum(bootfleet_http_requests_total{route="/boot/node.ipxe",code="2xx"})"#).await,
        Some(11.0),
        "six discoveries and five boots"
    );
    assert_eq!(
        v(r#"sum(bootfleet_http_requests_total{route="/api/v1/nodes",code="4xx"})"#).await,
        Some(1.0),
        "the scrape token refused on the admin API"
    );
    let blob_bytes = v(r#"bootfleet_http_response_bytes_total{route="/blobs/sha256/{hex}"}"#)
        .await
        .unwrap();
    assert!(blob_bytes >= 5.0 * 20_000.0, "{blob_bytes}");
    let webhook = format!("127.0.0.1:{silent}");
    let lag = prometheus
        .value(&format!(
            r#"bootfleet_webhook_lag_events{{webhook="{webhook}"}}"#
        ))
        .await;
    assert!(lag.is_some_and(|n| n >= 10.0), "{lag:?}");
    assert!(
        !text.contains("s3cret-path"),
        "a webhook's path is not shown"
    );
    // The GPUs of the node that sent readings, joined to their UUIDs as dcgm-exporter
    // names them.
    assert_eq!(
        v("count(bootfleet_gpu_temperature_celsius)").await,
        Some(8.0)
    );
    let uuid = healthy()["gpus"][2]["uuid"].as_str().unwrap().to_string();
    let joined = prometheus
        .query(r#"bootfleet_gpu_temperature_celsius * on (node, gpu) group_left (UUID) bootfleet_gpu_info"#)
        .await;
    let gpu2 = joined
        .iter()
        .find(|r| r["metric"]["UUID"] == uuid.as_str())
        .unwrap_or_else(|| panic!("{uuid} not in {joined:?}"));
    assert_eq!(gpu2["value"][1], "30");
    assert_eq!(v("sum(bootfleet_gpu_xids_total)").await, Some(1.0));
    // No alert fires on this fleet but the XID one, for that GPU.
    let alerts = prometheus.query(r#"ALERTS{alertstate="firing"}"#).await;
    let names: Vec<String> = alerts
        .iter()
        .map(|a| format!("{} {}", a["metric"]["alertname"], a["metric"]["gpu"]))
        .collect();
    assert!(
        names.iter().all(|n| n == r#""BootfleetGpuXid" "3""#),
        "{names:?}"
    );

    // Every query the dashboard and the rules ship names exported metrics and runs.
    let mut exported = exported_names(&text);
    exported.extend(exported_names(&gpu_text));
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(deploy("grafana/bootfleet.json")).unwrap())
            .unwrap();
    let mut exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().clone())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect();
    assert!(exprs.len() >= 15, "{}", exprs.len());
    let rules: Value = serde_yaml_rules(&deploy("prometheus/bootfleet.rules.yml"));
    exprs.extend(
        rules
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap().to_string()),
    );
    for expr in &exprs {
        let names = names_in(expr);
        assert!(!names.is_empty() || expr.contains("up{"), "{expr}");
        for name in names {
            assert!(
                exported.contains(&name),
                "{name} (in {expr}) is not exported"
            );
        }
        let runnable = expr
            .replace("$__rate_interval", "1m")
            .replace("$job", "bootfleet");
        prometheus.query(&runnable).await;
    }
}

/// The `expr` of every rule, read with Python's YAML (python3-yaml, as the Kubernetes
/// manifest's test does): no YAML parser among the crate's dependencies.
fn serde_yaml_rules(path: &Path) -> Value {
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import json,sys,yaml; d=yaml.safe_load(open(sys.argv[1])); \
             print(json.dumps([r['expr'] for g in d['groups'] for r in g['rules']]))",
        )
        .arg(path)
        .output()
        .expect("python3 runs (apt-get install python3-yaml)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The shipped rules and scrape config pass `promtool`: rules checked, their unit tests
/// (each alert fires on what it should and not before), the config valid.
#[test]
fn the_shipped_alert_rules_check_and_pass_their_unit_tests() {
    need(PROMTOOL);
    let run = |args: &[&str], dir: &Path| {
        let out = Command::new(PROMTOOL)
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let dir = deploy("prometheus");
    run(&["check", "rules", "bootfleet.rules.yml"], &dir);
    let tested = run(&["test", "rules", "bootfleet.rules.test.yml"], &dir);
    assert!(tested.contains("SUCCESS"), "{tested}");
    // The config names a token file that exists only where Prometheus runs: check a copy
    // pointing at one here.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("token"), "t").unwrap();
    let config = std::fs::read_to_string(dir.join("prometheus.yml"))
        .unwrap()
        .replace("/etc/prometheus/bootfleet.token", "token");
    std::fs::write(tmp.path().join("prometheus.yml"), config).unwrap();
    std::fs::copy(
        dir.join("bootfleet.rules.yml"),
        tmp.path().join("bootfleet.rules.yml"),
    )
    .unwrap();
    run(&["check", "config", "prometheus.yml"], tmp.path());
}

/// `/metrics` without a token is 401, with a wrong one 403, on the boot-only listener
/// it is not served; the text holds no token and no MAC.
#[tokio::test]
async fn metrics_need_a_token_and_show_no_secret_and_no_node() {
    let server = TestServer::start_configured(|cfg| {
        cfg.admin_listen = Some("127.0.0.1:0".parse().unwrap());
    })
    .await;
    let admin = server.admin_addr.unwrap();
    let http = &server.http;
    let get = |addr: std::net::SocketAddr, token: Option<&str>| {
        let mut r = http.get(format!("http://{addr}/metrics"));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        async move { r.send().await.unwrap() }
    };
    assert_eq!(get(admin, None).await.status(), 401);
    assert_eq!(
        get(admin, Some("wrong-token-but-long-enough"))
            .await
            .status(),
        403
    );
    assert_eq!(get(server.addr, Some(&server.token)).await.status(), 404);
    let node = FakeNode::new(&server, "52-54-00-00-20-01");
    node.script().await;
    let r = get(admin, Some(&server.token)).await;
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4")
    );
    let text = r.text().await.unwrap();
    assert!(
        text.contains("bootfleet_nodes{state=\"discovered\"} 1"),
        "{text}"
    );
    assert!(!text.contains(&server.token));
    assert!(!text.to_lowercase().contains("52:54:00:00:20:01"));
    assert!(!text.contains("52-54-00-00-20-01"));
}
