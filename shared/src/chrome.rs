//! Chrome trace-event JSON export (loads in Perfetto and `chrome://tracing`).
//!
//! Layout: one process per VM, one track (thread) per `(disk/device, queue)`.
//! Each request is a slice named `<op> <bytes>` spanning its first to last
//! anchor, with its stages (see [`crate::stages`]) as nested child slices.
//! Complete (`"ph":"X"`) slices on one track must nest, so requests that
//! overlap in time on the same queue are spread over extra lanes of that queue,
//! named `<disk> q<N>`, `<disk> q<N> #2`, … and sorted together.
//! Timestamps are µs (fractional) in the records' clock domain.

use std::collections::HashMap;
use std::io::{self, Write};

use serde_json::json;

use crate::record::JoinedIo;

/// Lanes one `(VM, track)` may have; a request that fits none of them is drawn
/// in the last one (overlapping) and counted in [`ChromeTrace::overlapping`].
pub const MAX_LANES: usize = 64;

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
            pids: HashMap::new(),
            tracks: HashMap::new(),
            next_tid: HashMap::new(),
            written: 0,
            skipped: 0,
            overlapping: 0,
        })
    }

    /// Requests written.
    pub fn len(&self) -> u64 {
        self.written
    }

    pub fn is_empty(&self) -> bool {
        self.written == 0
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
        let pid = self.pid(&io.vm)?;
        let tid = self.lane(pid, &track, start, end)?;
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
        self.emit(
            &json!({"ph":"X","name":format!("{} {}", io.op.name(), io.bytes),
            "cat":"io","pid":pid,"tid":tid,"ts":us(start),"dur":us(end - start),"args":args}),
        )?;
        // Stage slices follow each other from the first anchor; a negative
        // stage (clock uncertainty) is drawn empty and the next one starts
        // where the previous ended, clamped inside the request.
        let bd = crate::stages::derive(&io.ts);
        let mut t = bd.start_ns.unwrap_or(start);
        for (name, d) in bd.stages.iter() {
            let s = t.clamp(start, end);
            let e = t.saturating_add_signed(d).clamp(s, end);
            t = t.saturating_add_signed(d);
            self.emit(
                &json!({"ph":"X","name":name,"cat":"stage","pid":pid,"tid":tid,
                "ts":us(s),"dur":us(e - s)}),
            )?;
        }
        self.written += 1;
        Ok(())
    }

    /// Closes the trace's JSON and flushes; returns the writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.w.write_all(b"\n]}\n")?;
        self.w.flush()?;
        Ok(self.w)
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
        assert_eq!(t.overlapping(), 0);
        let buf = t.finish().unwrap();
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
    fn streams_with_bounded_state_and_counts_overflowing_lanes() {
        let mut t = ChromeTrace::new(Vec::new()).unwrap();
        // 100k back-to-back requests keep one lane.
        for i in 0..100_000u64 {
            t.add(&io("vm0", i * 10, i * 10 + 10)).unwrap();
        }
        assert_eq!(t.tracks.values().map(|t| t.lanes.len()).sum::<usize>(), 1);
        // MAX_LANES + 5 requests all in flight at once: the extra 5 overlap.
        for _ in 0..MAX_LANES + 5 {
            t.add(&io("vm0", 2_000_000, 3_000_000)).unwrap();
        }
        assert_eq!(t.overlapping(), 5);
        assert_eq!(t.len(), 100_000 + MAX_LANES as u64 + 5);
        let buf = t.finish().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&buf).unwrap();
        assert!(v["traceEvents"].as_array().unwrap().len() > 100_000);
    }
}
