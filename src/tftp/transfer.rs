//! One read transfer as a pure state machine: which blocks to send, when to retransmit,
//! when it is done. Time comes in as an argument; no sockets, no files.
//!
//! Blocks are numbered absolutely from 1 (u64); on the wire a block number is the low 16
//! bits, so files over 65535 blocks roll over to 0, as tftp-hpa, atftp, curl and iPXE
//! expect. An ACK is mapped back into the window in flight; a duplicate or stale ACK
//! changes nothing, so duplicates never trigger a duplicate burst (no Sorcerer's
//! Apprentice).

use std::time::{Duration, Instant};

use super::options::Negotiated;

/// What the socket loop must do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    SendOack,
    /// Send absolute blocks `first..=last`.
    SendBlocks {
        first: u64,
        last: u64,
    },
    /// Nothing to send; wait for a packet or the deadline.
    Wait,
    Done,
    Failed(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    AwaitOackAck,
    Sending,
    Finished,
}

/// Retransmission timing: RFC 6298-style estimate, with Karn's rule (no sample from a
/// retransmitted window), floored and capped, and never later than a negotiated timeout.
#[derive(Debug, Clone)]
struct Rto {
    srtt: Option<Duration>,
    rttvar: Duration,
    current: Duration,
    ceiling: Duration,
}

const INITIAL_RTO: Duration = Duration::from_millis(500);
const MIN_RTO: Duration = Duration::from_millis(20);
/// Before ACK 0 the server repeats its OACK only this late. A client that lost the OACK
/// repeats its request, which is answered at once (`on_duplicate`); a client whose ACK 0
/// was lost repeats it after its own timeout. atftp aborts on a second OACK ("unexpected
/// OACK"), so ours must come after atftp's 5 s timeout, not before.
const OACK_RETRY: Duration = Duration::from_secs(6);
/// Longer than clients' own 5 s timeout, so that a backed-off sender falls silent for
/// longer than it: atftp ignores duplicate blocks without re-acknowledging, and restarts
/// its timer on each one, so only a pause makes it repeat the ACK it lost. At exactly
/// 5 s the resends settled 5.0 s apart and one atftp fetch in 20 gave up at 5% loss.
const MAX_RTO: Duration = Duration::from_secs(6);

impl Rto {
    fn new(negotiated: Option<Duration>) -> Self {
        let ceiling = negotiated.unwrap_or(MAX_RTO).min(MAX_RTO);
        Self {
            srtt: None,
            rttvar: Duration::ZERO,
            current: INITIAL_RTO.min(ceiling),
            ceiling,
        }
    }

    fn sample(&mut self, rtt: Duration) {
        // An ACK the client repeated after its own timeout looks like a huge round trip;
        // clamping keeps one such sample from inflating the RTO past the client's timeout.
        let rtt = self.srtt.map_or(rtt, |s| rtt.min(s * 2));
        let (srtt, rttvar) = match self.srtt {
            None => (rtt, rtt / 2),
            Some(s) => {
                let diff = s.abs_diff(rtt);
                ((s * 7 + rtt) / 8, (self.rttvar * 3 + diff) / 4)
            }
        };
        self.srtt = Some(srtt);
        self.rttvar = rttvar;
        self.current =
            (srtt + (rttvar * 4).max(Duration::from_millis(5))).clamp(MIN_RTO, self.ceiling);
    }

    /// How long after a send a duplicate ACK or request counts as "the client is still
    /// waiting" rather than an echo of what is already in flight.
    /// Half a round trip: echoes of one event arrive within a packet time of each other,
    /// while a client that timed out repeats itself after its own timeout (seconds).
    fn duplicate_gap(&self) -> Duration {
        (self.srtt.unwrap_or(MIN_RTO) / 2).max(MIN_RTO)
    }

    fn back_off(&mut self) {
        self.current = (self.current * 2).min(self.ceiling);
    }
}

#[derive(Debug, Clone)]
pub struct Transfer {
    blksize: u64,
    window: u64,
    /// The final block: the first one shorter than blksize (maybe empty).
    last_block: u64,
    acked: u64,
    sent_up_to: u64,
    phase: Phase,
    retries: u32,
    max_retries: u32,
    rto: Rto,
    sent_at: Instant,
    /// Whether what is in flight was sent more than once (Karn's rule).
    retransmitted: bool,
    /// When we last sent something twice: until about two round trips later a duplicate
    /// ACK may be the client's echo of that copy rather than news.
    last_retransmit_at: Option<Instant>,
    pub retransmits: u64,
}

impl Transfer {
    pub fn new(file_len: u64, n: &Negotiated, max_retries: u32, now: Instant) -> Self {
        let blksize = n.blksize as u64;
        Self {
            blksize,
            window: n.windowsize.max(1) as u64,
            last_block: file_len / blksize + 1,
            acked: 0,
            sent_up_to: 0,
            phase: if n.oack.is_empty() {
                Phase::Sending
            } else {
                Phase::AwaitOackAck
            },
            retries: 0,
            max_retries,
            rto: Rto::new(n.timeout),
            sent_at: now,
            retransmitted: false,
            last_retransmit_at: None,
            retransmits: 0,
        }
    }

    pub fn blksize(&self) -> u64 {
        self.blksize
    }

    /// Byte range of absolute block `b` in a file of `len` bytes.
    pub fn block_range(&self, b: u64, len: u64) -> (u64, u64) {
        let start = ((b - 1) * self.blksize).min(len);
        (start, (start + self.blksize).min(len))
    }

    pub fn wire_block(b: u64) -> u16 {
        (b & 0xffff) as u16
    }

    /// The first thing to send.
    pub fn start(&mut self, now: Instant) -> Step {
        self.sent_at = now;
        match self.phase {
            Phase::AwaitOackAck => Step::SendOack,
            _ => self.send_window_after(0),
        }
    }

    /// The current retransmission timeout.
    pub fn rto(&self) -> Duration {
        self.rto.current
    }

    pub fn deadline(&self) -> Instant {
        match self.phase {
            Phase::AwaitOackAck => self.sent_at + OACK_RETRY,
            _ => self.sent_at + self.rto.current,
        }
    }

    /// Whether the final block has been sent (maybe not yet acknowledged).
    pub fn all_sent(&self) -> bool {
        self.sent_up_to == self.last_block
    }

    pub fn bytes_acked(&self, len: u64) -> u64 {
        (self.acked * self.blksize).min(len)
    }

    fn send_window_after(&mut self, acked: u64) -> Step {
        let first = acked + 1;
        let last = (acked + self.window).min(self.last_block);
        self.sent_up_to = last;
        Step::SendBlocks { first, last }
    }

    pub fn on_ack(&mut self, wire: u16, now: Instant) -> Step {
        match self.phase {
            Phase::Finished => Step::Done,
            Phase::AwaitOackAck if wire == 0 => {
                // No RTT sample here: when ACK 0 is lost the client repeats it after its
                // own timeout (a second or more), and that must not become our RTO.
                self.phase = Phase::Sending;
                self.sent_at = now;
                self.send_window_after(0)
            }
            Phase::AwaitOackAck => Step::Wait,
            Phase::Sending => {
                // Only blocks in flight can be acknowledged; anything else is stale.
                let span = self.sent_up_to - self.acked;
                let offset = (wire as u64).wrapping_sub(self.acked) & 0xffff;
                if offset == 0 {
                    return self.on_duplicate(now);
                }
                if offset > span {
                    return Step::Wait;
                }
                let block = self.acked + offset;
                if block == self.sent_up_to {
                    self.sample(now);
                }
                self.acked = block;
                self.retries = 0;
                if block == self.last_block {
                    self.phase = Phase::Finished;
                    return Step::Done;
                }
                self.sent_at = now;
                self.retransmitted = false;
                // A mid-window ACK means the client lost what followed: resend from there.
                self.send_window_after(block)
            }
        }
    }

    /// The client repeated its last ACK, or its request: it is missing what is in flight
    /// (a window whose first block was lost, an ACK of ours it never got). Resend at once,
    /// unless the repeat may be an echo of a copy we sent twice (Sorcerer's Apprentice):
    /// within two round trips of a retransmission, resend at most once per half round trip.
    pub fn on_duplicate(&mut self, now: Instant) -> Step {
        if self.phase == Phase::Finished {
            return Step::Wait;
        }
        let echo_possible = self
            .last_retransmit_at
            .is_some_and(|t| now.saturating_duration_since(t) < self.rto.duplicate_gap() * 4);
        if echo_possible && now.saturating_duration_since(self.sent_at) < self.rto.duplicate_gap() {
            return Step::Wait;
        }
        let step = match self.phase {
            Phase::AwaitOackAck => Step::SendOack,
            _ if self.sent_up_to > self.acked => Step::SendBlocks {
                first: self.acked + 1,
                last: self.sent_up_to,
            },
            _ => return Step::Wait,
        };
        self.note_retransmit(now);
        step
    }

    fn note_retransmit(&mut self, now: Instant) {
        self.retransmits += 1;
        self.retransmitted = true;
        self.last_retransmit_at = Some(now);
        self.sent_at = now;
    }

    fn sample(&mut self, now: Instant) {
        if !self.retransmitted {
            self.rto.sample(now.saturating_duration_since(self.sent_at));
        }
    }

    /// The deadline passed with no progress: resend what is in flight, or give up.
    pub fn on_timeout(&mut self, now: Instant) -> Step {
        if self.phase == Phase::Finished {
            return Step::Done;
        }
        if self.retries >= self.max_retries {
            return Step::Failed(format!(
                "no acknowledgement after {} retransmissions",
                self.retries
            ));
        }
        self.retries += 1;
        self.note_retransmit(now);
        self.rto.back_off();
        match self.phase {
            Phase::AwaitOackAck => Step::SendOack,
            _ => Step::SendBlocks {
                first: self.acked + 1,
                last: self.sent_up_to,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tftp::options::{OptionLimits, negotiate};

    fn transfer(len: u64, opts: &[(&str, &str)]) -> (Transfer, Instant) {
        let requested: Vec<_> = opts
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let n = negotiate(&requested, len, OptionLimits::default());
        let now = Instant::now();
        (Transfer::new(len, &n, 5, now), now)
    }

    #[test]
    fn lockstep_without_options_ends_with_a_short_block() {
        let (mut t, now) = transfer(1024, &[]);
        assert_eq!(t.start(now), Step::SendBlocks { first: 1, last: 1 });
        assert_eq!(t.on_ack(1, now), Step::SendBlocks { first: 2, last: 2 });
        // 1024 = 2 x 512: a final empty block says "end".
        assert_eq!(t.on_ack(2, now), Step::SendBlocks { first: 3, last: 3 });
        assert_eq!(t.block_range(3, 1024), (1024, 1024));
        assert_eq!(t.on_ack(3, now), Step::Done);
    }

    #[test]
    fn duplicate_acks_never_cause_a_second_burst() {
        let (mut t, now) = transfer(5000, &[]);
        t.start(now);
        assert_eq!(t.on_ack(1, now), Step::SendBlocks { first: 2, last: 2 });
        // A repeated ACK with no copy of ours about is news: resend at once, once.
        assert_eq!(t.on_ack(1, now), Step::SendBlocks { first: 2, last: 2 });
        // Now copies are about: repeats are echoes, whatever their number.
        for _ in 0..10 {
            assert_eq!(t.on_ack(1, now), Step::Wait, "Sorcerer's Apprentice");
        }
        let soon = now + Duration::from_millis(1);
        assert_eq!(t.on_ack(1, soon), Step::Wait, "an echo within a round trip");
        // Much later the same ACK means "still waiting": resend, once.
        let later = now + Duration::from_millis(900);
        assert_eq!(t.on_ack(1, later), Step::SendBlocks { first: 2, last: 2 });
        assert_eq!(t.on_ack(1, later), Step::Wait);
        assert_eq!(t.retransmits, 2);
        assert_eq!(t.on_ack(0, now), Step::Wait);
        assert_eq!(t.on_ack(9, now), Step::Wait, "beyond what was sent");
    }

    #[test]
    fn oack_then_windows_and_mid_window_recovery() {
        let (mut t, now) = transfer(10 * 1468, &[("blksize", "1468"), ("windowsize", "4")]);
        assert_eq!(t.start(now), Step::SendOack);
        assert_eq!(t.on_ack(5, now), Step::Wait, "only ACK 0 answers an OACK");
        assert_eq!(t.on_ack(0, now), Step::SendBlocks { first: 1, last: 4 });
        assert_eq!(t.on_ack(4, now), Step::SendBlocks { first: 5, last: 8 });
        // Client got 5 and 6 only.
        assert_eq!(t.on_ack(6, now), Step::SendBlocks { first: 7, last: 10 });
        assert_eq!(
            t.on_ack(10, now),
            Step::SendBlocks {
                first: 11,
                last: 11
            }
        );
        assert_eq!(t.on_ack(11, now), Step::Done);
    }

    #[test]
    fn block_numbers_roll_over() {
        let len = 70_000 * 512;
        let (mut t, now) = transfer(len, &[("windowsize", "8")]);
        t.start(now);
        t.on_ack(0, now);
        let mut acked = 0u64;
        while acked < 65_528 {
            acked += 8;
            t.on_ack(Transfer::wire_block(acked), now);
        }
        // 65529..=65536 in flight: 65536 is wire block 0.
        assert_eq!(Transfer::wire_block(65_536), 0);
        assert_eq!(
            t.on_ack(0, now),
            Step::SendBlocks {
                first: 65_537,
                last: 65_544
            }
        );
        assert_eq!(t.block_range(65_537, len), (65_536 * 512, 65_537 * 512));
    }

    #[test]
    fn timeouts_retransmit_then_give_up() {
        let (mut t, now) = transfer(100_000, &[("windowsize", "4")]);
        t.start(now);
        t.on_ack(0, now);
        let d1 = t.deadline();
        assert_eq!(t.on_timeout(d1), Step::SendBlocks { first: 1, last: 4 });
        assert!(t.deadline() - d1 > d1 - now, "backs off");
        for _ in 0..4 {
            let d = t.deadline();
            assert!(matches!(t.on_timeout(d), Step::SendBlocks { .. }));
        }
        assert!(matches!(t.on_timeout(t.deadline()), Step::Failed(_)));
        assert_eq!(t.retransmits, 5);
    }

    #[test]
    fn rto_adapts_to_fast_acks() {
        let (mut t, now) = transfer(100_000, &[]);
        t.start(now);
        let mut at = now;
        for b in 1..20u16 {
            at += Duration::from_micros(200);
            t.on_ack(b, at);
        }
        assert!(
            t.deadline() - at <= Duration::from_millis(25),
            "{:?}",
            t.deadline() - at
        );
        // A negotiated timeout caps the estimate, it never lengthens it.
        let (t, _) = transfer(100, &[("timeout", "1")]);
        assert!(t.rto.current <= Duration::from_secs(1));
    }
}

#[cfg(test)]
mod duplicate_request_tests {
    use super::*;
    use crate::tftp::options::{OptionLimits, negotiate};

    #[test]
    fn repeated_requests_resend_the_oack_at_most_once_per_round_trip() {
        let requested = vec![("blksize".to_string(), "1468".to_string())];
        let n = negotiate(&requested, 10_000, OptionLimits::default());
        let now = Instant::now();
        let mut t = Transfer::new(10_000, &n, 5, now);
        assert_eq!(t.start(now), Step::SendOack);
        assert_eq!(t.on_duplicate(now), Step::SendOack);
        assert_eq!(t.on_duplicate(now), Step::Wait);
        let later = now + Duration::from_millis(500);
        assert_eq!(t.on_duplicate(later), Step::SendOack);
        assert_eq!(t.on_duplicate(later), Step::Wait);
    }
}
