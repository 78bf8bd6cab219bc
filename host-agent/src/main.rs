//! viotrace host agent: traces every virtio-blk virtqueue element of QEMU
//! processes (stock binaries, exported symbols only) through QEMU and the host
//! kernel, one record per element.

mod bpf {
    #![allow(unused_imports, clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/viotrace_host.skel.rs"));
}
mod app;
mod fleet;
mod interfere;
mod joined;
mod qemu;
mod sink;
mod tracer;

use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use libbpf_rs::RingBuffer;
use nix::errno::Errno;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use crate::app::App;

/// Trace virtio-blk requests inside QEMU and the host kernel.
#[derive(Parser, Debug)]
#[command(name = "viotrace-host", version)]
pub(crate) struct Cli {
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
    /// scatter list), on QEMU's I/O thread: two uprobe hits per pop (entry and
    /// return), the empty pop that ends each batch included, and one per batch
    /// in virtio_blk_handle_vq; five more per request at queue depth 1. With
    /// QEMU's USDT probe: one per element popped and one per batch.
    #[arg(long)]
    pop: bool,
    /// Also probe blk_aio_* for the exact h.submit (the backend submit of a
    /// possibly merged request) instead of QEMU's block accounting start: one
    /// more uprobe hit per request.
    #[arg(long)]
    submit: bool,
    /// Also probe virtio_notify for h.irq where QEMU 8.2+ raises a queue's interrupt
    /// without an eventfd (queues served by the main loop, not an iothread): one
    /// more uprobe hit per request. Without it h.irq comes only from the guest
    /// notifier eventfd, a kernel tracepoint.
    #[arg(long)]
    irq: bool,
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
    /// Joined mode: write the end-to-end records (`"kind":"io"`) here instead of stdout:
    /// every one with --json (capture), else the slow (-t) and sampled ones.
    #[arg(long, value_name = "FILE")]
    joined_out: Option<PathBuf>,
    /// Joined mode: write a Chrome trace-event file (Perfetto) of the joined requests it
    /// writes (streamed as the run goes).
    #[arg(long, value_name = "FILE")]
    chrome_trace: Option<PathBuf>,
    /// Joined mode: most joined records written per second per VM (0: no limit); the
    /// rest still count in the statistics and are reported as output_rate_limited.
    #[arg(long, value_name = "N", default_value_t = 50_000.0)]
    max_vm_rate: f64,
    /// Joined mode: bytes read per second from each VM's guest agents (e.g. 512KiB,
    /// 24MiB, about 120 000 request records a second at about 200 bytes each); beyond it the VM's sockets are not read (reported as throttled_ms)
    /// and its guest agent buffers or counts what it cannot send.
    #[arg(long, value_name = "BYTES", default_value = "24MiB")]
    vm_read_rate: bytesize::ByteSize,
    /// Joined mode without --json (always-on): besides the records at or above
    /// -t, write one joined record in N per VM (0: none). With --json every
    /// record is written (capture).
    #[arg(long, value_name = "N", default_value_t = 1000)]
    sample_every: u64,
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

fn main() {
    if let Err(e) = run() {
        eprintln!("viotrace-host: error: {e:#}");
        std::process::exit(1);
    }
}

/// The longest the main loop sleeps. It wakes earlier for a signal, when BPF
/// finds the ring buffer a quarter full, and when the network thread finds a
/// VM's records waiting at half its budget. Every wakeup has a price beyond
/// its work (the caches and TLB are cold after a sleep: on a nested
/// hypervisor ~1 µs per page touched), so it is not a wakeup per record nor a
/// fixed fast tick.
const POLL_EVERY: Duration = Duration::from_secs(1);

/// One epoll set over the ring buffer's own epoll (its rings), the signalfd
/// and the inbox's wake; libbpf's poll is not used (it would sleep on its
/// rings alone). What woke the loop is not read: every pass does all its work.
fn poll_set(rb: &RingBuffer, sigfd: &SignalFd, app: &App) -> Result<Epoll> {
    let ep = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).context("creating an epoll")?;
    // SAFETY: the ring buffer's epoll fd is open for as long as `rb` lives,
    // which outlives every wait on this set (run's loop; the set is dropped
    // before `rb`).
    let rb_fd = unsafe { BorrowedFd::borrow_raw(rb.epoll_fd()) };
    ep.add(rb_fd, EpollEvent::new(EpollFlags::EPOLLIN, 0))
        .context("polling the ring buffer")?;
    ep.add(sigfd, EpollEvent::new(EpollFlags::EPOLLIN, 0))
        .context("polling the signalfd")?;
    if let Some(fd) = app.inbox_wake_fd() {
        ep.add(fd, EpollEvent::new(EpollFlags::EPOLLIN, 0))
            .context("polling the inbox wake")?;
    }
    Ok(ep)
}

/// Signals first, then the ring buffer, then the app's periodic work, each
/// pass; a pass starts when something is ready or `POLL_EVERY` has passed.
fn run() -> Result<()> {
    viotrace_shared::transport::one_heap_arena();
    if let Err(e) = viotrace_shared::transport::no_huge_pages() {
        eprintln!("viotrace-host: note: transparent huge pages stay on for the agent: {e}");
    }
    let cli = Cli::parse();
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGINT);
    mask.add(Signal::SIGTERM);
    mask.thread_block().context("blocking SIGINT/SIGTERM")?;
    let sigfd = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .context("creating a signalfd")?;
    let ready_file = cli.ready_file.clone();

    let mut storage = MaybeUninit::uninit();
    let mut app = App::new(cli, &mut storage)?;
    let (events, waits) = app.ring_maps()?;
    let rb = app.ring_buffer(&events, &waits)?;
    app.attach_initial()?;
    app.start_joined()?;
    let ep = poll_set(&rb, &sigfd, &app)?;
    if let Some(f) = &ready_file {
        std::fs::write(f, b"ready\n").with_context(|| format!("writing {}", f.display()))?;
    }

    let mut ready = [EpollEvent::empty(); 4];
    let mut warned = false;
    let why = loop {
        let timeout = EpollTimeout::try_from(POLL_EVERY).expect("1 s fits");
        if let Err(e) = ep.wait(&mut ready, timeout) {
            // EINTR is harmless; anything else is reported once.
            if e != Errno::EINTR && !std::mem::replace(&mut warned, true) {
                eprintln!("viotrace-host: warning: poll: {e}");
            }
        }
        if let Ok(Some(si)) = sigfd.read_signal() {
            break if si.ssi_signo == Signal::SIGTERM as u32 {
                "SIGTERM"
            } else {
                "SIGINT"
            };
        }
        app.drain(&rb);
        let now = Instant::now();
        if app.done(now) {
            break "duration elapsed";
        }
        app.tick(&rb, now)?;
    };
    drop(ep);
    app.finish(&rb, why)
}
