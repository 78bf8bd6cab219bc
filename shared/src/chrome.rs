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

struct Slice {
    vm: String,
    track: String,
    start: u64,
    end: u64,
    name: String,
    stages: Vec<(String, u64, u64)>,
    args: serde_json::Value,
}

/// Collects requests, then writes one trace file.
#[derive(Default)]
pub struct ChromeTrace {
    slices: Vec<Slice>,
    skipped: u64,
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

impl ChromeTrace {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of requests collected.
    pub fn len(&self) -> usize {
        self.slices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slices.is_empty()
    }

    /// Requests that could not be drawn (fewer than two points).
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Adds one request.
    pub fn add(&mut self, io: &JoinedIo) {
        let (Some(start), Some(end)) = (
            io.ts.iter().map(|e| e.1).min(),
            io.ts.iter().map(|e| e.1).max(),
        ) else {
            self.skipped += 1;
            return;
        };
        if end <= start {
            self.skipped += 1;
            return;
        }
        // Stage slices follow each other from the first anchor; a negative
        // stage (clock uncertainty) is drawn empty and the next one starts
        // where the previous ended, clamped inside the request.
        let bd = crate::stages::derive(&io.ts);
        let mut t = bd.start_ns.unwrap_or(start);
        let mut stages = Vec::with_capacity(bd.stages.len());
        for (name, d) in bd.stages.iter() {
            let s = t.clamp(start, end);
            let e = t.saturating_add_signed(d).clamp(s, end);
            stages.push((name.to_string(), s, e));
            t = t.saturating_add_signed(d);
        }
        let disk = io
            .disk
            .clone()
            .or_else(|| io.device.clone())
            .unwrap_or_else(|| "?".into());
        let track = match io.queue {
            Some(q) => format!("{disk} q{q}"),
            None => disk,
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
        self.slices.push(Slice {
            vm: io.vm.clone(),
            track,
            start,
            end,
            name: format!("{} {}", io.op.name(), io.bytes),
            stages,
            args,
        });
    }

    /// Writes the trace as one JSON object (`{"traceEvents":[…]}`).
    pub fn write<W: Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.slices.sort_by_key(|s| (s.start, s.end));
        let mut pids: HashMap<String, u32> = HashMap::new();
        // (vm, track) → (first tid, lane end times)
        let mut lanes: HashMap<(String, String), Vec<(u32, u64)>> = HashMap::new();
        let mut next_tid: HashMap<u32, u32> = HashMap::new();
        let mut meta: Vec<serde_json::Value> = Vec::new();
        w.write_all(b"{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n")?;
        let mut first = true;
        let mut emit = |w: &mut W, v: &serde_json::Value| -> io::Result<()> {
            if !first {
                w.write_all(b",\n")?;
            }
            first = false;
            serde_json::to_writer(&mut *w, v).map_err(io::Error::other)
        };
        let mut track_order: HashMap<(u32, String), u32> = HashMap::new();
        for s in &self.slices {
            let npids = pids.len() as u32;
            let pid = *pids.entry(s.vm.clone()).or_insert_with(|| {
                meta.push(
                    json!({"ph":"M","name":"process_name","pid":npids + 1,"args":{"name":s.vm}}),
                );
                npids + 1
            });
            let ls = lanes.entry((s.vm.clone(), s.track.clone())).or_default();
            let tid = match ls.iter_mut().find(|l| l.1 <= s.start) {
                Some(l) => {
                    l.1 = s.end;
                    l.0
                }
                None => {
                    let nt = next_tid.entry(pid).or_insert(0);
                    *nt += 1;
                    let tid = *nt;
                    let lane = ls.len() + 1;
                    ls.push((tid, s.end));
                    let name = if lane == 1 {
                        s.track.clone()
                    } else {
                        format!("{} #{lane}", s.track)
                    };
                    let n = track_order.len() as u32;
                    let order = *track_order.entry((pid, s.track.clone())).or_insert(n);
                    meta.push(json!({"ph":"M","name":"thread_name","pid":pid,"tid":tid,"args":{"name":name}}));
                    meta.push(
                        json!({"ph":"M","name":"thread_sort_index","pid":pid,"tid":tid,
                        "args":{"sort_index": order * 1000 + lane as u32}}),
                    );
                    tid
                }
            };
            emit(
                w,
                &json!({"ph":"X","name":s.name,"cat":"io","pid":pid,"tid":tid,
                    "ts":us(s.start),"dur":us(s.end - s.start),"args":s.args}),
            )?;
            for (name, a, b) in &s.stages {
                emit(
                    w,
                    &json!({"ph":"X","name":name,"cat":"stage","pid":pid,"tid":tid,
                        "ts":us(*a),"dur":us(b - a)}),
                )?;
            }
        }
        for m in &meta {
            emit(w, m)?;
        }
        w.write_all(b"\n]}\n")?;
        Ok(())
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
        let mut t = ChromeTrace::new();
        for j in &out {
            t.add(j);
        }
        assert_eq!(t.len(), 300);
        let mut buf = Vec::new();
        t.write(&mut buf).unwrap();
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
}
