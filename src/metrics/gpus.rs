//! Each GPU's newest readings from heartbeats, for `/metrics/gpus`: kept in memory per
//! node (a restarted server shows a node again at its next heartbeat), dropped when its
//! node has been silent `STALE_MS`. Value series are keyed by `node` (the MAC: hostnames
//! may repeat) and `gpu` (the index); `bootfleet_gpu_info` joins them to dcgm-exporter's
//! label names (`Hostname`, `UUID`, `modelName`, `pci_bus_id`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::api::Mac;
use crate::api::agent::GpuSample;

/// A node silent this long (several heartbeat intervals) drops out of the export.
pub const STALE_MS: i64 = 5 * 60_000;
/// GPUs kept per node; a heartbeat may not name more.
pub const MAX_GPUS_PER_NODE: usize = 64;
/// Nodes kept; past it, new nodes are not shown until stale ones go.
pub const MAX_NODES: usize = 200_000;
/// The longest UUID, model name or PCI address kept; a longer one is cut.
const MAX_TEXT: usize = 96;

/// Model names shared at most: past this many, a new one is kept per GPU.
const MAX_MODELS: usize = 64;

/// One node's GPUs as its newest heartbeat reported them.
#[derive(Debug)]
pub struct NodeGpus {
    pub node: String,
    pub hostname: String,
    pub at_ms: i64,
    pub gpus: Box<[GpuKept]>,
}

/// One GPU as the export shows it: its labels and its readings. Kept per GPU of the
/// fleet, so compact (heaptrack at 10,000 8-GPU nodes: the `GpuSample`s this replaced
/// were ~3 KiB a node, four allocations a GPU): the readings as numbers in `SERIES`
/// order, the model name shared by every GPU of the model.
#[derive(Debug)]
pub struct GpuKept {
    pub index: u32,
    pub uuid: Box<str>,
    pub name: Arc<str>,
    pub pci_bus_id: Option<Box<str>>,
    /// In `SERIES` order; NaN where the heartbeat had no reading.
    readings: [f64; SERIES.len()],
}

impl GpuKept {
    /// The reading of `SERIES[i]`, if the heartbeat had one.
    fn reading(&self, i: usize) -> Option<f64> {
        Some(self.readings[i]).filter(|v| !v.is_nan())
    }
}

#[derive(Default)]
pub struct GpuTelemetry {
    nodes: Mutex<HashMap<Mac, Arc<NodeGpus>>>,
    /// Model names seen, each kept once (`MAX_MODELS`).
    models: Mutex<HashMap<Box<str>, Arc<str>>>,
}

fn cut(s: &str) -> String {
    s.chars().take(MAX_TEXT).collect()
}

impl GpuTelemetry {
    /// Keeps `gpus` as the node's readings now; an empty list forgets the node's.
    pub fn record(&self, mac: Mac, hostname: Option<&str>, gpus: &[GpuSample], now_ms: i64) {
        let mut nodes = self.nodes.lock().expect("not poisoned");
        if gpus.is_empty() {
            nodes.remove(&mac);
            return;
        }
        if nodes.len() >= MAX_NODES && !nodes.contains_key(&mac) {
            nodes.retain(|_, n| now_ms - n.at_ms < STALE_MS);
            if nodes.len() >= MAX_NODES {
                return;
            }
        }
        let gpus = gpus
            .iter()
            .take(MAX_GPUS_PER_NODE)
            .map(|g| GpuKept {
                index: g.index,
                uuid: cut(&g.uuid).into(),
                name: self.model(&g.name),
                pci_bus_id: g.pci_bus_id.as_deref().map(|p| cut(p).into()),
                readings: std::array::from_fn(|i| (SERIES[i].3)(g).unwrap_or(f64::NAN)),
            })
            .collect();
        let node = NodeGpus {
            node: mac.to_string(),
            hostname: cut(hostname.unwrap_or("")),
            at_ms: now_ms,
            gpus,
        };
        nodes.insert(mac, Arc::new(node));
    }

    /// `name`, cut, shared with every GPU of the model.
    fn model(&self, name: &str) -> Arc<str> {
        let name = cut(name);
        let mut models = self.models.lock().expect("not poisoned");
        if let Some(kept) = models.get(name.as_str()) {
            return kept.clone();
        }
        let kept: Arc<str> = name.as_str().into();
        if models.len() < MAX_MODELS {
            models.insert(name.into(), kept.clone());
        }
        kept
    }

    /// The nodes heard from within `STALE_MS`, by MAC; the stale ones are forgotten.
    pub fn snapshot(&self, now_ms: i64) -> Vec<Arc<NodeGpus>> {
        let mut nodes = self.nodes.lock().expect("not poisoned");
        nodes.retain(|_, n| now_ms - n.at_ms < STALE_MS);
        let mut out: Vec<Arc<NodeGpus>> = nodes.values().cloned().collect();
        drop(nodes);
        out.sort_by(|a, b| a.node.cmp(&b.node));
        out
    }
}

/// The export of a snapshot, streamed family by family (no per-series map is built).
#[derive(Debug)]
pub struct GpuFamilies(pub Vec<Arc<NodeGpus>>);

type Reading = fn(&GpuSample) -> Option<f64>;

/// The value series: name, help, type, reading (taken when the heartbeat is recorded).
const SERIES: [(&str, &str, MetricType, Reading); 11] = [
    (
        "bootfleet_gpu_temperature_celsius",
        "GPU temperature (dcgm-exporter DCGM_FI_DEV_GPU_TEMP)",
        MetricType::Gauge,
        |g| g.temperature_c.map(f64::from),
    ),
    (
        "bootfleet_gpu_power_watts",
        "GPU power draw (dcgm-exporter DCGM_FI_DEV_POWER_USAGE)",
        MetricType::Gauge,
        |g| g.power_w,
    ),
    (
        "bootfleet_gpu_ecc_corrected_errors",
        "Corrected ECC errors over the GPU's life (NVML aggregate)",
        MetricType::Counter,
        |g| g.ecc.map(|e| e.aggregate_corrected as f64),
    ),
    (
        "bootfleet_gpu_ecc_uncorrected_errors",
        "Uncorrected ECC errors over the GPU's life (NVML aggregate)",
        MetricType::Counter,
        |g| g.ecc.map(|e| e.aggregate_uncorrected as f64),
    ),
    (
        "bootfleet_gpu_xids",
        "XIDs the kernel logged for the GPU since its node booted",
        MetricType::Counter,
        |g| Some(g.xids as f64),
    ),
    (
        "bootfleet_gpu_sm_clock_mhz",
        "SM clock (dcgm-exporter DCGM_FI_DEV_SM_CLOCK)",
        MetricType::Gauge,
        |g| g.sm_clock_mhz.map(f64::from),
    ),
    (
        "bootfleet_gpu_sm_clock_max_mhz",
        "The SM clock's maximum",
        MetricType::Gauge,
        |g| g.sm_clock_max_mhz.map(f64::from),
    ),
    (
        "bootfleet_gpu_throttle_reasons",
        "Clock throttle reasons active now, how many (dcgm-exporter DCGM_FI_DEV_CLOCK_THROTTLE_REASONS is the mask)",
        MetricType::Gauge,
        |g| g.throttle_reasons.as_ref().map(|r| r.len() as f64),
    ),
    (
        "bootfleet_gpu_pcie_replays",
        "PCIe replays since the driver loaded (dcgm-exporter DCGM_FI_DEV_PCIE_REPLAY_COUNTER)",
        MetricType::Counter,
        |g| g.pcie_replay.map(|v| v as f64),
    ),
    (
        "bootfleet_gpu_nvlink_errors",
        "NVLink errors over the GPU's links: CRC flit and data, replay, recovery",
        MetricType::Counter,
        |g| g.nvlink_errors.map(|v| v as f64),
    ),
    (
        "bootfleet_gpu_rows_remapped_uncorrectable",
        "Rows remapped for uncorrectable errors (dcgm-exporter DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS)",
        MetricType::Counter,
        |g| g.row_remap.map(|r| r.uncorrectable as f64),
    ),
];

impl Collector for GpuFamilies {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut buf = itoa::Buffer::new();
        {
            let mut family = encoder.encode_descriptor(
                "bootfleet_gpu_info",
                "Each GPU reporting, 1; its labels name it as dcgm-exporter does",
                None,
                MetricType::Gauge,
            )?;
            for n in &self.0 {
                for g in &n.gpus {
                    let labels = [
                        ("node", n.node.as_str()),
                        ("gpu", buf.format(g.index)),
                        ("Hostname", n.hostname.as_str()),
                        ("UUID", &*g.uuid),
                        ("modelName", &*g.name),
                        ("pci_bus_id", g.pci_bus_id.as_deref().unwrap_or("")),
                    ];
                    ConstGauge::new(1i64).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        for (i, (name, help, kind, _)) in SERIES.into_iter().enumerate() {
            let mut family = encoder.encode_descriptor(name, help, None, kind)?;
            for n in &self.0 {
                for g in &n.gpus {
                    let Some(v) = g.reading(i) else { continue };
                    let labels = [("node", n.node.as_str()), ("gpu", buf.format(g.index))];
                    let metric = family.encode_family(&labels)?;
                    match kind {
                        MetricType::Counter => ConstCounter::new(v as u64).encode(metric)?,
                        _ => ConstGauge::new(v).encode(metric)?,
                    }
                }
            }
        }
        Ok(())
    }
}

/// `/metrics/gpus` as text.
pub fn encode(snapshot: Vec<Arc<NodeGpus>>) -> String {
    let gpus: usize = snapshot.iter().map(|n| n.gpus.len()).sum();
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(GpuFamilies(snapshot)));
    let mut out = String::with_capacity(64 + gpus * 420);
    prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
        .expect("writing to a String cannot fail");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(index: u32) -> GpuSample {
        GpuSample {
            index,
            uuid: format!("GPU-{index}"),
            name: "NVIDIA H100 80GB HBM3".into(),
            pci_bus_id: Some("00000000:18:00.0".into()),
            temperature_c: Some(40),
            power_w: Some(70.5),
            ecc: None,
            xids: 1,
            ..Default::default()
        }
    }

    #[test]
    fn fresh_nodes_are_exported_and_stale_ones_dropped() {
        let t = GpuTelemetry::default();
        let a = Mac::from([0, 0, 0, 0, 0, 1]);
        let b = Mac::from([0, 0, 0, 0, 0, 2]);
        t.record(a, Some("gpu-a"), &[sample(0), sample(12)], 1_000);
        t.record(b, None, &[sample(0)], 1_000 - STALE_MS);
        let text = encode(t.snapshot(1_000));
        assert!(
            text.contains(
                r#"bootfleet_gpu_temperature_celsius{node="00:00:00:00:00:01",gpu="12"} 40"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"Hostname="gpu-a",UUID="GPU-0",modelName="NVIDIA H100 80GB HBM3""#),
            "{text}"
        );
        assert!(
            text.contains(r#"bootfleet_gpu_xids_total{node="00:00:00:00:00:01",gpu="0"} 1"#),
            "{text}"
        );
        // No ECC reading: no ECC series (missing is not zero).
        assert!(
            !text.contains("bootfleet_gpu_ecc_corrected_errors_total{"),
            "{text}"
        );
        assert!(
            !text.contains("00:00:00:00:00:02"),
            "the stale node is gone"
        );
        t.record(a, None, &[], 2_000);
        assert!(
            t.snapshot(2_000).is_empty(),
            "an empty report forgets the node"
        );
    }

    #[test]
    fn a_heartbeat_cannot_grow_memory_past_the_caps() {
        let t = GpuTelemetry::default();
        let mut many: Vec<GpuSample> = (0..1000).map(sample).collect();
        many[0].uuid = "x".repeat(10_000);
        t.record(
            Mac::from([0, 0, 0, 0, 0, 1]),
            Some(&"h".repeat(10_000)),
            &many,
            0,
        );
        let s = t.snapshot(0);
        assert_eq!(s[0].gpus.len(), MAX_GPUS_PER_NODE);
        assert_eq!(s[0].gpus[0].uuid.len(), MAX_TEXT);
        assert_eq!(s[0].hostname.len(), MAX_TEXT);
        // One model name kept for every GPU of the model, and no more than MAX_MODELS.
        assert!(Arc::ptr_eq(&s[0].gpus[0].name, &s[0].gpus[1].name));
        let mut models: Vec<GpuSample> = (0..200).map(sample).collect();
        for (i, g) in models.iter_mut().enumerate() {
            g.name = format!("model {i}");
        }
        t.record(Mac::from([0, 0, 0, 0, 0, 2]), None, &models[..64], 0);
        t.record(Mac::from([0, 0, 0, 0, 0, 3]), None, &models[64..128], 0);
        assert_eq!(t.models.lock().unwrap().len(), MAX_MODELS);
    }
}
