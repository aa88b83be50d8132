//! Post-boot validation judgement, pure: do the GPUs, driver, XIDs and checks the agent
//! reports meet the image's `[validation]` section and pins? "Node Ready" is not "GPU
//! Ready": every failure is named, per GPU where it concerns one, and a node is ready only
//! when none remains. The agent reports raw readings; every threshold is decided here.

use std::collections::BTreeSet;

use crate::api::agent::pci_bus_key;
use crate::api::agent::{Failure, GpuFacts, ValidationReport, ValidationVerdict};
use crate::image::manifest::ValidationSpec;

/// XIDs that mean the GPU is not fit for work until reset or replaced: 48 (double-bit
/// ECC), 63/64 (row remapping event/failure), 74 (NVLink error), 79 (fell off the bus),
/// 94/95 (contained/uncontained ECC error).
pub const DEFAULT_FATAL_XIDS: [u32; 7] = [48, 63, 64, 74, 79, 94, 95];
pub const DEFAULT_MAX_TEMPERATURE_C: u64 = 85;

/// What `[validation]` asks for, with defaults; read from the manifest's JSON form.
#[derive(Debug, Clone, PartialEq)]
pub struct Expectations {
    pub gpus: u64,
    pub gpu_model: Option<String>,
    pub min_memory_mib: Option<u64>,
    pub pcie_gen: Option<u64>,
    pub pcie_width: Option<u64>,
    /// Active NVLinks each GPU must have (when set); and every reported link must be up.
    pub nvlinks: Option<u64>,
    pub ecc_required: bool,
    pub max_temperature_c: u64,
    pub fatal_xids: BTreeSet<u32>,
    /// DCGM diag level required (its results must be present and pass).
    pub dcgm_level: Option<u64>,
    /// InfiniBand: ports up, each one's least rate (Gb/s) and its width.
    pub ib_ports: Option<u64>,
    pub ib_rate_gbps: Option<u64>,
    pub ib_width: Option<String>,
    /// The pinned driver (`[pins] nvidia-driver`).
    pub driver: Option<String>,
}

impl Expectations {
    /// The manifest's typed `[validation]` with the defaults filled in, and the pinned
    /// driver.
    pub fn from_manifest(
        spec: &ValidationSpec,
        pins: &std::collections::BTreeMap<String, String>,
    ) -> Self {
        let gpus = spec.gpus.unwrap_or(0);
        Self {
            gpus,
            gpu_model: spec.gpu_model.clone(),
            min_memory_mib: spec.min_gpu_memory_mib,
            pcie_gen: spec.pcie_gen,
            pcie_width: spec.pcie_width,
            nvlinks: spec.nvlinks,
            ecc_required: spec.ecc.unwrap_or(gpus > 0),
            max_temperature_c: spec.max_temperature_c.unwrap_or(DEFAULT_MAX_TEMPERATURE_C),
            fatal_xids: spec
                .fatal_xids
                .as_ref()
                .map(|x| x.iter().copied().collect())
                .unwrap_or_else(|| DEFAULT_FATAL_XIDS.into_iter().collect()),
            dcgm_level: spec.dcgm_level,
            ib_ports: spec.ib_ports,
            ib_rate_gbps: spec.ib_rate_gbps,
            ib_width: spec.ib_width.clone(),
            driver: pins.get("nvidia-driver").cloned(),
        }
    }
}

/// Failures as the checks find them.
#[derive(Default)]
struct Findings(Vec<Failure>);

impl Findings {
    fn fail(&mut self, check: &str, gpu: Option<u32>, reason: String) {
        self.0.push(Failure {
            check: check.into(),
            gpu,
            reason,
        });
    }
}

pub fn judge(report: &ValidationReport, want: &Expectations) -> ValidationVerdict {
    let mut found = Findings::default();
    node_checks(report, want, &mut found);
    for gpu in &report.gpus {
        gpu_identity(gpu, want, &mut found);
        gpu_link(gpu, want, &mut found);
        gpu_memory_health(gpu, want, &mut found);
    }
    xid_checks(report, want, &mut found);
    diagnostics(report, want, &mut found);
    fabric(report, want, &mut found);
    ValidationVerdict {
        passed: found.0.is_empty(),
        failures: found.0,
    }
}

/// NVML reachable, the GPU count, the pinned driver.
fn node_checks(report: &ValidationReport, want: &Expectations, found: &mut Findings) {
    if want.gpus > 0
        && let Some(e) = &report.nvml_error
    {
        found.fail("nvml", None, e.clone());
    }
    let count = report.gpus.len() as u64;
    if count != want.gpus {
        let plural = if want.gpus == 1 { "" } else { "s" };
        found.fail(
            "gpu-count",
            None,
            format!("expected {} GPU{plural}, found {count}", want.gpus),
        );
    }
    if want.gpus > 0
        && let Some(pinned) = &want.driver
    {
        match &report.driver_version {
            Some(v) if v == pinned => {}
            Some(v) => found.fail(
                "driver",
                None,
                format!("driver {v} is loaded, the image pins {pinned}"),
            ),
            None => found.fail(
                "driver",
                None,
                format!("no driver version reported, the image pins {pinned}"),
            ),
        }
    }
}

/// The InfiniBand ports against the image's `ib-*` expectations: enough of them up, and
/// each up port at its rate and width, so a port down or a degraded cable (a 4X link
/// trained at 1X, an NDR link at HDR rate) is named.
fn fabric(report: &ValidationReport, want: &Expectations, found: &mut Findings) {
    let up: Vec<&crate::api::agent::IbPortSample> = report
        .ib_ports
        .iter()
        .filter(|p| p.state.as_deref() == Some("ACTIVE"))
        .collect();
    if let Some(n) = want.ib_ports
        && (up.len() as u64) < n
    {
        let down: Vec<String> = report
            .ib_ports
            .iter()
            .filter(|p| p.state.as_deref() != Some("ACTIVE"))
            .map(|p| {
                format!(
                    "{} is {}",
                    p.port,
                    p.state.as_deref().unwrap_or("unreadable")
                )
            })
            .collect();
        let down = if down.is_empty() {
            String::new()
        } else {
            format!(": {}", down.join(", "))
        };
        found.fail(
            "ib-ports",
            None,
            format!("{} of {n} InfiniBand ports up{down}", up.len()),
        );
    }
    for p in &up {
        if let Some(min) = want.ib_rate_gbps {
            match p.rate_gbps {
                Some(r) if r >= min as f64 => {}
                Some(r) => found.fail(
                    "ib-rate",
                    None,
                    format!(
                        "InfiniBand port {} runs at {r} Gb/s, the image wants {min} (a degraded cable or link)",
                        p.port
                    ),
                ),
                None => found.fail(
                    "ib-rate",
                    None,
                    format!("InfiniBand port {}: rate not reported", p.port),
                ),
            }
        }
        if let Some(w) = &want.ib_width
            && p.width.as_deref() != Some(w.as_str())
        {
            found.fail(
                "ib-width",
                None,
                format!(
                    "InfiniBand port {} is {} wide, the image wants {w}",
                    p.port,
                    p.width.as_deref().unwrap_or("(not reported)")
                ),
            );
        }
    }
}

/// One GPU's NVML errors, model and memory size.
fn gpu_identity(gpu: &GpuFacts, want: &Expectations, found: &mut Findings) {
    let (i, g) = (Some(gpu.index), gpu.index);
    if let Some(e) = &gpu.error {
        found.fail("nvml", i, format!("GPU {g}: NVML: {e}"));
    }
    if let Some(model) = &want.gpu_model
        && !gpu.name.contains(model.as_str())
    {
        found.fail(
            "gpu-model",
            i,
            format!("GPU {g} is {:?}, expected {model}", gpu.name),
        );
    }
    if let Some(min) = want.min_memory_mib
        && gpu.memory_mib.is_none_or(|m| m < min)
    {
        let have = gpu
            .memory_mib
            .map_or("unknown".into(), |m| format!("{m} MiB"));
        found.fail(
            "gpu-memory",
            i,
            format!("GPU {g} has {have}, expected at least {min} MiB"),
        );
    }
}

/// One GPU's PCIe link and NVLinks.
fn gpu_link(gpu: &GpuFacts, want: &Expectations, found: &mut Findings) {
    let (i, g) = (Some(gpu.index), gpu.index);
    if want.pcie_gen.is_some() || want.pcie_width.is_some() {
        match gpu.pcie {
            None => found.fail("pcie", i, format!("GPU {g}: PCIe link not reported")),
            Some(link) => {
                if let Some(gen_min) = want.pcie_gen
                    && u64::from(link.gen_current) < gen_min
                {
                    found.fail(
                        "pcie",
                        i,
                        format!(
                            "GPU {g}: PCIe gen {} (max {}), expected at least {gen_min}",
                            link.gen_current, link.gen_max
                        ),
                    );
                }
                if let Some(width) = want.pcie_width
                    && u64::from(link.width_current) < width
                {
                    found.fail(
                        "pcie",
                        i,
                        format!(
                            "GPU {g}: PCIe x{} (max x{}), expected at least x{width}",
                            link.width_current, link.width_max
                        ),
                    );
                }
            }
        }
    }
    let down: Vec<String> = gpu
        .nvlinks
        .iter()
        .filter(|l| !l.active)
        .map(|l| l.link.to_string())
        .collect();
    if !down.is_empty() {
        found.fail(
            "nvlink",
            i,
            format!("GPU {g}: NVLink {} down", down.join(", ")),
        );
    }
    if let Some(links) = want.nvlinks
        && down.is_empty()
    {
        // Links that are down are named above; here, links missing from the report.
        let up = gpu.nvlinks.iter().filter(|l| l.active).count() as u64;
        if up < links {
            found.fail(
                "nvlink",
                i,
                format!("GPU {g}: {up} NVLinks up, expected {links}"),
            );
        }
    }
}

/// One GPU's ECC mode and errors, row remapping, retired pages and temperature.
fn gpu_memory_health(gpu: &GpuFacts, want: &Expectations, found: &mut Findings) {
    let (i, g) = (Some(gpu.index), gpu.index);
    if want.ecc_required && gpu.ecc_enabled != Some(true) {
        let state = match gpu.ecc_enabled {
            Some(false) => "disabled",
            _ => "not reported",
        };
        found.fail("ecc", i, format!("GPU {g}: ECC {state}"));
    }
    if let Some(ecc) = gpu.ecc
        && ecc.volatile_uncorrected > 0
    {
        found.fail(
            "ecc",
            i,
            format!(
                "GPU {g}: {} uncorrected ECC errors since the driver loaded",
                ecc.volatile_uncorrected
            ),
        );
    }
    if let Some(r) = gpu.row_remap {
        if r.pending {
            found.fail(
                "row-remap",
                i,
                format!("GPU {g}: row remapping pending (needs a GPU reset)"),
            );
        }
        if r.failure {
            found.fail(
                "row-remap",
                i,
                format!("GPU {g}: row remapping failed (no spare rows left)"),
            );
        }
    }
    if let Some(p) = gpu.retired_pages
        && p.pending
    {
        found.fail(
            "retired-pages",
            i,
            format!("GPU {g}: page retirement pending (needs a GPU reset)"),
        );
    }
    if let Some(t) = gpu.temperature_c
        && u64::from(t) > want.max_temperature_c
    {
        found.fail(
            "temperature",
            i,
            format!("GPU {g}: {t} C, above {} C", want.max_temperature_c),
        );
    }
}

/// Fatal XIDs since boot, each named on its GPU when the bus id matches one.
fn xid_checks(report: &ValidationReport, want: &Expectations, found: &mut Findings) {
    for xid in report
        .xids
        .iter()
        .filter(|x| want.fatal_xids.contains(&x.code))
    {
        let gpu = xid.pci_bus_id.as_deref().and_then(|bus| {
            report
                .gpus
                .iter()
                .find(|g| {
                    g.pci_bus_id
                        .as_deref()
                        .is_some_and(|b| pci_bus_key(b) == pci_bus_key(bus))
                })
                .map(|g| g.index)
        });
        let at = xid.pci_bus_id.as_deref().unwrap_or("unknown GPU");
        found.fail("xid", gpu, format!("XID {} on {at} since boot", xid.code));
    }
}

/// DCGM diagnostics (when asked for) and the named checks (a compute probe...).
fn diagnostics(report: &ValidationReport, want: &Expectations, found: &mut Findings) {
    match (&report.dcgm, want.dcgm_level) {
        (None, Some(level)) => found.fail(
            "dcgm",
            None,
            format!("DCGM diag level {level} was asked for and not reported"),
        ),
        (Some(tests), _) => {
            for t in tests.iter().filter(|t| !t.passed) {
                found.fail(
                    "dcgm",
                    None,
                    format!("DCGM {} failed: {}", t.name, t.detail),
                );
            }
        }
        (None, None) => {}
    }
    for check in report.checks.iter().filter(|c| !c.passed) {
        found.fail(
            &format!("check.{}", check.name),
            None,
            format!("{} failed: {}", check.name, check.detail),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::agent::*;

    fn want() -> Expectations {
        Expectations::from_manifest(
            &serde_json::from_value(serde_json::json!({ "gpus": 2, "gpu-model": "H100", "min-gpu-memory-mib": 80000, "pcie-gen": 5, "pcie-width": 16 })).unwrap(),
            &[("nvidia-driver".to_string(), "550.127.05".to_string())].into(),
        )
    }

    fn gpu(index: u32) -> GpuFacts {
        GpuFacts {
            index,
            uuid: format!("GPU-{index}"),
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_mib: Some(81559),
            pci_bus_id: Some(format!("00000000:{:02X}:00.0", 0x18 + index)),
            pcie: Some(PcieLink {
                gen_current: 5,
                gen_max: 5,
                width_current: 16,
                width_max: 16,
            }),
            ecc_enabled: Some(true),
            ecc: Some(EccCounts::default()),
            row_remap: Some(RowRemap::default()),
            temperature_c: Some(34),
            nvlinks: (0..18).map(|link| NvLink { link, active: true }).collect(),
            ..Default::default()
        }
    }

    fn healthy() -> ValidationReport {
        ValidationReport {
            driver_version: Some("550.127.05".into()),
            gpus: vec![gpu(0), gpu(1)],
            ..Default::default()
        }
    }

    fn failures(r: &ValidationReport) -> Vec<(String, Option<u32>)> {
        judge(r, &want())
            .failures
            .into_iter()
            .map(|f| (f.check, f.gpu))
            .collect()
    }

    /// Four NDR ports wanted: one down, one trained at 1X and HDR rate, each named.
    #[test]
    fn a_port_down_and_a_degraded_cable_are_named() {
        let mut want = want();
        want.ib_ports = Some(4);
        want.ib_rate_gbps = Some(400);
        want.ib_width = Some("4X".into());
        let port = |i: u32, state: &str, rate: f64, width: &str| IbPortSample {
            port: format!("mlx5_{i}/1"),
            state: Some(state.into()),
            rate_gbps: Some(rate),
            width: Some(width.into()),
            ..Default::default()
        };
        let mut r = healthy();
        r.ib_ports = (0..4).map(|i| port(i, "ACTIVE", 400.0, "4X")).collect();
        assert!(judge(&r, &want).passed);
        r.ib_ports[1] = port(1, "DOWN", 400.0, "4X");
        r.ib_ports[2] = port(2, "ACTIVE", 200.0, "1X");
        let v = judge(&r, &want);
        let reasons: Vec<(&str, &str)> = v
            .failures
            .iter()
            .map(|f| (f.check.as_str(), f.reason.as_str()))
            .collect();
        assert_eq!(reasons.len(), 3, "{reasons:?}");
        assert_eq!(
            reasons[0],
            ("ib-ports", "3 of 4 InfiniBand ports up: mlx5_1/1 is DOWN")
        );
        assert!(reasons[1].0 == "ib-rate" && reasons[1].1.contains("mlx5_2/1 runs at 200"));
        assert!(reasons[2].0 == "ib-width" && reasons[2].1.contains("mlx5_2/1 is 1X"));
        // An image without ib-* keys asks nothing of the fabric.
        assert!(judge(&r, &super::tests::want()).passed);
    }

    #[test]
    fn a_healthy_node_passes_and_a_cpu_image_needs_no_gpu() {
        assert!(judge(&healthy(), &want()).passed);
        let cpu = Expectations::from_manifest(&ValidationSpec::default(), &Default::default());
        let no_gpu = ValidationReport {
            nvml_error: Some("NVML unavailable: no driver".into()),
            ..Default::default()
        };
        assert!(judge(&no_gpu, &cpu).passed);
        let v = judge(&no_gpu, &want());
        assert!(
            v.failures
                .iter()
                .any(|f| f.reason == "expected 2 GPUs, found 0"),
            "{v:?}"
        );
    }

    #[test]
    fn each_fault_is_named_on_its_gpu() {
        let check = |change: fn(&mut ValidationReport), expected: &[(&str, Option<u32>)]| {
            let mut r = healthy();
            change(&mut r);
            let got = failures(&r);
            let want: Vec<(String, Option<u32>)> =
                expected.iter().map(|(c, g)| (c.to_string(), *g)).collect();
            assert_eq!(got, want);
        };
        check(
            |r| {
                r.gpus[1].ecc = Some(EccCounts {
                    volatile_uncorrected: 2,
                    ..Default::default()
                })
            },
            &[("ecc", Some(1))],
        );
        check(
            |r| {
                r.gpus[0].row_remap = Some(RowRemap {
                    pending: true,
                    ..Default::default()
                })
            },
            &[("row-remap", Some(0))],
        );
        check(
            |r| r.gpus[1].pcie.as_mut().unwrap().width_current = 8,
            &[("pcie", Some(1))],
        );
        check(
            |r| r.gpus[0].nvlinks[3].active = false,
            &[("nvlink", Some(0))],
        );
        check(
            |r| r.gpus[1].error = Some("Unknown Error".into()),
            &[("nvml", Some(1))],
        );
        check(
            |r| r.driver_version = Some("535.104.05".into()),
            &[("driver", None)],
        );
        check(|r| r.gpus[0].ecc_enabled = Some(false), &[("ecc", Some(0))]);
        check(
            |r| r.gpus[1].temperature_c = Some(91),
            &[("temperature", Some(1))],
        );
        check(
            |r| {
                r.xids.push(Xid {
                    code: 79,
                    pci_bus_id: Some("0000:19:00".into()),
                    line: String::new(),
                })
            },
            &[("xid", Some(1))],
        );
        check(
            |r| {
                r.xids.push(Xid {
                    code: 13,
                    pci_bus_id: None,
                    line: String::new(),
                })
            },
            &[],
        );
        check(
            |r| {
                r.dcgm = Some(vec![CheckResult {
                    name: "Memory".into(),
                    passed: false,
                    detail: "error".into(),
                }])
            },
            &[("dcgm", None)],
        );
        check(
            |r| {
                r.gpus.pop();
            },
            &[("gpu-count", None)],
        );
    }
}
