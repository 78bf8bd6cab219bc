//! viotrace host agent: traces every virtio-blk virtqueue element of QEMU
//! processes (stock binaries, exported symbols only) through QEMU and the host
//! kernel, one record per element.

mod bpf {
    #![allow(unused_imports, clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/viotrace_host.skel.rs"));
}
mod fleet;
mod joined;
mod qemu;
mod tracer;

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::io::Write;
use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use libbpf_rs::RingBufferBuilder;
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use serde::Serialize;
use viotrace_shared::record::HostElem;
use viotrace_shared::stats::{render_waterfall, stages, Aggregator, TOTAL_STAGE};

use crate::tracer::Tracer;

/// Trace virtio-blk requests inside QEMU and the host kernel.
#[derive(Parser, Debug)]
#[command(name = "viotrace-host", version)]
struct Cli {
    /// QEMU process to trace (repeatable). Without it, every running
    /// qemu-system-* is traced, including VMs that start later.
    #[arg(long = "pid", value_name = "PID")]
    pids: Vec<u32>,
    /// Only trace VMs with this name (QEMU `-name`; repeatable). Applies to
    /// discovery; with --pid the given processes are traced whatever their name.
    #[arg(long = "vm", value_name = "NAME")]
    vms: Vec<String>,
    /// Print a waterfall of every element whose total latency is at least this
    /// (e.g. 500us, 2ms).
    #[arg(short = 't', long, value_parser = humantime::parse_duration)]
    threshold: Option<Duration>,
    /// Interval of the periodic per-stage table.
    #[arg(short = 'i', long, default_value = "5s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Stop after this long.
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// One JSON object per line on stdout (records and a final "stats" line);
    /// tables and waterfalls go to stderr.
    #[arg(long)]
    json: bool,
    /// Also probe virtqueue_pop for h.pop (and the element's sizes from its
    /// scatter list): three more uprobe hits per request on QEMU's I/O thread.
    #[arg(long)]
    pop: bool,
    /// Create this file once the probes are attached.
    #[arg(long, value_name = "FILE")]
    ready_file: Option<PathBuf>,
    /// Joined mode: accept guest agents on this Unix socket (hybrid vsock: the VMM's
    /// `<uds-path>_<port>`), as `VM=PATH`, or `PATH` when exactly one VM is traced. Repeatable.
    #[arg(long, value_name = "[VM=]PATH")]
    listen_uds: Vec<String>,
    /// Joined mode: accept guest agents on this AF_VSOCK port (the VM is found from its CID).
    #[arg(long, value_name = "PORT")]
    listen_vsock: Option<u32>,
    /// Joined mode: write the end-to-end records (`"kind":"io"`) here instead of stdout.
    #[arg(long, value_name = "FILE")]
    joined_out: Option<PathBuf>,
    /// Joined mode: write a Chrome trace-event file (Perfetto) of the joined requests at exit.
    #[arg(long, value_name = "FILE")]
    chrome_trace: Option<PathBuf>,
    /// Joined mode: most joined records written per second per VM (0: no limit); the
    /// rest still count in the statistics and are reported as output_rate_limited.
    #[arg(long, value_name = "N", default_value_t = 50_000.0)]
    max_vm_rate: f64,
    /// Serve Prometheus metrics (per-stage histograms, counters, every drop
    /// counter) on this address, e.g. 127.0.0.1:9477 (GET /metrics).
    #[arg(long, value_name = "ADDR:PORT")]
    metrics_listen: Option<String>,
    /// Push the metrics (every 5 s) and one trace per slow I/O (joined mode, -t)
    /// as OTLP/HTTP protobuf to ENDPOINT/v1/metrics and ENDPOINT/v1/traces.
    #[arg(long, value_name = "http://HOST:PORT")]
    otlp: Option<String>,
    /// Full URL for the OTLP metrics (overrides --otlp for that signal).
    #[arg(long, value_name = "URL", requires = "otlp")]
    otlp_metrics_url: Option<String>,
    /// Full URL for the OTLP traces (overrides --otlp for that signal).
    #[arg(long, value_name = "URL", requires = "otlp")]
    otlp_traces_url: Option<String>,
}

#[derive(Serialize)]
struct Tagged<'a, T: Serialize> {
    kind: &'static str,
    #[serde(flatten)]
    rec: &'a T,
}

/// Where the records go, and the aggregates built from them.
struct Sink {
    json: bool,
    threshold_ns: Option<u64>,
    interval: Aggregator,
    total: Aggregator,
    out: std::io::BufWriter<std::io::Stdout>,
    records: u64,
    joined: Option<joined::Joined>,
    metrics: Option<viotrace_shared::metrics::Recorder>,
}

impl Sink {
    fn human(&mut self, s: &str) {
        if self.json {
            eprint!("{s}");
        } else {
            let _ = self.out.write_all(s.as_bytes());
        }
    }

    fn elem(&mut self, e: &HostElem) {
        self.records += 1;
        if let Some(j) = self.joined.as_mut() {
            j.host_elem(e);
        }
        // In joined mode the end-to-end records carry these stages (source="joined"):
        // deriving them a second time per element would double the exporter's cost.
        if let Some(m) = self.metrics.as_mut().filter(|_| self.joined.is_none()) {
            let b = viotrace_shared::join::host_breakdown(e);
            let (q, op) = (Some(e.queue), e.op);
            m.record(
                "host", &e.vm, &e.device, q, op, e.bytes, &b.stages, b.total_ns, true,
            );
        }
        let label = format!("{}/{}", e.vm, e.device);
        let st = stages(&e.ts);
        for (stage, ns) in &st {
            self.interval.record(&label, stage, *ns);
            self.total.record(&label, stage, *ns);
        }
        if self.json {
            let t = Tagged {
                kind: "host_elem",
                rec: e,
            };
            if serde_json::to_writer(&mut self.out, &t).is_ok() {
                let _ = self.out.write_all(b"\n");
            }
        }
        if let Some(th) = self.threshold_ns {
            let total = st.iter().find(|(n, _)| n == TOTAL_STAGE).map_or(0, |x| x.1);
            if total >= th {
                let header = format!(
                    "slow element: vm={} disk={} q{} head={} {} sector={} bytes={} backend={:?} merge_id={} status={} at {}",
                    e.vm,
                    e.device,
                    e.queue,
                    e.head,
                    e.op,
                    e.sector,
                    e.bytes,
                    e.backend,
                    e.merge_id,
                    e.status.map_or("-".to_string(), |s| s.to_string()),
                    e.time.map_or("?".to_string(), |t| t.to_string())
                );
                let w = render_waterfall(&header, &e.ts);
                self.human(&w);
            }
        }
    }
}

/// How long a pushed element waits for QEMU's guest notification before it is
/// reported without one.
const UNNOTIFIED_AFTER_NS: u64 = 200_000_000;

fn main() {
    if let Err(e) = run() {
        eprintln!("viotrace-host: error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGINT);
    mask.add(Signal::SIGTERM);
    mask.thread_block().context("blocking SIGINT/SIGTERM")?;
    let sigfd = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .context("creating a signalfd")?;

    tracer::ensure_tracefs()?;
    let mut storage = MaybeUninit::uninit();
    let tracer = Rc::new(RefCell::new(Tracer::open(&mut storage, cli.pop)?));
    for (what, e) in &tracer.borrow().missing_kernel {
        eprintln!("viotrace-host: warning: kernel probe {what} not attached: {e}");
    }

    let sink = Rc::new(RefCell::new(Sink {
        json: cli.json,
        threshold_ns: cli
            .threshold
            .map(|d| d.as_nanos().min(u128::from(u64::MAX)) as u64),
        interval: Aggregator::new(),
        total: Aggregator::new(),
        out: std::io::BufWriter::new(std::io::stdout()),
        records: 0,
        joined: None,
        metrics: None,
    }));
    let metrics = (cli.metrics_listen.is_some() || cli.otlp.is_some())
        .then(|| viotrace_shared::metrics::Metrics::new("viotrace-host"));
    if let (Some(m), Some(addr)) = (&metrics, &cli.metrics_listen) {
        let at = viotrace_shared::metrics::expose::serve(addr, m.clone())
            .with_context(|| format!("--metrics-listen {addr}"))?;
        eprintln!("viotrace-host: Prometheus metrics on http://{at}/metrics");
    }
    if let Some(m) = &metrics {
        sink.borrow_mut().metrics = Some(viotrace_shared::metrics::Recorder::new(m.clone()));
    }
    let mut otlp = match (&metrics, &cli.otlp) {
        (Some(m), Some(base)) => Some(fleet::start_otlp(&cli, base, m.clone())?),
        _ => None,
    };

    // An owned handle on the ring buffer map, so the tracer can stay mutable.
    let events = libbpf_rs::MapHandle::try_from(&tracer.borrow().skel.maps.events)
        .context("duplicating the ring buffer map handle")?;
    let mut rbb = RingBufferBuilder::new();
    let unknown = Rc::new(RefCell::new(0u64));
    {
        let (tr, sk, unk) = (tracer.clone(), sink.clone(), unknown.clone());
        rbb.add(&events, move |data: &[u8]| {
            let Some(r) = tracer::parse_rec(data) else {
                *unk.borrow_mut() += 1;
                return 0;
            };
            match tr.borrow_mut().make_record(&r) {
                Some(v) => v.iter().for_each(|e| sk.borrow_mut().elem(e)),
                None => *unk.borrow_mut() += 1,
            }
            0
        })
        .context("setting up the ring buffer")?;
    }
    let rb = rbb.build().context("building the ring buffer")?;

    // Initial targets.
    let explicit: BTreeSet<u32> = cli.pids.iter().copied().collect();
    let mut failed: BTreeSet<u32> = BTreeSet::new();
    let wanted = |pid: u32| -> bool {
        cli.vms.is_empty() || qemu::QemuProc::inspect(pid).is_ok_and(|p| cli.vms.contains(&p.vm))
    };
    let initial: Vec<u32> = if explicit.is_empty() {
        qemu::discover()
            .into_iter()
            .filter(|&p| wanted(p))
            .collect()
    } else {
        explicit.iter().copied().collect()
    };
    for pid in initial {
        if !explicit.is_empty() && !qemu::is_qemu(pid) {
            eprintln!("viotrace-host: warning: pid {pid} does not run a qemu-system-* or qemu-kvm binary; trying anyway");
        }
        attach(&tracer, pid, &mut failed, !explicit.is_empty())?;
    }
    if explicit.is_empty() && tracer.borrow().targets.is_empty() {
        eprintln!(
            "viotrace-host: no {}QEMU process yet; waiting for qemu-system-* to start",
            if cli.vms.is_empty() { "" } else { "matching " }
        );
    }
    if !cli.listen_uds.is_empty() || cli.listen_vsock.is_some() {
        let only_vm = {
            let t = tracer.borrow();
            let vms: BTreeSet<String> = t.targets.values().map(|t| t.proc.vm.clone()).collect();
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
            threshold_ns: sink.borrow().threshold_ns,
            vm_for_cid: tracer
                .borrow()
                .targets
                .iter()
                .filter_map(|(pid, t)| joined::guest_cid_of(*pid).map(|c| (c, t.proc.vm.clone())))
                .collect(),
            max_vm_rate: cli.max_vm_rate,
        };
        let j = joined::Joined::start(&opts)?;
        eprintln!(
            "viotrace-host: joined mode: waiting for guest agents on {}",
            cli.listen_uds
                .iter()
                .cloned()
                .chain(cli.listen_vsock.map(|p| format!("vsock port {p}")))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let mut j = j;
        j.metrics = metrics
            .as_ref()
            .map(|m| viotrace_shared::metrics::Recorder::new(m.clone()));
        j.otlp = otlp.as_ref().map(|o| o.traces());
        sink.borrow_mut().joined = Some(j);
    }
    if let Some(f) = &cli.ready_file {
        std::fs::write(f, b"ready\n").with_context(|| format!("writing {}", f.display()))?;
    }

    let start = Instant::now();
    let mut next_table = start + cli.interval;
    let mut next_scan = start + Duration::from_secs(1);
    let mut why = "duration elapsed";
    loop {
        // BPF wakes us only when the ring fills up (a wakeup per record would cost
        // QEMU's thread): wait at most 100 ms, then drain whatever is there.
        if let Err(e) = rb.poll(Duration::from_millis(100)) {
            // EINTR is harmless; anything else is reported once per poll.
            if !e.to_string().contains("Interrupted") {
                eprintln!("viotrace-host: warning: ring buffer poll: {e}");
            }
        }
        let _ = rb.consume();
        if let Ok(Some(si)) = sigfd.read_signal() {
            why = if si.ssi_signo == Signal::SIGTERM as u32 {
                "SIGTERM"
            } else {
                "SIGINT"
            };
            break;
        }
        let now = Instant::now();
        if cli.duration.is_some_and(|d| now - start >= d) {
            break;
        }
        // Elements whose guest notification QEMU skipped must not wait for the next one.
        let stale = tracer
            .borrow_mut()
            .sweep_unnotified(viotrace_shared::clock::monotonic_ns(), UNNOTIFIED_AFTER_NS);
        for r in stale {
            let e = tracer.borrow_mut().make_record(&r);
            match e {
                Some(v) => v.iter().for_each(|e| sink.borrow_mut().elem(e)),
                None => *unknown.borrow_mut() += 1,
            }
        }
        // The runtime layout check: held records released, refused VMs let go.
        let released = tracer.borrow_mut().poll_probation();
        released.iter().for_each(|e| sink.borrow_mut().elem(e));
        let refused = tracer.borrow_mut().take_refusals();
        for (pid, msg) in refused {
            eprintln!("viotrace-host: pid {pid}: {msg}");
            detach(&tracer, &sink, pid, "layout refused");
            failed.insert(pid);
        }
        if now >= next_scan {
            next_scan = now + Duration::from_secs(1);
            if let Some(m) = &metrics {
                publish_metrics(m, &tracer, &sink, *unknown.borrow(), otlp.as_ref());
            }
            // Exits.
            let gone: Vec<u32> = tracer
                .borrow()
                .targets
                .keys()
                .copied()
                .filter(|&p| !qemu::alive(p))
                .collect();
            for pid in gone {
                let _ = rb.consume();
                detach(&tracer, &sink, pid, "exited");
            }
            // New VMs.
            if explicit.is_empty() {
                for pid in qemu::discover() {
                    if tracer.borrow().targets.contains_key(&pid) || failed.contains(&pid) {
                        continue;
                    }
                    if !wanted(pid) {
                        failed.insert(pid); // not ours: do not look again
                        continue;
                    }
                    attach(&tracer, pid, &mut failed, false)?;
                }
                failed.retain(|&p| qemu::alive(p));
            }
        }
        {
            let mut s = sink.borrow_mut();
            if let Some(j) = s.joined.as_mut() {
                let notes = j.poll();
                for n in notes {
                    s.human(&n);
                }
            }
        }
        if now >= next_table {
            next_table = now + cli.interval;
            let mut s = sink.borrow_mut();
            if let Some(j) = s.joined.as_mut() {
                let mut t = String::new();
                if !j.interval.is_empty() {
                    t = j.interval.render_table(&format!(
                        "== viotrace end-to-end (guest + host, host clock): last {}",
                        humantime::format_duration(cli.interval)
                    ));
                    j.interval.clear();
                }
                let title = format!(
                    "== viotrace why-slow: causes of the slow I/Os of the last {}",
                    humantime::format_duration(cli.interval)
                );
                if let Some(c) = j.verdicts.as_mut().and_then(|v| v.take_interval(&title)) {
                    t += &c;
                }
                if !t.is_empty() {
                    s.human(&t);
                }
            }
            if !s.interval.is_empty() {
                let t = s.interval.render_table(&format!(
                    "== viotrace-host: last {} (at +{:.1}s)",
                    humantime::format_duration(cli.interval),
                    start.elapsed().as_secs_f64()
                ));
                s.human(&t);
                s.interval.clear();
            }
            let _ = s.out.flush();
        }
    }

    // Clean stop: drain, detach everything, emit what was still waiting.
    let _ = rb.consume();
    let detaching = tracer.borrow_mut().detach_all();
    let _ = rb.consume();
    let pids: Vec<u32> = tracer.borrow().targets.keys().copied().collect();
    for pid in pids {
        detach(&tracer, &sink, pid, "agent stopping");
    }
    let _ = rb.consume();
    let mut stats: Vec<(String, u64)> = tracer
        .borrow()
        .stats()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let mut s = sink.borrow_mut();
    let mut transport = Vec::new();
    if let Some(mut j) = s.joined.take() {
        let notes = j.finish()?;
        transport = j
            .vm_accounts()
            .iter()
            .map(|r| serde_json::to_value(r).unwrap_or_default())
            .collect();
        for n in notes {
            s.human(&n);
        }
        let t = j.total.render_table(&format!(
            "== viotrace end-to-end totals ({} records)",
            j.records
        ));
        s.human(&t);
        stats.extend(j.counters());
    }
    drop(s);
    if let Some(o) = otlp.as_mut() {
        // The last push carries the final counters.
        if let Some(m) = &metrics {
            publish_metrics(m, &tracer, &sink, *unknown.borrow(), Some(o));
        }
        o.finish();
        stats.extend(o.stats.counters());
    }
    let mut s = sink.borrow_mut();
    let t = s.total.render_table(&format!(
        "== viotrace-host: totals over {:.1}s ({why})",
        start.elapsed().as_secs_f64()
    ));
    s.human(&t);
    let mut line = format!(
        "drops/counters: records={} unattributed={}",
        s.records,
        unknown.borrow()
    );
    for (k, v) in &stats {
        line += &format!(" {k}={v}");
    }
    line.push('\n');
    s.human(&line);
    if s.json {
        let mut m = serde_json::Map::new();
        m.insert("kind".into(), "stats".into());
        m.insert("records".into(), s.records.into());
        m.insert("unattributed".into(), (*unknown.borrow()).into());
        for (k, v) in &stats {
            m.insert(k.clone(), (*v).into());
        }
        let summ: Vec<serde_json::Value> = s
            .total
            .summaries()
            .into_iter()
            .map(|(label, stage, sm)| {
                serde_json::json!({"label": label, "stage": stage, "count": sm.count,
                    "mean_ns": sm.mean_ns, "p50_ns": sm.p50_ns, "p99_ns": sm.p99_ns, "max_ns": sm.max_ns})
            })
            .collect();
        m.insert("stages".into(), summ.into());
        m.insert("transport".into(), transport.into());
        let _ = serde_json::to_writer(&mut s.out, &serde_json::Value::Object(m));
        let _ = s.out.write_all(b"\n");
    }
    s.out.flush().context("writing stdout")?;
    let _ = detaching.join();
    Ok(())
}

/// Publishes the counters of the final stats line (and each VM's clock
/// uncertainty) to the metrics endpoint: once a second, not per record.
fn publish_metrics(
    m: &viotrace_shared::metrics::Metrics,
    tracer: &Rc<RefCell<Tracer>>,
    sink: &Rc<RefCell<Sink>>,
    unattributed: u64,
    otlp: Option<&viotrace_shared::metrics::otlp::Otlp>,
) {
    let s = sink.borrow();
    let mut c: Vec<(String, u64)> = vec![
        ("records".into(), s.records),
        ("unattributed".into(), unattributed),
    ];
    c.extend(
        tracer
            .borrow()
            .stats()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v)),
    );
    let mut g = Vec::new();
    if let Some(j) = s.joined.as_ref() {
        c.extend(j.counters());
        for (vm, u) in &j.clock_uncertainty {
            g.push((
                "viotrace_clock_uncertainty_seconds".to_string(),
                vm.clone(),
                *u as f64 / 1e9,
            ));
        }
    }
    if let Some(o) = otlp {
        c.extend(o.stats.counters());
    }
    m.set_counters(c);
    m.set_gauges(g);
}

/// Starts tracing `pid`; failures are reported and remembered (fatal only for an
/// explicit --pid that cannot be traced at all).
fn attach(
    tracer: &Rc<RefCell<Tracer>>,
    pid: u32,
    failed: &mut BTreeSet<u32>,
    explicit: bool,
) -> Result<()> {
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
        let warns = tracer.borrow_mut().add(p)?;
        Ok((desc, warns))
    });
    match res {
        Ok((desc, warns)) => {
            let t = tracer.borrow();
            let info = t.targets.get(&pid).map(|t| {
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
            failed.insert(pid);
            Ok(())
        }
    }
}

fn detach(tracer: &Rc<RefCell<Tracer>>, sink: &Rc<RefCell<Sink>>, pid: u32, why: &str) {
    let (t, leftover, abandoned) = tracer.borrow_mut().remove(pid);
    let Some(t) = t else { return };
    let mut s = sink.borrow_mut();
    for r in &leftover {
        let e = Tracer::record_of_gone(&t, r);
        s.elem(&e);
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
