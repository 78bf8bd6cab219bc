//! The clock's fit (see the method in [`super`]): a Theil–Sen line over the
//! buckets' minimum-RTT samples, and the bound on its error at any guest time.

use std::collections::VecDeque;

use super::{Bucket, ClockConfig, OffsetSample};

#[derive(Clone, Debug)]
pub(super) struct Fit {
    /// Reference guest time and base offset (values are fitted relative to them).
    pub(super) g_ref: u64,
    pub(super) a: f64,
    pub(super) b: f64,
    pub(super) base: i64,
    pub(super) e: f64,
    pub(super) used: usize,
    pub(super) best_half_rtt: f64,
    pub(super) prior_slope: f64,
    /// Fitted points: (g − g_ref, E_i = halfRTT_i + |residual_i| + slack), by g.
    pub(super) pts: Vec<(f64, f64)>,
    /// Index of the minimum E in pts[..=i] and in pts[i..].
    pub(super) pmin: Vec<usize>,
    pub(super) smin: Vec<usize>,
    /// Extrapolation after the last point and before the first: each end
    /// sample `b` with its two partner samples (see [`Fit::bound`]), chosen
    /// once per fit rather than per query.
    pub(super) after: [[usize; 3]; 2],
    pub(super) before: [[usize; 3]; 2],
}

impl Fit {
    /// Bound on |θ(g) − L(g)| at relative guest time x.
    pub(super) fn bound(&self, x: f64) -> f64 {
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

/// The median (of the two middle values, their mean): the values around the
/// middle are selected, not sorted (a refit takes ~1800 slopes).
pub(super) fn median(v: &mut [f64]) -> f64 {
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

pub(super) fn compute_fit(buckets: &VecDeque<Bucket>, cfg: &ClockConfig) -> Option<Fit> {
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
