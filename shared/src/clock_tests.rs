use super::fit::median;
use super::*;
use proptest::prelude::*;

/// A simulated pair of clocks: host = guest + θ0 + s·(guest − G0).
#[derive(Clone, Copy, Debug)]
struct Sim {
    theta0: f64,
    s: f64,
    g0: f64,
}

impl Sim {
    fn theta(&self, g: f64) -> f64 {
        self.theta0 + self.s * (g - self.g0)
    }
    fn host(&self, g: f64) -> f64 {
        g + self.theta(g)
    }
    fn guest(&self, h: f64) -> f64 {
        (h - self.theta0 + self.s * self.g0) / (1.0 + self.s)
    }
    /// A guest-initiated probe at guest time g with one-way delays (ns).
    fn probe(&self, g: f64, up: f64, hold: f64, down: f64) -> (u64, u64, u64, u64) {
        let t1 = g;
        let t2 = self.host(t1) + up;
        let t3 = t2 + hold;
        let t4 = self.guest(t3 + down);
        (
            t1.round() as u64,
            t2.round() as u64,
            t3.round() as u64,
            t4.round() as u64,
        )
    }
}

struct Lcg(u64);
impl Lcg {
    fn next_f64(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 11) as f64) / ((1u64 << 53) as f64)
    }
    /// Exponential jitter with the given mean.
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.next_f64()).ln()
    }
}

fn run(sim: Sim, n: usize, seed: u64, start: f64, every: f64) -> (ClockEstimator, f64) {
    let mut est = ClockEstimator::default();
    let mut r = Lcg(seed);
    let mut g = start;
    for _ in 0..n {
        // Asymmetric: up 20 µs base, down 60 µs base, heavy jitter.
        let up = 20_000.0 + r.exp(100_000.0);
        let down = 60_000.0 + r.exp(200_000.0);
        let hold = 1_000.0 + r.exp(5_000.0);
        let (t1, t2, t3, t4) = sim.probe(g, up, hold, down);
        est.add_guest_probe(t1, t2, t3, t4).unwrap();
        g += every;
    }
    (est, g)
}

#[test]
fn constant_offset_single_probe() {
    let mut e = ClockEstimator::default();
    assert!(e.offset_at(5).is_none());
    // guest 1000 → host 5_001_000 (+10 up) ; hold 5; down 20.
    e.add_guest_probe(1000, 5_001_010, 5_001_015, 1035).unwrap();
    let o = e.offset_at(1017).unwrap();
    assert!((o.offset_ns - 5_000_000).abs() <= 20, "{o:?}");
    assert!(o.uncertainty_ns >= 15 && o.uncertainty_ns <= 40, "{o:?}");
    let m = e.to_host(2000).unwrap();
    assert!(m.host_ns.abs_diff(5_002_000) <= 30);
}

#[test]
fn invalid_samples_are_rejected() {
    let mut e = ClockEstimator::default();
    assert!(e.add_guest_probe(10, 5, 6, 9).is_err());
    assert!(e.add_guest_probe(10, 6, 5, 20).is_err());
    assert!(e.add_guest_probe(10, 0, 100, 20).is_err());
    assert!(e.add_host_probe(10, 5, 4, 20).is_err());
    assert_eq!(e.summary().rejected, 4);
    assert!(!e.is_synced());
}

#[test]
fn host_initiated_probe() {
    let sim = Sim {
        theta0: -3e9,
        s: 50e-6,
        g0: 1e12,
    };
    let mut e = ClockEstimator::default();
    for k in 0..30 {
        let h1 = sim.host(1e12 + k as f64 * 1e9);
        let g2 = sim.guest(h1 + 30_000.0);
        let g3 = g2 + 2_000.0;
        let h4 = sim.host(g3) + 70_000.0;
        e.add_host_probe(h1 as u64, g2 as u64, g3 as u64, h4 as u64)
            .unwrap();
    }
    for k in 0..40 {
        let g = 1e12 + k as f64 * 0.8e9;
        let o = e.offset_at(g as u64).unwrap();
        let err = (sim.theta(g) - o.offset_ns as f64).abs();
        assert!(err <= o.uncertainty_ns as f64, "{err} {o:?}");
    }
}

#[test]
fn error_shrinks_with_more_samples() {
    let sim = Sim {
        theta0: 123_456_789_000.0,
        s: -80e-6,
        g0: 5e11,
    };
    let mut prev_u = f64::INFINITY;
    for n in [1usize, 5, 40, 400, 4000] {
        // Same 40 s span, more probes per second.
        let every = 40e9 / n as f64;
        let (mut est, end) = run(sim, n, 7, 5e11, every);
        let g = end - every / 2.0;
        let o = est.offset_at(g as u64).unwrap();
        let err = (sim.theta(g) - o.offset_ns as f64).abs();
        assert!(err <= o.uncertainty_ns as f64);
        let u = o.uncertainty_ns as f64;
        eprintln!("n={n} u={u} err={err}");
        assert!(u <= prev_u * 1.05, "n={n}: {u} after {prev_u}");
        prev_u = u;
    }
    // Many samples: well below the mean one-way delay.
    assert!(prev_u < 60_000.0, "{prev_u}");
}

#[test]
fn request_pairs_tighten() {
    let sim = Sim {
        theta0: 7e9,
        s: 20e-6,
        g0: 0.0,
    };
    let (mut est, end) = run(sim, 20, 3, 1e9, 1e9);
    let u_probe = est.offset_at(end as u64).unwrap().uncertainty_ns;
    // Requests: guest vq_add → host pop 15 µs later; push → guest complete 10 µs later.
    let mut g = 1e9;
    while g < end {
        let pop = sim.host(g) + 15_000.0;
        let push = pop + 100_000.0;
        let done = sim.guest(push + 10_000.0);
        est.add_request(g as u64, pop as u64, push as u64, done as u64)
            .unwrap();
        g += 1e7;
    }
    let o = est.offset_at(end as u64).unwrap();
    assert!(o.uncertainty_ns < u_probe / 4, "{o:?} vs {u_probe}");
    let err = (sim.theta(end) - o.offset_ns as f64).abs();
    assert!(err <= o.uncertainty_ns as f64);
}

#[test]
fn narrow_intersects_and_detects_conflicts() {
    let est = OffsetEstimate {
        offset_ns: 1000,
        uncertainty_ns: 100,
    };
    let b = CausalBounds::default().before(10, 1050); // θ ≤ 1040
    let n = narrow(est, b, 0).unwrap();
    assert!(n.lo() <= 900 && n.lo() >= 898 && n.hi() >= 1040 && n.hi() <= 1042);
    let b = b.after(1000, 40); // θ ≥ 960
    let n = narrow(est, b, 0).unwrap();
    assert!(n.lo() <= 960 && n.hi() >= 1040 && n.uncertainty_ns <= 41);
    let bad = CausalBounds::default().before(0, 500);
    assert!(narrow(est, bad, 0).is_none());
    assert!(narrow(est, bad, 500).is_some());
}

#[test]
fn causal_bounds_alone_give_an_estimate_only_when_two_sided_and_consistent() {
    let b = CausalBounds::default().before(10, 1050).after(1000, 40); // 960 ≤ θ ≤ 1040
    let e = b.estimate(0).unwrap();
    assert_eq!((e.offset_ns, e.uncertainty_ns), (1000, 41));
    // Widened by the allowance on both sides.
    let e = b.estimate(10).unwrap();
    assert_eq!((e.offset_ns, e.uncertainty_ns), (1000, 51));
    assert!(e.lo() <= 950 && e.hi() >= 1050);
    // One-sided: no estimate.
    assert_eq!(CausalBounds::default().before(10, 1050).estimate(0), None);
    assert_eq!(CausalBounds::default().after(1000, 40).estimate(0), None);
    // Inconsistent (θ ≥ 1100 and θ ≤ 1040): none, unless the allowance bridges it.
    let bad = CausalBounds::default().before(10, 1050).after(1100, 0);
    assert_eq!(bad.estimate(59), None);
    let e = bad.estimate(60).unwrap();
    assert!(e.lo() <= 1040 && e.hi() >= 1100, "{e:?}");
}

#[test]
fn window_drops_old_buckets() {
    let cfg = ClockConfig {
        max_buckets: 4,
        ..ClockConfig::default()
    };
    let mut e = ClockEstimator::new(cfg);
    for k in 0..10u64 {
        let g = k * 1_000_000_000;
        e.add_guest_probe(g, g + 10, g + 11, g + 20).unwrap();
    }
    assert_eq!(e.summary().buckets, 4);
    // A sample older than the window (but not a whole window older) is ignored.
    let g = 2_000_000_005;
    e.add_guest_probe(g, g + 10, g + 11, g + 20).unwrap();
    assert_eq!(e.summary().buckets, 4);
}

#[test]
fn guest_reboot_restarts_the_estimate() {
    let mut e = ClockEstimator::default();
    // First boot: guest clock far along (1000 s), offset 5 s.
    for k in 0..100u64 {
        let g = 1_000_000_000_000 + k * 1_000_000_000;
        e.add_guest_probe(g, g + 5_000_000_010, g + 5_000_000_011, g + 20)
            .unwrap();
    }
    // Reboot: guest clock restarts near 0; host time went on (offset ~1105 s).
    let off = 1_105_000_000_000u64;
    for k in 0..5u64 {
        let g = 2_000_000_000 + k * 1_000_000_000;
        e.add_guest_probe(g, g + off + 10, g + off + 11, g + 20)
            .unwrap();
    }
    let o = e.offset_at(6_000_000_000).unwrap();
    assert!((o.offset_ns - off as i64).abs() < 100, "{o:?}");
    assert_eq!(e.summary().resets, 1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn true_offset_within_stated_uncertainty(
        theta0 in -1.9e12f64..1e15,
        ppm in -100.0f64..100.0,
        n in 1usize..200,
        every_ms in 10.0f64..2000.0,
        seed in any::<u64>(),
        probe_at in 0.0f64..1.0,
        extrap_s in 0.0f64..30.0,
    ) {
        let start = 2e12;
        let sim = Sim { theta0, s: ppm * 1e-6, g0: start };
        let every = every_ms * 1e6;
        let (mut est, end) = run(sim, n, seed, start, every);
        // Inside the window and extrapolated beyond it.
        for g in [start + (end - start) * probe_at, end + extrap_s * 1e9] {
            let o = est.offset_at(g as u64).unwrap();
            let err = (sim.theta(g) - o.offset_ns as f64).abs();
            prop_assert!(err <= o.uncertainty_ns as f64,
                "err {} > u {} at {} (n={})", err, o.uncertainty_ns, g, n);
        }
    }
}

proptest! {
    /// The selecting median equals the middle of the sorted values.
    #[test]
    fn median_is_the_sorted_middle(mut v in prop::collection::vec(-1e9f64..1e9, 1..200)) {
        let mut sorted = v.clone();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let n = sorted.len();
        let want = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        prop_assert_eq!(median(&mut v), want);
    }
}

fn rounding_agrees(x: f64) {
    assert_eq!(ceil_i64(x), x.ceil() as i64, "ceil_i64({x:e})");
    assert_eq!(ceil_u64(x), x.ceil() as u64, "ceil_u64({x:e})");
    assert_eq!(round_i64(x), x.round() as i64, "round_i64({x:e})");
}

#[test]
fn rounding_helpers_equal_the_f64_methods_at_the_edges() {
    let edges = [
        0.0,
        -0.0,
        0.5,
        -0.5,
        0.49999999999999994,
        -0.49999999999999994,
        1.5,
        -2.5,
        4503599627370495.5, // 2^52 - 0.5
        4503599627370496.0,
        9007199254740993.0,
        9.223372036854775e18,
        -9.223372036854775e18,
        1.8446744073709552e19,
        1e30,
        -1e30,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        f64::MIN_POSITIVE,
        -f64::MIN_POSITIVE,
    ];
    for x in edges {
        rounding_agrees(x);
        rounding_agrees(x.next_up());
        rounding_agrees(x.next_down());
    }
}

proptest! {
    #[test]
    fn rounding_helpers_equal_the_f64_methods(bits in any::<u64>(), small in -1e7f64..1e7) {
        rounding_agrees(f64::from_bits(bits));
        rounding_agrees(small);
        rounding_agrees(small.trunc() + 0.5);
    }
}

/// A narrower sample in the newest bucket refits only when it is a quarter
/// narrower; the fit then takes every bucket's narrowest (a smaller gain
/// waits for the next refit).
#[test]
fn a_slightly_narrower_sample_waits_for_the_next_refit() {
    let s = |g: u64, half: i64| OffsetSample {
        guest_ns: g,
        lo: 5_000 - half,
        hi: 5_000 + half,
        source: SampleSource::Request,
    };
    let mut est = ClockEstimator::default();
    est.add_sample(s(1_000_000, 1_000));
    assert_eq!(est.summary().best_half_rtt_ns, 1_000.0);
    // 10 % narrower: kept as the bucket's best, no refit.
    est.add_sample(s(2_000_000, 900));
    assert_eq!(est.summary().best_half_rtt_ns, 1_000.0);
    // A quarter narrower than the bucket's best (900): refit, with it.
    est.add_sample(s(3_000_000, 600));
    assert_eq!(est.summary().best_half_rtt_ns, 600.0);
    // A new bucket always refits, and takes the narrowest of each.
    est.add_sample(s(1_500_000_000, 580));
    assert_eq!(est.summary().best_half_rtt_ns, 580.0);
    assert_eq!(est.summary().buckets, 2);
}

/// The bound as it was computed per query before the partners were chosen
/// once per fit (the reference for the test below).
fn bound_per_query(f: &Fit, x: f64) -> f64 {
    let p = &f.pts;
    let n = p.len();
    let ends = if x > p[n - 1].0 {
        [n - 1, f.smin[0]].map(|b| {
            let half = p[b].0 - (p[b].0 - p[0].0) / 2.0;
            let k = p.partition_point(|q| q.0 <= half).max(1) - 1;
            [b, 0, f.pmin[k]]
        })
    } else {
        [0, f.pmin[n - 1]].map(|b| {
            let half = p[b].0 + (p[n - 1].0 - p[b].0) / 2.0;
            let k = p.partition_point(|q| q.0 < half).min(n - 1);
            [b, n - 1, f.smin[k]]
        })
    };
    let mut best = f64::INFINITY;
    for [b, a0, a1] in ends {
        let (gb, eb) = p[b];
        let d = (x - gb).abs();
        best = best.min(eb + d * f.prior_slope);
        for a in [a0, a1] {
            let (ga, ea) = p[a];
            if (gb - ga).abs() > 0.0 {
                best = best.min(eb + d * (ea + eb) / (gb - ga).abs());
            }
        }
    }
    best
}

/// Extrapolation uses partners chosen once per fit: beyond both ends the
/// bound is exactly the per-query choice's.
#[test]
fn extrapolation_partners_chosen_once_give_the_same_bounds() {
    for seed in 1..20 {
        let sim = Sim {
            theta0: 1e9,
            s: (seed as f64 - 10.0) * 5e-6,
            g0: 0.0,
        };
        let (mut est, _) = run(sim, 200 + 20 * seed as usize, seed, 1e9, 50e6);
        est.refit();
        let fit = est.fit.clone().unwrap();
        let (g0, gn) = (fit.pts[0].0, fit.pts[fit.pts.len() - 1].0);
        for k in 1..40 {
            let d = k as f64 * k as f64 * 1e6;
            for x in [gn + d, g0 - d] {
                assert_eq!(fit.bound(x), bound_per_query(&fit, x), "seed {seed} x {x}");
            }
        }
    }
}
