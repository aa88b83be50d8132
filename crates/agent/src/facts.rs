//! System facts, read from /proc and /sys under a root directory (`/` on a node, a
//! recorded tree in tests): kernel, command line, OS, modules with versions, the NVIDIA
//! driver, OFED, InfiniBand ports and NICs. Raw readings; nothing is judged here.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IbPort {
    pub device: String,
    pub port: String,
    /// `4: ACTIVE`
    pub state: String,
    /// `400 Gb/sec (4X NDR)`
    pub rate: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Nic {
    pub name: String,
    pub mac: String,
    pub operstate: String,
    pub speed_mbps: Option<i64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SystemFacts {
    pub kernel_release: String,
    pub cmdline: String,
    /// `/etc/os-release` keys (ID, VERSION_ID, PRETTY_NAME...).
    pub os_release: BTreeMap<String, String>,
    /// Loaded modules and their versions ("" when a module has none).
    pub modules: BTreeMap<String, String>,
    /// Versions by the manifest's pin names: `nvidia-driver`, `ofed`, `cuda`.
    pub versions: BTreeMap<String, String>,
    pub ib_ports: Vec<IbPort>,
    pub nics: Vec<Nic>,
}

fn read(root: &Path, path: &str) -> Option<String> {
    std::fs::read_to_string(root.join(path)).ok()
}

fn trimmed(root: &Path, path: &str) -> Option<String> {
    read(root, path).map(|s| s.trim().to_string())
}

fn dir_names(root: &Path, path: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root.join(path))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// The version in `/proc/driver/nvidia/version`:
/// `NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.127.05  Tue Oct  8 ...`.
pub fn nvidia_driver_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    line.split_whitespace()
        .find(|w| {
            w.split('.').count() >= 2
                && w.split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string)
}

fn os_release(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().trim_matches('"').to_string()))
        .collect()
}

/// `{"cuda": {"version": "12.4.1"}}` in `/usr/local/cuda/version.json`.
pub fn cuda_version(text: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    Some(v.get("cuda")?.get("version")?.as_str()?.to_string())
}

/// `400 Gb/sec (4X NDR)` as 400.0.
fn rate_gbps(text: &str) -> Option<f64> {
    text.split_whitespace().next()?.parse().ok()
}

/// `400 Gb/sec (4X NDR)` as `4X`.
fn width(text: &str) -> Option<String> {
    let inner = text.split_once('(')?.1.trim_end_matches(')');
    let w = inner.split_whitespace().next()?;
    w.ends_with('X').then(|| w.to_string())
}

/// Each InfiniBand port's state, rate and error counters for a heartbeat; a reading that
/// cannot be taken is named in `missing`, never left looking healthy.
pub fn ib_samples(root: &Path) -> Vec<bootfleet_api::agent::IbPortSample> {
    let mut out = Vec::new();
    for device in dir_names(root, "sys/class/infiniband") {
        for port in dir_names(root, &format!("sys/class/infiniband/{device}/ports")) {
            let base = format!("sys/class/infiniband/{device}/ports/{port}");
            let mut missing = Vec::new();
            let mut text = |name: &str, path: &str| {
                let v = trimmed(root, &format!("{base}/{path}"));
                if v.is_none() {
                    missing.push(name.to_string());
                }
                v
            };
            // `4: ACTIVE`: the word after the number.
            let state =
                text("state", "state").map(|s| s.rsplit(' ').next().unwrap_or(&s).to_string());
            let rate = text("rate", "rate");
            let mut count = |name: &str| text(name, &format!("counters/{name}"))?.parse().ok();
            let link_downed = count("link_downed");
            let symbol_errors = count("symbol_error");
            let link_error_recovery = count("link_error_recovery");
            let rcv_errors = count("port_rcv_errors");
            out.push(bootfleet_api::agent::IbPortSample {
                port: format!("{device}/{port}"),
                state,
                rate_gbps: rate.as_deref().and_then(rate_gbps),
                width: rate.as_deref().and_then(width),
                link_downed,
                symbol_errors,
                link_error_recovery,
                rcv_errors,
                missing,
                node_guid: None,
                peer: None,
            });
        }
    }
    out
}

/// Each port's HCA node GUID (sysfs `node_guid`), for validation: the declared
/// topology knows ports by it. Heartbeats go without (it does not change).
pub fn ib_node_guids(root: &Path, samples: &mut [bootfleet_api::agent::IbPortSample]) {
    for s in samples {
        let device = s.port.split('/').next().unwrap_or_default();
        s.node_guid = trimmed(root, &format!("sys/class/infiniband/{device}/node_guid"))
            .and_then(|g| super::ib_peers::guid(&g));
        if s.node_guid.is_none() {
            s.missing.push("node_guid".into());
        }
    }
}

pub fn collect(root: &Path) -> SystemFacts {
    let mut modules = BTreeMap::new();
    for line in read(root, "proc/modules").unwrap_or_default().lines() {
        if let Some(name) = line.split_whitespace().next() {
            let version = trimmed(root, &format!("sys/module/{name}/version")).unwrap_or_default();
            modules.insert(name.to_string(), version);
        }
    }
    let mut versions = BTreeMap::new();
    if let Some(v) =
        read(root, "proc/driver/nvidia/version").and_then(|t| nvidia_driver_version(&t))
    {
        versions.insert("nvidia-driver".to_string(), v);
    }
    // MLNX_OFED stamps its version on mlx5_core; inbox drivers have none.
    if let Some(v) = trimmed(root, "sys/module/mlx5_core/version").filter(|v| !v.is_empty()) {
        versions.insert("ofed".to_string(), v);
    }
    // The CUDA toolkit's own record of its version (what an image import pins).
    if let Some(v) = read(root, "usr/local/cuda/version.json").and_then(|t| cuda_version(&t)) {
        versions.insert("cuda".to_string(), v);
    }
    let mut ib_ports = Vec::new();
    for device in dir_names(root, "sys/class/infiniband") {
        for port in dir_names(root, &format!("sys/class/infiniband/{device}/ports")) {
            let base = format!("sys/class/infiniband/{device}/ports/{port}");
            ib_ports.push(IbPort {
                state: trimmed(root, &format!("{base}/state")).unwrap_or_default(),
                rate: trimmed(root, &format!("{base}/rate")).unwrap_or_default(),
                device: device.clone(),
                port,
            });
        }
    }
    let nics = dir_names(root, "sys/class/net")
        .into_iter()
        .filter(|n| n != "lo")
        .map(|name| {
            let base = format!("sys/class/net/{name}");
            Nic {
                mac: trimmed(root, &format!("{base}/address")).unwrap_or_default(),
                operstate: trimmed(root, &format!("{base}/operstate")).unwrap_or_default(),
                speed_mbps: trimmed(root, &format!("{base}/speed")).and_then(|s| s.parse().ok()),
                name,
            }
        })
        .collect();
    SystemFacts {
        kernel_release: trimmed(root, "proc/sys/kernel/osrelease").unwrap_or_default(),
        cmdline: trimmed(root, "proc/cmdline").unwrap_or_default(),
        os_release: os_release(&read(root, "etc/os-release").unwrap_or_default()),
        modules,
        versions,
        ib_ports,
        nics,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_versions_as_the_driver_prints_them() {
        let proprietary = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.127.05  Tue Oct  8 03:22:07 UTC 2024\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n";
        assert_eq!(
            nvidia_driver_version(proprietary).as_deref(),
            Some("550.127.05")
        );
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  560.35.03  Release Build  (dvs-builder@U16-I3-B03-4-3)  Fri Aug 16 21:42:42 UTC 2024\n";
        assert_eq!(nvidia_driver_version(open).as_deref(), Some("560.35.03"));
        assert_eq!(nvidia_driver_version("garbage"), None);
    }

    #[test]
    fn a_recorded_tree_is_read_whole() {
        let root = tempfile::tempdir().unwrap();
        let w = |p: &str, s: &str| {
            let path = root.path().join(p);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, s).unwrap();
        };
        w("proc/sys/kernel/osrelease", "6.1.0-28-cloud-amd64\n");
        w("proc/cmdline", "console=ttyS0 bootfleet.boot=b1\n");
        w(
            "proc/modules",
            "nvidia 54001664 2 - Live 0x0000000000000000 (POE)\nmlx5_core 2048000 0 - Live 0x0\n",
        );
        w("sys/module/nvidia/version", "550.127.05\n");
        w("sys/module/mlx5_core/version", "24.10-1.1.4\n");
        w(
            "proc/driver/nvidia/version",
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.127.05  Tue Oct  8 2024\n",
        );
        w("etc/os-release", "ID=debian\nVERSION_ID=\"12\"\n");
        w(
            "usr/local/cuda/version.json",
            r#"{"cuda": {"name": "CUDA SDK", "version": "12.4.1"}}"#,
        );
        w("sys/class/infiniband/mlx5_0/ports/1/state", "4: ACTIVE\n");
        w(
            "sys/class/infiniband/mlx5_0/ports/1/rate",
            "400 Gb/sec (4X NDR)\n",
        );
        w("sys/class/net/eth0/address", "52:54:00:12:34:56\n");
        w("sys/class/net/eth0/operstate", "up\n");
        w("sys/class/net/eth0/speed", "100000\n");
        let f = collect(root.path());
        assert_eq!(f.kernel_release, "6.1.0-28-cloud-amd64");
        assert_eq!(f.modules["nvidia"], "550.127.05");
        assert_eq!(f.versions["nvidia-driver"], "550.127.05");
        assert_eq!(f.versions["ofed"], "24.10-1.1.4");
        assert_eq!(f.versions["cuda"], "12.4.1");
        assert_eq!(f.os_release["VERSION_ID"], "12");
        assert_eq!(f.ib_ports[0].state, "4: ACTIVE");
        assert_eq!(f.nics[0].speed_mbps, Some(100_000));
        // The heartbeat's port readings: what is there, and what is not, by name.
        w(
            "sys/class/infiniband/mlx5_0/ports/1/counters/link_downed",
            "3\n",
        );
        w(
            "sys/class/infiniband/mlx5_0/ports/1/counters/symbol_error",
            "0\n",
        );
        let p = &ib_samples(root.path())[0];
        assert_eq!(p.port, "mlx5_0/1");
        assert_eq!(p.state.as_deref(), Some("ACTIVE"));
        assert_eq!((p.rate_gbps, p.width.as_deref()), (Some(400.0), Some("4X")));
        assert_eq!(p.link_downed, Some(3));
        assert_eq!(p.missing, ["link_error_recovery", "port_rcv_errors"]);
        assert_eq!(collect(Path::new("/nonexistent")), SystemFacts::default());
    }
}
