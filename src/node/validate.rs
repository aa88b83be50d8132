//! Post-boot validation judgement, pure: do the GPUs and checks the agent reports meet
//! the image's `[validation]` section? "Node Ready" is not "GPU Ready": every failure is
//! named, per GPU where it concerns one, and a node is ready only when none remains.
//! The full GPU health policy (ECC, NVLink, PCIe, XID...) extends this with issue #6.

use serde::{Deserialize, Serialize};

/// One GPU as the agent saw it through NVML. Unknown fields are accepted: a newer agent
/// may report more than this server judges.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuFacts {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    #[serde(default)]
    pub memory_mib: Option<u64>,
    /// An NVML error for this GPU ("Unknown Error", "GPU is lost"...).
    #[serde(default)]
    pub error: Option<String>,
}

/// An optional check the agent ran (a compute probe, a DCGM diag...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckResult {
    pub name: String,
    pub passed: bool,
    #[serde(default)]
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValidationReport {
    /// Why NVML could not be used ("NVML unavailable: ..."); GPUs are then unknown.
    #[serde(default)]
    pub nvml_error: Option<String>,
    #[serde(default)]
    pub gpus: Vec<GpuFacts>,
    #[serde(default)]
    pub checks: Vec<CheckResult>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub check: String,
    /// The GPU index, when the failure is one GPU's.
    pub gpu: Option<u32>,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ValidationVerdict {
    pub passed: bool,
    pub failures: Vec<Failure>,
}

/// Judges `report` against the manifest's `[validation]` (as JSON): `gpus` (count,
/// default 0), `gpu-model` (a substring of every GPU's name), `min-gpu-memory-mib`.
pub fn judge(report: &ValidationReport, expect: &serde_json::Value) -> ValidationVerdict {
    let mut failures = Vec::new();
    let mut fail = |check: &str, gpu: Option<u32>, reason: String| {
        failures.push(Failure {
            check: check.into(),
            gpu,
            reason,
        })
    };
    let want_gpus = expect.get("gpus").and_then(|v| v.as_u64()).unwrap_or(0);
    if want_gpus > 0
        && let Some(e) = &report.nvml_error
    {
        fail("nvml", None, e.clone());
    }
    let found = report.gpus.len() as u64;
    if found != want_gpus {
        let plural = if want_gpus == 1 { "" } else { "s" };
        fail(
            "gpu-count",
            None,
            format!("expected {want_gpus} GPU{plural}, found {found}"),
        );
    }
    let model = expect.get("gpu-model").and_then(|v| v.as_str());
    let min_memory = expect.get("min-gpu-memory-mib").and_then(|v| v.as_u64());
    for gpu in &report.gpus {
        if let Some(e) = &gpu.error {
            fail("nvml", Some(gpu.index), format!("GPU {}: {e}", gpu.index));
        }
        if let Some(model) = model
            && !gpu.name.contains(model)
        {
            fail(
                "gpu-model",
                Some(gpu.index),
                format!("GPU {} is {:?}, expected {model}", gpu.index, gpu.name),
            );
        }
        if let Some(min) = min_memory
            && gpu.memory_mib.is_none_or(|m| m < min)
        {
            fail(
                "gpu-memory",
                Some(gpu.index),
                format!(
                    "GPU {} has {} MiB, expected at least {min}",
                    gpu.index,
                    gpu.memory_mib.map_or("unknown".into(), |m| m.to_string())
                ),
            );
        }
    }
    for check in report.checks.iter().filter(|c| !c.passed) {
        fail(
            &format!("check.{}", check.name),
            None,
            format!("{} failed: {}", check.name, check.detail),
        );
    }
    ValidationVerdict {
        passed: failures.is_empty(),
        failures,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32) -> GpuFacts {
        GpuFacts {
            index,
            uuid: format!("GPU-{index:08}"),
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_mib: Some(81559),
            error: None,
        }
    }

    fn expect() -> serde_json::Value {
        serde_json::json!({ "gpus": 8, "gpu-model": "H100", "min-gpu-memory-mib": 80000 })
    }

    fn reasons(v: &ValidationVerdict) -> Vec<&str> {
        v.failures.iter().map(|f| f.reason.as_str()).collect()
    }

    #[test]
    fn eight_healthy_gpus_pass() {
        let report = ValidationReport {
            nvml_error: None,
            gpus: (0..8).map(gpu).collect(),
            checks: vec![],
        };
        assert!(judge(&report, &expect()).passed);
    }

    #[test]
    fn no_gpu_on_a_gpu_image_fails_by_name_and_a_cpu_image_passes() {
        let report = ValidationReport {
            nvml_error: Some("NVML unavailable: libnvidia-ml.so.1 not found".into()),
            gpus: vec![],
            checks: vec![],
        };
        let v = judge(&report, &expect());
        assert!(!v.passed);
        assert_eq!(
            reasons(&v),
            [
                "NVML unavailable: libnvidia-ml.so.1 not found",
                "expected 8 GPUs, found 0"
            ]
        );
        assert!(judge(&report, &serde_json::json!({})).passed);
    }

    #[test]
    fn each_bad_gpu_and_check_is_named() {
        let mut gpus: Vec<GpuFacts> = (0..8).map(gpu).collect();
        gpus[3].error = Some("Unknown Error".into());
        gpus[5].name = "NVIDIA A100-SXM4-80GB".into();
        gpus[6].memory_mib = Some(40000);
        let report = ValidationReport {
            nvml_error: None,
            gpus,
            checks: vec![CheckResult {
                name: "compute-probe".into(),
                passed: false,
                detail: "exit status 1".into(),
            }],
        };
        let v = judge(&report, &expect());
        let got: Vec<(&str, Option<u32>)> = v
            .failures
            .iter()
            .map(|f| (f.check.as_str(), f.gpu))
            .collect();
        assert_eq!(
            got,
            [
                ("nvml", Some(3)),
                ("gpu-model", Some(5)),
                ("gpu-memory", Some(6)),
                ("check.compute-probe", None)
            ]
        );
    }
}
