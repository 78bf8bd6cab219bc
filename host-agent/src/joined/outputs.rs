//! What becomes of each record the join emits: statistics, metrics,
//! verdicts and the always-on output. The records come as views
//! ([`Emitted`]); the full [`JoinedIo`] is built only for those that are
//! judged (`-t`) or written.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::time::Instant;

use rustc_hash::FxHashMap;
use viotrace_shared::cause::Verdicts;
use viotrace_shared::chrome::ChromeTrace;
use viotrace_shared::join::{Emitted, Output};
use viotrace_shared::jsonl::JsonLines;
use viotrace_shared::record::JoinedIo;
use viotrace_shared::stages;
use viotrace_shared::stats::{fmt_ns, render_waterfall, Aggregator, PairLabel};
use viotrace_shared::transport::host::TokenBucket;

use crate::interfere::Interfere;

/// Per-VM output state.
pub(super) struct VmOut {
    pub bucket: TokenBucket,
    pub written: u64,
    pub rate_limited: u64,
    /// Always-on: records neither slow nor sampled (statistics only).
    pub summarized: u64,
    /// Records offered to the output (for the 1-in-N sample).
    pub offered: u64,
    /// Syscall-level records (they stay in the guest's own output).
    pub io_records: u64,
    /// Delivered records whose contents did not decode (dropped, counted).
    pub malformed: u64,
    /// Live guest connections, and since when there has been none.
    pub conns: usize,
    pub stalled_since: Option<Instant>,
}

/// The joined records' destinations and statistics.
pub struct Outputs {
    /// Each VM's output, in first-seen order, found by name through
    /// `vm_index` (`last_vm`: the one of the previous record).
    pub(super) vms: Vec<(String, VmOut)>,
    pub(super) vm_index: FxHashMap<String, usize>,
    pub(super) last_vm: usize,
    pub(super) max_vm_rate: f64,
    /// See [`super::JoinOpts::capture`].
    pub(super) capture: bool,
    pub(super) sample_every: u64,
    pub(super) file: JsonLines<Box<dyn Write>>,
    /// The record being handled, when it had to be built (at most one).
    pub(super) built: Vec<JoinedIo>,
    pub interval: Aggregator,
    pub(super) label: PairLabel,
    pub(super) threshold_ns: Option<u64>,
    /// The Chrome trace, streamed as records are written, and its first write error.
    pub(super) chrome: Option<(
        PathBuf,
        ChromeTrace<BufWriter<File>>,
        Option<std::io::Error>,
    )>,
    pub records: u64,
    /// Human output (tables, waterfalls, notices).
    pub(super) human: Vec<String>,
    /// Fleet metrics of the end-to-end records (`--metrics-listen`), and each
    /// VM's newest clock uncertainty for them.
    pub metrics: Option<viotrace_shared::metrics::Recorder>,
    pub clock_uncertainty: FxHashMap<String, u64>,
    /// OTLP traces of slow I/Os (`--otlp`).
    pub otlp: Option<viotrace_shared::metrics::otlp::SlowTraces>,
    /// Why-slow verdicts of joined records above the threshold (`-t`).
    pub verdicts: Option<Verdicts>,
    /// Their interference evidence (QEMU's CPU waits, host device issuers).
    pub interfere: Interfere,
}

impl Outputs {
    pub(super) fn vm_out(&mut self, vm: &str) -> &mut VmOut {
        // Records come in runs of one VM: its name is compared, not hashed.
        let i = match self.vms.get(self.last_vm) {
            Some((name, _)) if name == vm => self.last_vm,
            _ => match self.vm_index.get(vm) {
                Some(&i) => i,
                None => {
                    let rate = self.max_vm_rate;
                    self.vms.push((
                        vm.to_string(),
                        VmOut {
                            bucket: TokenBucket::new(rate, rate.min(1e12)),
                            written: 0,
                            rate_limited: 0,
                            summarized: 0,
                            offered: 0,
                            io_records: 0,
                            malformed: 0,
                            conns: 0,
                            stalled_since: None,
                        },
                    ));
                    self.vm_index.insert(vm.to_string(), self.vms.len() - 1);
                    self.vms.len() - 1
                }
            },
        };
        self.last_vm = i;
        &mut self.vms[i].1
    }

    /// The output of VM `vm`, if it has one.
    pub(super) fn vm(&self, vm: &str) -> Option<&VmOut> {
        self.vm_index.get(vm).map(|&i| &self.vms[i].1)
    }

    /// The fleet metrics of one record (and its VM's clock uncertainty).
    fn metrics(&mut self, r: &Emitted<'_>) {
        let Some(m) = self.metrics.as_mut() else {
            return;
        };
        let disk = r.disk().or(r.device()).unwrap_or("");
        let b = stages::derive(r.ts());
        let (op, bytes) = r.op_bytes();
        m.record(
            "joined",
            r.vm(),
            disk,
            r.queue(),
            op,
            bytes,
            &b.stages,
            b.total_ns,
            r.joined(),
        );
        if let Some(u) = r.clock_uncertainty_ns() {
            match self.clock_uncertainty.get_mut(r.vm()) {
                Some(x) => *x = u,
                None => {
                    self.clock_uncertainty.insert(r.vm().to_string(), u);
                }
            }
        }
    }
}

impl Output for Outputs {
    /// Statistics, metrics, verdicts and the always-on output of one record.
    fn emit(&mut self, r: Emitted<'_>) {
        self.records += 1;
        self.built.clear();
        // `-t`: the verdicts read every whole record.
        if let Some(v) = self.verdicts.as_mut() {
            let j = built(&mut self.built, &r);
            self.interfere.note_request(j);
            if v.may_judge(j) {
                self.interfere.fill(j);
            }
            v.judge(j);
        }
        self.metrics(&r);
        // The stages and total of a joined record (into the interval only:
        // the totals take whole intervals, drain_into).
        let total_ns = if r.joined() {
            let disk = r.disk().or(r.device()).unwrap_or("?");
            let label = self.label.get(r.vm(), disk);
            self.interval.record_points(label, r.ts())
        } else {
            None
        };
        let slow = match (self.threshold_ns, total_ns) {
            (Some(th), Some(t)) => t >= 0 && t as u64 >= th,
            _ => false,
        };
        if slow {
            let j = built(&mut self.built, &r);
            if let Some(o) = &self.otlp {
                o.slow(j);
            }
            self.human.push(slow_report(j));
        }
        // Always-on: the files get the slow and the sampled records; the
        // statistics above keep every one.
        let (capture, every) = (self.capture, self.sample_every);
        let o = self.vm_out(r.vm());
        o.offered += 1;
        if !capture && !slow && (every == 0 || !o.offered.is_multiple_of(every)) {
            o.summarized += 1;
            return;
        }
        // Per-VM output rate: the files get at most the VM's rate, the rest
        // is counted.
        if !o.bucket.try_take(1.0, Instant::now()) {
            o.rate_limited += 1;
            return;
        }
        o.written += 1;
        let j = built(&mut self.built, &r);
        if let Some((_, c, err @ None)) = self.chrome.as_mut() {
            *err = c.add(j).err();
        }
        let _ = self.file.write(j);
    }
}

/// The record of `r`, built into `buf` (reused: no allocation per record)
/// unless it already is.
fn built<'b>(buf: &'b mut Vec<JoinedIo>, r: &Emitted<'_>) -> &'b mut JoinedIo {
    if buf.is_empty() {
        r.build_into(buf);
    }
    &mut buf[0]
}

/// A slow joined record's header and waterfall (and its verdict).
fn slow_report(j: &JoinedIo) -> String {
    let header = format!(
        "slow I/O: vm={} disk={} q{} head={} {} sector={} bytes={} pid={} comm={} inode={} offset={} total={} (clock ±{}) at {}",
        j.vm,
        j.disk.as_deref().unwrap_or("?"),
        j.queue.map_or("?".into(), |q| q.to_string()),
        j.head.map_or("?".into(), |h| h.to_string()),
        j.op,
        j.sector,
        j.bytes,
        j.pid.map_or("?".into(), |p| p.to_string()),
        j.comm.as_deref().unwrap_or("?"),
        j.inode.map_or("?".into(), |i| i.to_string()),
        j.file_offset.map_or("?".into(), |o| o.to_string()),
        fmt_ns(j.total_ns.unwrap_or(0) as u64),
        fmt_ns(j.clock_uncertainty_ns.unwrap_or(0)),
        j.time.map_or("?".to_string(), |t| t.to_string()),
    );
    let mut w = render_waterfall(&header, &j.ts);
    if let Some(c) = &j.cause {
        w += &format!("  cause: {}: {}\n", c.kind.name(), c.evidence);
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use viotrace_shared::join::synth::{generate, interleave, Event, SynthConfig};
    use viotrace_shared::join::JoinEngine;

    /// A writer whose bytes the test reads afterwards.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn outputs(file: Shared, threshold_ns: u64, sample_every: u64) -> Outputs {
        Outputs {
            vms: Vec::new(),
            vm_index: FxHashMap::default(),
            last_vm: 0,
            max_vm_rate: f64::INFINITY,
            capture: false,
            sample_every,
            file: JsonLines::new(Box::new(file)),
            built: Vec::new(),
            interval: Aggregator::new(),
            label: PairLabel::default(),
            threshold_ns: Some(threshold_ns),
            chrome: None,
            records: 0,
            human: Vec::new(),
            metrics: None,
            clock_uncertainty: FxHashMap::default(),
            otlp: None,
            verdicts: None,
            interfere: Interfere::default(),
        }
    }

    fn feed(events: &[Event], out: &mut dyn Output) {
        let mut e = JoinEngine::default();
        for ev in events.iter().cloned() {
            match ev {
                Event::Guest(g) => e.push_guest("vm0", g, out),
                Event::Host(h) => e.push_host(h, out),
                Event::Probe(a, b, c, d) => {
                    let _ = e.clock("vm0").add_guest_probe(a, b, c, d);
                }
            }
        }
        e.flush(out);
    }

    /// From the views: the same statistics, the same written lines and the
    /// same slow-I/O reports as from every record built (joined and
    /// unmatched records; slow, sampled and summarized ones), with and
    /// without verdicts (`-t`).
    #[test]
    fn views_make_the_outputs_of_the_built_records() {
        let s = generate(&SynthConfig {
            vm: "vm0".into(),
            requests: 3000,
            queues: 2,
            seed: 8,
            ..SynthConfig::default()
        });
        let mut events = interleave(&s, 1_000_000, 100, 4);
        events.retain(|e| !matches!(e, Event::Guest(g) if g.sector % 11 == 0));
        let mut all: Vec<JoinedIo> = Vec::new();
        feed(&events, &mut all);
        // One in five joined records is slow.
        let mut totals: Vec<i64> = all.iter().filter_map(|j| j.total_ns).collect();
        totals.sort_unstable();
        let (threshold, every) = (totals[totals.len() * 4 / 5] as u64, 7);
        for judged in [false, true] {
            let file = Shared::default();
            let mut o = outputs(file.clone(), threshold, every);
            o.verdicts = judged.then(|| Verdicts::new(threshold));
            feed(&events, &mut o);

            let mut recs = all.clone();
            let mut verdicts = judged.then(|| Verdicts::new(threshold));
            let mut interfere = Interfere::default();
            let want_file = Shared::default();
            let mut want_out = JsonLines::new(want_file.clone());
            let mut want = Aggregator::new();
            let (mut label, mut human) = (PairLabel::default(), vec![]);
            for (k, j) in recs.iter_mut().enumerate() {
                if let Some(v) = verdicts.as_mut() {
                    interfere.note_request(j);
                    if v.may_judge(j) {
                        interfere.fill(j);
                    }
                    v.judge(j);
                }
                if j.joined {
                    let disk = j.disk.as_deref().or(j.device.as_deref()).unwrap_or("?");
                    want.record_stages(label.get(&j.vm, disk), &j.stages, j.total_ns);
                }
                let slow = j.joined && j.total_ns.is_some_and(|t| t >= threshold as i64);
                if slow {
                    human.push(slow_report(j));
                }
                if slow || (k as u64 + 1).is_multiple_of(every) {
                    want_out.write(j).unwrap();
                }
            }
            assert_eq!(o.records, all.len() as u64);
            assert_eq!(o.interval.summaries(), want.summaries());
            assert_eq!(o.human, human);
            assert!(!human.is_empty() && human.len() < all.len() / 2);
            let vm = o.vm("vm0").unwrap();
            assert_eq!(vm.written + vm.summarized, all.len() as u64);
            assert!(all.iter().any(|j| !j.joined));
            assert_eq!(*file.0.lock().unwrap(), *want_file.0.lock().unwrap());
            assert_eq!(o.verdicts.map(|v| v.flagged), verdicts.map(|v| v.flagged));
        }
    }
}
