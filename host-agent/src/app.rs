//! The host agent's state and its phases: start-up ([`App::new`],
//! [`App::attach_initial`], [`App::start_joined`]), the loop's work
//! ([`App::drain`] after each ring-buffer poll, [`App::tick`]: stale elements,
//! the layout check, the once-a-second [`scan`](App::scan) for exits and new
//! VMs, joined-mode events and the periodic tables) and the clean stop
//! ([`App::finish`]; the tables, counters and metrics it reports are in
//! `app/report.rs`). The ring buffer's callback only queues raw records; the app
//! owns the tracer, the outputs and the join, so nothing is shared.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::mem::MaybeUninit;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use libbpf_rs::{OpenObject, RingBuffer, RingBufferBuilder};
use viotrace_shared::jsonl::JsonLines;
use viotrace_shared::metrics::otlp::Otlp;
use viotrace_shared::metrics::{Metrics, Recorder};
use viotrace_shared::selfcost::{CostReport, SelfCost};
use viotrace_shared::stats::Aggregator;

use crate::bpf::types::{host_rec, wait_rec};
use crate::sink::Sink;
use crate::tracer::{self, Tracer};
use crate::{fleet, joined, qemu, Cli};

mod report;

/// How long a pushed element waits for QEMU's guest notification before it is
/// reported without one.
const UNNOTIFIED_AFTER_NS: u64 = 200_000_000;
/// How often the pushed elements are swept for those: the queues that had
/// records each time, every queue (a walk of the 4k-bucket `vqs` map, ~0.2 ms
/// of CPU here) every `SWEEP_ALL_EVERY`th time.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Scans (one a second) between two discoveries that no QEMU exec asked for.
const DISCOVER_ALL_EVERY: u64 = 30;
const SWEEP_ALL_EVERY: u64 = 10;

/// Raw ring-buffer records waiting for [`App::drain`], and those that did not parse.
#[derive(Default)]
pub struct Queue {
    recs: Vec<host_rec>,
    waits: Vec<wait_rec>,
    unparsed: u64,
}

pub struct App<'obj> {
    cli: Cli,
    tracer: Tracer<'obj>,
    sink: Sink,
    queue: Rc<RefCell<Queue>>,
    /// Records no traced element could be made of (besides the unparsed ones).
    unknown: u64,
    metrics: Option<Arc<Metrics>>,
    otlp: Option<Otlp>,
    /// `--pid`s; empty means discovery.
    explicit: BTreeSet<u32>,
    /// Processes not to look at again (failed, refused or not ours).
    failed: BTreeSet<u32>,
    start: Instant,
    next_table: Instant,
    next_scan: Instant,
    next_sweep: Instant,
    sweeps: u64,
    scans: u64,
    /// The kernel's count of QEMU execs at the last discovery.
    qemu_execs: Option<u64>,
    /// Discovery scans of /proc so far.
    discoveries: u64,
    /// The verifier's instructions at load: all programs', the largest one's.
    verified: Option<(u64, u32)>,
    /// The agent's own cost from the moment its programs were loaded.
    cost: SelfCost,
    /// That cost at the stop, with the programs' run time (for the last publication).
    final_cost: Option<CostReport>,
}

impl<'obj> App<'obj> {
    /// Loads the BPF object and starts the metrics endpoint and the OTLP pusher.
    pub fn new(cli: Cli, storage: &'obj mut MaybeUninit<OpenObject>) -> Result<App<'obj>> {
        tracer::ensure_tracefs()?;
        // QEMU threads' waits for a CPU: only for the verdicts (joined mode with -t).
        let sched =
            cli.threshold.is_some() && (!cli.listen_uds.is_empty() || cli.listen_vsock.is_some());
        let tracer = Tracer::open(storage, cli.pop, cli.submit, cli.irq, sched)?;
        let verified = tracer.verified_insns();
        if let Some((sum, (name, top))) = &verified {
            eprintln!(
                "viotrace-host: BPF loaded, verifier: {sum} instructions \
                 (largest program {name}: {top}, the kernel's limit 1000000)"
            );
        }
        for (what, e) in &tracer.missing_kernel {
            eprintln!("viotrace-host: warning: kernel probe {what} not attached: {e}");
        }
        let mut sink = Sink {
            json: cli.json,
            threshold_ns: cli
                .threshold
                .map(|d| d.as_nanos().min(u128::from(u64::MAX)) as u64),
            interval: Aggregator::new(),
            total: Aggregator::new(),
            out: JsonLines::new(std::io::BufWriter::new(std::io::stdout())),
            records: 0,
            joined: None,
            metrics: None,
            label: Default::default(),
        };
        let metrics = (cli.metrics_listen.is_some() || cli.otlp.is_some())
            .then(|| Metrics::new("viotrace-host"));
        if let (Some(m), Some(addr)) = (&metrics, &cli.metrics_listen) {
            let at = viotrace_shared::metrics::expose::serve(addr, m.clone())
                .with_context(|| format!("--metrics-listen {addr}"))?;
            eprintln!("viotrace-host: Prometheus metrics on http://{at}/metrics");
        }
        if let Some(m) = &metrics {
            sink.metrics = Some(Recorder::new(m.clone()));
        }
        let otlp = match (&metrics, &cli.otlp) {
            (Some(m), Some(base)) => Some(fleet::start_otlp(&cli, base, m.clone())?),
            _ => None,
        };
        let start = Instant::now();
        let cost = SelfCost::start(tracer.bpf_runs());
        Ok(App {
            cost,
            final_cost: None,
            explicit: cli.pids.iter().copied().collect(),
            next_table: start + cli.interval,
            next_scan: start + Duration::from_secs(1),
            next_sweep: start + SWEEP_EVERY,
            sweeps: 0,
            scans: 0,
            qemu_execs: None,
            discoveries: 0,
            verified: verified.map(|(sum, (_, top))| (sum, top)),
            cli,
            tracer,
            sink,
            queue: Rc::default(),
            unknown: 0,
            metrics,
            otlp,
            failed: BTreeSet::new(),
            start,
        })
    }

    /// The ring buffer; its callback only queues the raw records for [`App::drain`].
    /// (The QEMU threads' CPU waits have a ring buffer of their own, so that
    /// they can never crowd out the request records.)
    pub fn ring_buffer(
        &self,
        events: &libbpf_rs::MapHandle,
        waits: &libbpf_rs::MapHandle,
    ) -> Result<RingBuffer<'static>> {
        let mut rbb = RingBufferBuilder::new();
        let q = self.queue.clone();
        rbb.add(events, move |data: &[u8]| {
            let mut q = q.borrow_mut();
            match tracer::parse_rec(data) {
                Some(r) => q.recs.push(r),
                None => q.unparsed += 1,
            }
            0
        })
        .context("setting up the ring buffer")?;
        let q = self.queue.clone();
        rbb.add(waits, move |data: &[u8]| {
            let mut q = q.borrow_mut();
            match tracer::parse::<wait_rec>(data) {
                Some(w) => q.waits.push(w),
                None => q.unparsed += 1,
            }
            0
        })
        .context("setting up the waits ring buffer")?;
        rbb.build().context("building the ring buffer")
    }

    /// Owned handles on the ring buffer maps (request records, CPU waits).
    pub fn ring_maps(&self) -> Result<(libbpf_rs::MapHandle, libbpf_rs::MapHandle)> {
        let m = &self.tracer.skel.maps;
        Ok((
            libbpf_rs::MapHandle::try_from(&m.events)
                .context("duplicating the ring buffer map handle")?,
            libbpf_rs::MapHandle::try_from(&m.waits)
                .context("duplicating the waits ring buffer map handle")?,
        ))
    }

    /// Consumes what the ring buffer holds and turns it into elements.
    pub fn drain(&mut self, rb: &RingBuffer) {
        let _ = rb.consume();
        let waits = std::mem::take(&mut self.queue.borrow_mut().waits);
        if let Some(j) = self.sink.joined.as_mut() {
            waits.iter().for_each(|w| j.out.interfere.add_wait(w));
        }
        let mut recs = std::mem::take(&mut self.queue.borrow_mut().recs);
        for r in &recs {
            if !self.tracer.make_record(r, |e| self.sink.elem(e)) {
                self.unknown += 1;
            }
        }
        recs.clear();
        let mut q = self.queue.borrow_mut();
        if q.recs.is_empty() {
            q.recs = recs; // keep the allocation
        }
    }

    /// The inbox's early wake (joined mode).
    pub fn inbox_wake_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.sink.joined.as_ref().map(|j| j.wake_fd())
    }

    fn unattributed(&self) -> u64 {
        self.unknown + self.queue.borrow().unparsed
    }

    fn wanted(&self, pid: u32) -> bool {
        self.cli.vms.is_empty()
            || qemu::QemuProc::inspect(pid).is_ok_and(|p| self.cli.vms.contains(&p.vm))
    }

    /// Attaches to the `--pid`s, or to every (matching) running QEMU.
    pub fn attach_initial(&mut self) -> Result<()> {
        let explicit = !self.explicit.is_empty();
        if explicit {
            let pids: Vec<u32> = self.explicit.iter().copied().collect();
            for pid in pids {
                if !qemu::is_qemu(pid) {
                    eprintln!("viotrace-host: warning: pid {pid} does not run a qemu-system-* or qemu-kvm binary; trying anyway");
                }
                self.attach(pid, true)?;
            }
        } else {
            self.discover_all(self.tracer.qemu_execs())?;
        }
        if !explicit && self.tracer.targets.is_empty() {
            eprintln!(
                "viotrace-host: no {}QEMU process yet; waiting for qemu-system-* to start",
                if self.cli.vms.is_empty() {
                    ""
                } else {
                    "matching "
                }
            );
        }
        Ok(())
    }

    /// Joined mode (`--listen-uds`/`--listen-vsock`): starts serving guest agents.
    pub fn start_joined(&mut self) -> Result<()> {
        let cli = &self.cli;
        if cli.listen_uds.is_empty() && cli.listen_vsock.is_none() {
            return Ok(());
        }
        let only_vm = {
            let vms: BTreeSet<String> = self
                .tracer
                .targets
                .values()
                .map(|t| t.proc.vm.clone())
                .collect();
            (vms.len() == 1).then(|| vms.into_iter().next()).flatten()
        };
        let opts = joined::JoinOpts {
            unix: cli
                .listen_uds
                .iter()
                .map(|s| {
                    let (vm, path) = joined::parse_listen_uds(s);
                    (vm.or_else(|| only_vm.clone()), path)
                })
                .collect(),
            vsock_port: cli.listen_vsock,
            out: cli.joined_out.clone(),
            chrome: cli.chrome_trace.clone(),
            threshold_ns: self.sink.threshold_ns,
            vm_for_cid: self
                .tracer
                .targets
                .iter()
                .filter_map(|(pid, t)| joined::guest_cid_of(*pid).map(|c| (c, t.proc.vm.clone())))
                .collect(),
            max_vm_rate: cli.max_vm_rate,
            vm_read_rate: cli.vm_read_rate.as_u64() as f64,
            capture: cli.json,
            sample_every: cli.sample_every,
        };
        let mut j = joined::Joined::start(&opts)?;
        eprintln!(
            "viotrace-host: joined mode: waiting for guest agents on {}",
            cli.listen_uds
                .iter()
                .cloned()
                .chain(cli.listen_vsock.map(|p| format!("vsock port {p}")))
                .collect::<Vec<_>>()
                .join(", ")
        );
        j.out.metrics = self.metrics.as_ref().map(|m| Recorder::new(m.clone()));
        j.out.otlp = self.otlp.as_ref().map(|o| o.traces());
        self.sink.joined = Some(j);
        Ok(())
    }

    /// Whether `--duration` has elapsed.
    pub fn done(&self, now: Instant) -> bool {
        self.cli.duration.is_some_and(|d| now - self.start >= d)
    }

    /// The loop's work after each poll: elements whose guest notification QEMU
    /// skipped, the runtime layout check, the scan, joined-mode events, tables.
    pub fn tick(&mut self, rb: &RingBuffer, now: Instant) -> Result<()> {
        if now >= self.next_sweep {
            self.next_sweep = now + SWEEP_EVERY;
            self.sweeps += 1;
            let all = self.sweeps.is_multiple_of(SWEEP_ALL_EVERY);
            let stale = self.tracer.sweep_unnotified(
                viotrace_shared::clock::monotonic_ns(),
                UNNOTIFIED_AFTER_NS,
                all,
            );
            for r in stale {
                if !self.tracer.make_record(&r, |e| self.sink.elem(e)) {
                    self.unknown += 1;
                }
            }
        }
        // The runtime layout check: held records released, refused VMs let go.
        let released = self.tracer.poll_probation();
        released.into_iter().for_each(|e| self.sink.elem(e));
        self.print_notes();
        for (pid, msg) in self.tracer.take_refusals() {
            eprintln!("viotrace-host: pid {pid}: {msg}");
            self.detach(pid, "layout refused");
            self.failed.insert(pid);
        }
        if now >= self.next_scan {
            self.next_scan = now + Duration::from_secs(1);
            self.scan(rb)?;
        }
        if let Some(j) = self.sink.joined.as_mut() {
            let notes = j.poll();
            for n in notes {
                self.sink.human(&n);
            }
        }
        if now >= self.next_table {
            self.next_table = now + self.cli.interval;
            self.tables();
        }
        Ok(())
    }

    /// Once a second: metrics published, exited VMs let go, new VMs attached;
    /// every 10 s, freed heap memory handed back.
    fn scan(&mut self, rb: &RingBuffer) -> Result<()> {
        self.publish_metrics();
        self.scans += 1;
        if self.scans.is_multiple_of(10) {
            tracer::trim_heap();
        }
        if let Some(j) = self
            .sink
            .joined
            .as_mut()
            .filter(|j| j.out.verdicts.is_some())
        {
            j.out
                .interfere
                .refresh_issuers(self.tracer.device_issuers().into_iter());
            j.out.interfere.vms = (self.tracer.targets.iter())
                .map(|(pid, t)| (*pid, t.proc.vm.clone()))
                .collect();
        }
        let gone: Vec<u32> = (self.tracer.targets.iter())
            .filter(|(_, t)| !t.live.alive())
            .map(|(&p, _)| p)
            .collect();
        for pid in gone {
            self.drain(rb);
            self.detach(pid, "exited");
        }
        self.discover_new()
    }

    /// Discovery (without `--pid`): attaches the wanted QEMUs that started. It
    /// reads every process's exe link, so it runs only when the kernel saw a
    /// QEMU binary start (or cannot tell), and every `DISCOVER_ALL_EVERY` scans.
    fn discover_new(&mut self) -> Result<()> {
        if !self.explicit.is_empty() {
            return Ok(());
        }
        let execs = self.tracer.qemu_execs();
        if execs.is_some()
            && execs == self.qemu_execs
            && !self.scans.is_multiple_of(DISCOVER_ALL_EVERY)
        {
            return Ok(());
        }
        self.discover_all(execs)
    }

    /// Scans `/proc` and attaches the wanted QEMUs not yet traced. `execs` is
    /// the exec count read before the scan: a QEMU that starts meanwhile moves
    /// it, so the next pass scans again.
    fn discover_all(&mut self, execs: Option<u64>) -> Result<()> {
        self.qemu_execs = execs;
        self.discoveries += 1;
        let found = qemu::discover();
        for &pid in &found {
            if self.tracer.targets.contains_key(&pid) || self.failed.contains(&pid) {
                continue;
            }
            if !self.wanted(pid) {
                self.failed.insert(pid); // not ours: do not look again
                continue;
            }
            self.attach(pid, false)?;
        }
        // Forget what exited (the scan found only running QEMUs): a new
        // QEMU with a reused pid is looked at again.
        self.failed.retain(|p| found.binary_search(p).is_ok());
        Ok(())
    }

    /// Starts tracing `pid`; failures are reported and remembered (fatal only for an
    /// explicit --pid that cannot be traced at all).
    fn attach(&mut self, pid: u32, explicit: bool) -> Result<()> {
        let res = qemu::QemuProc::inspect(pid).and_then(|p| {
            let desc = format!(
                "pid {pid} vm={} exe={} (via {}) devices={}",
                p.vm,
                p.exe.display(),
                p.exe_via,
                p.devices
                    .iter()
                    .map(|d| format!(
                        "{}(drive={},backend={:?})",
                        d.id.as_deref().unwrap_or("?"),
                        d.drive.as_deref().unwrap_or("?"),
                        p.backend_of(Some(d))
                    ))
                    .collect::<Vec<_>>()
                    .join(",")
            );
            let warns = self.tracer.add(p)?;
            Ok((desc, warns))
        });
        match res {
            Ok((desc, warns)) => {
                let info = self.tracer.targets.get(&pid).map(|t| {
                    format!(
                        "QEMU {}; {}",
                        t.info.version.as_deref().unwrap_or("version unknown"),
                        t.info.trust_note()
                    )
                });
                eprintln!(
                    "viotrace-host: tracing {desc} ({})",
                    info.unwrap_or_default()
                );
                for w in warns {
                    eprintln!("viotrace-host: pid {pid}: {w}");
                }
                Ok(())
            }
            Err(e) if explicit => Err(e.context(format!("cannot trace pid {pid}"))),
            Err(e) => {
                eprintln!("viotrace-host: not tracing pid {pid}: {e:#}");
                self.failed.insert(pid);
                Ok(())
            }
        }
    }

    /// The tracer's warnings since the last call, to stderr.
    fn print_notes(&mut self) {
        for n in self.tracer.take_notes() {
            eprintln!("viotrace-host: warning: {n}");
        }
    }

    fn detach(&mut self, pid: u32, why: &str) {
        self.tracer.last_checks(pid);
        self.print_notes();
        // A layout the final counts refuse (the VM ended between two checks).
        let mut why = why;
        for (p, msg) in self.tracer.take_refusals() {
            eprintln!("viotrace-host: pid {p}: {msg}");
            self.failed.insert(p);
            if p == pid {
                why = "layout refused";
            }
        }
        let (t, leftover, abandoned) = self.tracer.remove(pid);
        let Some(t) = t else { return };
        if let Some(j) = self.sink.joined.as_mut() {
            j.out.interfere.forget(pid);
        }
        for r in &leftover {
            let e = Tracer::record_of_gone(&t, r);
            self.sink.elem(e);
        }
        let cpu = match (t.cpu_ticks_start, qemu::cpu_ticks(pid)) {
            (Some(a), Some(b)) => format!(", QEMU CPU {} ticks", b.saturating_sub(a)),
            _ => String::new(),
        };
        let msg = format!(
            "viotrace-host: stopped tracing pid {pid} vm={} ({why}): {} elements{}{}{}{}\n",
            t.proc.vm,
            t.elems + leftover.len() as u64,
            if leftover.is_empty() {
                String::new()
            } else {
                format!(", {} emitted without h.irq", leftover.len())
            },
            if abandoned > 0 {
                format!(", {abandoned} in flight abandoned")
            } else {
                String::new()
            },
            if t.probation.dropped > 0 {
                format!(
                    ", {} records of the refused layout dropped",
                    t.probation.dropped
                )
            } else {
                String::new()
            },
            cpu
        );
        eprint!("{msg}");
    }
}
