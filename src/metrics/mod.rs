//! Prometheus metrics: what the services count and time as they work, and the scrape at
//! `GET /metrics`, where the fleet's gauges are read from the store.
//!
//! Every label is a bounded set: route templates (not paths), methods, status classes,
//! node states, boot phases, validation checks (named by the server's judge, not the
//! agent), images in use, and the values of the label keys `[metrics] group_labels`
//! names (capped). Nothing in `/metrics` is labelled by request or by node; the per-GPU
//! series, one per GPU by nature, are apart at `/metrics/gpus` (`gpus.rs`).

pub mod census;
pub mod expose;
pub mod gpus;
pub mod http;

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::api::NodeState;
use crate::dhcp::metrics::DhcpMetrics;
use crate::tftp::metrics::TftpMetrics;

/// Boot phases, in boot order: what `bootfleet_boot_phase_seconds{phase}` times.
pub mod phase {
    /// First DHCP answer to the boot script's request (firmware, iPXE's own DHCP).
    pub const DHCP: &str = "dhcp";
    /// One TFTP transfer (iPXE's binary).
    pub const TFTP: &str = "tftp";
    /// The boot script's request, answered (the boot record written).
    pub const SCRIPT: &str = "script";
    /// A download of the image's kernel, initrd or root filesystem, first byte to last.
    pub const KERNEL: &str = "kernel";
    pub const INITRD: &str = "initrd";
    pub const ROOTFS: &str = "rootfs";
    /// Script served to the attestation verdict.
    pub const ATTEST: &str = "attest";
    /// Attestation to the validation verdict.
    pub const VALIDATE: &str = "validate";
    /// Script served to ready: the whole boot after the firmware's part.
    pub const READY: &str = "ready";

    pub const ALL: [&str; 9] = [
        DHCP, TFTP, SCRIPT, KERNEL, INITRD, ROOTFS, ATTEST, VALIDATE, READY,
    ];
}

/// Label values are `&'static str` so that counting a request allocates nothing: route
/// templates are interned (`Inner::route_name`), methods and classes are constants.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    pub route: &'static str,
    pub method: &'static str,
    pub code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabels {
    pub from: &'static str,
    pub to: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CheckLabels {
    pub check: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictLabels {
    pub rule: String,
    pub action: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Seconds, from a millisecond to five minutes: requests, commits and boot phases.
const SECONDS: [f64; 15] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

fn seconds() -> Histogram {
    Histogram::new(SECONDS)
}

/// One route, method and status class's series (`Metrics::http_route`): handles on the
/// families' own metrics, which no family ever drops.
#[derive(Clone)]
pub struct HttpRouteCounters {
    requests: Counter,
    bytes: Counter,
    seconds: Histogram,
}

impl HttpRouteCounters {
    /// One request answered with `bytes` of body after `secs`.
    pub fn record(&self, bytes: u64, secs: f64) {
        self.requests.inc();
        self.bytes.inc_by(bytes);
        self.seconds.observe(secs);
    }
}

/// The server's metrics; cheap to clone (one shared set).
#[derive(Clone, Default)]
pub struct Metrics(Arc<Inner>);

pub struct Inner {
    pub dhcp: Arc<DhcpMetrics>,
    /// Per-GPU readings from heartbeats (`/metrics/gpus`).
    pub gpus: gpus::GpuTelemetry,
    pub tftp: Arc<TftpMetrics>,
    http_requests: Family<HttpLabels, Counter>,
    /// Route templates seen, each leaked once (the router's, so a fixed set; capped).
    routes_seen: std::sync::RwLock<std::collections::HashSet<&'static str>>,
    http_response_bytes: Family<RouteLabels, Counter>,
    http_seconds: HistogramFamily<RouteLabels>,
    boot_phase: HistogramFamily<PhaseLabels>,
    transitions: Family<TransitionLabels, Counter>,
    state_change_seconds: Histogram,
    state_changes_in_flight: Gauge,
    attestations: Family<ResultLabels, Counter>,
    validations: Family<ResultLabels, Counter>,
    validation_failures: Family<CheckLabels, Counter>,
    /// The check names `validation_failures` holds, for its cap.
    checks_seen: std::sync::Mutex<std::collections::BTreeSet<String>>,
    reimage_refusals: Family<ReasonLabels, Counter>,
    /// `[health]` verdicts by rule (the config's names, and `grey-failure`) and action.
    health_verdicts: Family<VerdictLabels, Counter>,
    fetch_commit_seconds: Histogram,
    fetch_records_dropped: Counter,
    auth_failures: Family<ReasonLabels, Counter>,
}

impl Default for Inner {
    /// Every family whose label values are known up front starts with them at zero, so
    /// `increase()` sees the first event and a query finds a series before it happens.
    fn default() -> Self {
        let inner = Self::empty();
        for phase in phase::ALL {
            let _ = inner.boot_phase.get_or_create(&PhaseLabels { phase });
        }
        for result in ["passed", "failed"] {
            let _ = inner.attestations.get_or_create(&ResultLabels { result });
            let _ = inner.validations.get_or_create(&ResultLabels { result });
        }
        for reason in AUTH_REASONS {
            let _ = inner.auth_failures.get_or_create(&ReasonLabels { reason });
        }
        for reason in [REFUSED_OVER_BUDGET, REFUSED_NOT_ALLOWED] {
            let _ = inner
                .reimage_refusals
                .get_or_create(&ReasonLabels { reason });
        }
        inner
    }
}

/// Reimage refusals: the disruption budget, or the node's state.
pub const REFUSED_OVER_BUDGET: &str = "over-budget";
pub const REFUSED_NOT_ALLOWED: &str = "not-allowed";

/// Admin API requests refused at the gate: a token no one holds, a revoked one, a
/// session cookie or CSRF token that does not check out, a role that does not allow
/// the route, a source refused for failing too often.
pub const AUTH_UNKNOWN: &str = crate::auth::tokens::Refusal::Unknown.as_str();
pub const AUTH_REVOKED: &str = crate::auth::tokens::Refusal::Revoked.as_str();
pub const AUTH_SESSION: &str = "session";
pub const AUTH_NOT_ALLOWED: &str = "not-allowed";
pub const AUTH_RATE_LIMITED: &str = "rate-limited";
const AUTH_REASONS: [&str; 5] = [
    AUTH_UNKNOWN,
    AUTH_REVOKED,
    AUTH_SESSION,
    AUTH_NOT_ALLOWED,
    AUTH_RATE_LIMITED,
];

/// A request method as a label: the standard ones by name, any other as "other".
fn method_name(method: &str) -> &'static str {
    const STANDARD: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE",
    ];
    STANDARD
        .into_iter()
        .find(|m| *m == method)
        .unwrap_or("other")
}

impl Inner {
    /// The labels of a request to `route` by `method` answered `status`.
    fn http_labels(&self, route: &str, method: &str, status: u16) -> HttpLabels {
        let code = match status {
            100..=199 => "1xx",
            200..=299 => "2xx",
            300..=399 => "3xx",
            400..=499 => "4xx",
            _ => "5xx",
        };
        HttpLabels {
            route: self.route_name(route),
            method: method_name(method),
            code,
        }
    }

    /// `route` as a label value that lives as long as the process: interned on first
    /// sight. Templates come from the router, a fixed set; past `MAX_LABEL_VALUES` of
    /// them (a bug, not traffic) the rest count as "other".
    fn route_name(&self, route: &str) -> &'static str {
        if let Some(name) = self.routes_seen.read().expect("not poisoned").get(route) {
            return name;
        }
        let mut seen = self.routes_seen.write().expect("not poisoned");
        if let Some(name) = seen.get(route) {
            return name;
        }
        if seen.len() >= MAX_LABEL_VALUES {
            return "other";
        }
        let name: &'static str = Box::leak(route.to_owned().into_boxed_str());
        seen.insert(name);
        name
    }

    fn empty() -> Self {
        Self {
            dhcp: Default::default(),
            gpus: Default::default(),
            tftp: Default::default(),
            http_requests: Default::default(),
            routes_seen: Default::default(),
            http_response_bytes: Default::default(),
            http_seconds: Family::new_with_constructor(seconds),
            boot_phase: Family::new_with_constructor(seconds),
            transitions: Default::default(),
            state_change_seconds: seconds(),
            state_changes_in_flight: Default::default(),
            attestations: Default::default(),
            validations: Default::default(),
            validation_failures: Default::default(),
            checks_seen: Default::default(),
            reimage_refusals: Default::default(),
            health_verdicts: Default::default(),
            fetch_commit_seconds: seconds(),
            fetch_records_dropped: Default::default(),
            auth_failures: Default::default(),
        }
    }
}

/// Distinct values a family with labels from outside our code may hold; past it, new
/// values are counted as `other`. A guard, not a limit anyone should reach.
pub const MAX_LABEL_VALUES: usize = 256;

impl Metrics {
    pub fn dhcp(&self) -> Arc<DhcpMetrics> {
        self.0.dhcp.clone()
    }

    pub fn tftp(&self) -> Arc<TftpMetrics> {
        self.0.tftp.clone()
    }

    pub fn gpus(&self) -> &gpus::GpuTelemetry {
        &self.0.gpus
    }

    /// One answered HTTP request, by route template.
    pub fn http_request(&self, route: &str, method: &str, status: u16, bytes: u64, secs: f64) {
        let labels = self.0.http_labels(route, method, status);
        let route = RouteLabels {
            route: labels.route,
        };
        self.0.http_requests.get_or_create(&labels).inc();
        self.0
            .http_response_bytes
            .get_or_create(&route)
            .inc_by(bytes);
        self.0.http_seconds.get_or_create(&route).observe(secs);
    }

    /// The series of requests to `route` by `method` answered `status`, looked up once
    /// (and so shown from now on, at 0 until counted): for a path answered before
    /// routing, where the lookup would be a fair part of the request's cost. They count
    /// what `http_request` would.
    pub fn http_route(&self, route: &str, method: &str, status: u16) -> HttpRouteCounters {
        let labels = self.0.http_labels(route, method, status);
        let route = RouteLabels {
            route: labels.route,
        };
        HttpRouteCounters {
            requests: self.0.http_requests.get_or_create(&labels).clone(),
            bytes: self.0.http_response_bytes.get_or_create(&route).clone(),
            seconds: self.0.http_seconds.get_or_create(&route).clone(),
        }
    }

    /// How long one phase of one boot took (`phase::*`).
    pub fn boot_phase(&self, phase: &'static str, secs: f64) {
        if secs.is_finite() && secs >= 0.0 {
            self.0
                .boot_phase
                .get_or_create(&PhaseLabels { phase })
                .observe(secs);
        }
    }

    /// A node state change, written; `secs` its write (compare-and-set retries included).
    pub fn transition(&self, from: NodeState, to: NodeState, secs: f64) {
        self.0
            .transitions
            .get_or_create(&TransitionLabels {
                from: from.as_str(),
                to: to.as_str(),
            })
            .inc();
        self.0.state_change_seconds.observe(secs);
    }

    /// A state change being written, until the guard is dropped.
    pub fn state_change_started(&self) -> InFlight {
        self.0.state_changes_in_flight.inc();
        InFlight(self.0.state_changes_in_flight.clone())
    }

    pub fn attestation(&self, passed: bool) {
        let result = if passed { "passed" } else { "failed" };
        self.0
            .attestations
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    /// A validation verdict, with the checks that failed (names from the server's judge).
    pub fn validation<'a>(&self, passed: bool, failed_checks: impl IntoIterator<Item = &'a str>) {
        let result = if passed { "passed" } else { "failed" };
        self.0
            .validations
            .get_or_create(&ResultLabels { result })
            .inc();
        let mut seen = std::collections::BTreeSet::new();
        for check in failed_checks {
            if seen.insert(check) {
                let check = self.bounded_check(check);
                self.0
                    .validation_failures
                    .get_or_create(&CheckLabels { check })
                    .inc();
            }
        }
    }

    /// The check's name, or `other` for one that is implausible or past the cap.
    fn bounded_check(&self, check: &str) -> String {
        let plausible = !check.is_empty()
            && check.len() <= 64
            && check
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        let mut seen = self.0.checks_seen.lock().expect("not poisoned");
        if plausible && (seen.contains(check) || seen.len() < MAX_LABEL_VALUES) {
            seen.insert(check.to_string());
            check.to_string()
        } else {
            "other".into()
        }
    }

    /// A reimage refused by the disruption budget (`over-budget`) or the state machine.
    /// A health verdict: `rule` is an operator's rule name (bounded by the config).
    pub fn health_verdict(&self, rule: &str, action: &str) {
        let labels = VerdictLabels {
            rule: rule.chars().take(64).collect(),
            action: action.to_string(),
        };
        self.0.health_verdicts.get_or_create(&labels).inc();
    }

    pub fn reimage_refused(&self, reason: &'static str) {
        self.0
            .reimage_refusals
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// An admin API request refused at the gate, for `reason` (one of `AUTH_*`).
    pub fn auth_failed(&self, reason: &'static str) {
        self.0
            .auth_failures
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// One batch of download records committed.
    pub fn fetch_commit(&self, secs: f64) {
        self.0.fetch_commit_seconds.observe(secs);
    }

    pub fn fetch_record_dropped(&self) {
        self.0.fetch_records_dropped.inc();
    }
}

/// Decrements the in-flight gauge when the write is done, however it ends.
pub struct InFlight(Gauge);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// `[metrics]` in the settings file.
#[derive(Debug, Clone, serde::Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MetricsSettings {
    /// Node label keys whose values group `bootfleet_nodes_by_group` (`rack`, `sku`):
    /// at most `census::MAX_GROUP_VALUES` values each.
    #[serde(default)]
    pub group_labels: Vec<String>,
    /// A token that may read `/metrics` and nothing else, so Prometheus need not hold
    /// the admin token (`authorization: credentials_file` in its scrape config).
    pub token_file: Option<std::path::PathBuf>,
    /// A node longer than this in provisioning, booted, validating or reimaging counts
    /// in `bootfleet_nodes_stuck` [default: 1800].
    #[serde(default = "default_stuck_after")]
    pub stuck_after_secs: u64,
}

fn default_stuck_after() -> u64 {
    1800
}

impl Default for MetricsSettings {
    fn default() -> Self {
        Self {
            group_labels: Vec::new(),
            token_file: None,
            stuck_after_secs: default_stuck_after(),
        }
    }
}

/// What the scrape needs besides the counters.
pub struct Scrape {
    pub group_labels: Vec<String>,
    pub stuck_after_secs: u64,
    /// The scrape-only token, when `[metrics] token_file` is set.
    pub token: Option<crate::auth::AdminToken>,
    /// The webhooks whose lag is reported, by URL.
    pub webhooks: Vec<String>,
}

impl Scrape {
    pub fn load(
        settings: &MetricsSettings,
        webhooks: Vec<String>,
    ) -> Result<Self, crate::auth::TokenError> {
        Ok(Self {
            group_labels: settings.group_labels.clone(),
            stuck_after_secs: settings.stuck_after_secs,
            token: settings
                .token_file
                .as_deref()
                .map(crate::auth::AdminToken::read)
                .transpose()?,
            webhooks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(m: &Metrics) -> String {
        expose::encode(m, &census::Census::default(), 0, None)
    }

    #[test]
    fn check_names_are_bounded_and_known_series_start_at_zero() {
        let m = Metrics::default();
        let fresh = text(&m);
        assert!(
            fresh.contains(r#"bootfleet_validations_total{result="failed"} 0"#),
            "{fresh}"
        );
        assert!(fresh.contains(r#"bootfleet_reimage_refusals_total{reason="over-budget"} 0"#));
        assert!(fresh.contains(r#"bootfleet_boot_phase_duration_seconds_count{phase="rootfs"} 0"#));
        m.validation(false, ["gpu-count", "gpu-count", "bad name\n{}"]);
        for i in 0..MAX_LABEL_VALUES + 10 {
            m.validation(false, [format!("check-{i}").as_str()]);
        }
        let t = text(&m);
        assert!(
            t.contains(r#"bootfleet_validation_failures_total{check="gpu-count"} 1"#),
            "a verdict counts a check once"
        );
        let names = t
            .lines()
            .filter(|l| l.starts_with("bootfleet_validation_failures_total{"))
            .count();
        assert_eq!(names, MAX_LABEL_VALUES + 1, "the cap, and other");
        assert!(
            t.contains(r#"bootfleet_validation_failures_total{check="other"} 12"#),
            "{t}"
        );
    }

    #[test]
    fn requests_count_by_status_class() {
        let m = Metrics::default();
        m.http_request("/api/v1/nodes/{mac}", "GET", 404, 10, 0.001);
        m.http_request("/api/v1/nodes/{mac}", "GET", 200, 90, 0.002);
        m.http_request("/api/v1/nodes/{mac}", "GET", 204, 0, 0.002);
        let t = text(&m);
        assert!(t.contains(r#"bootfleet_http_requests_total{route="/api/v1/nodes/{mac}",method="GET",code="2xx"} 2"#), "{t}");
        assert!(t.contains(r#"bootfleet_http_requests_total{route="/api/v1/nodes/{mac}",method="GET",code="4xx"} 1"#));
        assert!(
            t.contains(r#"bootfleet_http_response_bytes_total{route="/api/v1/nodes/{mac}"} 100"#)
        );
        m.http_request("/api/v1/nodes/{mac}", "BREW", 405, 0, 0.001);
        assert!(
            text(&m).contains(r#"bootfleet_http_requests_total{route="/api/v1/nodes/{mac}",method="other",code="4xx"} 1"#)
        );
        assert_eq!(m.0.routes_seen.read().unwrap().len(), 1, "interned once");
    }
}
