//! The scrape: the counters the services keep and the census read now, in Prometheus's
//! text format (0.0.4, what `curl` users and `promtool` read).

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use super::Metrics;
use super::census::Census;

pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

type Labels = Vec<(&'static str, String)>;

/// A gauge family filled from `(labels, value)` pairs.
fn gauges<V: Into<i64>>(pairs: impl IntoIterator<Item = (Labels, V)>) -> Family<Labels, Gauge> {
    let family = Family::<Labels, Gauge>::default();
    for (labels, v) in pairs {
        family.get_or_create(&labels).set(v.into());
    }
    family
}

/// A counter family from values read elsewhere (DHCP's and TFTP's own counters).
#[derive(Debug)]
struct ConstCounters {
    name: &'static str,
    help: &'static str,
    values: Vec<(Labels, u64)>,
}

impl prometheus_client::collector::Collector for ConstCounters {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        let mut family = encoder.encode_descriptor(
            self.name,
            self.help,
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (labels, v) in &self.values {
            let counter = ConstCounter::new(*v);
            counter.encode(family.encode_family(labels)?)?;
        }
        Ok(())
    }
}

fn dhcp_counters(m: &Metrics) -> ConstCounters {
    // Keys are `offer`, `ack`, `nak`, `chainload`, or `<outcome>.<reason>` for what was
    // dropped: `malformed.too-short`, `ignored.not-pxe`...
    let values = m
        .dhcp()
        .snapshot()
        .into_iter()
        .map(|(key, n)| {
            let (outcome, reason) = key.split_once('.').unwrap_or((key.as_str(), ""));
            (
                vec![
                    ("outcome", outcome.to_string()),
                    ("reason", reason.to_string()),
                ],
                n,
            )
        })
        .collect();
    ConstCounters {
        name: "dhcp_packets",
        help: "DHCP packets handled, by outcome (offer, ack, nak, or why dropped)",
        values,
    }
}

fn tftp_counters(m: &Metrics) -> Vec<ConstCounters> {
    use std::sync::atomic::Ordering::Relaxed;
    let t = m.tftp();
    let by = |pairs: &[(&str, &std::sync::atomic::AtomicU64)], key: &'static str| {
        pairs
            .iter()
            .map(|(v, c)| (vec![(key, v.to_string())], c.load(Relaxed)))
            .collect()
    };
    vec![
        ConstCounters {
            name: "tftp_transfers",
            help: "TFTP transfers ended, by outcome",
            values: by(
                &[
                    ("completed", &t.completed),
                    ("refused", &t.refused),
                    ("aborted", &t.aborted),
                    ("failed", &t.failed),
                ],
                "outcome",
            ),
        },
        ConstCounters {
            name: "tftp_dropped",
            help: "TFTP requests and datagrams not served, by reason",
            values: by(
                &[
                    ("malformed", &t.malformed),
                    ("path", &t.refused_paths),
                    ("write", &t.refused_writes),
                    ("busy", &t.refused_busy),
                    ("duplicate", &t.duplicate_requests),
                ],
                "reason",
            ),
        },
        ConstCounters {
            name: "tftp_requests",
            help: "TFTP read requests received",
            values: vec![(vec![], t.requests.load(Relaxed))],
        },
        ConstCounters {
            name: "tftp_sent_bytes",
            help: "Bytes TFTP clients acknowledged",
            values: vec![(vec![], t.bytes_sent.load(Relaxed))],
        },
        ConstCounters {
            name: "tftp_retransmits",
            help: "TFTP blocks sent again",
            values: vec![(vec![], t.retransmits.load(Relaxed))],
        },
    ]
}

/// Everything, as `/metrics` answers it.
pub fn encode(
    m: &Metrics,
    census: &Census,
    fetch_queue: usize,
    writes: Option<crate::store::WriteStats>,
) -> String {
    let i = &m.0;
    let mut r = Registry::with_prefix("bootfleet");
    r.register(
        "http_requests",
        "HTTP requests answered, by route template, method and status class",
        i.http_requests.clone(),
    );
    r.register_with_unit(
        "http_response",
        "Response body bytes (their announced length), by route template",
        Unit::Bytes,
        i.http_response_bytes.clone(),
    );
    r.register_with_unit(
        "http_request_duration",
        "Time to the response's headers, by route template (a blob's body streams after)",
        Unit::Seconds,
        i.http_seconds.clone(),
    );
    r.register_with_unit(
        "boot_phase_duration",
        "How long each phase of a boot took: dhcp, tftp, script, kernel, initrd, rootfs, attest (from the script), validate (from attest), ready (from the script)",
        Unit::Seconds,
        i.boot_phase.clone(),
    );
    r.register(
        "node_transitions",
        "Node state changes written, by from and to state (to=reimaging counts reimages)",
        i.transitions.clone(),
    );
    r.register_with_unit(
        "state_change_commit",
        "Time to write one node state change with its row, compare-and-set retries included",
        Unit::Seconds,
        i.state_change_seconds.clone(),
    );
    r.register(
        "state_changes_in_flight",
        "Node state changes being written now (the write queue)",
        i.state_changes_in_flight.clone(),
    );
    r.register(
        "attestations",
        "Attestation verdicts, by result",
        i.attestations.clone(),
    );
    r.register(
        "validations",
        "Validation verdicts, by result",
        i.validations.clone(),
    );
    r.register(
        "validation_failures",
        "Failed validations by the check that failed (a verdict failing two checks counts in both)",
        i.validation_failures.clone(),
    );
    r.register(
        "health_verdicts",
        "Health verdicts on nodes, by rule and the action it asked for",
        i.health_verdicts.clone(),
    );
    r.register(
        "auth_failures",
        "Admin API requests refused at authentication or authorisation, by reason",
        i.auth_failures.clone(),
    );
    r.register(
        "reimage_refusals",
        "Reimages refused, by reason (over-budget: the disruption budget)",
        i.reimage_refusals.clone(),
    );
    r.register_with_unit(
        "fetch_commit",
        "Time to write one batch of download records",
        Unit::Seconds,
        i.fetch_commit_seconds.clone(),
    );
    r.register(
        "fetch_records_dropped",
        "Download records dropped because the write queue was full (fails the boot's attestation)",
        i.fetch_records_dropped.clone(),
    );
    r.register(
        "fetch_queue",
        "Download records waiting to be written",
        gauges([(vec![], i64::try_from(fetch_queue).unwrap_or(i64::MAX))]),
    );
    if let Some(w) = writes {
        register_writes(&mut r, w);
    }
    register_census(&mut r, census);
    r.register_collector(Box::new(dhcp_counters(m)));
    for c in tftp_counters(m) {
        r.register_collector(Box::new(c));
    }
    let mut out = String::with_capacity(64 * 1024);
    prometheus_text::encode(&mut out, &r).expect("writing to a String cannot fail");
    out
}

/// The embedded store's write path (group commit): its queue, and how many writes each
/// commit carried (writes over commits).
fn register_writes(r: &mut Registry, w: crate::store::WriteStats) {
    let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let counter = |v: u64| {
        let c = prometheus_client::metrics::counter::Counter::<u64>::default();
        c.inc_by(v);
        c
    };
    r.register(
        "store_writers_queued",
        "Writers waiting for their turn to write (past its limit a writer gets 503)",
        gauges([(vec![], n(w.queued))]),
    );
    r.register(
        "store_commits",
        "Commits made (each one fsync), each carrying one or more writers' writes",
        counter(w.commits),
    );
    r.register(
        "store_writes",
        "Writers whose turn ended in a commit (divide by store_commits for writers per commit)",
        counter(w.writes),
    );
    r.register(
        "store_writes_refused",
        "Writers refused because the write queue was full (answered 503 with Retry-After)",
        counter(w.refused),
    );
}

fn register_census(r: &mut Registry, c: &Census) {
    let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    r.register(
        "nodes",
        "Nodes by state (every state, zero included)",
        gauges(
            c.by_state
                .iter()
                .map(|(s, v)| (vec![("state", s.as_str().to_string())], n(*v))),
        ),
    );
    r.register(
        "nodes_by_image",
        "Nodes by the image digest of their newest boot (none: never booted)",
        gauges(
            c.by_image
                .iter()
                .map(|(d, v)| (vec![("image", d.clone())], n(*v))),
        ),
    );
    r.register(
        "nodes_by_group",
        "Nodes by the value of each label key [metrics] group_labels names, and state",
        gauges(c.by_group.iter().map(|((key, value, state), v)| {
            (
                vec![
                    ("key", key.clone()),
                    ("value", value.clone()),
                    ("state", state.as_str().to_string()),
                ],
                n(*v),
            )
        })),
    );
    r.register(
        "nodes_stuck",
        "Nodes longer than [metrics] stuck_after_secs in a state a boot passes through",
        gauges(
            c.stuck
                .iter()
                .map(|(s, v)| (vec![("state", s.as_str().to_string())], n(*v))),
        ),
    );
    r.register(
        "webhook_lag_events",
        "Events not yet delivered to each webhook",
        gauges(
            c.webhooks
                .iter()
                .map(|w| (vec![("webhook", w.webhook.clone())], n(w.events))),
        ),
    );
    r.register_with_unit(
        "webhook_lag",
        "Age of the oldest event not yet delivered to each webhook (0: caught up)",
        Unit::Seconds,
        {
            let family = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
            for w in &c.webhooks {
                family
                    .get_or_create(&vec![("webhook", w.webhook.clone())])
                    .set(w.seconds);
            }
            family
        },
    );
}
