//! Deployment files: the systemd unit verifies, the Kubernetes manifest is a host-network
//! DaemonSet with probes, and its ConfigMap is a server config bootfleet accepts.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `program` from PATH, or a failure naming the Debian package that provides it.
fn tool(program: &str, package: &str) -> Command {
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()));
    assert!(
        found,
        "`{program}` is not installed: install the Debian package `{package}` \
         (scripts/test does, as root)"
    );
    Command::new(program)
}

/// Every document of deploy/kubernetes/bootfleet.yaml, read by PyYAML (no YAML crate here).
fn manifest() -> Vec<Value> {
    let path = root().join("deploy/kubernetes/bootfleet.yaml");
    // Debian's interpreter, where python3-yaml installs (a pyenv python3 may come first
    // on PATH and not see it).
    assert!(
        Path::new("/usr/bin/python3").is_file(),
        "/usr/bin/python3 is missing: install the Debian package `python3-yaml`"
    );
    let out = Command::new("/usr/bin/python3")
        .args([
            "-c",
            "import yaml, json, sys; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(&path)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "python3 could not load {} (PyYAML is the Debian package `python3-yaml`): {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let docs: Vec<Value> = serde_json::from_slice(&out.stdout).expect("PyYAML's JSON");
    // An empty document (a stray `---`) is null; kubectl skips it, so do we.
    docs.into_iter().filter(|d| !d.is_null()).collect()
}

/// The one document of `kind`.
fn only<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<_> = docs.iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(
        found.len(),
        1,
        "one {kind} in the manifest, found {}",
        found.len()
    );
    found[0]
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// The unit's ExecStart binary, so that `verify` can check it exists and is executable.
const INSTALLED_BINARY: &str = "/usr/local/bin/bootfleet";

/// `systemd-analyze verify` accepts deploy/systemd/bootfleet.service with no warning.
#[test]
fn the_systemd_unit_verifies() {
    let unit = std::fs::read_to_string(root().join("deploy/systemd/bootfleet.service")).unwrap();
    let exec_start = format!("ExecStart={INSTALLED_BINARY} ");
    assert_eq!(
        unit.lines().filter(|l| l.starts_with(&exec_start)).count(),
        1,
        "the unit runs {INSTALLED_BINARY} (one ExecStart line)"
    );
    for needed in [
        "--data-dir /var/lib/bootfleet serve --config /etc/bootfleet/bootfleet.toml",
        "\nUser=bootfleet\n",
        "\nStateDirectory=bootfleet\n",
        "CAP_NET_BIND_SERVICE",
        "\nNoNewPrivileges=yes\n",
        "\nProtectSystem=strict\n",
        "\nKillSignal=SIGTERM\n",
        "\nRestart=on-failure\n",
    ] {
        assert!(unit.contains(needed), "the unit has {needed:?}");
    }
    // verify fails when ExecStart's binary is missing: point it at the one cargo built.
    // (An unknown User= is not checked, so the bootfleet user need not exist here.)
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("bootfleet.service");
    let built = format!("ExecStart={} ", env!("CARGO_BIN_EXE_bootfleet"));
    std::fs::write(&copy, unit.replace(&exec_start, &built)).unwrap();
    let out = tool("systemd-analyze", "systemd")
        .arg("verify")
        .arg(&copy)
        .output()
        .expect("run systemd-analyze");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "systemd-analyze verify failed ({}): {stderr}",
        out.status
    );
    // Unknown keys and unparsable values are only warnings (exit 0): refuse them too.
    assert!(
        stderr.trim().is_empty(),
        "systemd-analyze verify warned about the unit: {stderr}"
    );
}

/// The node agent's unit (installed into imported images, or by an image's Containerfile)
/// verifies, runs the agent on bootfleet's boots only, after the network, restarting on
/// failure; it is the one the import embeds.
#[test]
fn the_agent_unit_verifies() {
    let path = root().join("deploy/systemd/bootfleet-agent.service");
    let unit = std::fs::read_to_string(&path).unwrap();
    for needed in [
        "\nExecStart=/usr/local/bin/bootfleet-agent\n",
        "\nConditionKernelCommandLine=bootfleet.server\n",
        "\nAfter=network-online.target\n",
        "\nRestart=on-failure\n",
        "\nWantedBy=multi-user.target\n",
    ] {
        assert!(unit.contains(needed), "the agent unit has {needed:?}");
    }
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("bootfleet-agent.service");
    let built = format!("\nExecStart={}\n", env!("CARGO_BIN_EXE_bootfleet-agent"));
    std::fs::write(
        &copy,
        unit.replace("\nExecStart=/usr/local/bin/bootfleet-agent\n", &built),
    )
    .unwrap();
    let out = tool("systemd-analyze", "systemd")
        .arg("verify")
        .arg(&copy)
        .output()
        .expect("run systemd-analyze");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.trim().is_empty(),
        "systemd-analyze verify: {stderr}"
    );
}

/// The manifest has a Namespace, a ConfigMap and a DaemonSet on the host network of the
/// boot-segment nodes, with /healthz and /readyz probes, the low-port capability, the
/// systemd unit's command line and only declared volumes mounted.
#[test]
fn the_kubernetes_manifest_is_a_host_network_daemonset_with_probes() {
    let docs = manifest();
    for kind in ["Namespace", "ConfigMap", "DaemonSet"] {
        only(&docs, kind);
    }
    let spec = &only(&docs, "DaemonSet")["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"], true, "DHCP needs the host's network");
    assert_eq!(
        spec["dnsPolicy"], "ClusterFirstWithHostNet",
        "cluster names resolve on the host network"
    );
    assert_eq!(
        spec["nodeSelector"]["bootfleet.io/boot-segment"], "true",
        "only boot-segment nodes run a server"
    );
    let containers = spec["containers"].as_array().expect("containers");
    let server = containers
        .iter()
        .find(|c| c["name"] == "bootfleet")
        .expect("a container named bootfleet");
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let get = &server[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe} asks {path}");
        assert_eq!(get["port"], 8080, "{probe} asks port 8080");
    }
    let added = strings(&server["securityContext"]["capabilities"]["add"]);
    assert!(
        added.contains(&"NET_BIND_SERVICE"),
        "DHCP and TFTP bind ports below 1024: capabilities.add is {added:?}"
    );
    let args = strings(&server["args"]);
    assert_eq!(
        args,
        [
            "--data-dir",
            "/var/lib/bootfleet",
            "serve",
            "--config",
            "/etc/bootfleet/bootfleet.toml"
        ],
        "the same command line as the systemd unit"
    );
    let volumes: Vec<&str> = spec["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    let init = spec["initContainers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for container in containers.iter().chain(&init) {
        for mount in container["volumeMounts"].as_array().into_iter().flatten() {
            let name = mount["name"].as_str().unwrap_or("(no name)");
            assert!(
                volumes.contains(&name),
                "container {} mounts {name}, which is not among the volumes {volumes:?}",
                container["name"]
            );
        }
    }
    let config_mount = server["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["mountPath"] == "/etc/bootfleet/bootfleet.toml");
    assert!(
        config_mount.is_some(),
        "something is mounted where --config reads"
    );
}

/// The ConfigMap's bootfleet.toml parses as a server config on PostgreSQL, S3 and
/// proxyDHCP, and the per-node server_ip comes from the environment.
#[test]
fn the_kubernetes_config_map_is_a_valid_server_config() {
    let docs = manifest();
    let map = only(&docs, "ConfigMap");
    assert_eq!(map["metadata"]["name"], "bootfleet-config");
    let text = map["data"]["bootfleet.toml"]
        .as_str()
        .expect("the ConfigMap holds bootfleet.toml");
    let path = Path::new("deploy/kubernetes/bootfleet.yaml#bootfleet.toml");
    let cfg = bootfleet::config::FileConfig::parse(text, path).unwrap_or_else(|e| panic!("{e}"));
    let store = cfg.store.url.as_deref().unwrap_or("(unset)");
    assert!(
        store.starts_with("postgres://"),
        "servers share PostgreSQL: [store] url is {store}"
    );
    assert!(cfg.store.password_file.is_some(), "[store] password_file");
    let blobs = cfg.blobs.url.as_deref().unwrap_or("(unset)");
    assert!(
        blobs.starts_with("s3://"),
        "servers share an object store: [blobs] url is {blobs}"
    );
    assert!(cfg.blobs.endpoint.is_some(), "[blobs] endpoint");
    assert_eq!(cfg.dhcp.mode, Some(bootfleet::dhcp::decide::Mode::Proxy));
    assert_eq!(cfg.tftp.listen, Some("0.0.0.0:69".parse().unwrap()));
    // The secrets it names are where the DaemonSet mounts them.
    let mounts: Vec<PathBuf> = only(&docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| c["volumeMounts"].as_array().cloned().unwrap_or_default())
        .filter_map(|m| m["mountPath"].as_str().map(PathBuf::from))
        .collect();
    let files = [
        cfg.admin_token_file.clone(),
        cfg.store.password_file.clone(),
        cfg.blobs.credentials_file.clone(),
    ];
    for file in files.iter().flatten() {
        assert!(
            mounts.iter().any(|m| file.starts_with(m)),
            "{} is under no mount of the DaemonSet ({mounts:?})",
            file.display()
        );
    }
    // server_ip (required for proxy mode) is per node: the server's environment sets it.
    let server = &only(&docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0];
    let env = server["env"].as_array().cloned().unwrap_or_default();
    let server_ip = env
        .iter()
        .find(|e| e["name"] == "BOOTFLEET_DHCP_SERVER_IP")
        .unwrap_or_else(|| panic!("BOOTFLEET_DHCP_SERVER_IP is not set: {env:?}"));
    assert_eq!(
        server_ip["valueFrom"]["fieldRef"]["fieldPath"], "status.hostIP",
        "{server_ip}"
    );
    let over = bootfleet::config::Overrides {
        dhcp_server_ip: Some("10.0.0.1".parse().unwrap()),
        ..Default::default()
    };
    let resolved = bootfleet::config::ServerConfig::resolve(cfg, over);
    assert_eq!(resolved.dhcp.server_ip, Some("10.0.0.1".parse().unwrap()));
}
