//! Fleet metrics: per-stage latency histograms, request/byte counters and the
//! agents' counters. The per-record path takes one uncontended lock of its
//! series and adds to plain counters (one lock instead of two atomic adds per
//! stage: about a third of the cost); everything else (formatting, `/proc`
//! reads, label strings) happens only when someone scrapes ([`expose`]).
//!
//! Series are keyed by `(source, vm, disk, queue)`: `source` is `joined`
//! (end-to-end records of the host agent), `host` (the host agent's own
//! elements) or `guest` (the guest agent's requests). Label cardinality is
//! bounded: at most [`MAX_SERIES`] keys (more are counted in
//! `viotrace_metrics_series_dropped_total`, never created), stages come from
//! the fixed vocabulary of [`crate::stages`] (merged names included, at most
//! [`MAX_STAGES`]), ops from [`Op`]; no pid, comm, cgroup or inode labels.

pub mod expose;
#[cfg(feature = "otlp")]
pub mod otlp;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::record::Op;
use crate::stages::{Stages, DEVICE_STAGE, STAGE_NAMES};

/// Upper bounds of the latency buckets: 1 µs · 2^k for k = 0..=24 (1 µs to
/// ≈16.8 s), then +Inf. Powers of two cover µs device latencies to multi-second
/// stalls with a constant relative resolution, and the bucket of a value is a
/// `leading_zeros`, not a search.
pub const BUCKETS: usize = 25;

/// Bucket bound `k` in ns.
pub const fn bound_ns(k: usize) -> u64 {
    1000 << k
}

/// The bucket (0..=BUCKETS, BUCKETS = +Inf) of a duration; negative values
/// (cross-clock stages within the clock uncertainty) count as 0.
#[inline]
pub fn bucket_of(ns: i64) -> usize {
    let v = ns.max(0) as u64;
    let q = v.saturating_sub(1) / 1000;
    ((64 - q.leading_zeros()) as usize).min(BUCKETS)
}

/// A fixed-bucket histogram of durations (ns).
#[derive(Clone, Debug)]
pub struct LatencyHistogram {
    counts: [u64; BUCKETS + 1],
    sum_ns: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            counts: [0; BUCKETS + 1],
            sum_ns: 0,
        }
    }
}

/// A point-in-time copy of a histogram: per-bucket (not cumulative) counts.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HistSnapshot {
    pub counts: Vec<u64>,
    pub sum_ns: u64,
}

impl HistSnapshot {
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
    /// `(upper bound in seconds, count in that bucket)`, +Inf last.
    pub fn buckets_seconds(&self) -> Vec<(f64, u64)> {
        (0..=BUCKETS)
            .map(|k| {
                let b = if k == BUCKETS {
                    f64::INFINITY
                } else {
                    bound_ns(k) as f64 / 1e9
                };
                (b, self.counts[k])
            })
            .collect()
    }
    /// `(upper bound in seconds, cumulative count)` for the finite buckets.
    pub fn cumulative_seconds(&self) -> Vec<(f64, u64)> {
        let mut acc = 0;
        (0..BUCKETS)
            .map(|k| {
                acc += self.counts[k];
                (bound_ns(k) as f64 / 1e9, acc)
            })
            .collect()
    }
}

impl LatencyHistogram {
    #[inline]
    pub fn observe(&mut self, ns: i64) {
        self.counts[bucket_of(ns)] += 1;
        self.sum_ns = self.sum_ns.wrapping_add(ns.max(0) as u64);
    }
    pub fn snapshot(&self) -> HistSnapshot {
        HistSnapshot {
            counts: self.counts.to_vec(),
            sum_ns: self.sum_ns,
        }
    }
}

/// Most `(source, vm, disk, queue)` series.
pub const MAX_SERIES: usize = 1024;
/// Most distinct stage names (the partition's, `device`, merged ones, `total`).
pub const MAX_STAGES: usize = 64;
/// Name of the whole-request duration in the stage histograms.
pub const TOTAL: &str = "total";

fn op_index(op: Op) -> usize {
    Op::ALL
        .iter()
        .position(|o| *o == op)
        .unwrap_or(Op::ALL.len() - 1)
}

/// Identity of a series.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeriesKey {
    pub source: &'static str,
    pub vm: String,
    pub disk: String,
    /// Queue number (label `""` when unknown).
    pub queue: Option<u16>,
}

/// One series: its counters behind one lock, taken once per record (by the
/// agent's record path; a scrape takes it to copy them).
#[derive(Debug, Default)]
pub struct Series(Mutex<SeriesData>);

#[derive(Debug)]
struct SeriesData {
    stages: Vec<LatencyHistogram>,
    requests: [u64; 8],
    bytes: [u64; 8],
    /// Records that were not joined (source `joined` only).
    unjoined: u64,
}

impl Default for SeriesData {
    fn default() -> Self {
        SeriesData {
            stages: vec![LatencyHistogram::default(); MAX_STAGES],
            requests: [0; 8],
            bytes: [0; 8],
            unjoined: 0,
        }
    }
}

/// Stage names by slot: the partition's, `device` and `total` first (fixed),
/// merged names as they appear.
#[derive(Debug)]
struct StageTable {
    names: RwLock<Vec<String>>,
}

impl StageTable {
    fn new() -> Self {
        let mut v: Vec<String> = STAGE_NAMES.iter().map(|s| s.to_string()).collect();
        v.push(DEVICE_STAGE.to_string());
        v.push(TOTAL.to_string());
        StageTable {
            names: RwLock::new(v),
        }
    }
    /// The slot of a stage name; `hint` is where the search starts (stages come in path order).
    fn slot(&self, name: &str, hint: usize) -> Option<usize> {
        let fixed = STAGE_NAMES.len();
        for k in (hint..fixed).chain(0..hint.min(fixed)) {
            if STAGE_NAMES[k] == name {
                return Some(k);
            }
        }
        let names = self.names.read().ok()?;
        if let Some(k) = names.iter().skip(fixed).position(|n| n == name) {
            return Some(fixed + k);
        }
        drop(names);
        let mut names = self.names.write().ok()?;
        if let Some(k) = names.iter().position(|n| n == name) {
            return Some(k);
        }
        // Only names of the stage vocabulary (merged partition stages) are admitted.
        let known = name.split('+').all(|p| STAGE_NAMES.contains(&p));
        if !known || names.len() >= MAX_STAGES {
            return None;
        }
        names.push(name.to_string());
        Some(names.len() - 1)
    }
    fn names(&self) -> Vec<String> {
        self.names.read().map(|n| n.clone()).unwrap_or_default()
    }
}

/// Everything an agent exposes. Shared (`Arc`) between the record path, the
/// scrape endpoint and the OTLP pusher.
#[derive(Debug)]
pub struct Metrics {
    /// `viotrace-host` or `viotrace-guest`.
    pub agent: &'static str,
    series: Mutex<HashMap<SeriesKey, Arc<Series>>>,
    stages: StageTable,
    series_dropped: AtomicU64,
    stages_dropped: AtomicU64,
    /// The agent's counters (drops, losses, transport accounts), published by its loop.
    counters: Mutex<Vec<(String, u64)>>,
    /// Gauges by (name, vm) (clock uncertainty …), published by the agent's loop.
    gauges: Mutex<Vec<(String, String, f64)>>,
}

impl Metrics {
    pub fn new(agent: &'static str) -> Arc<Metrics> {
        Arc::new(Metrics {
            agent,
            series: Mutex::new(HashMap::new()),
            stages: StageTable::new(),
            series_dropped: AtomicU64::new(0),
            stages_dropped: AtomicU64::new(0),
            counters: Mutex::new(Vec::new()),
            gauges: Mutex::new(Vec::new()),
        })
    }

    fn series(&self, key: &SeriesKey) -> Option<Arc<Series>> {
        let mut m = self.series.lock().ok()?;
        if let Some(s) = m.get(key) {
            return Some(s.clone());
        }
        if m.len() >= MAX_SERIES {
            self.series_dropped.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let s = Arc::new(Series::default());
        m.insert(key.clone(), s.clone());
        Some(s)
    }

    /// Replaces the published counters (called by the agent's loop, not per record).
    pub fn set_counters(&self, c: Vec<(String, u64)>) {
        if let Ok(mut g) = self.counters.lock() {
            *g = c;
        }
    }

    /// Replaces the published per-VM gauges `(name, vm, value)`.
    pub fn set_gauges(&self, g: Vec<(String, String, f64)>) {
        if let Ok(mut m) = self.gauges.lock() {
            *m = g;
        }
    }

    /// A copy of every series, sorted by key.
    pub fn snapshot(&self) -> Snapshot {
        let names = self.stages.names();
        let mut series: Vec<SeriesSnapshot> = self
            .series
            .lock()
            .map(|m| m.iter().map(|(k, s)| (k.clone(), s.clone())).collect())
            .unwrap_or_else(|_| Vec::new())
            .into_iter()
            .map(|(key, s)| {
                let s = s.0.lock().unwrap_or_else(|e| e.into_inner());
                SeriesSnapshot {
                    stages: names
                        .iter()
                        .enumerate()
                        .map(|(i, n)| (n.clone(), s.stages[i].snapshot()))
                        .filter(|(_, h)| h.count() > 0)
                        .collect(),
                    ops: Op::ALL
                        .iter()
                        .enumerate()
                        .map(|(i, op)| (*op, s.requests[i], s.bytes[i]))
                        .filter(|o| o.1 > 0)
                        .collect(),
                    unjoined: s.unjoined,
                    key,
                }
            })
            .collect();
        series.sort_by(|a, b| a.key.cmp(&b.key));
        Snapshot {
            agent: self.agent,
            series,
            series_dropped: self.series_dropped.load(Ordering::Relaxed),
            stages_dropped: self.stages_dropped.load(Ordering::Relaxed),
            counters: self.counters.lock().map(|c| c.clone()).unwrap_or_default(),
            gauges: self.gauges.lock().map(|c| c.clone()).unwrap_or_default(),
        }
    }
}

/// A copy of one series.
#[derive(Clone, Debug)]
pub struct SeriesSnapshot {
    pub key: SeriesKey,
    pub stages: Vec<(String, HistSnapshot)>,
    /// `(op, requests, bytes)` for ops seen.
    pub ops: Vec<(Op, u64, u64)>,
    pub unjoined: u64,
}

/// A copy of everything, for one scrape or one push.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub agent: &'static str,
    pub series: Vec<SeriesSnapshot>,
    pub series_dropped: u64,
    pub stages_dropped: u64,
    pub counters: Vec<(String, u64)>,
    pub gauges: Vec<(String, String, f64)>,
}

/// The per-record handle of one thread: a small cache of series so that a
/// record costs a string compare or two, not a lock.
#[derive(Debug)]
pub struct Recorder {
    metrics: Arc<Metrics>,
    cache: Vec<(SeriesKey, Option<Arc<Series>>)>,
}

const CACHE: usize = 32;

impl Recorder {
    pub fn new(metrics: Arc<Metrics>) -> Recorder {
        Recorder {
            metrics,
            cache: Vec::new(),
        }
    }

    fn lookup(
        &mut self,
        source: &'static str,
        vm: &str,
        disk: &str,
        queue: Option<u16>,
    ) -> Option<Arc<Series>> {
        let same =
            |k: &SeriesKey| k.source == source && k.vm == vm && k.disk == disk && k.queue == queue;
        if let Some(i) = self.cache.iter().position(|(k, _)| same(k)) {
            return self.cache[i].1.clone();
        }
        let key = SeriesKey {
            source,
            vm: vm.to_string(),
            disk: disk.to_string(),
            queue,
        };
        let s = self.metrics.series(&key);
        if self.cache.len() >= CACHE {
            self.cache.remove(0);
        }
        self.cache.push((key, s.clone()));
        s
    }

    /// One finished request: its stages, total, op and size. `joined: false`
    /// records (source `joined`) count as requests and as unjoined, but their
    /// stages are not observed (they are one side's view only).
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &mut self,
        source: &'static str,
        vm: &str,
        disk: &str,
        queue: Option<u16>,
        op: Op,
        bytes: u32,
        stages: &Stages,
        total_ns: Option<i64>,
        joined: bool,
    ) {
        let Some(s) = self.lookup(source, vm, disk, queue) else {
            return;
        };
        let o = op_index(op);
        let mut s = s.0.lock().unwrap_or_else(|e| e.into_inner());
        s.requests[o] += 1;
        s.bytes[o] += u64::from(bytes);
        if !joined {
            s.unjoined += 1;
            return;
        }
        let mut hint = 0;
        for (name, ns) in stages.iter() {
            match self.metrics.stages.slot(name, hint) {
                Some(k) => {
                    s.stages[k].observe(ns);
                    hint = k + 1;
                }
                None => {
                    self.metrics.stages_dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if let Some(t) = total_ns {
            s.stages[STAGE_NAMES.len() + 1].observe(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;

    #[test]
    fn buckets_are_upper_bounds() {
        assert_eq!(bucket_of(-5), 0);
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1000), 0);
        assert_eq!(bucket_of(1001), 1);
        assert_eq!(bucket_of(2000), 1);
        assert_eq!(bucket_of(2001), 2);
        for k in 0..BUCKETS {
            assert_eq!(bucket_of(bound_ns(k) as i64), k);
            assert_eq!(bucket_of(bound_ns(k) as i64 + 1), k + 1);
        }
        assert_eq!(bucket_of(i64::MAX), BUCKETS);
    }

    fn st(v: &[(&'static str, i64)]) -> Stages {
        Stages(v.iter().map(|(n, x)| (Cow::Borrowed(*n), *x)).collect())
    }

    #[test]
    fn records_count_per_stage_and_op() {
        let m = Metrics::new("test");
        let mut r = Recorder::new(m.clone());
        let s = st(&[("kick_to_pop", 3000), ("host_io", 50_000), ("bogus", 1)]);
        for _ in 0..3 {
            r.record(
                "joined",
                "vm",
                "vdb",
                Some(0),
                Op::Read,
                4096,
                &s,
                Some(53_000),
                true,
            );
        }
        let merged = st(&[("guest_queue+guest_driver", 10)]);
        r.record(
            "joined",
            "vm",
            "vdb",
            Some(1),
            Op::Write,
            512,
            &merged,
            None,
            true,
        );
        r.record(
            "joined",
            "vm",
            "vdb",
            Some(0),
            Op::Write,
            512,
            &s,
            None,
            false,
        );
        let snap = m.snapshot();
        assert_eq!(snap.series.len(), 2);
        let q0 = &snap.series[0];
        assert_eq!(q0.key.queue, Some(0));
        let names: Vec<&str> = q0.stages.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["kick_to_pop", "host_io", TOTAL]);
        assert_eq!(q0.stages[1].1.count(), 3);
        assert_eq!(q0.stages[1].1.sum_ns, 150_000);
        assert_eq!(q0.ops, vec![(Op::Read, 3, 12288), (Op::Write, 1, 512)]);
        assert_eq!(q0.unjoined, 1);
        assert_eq!(
            snap.stages_dropped, 3,
            "unknown stage names are counted, not added"
        );
        assert_eq!(snap.series[1].stages[0].0, "guest_queue+guest_driver");
        // Cumulative buckets end at the count.
        let cum = q0.stages[1].1.cumulative_seconds();
        assert_eq!(cum.last().unwrap().1, 3);
        assert_eq!(cum[0], (1e-6, 0));
    }

    #[test]
    fn series_are_capped_and_counted() {
        let m = Metrics::new("test");
        let mut r = Recorder::new(m.clone());
        for q in 0..(MAX_SERIES as u16 + 10) {
            r.record(
                "host",
                "vm",
                "d",
                Some(q),
                Op::Read,
                1,
                &Stages::default(),
                None,
                true,
            );
        }
        let s = m.snapshot();
        assert_eq!(s.series.len(), MAX_SERIES);
        assert_eq!(s.series_dropped, 10);
    }
}
