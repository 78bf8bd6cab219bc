//! Joined mode: serve guest agents over vsock / hybrid-vsock Unix sockets, keep each
//! VM's guest→host clock mapping, and join guest requests with this agent's virtqueue
//! elements into one end-to-end record per I/O.

mod outputs;

use std::collections::HashMap;

use rustc_hash::FxHashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use viotrace_shared::cause::Verdicts;
use viotrace_shared::chrome::{ChromeTrace, MAX_LANES};
use viotrace_shared::clock::monotonic_ns;
use viotrace_shared::join::{JoinConfig, JoinEngine, JoinStats};
use viotrace_shared::jsonl::JsonLines;
use viotrace_shared::proto::{BatchReader, GuestRecordRef};
use viotrace_shared::record::HostElem;
use viotrace_shared::stats::{Aggregator, PairLabel};
use viotrace_shared::transport::host::{
    self, ClockSample, EventKind, Inbox, Listen, Origin, Server, VmAccount,
};

use crate::interfere::Interfere;
pub use outputs::Outputs;

/// Time the main loop spends on guest events per pass (the BPF ring buffer and
/// signals come first, whatever the guests send).
const INBOX_BUDGET: Duration = Duration::from_millis(20);

/// What joined mode listens on and writes.
#[derive(Clone, Debug, Default)]
pub struct JoinOpts {
    /// Unix sockets (hybrid vsock), each with the VM it belongs to (None: the only traced VM).
    pub unix: Vec<(Option<String>, PathBuf)>,
    /// AF_VSOCK port (any CID).
    pub vsock_port: Option<u32>,
    /// Where joined records go (None: stdout with the other records).
    pub out: Option<PathBuf>,
    /// Chrome trace-event file written at exit.
    pub chrome: Option<PathBuf>,
    pub threshold_ns: Option<u64>,
    /// VM label for each guest CID (from QEMU command lines).
    pub vm_for_cid: HashMap<u32, String>,
    /// Joined records written per second per VM, at most (a flooding guest
    /// must not fill the host's disk); the rest are counted.
    pub max_vm_rate: f64,
    /// Bytes read per second from one VM's guest agents.
    pub vm_read_rate: f64,
    /// Capture mode (`--json`): every joined record is written. Always-on: only
    /// those at or above the threshold and one in `sample_every` (0: none); every
    /// record still counts in the statistics.
    pub capture: bool,
    pub sample_every: u64,
}

/// Per-connection bookkeeping.
struct Conn {
    vm: String,
    origin: Origin,
    records: u64,
    /// A record of this connection did not decode (said once per connection).
    told_malformed: bool,
    guest_counters: Vec<(String, u64)>,
}

/// One VM's transport accounting and what this agent did with its records.
#[derive(Debug, serde::Serialize)]
pub struct VmReport {
    #[serde(flatten)]
    pub transport: VmAccount,
    /// `produced == before_this_host + delivered + lost_in_transit + in_flight`.
    pub balanced: bool,
    /// Joined-mode records written to the outputs.
    pub written: u64,
    /// Records not written because the VM exceeded its output rate.
    pub output_rate_limited: u64,
    /// Always-on mode: records neither slow nor sampled, in the statistics only.
    pub summarized: u64,
    /// Syscall-level records received (they stay in the guest's own output).
    pub syscall_records: u64,
    /// Delivered records whose contents did not decode: dropped, counted here.
    pub malformed: u64,
}

/// How long a VM's guest records may be awaited after its connection was lost
/// (the guest reconnects and resends); then its host records expire as usual.
const STALL_GRACE: Duration = Duration::from_secs(30);
/// At stop, how long guest records are waited for while they still match host records.
const STOP_GRACE_MAX: Duration = Duration::from_millis(1200);
/// At stop, how long without a newly matched host record ends the wait.
const STOP_GRACE_IDLE: Duration = Duration::from_millis(400);

/// The joined-mode state, driven from the agent's main loop.
pub struct Joined {
    rt: host::NetRuntime,
    server: Option<Server>,
    inbox: Inbox,
    accounts: host::AccountsHandle,
    engine: JoinEngine,
    /// Decodes the guests' batches one record at a time, in place.
    reader: BatchReader,
    /// Where the join's records go, as it emits them.
    pub out: Outputs,
    pub total: Aggregator,
    conns: FxHashMap<u64, Conn>,
}

impl Joined {
    /// Binds every listener and starts serving guests.
    pub fn start(opts: &JoinOpts) -> Result<Joined> {
        if opts.unix.is_empty() && opts.vsock_port.is_none() {
            bail!("joined mode needs --listen-uds or --listen-vsock");
        }
        let mut listens = Vec::new();
        for (vm, path) in &opts.unix {
            let vm = vm.clone().context(
                "say which VM a Unix socket belongs to (--listen-uds VM=PATH) \
                 when not exactly one VM is traced",
            )?;
            listens.push(Listen::Unix {
                path: path.clone(),
                vm,
            });
        }
        if let Some(port) = opts.vsock_port {
            listens.push(Listen::Vsock { port });
        }
        if opts.vm_read_rate < 1024.0 {
            bail!("--vm-read-rate must be at least 1KiB (every frame is charged at least 1 KiB)");
        }
        let mut cfg = host::HostConfig {
            listens,
            vm_for_cid: opts.vm_for_cid.clone(),
            ..host::HostConfig::default()
        };
        cfg.budget.bytes_per_sec = opts.vm_read_rate;
        let max_vm_rate = if opts.max_vm_rate > 0.0 {
            opts.max_vm_rate
        } else {
            f64::INFINITY
        };
        let rt = host::NetRuntime::start("viotrace-net").context("start the network runtime")?;
        let (server, inbox) = rt
            .block_on(host::serve(cfg))
            .context("listen for guest agents")?;
        let accounts = server.accounts_handle();
        let out: Box<dyn Write> = match &opts.out {
            Some(p) => Box::new(BufWriter::new(
                File::create(p).with_context(|| format!("create {}", p.display()))?,
            )),
            None => Box::new(BufWriter::new(std::io::stdout())),
        };
        Ok(Joined {
            rt,
            server: Some(server),
            inbox,
            accounts,
            engine: JoinEngine::new(JoinConfig::default()),
            reader: BatchReader::new(),
            out: Outputs {
                vms: Vec::new(),
                vm_index: FxHashMap::default(),
                last_vm: 0,
                max_vm_rate,
                capture: opts.capture,
                sample_every: opts.sample_every,
                file: JsonLines::new(out),
                built: Vec::with_capacity(1),
                interval: Aggregator::new(),
                label: PairLabel::default(),
                threshold_ns: opts.threshold_ns,
                chrome: match &opts.chrome {
                    Some(p) => {
                        let f =
                            File::create(p).with_context(|| format!("create {}", p.display()))?;
                        let c = ChromeTrace::new(BufWriter::new(f))
                            .with_context(|| format!("write {}", p.display()))?;
                        Some((p.clone(), c, None))
                    }
                    None => None,
                },
                records: 0,
                human: Vec::new(),
                metrics: None,
                clock_uncertainty: FxHashMap::default(),
                otlp: None,
                verdicts: opts.threshold_ns.map(Verdicts::new),
                interfere: Interfere::default(),
            },
            total: Aggregator::new(),
            conns: FxHashMap::default(),
        })
    }

    /// Feeds one of this agent's host elements.
    pub fn host_elem(&mut self, e: &HostElem) {
        self.engine.push_host_ref(e, &mut self.out);
    }

    /// Readable when the network thread wants the inbox taken early.
    pub fn wake_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.inbox.wake_fd()
    }

    /// Handles what the guests sent (within [`INBOX_BUDGET`]), advances the join's
    /// clocks and timeouts, and writes what is ready. Returns human-readable
    /// notices and waterfalls.
    pub fn poll(&mut self) -> Vec<String> {
        self.take_events(INBOX_BUDGET);
        let now = Instant::now();
        for (vm, o) in &mut self.out.vms {
            if o.stalled_since.is_some_and(|t| now - t > STALL_GRACE) {
                o.stalled_since = None;
                self.engine.set_guest_live(vm);
            }
        }
        self.engine.advance(monotonic_ns(), &mut self.out);
        let _ = self.out.file.flush();
        std::mem::take(&mut self.out.human)
    }

    fn take_events(&mut self, budget: Duration) -> usize {
        let mut evs = Vec::new();
        let n = self.inbox.drain(budget, |e| evs.push(e));
        for ev in evs {
            self.event(ev);
        }
        n
    }

    /// Guest records and clock samples go to the join; a new boot id (shown in
    /// the connection notice) resets that VM's clock mapping there.
    fn event(&mut self, ev: host::Event) {
        let vm = ev.vm;
        match ev.kind {
            EventKind::Records { batch, permit } => {
                let conn = self.conns.get_mut(&ev.conn);
                let (engine, out) = (&mut self.engine, &mut self.out);
                let mut bad = None;
                self.reader.read(&batch, |r| match r {
                    Ok(GuestRecordRef::Rq(rq)) => engine.push_guest_ref(&vm, rq, out),
                    Ok(GuestRecordRef::Io(_)) => out.vm_out(&vm).io_records += 1,
                    Err(e) => {
                        out.vm_out(&vm).malformed += 1;
                        bad.get_or_insert(e);
                    }
                });
                if let Some(c) = conn {
                    c.records += batch.len() as u64;
                    if let Some(e) = bad.filter(|_| !c.told_malformed) {
                        c.told_malformed = true;
                        self.out.human.push(format!(
                            "viotrace-host: vm {vm}: a record from {} did not decode (dropped and counted as malformed; not said again for this connection): {e}\n",
                            c.origin
                        ));
                    }
                }
                // The VM's pending-record budget is released only now.
                drop(permit);
            }
            EventKind::Clock(ClockSample::GuestInitiated { t1, t2, t3, t4 }) => {
                if let Err(e) = self.engine.clock(&vm).add_guest_probe(t1, t2, t3, t4) {
                    log_debug(&vm, &e);
                }
            }
            EventKind::Clock(ClockSample::HostInitiated { h1, g2, g3, h4 }) => {
                if let Err(e) = self.engine.clock(&vm).add_host_probe(h1, g2, g3, h4) {
                    log_debug(&vm, &e);
                }
            }
            EventKind::Connected(hello) => {
                if self.engine.guest_connected(&vm, &hello.boot_id) {
                    self.out.human.push(format!(
                        "viotrace-host: vm {vm}: guest rebooted (boot id {}), clock reset\n",
                        hello.boot_id
                    ));
                }
                self.out.human.push(format!(
                    "viotrace-host: guest agent {} connected from {} as vm={vm} (kernel {}, boot {}, session {:016x})\n",
                    hello.agent_version, ev.origin, hello.kernel_release, hello.boot_id, hello.session
                ));
                // Resending now: the join waits until the guest has caught up
                // (at most STALL_GRACE after the connection was lost).
                let o = self.out.vm_out(&vm);
                o.conns += 1;
                self.engine.set_guest_stalled(&vm, false);
                let c = Conn {
                    vm,
                    origin: ev.origin,
                    records: 0,
                    told_malformed: false,
                    guest_counters: Vec::new(),
                };
                self.conns.insert(ev.conn, c);
            }
            EventKind::Stats(st) => {
                if let Some(c) = self.conns.get_mut(&ev.conn) {
                    c.guest_counters = st.counters.into_iter().map(|k| (k.name, k.value)).collect();
                }
            }
            EventKind::Disconnected { reason, error, bye } => {
                let what = if error { " with an error" } else { "" };
                let gone = self.conns.remove(&ev.conn);
                if let Some(c) = &gone {
                    // The guest will reconnect and resend: keep its host records waiting.
                    let o = self.out.vm_out(&c.vm);
                    o.conns = o.conns.saturating_sub(1);
                    if o.conns == 0 && !bye {
                        o.stalled_since.get_or_insert_with(Instant::now);
                        self.engine.set_guest_stalled(&c.vm, true);
                    }
                }
                let line = match gone {
                    Some(c) => format!(
                        "viotrace-host: guest connection {} (vm={}) closed{what}: {reason}; {} records\n",
                        c.origin, c.vm, c.records
                    ),
                    None => format!(
                        "viotrace-host: guest connection {} (vm={vm}) rejected{what}: {reason}\n",
                        ev.origin
                    ),
                };
                self.out.human.push(line);
            }
        }
    }

    /// Every VM's transport accounting, with what this agent did with the records.
    pub fn vm_accounts(&self) -> Vec<VmReport> {
        self.accounts
            .accounts()
            .into_iter()
            .map(|transport| {
                let o = self.out.vm(&transport.vm);
                VmReport {
                    written: o.map_or(0, |o| o.written),
                    output_rate_limited: o.map_or(0, |o| o.rate_limited),
                    summarized: o.map_or(0, |o| o.summarized),
                    syscall_records: o.map_or(0, |o| o.io_records),
                    malformed: o.map_or(0, |o| o.malformed),
                    balanced: transport.balanced(),
                    transport,
                }
            })
            .collect()
    }

    /// Join counters plus the transport's accounting summed over VMs.
    pub fn counters(&self) -> Vec<(String, u64)> {
        let s: JoinStats = self.engine.stats();
        let mut v = vec![
            ("join_guest_records".to_string(), s.guest_records),
            ("join_host_records".to_string(), s.host_records),
            ("joined".to_string(), s.joined),
            ("unmatched_guest".to_string(), s.unmatched_guest),
            ("unmatched_host".to_string(), s.unmatched_host),
            ("join_mismatched".to_string(), s.mismatched),
            ("join_evicted_lost".to_string(), s.evicted),
            ("clock_conflicts".to_string(), s.clock_conflicts),
        ];
        v.push(("joined_write_errors".to_string(), self.out.file.errors));
        if let Some(vd) = &self.out.verdicts {
            v.push(("slow_with_cause".to_string(), vd.flagged));
            let f = &self.out.interfere;
            v.push(("interference_filled".to_string(), f.filled));
            v.push(("qemu_cpu_waits_seen".to_string(), f.waits_seen));
            v.push(("qemu_cpu_waits_evicted".to_string(), f.waits_evicted));
            v.push(("cause_classes_refused".to_string(), vd.classes_refused()));
        }
        let mut sum: HashMap<&'static str, u64> = HashMap::new();
        for r in self.vm_accounts() {
            let (a, rl) = (&r.transport, r.output_rate_limited);
            for (k, n) in [
                ("guest_produced", a.produced),
                ("guest_delivered", a.delivered),
                ("lost_in_transit", a.lost_in_transit),
                ("in_flight_at_stop", a.in_flight),
                ("before_this_host", a.before_host),
                ("guest_dropped_full", a.guest_dropped_full),
                ("transport_duplicates", a.duplicates),
                ("transport_resyncs", a.resyncs),
                ("bad_guest_connections", a.bad_connections),
                ("rejected_guest_connections", a.rejected_connections),
                ("clock_rejected", a.clock_rejected),
                ("clock_rate_limited", a.clock_rate_limited),
                ("guest_throttled_ms", a.throttled_ms),
                ("guest_backpressure_ms", a.backpressure_ms),
                ("output_rate_limited", rl),
                ("joined_summarized", r.summarized),
                ("guest_records_malformed", r.malformed),
            ] {
                *sum.entry(k).or_default() += n;
            }
        }
        let refused = self.server.as_ref().map_or(0, Server::refused_total_cap);
        *sum.entry("rejected_guest_connections").or_default() += refused;
        let mut t: Vec<(String, u64)> = sum.into_iter().map(|(k, n)| (k.to_string(), n)).collect();
        t.sort();
        v.extend(t);
        let mut guest: HashMap<String, u64> = HashMap::new();
        for c in self.conns.values() {
            for (k, n) in &c.guest_counters {
                *guest.entry(format!("guest_{k}")).or_default() += n;
            }
        }
        let mut g: Vec<(String, u64)> = guest.into_iter().collect();
        g.sort();
        v.extend(g);
        v
    }

    /// One line per VM: the transport identity and what was refused.
    pub fn account_lines(&self) -> Vec<String> {
        self.vm_accounts()
            .into_iter()
            .map(|r| {
                let (a, written, rl, sm) =
                    (&r.transport, r.written, r.output_rate_limited, r.summarized);
                format!(
                    "viotrace-host: vm {}: guest records produced={} = before_this_host={} + delivered={} + lost_in_transit={} + in_flight={} ({}); guest buffer refused={}; connections={} rejected={} bad={}; clock samples={} rejected={} rate_limited={}; throttled={}ms backpressure={}ms; written={} output_rate_limited={} summarized={} malformed={}\n",
                    a.vm,
                    a.produced,
                    a.before_host,
                    a.delivered,
                    a.lost_in_transit,
                    a.in_flight,
                    if a.balanced() { "balanced" } else { "UNBALANCED" },
                    a.guest_dropped_full,
                    a.connections,
                    a.rejected_connections,
                    a.bad_connections,
                    a.clock_samples,
                    a.clock_rejected,
                    a.clock_rate_limited,
                    a.throttled_ms,
                    a.backpressure_ms,
                    written,
                    rl,
                    sm,
                    r.malformed
                )
            })
            .collect()
    }

    /// Stops serving, flushes every pending record (unmatched ones with their reason) and
    /// writes the Chrome trace.
    pub fn finish(&mut self) -> Result<Vec<String>> {
        // Let in-flight guest data arrive before the final flush, as long as it
        // still matches host records (a slow guest uploads its last requests
        // after the host saw them). Bounded: no progress for 400 ms, or 1.2 s in
        // all — the agent stops within two seconds of a signal whatever the
        // guests do.
        let start = Instant::now();
        let mut last_progress = start;
        let mut pending = self.engine.stats().pending_host;
        while pending > 0
            && start.elapsed() < STOP_GRACE_MAX
            && last_progress.elapsed() < STOP_GRACE_IDLE
        {
            if self.take_events(Duration::from_millis(20)) == 0 {
                std::thread::sleep(Duration::from_millis(20));
            }
            let now_pending = self.engine.stats().pending_host;
            if now_pending < pending {
                last_progress = Instant::now();
            }
            pending = now_pending;
        }
        if let Some(s) = self.server.as_ref() {
            // Keep the accounts of the server for the final report.
            self.accounts = s.accounts_handle();
        }
        if let Some(s) = self.server.take() {
            self.rt.block_on(s.shutdown(Duration::from_millis(700)));
        }
        self.take_events(Duration::from_millis(200));
        // (Streamed: a flooding guest can leave 16k records pending per side.)
        self.engine.flush(&mut self.out);
        self.out.file.flush().context("write joined records")?;
        if let Some((p, mut c, mut err)) = self.out.chrome.take() {
            if err.is_none() {
                err = c.finish().err();
            }
            let n = c.len();
            let overlapping = match c.overlapping() {
                0 => String::new(),
                o => format!(" ({o} drawn overlapping: their queue had {MAX_LANES} lanes in use)"),
            };
            if let Some(e) = err {
                return Err(e).with_context(|| format!("write {}", p.display()));
            }
            self.out.human.push(format!(
                "viotrace-host: Chrome trace with {n} requests in {}{overlapping} (open in ui.perfetto.dev)\n",
                p.display()
            ));
        }
        let lines = self.account_lines();
        self.out.human.extend(lines);
        Ok(std::mem::take(&mut self.out.human))
    }
}

fn log_debug(vm: &str, e: &dyn std::fmt::Display) {
    if std::env::var_os("VIOTRACE_DEBUG").is_some() {
        eprintln!("viotrace-host: vm {vm}: clock sample not used: {e}");
    }
}

/// Parses `VM=PATH` or `PATH`.
pub fn parse_listen_uds(s: &str) -> (Option<String>, PathBuf) {
    match s.split_once('=') {
        Some((vm, path)) if !vm.is_empty() && !vm.contains('/') => {
            (Some(vm.to_string()), PathBuf::from(path))
        }
        _ => (None, PathBuf::from(s)),
    }
}

/// The guest CID of a QEMU process's kernel vhost-vsock device, from its command line.
pub fn guest_cid_of(pid: u32) -> Option<u32> {
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    String::from_utf8_lossy(&cmd)
        .split(['\0', ','])
        .find_map(|a| a.strip_prefix("guest-cid="))
        .and_then(|n| n.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_uds_with_and_without_vm() {
        assert_eq!(
            parse_listen_uds("demo=/tmp/v.sock_5515"),
            (Some("demo".into()), PathBuf::from("/tmp/v.sock_5515"))
        );
        assert_eq!(
            parse_listen_uds("/tmp/a=b/v.sock"),
            (None, PathBuf::from("/tmp/a=b/v.sock"))
        );
    }
}
