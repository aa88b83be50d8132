//! A log line for what may come in floods (refused tokens, MACs past the discovery cap):
//! each occurrence is counted, and the count is logged at most every 10 s, so a flood
//! costs neither the log nor the database.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

const EVERY_MS: i64 = 10_000;

pub struct Sampled {
    what: &'static str,
    count: AtomicU64,
    logged_ms: AtomicI64,
}

impl Sampled {
    pub const fn new(what: &'static str) -> Self {
        Self {
            what,
            count: AtomicU64::new(0),
            logged_ms: AtomicI64::new(0),
        }
    }

    /// Counts one; logs the count (as a security warning) when 10 s have passed.
    pub fn note(&self) {
        self.count.fetch_add(1, Ordering::Relaxed);
        let now = crate::clock::now_ms();
        let last = self.logged_ms.load(Ordering::Relaxed);
        if now - last >= EVERY_MS
            && self
                .logged_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let count = self.count.swap(0, Ordering::Relaxed);
            tracing::warn!(security = true, count, "{}", self.what);
        }
    }
}
