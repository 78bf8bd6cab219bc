//! Latency aggregation and rendering shared by the agents.
//!
//! [`Aggregator`] keeps one HDR histogram per `(label, stage)` — a label is
//! typically a disk (`vda`) or a VM/device, a stage one of the names of
//! [`crate::stages`] (the only place stages are named and derived), so the
//! agents' own tables and the joined table use one vocabulary, plus
//! [`TOTAL_STAGE`]. [`render_waterfall`] draws one record's points on a time line.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use hdrhistogram::Histogram;

use crate::record::{Point, Points, StageSummary};
pub use crate::stages::TOTAL_STAGE;
use crate::stages::{Breakdown, StageId, Stages, DEVICE_STAGE, STAGE_IDS, STAGE_NAMES};

/// Highest value a histogram tracks exactly (1 hour in ns); larger values saturate.
const HIST_HIGH_NS: u64 = 3_600_000_000_000;
/// Two significant digits: 1 % precision at ~40 KiB per histogram.
const HIST_SIGFIG: u8 = 2;

/// The bucket layout of an HDR histogram of `1..=HIST_HIGH_NS` with
/// `HIST_SIGFIG` digits: 256 sub-buckets (128 new per power of two), 35
/// buckets. [`StageHist`] counts in this layout itself (a record is one
/// increment) and makes the `hdrhistogram` only to summarize; the tests check
/// the layout against the crate's.
const SUB_BUCKET_MASK: u64 = 255;
const SUB_BUCKET_HALF_MAGNITUDE: u32 = 7;
const HIST_BUCKETS: usize = 35;
const HIST_LEN: usize = (HIST_BUCKETS + 1) << SUB_BUCKET_HALF_MAGNITUDE;

/// The slot of a value (`value >= 1`) in that layout; past the end for a
/// value beyond the last bucket.
fn hist_index(value: u64) -> usize {
    let bucket = 56 - (value | SUB_BUCKET_MASK).leading_zeros();
    let sub = (value >> bucket) as usize;
    (((bucket + 1) as usize) << SUB_BUCKET_HALF_MAGNITUDE) + sub - (1 << SUB_BUCKET_HALF_MAGNITUDE)
}

/// The slot of `ns` in the stage histograms' bucket layout (values beyond the
/// last slot saturate into it), for counts kept elsewhere and added with
/// [`Aggregator::record_slots`] (the guest kernel's syscall histograms).
pub fn hist_slot(ns: u64) -> usize {
    hist_index(ns.max(1)).min(hist_index(HIST_HIGH_NS))
}

/// The lowest value of a slot.
fn hist_value(index: usize) -> u64 {
    let half = 1usize << SUB_BUCKET_HALF_MAGNITUDE;
    let (bucket, sub) = match (index >> SUB_BUCKET_HALF_MAGNITUDE).checked_sub(1) {
        Some(b) => (b, (index & (half - 1)) + half),
        None => (0, index & (half - 1)),
    };
    (sub as u64) << bucket
}

/// Slots per chunk of a [`StageHist`]'s counts (one power of two of values).
const CHUNK: usize = 1 << SUB_BUCKET_HALF_MAGNITUDE;
const CHUNKS: usize = HIST_LEN / CHUNK;

/// Latency distribution of one stage: counts in the HDR histogram's layout
/// (values beyond its range saturate, as `saturating_record` does). The counts
/// are kept by power of two (a chunk of [`CHUNK`] slots), each allocated when a
/// value first falls in it: a stage's values span a few powers of two, not the
/// layout's 36 (5–10 KiB per histogram instead of 36 KiB).
#[derive(Clone, Debug)]
pub struct StageHist {
    chunks: Box<[Option<Box<[u64; CHUNK]>>]>,
    sum: u128,
}

impl StageHist {
    fn new() -> Self {
        StageHist {
            chunks: vec![None; CHUNKS].into_boxed_slice(),
            sum: 0,
        }
    }

    /// The count of slot `i` (< HIST_LEN), its chunk allocated if need be.
    fn slot_mut(&mut self, i: usize) -> &mut u64 {
        let chunk = self.chunks[i / CHUNK].get_or_insert_with(|| Box::new([0; CHUNK]));
        &mut chunk[i % CHUNK]
    }

    /// (slot, count) of every slot counted in, in slot order.
    fn slots(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.chunks.iter().enumerate().flat_map(|(ci, c)| {
            c.iter()
                .flat_map(|c| c.iter().enumerate())
                .filter(|e| *e.1 > 0)
                .map(move |(j, &n)| (ci * CHUNK + j, n))
        })
    }

    fn record(&mut self, ns: u64) {
        let i = hist_index(ns.max(1));
        let i = if i < HIST_LEN {
            i
        } else {
            hist_index(HIST_HIGH_NS)
        };
        let c = self.slot_mut(i);
        *c = c.saturating_add(1);
        self.sum += u128::from(ns);
    }

    /// Adds counts by slot ([`hist_slot`]) and their values' sum; a slot past
    /// the end counts in the last one.
    fn add_slots(&mut self, slots: &[(usize, u64)], sum: u128) {
        let last = hist_index(HIST_HIGH_NS);
        for &(i, n) in slots {
            let c = self.slot_mut(i.min(last));
            *c = c.saturating_add(n);
        }
        self.sum += sum;
    }

    fn add(&mut self, other: &StageHist) {
        for (mine, theirs) in self.chunks.iter_mut().zip(other.chunks.iter()) {
            let Some(t) = theirs else { continue };
            match mine {
                Some(m) => {
                    for (a, b) in m.iter_mut().zip(t.iter()) {
                        *a = a.saturating_add(*b);
                    }
                }
                None => *mine = Some(t.clone()),
            }
        }
        self.sum += other.sum;
    }

    /// The values as an HDR histogram (each slot's count at its lowest value).
    fn histogram(&self) -> Histogram<u64> {
        let mut h = Histogram::new_with_bounds(1, HIST_HIGH_NS, HIST_SIGFIG)
            .expect("static histogram bounds are valid");
        for (i, c) in self.slots() {
            h.saturating_record_n(hist_value(i), c);
        }
        h
    }

    /// Summary of the recorded values.
    pub fn summary(&self) -> Summary {
        let hist = self.histogram();
        let count = hist.len();
        Summary {
            count,
            mean_ns: if count == 0 {
                0
            } else {
                (self.sum / u128::from(count)) as u64
            },
            p50_ns: hist.value_at_quantile(0.5),
            p99_ns: hist.value_at_quantile(0.99),
            max_ns: hist.max(),
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

/// A table label `a/b` (VM and disk or device), formatted again only when the
/// pair changes: the per-record path does not format or allocate.
#[derive(Clone, Debug, Default)]
pub struct PairLabel {
    pair: Option<(crate::record::Name, crate::record::Name)>,
    label: String,
}

impl PairLabel {
    pub fn get(&mut self, a: &str, b: &str) -> &str {
        if !matches!(&self.pair, Some((x, y)) if x == a && y == b) {
            self.label.clear();
            self.label.push_str(a);
            self.label.push('/');
            self.label.push_str(b);
            self.pair = Some((a.into(), b.into()));
        }
        &self.label
    }
}

/// Histograms of one label, stages in first-seen order.
#[derive(Clone, Debug)]
struct LabelStats {
    stages: Vec<(Cow<'static, str>, StageHist)>,
    /// Position + 1 in `stages` of each [`StageId`] (0: not seen yet): a
    /// record's stage is found by its id, without comparing names.
    by_id: [u16; STAGE_IDS],
}

impl Default for LabelStats {
    fn default() -> Self {
        LabelStats {
            stages: Vec::new(),
            by_id: [0; STAGE_IDS],
        }
    }
}

impl LabelStats {
    /// Index of stage `id` (added if new).
    fn index_of_id(&mut self, id: StageId) -> usize {
        match self.by_id[id.index()] {
            0 => {
                self.stages
                    .push((Cow::Borrowed(id.name()), StageHist::new()));
                self.by_id[id.index()] = self.stages.len() as u16;
                self.stages.len() - 1
            }
            k => usize::from(k) - 1,
        }
    }

    /// Index of stage `name` (added if new).
    fn index_of_name(&mut self, name: &str) -> usize {
        if let Some(id) = StageId::of_name(name) {
            return self.index_of_id(id);
        }
        match self.stages.iter().position(|(s, _)| s == name) {
            Some(i) => i,
            None => {
                self.stages
                    .push((Cow::Owned(name.to_owned()), StageHist::new()));
                self.stages.len() - 1
            }
        }
    }

    /// Records one value of a record's stage `id` (a negative cross-clock
    /// stage counts as 0).
    fn record_id(&mut self, id: StageId, ns: i64) {
        let i = self.index_of_id(id);
        self.stages[i].1.record(ns.max(0) as u64);
    }

    /// [`record_id`](Self::record_id) by name.
    fn record_name(&mut self, name: &str, ns: i64) {
        let i = self.index_of_name(name);
        self.stages[i].1.record(ns.max(0) as u64);
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
        let ls = self.label_mut(label);
        let i = ls.index_of_name(stage);
        ls.stages[i].1.record(ns);
    }

    /// Adds durations counted elsewhere for `(label, stage)`: counts by slot
    /// ([`hist_slot`]) and the sum of their values (ns). The same as recording
    /// each value, without having the values.
    pub fn record_slots(&mut self, label: &str, stage: &str, slots: &[(usize, u64)], sum: u128) {
        self.label_mut(label).stage_mut(stage).add_slots(slots, sum);
    }

    /// Records the stages of a record's points (see [`crate::stages::derive`])
    /// and its total under `label`; returns the total.
    pub fn record_points(&mut self, label: &str, points: &Points) -> Option<i64> {
        let ls = self.label_mut(label);
        let (total, _) = crate::stages::visit_stages(points, |id, ns| ls.record_id(id, ns));
        if let Some(t) = total {
            ls.record_id(StageId::TOTAL, t);
        }
        total
    }

    /// Records a derived breakdown's stages (a negative cross-clock stage counts
    /// as 0) and total under `label`.
    pub fn record_breakdown(&mut self, label: &str, bd: &Breakdown) {
        self.record_stages(label, &bd.stages, bd.total_ns);
    }

    /// Records stages (a negative cross-clock stage counts as 0) and a total
    /// under `label`: one label lookup for all of them.
    pub fn record_stages(&mut self, label: &str, stages: &Stages, total_ns: Option<i64>) {
        let ls = self.label_mut(label);
        for (name, ns) in stages.iter() {
            ls.record_name(name, ns);
        }
        if let Some(t) = total_ns {
            ls.record_id(StageId::TOTAL, t);
        }
    }

    /// Moves this aggregator's values into `total` and clears it: an agent
    /// records each value once, into its interval, and the totals take whole
    /// intervals (a histogram merge per stage, not a second record per value).
    pub fn drain_into(&mut self, total: &mut Aggregator) {
        total.merge(self);
        self.clear();
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
            let mine = self.labels.entry(label.clone()).or_default();
            for (stage, h) in &theirs.stages {
                let i = mine.index_of_name(stage);
                mine.stages[i].1.add(h);
            }
        }
    }

    /// Every stage's summary, labels sorted, stages in first-seen order.
    pub fn summaries(&self) -> Vec<StageSummary> {
        self.labels
            .iter()
            .flat_map(|(l, st)| {
                st.stages.iter().map(move |(s, h)| StageSummary {
                    label: l.clone(),
                    stage: s.to_string(),
                    summary: h.summary(),
                })
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
            let mut rows: Vec<&(Cow<'static, str>, StageHist)> = stages.stages.iter().collect();
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

/// Path position of a stage for table order: the partition's stages in path
/// order (a merged `a+b` at `a`, `device` at `kick_to_pop`), other names after
/// them (first-seen order), the total last.
fn stage_rank(name: &str) -> (u8, usize) {
    if name == TOTAL_STAGE {
        return (2, 0);
    }
    let first = name.split('+').next().unwrap_or(name);
    let first = if first == DEVICE_STAGE {
        "kick_to_pop"
    } else {
        first
    };
    match STAGE_NAMES.iter().position(|s| *s == first) {
        Some(i) => (0, i),
        None => (1, 0),
    }
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
    use proptest::prelude::*;

    fn hdr() -> Histogram<u64> {
        Histogram::new_with_bounds(1, HIST_HIGH_NS, HIST_SIGFIG).unwrap()
    }

    #[test]
    fn a_stage_hist_allocates_only_the_powers_of_two_it_counts() {
        let mut h = StageHist::new();
        let chunks = |h: &StageHist| h.chunks.iter().filter(|c| c.is_some()).count();
        assert_eq!(chunks(&h), 0);
        for ns in [40_000u64, 50_000, 60_000, 65_000] {
            h.record(ns);
        }
        assert_eq!(chunks(&h), 1);
        h.record(1_000_000);
        h.record(u64::MAX);
        assert_eq!(chunks(&h), 3);
        let mut m = StageHist::new();
        m.add(&h);
        assert_eq!((chunks(&m), m.summary()), (3, h.summary()));
    }

    #[test]
    fn counts_by_slot_equal_recorded_values() {
        let values = [0u64, 1, 255, 256, 300, 4_000, 65_537, 1 << 33, u64::MAX];
        let (mut each, mut slots) = (Aggregator::new(), Aggregator::new());
        let mut by_slot: Vec<(usize, u64)> = Vec::new();
        for v in values {
            each.record("syscalls", "pread64", v);
            by_slot.push((hist_slot(v), 1));
        }
        let sum: u128 = values.iter().map(|&v| u128::from(v)).sum();
        slots.record_slots("syscalls", "pread64", &by_slot, sum);
        assert_eq!(each.summaries(), slots.summaries());
        assert_eq!(each.render_table("t"), slots.render_table("t"));
        assert_eq!(hist_slot(u64::MAX), hist_slot(HIST_HIGH_NS));
    }

    #[test]
    fn stage_hist_layout_is_hdrhistograms() {
        let h = hdr();
        assert_eq!(h.distinct_values(), HIST_LEN);
        let mut v = 1u64;
        while v < HIST_HIGH_NS {
            for x in [v, v + 1, v * 3 / 2, (v * 2).saturating_sub(1)] {
                assert_eq!(hist_value(hist_index(x)), h.lowest_equivalent(x), "{x}");
            }
            v *= 2;
        }
        assert!(hist_index(HIST_HIGH_NS) < HIST_LEN);
        assert!(hist_index(u64::MAX) >= HIST_LEN);
    }

    proptest! {
        /// Same count, mean and quantiles as recording into the HDR histogram
        /// (also when merged, and for values beyond its range).
        #[test]
        fn stage_hist_summary_is_hdrhistograms(
            a in prop::collection::vec(prop_oneof![0u64..5_000_000, any::<u64>()], 0..300),
            b in prop::collection::vec(0u64..50_000_000_000, 0..300),
        ) {
            let (mut x, mut y) = (StageHist::new(), StageHist::new());
            let mut h = hdr();
            let mut sum = 0u128;
            for &v in &a {
                x.record(v);
                h.saturating_record(v.max(1));
                sum += u128::from(v);
            }
            for &v in &b {
                y.record(v);
                h.saturating_record(v.max(1));
                sum += u128::from(v);
            }
            x.add(&y);
            let n = h.len();
            let want = Summary {
                count: n,
                mean_ns: if n == 0 { 0 } else { (sum / u128::from(n)) as u64 },
                p50_ns: h.value_at_quantile(0.5),
                p99_ns: h.value_at_quantile(0.99),
                max_ns: h.max(),
            };
            prop_assert_eq!(x.summary(), want);
        }
    }

    fn pts(v: &[(Point, u64)]) -> Points {
        v.iter().copied().collect()
    }

    #[test]
    fn pair_label_follows_the_pair() {
        let mut l = PairLabel::default();
        assert_eq!(l.get("vm1", "vda"), "vm1/vda");
        assert_eq!(l.get("vm1", "vda"), "vm1/vda");
        assert_eq!(l.get("vm1", "vdb"), "vm1/vdb");
        assert_eq!(l.get("vm2", "vdb"), "vm2/vdb");
        assert_eq!(l.get("vm", "2/vdb"), "vm/2/vdb");
    }

    #[test]
    fn record_points_uses_the_partition_names() {
        let p = pts(&[
            (Point::RqIssue, 300),
            (Point::QueueRq, 250),
            (Point::BioQueue, 100),
            (Point::Kick, 400),
            (Point::Irq, 900),
            (Point::RqComplete, 1300),
        ]);
        let mut a = Aggregator::new();
        a.record_points("vda", &p);
        let got: Vec<(String, u64)> = a
            .summaries()
            .into_iter()
            .map(|s| (s.stage, s.summary.max_ns))
            .collect();
        let want = [
            ("guest_queue", 200),
            ("guest_driver", 100),
            ("device", 500),
            ("guest_complete", 400),
            ("total", 1200),
        ];
        assert_eq!(got.len(), want.len(), "{got:?}");
        for ((g, gns), (w, wns)) in got.iter().zip(want) {
            assert_eq!(g, w);
            // HDR histograms keep 2 significant digits.
            assert!(gns.abs_diff(wns) * 100 <= wns, "{g}: {gns} vs {wns}");
        }
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
        a.record("vda", "guest_complete", 5);
        a.record("vda", "custom", 1);
        a.record("vda", "device", 3);
        a.record("vda", "guest_queue+guest_driver", 2);
        let t = a.render_table("t");
        let pos = |s: &str| t.find(s).unwrap();
        assert!(pos("guest_queue+guest_driver") < pos("device"));
        assert!(pos("device") < pos("guest_complete"));
        assert!(pos("guest_complete") < pos("custom"));
        assert!(pos("custom") < pos("total"));
    }

    #[test]
    fn record_points_feeds_stages_and_total() {
        let mut a = Aggregator::new();
        a.record_points(
            "h",
            &pts(&[(Point::HostSubmit, 10), (Point::HostIoComplete, 40)]),
        );
        assert_eq!(a.get("h", "host_io").unwrap().count, 1);
        assert_eq!(a.get("h", "total").unwrap().max_ns, 30);
    }

    /// The per-record path (stage ids from the points) makes the same
    /// statistics as recording each record's derived, named stages: joined
    /// records of a synthetic stream, with some points dropped so that stand-ins
    /// and merged stages occur, under two labels, drained into totals.
    #[test]
    fn recording_points_equals_recording_derived_stages() {
        use crate::join::synth::{generate, interleave, Event, SynthConfig};
        let s = generate(&SynthConfig {
            requests: 3000,
            queues: 2,
            seed: 5,
            ..SynthConfig::default()
        });
        let mut e = crate::join::JoinEngine::default();
        let mut out = Vec::new();
        for ev in interleave(&s, 1_000_000, 100, 9) {
            match ev {
                Event::Guest(g) => e.push_guest("vm0", g, &mut out),
                Event::Host(h) => e.push_host(h, &mut out),
                Event::Probe(a, b, c, d) => {
                    let _ = e.clock("vm0").add_guest_probe(a, b, c, d);
                }
            }
        }
        e.flush(&mut out);
        let drop = [
            Point::RqIssue,
            Point::HostPop,
            Point::HostCompleteCb,
            Point::Irq,
        ];
        let (mut by_ids, mut by_names) = (Aggregator::new(), Aggregator::new());
        let (mut ids_total, mut names_total) = (Aggregator::new(), Aggregator::new());
        for (k, j) in out.iter_mut().enumerate() {
            if k % 3 == 0 {
                j.ts.remove(drop[k % drop.len()]);
            }
            let bd = crate::stages::derive(&j.ts);
            let label = if k % 2 == 0 { "vm0/vda" } else { "vm0/vdb" };
            // a label of its own for negative (cross-clock) stages
            let label = if bd.stages.iter().any(|s| s.1 < 0) {
                "neg"
            } else {
                label
            };
            assert_eq!(by_ids.record_points(label, &j.ts), bd.total_ns);
            by_names.record_breakdown(label, &bd);
            if k % 500 == 0 {
                by_ids.drain_into(&mut ids_total);
                by_names.drain_into(&mut names_total);
            }
        }
        by_ids.drain_into(&mut ids_total);
        by_names.drain_into(&mut names_total);
        assert_eq!(ids_total.summaries(), names_total.summaries());
        assert_eq!(ids_total.render_table("t"), names_total.render_table("t"));
        let stages = ids_total.summaries().len();
        assert!(stages > 12, "merged stages and stand-ins occur: {stages}");
    }

    #[test]
    fn records_with_different_stage_sets_keep_each_stage_apart() {
        // The lookup hint (the slot after the previous stage) must not mix up
        // stages when a record skips one or brings a new one.
        let mut a = Aggregator::new();
        let full = pts(&[
            (Point::RqIssue, 100),
            (Point::VqAdd, 150),
            (Point::RqComplete, 400),
        ]);
        let short = pts(&[(Point::RqIssue, 100), (Point::RqComplete, 300)]);
        for _ in 0..3 {
            a.record_points("vda", &full);
            a.record_points("vda", &short);
        }
        let stages = |a: &Aggregator| {
            a.summaries()
                .into_iter()
                .map(|s| (s.stage, s.summary.count))
                .collect::<Vec<_>>()
        };
        let got = stages(&a);
        let total = got.iter().find(|(s, _)| s == TOTAL_STAGE).map(|x| x.1);
        assert_eq!(total, Some(6), "{got:?}");
        // every stage name appears once, and the counts add up per record kind
        let mut names: Vec<&str> = got.iter().map(|(s, _)| s.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), got.len(), "{got:?}");
        assert!(got.iter().all(|(_, n)| *n == 3 || *n == 6), "{got:?}");
    }

    #[test]
    fn totals_from_drained_intervals_equal_recording_every_value_twice() {
        let mut direct = Aggregator::new();
        let (mut interval, mut total) = (Aggregator::new(), Aggregator::new());
        for i in 1..=1000u64 {
            let stage = if i % 3 == 0 { "host_io" } else { "guest_queue" };
            direct.record("vm/vda", stage, i * 7);
            interval.record("vm/vda", stage, i * 7);
            if i % 250 == 0 {
                interval.drain_into(&mut total);
                assert!(interval.is_empty());
            }
        }
        interval.record("vm/vdb", "total", 5);
        direct.record("vm/vdb", "total", 5);
        interval.drain_into(&mut total);
        assert_eq!(total.summaries(), direct.summaries());
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
