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

#[derive(Clone, Debug)]
struct Fit {
    /// Reference guest time and base offset (values are fitted relative to them).
    g_ref: u64,
    a: f64,
    b: f64,
    base: i64,
    e: f64,
    used: usize,
    best_half_rtt: f64,
    prior_slope: f64,
    /// Fitted points: (g − g_ref, E_i = halfRTT_i + |residual_i| + slack), by g.
    pts: Vec<(f64, f64)>,
    /// Index of the minimum E in pts[..=i] and in pts[i..].
    pmin: Vec<usize>,
    smin: Vec<usize>,
    /// Extrapolation after the last point and before the first: each end
    /// sample `b` with its two partner samples (see [`Fit::bound`]), chosen
    /// once per fit rather than per query.
    after: [[usize; 3]; 2],
    before: [[usize; 3]; 2],
}

impl Fit {
    /// Bound on |θ(g) − L(g)| at relative guest time x.
    fn bound(&self, x: f64) -> f64 {
        let p = &self.pts;
        let n = p.len();
        let (g0, gn) = (p[0].0, p[n - 1].0);
        if x >= g0 && x <= gn && n > 1 {
            // Bracketing pair k, k+1.
            let k = p.partition_point(|q| q.0 <= x).clamp(1, n - 1) - 1;
            let (ga, ea) = p[k];
            let (gb, eb) = p[k + 1];
            let interp = if gb > ga {
                ea + (eb - ea) * (x - ga) / (gb - ga)
            } else {
                ea.max(eb)
            };
            let far = p[self.pmin[k]].1.max(p[self.smin[k + 1]].1);
            return interp.min(far);
        }
        if n == 1 {
            return p[0].1 + (x - p[0].0).abs() * self.prior_slope;
        }
        // Extrapolation: a linear error bounded by E_a at g_a and E_b at g_b
        // grows by at most (E_a + E_b)/|g_b − g_a| per ns beyond g_b.
        let ends = if x > gn { &self.after } else { &self.before };
        let mut best = f64::INFINITY;
        for &[b, a0, a1] in ends {
            let (gb, eb) = p[b];
            let d = (x - gb).abs();
            best = best.min(eb + d * self.prior_slope);
            for a in [a0, a1] {
                let (ga, ea) = p[a];
                if (gb - ga).abs() > 0.0 {
                    best = best.min(eb + d * (ea + eb) / (gb - ga).abs());
                }
            }
        }
        best
    }
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

/// The median (of the two middle values, their mean): the values around the
/// middle are selected, not sorted (a refit takes ~1800 slopes).
fn median(v: &mut [f64]) -> f64 {
    let n = v.len();
    let (lower, mid, _) = v.select_nth_unstable_by(n / 2, |a, b| a.total_cmp(b));
    let mid = *mid;
    if n % 2 == 1 {
        mid
    } else {
        let below = lower.iter().copied().max_by(|a, b| a.total_cmp(b));
        (below.expect("n is even and not 0") + mid) / 2.0
    }
}

fn compute_fit(buckets: &VecDeque<Bucket>, cfg: &ClockConfig) -> Option<Fit> {
    let best = buckets
        .iter()
        .map(|b| b.best.half_width())
        .min_by(|a, b| a.total_cmp(b))?;
    let limit = best * cfg.outlier_factor + cfg.outlier_slack_ns as f64;
    let sel: Vec<OffsetSample> = buckets
        .iter()
        .map(|b| b.best)
        .filter(|s| s.half_width() <= limit)
        .collect();
    let max_drift = cfg.max_drift_ppm * 1e-6;
    let g_ref = sel[sel.len() / 2].guest_ns;
    let base = sel[sel.len() / 2].lo + (sel[sel.len() / 2].hi - sel[sel.len() / 2].lo) / 2;
    let pts: Vec<(f64, f64, f64)> = sel
        .iter()
        .map(|s| {
            (
                s.guest_ns as f64 - g_ref as f64,
                s.center() - base as f64,
                s.half_width(),
            )
        })
        .collect();
    let mut slopes = Vec::with_capacity(pts.len() * (pts.len() - 1) / 2);
    for i in 0..pts.len() {
        for j in i + 1..pts.len() {
            let dx = pts[j].0 - pts[i].0;
            if dx.abs() > 0.0 {
                slopes.push((pts[j].1 - pts[i].1) / dx);
            }
        }
    }
    let b = if slopes.is_empty() {
        0.0
    } else {
        median(&mut slopes).clamp(-max_drift, max_drift)
    };
    let mut icpt: Vec<f64> = pts.iter().map(|p| p.1 - b * p.0).collect();
    let a = median(&mut icpt);
    let mut fp: Vec<(f64, f64)> = pts
        .iter()
        .map(|p| {
            (
                p.0,
                p.2 + (p.1 - (a + b * p.0)).abs() + cfg.rounding_slack_ns as f64,
            )
        })
        .collect();
    fp.sort_by(|x, y| x.0.total_cmp(&y.0));
    let n = fp.len();
    let mut pmin = vec![0usize; n];
    let mut smin = vec![n - 1; n];
    for i in 1..n {
        pmin[i] = if fp[i].1 < fp[pmin[i - 1]].1 {
            i
        } else {
            pmin[i - 1]
        };
    }
    for i in (0..n - 1).rev() {
        smin[i] = if fp[i].1 < fp[smin[i + 1]].1 {
            i
        } else {
            smin[i + 1]
        };
    }
    let e = fp[smin[0]].1;
    let (after, before) = extrapolation_partners(&fp, &pmin, &smin);
    Some(Fit {
        g_ref,
        a,
        b,
        base,
        e,
        used: sel.len(),
        best_half_rtt: best,
        prior_slope: max_drift + b.abs(),
        after,
        before,
        pts: fp,
        pmin,
        smin,
    })
}

/// The samples that bound extrapolation (see [`Fit::bound`]): after the last
/// point, the last sample and the one of least error, each with the first
/// sample and the least-error one of its first half; before the first,
/// symmetrically. Each entry is `[end, partner, partner]`.
fn extrapolation_partners(
    p: &[(f64, f64)],
    pmin: &[usize],
    smin: &[usize],
) -> ([[usize; 3]; 2], [[usize; 3]; 2]) {
    let n = p.len();
    let after = |b: usize| {
        let half = p[b].0 - (p[b].0 - p[0].0) / 2.0;
        let k = p.partition_point(|q| q.0 <= half).max(1) - 1;
        [b, 0, pmin[k]]
    };
    let before = |b: usize| {
        let half = p[b].0 + (p[n - 1].0 - p[b].0) / 2.0;
        let k = p.partition_point(|q| q.0 < half).min(n - 1);
        [b, n - 1, smin[k]]
    };
    ([n - 1, smin[0]].map(after), [0, pmin[n - 1]].map(before))
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
