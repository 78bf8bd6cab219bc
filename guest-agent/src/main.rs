//! viotrace guest agent: traces each I/O from the syscall through the block
//! layer and virtio-blk to its completion, with per-stage latency tables,
//! slow-I/O waterfalls and JSON records.

mod bpf {
    include!(concat!(env!("OUT_DIR"), "/viotrace_guest.skel.rs"));
}
mod btf_file;
mod btf_min;
mod embedded;
mod io_hist;
mod kernel;
mod load;
mod plan;
mod probe;
mod raw;
mod sink;

use std::cell::RefCell;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use libbpf_rs::{MapCore, MapFlags, RingBufferBuilder};
use nix::sys::signal::{SigSet, Signal};

use bpf::ViotraceGuestSkel;
use probe::Mode;
use sink::Sink;
use viotrace_shared::transport;

/// Trace guest I/O end to end: syscall → block layer → virtio-blk → completion.
#[derive(Parser, Debug)]
#[command(
    name = "viotrace-guest",
    version,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// Only this process (tgid).
    #[arg(short = 'p', long)]
    pid: Option<u32>,
    /// Only this thread.
    #[arg(long)]
    tid: Option<u32>,
    /// Only tasks with this command name (first 15 bytes).
    #[arg(short = 'c', long)]
    comm: Option<String>,
    /// Only this cgroup (v2 path, absolute or relative to /sys/fs/cgroup).
    #[arg(long, value_name = "PATH")]
    cgroup: Option<PathBuf>,
    /// Only this disk (e.g. vda; a partition selects its disk).
    #[arg(short = 'd', long, value_name = "NAME")]
    disk: Option<String>,
    /// Print a waterfall for each I/O slower than this (e.g. 5ms).
    #[arg(short = 't', long, value_parser = humantime::parse_duration)]
    threshold: Option<Duration>,
    /// Print the per-stage table every interval.
    #[arg(short = 'i', long, value_parser = humantime::parse_duration, default_value = "1s")]
    interval: Duration,
    /// Stop after this long.
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// JSON lines on stdout (records and stats); tables and waterfalls go to stderr.
    #[arg(long)]
    json: bool,
    /// Capture every record (each request and syscall, as `--json` would print
    /// them) to this file in viotrace's compact binary form (`-`: stdout), for
    /// `viotrace-guest decode` to print as JSON lines later, on any machine.
    /// Much cheaper than `--json` for the traced machine.
    #[arg(long, value_name = "FILE")]
    capture: Option<PathBuf>,
    /// Also trap virtqueue_notify, for the exact time of each notification.
    /// Without it, g.kick is when virtqueue_kick_prepare returned true, just
    /// before the driver notifies (one trap less per request).
    #[arg(long)]
    exact_kick: bool,
    /// Leave out these points to trace for less (comma-separated): g.queue_rq,
    /// g.kick, g.irq, g.driver_complete (g.irq goes with it), g.bio_complete;
    /// `lean` is g.kick,g.irq,g.driver_complete,g.bio_complete. Their programs are
    /// not attached and the points are reported blind; the record, its join with
    /// the host and its attribution stay. What each point costs:
    /// docs/PERFORMANCE.md.
    #[arg(long, value_name = "POINTS")]
    skip_points: Option<plan::SkipPoints>,
    /// Attach mode.
    #[arg(long, value_enum, default_value_t = Mode::Auto)]
    mode: Mode,
    /// In fentry mode, trace the I/O syscalls with the raw `sys_enter`/`sys_exit`
    /// tracepoints instead of fentry/fexit on each syscall's wrapper: a program
    /// runs for every syscall, but no trampoline does (see docs/PERFORMANCE.md).
    #[arg(long)]
    syscall_tracepoints: bool,
    /// Create this file once every probe is attached.
    #[arg(long, value_name = "PATH")]
    ready_file: Option<PathBuf>,
    /// Also stream the block request records to a host agent for the end-to-end
    /// join: `vsock[:CID]:PORT` (host CID 2, default port 5515), `unix:PATH` or
    /// `/PATH`. Reconnects with back-off; records are buffered (bounded) while
    /// disconnected. Syscall-level records stay in this agent's own output (the
    /// join does not use them; each request record carries its syscall's entry).
    #[arg(long, value_name = "ENDPOINT")]
    connect: Option<viotrace_shared::transport::Endpoint>,
    /// Before 6.16, where the kernel's BTF file cannot be mapped, libbpf maps a
    /// copy of the part the agent uses while loading; this copies all of it
    /// instead (1–2.5 MB more at the peak), for comparison.
    #[arg(long)]
    full_btf: bool,
    /// Before 6.16 (see `--full-btf`): when modules come while the programs
    /// load over the part of the BTF (a boot's module loads), the part is made
    /// again with them and the load done again, at most this many times; then
    /// over a copy of the whole BTF, as `--full-btf` makes.
    #[arg(long, value_name = "N", default_value_t = 3)]
    btf_remakes: u64,
    /// Print libbpf's debug log on stderr (BTF loading, CO-RE relocations,
    /// attach targets).
    #[arg(long)]
    libbpf_log: bool,
}

/// The names of the kernel types the agent looks up (None: `--full-btf`, or
/// they could not be read, then noted).
fn btf_names(full: bool) -> Option<std::collections::HashSet<String>> {
    if full {
        return None;
    }
    match embedded::btf_names() {
        Ok(mut names) => {
            names.extend(kernel::btf_names());
            Some(names)
        }
        Err(e) => {
            eprintln!("viotrace-guest: note: the whole BTF is copied: {e}");
            None
        }
    }
}

fn note_btf_copy(copy: &btf_file::BtfCopy) {
    match copy {
        btf_file::BtfCopy::Minimized(s) => eprintln!(
            "viotrace-guest: note: libbpf mapped the part of the kernel's BTF the agent uses: \
             {} of {} types whole, {} hollow; {} of {} KiB",
            s.whole,
            s.types,
            s.hollow,
            s.bytes_out / 1024,
            s.bytes_in / 1024
        ),
        btf_file::BtfCopy::Whole(Some(why)) => eprintln!(
            "viotrace-guest: note: libbpf mapped a copy of the kernel's whole BTF ({why})"
        ),
        btf_file::BtfCopy::Whole(None) => {}
    }
}

/// Loads and attaches the programs while `btf` is bound over the kernel's BTF,
/// then unbinds it. If a module came while they loaded, its BTF was read over a
/// part made without it, which libbpf refuses where the module refers to a type
/// the part left out (and with it the CO-RE relocations: fentry and kprobe mode
/// fail). The part is made again with every module there is now, and the load
/// done again, up to `remakes` times; then (or sooner, when the names to keep
/// cannot be read) over a copy of the whole BTF, which no module outdates; if
/// that cannot be made either, over the kernel's own file.
/// Returns the programs and the number of loads done again.
fn load_over_btf(
    modes: &[probe::Mode],
    facts: &kernel::Facts,
    filters: &Filters,
    btf: btf_file::Outcome,
    remakes: u64,
) -> Result<(load::Running, u64)> {
    let (mut guard, mut copy) = match btf {
        btf_file::Outcome::Bound(guard, copy) => (guard, copy),
        btf_file::Outcome::Skipped(why) => {
            eprintln!("viotrace-guest: note: libbpf copies the kernel's BTF while loading ({why})");
            return Ok((load::start_any(modes, facts, filters)?, 0));
        }
        btf_file::Outcome::NotNeeded => return Ok((load::start_any(modes, facts, filters)?, 0)),
    };
    let mut again = 0;
    // (the loads done in vain count in the start-up's load time)
    let mut in_vain = Duration::ZERO;
    let counted = |r: Result<load::Running>, t: Duration| {
        r.map(|mut r| {
            r.startup.load += t;
            r
        })
    };
    loop {
        let t0 = Instant::now();
        // (a failed load too may be the module's doing)
        let run = load::start_any(modes, facts, filters);
        let added = guard.modules_added();
        if added.is_empty() {
            drop(guard);
            note_btf_copy(&copy);
            return Ok((counted(run, in_vain)?, again));
        }
        drop(run);
        in_vain += t0.elapsed();
        again += 1;
        let (want, why) = remake_from(again, remakes, || btf_names(false));
        let remade = guard.remake(want.as_ref()).map(|c| match c {
            btf_file::BtfCopy::Whole(None) => btf_file::BtfCopy::Whole(Some(why)),
            c => c,
        });
        eprintln!(
            "viotrace-guest: note: module(s) {} loaded while the programs loaded: loading \
             again over {}",
            added.join(", "),
            match &remade {
                Ok(btf_file::BtfCopy::Minimized(_)) => "a part of the BTF made with them".into(),
                Ok(btf_file::BtfCopy::Whole(why)) => {
                    format!("a copy of the whole BTF ({})", why.as_deref().unwrap_or(""))
                }
                Err(e) => format!("the kernel's own BTF ({e})"),
            }
        );
        match remade {
            Ok(c) => copy = c,
            Err(_) => {
                // Unbound: libbpf reads the kernel's own file (and copies it).
                drop(guard);
                return Ok((
                    counted(load::start_any(modes, facts, filters), in_vain)?,
                    again,
                ));
            }
        }
    }
}

/// What the BTF is made again from after `again` loads in vain: the names to
/// keep (a part), or none (a whole copy) with the reason: past `remakes`, or
/// when the names cannot be read (a whole copy then, as after the last remake,
/// rather than the kernel's own file).
fn remake_from(
    again: u64,
    remakes: u64,
    names: impl FnOnce() -> Option<std::collections::HashSet<String>>,
) -> (Option<std::collections::HashSet<String>>, String) {
    if again > remakes {
        return (
            None,
            format!("the part made again {remakes} times already, --btf-remakes"),
        );
    }
    match names() {
        Some(w) => (Some(w), String::new()),
        None => (
            None,
            "the names the agent needs could not be read".to_string(),
        ),
    }
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Print a capture file (`--capture`) as the JSON lines `--json` prints:
    /// every record, then the final stats line. Fails, after the records it
    /// could read, on a damaged capture or one that did not finish.
    Decode {
        /// The capture file (`-`: stdin).
        file: PathBuf,
    },
}

/// `viotrace-guest decode FILE`.
fn decode(file: &Path) -> Result<()> {
    use std::io::Write;
    let input: Box<dyn std::io::Read> = if file == Path::new("-") {
        Box::new(std::io::stdin().lock())
    } else {
        Box::new(std::fs::File::open(file).with_context(|| format!("opening {}", file.display()))?)
    };
    let input = std::io::BufReader::with_capacity(256 * 1024, input);
    let mut rd = viotrace_shared::capture::CaptureReader::new(input)
        .with_context(|| format!("{}", file.display()))?;
    let mut out = std::io::BufWriter::with_capacity(256 * 1024, std::io::stdout().lock());
    let r = viotrace_shared::capture::render_json(&mut rd, &mut out);
    out.flush().context("writing stdout")?;
    r.with_context(|| format!("{}: after {} records", file.display(), rd.records()))?;
    Ok(())
}

/// The capture writer of `--capture PATH`, and whether it is stdout.
/// A capture file's writer, and whether it writes to stdout.
type Capture = (
    viotrace_shared::capture::CaptureWriter<Box<dyn std::io::Write>>,
    bool,
);

fn open_capture(path: &Path, json: bool) -> Result<Capture> {
    let on_stdout = path == Path::new("-");
    let out: Box<dyn std::io::Write> = if on_stdout {
        if json {
            bail!("--capture - and --json both want stdout");
        }
        Box::new(std::io::stdout())
    } else {
        Box::new(
            std::fs::File::create(path)
                .with_context(|| format!("creating the capture file {}", path.display()))?,
        )
    };
    let hello = transport::local_hello(env!("CARGO_PKG_VERSION"), transport::local_cid());
    let w = viotrace_shared::capture::CaptureWriter::new(out, &hello)
        .with_context(|| format!("starting the capture {}", path.display()))?;
    Ok((w, on_stdout))
}

/// Filters as the BPF side wants them.
#[derive(Default, Debug)]
pub(crate) struct Filters {
    pid: u32,
    tid: u32,
    comm: Option<[u8; 16]>,
    cgroup: u64,
    disk: Option<(i32, i32)>,
    /// Account traced syscalls' off-CPU time (for the verdicts, `-t`).
    off_cpu: bool,
    /// Trap virtqueue_notify too (`--exact-kick`).
    exact_kick: bool,
    /// The raw syscall tracepoints even in fentry mode (`--syscall-tracepoints`).
    sys_tracepoints: bool,
    /// Syscalls faster than this send no record, only their latency (0: all send one).
    io_detail_ns: u64,
    /// Points whose programs are left out (`--skip-points`).
    skip_points: Vec<viotrace_shared::record::Point>,
}

fn resolve_filters(cli: &Cli) -> Result<Filters> {
    let mut f = Filters {
        pid: cli.pid.unwrap_or(0),
        tid: cli.tid.unwrap_or(0),
        off_cpu: cli.threshold.is_some(),
        exact_kick: cli.exact_kick,
        sys_tracepoints: cli.syscall_tracepoints,
        skip_points: cli.skip_points.clone().map(|s| s.0).unwrap_or_default(),
        // Always-on (no --json, --capture or -t): the syscall table needs only
        // each syscall's latency, and the kernel counts it (io_hist). JSON
        // lines, the capture and the verdicts of -t (their baselines) need
        // every record.
        io_detail_ns: if cli.json || cli.capture.is_some() || cli.threshold.is_some() {
            0
        } else {
            u64::MAX
        },
        ..Default::default()
    };
    if let Some(c) = &cli.comm {
        if c.is_empty() {
            bail!("--comm must not be empty");
        }
        let mut b = [0u8; 16];
        let n = c.len().min(15);
        b[..n].copy_from_slice(&c.as_bytes()[..n]);
        f.comm = Some(b);
    }
    if let Some(p) = &cli.cgroup {
        let full = if p.is_absolute() {
            p.clone()
        } else {
            Path::new("/sys/fs/cgroup").join(p)
        };
        let md = std::fs::metadata(&full)
            .with_context(|| format!("cgroup {}: cannot stat", full.display()))?;
        if !md.is_dir() {
            bail!("cgroup {} is not a directory", full.display());
        }
        f.cgroup = md.ino();
    }
    if let Some(d) = &cli.disk {
        f.disk = Some(disk_dev(d)?);
    }
    Ok(f)
}

/// (major, first_minor) of the whole disk named `name` (a partition maps to its disk).
fn disk_dev(name: &str) -> Result<(i32, i32)> {
    if name.is_empty() || name.contains('/') {
        bail!("invalid disk name {name:?}");
    }
    let sys = Path::new("/sys/class/block").join(name);
    let real = std::fs::canonicalize(&sys)
        .with_context(|| format!("disk {name}: no {}", sys.display()))?;
    let disk_dir = if real.join("partition").exists() {
        real.parent()
            .map(Path::to_path_buf)
            .context("partition without parent disk")?
    } else {
        real
    };
    let dev = std::fs::read_to_string(disk_dir.join("dev"))
        .with_context(|| format!("disk {name}: reading dev"))?;
    let (a, b) = dev
        .trim()
        .split_once(':')
        .with_context(|| format!("disk {name}: bad dev {dev:?}"))?;
    Ok((a.parse()?, b.parse()?))
}

/// The BPF counters, plus what the kernel skipped when it can tell: kprobe hits
/// (`kprobe_hits_lost`) and recursive program runs (`bpf_runs_lost`).
fn read_stats(run: &load::Running) -> Vec<(&'static str, u64)> {
    let mut v = bpf_stats(&run.skel);
    if let Some(n) = run.kprobe_missed() {
        v.push(("kprobe_hits_lost", n));
    }
    if let Some(n) = run.bpf_runs_missed() {
        v.push(("bpf_runs_lost", n));
    }
    v
}

/// The syscalls the kernel summarized since the last call, into the sink's
/// syscall table.
fn take_io_hist(run: &load::Running, h: &mut io_hist::IoHist, sink: &mut Sink) {
    let maps = &run.skel.maps;
    let (Some(bss), Some(ro)) = (maps.bss_data.as_deref(), maps.rodata_data) else {
        return;
    };
    let rows = io_hist::Rows {
        nrs: &ro.io_row_nrs,
        rows: &bss.io_rows,
        counts: &bss.io_row_counts,
        hashed: bss.io_hashed,
    };
    for (nr, g) in h.take(&rows, &maps.io_hist, &maps.io_sum) {
        sink.syscall_summary(nr, &g);
    }
}

fn bpf_stats(skel: &ViotraceGuestSkel<'_>) -> Vec<(&'static str, u64)> {
    raw::STAT_NAMES
        .iter()
        .enumerate()
        .map(|(i, &name)| {
            let key = (i as u32).to_ne_bytes();
            let v = skel
                .maps
                .stats
                .lookup_percpu(&key, MapFlags::ANY)
                .ok()
                .flatten()
                .map(|cpus| {
                    cpus.iter()
                        .filter_map(|b| b.get(..8).and_then(|s| s.try_into().ok()))
                        .map(u64::from_ne_bytes)
                        .sum()
                })
                .unwrap_or(0);
            (name, v)
        })
        .collect()
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(Cmd::Decode { file }) = &cli.cmd {
        return decode(file);
    }
    let filters = resolve_filters(&cli)?;
    let capture = cli
        .capture
        .as_deref()
        .map(|p| open_capture(p, cli.json))
        .transpose()?;

    transport::one_heap_arena();
    if let Err(e) = transport::no_huge_pages() {
        eprintln!("viotrace-guest: note: transparent huge pages stay on for the agent: {e}");
    }
    // (before the agent has a mount namespace of its own: mounted for everyone)
    kernel::ensure_tracefs();
    // While the BPF programs load, libbpf maps the kernel's BTF (the part the
    // agent uses) instead of copying it twice (this needs the process still
    // single-threaded).
    let want = btf_names(cli.full_btf);
    let btf_copy = btf_file::mappable_vmlinux_btf(want.as_ref());
    drop(want);
    let stop = wait_for_signals()?;
    let (run, btf_reloads, blind_points) = load_and_report(&cli, &filters, btf_copy)?;
    let uplink = start_uplink(&cli)?;
    trace(
        &cli,
        &run,
        blind_points,
        uplink,
        capture,
        &stop,
        btf_reloads,
    )
}

/// Blocks SIGINT and SIGTERM before any other thread exists; one thread
/// waits for them and sets the returned flag.
fn wait_for_signals() -> Result<Arc<AtomicBool>> {
    let mut sigs = SigSet::empty();
    sigs.add(Signal::SIGINT);
    sigs.add(Signal::SIGTERM);
    sigs.thread_block().context("blocking signals")?;
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if sigs.wait().is_ok() {
                flag.store(true, Ordering::SeqCst);
            }
        })
        .context("spawning signal thread")?;
    Ok(stop)
}

/// Loads and attaches the BPF object (over `btf_copy`, remade if need be) and
/// says what the chosen mode cannot see; also returns the BTF remakes taken
/// and the points the mode is blind to.
fn load_and_report(
    cli: &Cli,
    filters: &Filters,
    btf_copy: btf_file::Outcome,
) -> Result<(load::Running, u64, Vec<&'static str>)> {
    let level = if cli.libbpf_log {
        load::LIBBPF_DEBUG.store(true, Ordering::Relaxed);
        libbpf_rs::PrintLevel::Debug
    } else {
        libbpf_rs::PrintLevel::Warn
    };
    libbpf_rs::set_print(Some((level, load::libbpf_print)));
    let facts = kernel::Facts::gather()?;
    let (run, btf_reloads) = load_over_btf(
        &load::candidate_modes(cli.mode, &facts),
        &facts,
        filters,
        btf_copy,
        cli.btf_remakes,
    )?;
    for n in &run.report.notes {
        eprintln!("viotrace-guest: note: {n}");
    }
    for b in &run.report.blind {
        eprintln!("viotrace-guest: cannot see {b}");
    }
    let blind: Vec<&'static str> = run.report.blind_points.iter().map(|p| p.name()).collect();
    eprintln!(
        "viotrace-guest: {} mode blind points: {}",
        run.mode,
        if blind.is_empty() {
            "none".to_string()
        } else {
            blind.join(" ")
        }
    );
    Ok((run, btf_reloads, blind))
}

/// The uplink to the host agent (`--connect`), started.
fn start_uplink(cli: &Cli) -> Result<Option<transport::GuestSender>> {
    let Some(ep) = &cli.connect else {
        return Ok(None);
    };
    let hello = transport::local_hello(env!("CARGO_PKG_VERSION"), transport::local_cid());
    let sender =
        transport::GuestSender::start(transport::GuestSenderConfig::new(ep.clone(), hello))
            .with_context(|| format!("starting the uplink to {ep}"))?;
    eprintln!("viotrace-guest: streaming records to {ep}");
    Ok(Some(sender))
}

/// Traces until a signal or `--duration`: the ring buffer's records into the
/// sink, its tables every interval; then the final statistics.
fn trace(
    cli: &Cli,
    run: &load::Running,
    blind_points: Vec<&'static str>,
    uplink: Option<transport::GuestSender>,
    capture: Option<Capture>,
    stop: &AtomicBool,
    btf_reloads: u64,
) -> Result<()> {
    let sink = RefCell::new(Sink::new(
        cli.json,
        cli.threshold,
        run.mode.to_string(),
        run.report.blind.clone(),
        blind_points,
        uplink,
    ));
    sink.borrow_mut().set_off_cpu(run.off_cpu);
    if let Some((w, on_stdout)) = capture {
        sink.borrow_mut().set_capture(w, on_stdout);
    }
    let mut decoder = raw::Decoder::new();
    decoder.off_cpu = run.off_cpu;
    // (the capture and the uplink take request records as the ring buffer
    // holds them)
    decoder.tables_only = !cli.json && cli.threshold.is_none();
    let mut rb = RingBufferBuilder::new();
    rb.add(&run.skel.maps.events, |data: &[u8]| {
        match decoder.decode(data) {
            Ok(rec) => sink.borrow_mut().handle(rec, data),
            Err(e) => sink.borrow_mut().bad_record(&e),
        }
        0
    })
    .context("ring buffer")?;
    let rb = rb.build().context("ring buffer")?;

    if let Some(p) = &cli.ready_file {
        std::fs::write(p, format!("{}\n", run.mode))
            .with_context(|| format!("writing ready file {}", p.display()))?;
    }

    let mut hist = io_hist::IoHist::default();
    let started = Instant::now();
    let cost = viotrace_shared::selfcost::SelfCost::start(run.bpf_runs());
    let mut next_table = started + cli.interval;
    while !stop.load(Ordering::SeqCst) {
        if cli.duration.is_some_and(|d| started.elapsed() >= d) {
            break;
        }
        rb.poll(Duration::from_millis(100))
            .context("polling ring buffer")?;
        rb.consume().context("consuming ring buffer")?;
        let now = Instant::now();
        let mut s = sink.borrow_mut();
        if now >= next_table {
            let stats = read_stats(run);
            take_io_hist(run, &mut hist, &mut s);
            s.interval_table(started.elapsed());
            s.send_counters(&stats);
            next_table = now + cli.interval;
        }
        s.flush();
    }
    rb.consume().context("consuming ring buffer")?;
    let mut s = sink.borrow_mut();
    finish(run, &mut s, &mut hist, cost, started, btf_reloads)
}

/// The end of a run: what the kernel skipped, the last syscall summaries, the
/// uplink and the capture closed, and the final statistics line.
fn finish(
    run: &load::Running,
    s: &mut Sink,
    hist: &mut io_hist::IoHist,
    cost: viotrace_shared::selfcost::SelfCost,
    started: Instant,
    btf_reloads: u64,
) -> Result<()> {
    for (p, n) in run.bpf_runs_missed_by_program().unwrap_or_default() {
        if n > 0 {
            eprintln!("viotrace-guest: the kernel skipped {n} runs of program {p} (recursion)");
        }
    }
    let mut stats = read_stats(run);
    take_io_hist(run, hist, s);
    stats.push(("io_hist_reread", hist.batch_short));
    stats.extend(s.verdict_counters());
    s.close_uplink(&mut stats);
    s.close_capture(&mut stats);
    let cost = cost.report(Some(run.bpf_runs()), s.rqs);
    stats.extend(cost.counters());
    let startup = run.startup.load + run.startup.attach;
    stats.push(("startup_btf_reloads", btf_reloads));
    stats.push((
        "startup_ms",
        startup.as_millis().min(u128::from(u64::MAX)) as u64,
    ));
    if let Some(n) = run.startup.verified_insns {
        stats.push(("startup_verified_insns", n));
    }
    let r = s.finish(started.elapsed(), &stats);
    s.say(&format!("viotrace-guest: {}\n", cost.line("request")));
    r
}

#[cfg(test)]
mod tests {
    use super::remake_from;

    #[test]
    fn a_remake_keeps_the_names_or_says_why_it_copies_the_whole() {
        let names = || Some(["task_struct".to_string()].into_iter().collect());
        // Within --btf-remakes: a part with the names the agent reads.
        let (want, why) = remake_from(2, 3, names);
        assert!(want.is_some_and(|w| w.contains("task_struct")) && why.is_empty());
        // Names that cannot be read: a whole copy, and the reason.
        let (want, why) = remake_from(1, 3, || None);
        assert!(want.is_none() && why.contains("could not be read"), "{why}");
        // Past --btf-remakes: a whole copy without reading the names again.
        let (want, why) = remake_from(4, 3, || panic!("names read past the remakes"));
        assert!(want.is_none() && why.contains("--btf-remakes"), "{why}");
    }
}
