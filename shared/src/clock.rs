//! Mapping the guest's `CLOCK_MONOTONIC` onto the host's.
//!
//! The relation is modelled as `host = guest + θ(guest)` with a linear offset
//! `θ(g) = a + b·(g − g_ref)` (`b` is the relative drift, e.g. ±100 ppm).
//!
//! Every NTP-style exchange gives an *interval* that must contain the true
//! offset at the guest time of the exchange:
//! * guest-initiated (`t1` guest send, `t2` host receive, `t3` host send,
//!   `t4` guest receive): `t3 − t4 ≤ θ ≤ t2 − t1`;
//! * host-initiated (`h1` host send, `g2`/`g3` guest receive/send, `h4`):
//!   `h1 − g2 ≤ θ ≤ h4 − g3`.
//!
//! The interval's half-width is half the round-trip time. A joined block request
//! is such an exchange too (the guest publishes it before the host pops it, and
//! the host pushes it before the guest completes it), so the join feeds its
//! pairs back with [`ClockEstimator::add_request`]; this is the causality
//! tightener, and [`narrow`] applies one record's own causal bounds to that
//! record's mapping.
//!
//! Filtering and fit: samples are bucketed by guest time ([`ClockConfig::bucket_ns`]),
//! each bucket keeps only its minimum-RTT sample, only the newest
//! [`ClockConfig::max_buckets`] buckets are kept, and buckets whose RTT is far
//! above the best are ignored. The line is a Theil–Sen fit (median of pairwise
//! slopes, median intercept) over the bucket minima.
//!
//! Stated uncertainty `U(g)` is a bound that holds whenever the true offset is
//! linear over the window and the drift is at most [`ClockConfig::max_drift_ppm`].
//! Each fitted sample `i` bounds the fit error there by
//! `E_i = halfRTT_i + |residual_i|` (half its RTT plus the fit's residual);
//! the error of a line is linear, so between two fitted samples it is bounded by
//! the interpolation (or the max) of their `E`, and beyond the fitted span at
//! distance `d` from sample `b` by `E_b + d·(E_a + E_b)/|g_b − g_a|` for any other
//! sample `a`, or `E_b + d·(max_drift + |slope|)`; the smallest such bound is used.

use std::collections::VecDeque;

#[path = "clock_fit.rs"]
mod fit;
use fit::{compute_fit, Fit};

/// Reads `CLOCK_MONOTONIC` in nanoseconds (the clock BPF's `bpf_ktime_get_ns` uses).
pub fn monotonic_ns() -> u64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
        Ok(ts) => (ts.tv_sec() as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(ts.tv_nsec() as u64),
        // CLOCK_MONOTONIC cannot fail on Linux; fall back to 0 rather than panic.
        Err(_) => 0,
    }
}

/// Errors for clock samples.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClockError {
    #[error("invalid clock sample: {0}")]
    InvalidSample(&'static str),
}

/// Tuning of the estimator.
#[derive(Clone, Debug)]
pub struct ClockConfig {
    /// Width of a min-RTT bucket in guest ns.
    pub bucket_ns: u64,
    /// Number of newest buckets kept (the window is `bucket_ns · max_buckets`).
    pub max_buckets: usize,
    /// Buckets whose half-RTT exceeds `outlier_factor ·` best + `outlier_slack_ns` are not fitted.
    pub outlier_factor: f64,
    pub outlier_slack_ns: u64,
    /// Largest plausible drift between the two clocks.
    pub max_drift_ppm: f64,
    /// Added to every bound to cover integer rounding.
    pub rounding_slack_ns: u64,
}

impl Default for ClockConfig {
    fn default() -> Self {
        ClockConfig {
            bucket_ns: 1_000_000_000,
            max_buckets: 60,
            outlier_factor: 3.0,
            outlier_slack_ns: 1_000,
            max_drift_ppm: 500.0,
            rounding_slack_ns: 4,
        }
    }
}

/// Where a sample came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleSource {
    Probe,
    Request,
}

/// One offset interval at a guest time: `lo ≤ θ(guest_ns) ≤ hi`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OffsetSample {
    pub guest_ns: u64,
    pub lo: i64,
    pub hi: i64,
    pub source: SampleSource,
}

impl OffsetSample {
    pub fn half_width(&self) -> f64 {
        (self.hi as f64 - self.lo as f64) / 2.0
    }
    pub fn center(&self) -> f64 {
        self.lo as f64 + (self.hi as f64 - self.lo as f64) / 2.0
    }

    /// From a guest-initiated exchange; `max_drift` (fraction) widens the interval
    /// for the drift during the exchange itself.
    pub fn guest_initiated(
        t1: u64,
        t2: u64,
        t3: u64,
        t4: u64,
        max_drift: f64,
        source: SampleSource,
    ) -> Result<Self, ClockError> {
        if t4 < t1 {
            return Err(ClockError::InvalidSample("guest receive before guest send"));
        }
        if t3 < t2 {
            return Err(ClockError::InvalidSample("host send before host receive"));
        }
        if t3 - t2 > t4 - t1 {
            return Err(ClockError::InvalidSample(
                "host time exceeds guest round trip (negative RTT)",
            ));
        }
        let hi_at_t1 = sub_i64(t2, t1);
        let lo_at_t4 = sub_i64(t3, t4);
        let half = (t4 - t1) / 2;
        let g = t1 + half;
        let widen = ceil_i64(half as f64 * max_drift);
        Ok(OffsetSample {
            guest_ns: g,
            lo: lo_at_t4.saturating_sub(widen),
            hi: hi_at_t1.saturating_add(widen),
            source,
        })
    }

    /// From a host-initiated exchange.
    pub fn host_initiated(
        h1: u64,
        g2: u64,
        g3: u64,
        h4: u64,
        max_drift: f64,
    ) -> Result<Self, ClockError> {
        if h4 < h1 {
            return Err(ClockError::InvalidSample("host receive before host send"));
        }
        if g3 < g2 {
            return Err(ClockError::InvalidSample("guest send before guest receive"));
        }
        if g3 - g2 > h4 - h1 {
            return Err(ClockError::InvalidSample(
                "guest time exceeds host round trip (negative RTT)",
            ));
        }
        let lo_at_g2 = sub_i64(h1, g2);
        let hi_at_g3 = sub_i64(h4, g3);
        let half = (g3 - g2) / 2;
        let g = g2 + half;
        // The drift over the guest's hold time, plus over the host round trip.
        let widen = ceil_i64((h4 - h1) as f64 * max_drift);
        Ok(OffsetSample {
            guest_ns: g,
            lo: lo_at_g2.saturating_sub(widen),
            hi: hi_at_g3.saturating_add(widen),
            source: SampleSource::Probe,
        })
    }
}

fn sub_i64(a: u64, b: u64) -> i64 {
    (a as i128 - b as i128).clamp(i64::MIN as i128, i64::MAX as i128) as i64
}

/// An offset estimate at one guest time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffsetEstimate {
    /// `host − guest` in ns.
    pub offset_ns: i64,
    /// The true offset is within `offset_ns ± uncertainty_ns`.
    pub uncertainty_ns: u64,
}

impl OffsetEstimate {
    pub fn lo(&self) -> i64 {
        self.offset_ns.saturating_sub_unsigned(self.uncertainty_ns)
    }
    pub fn hi(&self) -> i64 {
        self.offset_ns.saturating_add_unsigned(self.uncertainty_ns)
    }
    /// Maps a guest timestamp onto the host clock.
    pub fn apply(&self, guest_ns: u64) -> u64 {
        guest_ns.saturating_add_signed(self.offset_ns)
    }
    fn from_interval(lo: f64, hi: f64) -> Self {
        let c = lo + (hi - lo) / 2.0;
        OffsetEstimate {
            offset_ns: round_i64(c),
            uncertainty_ns: ceil_u64((hi - lo) / 2.0 + 0.5),
        }
    }
}

// Rounding without a libm call (x86-64's baseline has no rounding
// instruction, and these run for every joined request). Each equals the
// `f64` method followed by the saturating `as` cast, NaN giving 0.

/// `x.ceil() as i64`.
pub(crate) fn ceil_i64(x: f64) -> i64 {
    let t = x as i64;
    if (t as f64) < x {
        t.saturating_add(1)
    } else {
        t
    }
}

/// `x.ceil() as u64` (0 for a negative `x`).
pub(crate) fn ceil_u64(x: f64) -> u64 {
    let t = x as u64;
    if (t as f64) < x {
        t.saturating_add(1)
    } else {
        t
    }
}

/// `x.round() as i64` (halves away from zero). `x - t` is exact: `t` is
/// `x` truncated, within a factor of two of `x` (or 0).
pub(crate) fn round_i64(x: f64) -> i64 {
    let t = x as i64;
    let frac = x - t as f64;
    if frac >= 0.5 {
        t.saturating_add(1)
    } else if frac <= -0.5 {
        t.saturating_sub(1)
    } else {
        t
    }
}

/// A guest timestamp mapped onto the host clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapped {
    pub host_ns: u64,
    pub uncertainty_ns: u64,
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    idx: u64,
    best: OffsetSample,
    count: u64,
}

/// Guest→host clock estimator (one per guest boot).
#[derive(Clone, Debug)]
pub struct ClockEstimator {
    cfg: ClockConfig,
    buckets: VecDeque<Bucket>,
    fit: Option<Fit>,
    dirty: bool,
    /// The last [`offset_at`](Self::offset_at) query and its answer under
    /// the current fit (the join asks the same time for many records).
    last_query: Option<(u64, OffsetEstimate)>,
    samples: u64,
    rejected: u64,
    resets: u64,
}

impl Default for ClockEstimator {
    fn default() -> Self {
        Self::new(ClockConfig::default())
    }
}

/// Summary of the estimator's state (for stats lines and logs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClockSummary {
    pub samples: u64,
    pub rejected: u64,
    /// Times the guest clock was seen to restart (samples far behind the window).
    pub resets: u64,
    pub buckets: usize,
    pub fitted: usize,
    pub best_half_rtt_ns: f64,
    pub residual_bound_ns: f64,
    pub drift_ppm: f64,
}

impl ClockEstimator {
    pub fn new(cfg: ClockConfig) -> Self {
        ClockEstimator {
            cfg,
            buckets: VecDeque::new(),
            fit: None,
            dirty: false,
            last_query: None,
            samples: 0,
            rejected: 0,
            resets: 0,
        }
    }

    pub fn config(&self) -> &ClockConfig {
        &self.cfg
    }

    fn max_drift(&self) -> f64 {
        self.cfg.max_drift_ppm * 1e-6
    }

    /// Adds a guest-initiated probe (`t1`,`t4` guest; `t2`,`t3` host).
    pub fn add_guest_probe(
        &mut self,
        t1: u64,
        t2: u64,
        t3: u64,
        t4: u64,
    ) -> Result<(), ClockError> {
        let s =
            OffsetSample::guest_initiated(t1, t2, t3, t4, self.max_drift(), SampleSource::Probe);
        self.add_result(s)
    }

    /// Adds a host-initiated probe (`h1`,`h4` host; `g2`,`g3` guest).
    pub fn add_host_probe(&mut self, h1: u64, g2: u64, g3: u64, h4: u64) -> Result<(), ClockError> {
        let s = OffsetSample::host_initiated(h1, g2, g3, h4, self.max_drift());
        self.add_result(s)
    }

    /// Causality tightener: a joined request whose guest point `guest_before`
    /// strictly precedes the host's `host_pop`, and whose host `host_push`
    /// strictly precedes the guest's `guest_after`, is an exchange like a probe.
    pub fn add_request(
        &mut self,
        guest_before: u64,
        host_pop: u64,
        host_push: u64,
        guest_after: u64,
    ) -> Result<(), ClockError> {
        let s = OffsetSample::guest_initiated(
            guest_before,
            host_pop,
            host_push,
            guest_after,
            self.max_drift(),
            SampleSource::Request,
        );
        self.add_result(s)
    }

    fn add_result(&mut self, s: Result<OffsetSample, ClockError>) -> Result<(), ClockError> {
        match s {
            Ok(s) => {
                self.add_sample(s);
                Ok(())
            }
            Err(e) => {
                self.rejected += 1;
                Err(e)
            }
        }
    }

    /// Adds an interval sample.
    pub fn add_sample(&mut self, s: OffsetSample) {
        self.samples += 1;
        let idx = s.guest_ns / self.cfg.bucket_ns.max(1);
        // A sample a whole window before the newest one cannot be a late
        // arrival: the guest's clock restarted (reboot). Start over.
        if let Some(newest) = self.buckets.back() {
            if idx.saturating_add(2 * self.cfg.max_buckets as u64) < newest.idx {
                self.buckets.clear();
                self.fit = None;
                self.last_query = None;
                self.resets += 1;
            }
        }
        // Find the bucket (usually the last one).
        let pos = self.buckets.iter().rposition(|b| b.idx <= idx);
        match pos {
            Some(p) if self.buckets[p].idx == idx => {
                let b = &mut self.buckets[p];
                b.count += 1;
                let (w, best_w) = (s.hi - s.lo, b.best.hi - b.best.lo);
                if w < best_w {
                    // A fit is rebuilt from every bucket: a narrower sample in
                    // the newest bucket, which most requests bring, forces it
                    // only when a quarter narrower (the fit stays valid with
                    // the older one, a little wider; the next refit takes it).
                    self.dirty |= (w as i128) * 4 < (best_w as i128) * 3;
                    b.best = s;
                }
            }
            _ => {
                let at = pos.map_or(0, |p| p + 1);
                if at == 0 && self.buckets.len() >= self.cfg.max_buckets {
                    // Older than the whole window.
                    return;
                }
                self.buckets.insert(
                    at,
                    Bucket {
                        idx,
                        best: s,
                        count: 1,
                    },
                );
                while self.buckets.len() > self.cfg.max_buckets.max(1) {
                    self.buckets.pop_front();
                }
                self.dirty = true;
            }
        }
    }

    /// Whether any sample is available.
    pub fn is_synced(&self) -> bool {
        !self.buckets.is_empty()
    }

    pub fn summary(&mut self) -> ClockSummary {
        self.refit();
        let f = self.fit.as_ref();
        ClockSummary {
            samples: self.samples,
            rejected: self.rejected,
            resets: self.resets,
            buckets: self.buckets.len(),
            fitted: f.map_or(0, |f| f.used),
            best_half_rtt_ns: f.map_or(f64::NAN, |f| f.best_half_rtt),
            residual_bound_ns: f.map_or(f64::NAN, |f| f.e),
            drift_ppm: f.map_or(f64::NAN, |f| f.b * 1e6),
        }
    }

    fn refit(&mut self) {
        if !self.dirty {
            return;
        }
        self.dirty = false;
        self.fit = compute_fit(&self.buckets, &self.cfg);
        self.last_query = None;
    }

    /// The offset estimate at guest time `guest_ns`, `None` before the first sample.
    pub fn offset_at(&mut self, guest_ns: u64) -> Option<OffsetEstimate> {
        self.refit();
        if let Some((_, e)) = self.last_query.filter(|q| q.0 == guest_ns) {
            return Some(e);
        }
        let f = self.fit.as_ref()?;
        let dg = guest_ns as f64 - f.g_ref as f64;
        let center = f.base as f64 + f.a + f.b * dg;
        let u = f.bound(dg);
        let e = OffsetEstimate::from_interval(center - u, center + u);
        self.last_query = Some((guest_ns, e));
        Some(e)
    }

    /// Maps a guest timestamp onto the host clock.
    pub fn to_host(&mut self, guest_ns: u64) -> Option<Mapped> {
        let e = self.offset_at(guest_ns)?;
        Some(Mapped {
            host_ns: e.apply(guest_ns),
            uncertainty_ns: e.uncertainty_ns,
        })
    }
}

/// One record's own causal bounds on the offset: `lo ≤ θ ≤ hi` (either may be absent).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CausalBounds {
    pub lo: Option<i64>,
    pub hi: Option<i64>,
}

impl CausalBounds {
    /// `guest_before` (guest) strictly precedes `host_after` (host): `θ ≤ host_after − guest_before`.
    pub fn before(mut self, guest_before: u64, host_after: u64) -> Self {
        let v = sub_i64(host_after, guest_before);
        self.hi = Some(self.hi.map_or(v, |h| h.min(v)));
        self
    }
    /// `host_before` (host) strictly precedes `guest_after` (guest): `θ ≥ host_before − guest_after`.
    pub fn after(mut self, host_before: u64, guest_after: u64) -> Self {
        let v = sub_i64(host_before, guest_after);
        self.lo = Some(self.lo.map_or(v, |l| l.max(v)));
        self
    }
    /// The estimate these bounds give on their own, each widened by
    /// `drift_allowance_ns`: `None` unless both are present and consistent.
    pub fn estimate(&self, drift_allowance_ns: u64) -> Option<OffsetEstimate> {
        let (lo, hi) = (self.lo?, self.hi?);
        let allow = drift_allowance_ns as i64;
        if lo > hi.saturating_add(allow) {
            return None;
        }
        Some(OffsetEstimate::from_interval(
            lo.saturating_sub(allow) as f64,
            hi.saturating_add(allow) as f64,
        ))
    }
}

/// Intersects an estimate with causal bounds. Returns the narrowed estimate, or
/// `None` when they are inconsistent (then keep the original and count it: one
/// of the two is wrong, e.g. a mis-join or a non-causal timestamp).
/// `drift_allowance_ns` widens the causal bounds for the time between the
/// bound's own guest time and the estimate's (`max_drift · Δg`).
pub fn narrow(
    est: OffsetEstimate,
    bounds: CausalBounds,
    drift_allowance_ns: u64,
) -> Option<OffsetEstimate> {
    let mut lo = est.lo() as f64;
    let mut hi = est.hi() as f64;
    if let Some(l) = bounds.lo {
        lo = lo.max(l as f64 - drift_allowance_ns as f64);
    }
    if let Some(h) = bounds.hi {
        hi = hi.min(h as f64 + drift_allowance_ns as f64);
    }
    if lo > hi {
        return None;
    }
    Some(OffsetEstimate::from_interval(lo, hi))
}

#[cfg(test)]
#[path = "clock_tests.rs"]
mod tests;
