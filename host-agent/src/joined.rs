//! Joined mode: serve guest agents over vsock / hybrid-vsock Unix sockets, keep each
//! VM's guest→host clock mapping, and join guest requests with this agent's virtqueue
//! elements into one end-to-end record per I/O.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use viotrace_shared::chrome::ChromeTrace;
use viotrace_shared::clock::monotonic_ns;
use viotrace_shared::join::{JoinConfig, JoinEngine, JoinStats};
use viotrace_shared::record::{HostElem, JoinedIo, Record};
use viotrace_shared::stats::{fmt_ns, render_waterfall, Aggregator, TOTAL_STAGE};
use viotrace_shared::transport::host::{self, EventKind, Listen, Origin, Server};

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
}

/// Per-connection bookkeeping.
struct Conn {
    vm: String,
    origin: Origin,
    records: u64,
    transport_dropped: u64,
    guest_counters: Vec<(String, u64)>,
}

/// The joined-mode state, driven from the agent's main loop.
pub struct Joined {
    rt: tokio::runtime::Runtime,
    server: Option<Server>,
    rx: tokio::sync::mpsc::Receiver<host::Event>,
    engine: JoinEngine,
    out: Box<dyn Write>,
    buf: Vec<JoinedIo>,
    pub interval: Aggregator,
    pub total: Aggregator,
    threshold_ns: Option<u64>,
    chrome: Option<(PathBuf, ChromeTrace)>,
    conns: HashMap<u64, Conn>,
    /// Guest-side losses reported by connections that have ended.
    closed_dropped: u64,
    bad_connections: u64,
    pub records: u64,
    /// Human output (tables, waterfalls, notices).
    human: Vec<String>,
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
        let cfg = host::HostConfig {
            listens,
            vm_for_cid: opts.vm_for_cid.clone(),
            ..host::HostConfig::default()
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("viotrace-net")
            .enable_all()
            .build()
            .context("start the network runtime")?;
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        let server = rt
            .block_on(host::serve(cfg, tx))
            .context("listen for guest agents")?;
        let out: Box<dyn Write> = match &opts.out {
            Some(p) => Box::new(BufWriter::new(
                File::create(p).with_context(|| format!("create {}", p.display()))?,
            )),
            None => Box::new(BufWriter::new(std::io::stdout())),
        };
        Ok(Joined {
            rt,
            server: Some(server),
            rx,
            engine: JoinEngine::new(JoinConfig::default()),
            out,
            buf: Vec::new(),
            interval: Aggregator::new(),
            total: Aggregator::new(),
            threshold_ns: opts.threshold_ns,
            chrome: opts.chrome.clone().map(|p| (p, ChromeTrace::new())),
            conns: HashMap::new(),
            closed_dropped: 0,
            bad_connections: 0,
            records: 0,
            human: Vec::new(),
        })
    }

    /// Feeds one of this agent's host elements.
    pub fn host_elem(&mut self, e: &HostElem) {
        self.engine.push_host(e.clone(), &mut self.buf);
        self.emit();
    }

    /// Handles what the guests sent, advances the join's clocks and timeouts, and
    /// writes what is ready. Returns human-readable notices and waterfalls.
    pub fn poll(&mut self) -> Vec<String> {
        while let Ok(ev) = self.rx.try_recv() {
            self.event(ev);
        }
        self.engine.advance(monotonic_ns(), &mut self.buf);
        self.emit();
        let _ = self.out.flush();
        std::mem::take(&mut self.human)
    }

    fn event(&mut self, ev: host::Event) {
        if let (EventKind::GuestRqs(rqs), Some(c)) = (&ev.kind, self.conns.get_mut(&ev.conn)) {
            c.records += rqs.len() as u64;
        }
        // Guest records and clock samples go to the join; a new boot id (shown in the
        // connection notice) resets that VM's clock mapping there.
        let Some(ev) = host::feed_join(&mut self.engine, ev, &mut self.buf) else {
            self.emit();
            return;
        };
        match ev.kind {
            EventKind::Connected(hello) => {
                self.human.push(format!(
                    "viotrace-host: guest agent {} connected from {} as vm={} (kernel {}, boot {})\n",
                    hello.agent_version, ev.origin, ev.vm, hello.kernel_release, hello.boot_id
                ));
                self.conns.insert(
                    ev.conn,
                    Conn {
                        vm: ev.vm,
                        origin: ev.origin,
                        records: 0,
                        transport_dropped: 0,
                        guest_counters: Vec::new(),
                    },
                );
            }
            EventKind::GuestRqs(_) | EventKind::Clock(_) => {
                // Consumed by feed_join.
            }
            EventKind::GuestIos(_) => {
                // Syscall-level records stay in the guest's own output; the join is per request.
            }
            EventKind::Stats(st) => {
                if let Some(c) = self.conns.get_mut(&ev.conn) {
                    c.transport_dropped = st.transport_dropped;
                    c.guest_counters = st.counters.into_iter().map(|k| (k.name, k.value)).collect();
                }
            }
            EventKind::Disconnected { reason, error } => {
                if error {
                    self.bad_connections += 1;
                }
                if let Some(c) = self.conns.remove(&ev.conn) {
                    self.closed_dropped += c.transport_dropped;
                    self.human.push(format!(
                        "viotrace-host: guest connection {} (vm={}) closed{}: {reason}; {} records\n",
                        c.origin,
                        c.vm,
                        if error { " with an error" } else { "" },
                        c.records
                    ));
                } else {
                    self.human.push(format!(
                        "viotrace-host: guest connection {} (vm={}) rejected{}: {reason}\n",
                        ev.origin,
                        ev.vm,
                        if error { " with an error" } else { "" },
                    ));
                }
            }
        }
    }

    fn emit(&mut self) {
        for j in self.buf.drain(..) {
            self.records += 1;
            let label = format!(
                "{}/{}",
                j.vm,
                j.disk.as_deref().or(j.device.as_deref()).unwrap_or("?")
            );
            if j.joined {
                for (stage, ns) in j.stages.iter() {
                    let ns = ns.max(0) as u64;
                    self.interval.record(&label, stage, ns);
                    self.total.record(&label, stage, ns);
                }
                if let Some(t) = j.total_ns {
                    self.interval.record(&label, TOTAL_STAGE, t.max(0) as u64);
                    self.total.record(&label, TOTAL_STAGE, t.max(0) as u64);
                }
            }
            if let (Some(th), Some(t)) = (self.threshold_ns, j.total_ns) {
                if j.joined && t >= 0 && t as u64 >= th {
                    let header = format!(
                        "slow I/O: vm={} disk={} q{} head={} {} sector={} bytes={} pid={} comm={} inode={} offset={} total={} (clock ±{})",
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
                        fmt_ns(t as u64),
                        fmt_ns(j.clock_uncertainty_ns.unwrap_or(0)),
                    );
                    self.human.push(render_waterfall(&header, &j.ts));
                }
            }
            if let Some((_, c)) = self.chrome.as_mut() {
                c.add(&j);
            }
            let rec = Record::Io(j);
            if serde_json::to_writer(&mut self.out, &rec).is_ok() {
                let _ = self.out.write_all(b"\n");
            }
        }
    }

    /// Join counters plus the guests' reported losses.
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
            ("bad_guest_connections".to_string(), self.bad_connections),
        ];
        let live: u64 = self.conns.values().map(|c| c.transport_dropped).sum();
        v.push((
            "guest_transport_dropped".to_string(),
            self.closed_dropped + live,
        ));
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

    /// Stops serving, flushes every pending record (unmatched ones with their reason) and
    /// writes the Chrome trace.
    pub fn finish(&mut self) -> Result<Vec<String>> {
        // Let in-flight guest data arrive before the final flush.
        let deadline = std::time::Instant::now() + Duration::from_millis(500);
        while std::time::Instant::now() < deadline {
            match self.rx.try_recv() {
                Ok(ev) => self.event(ev),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        if let Some(s) = self.server.take() {
            self.rt.block_on(s.shutdown(Duration::from_secs(2)));
        }
        while let Ok(ev) = self.rx.try_recv() {
            self.event(ev);
        }
        self.engine.flush(&mut self.buf);
        self.emit();
        self.out.flush().context("write joined records")?;
        if let Some((p, c)) = self.chrome.as_mut() {
            let mut f = BufWriter::new(
                File::create(&*p).with_context(|| format!("create {}", p.display()))?,
            );
            c.write(&mut f)
                .with_context(|| format!("write {}", p.display()))?;
            f.flush()?;
            self.human.push(format!(
                "viotrace-host: Chrome trace with {} requests in {} (open in ui.perfetto.dev)\n",
                c.len(),
                p.display()
            ));
        }
        Ok(std::mem::take(&mut self.human))
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
