//! The issue-11 checks of a bench run, each with how sure it is: a bootstrap over
//! rounds gives the interval of its margin (how far on the good side of its bound).

use std::fmt::Write as _;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::{
    median, BenchResult, BOTH_IOPS_MARGIN, GUEST_IOPS_MARGIN, JOBS, MAX_BPF_X_ALWAYS_ON,
    MAX_BPF_X_CAPTURE,
};

/// One done-when check of issue 11, from medians over the rounds (of a run, or runs pooled).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    pub check: String,
    pub value: f64,
    pub bound: f64,
    /// `value <= bound` for costs, `value >= bound` for IOPS ratios.
    pub pass: bool,
    /// For the checks between conditions: the [`LEVEL`] bootstrap interval of the margin
    /// (`value - bound` for IOPS ratios, `bound - value` for costs; positive is met).
    pub margin: Option<(f64, f64)>,
}

impl Verdict {
    fn new(check: String, value: f64, bound: f64, pass: bool) -> Verdict {
        Verdict {
            check,
            value,
            bound,
            pass,
            margin: None,
        }
    }

    /// The rounds cannot tell a pass from a miss: the margin's interval spans zero.
    pub fn within_noise(&self) -> bool {
        self.margin.is_some_and(|(lo, hi)| lo < 0.0 && hi > 0.0)
    }
}

/// Resamples per bootstrap, and the interval's coverage.
pub const RESAMPLES: usize = 2000;
pub const LEVEL: f64 = 0.90;

/// The central [`LEVEL`] interval of `stat` when each group (one condition's values over
/// rounds) is resampled with replacement, independently (each run is a VM of its own).
/// `None` when a group has fewer than 2 values. Seeded: a run renders the same each time.
pub fn bootstrap(groups: &[&[f64]], stat: impl Fn(&[Vec<f64>]) -> f64) -> Option<(f64, f64)> {
    if groups.iter().any(|g| g.len() < 2) {
        return None;
    }
    let mut rng = StdRng::seed_from_u64(0x7669_6f74);
    let mut draw: Vec<Vec<f64>> = groups.iter().map(|g| Vec::with_capacity(g.len())).collect();
    let mut stats = Vec::with_capacity(RESAMPLES);
    for _ in 0..RESAMPLES {
        for (g, d) in groups.iter().zip(draw.iter_mut()) {
            d.clear();
            d.extend((0..g.len()).map(|_| g[rng.random_range(0..g.len())]));
        }
        let x = stat(&draw);
        if x.is_finite() {
            stats.push(x);
        }
    }
    if stats.is_empty() {
        return None;
    }
    stats.sort_by(f64::total_cmp);
    let at = |p: f64| stats[((stats.len() - 1) as f64 * p).round() as usize];
    Some((at((1.0 - LEVEL) / 2.0), at((1.0 + LEVEL) / 2.0)))
}

fn iops_of<'a>(res: &'a BenchResult, cond: &str, job: &str) -> Option<&'a [f64]> {
    res.jobs.get(cond)?.get(job).map(|s| s.iops.as_slice())
}

fn iops_ratio(res: &BenchResult, cond: &str, job: &str) -> Option<f64> {
    let m = |c: &str| {
        res.jobs
            .get(c)
            .and_then(|j| j.get(job))
            .map(|s| median(&s.iops))
    };
    Some(m(cond)? / m("none")?)
}

/// The issue-11 checks this run has the conditions for: runs that did not finish, guest BPF
/// run time per I/O against the anchor's, each condition's IOPS ratio against the anchor's
/// ratio per job, and the agents' memory, host CPU per I/O, drops and uprobe hits.
pub fn verdicts(res: &BenchResult) -> Vec<Verdict> {
    let mut v = vec![Verdict::new(
        "runs that did not finish".into(),
        res.failed_runs.len() as f64,
        0.0,
        res.failed_runs.is_empty(),
    )];
    bpf_verdicts(res, &mut v);
    iops_verdicts(res, &mut v);
    cost_verdicts(res, &mut v);
    v
}

/// Guest BPF run time per I/O against the anchor's, per guest condition.
fn bpf_verdicts(res: &BenchResult, v: &mut Vec<Verdict>) {
    let bpf = |c: &str| {
        res.costs
            .get(c)
            .filter(|c| !c.guest_bpf_ns_per_io.is_empty())
            .map(|c| median(&c.guest_bpf_ns_per_io))
    };
    if let Some(anchor) = bpf("bpftrace").filter(|a| *a > 0.0) {
        for (cond, bound) in [
            ("guest", MAX_BPF_X_ALWAYS_ON),
            ("capture", MAX_BPF_X_CAPTURE),
            ("lean", MAX_BPF_X_ALWAYS_ON),
            ("lean-capture", MAX_BPF_X_CAPTURE),
        ] {
            if let Some(x) = bpf(cond) {
                let value = x / anchor;
                let mut x = Verdict::new(
                    format!("{cond}: guest BPF ns/IO ÷ anchor's"),
                    value,
                    bound,
                    value <= bound,
                );
                let ns = |c: &str| res.costs[c].guest_bpf_ns_per_io.as_slice();
                x.margin = bootstrap(&[ns(cond), ns("bpftrace")], |d| {
                    bound - median(&d[0]) / median(&d[1])
                });
                v.push(x);
            }
        }
    }
}

/// Each round's IOPS ratio of `cond` minus the anchor's, on job `job`: `(cond − anchor) /
/// none` of the same round. `None` unless the three conditions have the same rounds (as
/// many, at least 2, and no run of theirs failed): only then is the i-th value of each the
/// same round's. Pooled runs concatenate their rounds in the same order for every condition.
fn paired_by_round(res: &BenchResult, cond: &str, job: &str) -> Option<Vec<f64>> {
    let conds = ["none", cond, "bpftrace"];
    if res
        .failed_runs
        .iter()
        .any(|f| conds.contains(&f.0.as_str()))
    {
        return None;
    }
    let (n, c, a) = (
        iops_of(res, "none", job)?,
        iops_of(res, cond, job)?,
        iops_of(res, "bpftrace", job)?,
    );
    if n.len() < 2 || c.len() != n.len() || a.len() != n.len() {
        return None;
    }
    Some((0..n.len()).map(|i| (c[i] - a[i]) / n[i]).collect())
}

/// IOPS ratios against the anchor's, per condition and job, with the rounds'
/// bootstrap margin. Where the rounds pair up (`paired_by_round`), the check is the
/// median over rounds of the ratio's difference to the anchor's in the same round: the
/// conditions of a round run back to back (their order rotated), so a host that is
/// faster or slower for a while moves both, and the difference keeps only the tracers'.
/// Otherwise (a failed run, one round) the medians' ratios are compared.
fn iops_verdicts(res: &BenchResult, v: &mut Vec<Verdict>) {
    for (cond, margin) in [
        ("guest", GUEST_IOPS_MARGIN),
        ("capture", GUEST_IOPS_MARGIN),
        ("both", BOTH_IOPS_MARGIN),
        ("lean", GUEST_IOPS_MARGIN),
        ("lean-both", BOTH_IOPS_MARGIN),
        ("lean-capture", GUEST_IOPS_MARGIN),
        ("host", 0.0),
    ] {
        for j in JOBS {
            let (Some(x), Some(a)) = (
                iops_ratio(res, cond, j.name),
                iops_ratio(res, "bpftrace", j.name),
            ) else {
                continue;
            };
            if let Some(d) = paired_by_round(res, cond, j.name) {
                let value = median(&d);
                let at_least = if margin > 0.0 {
                    format!("−{margin:.2}")
                } else {
                    "0".into()
                };
                let mut p = Verdict::new(
                    format!(
                        "{cond} {}: IOPS ratio − anchor's, per round, ≥ {at_least} (medians {x:.3}, {a:.3})",
                        j.name
                    ),
                    value,
                    -margin,
                    value >= -margin,
                );
                p.margin = bootstrap(&[&d], |s| median(&s[0]) + margin);
                v.push(p);
                continue;
            }
            let mut x = Verdict::new(
                format!(
                    "{cond} {}: IOPS ratio ≥ anchor's ({a:.3}) − {margin:.2}",
                    j.name
                ),
                x,
                a - margin,
                x >= a - margin,
            );
            if let (Some(n), Some(c), Some(a)) = (
                iops_of(res, "none", j.name),
                iops_of(res, cond, j.name),
                iops_of(res, "bpftrace", j.name),
            ) {
                x.margin = bootstrap(&[n, c, a], |d| {
                    (median(&d[1]) - median(&d[2])) / median(&d[0]) + margin
                });
            }
            v.push(x);
        }
    }
}

/// Each condition's memory, host agent userspace CPU, drops and uprobe hits.
fn cost_verdicts(res: &BenchResult, v: &mut Vec<Verdict>) {
    for (cond, c) in &res.costs {
        let mut bound = |check: String, value: f64, bound: f64| {
            v.push(Verdict::new(check, value, bound, value <= bound))
        };
        // The anchor's process in the guest is bpftrace, not an agent of ours.
        let agent = cond != "bpftrace";
        if let Some(p) = c.guest_agent_peak_rss_kib.iter().max().filter(|_| agent) {
            bound(
                format!("{cond}: guest agent peak RSS, MiB"),
                *p as f64 / 1024.0,
                8.0,
            );
        }
        if let Some(e) = c.host_agent_rss_kib.iter().max() {
            bound(
                format!("{cond}: host agent RSS at the end, MiB"),
                *e as f64 / 1024.0,
                16.0,
            );
        }
        // The bound is on the agent's userspace; the table shows the whole.
        // Beside it, what QEMU's own per-request threads took on this machine in
        // the same runs (their price moves with the machine's hour, as the agent's).
        if !c.host_agent_user_us_per_io.is_empty() {
            let value = median(&c.host_agent_user_us_per_io);
            let reference = match c.qemu_worker_us_per_io.as_slice() {
                [] => String::new(),
                w => format!(" (QEMU's I/O workers: {:.1})", median(w)),
            };
            bound(
                format!("{cond}: host agent userspace µs CPU per I/O{reference}"),
                value,
                1.0,
            );
        }
        if !c.drops.is_empty() {
            let value = c.drops.iter().sum::<u64>() as f64;
            bound(format!("{cond}: drops of any kind"), value, 0.0);
        }
        if !c.host_uprobe_hits_per_io.is_empty() {
            let value = median(&c.host_uprobe_hits_per_io);
            let other: Vec<f64> = c.host_other_traps.iter().map(|&n| n as f64).collect();
            // (the issue bounds the default mode; options that trap more say so)
            let extra = extra_probe_options(res);
            let mode = if extra.is_empty() {
                String::new()
            } else {
                format!("; the bound is the default mode's, this run adds {extra}")
            };
            v.push(Verdict::new(
                format!(
                    "{cond}: host uprobe hits per block request (+{} traps for other devices{mode})",
                    median(&other)
                ),
                value,
                1.0,
                value <= 1.0,
            ));
        }
    }
}

/// The host agent options of the run that trap more than once per request
/// (`--submit`, `--pop`, `--irq`), as given; empty for a pooled report (its
/// runs' settings are not read back).
fn extra_probe_options(res: &BenchResult) -> String {
    let Some(cfg) = &res.config else {
        return String::new();
    };
    cfg.vm
        .host_args
        .iter()
        .filter(|a| matches!(a.as_str(), "--submit" | "--pop" | "--irq"))
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(" ")
}

pub(super) fn render_verdicts(v: &[Verdict]) -> String {
    let mut s = String::new();
    if v.is_empty() {
        return s;
    }
    let _ = writeln!(
        s,
        "\nagainst the anchor (issue 11, medians over the rounds of the run, or runs pooled; \
         margin: {:.0} % bootstrap interval over rounds, positive is met, ~ spans zero: the \
         rounds cannot tell):",
        LEVEL * 100.0
    );
    for x in v {
        let margin = x
            .margin
            .map(|(lo, hi)| format!("  margin {lo:+.3}..{hi:+.3}"))
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "  {:<4} {:<60} {:>7.3} (bound {:.3}){margin}",
            match (x.pass, x.within_noise()) {
                (true, false) => "ok",
                (true, true) => "ok~",
                (false, true) => "MIS~",
                (false, false) => "MISS",
            },
            x.check,
            x.value,
            x.bound
        );
    }
    let (met, noise) = (
        v.iter().filter(|x| x.pass).count(),
        v.iter().filter(|x| x.within_noise()).count(),
    );
    let missed_clearly = v.iter().filter(|x| !x.pass && !x.within_noise()).count();
    let _ = writeln!(
        s,
        "  {met} of {} met; {noise} within noise; {missed_clearly} missed beyond it",
        v.len()
    );
    s
}
