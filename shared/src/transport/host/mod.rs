//! Host side: tokio listeners for AF_VSOCK and Unix (hybrid vsock) sockets.
//!
//! Isolation: every VM has a budget ([`Budget`]) — live connections, connection
//! rate, bytes read per second, records waiting for the agent, clock
//! samples per second, remembered sessions. A guest over its budget is not read
//! (back-pressure) or is refused, and every refusal is counted in its
//! [`VmAccount`]. The agent takes events through an [`Inbox`] with one bounded
//! queue per connection, served round-robin under a time budget, so no guest
//! can starve the agent's main loop or another guest.

mod conn;
pub mod ledger;
mod runtime;

use std::collections::{HashMap, VecDeque};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use crate::proto::{GuestStats, Hello, RawBatch};
pub use ledger::{SessionLedger, TokenBucket, VmAccount, VmLedger};
pub use runtime::NetRuntime;

/// What to listen on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    /// AF_VSOCK, any CID, this port.
    Vsock { port: u32 },
    /// A Unix socket path (for a hybrid-vsock VMM use
    /// [`super::hybrid_vsock_path`]); connections are attributed to `vm`.
    Unix { path: PathBuf, vm: String },
}

/// Where a connection came from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Origin {
    Vsock { cid: u32 },
    Unix { path: PathBuf },
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Vsock { cid } => write!(f, "vsock cid {cid}"),
            Origin::Unix { path } => write!(f, "unix {}", path.display()),
        }
    }
}

/// Per-VM limits (every guest is untrusted).
#[derive(Clone, Debug)]
pub struct Budget {
    /// Live connections per VM (handshaking ones included).
    pub max_conns_per_vm: usize,
    /// Live connections over all VMs.
    pub max_conns_total: usize,
    /// New connections per second per VM (and the burst allowed).
    pub connects_per_sec: f64,
    pub connect_burst: f64,
    /// Bytes read per second per VM; beyond it the VM's sockets are not read.
    pub bytes_per_sec: f64,
    /// Largest frame accepted after the handshake.
    pub max_frame: usize,
    /// Most records in one batch.
    pub max_batch_records: usize,
    /// Decoded records of a VM waiting for the agent (back-pressure beyond).
    pub records_pending: usize,
    /// Clock samples per second per VM (more are refused and counted).
    pub clock_per_sec: f64,
    /// Sessions (guest agent instances) remembered per VM.
    pub max_sessions_per_vm: usize,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            max_conns_per_vm: 2,
            max_conns_total: 256,
            connects_per_sec: 1.0,
            connect_burst: 8.0,
            bytes_per_sec: 24.0 * 1024.0 * 1024.0,
            max_frame: 256 * 1024,
            max_batch_records: 4096,
            records_pending: 8192,
            clock_per_sec: 8.0,
            max_sessions_per_vm: 4,
        }
    }
}

#[derive(Clone, Debug)]
pub struct HostConfig {
    pub listens: Vec<Listen>,
    /// Host-initiated clock ping period.
    pub probe_interval: Duration,
    pub handshake_timeout: Duration,
    /// A connection that sends nothing for this long is closed.
    pub idle_timeout: Duration,
    pub agent_version: String,
    /// VM labels for vsock CIDs (default label: `cid<N>`).
    pub vm_for_cid: HashMap<u32, String>,
    pub budget: Budget,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            listens: Vec::new(),
            probe_interval: Duration::from_secs(1),
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            vm_for_cid: HashMap::new(),
            budget: Budget::default(),
        }
    }
}

/// A verified clock sample from one connection (host timestamps are the host's own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClockSample {
    /// Guest probe: `t1`,`t4` guest; `t2`,`t3` host.
    GuestInitiated { t1: u64, t2: u64, t3: u64, t4: u64 },
    /// Host ping: `h1`,`h4` host; `g2`,`g3` guest.
    HostInitiated { h1: u64, g2: u64, g3: u64, h4: u64 },
}

#[derive(Debug)]
pub enum EventKind {
    Connected(Hello),
    /// Records in sequence order, checked for structure and still in their
    /// wire form (read them with a [`BatchReader`](crate::proto::BatchReader):
    /// a record whose contents do not decode is the reader's to count);
    /// `permit` holds the VM's pending-record budget until the event is dropped.
    Records {
        batch: RawBatch,
        permit: Option<OwnedSemaphorePermit>,
    },
    Stats(GuestStats),
    Clock(ClockSample),
    /// The connection ended; `error` when it was dropped for bad data or I/O
    /// errors, `bye` when the guest agent said it is stopping (nothing will be
    /// resent; otherwise a reconnection resends what was not acknowledged).
    Disconnected {
        reason: String,
        error: bool,
        bye: bool,
    },
}

/// One event from one guest connection.
#[derive(Debug)]
pub struct Event {
    /// Unique per connection.
    pub conn: u64,
    pub origin: Origin,
    pub vm: String,
    pub kind: EventKind,
}

/// One VM's shared transport state.
struct VmSlot {
    conns: usize,
    connects: TokenBucket,
    bytes: TokenBucket,
    clock: TokenBucket,
    pending: Arc<Semaphore>,
    ledger: VmLedger,
}

#[derive(Default)]
struct Registry {
    vms: HashMap<String, VmSlot>,
    conns: usize,
    /// Connections refused before any VM could be charged (total cap).
    refused_total_cap: u64,
}

/// Shared by the accept loops and the connection tasks.
#[derive(Clone)]
struct Hub {
    cfg: Arc<HostConfig>,
    reg: Arc<Mutex<Registry>>,
    new_conns: mpsc::UnboundedSender<ConnQueue>,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
    ids: Arc<AtomicU64>,
    stop_rx: watch::Receiver<bool>,
    wake: Arc<Wake>,
}

/// Wakes the agent's main loop early: it polls the inbox on its own clock,
/// and a VM whose records waiting reach half its budget
/// (`Budget::records_pending`) should not wait for that (its guest would be
/// held back). Rung at most once until the loop takes the inbox again.
struct Wake {
    fd: nix::sys::eventfd::EventFd,
    rung: std::sync::atomic::AtomicBool,
}

impl Wake {
    fn new() -> io::Result<Wake> {
        use nix::sys::eventfd::{EfdFlags, EventFd};
        let fd = EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map_err(io::Error::from)?;
        Ok(Wake {
            fd,
            rung: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn ring(&self) {
        if !self.rung.swap(true, Ordering::AcqRel) {
            // (an error can only be a full counter: it is readable then anyway)
            let _ = self.fd.write(1);
        }
    }

    /// Rearms it (the loop is about to take the inbox).
    fn clear(&self) {
        if self.rung.swap(false, Ordering::AcqRel) {
            let _ = self.fd.read();
        }
    }
}

/// Releases a connection slot when the connection ends.
struct Admission {
    reg: Arc<Mutex<Registry>>,
    vm: String,
}

impl Drop for Admission {
    fn drop(&mut self) {
        let mut r = lock(&self.reg);
        r.conns = r.conns.saturating_sub(1);
        if let Some(v) = r.vms.get_mut(&self.vm) {
            v.conns = v.conns.saturating_sub(1);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Hub {
    fn slot<'a>(&self, r: &'a mut Registry, vm: &str) -> &'a mut VmSlot {
        let b = &self.cfg.budget;
        r.vms.entry(vm.to_string()).or_insert_with(|| VmSlot {
            conns: 0,
            connects: TokenBucket::new(b.connects_per_sec, b.connect_burst),
            bytes: TokenBucket::new(b.bytes_per_sec, b.bytes_per_sec),
            clock: TokenBucket::new(b.clock_per_sec, b.clock_per_sec * 2.0),
            pending: Arc::new(Semaphore::new(b.records_pending)),
            ledger: VmLedger::new(b.max_sessions_per_vm),
        })
    }

    /// Applies `f` to a VM's ledger.
    fn ledger<R>(&self, vm: &str, f: impl FnOnce(&mut VmLedger) -> R) -> R {
        let mut r = lock(&self.reg);
        f(&mut self.slot(&mut r, vm).ledger)
    }

    /// Admits a new connection of `vm`, or says why not (counted).
    fn admit(&self, vm: &str) -> Result<Admission, String> {
        let b = &self.cfg.budget;
        let mut r = lock(&self.reg);
        if r.conns >= b.max_conns_total {
            r.refused_total_cap += 1;
            return Err(format!("{} connections in all", b.max_conns_total));
        }
        let now = Instant::now();
        let s = self.slot(&mut r, vm);
        let why = if s.conns >= b.max_conns_per_vm {
            Some(format!("{} live connections for this VM", s.conns))
        } else if !s.connects.try_take(1.0, now) {
            Some("connecting too often".to_string())
        } else {
            None
        };
        if let Some(w) = why {
            s.ledger.counters.rejected_connections += 1;
            return Err(w);
        }
        s.conns += 1;
        s.ledger.counters.connections += 1;
        r.conns += 1;
        Ok(Admission {
            reg: self.reg.clone(),
            vm: vm.to_string(),
        })
    }

    /// Charges `n` bytes read to the VM; returns how long to stop reading.
    fn charge_bytes(&self, vm: &str, n: usize) -> Duration {
        let mut r = lock(&self.reg);
        let s = self.slot(&mut r, vm);
        let d = s.bytes.take_debt(n as f64, Instant::now());
        s.ledger.counters.throttled_ms += d.as_millis() as u64;
        d
    }

    /// Whether a clock sample of the VM fits its rate (counted either way).
    fn clock_allowed(&self, vm: &str) -> bool {
        let mut r = lock(&self.reg);
        let s = self.slot(&mut r, vm);
        let ok = s.clock.try_take(1.0, Instant::now());
        if !ok {
            s.ledger.counters.clock_rate_limited += 1;
        }
        ok
    }

    fn pending(&self, vm: &str) -> Arc<Semaphore> {
        let mut r = lock(&self.reg);
        self.slot(&mut r, vm).pending.clone()
    }

    /// Serves one accepted stream in its own task, remembered for shutdown.
    fn spawn<S: AsyncRead + AsyncWrite + Send + 'static>(
        &self,
        stream: S,
        origin: Origin,
        vm: String,
    ) {
        let adm = match self.admit(&vm) {
            Ok(a) => a,
            Err(why) => {
                log::warn!("viotrace: refusing a connection from {origin} (vm {vm}): {why}");
                return; // dropping the stream closes it
            }
        };
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(16);
        if self.new_conns.send(ConnQueue { id, rx }).is_err() {
            return;
        }
        let c = conn::Conn {
            hub: self.clone(),
            id,
            origin,
            vm,
            tx,
            _admission: adm,
        };
        let h = tokio::spawn(c.run(stream));
        let mut t = lock(&self.tasks);
        t.retain(|h| !h.is_finished());
        t.push(h);
    }
}

/// A running server; dropping it stops accepting, [`Server::shutdown`]
/// also says `Bye` to connected guests.
pub struct Server {
    stop: watch::Sender<bool>,
    accept: Vec<JoinHandle<()>>,
    hub: Hub,
    pub bound: Vec<Listen>,
}

impl Server {
    /// Stops accepting, says bye to every guest, and ends every connection
    /// within `timeout` (the rest are aborted).
    pub async fn shutdown(self, timeout: Duration) {
        let _ = self.stop.send(true);
        for a in &self.accept {
            a.abort();
        }
        let tasks = std::mem::take(&mut *lock(&self.hub.tasks));
        let aborts: Vec<_> = tasks.iter().map(|t| t.abort_handle()).collect();
        let done = tokio::time::timeout(timeout, async {
            for c in tasks {
                let _ = c.await;
            }
        })
        .await;
        if done.is_err() {
            for a in aborts {
                a.abort();
            }
        }
    }

    /// Every VM's transport accounting so far.
    pub fn accounts(&self) -> Vec<VmAccount> {
        accounts(&self.hub.reg)
    }

    /// A cheap handle to read the accounts from elsewhere.
    pub fn accounts_handle(&self) -> AccountsHandle {
        AccountsHandle(self.hub.reg.clone())
    }

    /// Connections refused because the total cap was reached (no VM charged).
    pub fn refused_total_cap(&self) -> u64 {
        lock(&self.hub.reg).refused_total_cap
    }
}

/// Reads the transport accounts of a running server.
#[derive(Clone)]
pub struct AccountsHandle(Arc<Mutex<Registry>>);

impl AccountsHandle {
    pub fn accounts(&self) -> Vec<VmAccount> {
        accounts(&self.0)
    }
}

fn accounts(reg: &Mutex<Registry>) -> Vec<VmAccount> {
    let r = lock(reg);
    let mut v: Vec<VmAccount> = r.vms.iter().map(|(k, s)| s.ledger.account(k)).collect();
    v.sort_by(|a, b| a.vm.cmp(&b.vm));
    v
}

impl Drop for Server {
    fn drop(&mut self) {
        for a in &self.accept {
            a.abort();
        }
    }
}

/// One connection's queue of events for the agent.
struct ConnQueue {
    id: u64,
    rx: mpsc::Receiver<Event>,
}

/// Where the agent takes guest events from: one bounded queue per connection,
/// served round-robin.
pub struct Inbox {
    new: mpsc::UnboundedReceiver<ConnQueue>,
    queues: VecDeque<ConnQueue>,
    wake: Arc<Wake>,
}

impl Inbox {
    /// Readable when the inbox should be taken before the loop's own time
    /// (a VM's records waiting reached half its budget); add it to the
    /// loop's poll set. [`Inbox::drain`] rearms it.
    pub fn wake_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.wake.fd.as_fd()
    }

    /// Hands events to `f`, a few per connection in turn, until none is
    /// waiting or `budget` has passed. Returns the number handled.
    pub fn drain(&mut self, budget: Duration, mut f: impl FnMut(Event)) -> usize {
        const PER_TURN: usize = 4;
        self.wake.clear();
        let deadline = Instant::now() + budget;
        while let Ok(q) = self.new.try_recv() {
            self.queues.push_back(q);
        }
        let mut n = 0;
        loop {
            let mut progressed = false;
            for _ in 0..self.queues.len() {
                let Some(mut q) = self.queues.pop_front() else {
                    break;
                };
                let mut closed = false;
                for _ in 0..PER_TURN {
                    match q.rx.try_recv() {
                        Ok(ev) => {
                            f(ev);
                            n += 1;
                            progressed = true;
                        }
                        Err(mpsc::error::TryRecvError::Empty) => break,
                        Err(mpsc::error::TryRecvError::Disconnected) => {
                            closed = true;
                            break;
                        }
                    }
                }
                if !closed {
                    self.queues.push_back(q);
                } else {
                    log::trace!("inbox: connection {} drained", q.id);
                }
                if Instant::now() >= deadline {
                    return n;
                }
            }
            if !progressed {
                return n;
            }
        }
    }

    /// Connections whose queues are still open.
    pub fn open_queues(&self) -> usize {
        self.queues.len()
    }
}

fn prepare_unix_path(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Binds every listener (failing if any cannot be bound) and starts serving.
pub async fn serve(cfg: HostConfig) -> io::Result<(Server, Inbox)> {
    let (stop, stop_rx) = watch::channel(false);
    let (new_tx, new_rx) = mpsc::unbounded_channel();
    let hub = Hub {
        cfg: Arc::new(cfg),
        reg: Arc::default(),
        new_conns: new_tx,
        tasks: Arc::default(),
        ids: Arc::new(AtomicU64::new(1)),
        stop_rx,
        wake: Arc::new(Wake::new()?),
    };
    let mut accept = Vec::new();
    for l in &hub.cfg.listens {
        match l.clone() {
            Listen::Unix { path, vm } => {
                prepare_unix_path(&path)?;
                let lis = tokio::net::UnixListener::bind(&path).map_err(|e| {
                    io::Error::new(e.kind(), format!("bind {}: {e}", path.display()))
                })?;
                let hub = hub.clone();
                accept.push(tokio::spawn(async move {
                    loop {
                        match lis.accept().await {
                            Ok((s, _)) => {
                                let origin = Origin::Unix { path: path.clone() };
                                hub.spawn(s, origin, vm.clone());
                            }
                            Err(e) => {
                                log::warn!("accept on {}: {e}", path.display());
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                        }
                    }
                }));
            }
            Listen::Vsock { port } => {
                let addr = tokio_vsock::VsockAddr::new(tokio_vsock::VMADDR_CID_ANY, port);
                let lis = tokio_vsock::VsockListener::bind(addr).map_err(|e| {
                    io::Error::new(e.kind(), format!("bind vsock port {port}: {e}"))
                })?;
                let hub = hub.clone();
                accept.push(tokio::spawn(async move {
                    loop {
                        match lis.accept().await {
                            Ok((s, peer)) => {
                                let cid = peer.cid();
                                let vm = hub
                                    .cfg
                                    .vm_for_cid
                                    .get(&cid)
                                    .cloned()
                                    .unwrap_or_else(|| format!("cid{cid}"));
                                hub.spawn(s, Origin::Vsock { cid }, vm);
                            }
                            Err(e) => {
                                log::warn!("accept on vsock port {port}: {e}");
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                        }
                    }
                }));
            }
        }
    }
    let bound = hub.cfg.listens.clone();
    let wake = hub.wake.clone();
    Ok((
        Server {
            stop,
            accept,
            hub,
            bound,
        },
        Inbox {
            new: new_rx,
            queues: VecDeque::new(),
            wake,
        },
    ))
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
