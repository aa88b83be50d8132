//! TFTP counters (for the metrics endpoint) and the per-transfer event (for the node
//! timeline).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", content = "reason", rename_all = "lowercase")]
pub enum Outcome {
    Completed,
    /// Every block was sent, but the final ACK never came and the client's port closed:
    /// almost always a client that got everything and did not wait for a retransmission.
    Unconfirmed,
    /// Refused before any data: bad name, missing file, unsupported mode.
    Refused(String),
    /// The client sent an ERROR packet.
    Aborted(String),
    /// Retries or the total timeout ran out, or the client became unreachable.
    Failed(String),
}

/// One transfer, as the node timeline sees it.
#[derive(Debug, Clone, Serialize)]
pub struct TransferEvent {
    pub client: SocketAddr,
    pub file: String,
    /// Bytes the client acknowledged.
    pub bytes: u64,
    pub duration: Duration,
    pub retransmits: u64,
    #[serde(flatten)]
    pub outcome: Outcome,
}

impl TransferEvent {
    /// One line for a boot timeline: `ok, 70656 bytes in 310 ms`, or what went wrong.
    pub fn summary(&self) -> String {
        let sent = format!("{} bytes in {} ms", self.bytes, self.duration.as_millis());
        let retransmits = match self.retransmits {
            0 => String::new(),
            n => format!(", {n} retransmits"),
        };
        match &self.outcome {
            Outcome::Completed => format!("ok, {sent}{retransmits}"),
            Outcome::Unconfirmed => format!("ok (last ACK not seen), {sent}{retransmits}"),
            Outcome::Refused(why) => format!("refused: {why}"),
            Outcome::Aborted(why) => format!("aborted by the client after {sent}: {why}"),
            Outcome::Failed(why) => format!("failed after {sent}: {why}"),
        }
    }
}

#[derive(Debug, Default)]
pub struct TftpMetrics {
    pub requests: AtomicU64,
    pub completed: AtomicU64,
    pub refused: AtomicU64,
    pub aborted: AtomicU64,
    pub failed: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub retransmits: AtomicU64,
    /// Datagrams dropped because they did not parse or came where none was expected.
    pub malformed: AtomicU64,
    pub refused_paths: AtomicU64,
    pub refused_writes: AtomicU64,
    pub refused_busy: AtomicU64,
    /// Requests repeated by a client whose transfer was already running.
    pub duplicate_requests: AtomicU64,
}

impl TftpMetrics {
    pub fn record(&self, e: &TransferEvent) {
        let counter = match e.outcome {
            Outcome::Completed | Outcome::Unconfirmed => &self.completed,
            Outcome::Refused(_) => &self.refused,
            Outcome::Aborted(_) => &self.aborted,
            Outcome::Failed(_) => &self.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.bytes_sent.fetch_add(e.bytes, Ordering::Relaxed);
        self.retransmits.fetch_add(e.retransmits, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> serde_json::Value {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        serde_json::json!({
            "requests": g(&self.requests),
            "completed": g(&self.completed),
            "refused": g(&self.refused),
            "aborted": g(&self.aborted),
            "failed": g(&self.failed),
            "bytes_sent": g(&self.bytes_sent),
            "retransmits": g(&self.retransmits),
            "malformed": g(&self.malformed),
            "refused_paths": g(&self.refused_paths),
            "refused_writes": g(&self.refused_writes),
            "refused_busy": g(&self.refused_busy),
            "duplicate_requests": g(&self.duplicate_requests),
        })
    }
}
