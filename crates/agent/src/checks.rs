//! Optional checks the image asks for, each with a timeout: DCGM diagnostics
//! (`dcgmi diag -r N -j`, parsed into per-test results) and a compute-probe command.
//! A check that cannot run is a failed check with the reason, never a silent pass.

use std::time::Duration;

use serde_json::Value;

use bootfleet_api::agent::CheckResult;

/// How long each DCGM level may take (level 1 takes seconds, 2 about 2 minutes, 3 about
/// 15, 4 is the extended run).
pub fn dcgm_timeout(level: u64) -> Duration {
    Duration::from_secs(match level {
        0 | 1 => 120,
        2 => 600,
        3 => 2700,
        _ => 4 * 3600,
    })
}

/// Per-test results from `dcgmi diag -j` output. The top-level key has been both
/// "DCGM GPU Diagnostic" and "DCGM Diagnostic"; a test passes when none of its results
/// is a failure ("Pass", "Skip" and "Not Run" are not failures; warnings are).
pub fn parse_dcgm(json: &str) -> Result<Vec<CheckResult>, String> {
    let v: Value =
        serde_json::from_str(json).map_err(|e| format!("dcgmi output is not JSON: {e}"))?;
    let root = v
        .as_object()
        .and_then(|o| o.values().find(|x| x.get("test_categories").is_some()))
        .ok_or("dcgmi output has no test_categories")?;
    let mut out = Vec::new();
    for category in root["test_categories"].as_array().into_iter().flatten() {
        for test in category["tests"].as_array().into_iter().flatten() {
            let name = test["name"].as_str().unwrap_or("unnamed").to_string();
            let mut problems = Vec::new();
            for r in test["results"].as_array().into_iter().flatten() {
                let status = r["status"].as_str().unwrap_or("").to_ascii_lowercase();
                if matches!(status.as_str(), "pass" | "skip" | "not run" | "") {
                    continue;
                }
                let gpu = r.get("gpu_id").or_else(|| r.get("entity_id")).map(|g| {
                    format!(
                        "GPU {} ",
                        g.as_str()
                            .map(str::to_string)
                            .unwrap_or_else(|| g.to_string())
                    )
                });
                let info = ["info", "warnings", "warning"]
                    .iter()
                    .filter_map(|k| r.get(*k))
                    .map(|x| match x {
                        Value::String(s) => s.clone(),
                        Value::Array(a) => a
                            .iter()
                            .map(|m| {
                                m.get("message")
                                    .and_then(|m| m.as_str())
                                    .map(str::to_string)
                                    .unwrap_or_else(|| m.to_string())
                            })
                            .collect::<Vec<_>>()
                            .join("; "),
                        other => other.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join("; ");
                problems.push(format!(
                    "{}{status}{}",
                    gpu.unwrap_or_default(),
                    if info.is_empty() {
                        String::new()
                    } else {
                        format!(": {info}")
                    }
                ));
            }
            out.push(CheckResult {
                name,
                passed: problems.is_empty(),
                detail: problems.join(" | "),
            });
        }
    }
    if out.is_empty() {
        return Err("dcgmi reported no tests".into());
    }
    Ok(out)
}

fn last_line(text: &str) -> Option<&str> {
    text.lines().rfind(|l| !l.trim().is_empty())
}

/// Runs `program args` with a timeout; Ok(stdout) on exit 0.
pub(crate) async fn run(program: &str, args: &[&str], timeout: Duration) -> Result<String, String> {
    let child = tokio::process::Command::new(program)
        .args(args)
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(timeout, child).await {
        Err(_) => Err(format!("{program} timed out after {timeout:?}")),
        Ok(Err(e)) => Err(format!("cannot run {program}: {e}")),
        Ok(Ok(out)) if out.status.success() => {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        }
        Ok(Ok(out)) => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let stdout = String::from_utf8_lossy(&out.stdout);
            // The error is usually the last thing on stderr, else on stdout.
            let last = last_line(&stderr)
                .or_else(|| last_line(&stdout))
                .unwrap_or("")
                .to_string();
            Err(format!("{program} exited with {}: {last}", out.status))
        }
    }
}

/// DCGM diagnostics at `level`, as one result per test.
pub async fn dcgm(level: u64) -> Vec<CheckResult> {
    let level_arg = level.to_string();
    // dcgmi exits non-zero when a test fails; its JSON still says which.
    let output = match tokio::time::timeout(
        dcgm_timeout(level),
        tokio::process::Command::new("dcgmi")
            .args(["diag", "-r", &level_arg, "-j"])
            .kill_on_drop(true)
            .output(),
    )
    .await
    {
        Err(_) => Err(format!("dcgmi diag -r {level} timed out")),
        Ok(Err(e)) => Err(format!(
            "cannot run dcgmi: {e} (is datacenter-gpu-manager in the image?)"
        )),
        Ok(Ok(out)) => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
    };
    match output.and_then(|json| parse_dcgm(&json)) {
        Ok(results) => results,
        Err(detail) => vec![CheckResult {
            name: "dcgm".into(),
            passed: false,
            detail,
        }],
    }
}

/// The compute probe: `sh -c COMMAND`, passed on exit 0; the detail is its last line.
pub async fn probe(command: &str, timeout: Duration) -> CheckResult {
    match run("sh", &["-c", command], timeout).await {
        Ok(out) => CheckResult {
            name: "compute-probe".into(),
            passed: true,
            detail: last_line(&out).unwrap_or("").to_string(),
        },
        Err(detail) => CheckResult {
            name: "compute-probe".into(),
            passed: false,
            detail,
        },
    }
}

/// A performance probe: `sh -c COMMAND`, whose figure is the last number on its last
/// line (`GEMM: 712.4 TFLOPS` gives 712.4). A probe that fails or prints no number gives
/// a failed check instead, so a missing figure is never taken as a good one.
pub async fn figure(
    name: &str,
    command: &str,
    timeout: Duration,
) -> Result<bootfleet_api::agent::Figure, CheckResult> {
    let failed = |detail: String| CheckResult {
        name: format!("figure-{name}"),
        passed: false,
        detail,
    };
    let out = run("sh", &["-c", command], timeout).await.map_err(failed)?;
    let line = last_line(&out).unwrap_or("");
    line.split(|c: char| c.is_whitespace() || c == '=' || c == ':')
        .rev()
        .find_map(|w| w.parse::<f64>().ok().filter(|v| v.is_finite()))
        .map(|value| bootfleet_api::agent::Figure {
            name: name.to_string(),
            value,
        })
        .ok_or_else(|| failed(format!("no figure in its last line {line:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of `dcgmi diag -r 2 -j` (DCGM 3.x), one test failing on one GPU.
    const DCGM: &str = r#"{"DCGM GPU Diagnostic": {"test_categories": [
      {"category": "Deployment", "tests": [
        {"name": "Denylist", "results": [{"status": "Pass"}]},
        {"name": "NVML Library", "results": [{"status": "Pass"}]}]},
      {"category": "Integration", "tests": [
        {"name": "PCIe", "results": [{"gpu_id": "0", "status": "Pass"}, {"gpu_id": "1", "status": "Skip"}]}]},
      {"category": "Hardware", "tests": [
        {"name": "GPU Memory", "results": [{"gpu_id": "3", "status": "Fail", "warnings": [{"message": "DBE detected"}], "info": "Allocated 79 GB"}]}]}
    ]}, "version": "3.3.5"}"#;

    #[test]
    fn dcgm_json_becomes_one_result_per_test() {
        let r = parse_dcgm(DCGM).unwrap();
        let names: Vec<(&str, bool)> = r.iter().map(|c| (c.name.as_str(), c.passed)).collect();
        assert_eq!(
            names,
            [
                ("Denylist", true),
                ("NVML Library", true),
                ("PCIe", true),
                ("GPU Memory", false)
            ]
        );
        assert_eq!(r[3].detail, "GPU 3 fail: Allocated 79 GB; DBE detected");
        assert!(parse_dcgm("not json").is_err());
        assert!(parse_dcgm("{}").is_err());
    }

    #[tokio::test]
    async fn a_figure_is_the_last_number_of_the_last_line_or_a_failed_check() {
        let t = Duration::from_secs(5);
        let f = figure("gemm_tflops", "echo warming; echo 'GEMM: 712.4 TFLOPS'", t).await;
        assert_eq!(f.unwrap().value, 712.4);
        let none = figure("gemm_tflops", "echo done", t).await.unwrap_err();
        assert!(
            !none.passed && none.name == "figure-gemm_tflops",
            "{none:?}"
        );
        assert!(figure("x", "exit 3", t).await.is_err());
    }

    #[tokio::test]
    async fn a_probe_passes_on_exit_zero_and_fails_with_its_reason() {
        let ok = probe("echo warming; echo 'matmul ok'", Duration::from_secs(5)).await;
        assert!(ok.passed && ok.detail == "matmul ok", "{ok:?}");
        let bad = probe(
            "echo 'CUDA error: no device' >&2; exit 3",
            Duration::from_secs(5),
        )
        .await;
        assert!(
            !bad.passed && bad.detail.contains("CUDA error: no device"),
            "{bad:?}"
        );
        let slow = probe("sleep 5", Duration::from_millis(100)).await;
        assert!(
            !slow.passed && slow.detail.contains("timed out"),
            "{slow:?}"
        );
    }
}
