//! DHCP counters: what was answered and what was dropped, by reason. Read by `/metrics`
//! (a later issue) and by tests.

use std::collections::BTreeMap;
use std::sync::Mutex;

#[derive(Default)]
pub struct DhcpMetrics {
    counts: Mutex<BTreeMap<String, u64>>,
}

impl DhcpMetrics {
    pub fn count(&self, what: &str) {
        *self
            .counts
            .lock()
            .expect("not poisoned")
            .entry(what.to_string())
            .or_default() += 1;
    }

    /// Every counter: `offer`, `ack`, `nak`, `malformed.<reason>`, `ignored.<reason>`...
    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        self.counts.lock().expect("not poisoned").clone()
    }
}
