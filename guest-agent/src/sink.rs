//! Where decoded records go: JSON lines, per-stage tables, slow-I/O waterfalls.

use std::collections::HashMap;
use std::io::{self, BufWriter, Stdout, Write};
use std::time::Duration;

use viotrace_shared::capture::CaptureWriter;
use viotrace_shared::cause::syscall::SyscallVerdicts;
use viotrace_shared::clock::monotonic_ns;
use viotrace_shared::jsonl::JsonLines;
use viotrace_shared::proto::{io_bpf, Counter, GuestRecordRef, GuestStats};
use viotrace_shared::record::{GuestIo, GuestRq, Point, Points, Stats};
use viotrace_shared::stats::{render_waterfall, Aggregator, StageHist};
use viotrace_shared::transport::GuestSender;
use viotrace_shared::walltime::{self, WallTime};

use crate::io_hist::Gained;
use crate::raw::{DecodeError, Record};

/// Label under which syscall-level latencies are aggregated.
const SYSCALL_LABEL: &str = "syscalls";
/// Requests remembered to draw syscall waterfalls.
const RECENT_RQS: usize = 4096;

pub struct Sink {
    json: bool,
    threshold_ns: Option<u64>,
    mode: String,
    blind: Vec<String>,
    blind_points: Vec<&'static str>,
    out: JsonLines<BufWriter<Stdout>>,
    interval: Aggregator,
    /// The interval's syscall latencies by syscall number, added to `interval`
    /// when it is read: a record finds its histogram by its number, not by the
    /// table's two lookups by name (label, then stage).
    syscalls: Vec<(u32, viotrace_shared::record::Name, StageHist)>,
    syscall_last: usize,
    total: Aggregator,
    /// (disk, sector) → points of recently finished requests, and whether
    /// their waterfall was printed (then their syscall's is not).
    recent: HashMap<(viotrace_shared::record::Name, u64), (Points, bool)>,
    pub rqs: u64,
    pub ios: u64,
    pub decode_errors: u64,
    interval_records: u64,
    /// Stream to the host agent (`--connect`).
    uplink: Option<GuestSender>,
    /// Verdicts on slow syscalls (`-t` with the off-CPU programs loaded).
    verdicts: Option<SyscallVerdicts>,
    /// Every record, encoded, to the capture file (`--capture`).
    capture: Option<CaptureWriter<Box<dyn Write>>>,
    /// Human text goes to stderr (stdout carries JSON lines or the capture).
    human_to_stderr: bool,
    capture_failure_said: bool,
}

#[cfg(test)]
fn json_line<T: viotrace_shared::jsonl::Kind>(v: &T) -> Option<String> {
    let mut w = JsonLines::new(Vec::new());
    w.write(v).ok()?;
    String::from_utf8(std::mem::take(w.get_mut()))
        .ok()
        .map(|s| s.trim_end().to_owned())
}

fn first_last(p: &Points) -> Option<u64> {
    let (mut lo, mut hi) = (u64::MAX, 0);
    for (_, t) in p.iter() {
        lo = lo.min(t);
        hi = hi.max(t);
    }
    (hi >= lo).then(|| hi - lo)
}

/// The wall-clock offset sent with a record in the BPF layout, from which its
/// reader gives it its time (its first point plus the offset): the one its
/// decoded `time` was made with, else the guest's now (measured again if its
/// last measurement is a second older than the record's last point in path
/// order: any of its points would do, and that one is read without a pass
/// over them).
fn wall_offset(time: Option<WallTime>, ts: &Points) -> i64 {
    time.and_then(|t| {
        let (first, _) = ts.min_max()?;
        Some(t.unix_ns().wrapping_sub(first as i64))
    })
    .unwrap_or_else(|| walltime::offset_near(ts.last_in_path().unwrap_or(0)))
}

fn rq_header(r: &GuestRq) -> String {
    let mut h = format!(
        "slow request: {} {} sector {} {}B  pid {} tid {} ({}) cgroup {} inode {}",
        r.disk, r.op, r.sector, r.bytes, r.pid, r.tid, r.comm, r.cgroup_id, r.inode
    );
    if let Some(o) = r.file_offset {
        h += &format!(" off {o}");
    }
    if let Some(q) = r.queue {
        h += &format!(" queue {q}");
    }
    if let Some(hd) = r.head {
        h += &format!(" head {hd}");
    }
    match r.kicked {
        Some(true) => h += " kick notified",
        Some(false) => h += " kick suppressed",
        None => {}
    }
    h += &format!(" bios {}", r.bios);
    if let Some(t) = r.time {
        h += &format!(" at {t}");
    }
    if r.error != 0 {
        h += &format!(" error {}", r.error);
    }
    h
}

fn io_header(io: &GuestIo) -> String {
    let mut h = format!(
        "slow {}: pid {} tid {} ({}) cgroup {} inode {}",
        io.syscall, io.pid, io.tid, io.comm, io.cgroup_id, io.inode
    );
    if let Some(o) = io.file_offset {
        h += &format!(" off {o}");
    }
    h += &format!(" size {} ret {}", io.bytes, io.ret);
    if !io.requests.is_empty() {
        let refs: Vec<String> = io
            .requests
            .iter()
            .map(|r| format!("{}@{}+{}", r.disk, r.sector, r.bytes))
            .collect();
        h += &format!(" requests {}", refs.join(","));
    }
    if io.requests_unlisted > 0 {
        h += &format!(" (+{} more)", io.requests_unlisted);
    }
    h
}

impl Sink {
    pub fn new(
        json: bool,
        threshold: Option<Duration>,
        mode: String,
        blind: Vec<String>,
        blind_points: Vec<&'static str>,
        uplink: Option<GuestSender>,
    ) -> Self {
        Sink {
            uplink,
            json,
            threshold_ns: threshold.map(|d| d.as_nanos().min(u128::from(u64::MAX)) as u64),
            mode,
            blind,
            blind_points,
            out: JsonLines::new(BufWriter::with_capacity(64 * 1024, io::stdout())),
            interval: Aggregator::new(),
            syscalls: Vec::new(),
            syscall_last: 0,
            total: Aggregator::new(),
            recent: HashMap::new(),
            rqs: 0,
            ios: 0,
            decode_errors: 0,
            interval_records: 0,
            verdicts: None,
            capture: None,
            human_to_stderr: json,
            capture_failure_said: false,
        }
    }

    /// Writes every record to `capture` from now on; `on_stdout`: the capture
    /// is this process's stdout, so human text goes to stderr.
    pub fn set_capture(&mut self, capture: CaptureWriter<Box<dyn Write>>, on_stdout: bool) {
        self.capture = Some(capture);
        self.human_to_stderr |= on_stdout;
    }

    /// The off-CPU programs are loaded: syscall records carry their off-CPU
    /// time (the decoder's `off_cpu`), and with a threshold the slow ones get
    /// a verdict.
    pub fn set_off_cpu(&mut self, on: bool) {
        self.verdicts = match (on, self.threshold_ns) {
            (true, Some(t)) => Some(SyscallVerdicts::new(t)),
            _ => None,
        };
    }

    /// Counters of the verdicts (for the stats line).
    pub fn verdict_counters(&self) -> Vec<(&'static str, u64)> {
        match &self.verdicts {
            Some(v) => vec![
                ("slow_syscalls_with_cause", v.flagged),
                ("syscall_cause_classes_refused", v.classes_refused),
            ],
            None => Vec::new(),
        }
    }

    /// Human text: stdout, or stderr when stdout carries JSON or the capture.
    fn human(&mut self, s: &str) {
        if self.human_to_stderr {
            let _ = io::stderr().write_all(s.as_bytes());
        } else {
            let _ = self.out.get_mut().write_all(s.as_bytes());
        }
    }

    /// A line of human text, written out now.
    pub fn say(&mut self, s: &str) {
        self.human(s);
        let _ = self.out.flush();
    }

    /// A ring-buffer record that could not be decoded (counted, the first
    /// few said).
    pub fn bad_record(&mut self, e: &DecodeError) {
        self.decode_errors += 1;
        if self.decode_errors <= 5 {
            eprintln!("viotrace-guest: bad record: {e}");
        }
    }

    /// One decoded ring-buffer record; `raw`: its bytes as the ring buffer
    /// holds them (a request record goes to the host as it is).
    pub fn handle(&mut self, rec: Record<'_>, raw: &[u8]) {
        self.interval_records += 1;
        match rec {
            Record::Rq(r) => {
                self.on_rq(r);
                // (the capture and the uplink take the record as the ring
                // buffer holds it: copied, not encoded)
                if self.capture.is_some() || self.uplink.is_some() {
                    let off = wall_offset(r.time, &r.ts);
                    if let Some(c) = &mut self.capture {
                        c.push_rq_bpf(raw, off, &r.disk);
                    }
                    if let Some(u) = &self.uplink {
                        u.send_rq_bpf(raw, off, &r.disk);
                    }
                }
            }
            Record::Io(io) => {
                if let Some(v) = self.verdicts.as_mut() {
                    v.judge(io);
                }
                // (not streamed: the join has no use for it, and it would be
                // half the uplink's cost)
                // (the syscall's number, as the record's bytes hold it)
                self.on_io(io, io_bpf::syscall_nr(raw).unwrap_or(u32::MAX));
                if let Some(c) = &mut self.capture {
                    // (as the ring buffer holds it, unless user space added
                    // to it: off-CPU time and a cause are not in the layout)
                    if io.off_cpu.is_none() && io.cause.is_none() {
                        let disks = io.requests.iter().map(|r| r.disk.as_str());
                        c.push_io_bpf(raw, wall_offset(io.time, &io.ts), disks);
                    } else {
                        c.push(GuestRecordRef::Io(io));
                    }
                }
            }
        }
    }

    /// Syscalls of number `nr` the kernel summarized (no record): their
    /// latencies into the syscall table, as their records' would go.
    pub fn syscall_summary(&mut self, nr: u32, g: &Gained) {
        let n = g.count();
        self.ios += n;
        self.interval_records += n;
        let name = crate::raw::syscall_name(nr);
        self.interval
            .record_slots(SYSCALL_LABEL, &name, &g.slots, g.sum_ns);
    }

    fn on_rq(&mut self, r: &GuestRq) {
        self.rqs += 1;
        if self.json {
            let _ = self.out.write(r);
        }
        self.interval.record_points(&r.disk, &r.ts);
        if let Some(th) = self.threshold_ns {
            let slow = first_last(&r.ts).is_some_and(|d| d >= th);
            if slow {
                let w = render_waterfall(&rq_header(r), &r.ts);
                self.human(&w);
            }
            if self.recent.len() >= RECENT_RQS {
                self.recent.clear();
            }
            self.recent
                .insert((r.disk.clone(), r.sector), (r.ts.clone(), slow));
        }
    }

    fn on_io(&mut self, io: &GuestIo, nr: u32) {
        self.ios += 1;
        if self.json {
            let _ = self.out.write(io);
        }
        let (Some(a), Some(b)) = (
            io.ts.get(Point::SyscallEnter),
            io.ts.get(Point::SyscallExit),
        ) else {
            return;
        };
        let d = b.saturating_sub(a);
        self.record_syscall(nr, &io.syscall, d);
        if let Some(th) = self.threshold_ns {
            let caused: Vec<&(Points, bool)> = io
                .requests
                .iter()
                .filter_map(|r| self.recent.get(&(r.disk.clone(), r.sector)))
                .collect();
            // A slow request already printed its waterfall (with g.syscall_enter).
            if d >= th && !caused.iter().any(|(_, printed)| *printed) {
                // The syscall's points plus those of the slowest request it caused.
                let mut pts = io.ts.clone();
                let slowest = caused
                    .iter()
                    .map(|(p, _)| p)
                    .max_by_key(|p| first_last(p).unwrap_or(0));
                if let Some(p) = slowest {
                    for (pt, t) in p.iter() {
                        if pt != Point::SyscallEnter {
                            pts.set(pt, t);
                        }
                    }
                }
                let w = render_waterfall(&io_header(io), &pts);
                self.human(&w);
            }
        }
        if let Some(c) = &io.cause {
            let line = format!(
                "slow {}: pid={} comm={} total={} cause: {}: {}\n",
                io.syscall,
                io.pid,
                io.comm,
                viotrace_shared::stats::fmt_ns(d),
                c.kind.name(),
                c.evidence
            );
            self.human(&line);
        }
    }

    /// One latency of syscall `nr` (named `name`) into the interval's
    /// histogram of it.
    fn record_syscall(&mut self, nr: u32, name: &viotrace_shared::record::Name, ns: u64) {
        let i = match self.syscalls.get(self.syscall_last) {
            Some((n, ..)) if *n == nr => self.syscall_last,
            _ => match self.syscalls.iter().position(|(n, ..)| *n == nr) {
                Some(i) => i,
                None => {
                    self.syscalls.push((nr, name.clone(), StageHist::new()));
                    self.syscalls.len() - 1
                }
            },
        };
        self.syscalls[i].2.record(ns);
        self.syscall_last = i;
    }

    /// Adds the syscall histograms to the interval's table (before it is read).
    fn take_syscalls(&mut self) {
        for (_, name, h) in &mut self.syscalls {
            self.interval.add_hist(SYSCALL_LABEL, name, h);
        }
        self.syscalls.clear();
    }

    /// The per-stage table of the interval that just ended (skipped when idle).
    pub fn interval_table(&mut self, elapsed: Duration) {
        if self.interval_records == 0 {
            return;
        }
        self.take_syscalls();
        self.total.merge(&self.interval);
        let t = self.interval.render_table(&format!(
            "--- interval ending at {:.1}s ---",
            elapsed.as_secs_f64()
        ));
        self.human(&t);
        let causes = self.verdicts.as_mut().and_then(|v| {
            v.take_interval(&format!(
                "--- why-slow: causes of the slow syscalls of the interval ending at {:.1}s ---",
                elapsed.as_secs_f64()
            ))
        });
        if let Some(c) = causes {
            self.human(&c);
        }
        self.interval.clear();
        self.interval_records = 0;
    }

    /// Sends the agent's counters to the host (when connected).
    pub fn send_counters(&self, counters: &[(&'static str, u64)]) {
        if let Some(u) = &self.uplink {
            u.send_stats(GuestStats {
                ts: monotonic_ns(),
                // Filled in by the sender (its own accounting).
                produced: 0,
                dropped_full: 0,
                counters: counters
                    .iter()
                    .map(|(n, v)| Counter {
                        name: (*n).to_string(),
                        value: *v,
                    })
                    .chain([Counter {
                        name: "decode_errors".into(),
                        value: self.decode_errors,
                    }])
                    .collect(),
            });
        }
    }

    /// Sends the final counters, flushes the uplink and adds its losses to `counters`.
    pub fn close_uplink(&mut self, counters: &mut Vec<(&'static str, u64)>) {
        self.send_counters(counters);
        if let Some(u) = self.uplink.take() {
            let st = u.shutdown("guest agent stopping", Duration::from_secs(5));
            // offered = acked (delivered or counted by the host) + refused + unacked at exit.
            counters.push(("uplink_offered", st.offered()));
            counters.push(("uplink_acked", st.acked));
            counters.push(("uplink_dropped_full", st.dropped_full));
            counters.push(("uplink_unacked_at_exit", st.unacked_at_exit));
            counters.push(("uplink_resent", st.resent));
            counters.push(("uplink_connects", st.connects));
            counters.push(("uplink_connect_failures", st.connect_failures));
            let balanced = st.offered() == st.acked + st.dropped_full + st.unacked_at_exit;
            self.human(&format!(
                "viotrace-guest: uplink: offered={} = acked={} + refused_buffer_full={} + unacked_at_exit={} ({})\n",
                st.offered(),
                st.acked,
                st.dropped_full,
                st.unacked_at_exit,
                if balanced { "balanced" } else { "UNBALANCED" }
            ));
        }
    }

    /// Writes the capture's open chunk and adds its counts to `counters`:
    /// records written, and lost (not encodable, or the write failed).
    pub fn close_capture(&mut self, counters: &mut Vec<(&'static str, u64)>) {
        if let Some(c) = &mut self.capture {
            c.flush();
            counters.push(("capture_records", c.written));
            counters.push(("capture_lost", c.lost));
            if let Some(e) = &c.failed {
                eprintln!("viotrace-guest: capture: {e}; {} records lost", c.lost);
            }
        }
    }

    pub fn flush(&mut self) {
        if let Some(c) = &mut self.capture {
            c.flush();
            // Said once, when it happens; the count comes with the totals.
            if let (Some(e), false) = (&c.failed, self.capture_failure_said) {
                eprintln!(
                    "viotrace-guest: capture: {e}; the records from here on are lost (counted)"
                );
                self.capture_failure_said = true;
            }
        }
        let _ = self.out.flush();
    }

    /// Final table, counters, and the `"kind":"stats"` line in JSON mode and
    /// at the end of the capture (an error: the capture could not be completed).
    pub fn finish(
        &mut self,
        elapsed: Duration,
        counters: &[(&'static str, u64)],
    ) -> anyhow::Result<()> {
        self.take_syscalls();
        self.total.merge(&self.interval);
        self.interval.clear();
        let mut t = self.total.render_table(&format!(
            "=== viotrace-guest totals ({} mode, {:.1}s, {} requests, {} syscalls) ===",
            self.mode,
            elapsed.as_secs_f64(),
            self.rqs,
            self.ios
        ));
        t += "  counters:";
        for (n, v) in counters {
            t += &format!(" {n}={v}");
        }
        t += &format!(" decode_errors={}\n", self.decode_errors);
        self.human(&t);
        if !self.json && self.capture.is_none() {
            self.flush();
            return Ok(());
        }
        let line = Stats {
            is_final: Some(true),
            mode: Some(self.mode.clone()),
            elapsed_ns: Some(elapsed.as_nanos().min(u128::from(u64::MAX)) as u64),
            guest_rq: Some(self.rqs),
            guest_io: Some(self.ios),
            decode_errors: Some(self.decode_errors),
            counters: Some(counters.iter().map(|(k, v)| (k.to_string(), *v)).collect()),
            blind: Some(self.blind.clone()),
            blind_points: Some(self.blind_points.iter().map(|p| p.to_string()).collect()),
            stages: self.total.summaries(),
            ..Stats::default()
        };
        let mut w = JsonLines::new(Vec::new());
        let _ = w.write(&line);
        let line = std::mem::take(w.get_mut());
        if self.json {
            let _ = self.out.get_mut().write_all(&line);
        }
        self.flush();
        match self.capture.take() {
            Some(c) => c
                .finish(&line)
                .map(drop)
                .map_err(|e| anyhow::anyhow!("the capture is incomplete: {e}")),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
#[path = "sink_tests.rs"]
mod tests;
