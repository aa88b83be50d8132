//! Failed authentications limited per source: after `max` failures within a window, a
//! source's admin requests (the API, the console's login, the scrape) are refused (429,
//! Retry-After) until the window ends, so a token cannot be guessed at the speed of the
//! network. IPv6 sources count by /64, the block one host is usually given. A site whose
//! operators share an address (NAT, a bastion) raises `[http] auth_failures_per_minute`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failures a source may make in one window, unless `[http] auth_failures_per_minute`
/// says otherwise.
pub const MAX_FAILURES: u32 = 20;
/// How long a window lasts, from a source's first failure in it.
pub const WINDOW: Duration = Duration::from_secs(60);
/// Sources tracked at once; past it, expired windows are dropped, and a source that
/// still finds no room is not tracked (and so not limited) until one expires.
const MAX_SOURCES: usize = 65_536;

pub struct FailureLimiter {
    max: u32,
    window: Duration,
    sources: Mutex<HashMap<IpAddr, (u32, Instant)>>,
}

/// The key a source is counted under: the address, or its /64.
fn key(source: IpAddr) -> IpAddr {
    match source {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(bits.into())
            }
        },
        v4 => v4,
    }
}

impl FailureLimiter {
    pub fn new(max: u32, window: Duration) -> Self {
        Self {
            max,
            window,
            sources: Mutex::new(HashMap::new()),
        }
    }

    /// Ok when `source` may try now; else how long until it may.
    pub fn check(&self, source: IpAddr, now: Instant) -> Result<(), Duration> {
        let sources = self
            .sources
            .lock()
            .expect("the limiter's lock is never poisoned");
        match sources.get(&key(source)) {
            Some(&(failures, since)) if failures >= self.max => {
                let ends = since + self.window;
                if now < ends { Err(ends - now) } else { Ok(()) }
            }
            _ => Ok(()),
        }
    }

    /// Counts one failure from `source`.
    pub fn failed(&self, source: IpAddr, now: Instant) {
        let mut sources = self
            .sources
            .lock()
            .expect("the limiter's lock is never poisoned");
        let window = self.window;
        if sources.len() >= MAX_SOURCES {
            sources.retain(|_, (_, since)| now.duration_since(*since) < window);
        }
        let key = key(source);
        if sources.len() >= MAX_SOURCES && !sources.contains_key(&key) {
            return;
        }
        let entry = sources.entry(key).or_insert((0, now));
        if now.duration_since(entry.1) >= window {
            *entry = (0, now);
        }
        entry.0 = entry.0.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_is_refused_after_its_failures_until_the_window_ends() {
        let limiter = FailureLimiter::new(3, Duration::from_secs(60));
        let t0 = Instant::now();
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        for i in 0..3 {
            assert!(limiter.check(a, t0).is_ok(), "failure {i} is still allowed");
            limiter.failed(a, t0);
        }
        let wait = limiter.check(a, t0 + Duration::from_secs(10)).unwrap_err();
        assert_eq!(wait, Duration::from_secs(50));
        assert!(
            limiter.check(b, t0).is_ok(),
            "another source is not limited"
        );
        assert!(limiter.check(a, t0 + Duration::from_secs(60)).is_ok());
        // A new window starts from zero.
        limiter.failed(a, t0 + Duration::from_secs(61));
        assert!(limiter.check(a, t0 + Duration::from_secs(62)).is_ok());
    }

    #[test]
    fn ipv6_sources_count_by_their_64() {
        let limiter = FailureLimiter::new(2, Duration::from_secs(60));
        let t0 = Instant::now();
        limiter.failed("2001:db8::1".parse().unwrap(), t0);
        limiter.failed("2001:db8::2".parse().unwrap(), t0);
        assert!(limiter.check("2001:db8::3".parse().unwrap(), t0).is_err());
        assert!(
            limiter
                .check("2001:db8:0:1::1".parse().unwrap(), t0)
                .is_ok()
        );
        let mapped: IpAddr = "::ffff:192.0.2.9".parse().unwrap();
        limiter.failed(mapped, t0);
        limiter.failed("192.0.2.9".parse().unwrap(), t0);
        assert!(limiter.check("192.0.2.9".parse().unwrap(), t0).is_err());
    }
}
