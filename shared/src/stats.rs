//! Latency aggregation and rendering shared by the agents.
//!
//! [`Aggregator`] keeps one HDR histogram per `(label, stage)` — a label is
//! typically a disk (`vda`) or a VM/device, a stage any name (`bio_queue→rq_issue`).
//! Stage names are free-form, so the same code serves guest points, host points
//! and joined records. [`stages`] derives stages from a [`Points`] set: one per
//! pair of time-consecutive present points, plus `total`. [`render_waterfall`]
//! draws one record's points on a time line.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use hdrhistogram::Histogram;

use crate::record::{Point, Points};

/// Highest value a histogram tracks exactly (1 hour in ns); larger values saturate.
const HIST_HIGH_NS: u64 = 3_600_000_000_000;
/// Two significant digits: 1 % precision at ~40 KiB per histogram.
const HIST_SIGFIG: u8 = 2;

/// Name of the stage spanning the first to the last point of a record.
pub const TOTAL_STAGE: &str = "total";

/// Latency distribution of one stage.
#[derive(Clone, Debug)]
pub struct StageHist {
    hist: Histogram<u64>,
    sum: u128,
}

impl StageHist {
    fn new() -> Self {
        let hist = Histogram::new_with_bounds(1, HIST_HIGH_NS, HIST_SIGFIG)
            .expect("static histogram bounds are valid");
        StageHist { hist, sum: 0 }
    }

    fn record(&mut self, ns: u64) {
        self.hist.saturating_record(ns.max(1));
        self.sum += u128::from(ns);
    }

    /// Summary of the recorded values.
    pub fn summary(&self) -> Summary {
        let count = self.hist.len();
        Summary {
            count,
            mean_ns: if count == 0 {
                0
            } else {
                (self.sum / u128::from(count)) as u64
            },
            p50_ns: self.hist.value_at_quantile(0.5),
            p99_ns: self.hist.value_at_quantile(0.99),
            max_ns: self.hist.max(),
        }
    }
}

/// Count, mean, p50, p99 and max of a stage, in ns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Summary {
    pub count: u64,
    pub mean_ns: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

/// Histograms of one label, stages in first-seen order.
#[derive(Clone, Debug, Default)]
struct LabelStats {
    stages: Vec<(String, StageHist)>,
    /// `(from, to)` point-id pair → 1 + index in `stages` (0 = not yet), the
    /// last slot for the total: lets [`Aggregator::record_points`] find a
    /// stage without building its name or hashing.
    pairs: Vec<u16>,
}

/// Point ids are below this (see `Point`); pairs beyond it use the slow path.
const PAIR_IDS: usize = 64;
const TOTAL_SLOT: usize = PAIR_IDS * PAIR_IDS;

impl LabelStats {
    fn stage_mut(&mut self, stage: &str) -> &mut StageHist {
        let i = match self.stages.iter().position(|(s, _)| s == stage) {
            Some(i) => i,
            None => {
                self.stages.push((stage.to_owned(), StageHist::new()));
                self.stages.len() - 1
            }
        };
        &mut self.stages[i].1
    }
}

/// Per-`(label, stage)` latency histograms. Stages keep their first-seen order.
#[derive(Clone, Debug, Default)]
pub struct Aggregator {
    labels: BTreeMap<String, LabelStats>,
}

impl Aggregator {
    pub fn new() -> Self {
        Self::default()
    }

    fn label_mut(&mut self, label: &str) -> &mut LabelStats {
        if !self.labels.contains_key(label) {
            self.labels.insert(label.to_owned(), LabelStats::default());
        }
        self.labels.get_mut(label).expect("inserted above")
    }

    /// Records one duration for `(label, stage)`.
    pub fn record(&mut self, label: &str, stage: &str, ns: u64) {
        self.label_mut(label).stage_mut(stage).record(ns);
    }

    /// Records every stage of a record's points (see [`stages`]) under `label`.
    /// Same result as recording each of [`stages`], without per-record allocation
    /// once a stage has been seen.
    pub fn record_points(&mut self, label: &str, points: &Points) {
        let mut buf = [(Point::SyscallEnter, 0u64); MAX_POINTS];
        let v = sorted_points(points, &mut buf);
        if v.len() < 2 {
            return;
        }
        let strip = same_prefix(v);
        let ls = self.label_mut(label);
        if ls.pairs.is_empty() {
            ls.pairs = vec![0; TOTAL_SLOT + 1];
        }
        let mut add = |key: Option<(Point, Point)>, ns: u64| {
            let slot = match key {
                Some((a, b)) if (a as usize) < PAIR_IDS && (b as usize) < PAIR_IDS => {
                    a as usize * PAIR_IDS + b as usize
                }
                Some(_) => usize::MAX,
                None => TOTAL_SLOT,
            };
            let known = ls.pairs.get(slot).copied().unwrap_or(0);
            let i = if known != 0 {
                usize::from(known - 1)
            } else {
                let name = match key {
                    Some((a, b)) => format!("{}→{}", short(a, strip), short(b, strip)),
                    None => TOTAL_STAGE.to_owned(),
                };
                ls.stage_mut(&name);
                let i = ls
                    .stages
                    .iter()
                    .position(|(s, _)| *s == name)
                    .expect("created above");
                if let (Some(p), Ok(v)) = (ls.pairs.get_mut(slot), u16::try_from(i + 1)) {
                    *p = v;
                }
                i
            };
            ls.stages[i].1.record(ns);
        };
        for w in v.windows(2) {
            add(Some((w[0].0, w[1].0)), w[1].1 - w[0].1);
        }
        add(None, v[v.len() - 1].1 - v[0].1);
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Forgets everything (start of a new interval).
    pub fn clear(&mut self) {
        self.labels.clear();
    }

    /// Adds another aggregator's values into this one.
    pub fn merge(&mut self, other: &Aggregator) {
        for (label, theirs) in &other.labels {
            let mine = &mut self.labels.entry(label.clone()).or_default().stages;
            for (stage, h) in &theirs.stages {
                match mine.iter_mut().find(|(s, _)| s == stage) {
                    Some((_, m)) => {
                        // Both histograms share bounds, so add cannot fail.
                        let _ = m.hist.add(&h.hist);
                        m.sum += h.sum;
                    }
                    None => mine.push((stage.clone(), h.clone())),
                }
            }
        }
    }

    /// `(label, stage, summary)` for every stage, labels sorted, stages in first-seen order.
    pub fn summaries(&self) -> Vec<(String, String, Summary)> {
        self.labels
            .iter()
            .flat_map(|(l, st)| {
                st.stages
                    .iter()
                    .map(move |(s, h)| (l.clone(), s.clone(), h.summary()))
            })
            .collect()
    }

    /// Summary of one `(label, stage)`.
    pub fn get(&self, label: &str, stage: &str) -> Option<Summary> {
        self.labels
            .get(label)?
            .stages
            .iter()
            .find(|(s, _)| s == stage)
            .map(|(_, h)| h.summary())
    }

    /// Human table: one block per label, one row per stage.
    pub fn render_table(&self, title: &str) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "{title}");
        if self.labels.is_empty() {
            let _ = writeln!(out, "  (no I/O)");
            return out;
        }
        let width = self
            .labels
            .values()
            .flat_map(|s| s.stages.iter().map(|(n, _)| n.chars().count()))
            .max()
            .unwrap_or(5)
            .max(5);
        for (label, stages) in &self.labels {
            let _ = writeln!(
                out,
                "  {label}\n    {:<width$} {:>9} {:>10} {:>10} {:>10} {:>10}",
                "stage", "count", "mean", "p50", "p99", "max"
            );
            let mut rows: Vec<&(String, StageHist)> = stages.stages.iter().collect();
            rows.sort_by_key(|(name, _)| stage_rank(name));
            for (stage, h) in rows {
                let s = h.summary();
                let _ = writeln!(
                    out,
                    "    {:<width$} {:>9} {:>10} {:>10} {:>10} {:>10}",
                    stage,
                    s.count,
                    fmt_ns(s.mean_ns),
                    fmt_ns(s.p50_ns),
                    fmt_ns(s.p99_ns),
                    fmt_ns(s.max_ns)
                );
            }
        }
        out
    }
}

/// Path position of a stage for table order: `a→b` stages by their points'
/// path order, other names after them (first-seen order), the total last.
fn stage_rank(name: &str) -> (u8, u8, u8) {
    let point = |n: &str| {
        Point::from_name(n)
            .or_else(|| Point::from_name(&format!("g.{n}")))
            .or_else(|| Point::from_name(&format!("h.{n}")))
            .and_then(|p| Point::ALL.iter().position(|&q| q == p))
            .and_then(|i| u8::try_from(i).ok())
    };
    if name == TOTAL_STAGE {
        return (2, 0, 0);
    }
    match name.split_once('→').map(|(a, b)| (point(a), point(b))) {
        Some((Some(a), Some(b))) => (0, a, b),
        _ => (1, 0, 0),
    }
}

/// Short name of a point for stage names: `g.rq_issue` → `rq_issue` when `strip`.
fn short(p: Point, strip: bool) -> &'static str {
    let n = p.name();
    if strip {
        n.split_once('.').map_or(n, |(_, s)| s)
    } else {
        n
    }
}

/// Stages of a record: one per pair of time-consecutive present points
/// (`a→b`, ns between them), then [`TOTAL_STAGE`] (first to last) when there
/// are at least two points. Point prefixes (`g.`/`h.`) are dropped when all
/// points share one. Points are ordered by time, ties by path order.
pub fn stages(points: &Points) -> Vec<(String, u64)> {
    let mut buf = [(Point::SyscallEnter, 0u64); MAX_POINTS];
    let v = sorted_points(points, &mut buf);
    if v.len() < 2 {
        return Vec::new();
    }
    let strip = same_prefix(v);
    let mut out: Vec<(String, u64)> = v
        .windows(2)
        .map(|w| {
            (
                format!("{}→{}", short(w[0].0, strip), short(w[1].0, strip)),
                w[1].1 - w[0].1,
            )
        })
        .collect();
    out.push((TOTAL_STAGE.to_owned(), v[v.len() - 1].1 - v[0].1));
    out
}

/// At most this many points of a record are considered (there are fewer points).
const MAX_POINTS: usize = 64;

/// The present points sorted by time (ties: path order), in `buf`.
fn sorted_points<'a>(
    points: &Points,
    buf: &'a mut [(Point, u64); MAX_POINTS],
) -> &'a [(Point, u64)] {
    let mut n = 0;
    for e in points.iter().take(MAX_POINTS) {
        buf[n] = e;
        n += 1;
    }
    let v = &mut buf[..n];
    v.sort_unstable_by_key(|&(p, t)| (t, p));
    v
}

/// Whether all points share one prefix (`g.`/`h.`), which stage names then drop.
fn same_prefix(v: &[(Point, u64)]) -> bool {
    let prefix = |p: Point| {
        let n = p.name().as_bytes();
        &n[..n.iter().position(|&c| c == b'.').unwrap_or(n.len())]
    };
    v.iter().all(|&(p, _)| prefix(p) == prefix(v[0].0))
}

/// Formats ns with a unit fit for latencies (`850ns`, `12.3us`, `4.56ms`, `1.20s`).
pub fn fmt_ns(ns: u64) -> String {
    let f = ns as f64;
    if ns < 1_000 {
        format!("{ns}ns")
    } else if ns < 1_000_000 {
        format!("{:.1}us", f / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.2}ms", f / 1e6)
    } else {
        format!("{:.2}s", f / 1e9)
    }
}

/// Width of the waterfall's time bar, in characters.
const BAR: usize = 40;

/// One record as a waterfall: a header line, then one line per present point
/// (time order) with its offset from the first point, the step from the previous
/// one, and a bar placing that step on the record's time line.
pub fn render_waterfall(header: &str, points: &Points) -> String {
    let mut out = String::new();
    let mut v: Vec<(Point, u64)> = points.iter().collect();
    v.sort_by_key(|&(p, t)| (t, p));
    let (Some(&(_, t0)), Some(&(_, tn))) = (v.first(), v.last()) else {
        let _ = writeln!(out, "{header}\n  (no points)");
        return out;
    };
    let span = (tn - t0).max(1);
    let _ = writeln!(out, "{header}  total {}", fmt_ns(tn - t0));
    let col = |t: u64| ((u128::from(t - t0) * BAR as u128) / u128::from(span)) as usize;
    let mut prev = t0;
    for &(p, t) in &v {
        let (a, b) = (col(prev), col(t).max(col(prev)));
        let mut bar = String::with_capacity(BAR + 2);
        for i in 0..=BAR {
            bar.push(if i == b || (i >= a && i < b) {
                '█'
            } else {
                '·'
            });
        }
        let _ = writeln!(
            out,
            "  {:<18} +{:>10} {:>11} |{bar}|",
            p.name(),
            fmt_ns(t - t0),
            if t == t0 {
                String::new()
            } else {
                format!("(+{})", fmt_ns(t - prev))
            },
        );
        prev = t;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pts(v: &[(Point, u64)]) -> Points {
        v.iter().copied().collect()
    }

    #[test]
    fn stages_follow_time_order_and_strip_common_prefix() {
        let p = pts(&[
            (Point::RqIssue, 300),
            (Point::QueueRq, 250),
            (Point::BioQueue, 100),
            (Point::RqComplete, 1300),
        ]);
        let s = stages(&p);
        assert_eq!(
            s,
            vec![
                ("bio_queue→queue_rq".to_string(), 150),
                ("queue_rq→rq_issue".to_string(), 50),
                ("rq_issue→rq_complete".to_string(), 1000),
                ("total".to_string(), 1200),
            ]
        );
        let mixed = pts(&[(Point::Kick, 10), (Point::HostPop, 30)]);
        assert_eq!(stages(&mixed)[0].0, "g.kick→h.pop");
        assert!(stages(&pts(&[(Point::Kick, 10)])).is_empty());
    }

    #[test]
    fn aggregator_summarises_per_label_and_stage() {
        let mut a = Aggregator::new();
        for i in 1..=100u64 {
            a.record("vda", "x", i * 1000);
        }
        a.record("vdb", "y", 5);
        let s = a.get("vda", "x").unwrap();
        assert_eq!(s.count, 100);
        assert_eq!(s.mean_ns, 50_500);
        assert!((49_000..=51_000).contains(&s.p50_ns), "{s:?}");
        assert!((98_000..=100_500).contains(&s.p99_ns), "{s:?}");
        assert!((99_000..=101_000).contains(&s.max_ns), "{s:?}");
        assert_eq!(a.get("vdb", "y").unwrap().count, 1);
        assert!(a.get("vdb", "x").is_none());
        let t = a.render_table("interval");
        assert!(t.contains("vda") && t.contains("vdb") && t.contains("100"));
        let mut b = Aggregator::new();
        b.merge(&a);
        b.merge(&a);
        assert_eq!(b.get("vda", "x").unwrap().count, 200);
        a.clear();
        assert!(a.is_empty());
        assert!(a.render_table("t").contains("no I/O"));
    }

    #[test]
    fn table_rows_follow_path_order_with_total_last() {
        let mut a = Aggregator::new();
        a.record("vda", "total", 9);
        a.record("vda", "rq_issue→rq_complete", 5);
        a.record("vda", "custom", 1);
        a.record("vda", "syscall_enter→bio_queue", 2);
        let t = a.render_table("t");
        let pos = |s: &str| t.find(s).unwrap();
        assert!(pos("syscall_enter→bio_queue") < pos("rq_issue→rq_complete"));
        assert!(pos("rq_issue→rq_complete") < pos("custom"));
        assert!(pos("custom") < pos("total"));
    }

    #[test]
    fn record_points_feeds_stages_and_total() {
        let mut a = Aggregator::new();
        a.record_points(
            "vda",
            &pts(&[(Point::RqIssue, 10), (Point::RqComplete, 40)]),
        );
        assert_eq!(a.get("vda", "rq_issue→rq_complete").unwrap().count, 1);
        assert_eq!(a.get("vda", "total").unwrap().max_ns, 30);
    }

    #[test]
    fn record_points_matches_stages() {
        let recs = [
            pts(&[(Point::BioQueue, 5), (Point::RqIssue, 9), (Point::Irq, 20)]),
            pts(&[(Point::BioQueue, 1), (Point::RqIssue, 4), (Point::Irq, 30)]),
            pts(&[(Point::Kick, 1), (Point::HostPop, 7)]),
        ];
        let (mut a, mut b) = (Aggregator::new(), Aggregator::new());
        for r in &recs {
            a.record_points("x", r);
            for (st, ns) in stages(r) {
                b.record("x", &st, ns);
            }
        }
        assert_eq!(a.summaries(), b.summaries());
        assert_eq!(a.get("x", "total").unwrap().count, 3);
    }

    #[test]
    fn waterfall_lists_points_in_time_order() {
        let w = render_waterfall(
            "pid 1 x",
            &pts(&[(Point::RqComplete, 5_000_000), (Point::RqIssue, 1_000_000)]),
        );
        let lines: Vec<&str> = w.lines().collect();
        assert!(lines[0].starts_with("pid 1 x") && lines[0].contains("4.00ms"));
        assert!(lines[1].contains("g.rq_issue"));
        assert!(lines[2].contains("g.rq_complete") && lines[2].contains("(+4.00ms)"));
        assert!(render_waterfall("h", &Points::new()).contains("no points"));
    }

    #[test]
    fn fmt_ns_units() {
        assert_eq!(fmt_ns(999), "999ns");
        assert_eq!(fmt_ns(12_345), "12.3us");
        assert_eq!(fmt_ns(4_560_000), "4.56ms");
        assert_eq!(fmt_ns(1_200_000_000), "1.20s");
    }
}
