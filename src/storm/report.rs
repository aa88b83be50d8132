//! The storm's report, pure: per-phase latency percentiles, failures by cause, retries,
//! and the server's CPU time and peak memory, as text and as JSON.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use super::node::{NodeResult, Phase};

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Percentiles {
    pub count: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// Nearest-rank percentiles of `samples` (sorted here).
pub fn percentiles(samples: &mut [Duration]) -> Option<Percentiles> {
    if samples.is_empty() {
        return None;
    }
    samples.sort_unstable();
    let at = |q: f64| {
        let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
        samples[rank - 1].as_secs_f64() * 1000.0
    };
    Some(Percentiles {
        count: samples.len(),
        p50_ms: at(0.50),
        p90_ms: at(0.90),
        p99_ms: at(0.99),
        max_ms: at(1.0),
    })
}

/// CPU seconds and peak resident memory of the processes under test.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ServerCost {
    pub cpu_secs: f64,
    /// VmHWM over the process's life: it counts each mapping of a page-cache page, so
    /// blob windows mapped by many downloads at once weigh here as often as they are
    /// mapped, though they are one copy in memory.
    pub peak_rss_mib: f64,
    /// The highest anonymous resident memory (RssAnon: heap, stacks, buffers) sampled
    /// during the storm: the memory the server itself holds.
    pub peak_anon_mib: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub nodes: usize,
    pub completed: usize,
    pub wall_secs: f64,
    pub phases: BTreeMap<Phase, Percentiles>,
    /// "phase: cause" -> nodes.
    pub failures: BTreeMap<String, usize>,
    pub retries: BTreeMap<String, u64>,
    pub http_bytes: u64,
    pub stray_dhcp_replies: u64,
    pub server: Option<ServerCost>,
}

/// Digits, addresses, digests and boot ids make every cause unique; strip them so causes
/// group: a run of 8 or more hex digits becomes `H`, any other run of digits `N`.
fn cause(why: &str) -> String {
    let why: String = why.chars().take(160).collect();
    let mut out = String::with_capacity(why.len());
    let mut rest = why.as_str();
    while let Some(c) = rest.chars().next() {
        let hex_run = rest
            .find(|c: char| !c.is_ascii_hexdigit())
            .unwrap_or(rest.len());
        if hex_run >= 8 {
            out.push('H');
            rest = &rest[hex_run..];
        } else if c.is_ascii_digit() {
            out.push('N');
            rest = rest.trim_start_matches(|c: char| c.is_ascii_digit());
        } else {
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

pub fn build(
    results: &[NodeResult],
    wall: Duration,
    stray_dhcp_replies: u64,
    server: Option<ServerCost>,
) -> Report {
    let mut samples: BTreeMap<Phase, Vec<Duration>> = BTreeMap::new();
    let mut failures = BTreeMap::new();
    let mut retries = BTreeMap::new();
    let mut http_bytes = 0;
    for r in results {
        for (phase, d) in &r.phases {
            samples.entry(*phase).or_default().push(*d);
        }
        if let Some((phase, why)) = &r.failure {
            *failures
                .entry(format!("{}: {}", phase.name(), cause(why)))
                .or_insert(0) += 1;
        }
        for (kind, n) in &r.retries {
            *retries.entry(kind.to_string()).or_insert(0) += u64::from(*n);
        }
        http_bytes += r.http_bytes;
    }
    Report {
        nodes: results.len(),
        completed: results.iter().filter(|r| r.failure.is_none()).count(),
        wall_secs: wall.as_secs_f64(),
        phases: samples
            .into_iter()
            .filter_map(|(p, mut s)| Some((p, percentiles(&mut s)?)))
            .collect(),
        failures,
        retries,
        http_bytes,
        stray_dhcp_replies,
        server,
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "nodes {}  completed {}  failed {}  wall {:.1} s  http {:.1} MiB",
            self.nodes,
            self.completed,
            self.nodes - self.completed,
            self.wall_secs,
            self.http_bytes as f64 / (1 << 20) as f64
        )?;
        writeln!(
            f,
            "{:<18} {:>6} {:>9} {:>9} {:>9} {:>9}",
            "phase (ms)", "count", "p50", "p90", "p99", "max"
        )?;
        for (phase, p) in &self.phases {
            writeln!(
                f,
                "{:<18} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
                phase.name(),
                p.count,
                p.p50_ms,
                p.p90_ms,
                p.p99_ms,
                p.max_ms
            )?;
        }
        for (why, n) in &self.failures {
            writeln!(f, "failed: {n} x {why}")?;
        }
        for (kind, n) in &self.retries {
            writeln!(f, "retries: {kind} {n}")?;
        }
        if self.stray_dhcp_replies > 0 {
            writeln!(
                f,
                "dhcp replies nobody waited for: {}",
                self.stray_dhcp_replies
            )?;
        }
        if let Some(s) = &self.server {
            writeln!(
                f,
                "server: cpu {:.2} s, peak rss {:.1} MiB, peak anonymous {:.1} MiB",
                s.cpu_secs, s.peak_rss_mib, s.peak_anon_mib
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut s: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let p = percentiles(&mut s).unwrap();
        assert_eq!(
            (p.count, p.p50_ms, p.p90_ms, p.p99_ms, p.max_ms),
            (100, 50.0, 90.0, 99.0, 100.0)
        );
        assert_eq!(percentiles(&mut []), None);
    }

    #[test]
    fn failures_group_by_phase_and_cause_without_numbers() {
        let failed = |why: &str| NodeResult {
            failure: Some((Phase::Tftp, why.into())),
            ..Default::default()
        };
        let ok = NodeResult {
            phases: vec![(Phase::Ready, Duration::from_secs(3))],
            ..Default::default()
        };
        let r = build(
            &[
                failed("no answer after 10 retries"),
                failed("no answer after 11 retries"),
                ok,
            ],
            Duration::from_secs(5),
            0,
            None,
        );
        assert_eq!((r.nodes, r.completed), (3, 1));
        assert_eq!(r.failures["tftp: no answer after N retries"], 2);
        assert_eq!(r.phases[&Phase::Ready].count, 1);
        assert!(r.to_string().contains("failed: 2 x tftp"));
    }

    #[test]
    fn digests_and_boot_ids_do_not_split_a_cause() {
        let url = |digest: &str, boot: &str| {
            format!(
                "error sending request for url (http://10.98.0.1:8080/blobs/sha256/{digest}?boot={boot})"
            )
        };
        let a = cause(&url(&"4f".repeat(32), "0a1b2c3d4e5f6789"));
        assert_eq!(a, cause(&url(&"c0".repeat(32), "9876543210fedcba")));
        assert_eq!(
            a,
            "error sending request for url (http://N.N.N.N:N/blobs/shaN/H?boot=H)"
        );
        assert_eq!(cause("a bad cafe after 10 s"), "a bad cafe after N s");
    }
}
