//! viotrace guest agent: traces each I/O from the syscall through the block
//! layer and virtio-blk to its completion, with per-stage latency tables,
//! slow-I/O waterfalls and JSON records.

mod bpf {
    include!(concat!(env!("OUT_DIR"), "/viotrace_guest.skel.rs"));
}
mod probe;
mod raw;
mod sink;

use std::cell::RefCell;
use std::collections::HashSet;
use std::mem::MaybeUninit;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, RingBufferBuilder};
use nix::sys::signal::{SigSet, Signal};

use bpf::{OpenViotraceGuestSkel, ViotraceGuestSkel, ViotraceGuestSkelBuilder};
use probe::{Mode, HOOKS};
use sink::Sink;
use viotrace_shared::transport;

/// Trace guest I/O end to end: syscall → block layer → virtio-blk → completion.
#[derive(Parser, Debug)]
#[command(name = "viotrace-guest", version)]
struct Cli {
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
    /// Attach mode.
    #[arg(long, value_enum, default_value_t = Mode::Auto)]
    mode: Mode,
    /// Create this file once every probe is attached.
    #[arg(long, value_name = "PATH")]
    ready_file: Option<PathBuf>,
    /// Also stream the records to a host agent for the end-to-end join:
    /// `vsock[:CID]:PORT` (host CID 2, default port 5515), `unix:PATH` or `/PATH`.
    /// Reconnects with back-off; records are buffered (bounded) while disconnected.
    #[arg(long, value_name = "ENDPOINT")]
    connect: Option<viotrace_shared::transport::Endpoint>,
}

/// Filters as the BPF side wants them.
#[derive(Default, Debug)]
struct Filters {
    pid: u32,
    tid: u32,
    comm: Option<[u8; 16]>,
    cgroup: u64,
    disk: Option<(i32, i32)>,
}

fn resolve_filters(cli: &Cli) -> Result<Filters> {
    let mut f = Filters {
        pid: cli.pid.unwrap_or(0),
        tid: cli.tid.unwrap_or(0),
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

/// A loaded and attached object.
struct Running<'obj> {
    skel: ViotraceGuestSkel<'obj>,
    _links: Vec<Link>,
    mode: Mode,
    /// Human lines: what cannot be seen and why.
    blind: Vec<String>,
}

fn set_config(
    open: &mut OpenViotraceGuestSkel<'_>,
    f: &Filters,
    emit_at_complete: bool,
    have_driver_complete: bool,
) -> Result<()> {
    let ro = open
        .maps
        .rodata_data
        .as_deref_mut()
        .context("BPF object has no .rodata")?;
    ro.self_pid = std::process::id();
    ro.filter_pid = f.pid;
    ro.filter_tid = f.tid;
    if let Some(c) = f.comm {
        ro.filter_comm_on = 1;
        for (d, s) in ro.filter_comm.iter_mut().zip(c) {
            *d = s as i8;
        }
    }
    ro.filter_cgroup = f.cgroup;
    if let Some((maj, min)) = f.disk {
        ro.filter_disk_on = 1;
        ro.filter_disk_major = maj;
        ro.filter_disk_minor = min;
    }
    ro.emit_at_rq_complete = u8::from(emit_at_complete);
    ro.have_driver_complete = u8::from(have_driver_complete);
    Ok(())
}

/// Opens, configures, loads and attaches the object in `mode`.
fn start<'obj>(
    storage: &'obj mut MaybeUninit<libbpf_rs::OpenObject>,
    mode: Mode,
    f: &Filters,
) -> Result<Running<'obj>> {
    let mut blind = Vec::new();
    let mut enabled: HashSet<&'static str> = HashSet::new();
    let mut vring_interrupt_addr = 0;
    if mode == Mode::Tracepoint {
        for h in HOOKS {
            blind.push(format!(
                "{}: needs fentry or kprobes on {} (tracepoint mode)",
                h.sees, h.target
            ));
        }
    } else {
        let ks = std::fs::File::open("/proc/kallsyms").context("opening /proc/kallsyms")?;
        let wanted: Vec<&str> = HOOKS.iter().map(|h| h.target).collect();
        let syms = probe::find_symbols(std::io::BufReader::new(ks), &wanted);
        if mode == Mode::Kprobe {
            if let Some(s) = syms.get("vring_interrupt").filter(|s| s.addr != 0) {
                vring_interrupt_addr = s.addr;
                enabled.insert("irq_entry");
            }
        }
        for h in HOOKS {
            match probe::unusable(mode, h.target, &syms) {
                None => enabled.extend(if mode == Mode::Fentry {
                    h.fentry
                } else {
                    h.kprobe
                }),
                Some(why) => blind.push(format!("{}: {why}", h.sees)),
            }
        }
    }
    let emit_at_complete =
        !enabled.contains("fx_update_request") && !enabled.contains("kp_update_request");

    let builder = ViotraceGuestSkelBuilder::default();
    let mut open = builder.open(storage).context("opening BPF object")?;
    let have_driver_complete =
        enabled.contains("fe_complete_request") || enabled.contains("kp_complete_request");
    set_config(&mut open, f, emit_at_complete, have_driver_complete)?;
    if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
        ro.vring_interrupt_addr = vring_interrupt_addr;
    }
    for mut p in open.open_object_mut().progs_mut() {
        let name = p.name().to_string_lossy().into_owned();
        if name == "irq_entry"
            || HOOKS
                .iter()
                .any(|h| h.fentry.contains(&name.as_str()) || h.kprobe.contains(&name.as_str()))
        {
            p.set_autoload(enabled.contains(name.as_str()));
        } else if let Some(n) = probe::OPTIONAL_TPS
            .iter()
            .flat_map(|(progs, _)| progs.iter())
            .find(|n| **n == name)
        {
            p.set_autoload(true);
            enabled.insert(n);
        }
    }
    let skel = open
        .load()
        .with_context(|| format!("loading BPF object ({mode} mode)"))?;
    let mut links = Vec::new();
    let mut failed: HashSet<String> = HashSet::new();
    for p in skel.object().progs_mut() {
        let name = p.name().to_string_lossy().into_owned();
        let optional = probe::is_optional(&name);
        if optional && !enabled.contains(name.as_str()) {
            continue;
        }
        match p.attach() {
            Ok(l) => links.push(l),
            Err(e) if optional => {
                if !probe::OPTIONAL_TPS
                    .iter()
                    .any(|(p, _)| p.contains(&name.as_str()))
                {
                    blind.push(format!("program {name}: attach failed: {e}"));
                }
                failed.insert(name.clone());
            }
            Err(e) => return Err(e).with_context(|| format!("attaching {name} ({mode} mode)")),
        }
    }
    for (progs, what) in probe::OPTIONAL_TPS {
        if progs.iter().all(|p| failed.contains(*p)) {
            blind.push(format!("{what}: no such tracepoint"));
        }
    }
    // A hook is blind if any of its programs failed to attach.
    for h in HOOKS {
        let progs = if mode == Mode::Fentry {
            h.fentry
        } else {
            h.kprobe
        };
        if progs.iter().any(|p| failed.contains(*p)) {
            blind.push(format!("{}: {} hook not attached", h.sees, h.target));
        }
    }
    Ok(Running {
        skel,
        _links: links,
        mode,
        blind,
    })
}

/// The modes to try, best first.
fn candidate_modes(m: Mode) -> Vec<Mode> {
    match m {
        Mode::Auto => {
            let mut v = Vec::new();
            if probe::fentry_available() {
                v.push(Mode::Fentry);
            }
            if probe::kprobes_available() {
                v.push(Mode::Kprobe);
            }
            v.push(Mode::Tracepoint);
            v
        }
        m => vec![m],
    }
}

fn read_stats(skel: &ViotraceGuestSkel<'_>) -> Vec<(&'static str, u64)> {
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

/// libbpf's messages go to stderr, except the expected failure of an optional
/// tracepoint that this kernel names differently (reported once, in our words).
fn libbpf_print(level: libbpf_rs::PrintLevel, msg: String) {
    if level == libbpf_rs::PrintLevel::Debug {
        return;
    }
    let optional_tp = probe::OPTIONAL_TPS
        .iter()
        .flat_map(|(progs, _)| progs.iter())
        .any(|p| msg.contains(&format!("prog '{p}': failed to attach")));
    if !optional_tp {
        eprint!("{msg}");
    }
}

fn ensure_tracefs() {
    // Tracepoint attach needs tracefs on some kernels; mounting is best effort.
    if !Path::new("/sys/kernel/tracing/events").exists() {
        let _ = std::process::Command::new("mount")
            .args(["-t", "tracefs", "none", "/sys/kernel/tracing"])
            .status();
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let filters = resolve_filters(&cli)?;

    // Block SIGINT/SIGTERM before any thread exists; one thread waits for them.
    let mut sigs = SigSet::empty();
    sigs.add(Signal::SIGINT);
    sigs.add(Signal::SIGTERM);
    sigs.thread_block().context("blocking signals")?;
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                if sigs.wait().is_ok() {
                    stop.store(true, Ordering::SeqCst);
                }
            })
            .context("spawning signal thread")?;
    }

    libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Warn, libbpf_print)));
    ensure_tracefs();
    let modes = candidate_modes(cli.mode);
    let mut storages: Vec<MaybeUninit<libbpf_rs::OpenObject>> =
        modes.iter().map(|_| MaybeUninit::uninit()).collect();
    let mut running = None;
    let mut errors = Vec::new();
    for (storage, &m) in storages.iter_mut().zip(&modes) {
        let t0 = Instant::now();
        match start(storage, m, &filters) {
            Ok(r) => {
                eprintln!(
                    "viotrace-guest: {} mode, attached in {:.2}s",
                    r.mode,
                    t0.elapsed().as_secs_f64()
                );
                running = Some(r);
                break;
            }
            Err(e) => {
                eprintln!("viotrace-guest: {m} mode unavailable: {e:#}");
                errors.push(format!("{m}: {e:#}"));
            }
        }
    }
    let Some(run) = running else {
        bail!("no attach mode works: {}", errors.join("; "));
    };
    for b in &run.blind {
        eprintln!("viotrace-guest: cannot see {b}");
    }

    let uplink = match &cli.connect {
        Some(ep) => {
            let hello = transport::local_hello(env!("CARGO_PKG_VERSION"), transport::local_cid());
            let sender =
                transport::GuestSender::start(transport::GuestSenderConfig::new(ep.clone(), hello))
                    .with_context(|| format!("starting the uplink to {ep}"))?;
            eprintln!("viotrace-guest: streaming records to {ep}");
            Some(sender)
        }
        None => None,
    };
    let sink = RefCell::new(Sink::new(
        cli.json,
        cli.threshold,
        run.mode.to_string(),
        run.blind.clone(),
        uplink,
    ));
    let mut rb = RingBufferBuilder::new();
    rb.add(&run.skel.maps.events, |data: &[u8]| {
        sink.borrow_mut().handle(data);
        0
    })
    .context("ring buffer")?;
    let rb = rb.build().context("ring buffer")?;

    if let Some(p) = &cli.ready_file {
        std::fs::write(p, format!("{}\n", run.mode))
            .with_context(|| format!("writing ready file {}", p.display()))?;
    }

    let started = Instant::now();
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
            s.interval_table(started.elapsed());
            s.send_counters(&read_stats(&run.skel));
            next_table = now + cli.interval;
        }
        s.flush();
    }
    rb.consume().context("consuming ring buffer")?;
    let mut stats = read_stats(&run.skel);
    let mut s = sink.borrow_mut();
    s.close_uplink(&mut stats);
    s.finish(started.elapsed(), &stats);
    Ok(())
}
