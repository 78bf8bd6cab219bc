//! Chrome trace-event JSON export (loads in Perfetto and `chrome://tracing`).
//!
//! Layout: one process per VM, one track (thread) per `(disk/device, queue)`.
//! Each request is a slice named `<op> <bytes>` spanning its first to last
//! anchor, with its stages (see [`crate::stages`]) as nested child slices.
//! Complete (`"ph":"X"`) slices on one track must nest, so requests that
//! overlap in time on the same queue are spread over extra lanes of that queue,
//! named `<disk> q<N>`, `<disk> q<N> #2`, … and sorted together.
//! Timestamps are µs (fractional) in the records' clock domain.

use std::collections::{BinaryHeap, HashMap};
use std::io::{self, Write};

use serde_json::json;

use crate::record::JoinedIo;

/// Lanes one `(VM, track)` may have; a request that fits none of them is drawn
/// in the last one (overlapping) and counted in [`ChromeTrace::overlapping`].
pub const MAX_LANES: usize = 64;

/// Requests are held this long (by the latest end seen) before they are drawn,
/// so that requests arriving out of order still go to lanes in start order.
pub const REORDER_NS: u64 = 1_000_000_000;
/// Most requests held for reordering; beyond it the earliest is drawn at once.
pub const MAX_HELD: usize = 8192;

/// A request waiting to be drawn; the heap's top is the earliest start.
struct Held {
    start: u64,
    seq: u64,
    end: u64,
    vm: String,
    track: String,
    name: String,
    args: serde_json::Value,
    stages: Vec<(String, u64, u64)>,
}

impl PartialEq for Held {
    fn eq(&self, o: &Self) -> bool {
        (self.start, self.seq) == (o.start, o.seq)
    }
}
impl Eq for Held {}
impl PartialOrd for Held {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Held {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.start, o.seq).cmp(&(self.start, self.seq))
    }
}

/// The lanes of one `(VM, track)`: each lane's thread id and the end of the
/// latest request drawn in it.
struct Track {
    lanes: Vec<(u32, u64)>,
    order: u32,
}

/// Streams requests into a trace file as they come: the header at creation,
/// each request's slices when it is added, the closing bracket at
/// [`finish`](ChromeTrace::finish). Memory is bounded by the number of VMs,
/// tracks and lanes, never by the number of requests.
///
/// A request goes to the first lane of its track whose latest request ended
/// before it started, so slices on one lane never overlap (they nest, as
/// complete slices must), whatever order requests arrive in; a new lane is
/// opened (and named) when none is free.
pub struct ChromeTrace<W: Write> {
    w: W,
    first: bool,
    finished: bool,
    /// Requests waiting to be drawn in start order, and the latest end seen.
    held: BinaryHeap<Held>,
    seq: u64,
    newest: u64,
    added: u64,
    pids: HashMap<String, u32>,
    tracks: HashMap<(u32, String), Track>,
    next_tid: HashMap<u32, u32>,
    written: u64,
    skipped: u64,
    overlapping: u64,
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

impl<W: Write> ChromeTrace<W> {
    /// Starts a trace in `w` (writes the header).
    pub fn new(mut w: W) -> io::Result<Self> {
        w.write_all(b"{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n")?;
        Ok(Self {
            w,
            first: true,
            finished: false,
            held: BinaryHeap::new(),
            seq: 0,
            newest: 0,
            added: 0,
            pids: HashMap::new(),
            tracks: HashMap::new(),
            next_tid: HashMap::new(),
            written: 0,
            skipped: 0,
            overlapping: 0,
        })
    }

    /// Requests added (drawn, or held for reordering until [`finish`](Self::finish)).
    pub fn len(&self) -> u64 {
        self.added
    }

    pub fn is_empty(&self) -> bool {
        self.added == 0
    }

    /// Requests drawn so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Requests currently held for reordering (at most [`MAX_HELD`]).
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Requests that could not be drawn (fewer than two points).
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Requests drawn overlapping another one because their track had no free
    /// lane left ([`MAX_LANES`]).
    pub fn overlapping(&self) -> u64 {
        self.overlapping
    }

    fn emit(&mut self, v: &serde_json::Value) -> io::Result<()> {
        if !self.first {
            self.w.write_all(b",\n")?;
        }
        self.first = false;
        serde_json::to_writer(&mut self.w, v).map_err(io::Error::other)
    }

    /// The process id of a VM (announced with its name on first use).
    fn pid(&mut self, vm: &str) -> io::Result<u32> {
        if let Some(&p) = self.pids.get(vm) {
            return Ok(p);
        }
        let pid = self.pids.len() as u32 + 1;
        self.pids.insert(vm.to_owned(), pid);
        self.emit(&json!({"ph":"M","name":"process_name","pid":pid,"args":{"name":vm}}))?;
        Ok(pid)
    }

    /// The thread id of a free lane of `track` for `[start, end]`.
    fn lane(&mut self, pid: u32, track: &str, start: u64, end: u64) -> io::Result<u32> {
        let key = (pid, track.to_owned());
        let n = self.tracks.len() as u32;
        let t = self.tracks.entry(key).or_insert(Track {
            lanes: Vec::new(),
            order: n,
        });
        if let Some(l) = t.lanes.iter_mut().find(|l| l.1 <= start) {
            l.1 = end;
            return Ok(l.0);
        }
        if t.lanes.len() >= MAX_LANES {
            self.overlapping += 1;
            let l = t.lanes.last_mut().expect("MAX_LANES > 0");
            l.1 = l.1.max(end);
            return Ok(l.0);
        }
        let nt = self.next_tid.entry(pid).or_insert(0);
        *nt += 1;
        let tid = *nt;
        t.lanes.push((tid, end));
        let lane = t.lanes.len();
        let order = t.order * 1000 + lane as u32;
        let name = if lane == 1 {
            track.to_owned()
        } else {
            format!("{track} #{lane}")
        };
        self.emit(
            &json!({"ph":"M","name":"thread_name","pid":pid,"tid":tid,"args":{"name":name}}),
        )?;
        self.emit(
            &json!({"ph":"M","name":"thread_sort_index","pid":pid,"tid":tid,
            "args":{"sort_index": order}}),
        )?;
        Ok(tid)
    }

    /// Writes one request: a slice from its first to its last point, its stages
    /// nested inside.
    pub fn add(&mut self, io: &JoinedIo) -> io::Result<()> {
        let (Some(start), Some(end)) = (
            io.ts.iter().map(|e| e.1).min(),
            io.ts.iter().map(|e| e.1).max(),
        ) else {
            self.skipped += 1;
            return Ok(());
        };
        if end <= start {
            self.skipped += 1;
            return Ok(());
        }
        let disk = io.disk.as_deref().or(io.device.as_deref()).unwrap_or("?");
        let track = match io.queue {
            Some(q) => format!("{disk} q{q}"),
            None => disk.to_owned(),
        };
        let args = json!({
            "op": io.op.name(),
            "sector": io.sector,
            "bytes": io.bytes,
            "head": io.head,
            "comm": io.comm,
            "pid": io.pid,
            "inode": io.inode,
            "joined": io.joined,
            "reason": io.reason.map(|r| r.name()),
            "clock_uncertainty_ns": io.clock_uncertainty_ns,
            "total_ns": io.total_ns,
            "merge_id": io.merge_id,
        });
        // Stage slices follow each other from the first anchor; a negative
        // stage (clock uncertainty) is drawn empty and the next one starts
        // where the previous ended, clamped inside the request.
        let bd = crate::stages::derive(&io.ts);
        let mut t = bd.start_ns.unwrap_or(start);
        let mut stages = Vec::with_capacity(bd.stages.len());
        for (name, d) in bd.stages.iter() {
            let s = t.clamp(start, end);
            let e = t.saturating_add_signed(d).clamp(s, end);
            t = t.saturating_add_signed(d);
            stages.push((name.to_owned(), s, e));
        }
        self.seq += 1;
        self.held.push(Held {
            start,
            seq: self.seq,
            end,
            vm: io.vm.to_string(),
            track,
            name: format!("{} {}", io.op.name(), io.bytes),
            args,
            stages,
        });
        self.added += 1;
        self.newest = self.newest.max(end);
        while let Some(h) = self.held.peek() {
            if h.start.saturating_add(REORDER_NS) > self.newest && self.held.len() <= MAX_HELD {
                break;
            }
            let h = self.held.pop().expect("peeked");
            self.draw(h)?;
        }
        Ok(())
    }

    /// Writes one held request: its slice and its stages nested inside.
    fn draw(&mut self, h: Held) -> io::Result<()> {
        let pid = self.pid(&h.vm)?;
        let tid = self.lane(pid, &h.track, h.start, h.end)?;
        self.emit(
            &json!({"ph":"X","name":h.name,"cat":"io","pid":pid,"tid":tid,
            "ts":us(h.start),"dur":us(h.end - h.start),"args":h.args}),
        )?;
        for (name, s, e) in &h.stages {
            self.emit(
                &json!({"ph":"X","name":name,"cat":"stage","pid":pid,"tid":tid,
                "ts":us(*s),"dur":us(e - s)}),
            )?;
        }
        self.written += 1;
        Ok(())
    }

    /// Draws every held request, closes the trace's JSON and flushes (once).
    pub fn finish(&mut self) -> io::Result<()> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        while let Some(h) = self.held.pop() {
            self.draw(h)?;
        }
        self.w.write_all(b"\n]}\n")?;
        self.w.flush()
    }

    /// The writer (call [`finish`](Self::finish) first).
    pub fn into_inner(self) -> W {
        self.w
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::join::synth::{generate, interleave, Event, SynthConfig};
    use crate::join::JoinEngine;

    #[test]
    fn trace_is_valid_and_slices_nest() {
        let s = generate(&SynthConfig {
            requests: 300,
            queues: 2,
            interval_ns: 20_000,
            ..SynthConfig::default()
        });
        let mut e = JoinEngine::default();
        let mut out = Vec::new();
        for ev in interleave(&s, 1_000_000, 0, 1) {
            match ev {
                Event::Guest(g) => e.push_guest("vm0", g, &mut out),
                Event::Host(h) => e.push_host(h, &mut out),
                Event::Probe(a, b, c, d) => e.clock("vm0").add_guest_probe(a, b, c, d).unwrap(),
            }
        }
        e.flush(&mut out);
        // Requests arrive in completion order, not start order.
        out.sort_by_key(|j| j.ts.iter().map(|e| e.1).max());
        let mut t = ChromeTrace::new(Vec::new()).unwrap();
        for j in &out {
            t.add(j).unwrap();
        }
        assert_eq!(t.len(), 300);
        t.finish().unwrap();
        assert_eq!((t.written(), t.overlapping()), (300, 0));
        let buf = t.into_inner();
        let v: serde_json::Value = serde_json::from_slice(&buf).unwrap();
        let evs = v["traceEvents"].as_array().unwrap();
        let io: Vec<_> = evs.iter().filter(|e| e["cat"] == "io").collect();
        assert_eq!(io.len(), 300);
        // Per (pid, tid): request slices never overlap; stages lie inside their request.
        let mut by_tid: HashMap<(u64, u64), Vec<(f64, f64)>> = HashMap::new();
        for e in &io {
            by_tid
                .entry((e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap()))
                .or_default()
                .push((e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap()));
        }
        assert!(by_tid.len() > 2, "overlapping requests got extra lanes");
        for v in by_tid.values_mut() {
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            for w in v.windows(2) {
                assert!(w[0].0 + w[0].1 <= w[1].0 + 1e-9);
            }
        }
        let names: std::collections::HashSet<&str> = evs
            .iter()
            .filter(|e| e["cat"] == "stage")
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert!(names.contains("host_io") && names.contains("kick_to_pop"));
        assert!(evs
            .iter()
            .any(|e| e["name"] == "thread_name" && e["args"]["name"] == "vda q0"));
        assert!(evs
            .iter()
            .any(|e| e["name"] == "process_name" && e["args"]["name"] == "vm0"));
    }

    fn io(vm: &str, start: u64, end: u64) -> JoinedIo {
        let mut j: JoinedIo = serde_json::from_value(json!({
            "vm": vm, "op": "read", "sector": 0, "bytes": 4096, "joined": true,
            "ts": {"h.submit": start, "h.complete_cb": end},
            "ts_domain": "host", "stages": {}, "substages": {}, "total_ns": end - start,
        }))
        .unwrap();
        j.queue = Some(0);
        j.disk = Some("vdb".into());
        j
    }

    #[test]
    fn streams_in_start_order_with_bounded_state_and_counts_overflowing_lanes() {
        let mut t = ChromeTrace::new(Vec::new()).unwrap();
        // 100k back-to-back requests (10 µs each, 1 s in all), arriving in pairs
        // swapped: drawn in start order, they keep one lane.
        for i in (0..100_000u64).step_by(2) {
            for k in [i + 1, i] {
                t.add(&io("vm0", k * 10_000, k * 10_000 + 10_000)).unwrap();
            }
            assert!(t.held() <= MAX_HELD + 1);
        }
        assert!(
            t.written() > 0,
            "requests older than the reorder window are drawn"
        );
        // MAX_LANES + 5 requests all in flight at once: the extra 5 overlap.
        for _ in 0..MAX_LANES + 5 {
            t.add(&io("vm0", 2_000_000_000, 3_000_000_000)).unwrap();
        }
        t.finish().unwrap();
        assert_eq!(t.overlapping(), 5);
        assert_eq!(t.written(), 100_000 + MAX_LANES as u64 + 5);
        let buf = t.into_inner();
        let v: serde_json::Value = serde_json::from_slice(&buf).unwrap();
        let evs = v["traceEvents"].as_array().unwrap();
        // The 100k sequential requests all went to the first lane (tid 1).
        let first_lane = evs
            .iter()
            .filter(|e| e["cat"] == "io" && e["tid"] == 1)
            .count();
        assert!(first_lane >= 100_000, "{first_lane}");
    }
}
