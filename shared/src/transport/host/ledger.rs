//! Per-VM accounting and budgets of the host transport (pure, no I/O).
//!
//! Every guest agent instance is a *session*; its records carry consecutive
//! sequence numbers. For each session the host keeps the next number it
//! expects and counts what it delivered, what it saw twice (resends) and the
//! numbers that never arrived (lost in transit). With the guest's own report
//! (`produced`, `dropped_full`) this gives, per VM, the identity
//!
//! `produced = before_host + delivered + lost_in_transit + in_flight`
//!
//! where `before_host` are records numbered before this host agent first heard
//! of the session (delivered to an earlier host agent) and `in_flight` those
//! the guest has numbered but the host has not seen yet.

use std::collections::VecDeque;
use std::time::Instant;

use serde::Serialize;

/// A token bucket: `rate` tokens per second, at most `burst` saved up.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    pub fn new(rate: f64, burst: f64) -> Self {
        TokenBucket {
            rate: rate.max(0.0),
            burst: burst.max(1.0),
            tokens: burst.max(1.0),
            at: Instant::now(),
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        self.at = now;
    }

    /// Takes `n` tokens if they are there.
    pub fn try_take(&mut self, n: f64, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= n {
            self.tokens -= n;
            true
        } else {
            false
        }
    }

    /// Takes `n` tokens, going into debt; returns how long the caller must wait
    /// until the debt is paid (zero when there was enough).
    pub fn take_debt(&mut self, n: f64, now: Instant) -> std::time::Duration {
        self.refill(now);
        self.tokens -= n;
        if self.tokens >= 0.0 || self.rate <= 0.0 {
            std::time::Duration::ZERO
        } else {
            std::time::Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }
}

/// What to do with a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Deliver the batch's records from index `skip` on (the first `skip` were
    /// delivered before).
    Deliver { skip: usize },
    /// A gap inside a connection: the stream lost bytes or frames. The guest
    /// must reconnect and resend from `expected`.
    Resync { expected: u64 },
}

/// Accounting of one guest agent session.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SessionLedger {
    pub session: u64,
    /// First sequence number this host saw (None: no batch yet).
    pub before_host: Option<u64>,
    /// Next sequence number expected.
    pub next: u64,
    pub delivered: u64,
    pub lost_in_transit: u64,
    pub duplicates: u64,
    pub resyncs: u64,
    /// The guest's latest report.
    pub produced: u64,
    pub dropped_full: u64,
}

impl SessionLedger {
    pub fn new(session: u64) -> Self {
        SessionLedger {
            session,
            ..Default::default()
        }
    }

    /// Where the guest should resume after a (re)connection.
    pub fn resume(&self) -> Option<u64> {
        self.before_host.map(|_| self.next)
    }

    /// Accounts for a batch of `n` records numbered from `first`.
    /// `first_on_conn`: the first batch of a new connection, which starts where
    /// the guest still has records — a gap there is final.
    pub fn on_batch(&mut self, first: u64, n: usize, first_on_conn: bool) -> Admit {
        let Some(_) = self.before_host else {
            self.before_host = Some(first);
            self.next = first.saturating_add(n as u64);
            self.delivered += n as u64;
            return Admit::Deliver { skip: 0 };
        };
        if first > self.next {
            if !first_on_conn {
                self.resyncs += 1;
                return Admit::Resync {
                    expected: self.next,
                };
            }
            self.lost_in_transit += first - self.next;
            self.next = first;
        }
        let skip = (self.next - first).min(n as u64);
        self.duplicates += skip;
        self.delivered += n as u64 - skip;
        self.next = self.next.max(first.saturating_add(n as u64));
        Admit::Deliver {
            skip: skip as usize,
        }
    }

    /// Takes the guest's own report (a lying guest only misreports itself).
    pub fn on_stats(&mut self, produced: u64, dropped_full: u64) {
        self.produced = self.produced.max(produced);
        self.dropped_full = self.dropped_full.max(dropped_full);
    }

    /// Numbered by the guest but not (yet) seen here.
    pub fn in_flight(&self) -> u64 {
        self.produced.saturating_sub(self.next)
    }
}

/// Per-VM transport counters (sessions folded in).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VmAccount {
    pub vm: String,
    /// Records the guest agents say they numbered.
    pub produced: u64,
    /// Records numbered before this host agent heard of their session.
    pub before_host: u64,
    pub delivered: u64,
    pub lost_in_transit: u64,
    /// Numbered by the guest, not seen here (yet).
    pub in_flight: u64,
    /// Refused by the guests' full send buffers (their own count).
    pub guest_dropped_full: u64,
    pub duplicates: u64,
    pub resyncs: u64,
    pub sessions: u64,
    pub connections: u64,
    pub rejected_connections: u64,
    pub bad_connections: u64,
    pub handshake_timeouts: u64,
    pub idle_timeouts: u64,
    pub clock_samples: u64,
    pub clock_rejected: u64,
    pub clock_rate_limited: u64,
    /// Time this VM's connections were not read because it exceeded its byte budget.
    pub throttled_ms: u64,
    /// Time this VM's connections waited for the agent to take its pending records.
    pub backpressure_ms: u64,
}

impl VmAccount {
    /// `produced == before_host + delivered + lost_in_transit + in_flight`.
    pub fn balanced(&self) -> bool {
        self.produced == self.before_host + self.delivered + self.lost_in_transit + self.in_flight
    }
}

/// The sessions of one VM (bounded: the least recently used is folded into the
/// totals when a new one would exceed `max`).
#[derive(Clone, Debug, Default)]
pub struct VmLedger {
    sessions: VecDeque<SessionLedger>,
    retired: VmAccount,
    pub counters: VmAccount,
    max: usize,
}

impl VmLedger {
    pub fn new(max_sessions: usize) -> Self {
        VmLedger {
            max: max_sessions.max(1),
            ..Default::default()
        }
    }

    /// The session's ledger, created (and moved to the front) as needed.
    pub fn session(&mut self, id: u64) -> &mut SessionLedger {
        match self.sessions.iter().position(|s| s.session == id) {
            Some(i) => {
                let s = self
                    .sessions
                    .remove(i)
                    .unwrap_or_else(|| SessionLedger::new(id));
                self.sessions.push_front(s);
            }
            None => {
                if self.sessions.len() >= self.max {
                    if let Some(old) = self.sessions.pop_back() {
                        fold(&mut self.retired, &old);
                    }
                }
                self.counters.sessions += 1;
                self.sessions.push_front(SessionLedger::new(id));
            }
        }
        &mut self.sessions[0]
    }

    /// The session's resume point, without creating it.
    pub fn resume(&self, id: u64) -> Option<u64> {
        self.sessions
            .iter()
            .find(|s| s.session == id)
            .and_then(SessionLedger::resume)
    }

    /// Totals over every session, live and retired.
    pub fn account(&self, vm: &str) -> VmAccount {
        let mut a = self.counters.clone();
        a.vm = vm.to_string();
        let r = &self.retired;
        a.produced = r.produced;
        a.before_host = r.before_host;
        a.delivered = r.delivered;
        a.lost_in_transit = r.lost_in_transit;
        a.in_flight = r.in_flight;
        a.guest_dropped_full = r.guest_dropped_full;
        a.duplicates = r.duplicates;
        a.resyncs = r.resyncs;
        for s in &self.sessions {
            fold(&mut a, s);
        }
        a
    }
}

fn fold(a: &mut VmAccount, s: &SessionLedger) {
    a.produced += s.produced.max(s.next);
    a.before_host += s.before_host.unwrap_or(0);
    a.delivered += s.delivered;
    a.lost_in_transit += s.lost_in_transit;
    a.in_flight += s.in_flight();
    a.guest_dropped_full += s.dropped_full;
    a.duplicates += s.duplicates;
    a.resyncs += s.resyncs;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn in_order_resend_gap_and_report_balance() {
        let mut s = SessionLedger::new(1);
        assert_eq!(s.resume(), None);
        assert_eq!(s.on_batch(0, 10, true), Admit::Deliver { skip: 0 });
        assert_eq!(s.resume(), Some(10));
        // A resend overlapping what was delivered.
        assert_eq!(s.on_batch(5, 10, true), Admit::Deliver { skip: 5 });
        assert_eq!((s.next, s.delivered, s.duplicates), (15, 15, 5));
        // A gap inside a connection asks for a resync and changes nothing.
        assert_eq!(s.on_batch(20, 5, false), Admit::Resync { expected: 15 });
        assert_eq!((s.next, s.delivered, s.resyncs), (15, 15, 1));
        // On a new connection the guest starts where it still has records: final.
        assert_eq!(s.on_batch(18, 2, true), Admit::Deliver { skip: 0 });
        assert_eq!((s.next, s.lost_in_transit), (20, 3));
        // A batch entirely below `next` is all duplicates.
        assert_eq!(s.on_batch(0, 4, false), Admit::Deliver { skip: 4 });
        s.on_stats(25, 7);
        s.on_stats(3, 1); // a stale report never lowers the counts
        assert_eq!((s.produced, s.dropped_full, s.in_flight()), (25, 7, 5));
        let mut v = VmLedger::new(4);
        *v.session(1) = s;
        let a = v.account("vm");
        assert!(a.balanced(), "{a:?}");
        assert_eq!(
            (a.produced, a.delivered, a.lost_in_transit, a.in_flight),
            (25, 17, 3, 5)
        );
    }

    #[test]
    fn a_session_first_seen_late_counts_what_came_before() {
        let mut s = SessionLedger::new(9);
        assert_eq!(s.on_batch(1000, 10, true), Admit::Deliver { skip: 0 });
        s.on_stats(1010, 0);
        let mut v = VmLedger::new(2);
        *v.session(9) = s;
        let a = v.account("vm");
        assert_eq!((a.before_host, a.delivered, a.in_flight), (1000, 10, 0));
        assert!(a.balanced());
    }

    #[test]
    fn sessions_are_bounded_and_retired_ones_still_count() {
        let mut v = VmLedger::new(2);
        for id in 0..50u64 {
            let s = v.session(id);
            s.on_batch(0, 3, true);
            s.on_stats(4, 0);
        }
        assert_eq!(v.sessions.len(), 2);
        let a = v.account("vm");
        assert_eq!((a.sessions, a.delivered, a.in_flight), (50, 150, 50));
        assert!(a.balanced());
        assert_eq!(v.resume(49), Some(3));
        assert_eq!(v.resume(0), None);
    }

    #[test]
    fn token_buckets() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10.0, 5.0);
        for _ in 0..5 {
            assert!(b.try_take(1.0, t0));
        }
        assert!(!b.try_take(1.0, t0));
        assert!(b.try_take(1.0, t0 + Duration::from_millis(150)));
        let mut d = TokenBucket::new(1000.0, 1000.0);
        assert_eq!(d.take_debt(1000.0, t0), Duration::ZERO);
        let w = d.take_debt(500.0, t0);
        assert!((w.as_secs_f64() - 0.5).abs() < 1e-6, "{w:?}");
    }
}
