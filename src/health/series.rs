//! A counter's recent values, kept only when they change: how much it rose within a
//! window, with resets (a driver reload zeroes NVML's volatile counters) counted as
//! rises from zero. A steady counter costs one point.

use std::collections::VecDeque;

/// The most points a series keeps; past it the oldest go (their rises are then older
/// than anything a rule looks at, or the counter is changing every few seconds anyway).
const MAX_POINTS: usize = 32;

#[derive(Debug, Default, Clone)]
pub struct Series {
    /// (milliseconds, value), oldest first; consecutive values differ.
    points: VecDeque<(i64, u64)>,
}

impl Series {
    /// Records `value` at `at_ms`, dropping points older than `keep_ms` but the newest
    /// of those (the baseline a rise is measured from).
    pub fn push(&mut self, at_ms: i64, value: u64, keep_ms: i64) {
        if self.points.back().is_none_or(|&(_, v)| v != value) {
            self.points.push_back((at_ms, value));
        }
        while self.points.len() > MAX_POINTS
            || (self.points.len() > 1 && self.points[1].0 < at_ms - keep_ms)
        {
            self.points.pop_front();
        }
    }

    /// How much the counter rose in the `window_ms` before `now_ms`.
    pub fn rise(&self, now_ms: i64, window_ms: i64) -> u64 {
        let start = now_ms - window_ms;
        let mut rise = 0;
        for pair in self.points.iter().collect::<Vec<_>>().windows(2) {
            let (&(_, before), &(at, after)) = (pair[0], pair[1]);
            if at >= start {
                // A counter that went down was reset: all of `after` is new.
                rise += if after >= before {
                    after - before
                } else {
                    after
                };
            }
        }
        rise
    }

    /// Points kept (a steady counter keeps one).
    pub fn points(&self) -> usize {
        self.points.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rises_within_the_window_count_and_a_steady_counter_costs_one_point() {
        let mut s = Series::default();
        for t in 0..100 {
            s.push(t * 1000, 7, 60_000);
        }
        assert_eq!(s.points(), 1);
        assert_eq!(s.rise(100_000, 60_000), 0);
        s.push(100_000, 10, 60_000);
        s.push(110_000, 15, 60_000);
        assert_eq!(s.rise(110_000, 60_000), 8);
        // Later, the early rise leaves the window.
        s.push(165_000, 16, 60_000);
        assert_eq!(s.rise(165_000, 60_000), 6);
        assert_eq!(s.rise(200_000, 60_000), 1);
    }

    #[test]
    fn a_reset_counts_as_a_rise_from_zero() {
        let mut s = Series::default();
        s.push(0, 100, 60_000);
        s.push(1000, 3, 60_000);
        assert_eq!(s.rise(1000, 60_000), 3);
    }

    #[test]
    fn it_stays_bounded() {
        let mut s = Series::default();
        for t in 0..1000 {
            s.push(t, t as u64, i64::MAX / 2);
        }
        assert!(s.points() <= MAX_POINTS);
    }
}
