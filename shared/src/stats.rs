//! Latency aggregation and rendering shared by the agents.
//!
//! [`Aggregator`] keeps one histogram per `(label, stage)`, in an HDR
//! histogram's layout — a label is typically a disk (`vda`) or a VM/device,
//! a stage one of the names of
//! [`crate::stages`] (the only place stages are named and derived), so the
//! agents' own tables and the joined table use one vocabulary, plus
//! [`TOTAL_STAGE`]. [`render_waterfall`] draws one record's points on a time line.

use std::borrow::Cow;
use std::fmt::Write as _;

use crate::record::{Point, Points, StageSummary};
pub use crate::stages::TOTAL_STAGE;
use crate::stages::{Breakdown, StageId, Stages, DEVICE_STAGE, STAGE_IDS, STAGE_NAMES};

/// Highest value a histogram tracks exactly (1 hour in ns); larger values saturate.
const HIST_HIGH_NS: u64 = 3_600_000_000_000;
/// Two significant digits (1 % precision): the HDR histogram whose layout
/// the counts use (the tests build it to check the layout and summaries).
#[cfg(test)]
const HIST_SIGFIG: u8 = 2;

/// The bucket layout of an HDR histogram of `1..=HIST_HIGH_NS` with
/// `HIST_SIGFIG` digits: 256 sub-buckets (128 new per power of two), 35
/// buckets. [`StageHist`] counts in this layout itself (a record is one
/// increment) and summarizes as the `hdrhistogram` crate would; the tests
/// check the layout and the summaries against the crate's.
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

/// The highest value of a slot (its lowest plus its width, less one).
fn hist_high(index: usize) -> u64 {
    let bucket = (index >> SUB_BUCKET_HALF_MAGNITUDE).saturating_sub(1);
    hist_value(index) + (1u64 << bucket) - 1
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
    chunks: Box<[Option<Box<[u64; CHUNK]>>; CHUNKS]>,
    sum: u128,
}

impl Default for StageHist {
    fn default() -> Self {
        Self::new()
    }
}

impl StageHist {
    pub fn new() -> Self {
        StageHist {
            chunks: Box::new(std::array::from_fn(|_| None)),
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

    /// Counts one value (ns).
    #[inline]
    pub fn record(&mut self, ns: u64) {
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

    /// Summary of the recorded values: what an HDR histogram of them reports
    /// (quantiles and max at the highest value of their slot), read off the
    /// counts directly (the tests check it against the crate's).
    pub fn summary(&self) -> Summary {
        let count = self.slots().fold(0u64, |n, (_, c)| n.saturating_add(c));
        // hdrhistogram's value_at_quantile: the first slot whose running
        // count reaches ceil(q * count), at least 1.
        let at = |q: f64| {
            let want = ((q * count as f64).ceil() as u64).max(1);
            let mut seen = 0u64;
            self.slots()
                .find(|&(_, c)| {
                    seen = seen.saturating_add(c);
                    seen >= want
                })
                .map_or(0, |(i, _)| hist_high(i))
        };
        Summary {
            count,
            mean_ns: if count == 0 {
                0
            } else {
                (self.sum / u128::from(count)) as u64
            },
            p50_ns: at(0.5),
            p99_ns: at(0.99),
            max_ns: self.slots().last().map_or(0, |(i, _)| hist_high(i)),
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
    /// The stages of the masks recorded last (direct-mapped by mask).
    plans: [Option<MaskPlan>; MASK_PLANS],
    /// The position of the stage last found by name (checked before use: a
    /// label's named stages, its syscalls, come in runs).
    last_named: usize,
}

impl Default for LabelStats {
    fn default() -> Self {
        LabelStats {
            stages: Vec::new(),
            by_id: [0; STAGE_IDS],
            plans: [None; MASK_PLANS],
            last_named: 0,
        }
    }
}

/// Plans kept per label: a stream's records have a few masks (joined,
/// host-only, guest-only; a notification point dropped or not).
const MASK_PLANS: usize = 4;

/// A point mask's stages resolved against one label's histograms: each
/// stage as `(start slot, end slot, position in stages)`, and the total
/// the same way. Recording a set of points is then subtractions and
/// increments.
#[derive(Clone, Copy, Debug)]
struct MaskPlan {
    mask: u32,
    n: u8,
    steps: [(u8, u8, u16); crate::stages::MAX_SPANS],
    total: Option<(u8, u8, u16)>,
}

impl LabelStats {
    /// The plan of `mask` (resolved, and its stages added in path order,
    /// the first time).
    fn plan(&mut self, mask: u32) -> MaskPlan {
        let k = (mask.wrapping_mul(0x9E37_79B9) >> 30) as usize % MASK_PLANS;
        if let Some(p) = self.plans[k].filter(|p| p.mask == mask) {
            return p;
        }
        let mut p = MaskPlan {
            mask,
            n: 0,
            steps: [(0, 0, 0); crate::stages::MAX_SPANS],
            total: None,
        };
        let ends = crate::stages::stage_slots(mask, |id, a, b| {
            p.steps[p.n as usize] = (a, b, self.index_of_id(id) as u16);
            p.n += 1;
        });
        p.total = (ends.and_then(|e| e.total))
            .map(|(a, b)| (a, b, self.index_of_id(StageId::TOTAL) as u16));
        self.plans[k] = Some(p);
        p
    }

    /// Records the stages and total of a set of points; returns the total.
    fn record_points(&mut self, ts: &Points) -> Option<i64> {
        let p = self.plan(ts.mask());
        // A stage's value as recorded: a negative one counts as 0 (as
        // `diff(..).max(0)`, without its 128-bit clamp).
        let gap = |(a, b, _): (u8, u8, u16)| {
            let d = ts
                .at_slot(b as usize)
                .saturating_sub(ts.at_slot(a as usize));
            d.min(i64::MAX as u64)
        };
        for &step in &p.steps[..p.n as usize] {
            self.stages[step.2 as usize].1.record(gap(step));
        }
        let t = p.total?;
        self.stages[t.2 as usize].1.record(gap(t));
        Some(crate::stages::diff(
            ts.at_slot(t.0 as usize),
            ts.at_slot(t.1 as usize),
        ))
    }

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
        // (stage names are unique here: a hit is the stage, whatever kind)
        if self
            .stages
            .get(self.last_named)
            .is_some_and(|(s, _)| s == name)
        {
            return self.last_named;
        }
        let i = if let Some(id) = StageId::of_name(name) {
            self.index_of_id(id)
        } else if let Some(i) = self.stages.iter().position(|(s, _)| s == name) {
            i
        } else {
            self.stages
                .push((Cow::Owned(name.to_owned()), StageHist::new()));
            self.stages.len() - 1
        };
        self.last_named = i;
        i
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
    /// Sorted by label: one binary search finds a record's label (an agent
    /// has a few), without the map's second lookup to insert.
    labels: Vec<(String, LabelStats)>,
    /// The indexes of the two labels used last, the latest first (checked
    /// before use: records come in runs of one label, or alternate between
    /// two, a disk's requests and the syscalls that made them; the check is
    /// cheaper than the search).
    last: [usize; 2],
}

impl Aggregator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Where `label` is in the sorted labels (`Err`: where it would go).
    fn position(&self, label: &str) -> Result<usize, usize> {
        self.labels.binary_search_by(|(l, _)| l.as_str().cmp(label))
    }

    fn label_mut(&mut self, label: &str) -> &mut LabelStats {
        let [a, b] = self.last;
        let is = |i: usize| self.labels.get(i).is_some_and(|(l, _)| l == label);
        let i = if is(a) {
            a
        } else if is(b) {
            b
        } else {
            match self.position(label) {
                Ok(i) => i,
                Err(i) => {
                    self.labels
                        .insert(i, (label.to_owned(), LabelStats::default()));
                    i
                }
            }
        };
        if i != a {
            self.last = [i, a];
        }
        &mut self.labels[i].1
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
        let ls = self.label_mut(label);
        let i = ls.index_of_name(stage);
        ls.stages[i].1.add_slots(slots, sum);
    }

    /// Adds the values of a histogram kept aside to `(label, stage)` (a caller
    /// that finds its histogram by a number, not by two names, per value).
    pub fn add_hist(&mut self, label: &str, stage: &str, h: &StageHist) {
        let ls = self.label_mut(label);
        let i = ls.index_of_name(stage);
        ls.stages[i].1.add(h);
    }

    /// Records the stages of a record's points (see [`crate::stages::derive`])
    /// and its total under `label`; returns the total.
    pub fn record_points(&mut self, label: &str, points: &Points) -> Option<i64> {
        self.label_mut(label).record_points(points)
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
            let mine = self.label_mut(label);
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
        let i = self.position(label).ok()?;
        self.labels[i]
            .1
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
            .iter()
            .flat_map(|(_, s)| s.stages.iter().map(|(n, _)| n.chars().count()))
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
#[path = "stats_tests.rs"]
mod tests;
