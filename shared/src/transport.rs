//! Channel between the agents.
//!
//! * Guest side ([`GuestSender`], std threads, no async runtime): connects to
//!   the host over AF_VSOCK (host CID [`HOST_CID`], port
//!   [`DEFAULT_VSOCK_PORT`]) or a Unix socket, says [`Hello`], streams record
//!   batches, answers host clock pings and issues its own probes, reconnects
//!   with exponential back-off, and keeps a bounded buffer while disconnected
//!   (the oldest records are dropped and counted when it is full).
//! * Host side ([`host`], tokio, feature `host`): listens on AF_VSOCK and/or
//!   Unix socket paths (hybrid vsock: a guest connection to port P arrives on
//!   `<uds-path>_P`, see [`hybrid_vsock_path`]), serves many guests, tags every
//!   connection with its origin, decodes strictly, drops a bad connection with
//!   a logged reason, pings each guest for clock samples, and delivers events
//!   on a channel.

use std::collections::VecDeque;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::clock::monotonic_ns;
use crate::proto::{
    self, encode_batches, encode_frame_into, GuestStats, Hello, Message, ProtoError,
    DEFAULT_VSOCK_PORT, HOST_CID, PROTOCOL_VERSION,
};
use crate::record::{GuestIo, GuestRq};

/// Where the guest agent sends its records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Vsock { cid: u32, port: u32 },
    Unix(PathBuf),
}

impl Default for Endpoint {
    fn default() -> Self {
        Endpoint::Vsock {
            cid: HOST_CID,
            port: DEFAULT_VSOCK_PORT,
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Vsock { cid, port } => write!(f, "vsock:{cid}:{port}"),
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// Parses `vsock:CID:PORT`, `vsock:PORT` (host CID 2), `vsock` (defaults),
/// `unix:PATH` or an absolute path.
impl FromStr for Endpoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err("empty unix socket path".into());
            }
            return Ok(Endpoint::Unix(PathBuf::from(p)));
        }
        if s.starts_with('/') {
            return Ok(Endpoint::Unix(PathBuf::from(s)));
        }
        let rest = if s == "vsock" {
            ""
        } else if let Some(r) = s.strip_prefix("vsock:") {
            r
        } else {
            return Err(format!(
                "bad endpoint {s:?}: want vsock[:CID]:PORT, unix:PATH or /PATH"
            ));
        };
        let num = |x: &str| {
            x.parse::<u32>()
                .map_err(|e| format!("bad number {x:?} in endpoint {s:?}: {e}"))
        };
        let parts: Vec<&str> = if rest.is_empty() {
            vec![]
        } else {
            rest.split(':').collect()
        };
        match parts.as_slice() {
            [] => Ok(Endpoint::default()),
            [port] => Ok(Endpoint::Vsock {
                cid: HOST_CID,
                port: num(port)?,
            }),
            [cid, port] => Ok(Endpoint::Vsock {
                cid: num(cid)?,
                port: num(port)?,
            }),
            _ => Err(format!("bad endpoint {s:?}")),
        }
    }
}

/// The Unix socket path on which a hybrid-vsock VMM (Firecracker, Cloud
/// Hypervisor, vhost-device-vsock) delivers guest connections to `port`.
pub fn hybrid_vsock_path(uds_path: &Path, port: u32) -> PathBuf {
    let mut s = uds_path.as_os_str().to_owned();
    s.push(format!("_{port}"));
    PathBuf::from(s)
}

enum Conn {
    Unix(UnixStream),
    Vsock(vsock::VsockStream),
}

impl Conn {
    fn connect(ep: &Endpoint) -> io::Result<Conn> {
        match ep {
            Endpoint::Unix(p) => UnixStream::connect(p).map(Conn::Unix),
            Endpoint::Vsock { cid, port } => {
                vsock::VsockStream::connect_with_cid_port(*cid, *port).map(Conn::Vsock)
            }
        }
    }
    fn try_clone(&self) -> io::Result<Conn> {
        match self {
            Conn::Unix(s) => s.try_clone().map(Conn::Unix),
            Conn::Vsock(s) => s.try_clone().map(Conn::Vsock),
        }
    }
    fn set_read_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Unix(s) => s.set_read_timeout(d),
            Conn::Vsock(s) => s.set_read_timeout(d),
        }
    }
    fn set_write_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Unix(s) => s.set_write_timeout(d),
            Conn::Vsock(s) => s.set_write_timeout(d),
        }
    }
    fn shutdown(&self) {
        let _ = match self {
            Conn::Unix(s) => s.shutdown(Shutdown::Both),
            Conn::Vsock(s) => s.shutdown(Shutdown::Both),
        };
    }
}

impl Read for Conn {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Unix(s) => s.read(b),
            Conn::Vsock(s) => s.read(b),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Unix(s) => s.write(b),
            Conn::Vsock(s) => s.write(b),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Conn::Unix(s) => s.flush(),
            Conn::Vsock(s) => s.flush(),
        }
    }
}

/// Guest sender settings.
#[derive(Clone, Debug)]
pub struct GuestSenderConfig {
    pub endpoint: Endpoint,
    pub hello: Hello,
    /// Records kept while disconnected or slow; beyond this the oldest are dropped.
    pub max_buffered: usize,
    /// Records per batch frame (a batch is also split to fit the frame limit).
    pub batch_max: usize,
    /// Longest time a record waits before its batch is sent.
    pub flush_interval: Duration,
    /// Guest-initiated clock probe period (zero: never).
    pub probe_interval: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// How long to wait for the host's `HelloAck`.
    pub handshake_timeout: Duration,
}

impl GuestSenderConfig {
    pub fn new(endpoint: Endpoint, hello: Hello) -> Self {
        GuestSenderConfig {
            endpoint,
            hello,
            max_buffered: 100_000,
            batch_max: 1024,
            flush_interval: Duration::from_millis(100),
            probe_interval: Duration::from_secs(1),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
        }
    }
}

/// This guest's own vsock CID, when a vsock transport is loaded.
pub fn local_cid() -> Option<u32> {
    vsock::get_local_cid().ok()
}

/// Builds a [`Hello`] from this machine's facts (`/proc`), with `agent_version`.
pub fn local_hello(agent_version: &str, cid: Option<u32>) -> Hello {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    Hello {
        protocol_version: PROTOCOL_VERSION,
        agent_version: agent_version.to_string(),
        kernel_release: read("/proc/sys/kernel/osrelease"),
        boot_id: read("/proc/sys/kernel/random/boot_id"),
        hostname: read("/proc/sys/kernel/hostname"),
        cid,
    }
}

/// Counters of the guest sender.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SenderStats {
    pub queued: u64,
    pub sent_records: u64,
    pub sent_frames: u64,
    /// Records dropped because the buffer was full.
    pub dropped_full: u64,
    /// Records lost in a connection that failed while sending them.
    pub dropped_disconnect: u64,
    pub connects: u64,
    pub connect_failures: u64,
    pub probes_sent: u64,
    pub pongs_sent: u64,
    pub connected: bool,
}

impl SenderStats {
    pub fn dropped(&self) -> u64 {
        self.dropped_full + self.dropped_disconnect
    }
}

enum Item {
    Rq(GuestRq),
    Io(GuestIo),
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Item>,
    control: VecDeque<Message>,
    stats: Option<GuestStats>,
    closing: Option<String>,
}

struct Shared {
    q: Mutex<Queue>,
    cv: Condvar,
    max: usize,
    batch_max: usize,
    dropped_full: AtomicU64,
    dropped_disconnect: AtomicU64,
    queued: AtomicU64,
    sent_records: AtomicU64,
    sent_frames: AtomicU64,
    connects: AtomicU64,
    connect_failures: AtomicU64,
    probes: AtomicU64,
    pongs: AtomicU64,
    connected: AtomicBool,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        // A poisoned lock only means another thread panicked mid-update of a
        // plain queue; the data is still usable.
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Guest-side sender (one background thread, plus a reader per connection).
pub struct GuestSender {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl GuestSender {
    /// Starts the background sender; it connects (and reconnects) on its own.
    pub fn start(cfg: GuestSenderConfig) -> io::Result<GuestSender> {
        let shared = Arc::new(Shared {
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            max: cfg.max_buffered.max(1),
            batch_max: cfg.batch_max.max(1),
            dropped_full: AtomicU64::new(0),
            dropped_disconnect: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            sent_records: AtomicU64::new(0),
            sent_frames: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            connect_failures: AtomicU64::new(0),
            probes: AtomicU64::new(0),
            pongs: AtomicU64::new(0),
            connected: AtomicBool::new(false),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("viotrace-send".into())
            .spawn(move || sender_main(cfg, sh))?;
        Ok(GuestSender {
            shared,
            thread: Some(thread),
        })
    }

    fn push(&self, it: Item) {
        let mut q = self.shared.lock();
        if q.items.len() >= self.shared.max {
            q.items.pop_front();
            self.shared.dropped_full.fetch_add(1, Ordering::Relaxed);
        }
        q.items.push_back(it);
        let n = q.items.len();
        self.shared.queued.fetch_add(1, Ordering::Relaxed);
        drop(q);
        // The writer sleeps at most a flush interval while records wait; wake
        // it only when the first record arrives or a batch is full (a wake-up
        // per record would cost a syscall each).
        if n == 1 || n == self.shared.batch_max {
            self.shared.cv.notify_one();
        }
    }

    pub fn send_rq(&self, rq: GuestRq) {
        self.push(Item::Rq(rq));
    }

    pub fn send_io(&self, io: GuestIo) {
        self.push(Item::Io(io));
    }

    /// Queues a statistics snapshot (replaces an unsent one).
    pub fn send_stats(&self, mut st: GuestStats) {
        st.transport_dropped = self.stats().dropped();
        self.shared.lock().stats = Some(st);
        self.shared.cv.notify_one();
    }

    pub fn stats(&self) -> SenderStats {
        let s = &self.shared;
        SenderStats {
            queued: s.queued.load(Ordering::Relaxed),
            sent_records: s.sent_records.load(Ordering::Relaxed),
            sent_frames: s.sent_frames.load(Ordering::Relaxed),
            dropped_full: s.dropped_full.load(Ordering::Relaxed),
            dropped_disconnect: s.dropped_disconnect.load(Ordering::Relaxed),
            connects: s.connects.load(Ordering::Relaxed),
            connect_failures: s.connect_failures.load(Ordering::Relaxed),
            probes_sent: s.probes.load(Ordering::Relaxed),
            pongs_sent: s.pongs.load(Ordering::Relaxed),
            connected: s.connected.load(Ordering::Relaxed),
        }
    }

    /// Flushes what it can within `timeout`, sends `Bye`, and stops. Records
    /// still buffered afterwards are counted as dropped.
    pub fn shutdown(mut self, reason: &str, timeout: Duration) -> SenderStats {
        self.shared.lock().closing = Some(reason.to_string());
        self.shared.cv.notify_all();
        let deadline = Instant::now() + timeout;
        if let Some(t) = self.thread.take() {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if t.is_finished() {
                let _ = t.join();
            }
            // Otherwise the thread is stuck connecting; it is detached and
            // exits at its next check of `closing`.
        }
        let left = self.shared.lock().items.len() as u64;
        self.shared
            .dropped_disconnect
            .fetch_add(left, Ordering::Relaxed);
        self.shared.lock().items.clear();
        self.stats()
    }
}

impl Drop for GuestSender {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.shared.lock().closing = Some("dropped".into());
            self.shared.cv.notify_all();
        }
    }
}

fn sender_main(cfg: GuestSenderConfig, sh: Arc<Shared>) {
    let mut backoff = cfg.backoff_min;
    loop {
        let closing = {
            let q = sh.lock();
            if q.closing.is_some() && q.items.is_empty() && q.stats.is_none() {
                return;
            }
            q.closing.is_some()
        };
        match session(&cfg, &sh) {
            Ok(Done::Closed) => return,
            Ok(Done::Failed(e)) => {
                log::warn!(
                    "viotrace transport: connection to {} lost: {e}",
                    cfg.endpoint
                );
                backoff = cfg.backoff_min;
            }
            Err(e) => {
                sh.connect_failures.fetch_add(1, Ordering::Relaxed);
                log::debug!(
                    "viotrace transport: connect to {} failed: {e}",
                    cfg.endpoint
                );
            }
        }
        sh.connected.store(false, Ordering::Relaxed);
        if closing {
            // That was the last attempt to deliver what was buffered.
            return;
        }
        // Back-off wait, cut short by shutdown (which then makes one final attempt).
        let q = sh.lock();
        let _ = sh
            .cv
            .wait_timeout_while(q, backoff, |q| q.closing.is_none())
            .unwrap_or_else(|e| e.into_inner());
        backoff = (backoff * 2).min(cfg.backoff_max);
    }
}

enum Done {
    Closed,
    Failed(ProtoError),
}

/// One connection: handshake, then stream until failure or shutdown.
fn session(cfg: &GuestSenderConfig, sh: &Arc<Shared>) -> Result<Done, ProtoError> {
    let mut conn = Conn::connect(&cfg.endpoint)?;
    conn.set_write_timeout(Some(Duration::from_secs(10)))?;
    conn.set_read_timeout(Some(cfg.handshake_timeout))?;
    proto::write_message(&mut conn, &Message::Hello(cfg.hello.clone()))?;
    match proto::read_message(&mut conn)? {
        Some(Message::HelloAck(ack)) => {
            proto::check_version(ack.protocol_version)?;
            log::info!(
                "viotrace transport: connected to {} (host agent {}, vm {:?})",
                cfg.endpoint,
                ack.agent_version,
                ack.vm
            );
        }
        Some(Message::Bye { reason }) => {
            return Err(ProtoError::Violation(format!("host refused: {reason}")))
        }
        Some(other) => {
            return Err(ProtoError::Violation(format!(
                "expected hello_ack, got {}",
                other.name()
            )))
        }
        None => return Err(ProtoError::Violation("host closed during handshake".into())),
    }
    conn.set_read_timeout(None)?;
    sh.connects.fetch_add(1, Ordering::Relaxed);
    sh.connected.store(true, Ordering::Relaxed);

    // Reader: answers pings (via the control queue) and completes our probes.
    let reader_conn = conn.try_clone()?;
    let alive = Arc::new(AtomicBool::new(true));
    let reader = {
        let sh = sh.clone();
        let alive = alive.clone();
        std::thread::Builder::new()
            .name("viotrace-recv".into())
            .spawn(move || reader_main(reader_conn, sh, alive))?
    };
    let r = writer_loop(cfg, sh, &mut conn, &alive);
    conn.shutdown();
    let _ = reader.join();
    r
}

fn reader_main(mut conn: Conn, sh: Arc<Shared>, alive: Arc<AtomicBool>) {
    let mut dec = proto::FrameDecoder::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let now = monotonic_ns();
        dec.feed(&buf[..n]);
        loop {
            match dec.next_message() {
                Ok(None) => break,
                Ok(Some(Message::ClockPing { seq, h1 })) => {
                    // g3 is stamped by the writer right before sending.
                    sh.lock().control.push_back(Message::ClockPong {
                        seq,
                        h1,
                        g2: now,
                        g3: 0,
                    });
                    sh.cv.notify_one();
                }
                Ok(Some(Message::ClockReply { seq, t1, t2, t3 })) => {
                    sh.lock().control.push_back(Message::ClockSample {
                        seq,
                        t1,
                        t2,
                        t3,
                        t4: now,
                    });
                    sh.cv.notify_one();
                }
                Ok(Some(Message::Bye { reason })) => {
                    log::info!("viotrace transport: host said bye: {reason}");
                    alive.store(false, Ordering::Relaxed);
                    sh.cv.notify_all();
                    return;
                }
                Ok(Some(other)) => {
                    log::debug!("viotrace transport: ignoring {} from host", other.name());
                }
                Err(e) => {
                    log::warn!("viotrace transport: bad data from host: {e}");
                    alive.store(false, Ordering::Relaxed);
                    sh.cv.notify_all();
                    return;
                }
            }
        }
    }
    alive.store(false, Ordering::Relaxed);
    sh.cv.notify_all();
}

fn writer_loop(
    cfg: &GuestSenderConfig,
    sh: &Arc<Shared>,
    conn: &mut Conn,
    alive: &AtomicBool,
) -> Result<Done, ProtoError> {
    let mut seq: u64 = 0;
    let mut last_probe: Option<Instant> = None;
    let mut out = Vec::with_capacity(64 * 1024);
    let mut rqs: Vec<GuestRq> = Vec::new();
    let mut ios: Vec<GuestIo> = Vec::new();
    let mut oldest_wait = Instant::now();
    loop {
        if !alive.load(Ordering::Relaxed) {
            return Ok(Done::Failed(ProtoError::Violation(
                "connection closed by host".into(),
            )));
        }
        let probe_due = !cfg.probe_interval.is_zero()
            && last_probe.is_none_or(|t| t.elapsed() >= cfg.probe_interval);
        let mut q = sh.lock();
        // Wait for work: enough records, control messages, a due probe, or closing.
        let timeout = if q.items.is_empty() {
            cfg.probe_interval
                .checked_sub(last_probe.map_or(Duration::ZERO, |t| t.elapsed()))
                .unwrap_or(Duration::ZERO)
                .max(Duration::from_millis(1))
                .min(cfg.flush_interval.max(Duration::from_millis(1)) * 10)
        } else {
            cfg.flush_interval
                .checked_sub(oldest_wait.elapsed())
                .unwrap_or(Duration::ZERO)
        };
        if q.control.is_empty()
            && q.stats.is_none()
            && q.closing.is_none()
            && !probe_due
            && q.items.len() < cfg.batch_max
            && !timeout.is_zero()
        {
            let (nq, _) = sh
                .cv
                .wait_timeout_while(q, timeout, |q| {
                    q.control.is_empty()
                        && q.stats.is_none()
                        && q.closing.is_none()
                        && q.items.len() < cfg.batch_max
                        && alive.load(Ordering::Relaxed)
                })
                .unwrap_or_else(|e| e.into_inner());
            q = nq;
        }
        let closing = q.closing.clone();
        let flush_due = oldest_wait.elapsed() >= cfg.flush_interval
            || q.items.len() >= cfg.batch_max
            || closing.is_some();
        let control: Vec<Message> = q.control.drain(..).collect();
        let stats = q.stats.take();
        if flush_due {
            let n = q.items.len().min(if closing.is_some() {
                usize::MAX
            } else {
                cfg.batch_max * 16
            });
            for it in q.items.drain(..n) {
                match it {
                    Item::Rq(r) => rqs.push(r),
                    Item::Io(i) => ios.push(i),
                }
            }
        }
        let more_waiting = !q.items.is_empty();
        drop(q);
        if !more_waiting || flush_due {
            oldest_wait = Instant::now();
        }

        out.clear();
        for mut m in control {
            if let Message::ClockPong { g3, .. } = &mut m {
                *g3 = monotonic_ns();
                sh.pongs.fetch_add(1, Ordering::Relaxed);
            }
            encode_frame_into(&m, &mut out)?;
        }
        if probe_due && closing.is_none() {
            seq += 1;
            last_probe = Some(Instant::now());
            encode_frame_into(
                &Message::ClockProbe {
                    seq,
                    t1: monotonic_ns(),
                },
                &mut out,
            )?;
            sh.probes.fetch_add(1, Ordering::Relaxed);
        }
        let nrec = (rqs.len() + ios.len()) as u64;
        let mut frames = 0u64;
        for chunk in rqs.chunks(cfg.batch_max.max(1)) {
            frames += encode_or_drop(chunk, &Message::GuestRqBatch, &mut out, sh) as u64;
        }
        for chunk in ios.chunks(cfg.batch_max.max(1)) {
            frames += encode_or_drop(chunk, &Message::GuestIoBatch, &mut out, sh) as u64;
        }
        rqs.clear();
        ios.clear();
        if let Some(st) = stats {
            encode_frame_into(&Message::GuestStats(st), &mut out)?;
        }
        if let Some(reason) = &closing {
            encode_frame_into(
                &Message::Bye {
                    reason: reason.clone(),
                },
                &mut out,
            )?;
        }
        if !out.is_empty() {
            if let Err(e) = conn.write_all(&out) {
                sh.dropped_disconnect.fetch_add(nrec, Ordering::Relaxed);
                return Ok(Done::Failed(e.into()));
            }
            sh.sent_records.fetch_add(nrec, Ordering::Relaxed);
            sh.sent_frames.fetch_add(frames, Ordering::Relaxed);
        }
        if closing.is_some() {
            let _ = conn.flush();
            return Ok(Done::Closed);
        }
    }
}

/// Encodes a batch; a single record too large for any frame is dropped and counted.
fn encode_or_drop<T: Clone>(
    items: &[T],
    make: &dyn Fn(Vec<T>) -> Message,
    out: &mut Vec<u8>,
    sh: &Shared,
) -> usize {
    let start = out.len();
    match encode_batches(items, make, out) {
        Ok(n) => n,
        Err(e) => {
            out.truncate(start);
            // Fall back to one record at a time so only the culprit is lost.
            let mut n = 0;
            for it in items {
                match encode_batches(std::slice::from_ref(it), make, out) {
                    Ok(k) => n += k,
                    Err(_) => {
                        sh.dropped_full.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            log::warn!("viotrace transport: dropped an unencodable record: {e}");
            n
        }
    }
}

/// Host side: tokio listeners for AF_VSOCK and Unix (hybrid vsock) sockets.
#[cfg(feature = "host")]
pub mod host {
    use std::collections::{HashMap, VecDeque};
    use std::io;
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
    use tokio::sync::{mpsc, watch};
    use tokio::task::JoinHandle;

    use crate::clock::monotonic_ns;
    use crate::proto::{
        check_version, encode_frame, FrameDecoder, GuestStats, Hello, HelloAck, Message,
        ProtoError, PROTOCOL_VERSION,
    };
    use crate::record::{GuestIo, GuestRq};

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

    #[derive(Clone, Debug)]
    pub struct HostConfig {
        pub listens: Vec<Listen>,
        /// Host-initiated clock ping period.
        pub probe_interval: Duration,
        pub handshake_timeout: Duration,
        pub agent_version: String,
        /// VM labels for vsock CIDs (default label: `cid<N>`).
        pub vm_for_cid: HashMap<u32, String>,
    }

    impl Default for HostConfig {
        fn default() -> Self {
            HostConfig {
                listens: Vec::new(),
                probe_interval: Duration::from_millis(500),
                handshake_timeout: Duration::from_secs(5),
                agent_version: env!("CARGO_PKG_VERSION").to_string(),
                vm_for_cid: HashMap::new(),
            }
        }
    }

    /// A complete clock sample from one connection.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum ClockSample {
        /// Guest probe: `t1`,`t4` guest; `t2`,`t3` host.
        GuestInitiated { t1: u64, t2: u64, t3: u64, t4: u64 },
        /// Host ping: `h1`,`h4` host; `g2`,`g3` guest.
        HostInitiated { h1: u64, g2: u64, g3: u64, h4: u64 },
    }

    #[derive(Clone, Debug, PartialEq)]
    pub enum EventKind {
        Connected(Hello),
        GuestRqs(Vec<GuestRq>),
        GuestIos(Vec<GuestIo>),
        Stats(GuestStats),
        Clock(ClockSample),
        /// The connection ended; `error` when it was dropped for bad data or I/O errors.
        Disconnected {
            reason: String,
            error: bool,
        },
    }

    /// One event from one guest connection.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Event {
        /// Unique per connection.
        pub conn: u64,
        pub origin: Origin,
        pub vm: String,
        pub kind: EventKind,
    }

    /// A running server; dropping it stops accepting, [`Server::shutdown`]
    /// also says `Bye` to connected guests.
    pub struct Server {
        stop: watch::Sender<bool>,
        accept: Vec<JoinHandle<()>>,
        conns: Arc<tokio::sync::Mutex<Vec<JoinHandle<()>>>>,
        pub bound: Vec<Listen>,
    }

    impl Server {
        pub async fn shutdown(self, timeout: Duration) {
            let _ = self.stop.send(true);
            for a in &self.accept {
                a.abort();
            }
            let conns = std::mem::take(&mut *self.conns.lock().await);
            let _ = tokio::time::timeout(timeout, async {
                for c in conns {
                    let _ = c.await;
                }
            })
            .await;
        }
    }

    impl Drop for Server {
        fn drop(&mut self) {
            for a in &self.accept {
                a.abort();
            }
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

    /// What every accept loop needs to start a connection task.
    #[derive(Clone)]
    struct Acceptor {
        cfg: Arc<HostConfig>,
        tx: mpsc::Sender<Event>,
        conns: Arc<tokio::sync::Mutex<Vec<JoinHandle<()>>>>,
        ids: Arc<AtomicU64>,
        stop_rx: watch::Receiver<bool>,
    }

    impl Acceptor {
        /// Serves one accepted stream in its own task, remembered for shutdown.
        async fn spawn<S: AsyncRead + AsyncWrite + Send + 'static>(
            &self,
            stream: S,
            origin: Origin,
            vm: String,
        ) {
            let id = self.ids.fetch_add(1, Ordering::Relaxed);
            let h = tokio::spawn(connection(
                stream,
                id,
                origin,
                vm,
                self.cfg.clone(),
                self.tx.clone(),
                self.stop_rx.clone(),
            ));
            let mut c = self.conns.lock().await;
            c.retain(|h| !h.is_finished());
            c.push(h);
        }
    }

    /// Binds every listener (failing if any cannot be bound) and starts serving.
    pub async fn serve(cfg: HostConfig, tx: mpsc::Sender<Event>) -> io::Result<Server> {
        let (stop, stop_rx) = watch::channel(false);
        let acc = Acceptor {
            cfg: Arc::new(cfg),
            tx,
            conns: Arc::default(),
            ids: Arc::new(AtomicU64::new(1)),
            stop_rx,
        };
        let mut accept = Vec::new();
        for l in &acc.cfg.listens {
            match l.clone() {
                Listen::Unix { path, vm } => {
                    prepare_unix_path(&path)?;
                    let lis = tokio::net::UnixListener::bind(&path).map_err(|e| {
                        io::Error::new(e.kind(), format!("bind {}: {e}", path.display()))
                    })?;
                    let acc = acc.clone();
                    accept.push(tokio::spawn(async move {
                        loop {
                            match lis.accept().await {
                                Ok((s, _)) => {
                                    let origin = Origin::Unix { path: path.clone() };
                                    acc.spawn(s, origin, vm.clone()).await;
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
                    let acc = acc.clone();
                    accept.push(tokio::spawn(async move {
                        loop {
                            match lis.accept().await {
                                Ok((s, peer)) => {
                                    let cid = peer.cid();
                                    let vm = acc
                                        .cfg
                                        .vm_for_cid
                                        .get(&cid)
                                        .cloned()
                                        .unwrap_or_else(|| format!("cid{cid}"));
                                    acc.spawn(s, Origin::Vsock { cid }, vm).await;
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
        Ok(Server {
            stop,
            accept,
            conns: acc.conns.clone(),
            bound: acc.cfg.listens.clone(),
        })
    }

    /// Applies one event to a join engine: clock samples feed the VM's clock,
    /// guest records are joined (results go to `out`), a connection with a new
    /// boot id resets the VM's clock. Returns the events the join does not
    /// consume (connections, statistics, disconnections) for the caller.
    pub fn feed_join(
        engine: &mut crate::join::JoinEngine,
        ev: Event,
        out: &mut Vec<crate::record::JoinedIo>,
    ) -> Option<Event> {
        match ev.kind {
            EventKind::GuestRqs(v) => {
                for rq in v {
                    engine.push_guest(&ev.vm, rq, out);
                }
                None
            }
            EventKind::Clock(ClockSample::GuestInitiated { t1, t2, t3, t4 }) => {
                if let Err(e) = engine.clock(&ev.vm).add_guest_probe(t1, t2, t3, t4) {
                    log::debug!("vm {}: {e}", ev.vm);
                }
                None
            }
            EventKind::Clock(ClockSample::HostInitiated { h1, g2, g3, h4 }) => {
                if let Err(e) = engine.clock(&ev.vm).add_host_probe(h1, g2, g3, h4) {
                    log::debug!("vm {}: {e}", ev.vm);
                }
                None
            }
            EventKind::Connected(ref h) => {
                if engine.guest_connected(&ev.vm, &h.boot_id) {
                    log::info!(
                        "vm {}: guest rebooted (boot id {}), clock reset",
                        ev.vm,
                        h.boot_id
                    );
                }
                Some(ev)
            }
            _ => Some(ev),
        }
    }

    async fn write_msg<W: AsyncWrite + Unpin>(w: &mut W, m: &Message) -> Result<(), ProtoError> {
        let f = encode_frame(m)?;
        w.write_all(&f).await?;
        Ok(())
    }

    enum Step {
        Continue,
        End(String, bool),
    }

    async fn connection<S: AsyncRead + AsyncWrite + Send + 'static>(
        stream: S,
        id: u64,
        origin: Origin,
        vm: String,
        cfg: Arc<HostConfig>,
        tx: mpsc::Sender<Event>,
        mut stop: watch::Receiver<bool>,
    ) {
        let ev = |kind| Event {
            conn: id,
            origin: origin.clone(),
            vm: vm.clone(),
            kind,
        };
        let (mut rd, mut wr) = tokio::io::split(stream);
        let mut dec = FrameDecoder::new();
        let mut buf = vec![0u8; 64 * 1024];

        // Handshake.
        let hello = tokio::time::timeout(cfg.handshake_timeout, async {
            loop {
                if let Some(m) = dec.next_message()? {
                    return Ok::<_, ProtoError>(Some(m));
                }
                let n = rd.read(&mut buf).await?;
                if n == 0 {
                    return Ok(None);
                }
                dec.feed(&buf[..n]);
            }
        })
        .await;
        let hello = match hello {
            Err(_) => Err("no hello within the handshake timeout".to_string()),
            Ok(Err(e)) => Err(format!("bad handshake: {e}")),
            Ok(Ok(None)) => Err("closed before hello".to_string()),
            Ok(Ok(Some(Message::Hello(h)))) => match check_version(h.protocol_version) {
                Ok(()) => Ok(h),
                Err(e) => {
                    let _ = write_msg(
                        &mut wr,
                        &Message::Bye {
                            reason: e.to_string(),
                        },
                    )
                    .await;
                    Err(e.to_string())
                }
            },
            Ok(Ok(Some(m))) => Err(format!("expected hello, got {}", m.name())),
        };
        let hello = match hello {
            Ok(h) => h,
            Err(reason) => {
                log::warn!("viotrace: dropping connection {id} from {origin}: {reason}");
                let _ = tx
                    .send(ev(EventKind::Disconnected {
                        reason,
                        error: true,
                    }))
                    .await;
                return;
            }
        };
        let ack = Message::HelloAck(HelloAck {
            protocol_version: PROTOCOL_VERSION,
            agent_version: cfg.agent_version.clone(),
            vm: vm.clone(),
        });
        if let Err(e) = write_msg(&mut wr, &ack).await {
            let _ = tx
                .send(ev(EventKind::Disconnected {
                    reason: format!("write hello_ack: {e}"),
                    error: true,
                }))
                .await;
            return;
        }
        log::info!(
            "viotrace: guest {} ({}, kernel {}, agent {}) connected from {origin} as vm {vm}",
            hello.hostname,
            hello.boot_id,
            hello.kernel_release,
            hello.agent_version
        );
        if tx.send(ev(EventKind::Connected(hello))).await.is_err() {
            return;
        }

        let mut ping = tokio::time::interval(cfg.probe_interval.max(Duration::from_millis(1)));
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut seq = 0u64;
        let mut outstanding: VecDeque<(u64, u64)> = VecDeque::new();
        let mut write_err: Option<String> = None;
        let (reason, error) = loop {
            let step = tokio::select! {
                _ = stop.changed() => {
                    let _ = write_msg(&mut wr, &Message::Bye { reason: "host agent stopping".into() }).await;
                    Step::End("host agent stopping".into(), false)
                }
                _ = ping.tick(), if write_err.is_none() => {
                    seq += 1;
                    let h1 = monotonic_ns();
                    outstanding.push_back((seq, h1));
                    if outstanding.len() > 16 { outstanding.pop_front(); }
                    // A failed write is reported once the peer's remaining
                    // bytes (maybe a bye) have been read.
                    if let Err(e) = write_msg(&mut wr, &Message::ClockPing { seq, h1 }).await {
                        write_err = Some(format!("write: {e}"));
                    }
                    Step::Continue
                }
                r = rd.read(&mut buf) => {
                    let now = monotonic_ns();
                    match r {
                        Ok(0) => match write_err.take() {
                            Some(e) => Step::End(e, true),
                            None => Step::End("connection closed without bye".into(), false),
                        },
                        Err(e) => Step::End(format!("read: {e}"), true),
                        Ok(n) => {
                            dec.feed(&buf[..n]);
                            let mut step = Step::Continue;
                            loop {
                                let m = match dec.next_message() {
                                    Ok(Some(m)) => m,
                                    Ok(None) => break,
                                    Err(e) => { step = Step::End(format!("bad frame: {e}"), true); break; }
                                };
                                let out = match m {
                                    Message::ClockProbe { seq, t1 } => {
                                        let reply = Message::ClockReply { seq, t1, t2: now, t3: monotonic_ns() };
                                        if write_err.is_none() {
                                            if let Err(e) = write_msg(&mut wr, &reply).await {
                                                write_err = Some(format!("write: {e}"));
                                            }
                                        }
                                        None
                                    }
                                    Message::ClockPong { seq, h1: _, g2, g3 } => {
                                        // Use our own record of h1, not the echo.
                                        match outstanding.iter().position(|e| e.0 == seq) {
                                            Some(i) => {
                                                let (_, h1) = outstanding.remove(i).unwrap_or((seq, 0));
                                                Some(EventKind::Clock(ClockSample::HostInitiated { h1, g2, g3, h4: now }))
                                            }
                                            None => None,
                                        }
                                    }
                                    Message::ClockSample { seq: _, t1, t2, t3, t4 } => {
                                        Some(EventKind::Clock(ClockSample::GuestInitiated { t1, t2, t3, t4 }))
                                    }
                                    Message::GuestRqBatch(v) => Some(EventKind::GuestRqs(v)),
                                    Message::GuestIoBatch(v) => Some(EventKind::GuestIos(v)),
                                    Message::GuestStats(s) => Some(EventKind::Stats(s)),
                                    Message::Bye { reason } => {
                                        step = Step::End(format!("guest said bye: {reason}"), false);
                                        break;
                                    }
                                    other @ (Message::Hello(_) | Message::HelloAck(_)
                                        | Message::ClockReply { .. } | Message::ClockPing { .. }) => {
                                        step = Step::End(format!("protocol violation: unexpected {}", other.name()), true);
                                        break;
                                    }
                                };
                                if let Some(k) = out {
                                    if tx.send(ev(k)).await.is_err() {
                                        step = Step::End("event receiver gone".into(), false);
                                        break;
                                    }
                                }
                            }
                            step
                        }
                    }
                }
            };
            if let Step::End(r, e) = step {
                break (r, e);
            }
        };
        if error {
            log::warn!("viotrace: dropping connection {id} from {origin} (vm {vm}): {reason}");
        } else {
            log::info!("viotrace: connection {id} from {origin} (vm {vm}) ended: {reason}");
        }
        let _ = wr.shutdown().await;
        let _ = tx.send(ev(EventKind::Disconnected { reason, error })).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{read_message, write_message, HelloAck};
    use crate::record::{Op, Points};
    use std::os::unix::net::UnixListener;

    pub(crate) fn tmp_sock(tag: &str) -> PathBuf {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        std::env::temp_dir().join(format!("viotrace-t-{}-{tag}-{n}.sock", std::process::id()))
    }

    pub(crate) fn rq(i: u64) -> GuestRq {
        GuestRq {
            disk: "vda".into(),
            op: Op::Read,
            sector: i * 8,
            bytes: 4096,
            queue: Some(0),
            head: Some((i % 256) as u16),
            pid: i as u32,
            tid: 1,
            comm: "t".into(),
            cgroup_id: 0,
            inode: 0,
            file_offset: None,
            kicked: None,
            bios: 1,
            error: 0,
            ts: Points::new(),
        }
    }

    pub(crate) fn fast_cfg(ep: Endpoint) -> GuestSenderConfig {
        let mut c = GuestSenderConfig::new(ep, local_hello("test", Some(3)));
        c.flush_interval = Duration::from_millis(5);
        c.probe_interval = Duration::from_millis(20);
        c.backoff_min = Duration::from_millis(10);
        c.backoff_max = Duration::from_millis(40);
        c
    }

    #[test]
    fn endpoint_parsing() {
        assert_eq!("vsock".parse::<Endpoint>().unwrap(), Endpoint::default());
        assert_eq!(
            "vsock:6000".parse::<Endpoint>().unwrap(),
            Endpoint::Vsock { cid: 2, port: 6000 }
        );
        assert_eq!(
            "vsock:3:7".parse::<Endpoint>().unwrap(),
            Endpoint::Vsock { cid: 3, port: 7 }
        );
        assert_eq!(
            "unix:/run/x.sock".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("/run/x.sock".into())
        );
        assert_eq!(
            "/run/y".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("/run/y".into())
        );
        assert!("tcp:1".parse::<Endpoint>().is_err());
        assert!("vsock:x".parse::<Endpoint>().is_err());
        assert!("vsock:1:2:3".parse::<Endpoint>().is_err());
        assert_eq!(Endpoint::default().to_string(), "vsock:2:5515");
        assert_eq!(
            hybrid_vsock_path(Path::new("/tmp/v.sock"), 5515),
            PathBuf::from("/tmp/v.sock_5515")
        );
    }

    /// The guest sender against a minimal blocking host: handshake, records,
    /// pong, probe, bye.
    #[test]
    fn guest_sender_against_a_std_host() {
        let path = tmp_sock("std");
        let lis = UnixListener::bind(&path).unwrap();
        let tx = GuestSender::start(fast_cfg(Endpoint::Unix(path.clone()))).unwrap();
        for i in 0..5000 {
            tx.send_rq(rq(i));
        }
        let (mut s, _) = lis.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        match read_message(&mut s).unwrap() {
            Some(Message::Hello(h)) => {
                assert_eq!(h.protocol_version, PROTOCOL_VERSION);
                assert_eq!(h.cid, Some(3));
                assert!(!h.kernel_release.is_empty());
            }
            other => panic!("{other:?}"),
        }
        write_message(
            &mut s,
            &Message::HelloAck(HelloAck {
                protocol_version: PROTOCOL_VERSION,
                agent_version: "h".into(),
                vm: "vm".into(),
            }),
        )
        .unwrap();
        write_message(&mut s, &Message::ClockPing { seq: 7, h1: 1 }).unwrap();
        let mut got = 0usize;
        let mut pong = false;
        let mut probe = None;
        while got < 5000 || !pong || probe.is_none() {
            match read_message(&mut s).unwrap().unwrap() {
                Message::GuestRqBatch(v) => {
                    for (k, r) in v.iter().enumerate() {
                        assert_eq!(r.pid as usize, got + k, "in order");
                    }
                    got += v.len();
                }
                Message::ClockPong { seq, h1, g2, g3 } => {
                    assert_eq!((seq, h1), (7, 1));
                    assert!(g3 >= g2 && g2 > 0);
                    pong = true;
                }
                Message::ClockProbe { seq, t1 } => probe = Some((seq, t1)),
                _ => {}
            }
        }
        let (seq, t1) = probe.unwrap();
        write_message(
            &mut s,
            &Message::ClockReply {
                seq,
                t1,
                t2: 100,
                t3: 101,
            },
        )
        .unwrap();
        loop {
            if let Message::ClockSample {
                seq: s2, t1: a, t4, ..
            } = read_message(&mut s).unwrap().unwrap()
            {
                assert_eq!((s2, a), (seq, t1));
                assert!(t4 >= t1);
                break;
            }
        }
        let st = tx.shutdown("test done", Duration::from_secs(5));
        assert_eq!(st.sent_records, 5000);
        assert_eq!(st.dropped(), 0);
        loop {
            match read_message(&mut s).unwrap() {
                Some(Message::Bye { reason }) => {
                    assert_eq!(reason, "test done");
                    break;
                }
                Some(_) => {}
                None => panic!("closed without bye"),
            }
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn buffer_is_bounded_while_disconnected_and_drains_after_connect() {
        let path = tmp_sock("late");
        let mut cfg = fast_cfg(Endpoint::Unix(path.clone()));
        cfg.max_buffered = 100;
        let tx = GuestSender::start(cfg).unwrap();
        for i in 0..150 {
            tx.send_rq(rq(i));
        }
        std::thread::sleep(Duration::from_millis(60));
        let st = tx.stats();
        assert_eq!(st.dropped_full, 50);
        assert!(st.connect_failures >= 1);
        assert!(!st.connected);
        // The host appears: the 100 newest records arrive.
        let lis = UnixListener::bind(&path).unwrap();
        let (mut s, _) = lis.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(matches!(
            read_message(&mut s).unwrap(),
            Some(Message::Hello(_))
        ));
        write_message(
            &mut s,
            &Message::HelloAck(HelloAck {
                protocol_version: PROTOCOL_VERSION,
                agent_version: "h".into(),
                vm: "vm".into(),
            }),
        )
        .unwrap();
        let mut pids = Vec::new();
        while pids.len() < 100 {
            if let Message::GuestRqBatch(v) = read_message(&mut s).unwrap().unwrap() {
                pids.extend(v.iter().map(|r| r.pid));
            }
        }
        assert_eq!(pids, (50..150).collect::<Vec<u32>>());
        // Host goes away: the sender notices and reconnects later.
        drop(s);
        drop(lis);
        let _ = std::fs::remove_file(&path);
        std::thread::sleep(Duration::from_millis(50));
        tx.send_rq(rq(1));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!tx.stats().connected);
        let st = tx.shutdown("bye", Duration::from_millis(500));
        assert_eq!(st.connects, 1);
    }

    #[test]
    fn host_refusing_the_version_is_not_a_connection() {
        let path = tmp_sock("ver");
        let lis = UnixListener::bind(&path).unwrap();
        let tx = GuestSender::start(fast_cfg(Endpoint::Unix(path.clone()))).unwrap();
        let (mut s, _) = lis.accept().unwrap();
        assert!(matches!(
            read_message(&mut s).unwrap(),
            Some(Message::Hello(_))
        ));
        write_message(
            &mut s,
            &Message::HelloAck(HelloAck {
                protocol_version: PROTOCOL_VERSION + 1,
                agent_version: "h".into(),
                vm: "vm".into(),
            }),
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let st = tx.stats();
        assert_eq!(st.connects, 0);
        assert!(st.connect_failures >= 1);
        drop(tx);
        let _ = std::fs::remove_file(&path);
    }

    #[cfg(feature = "host")]
    mod host_side {
        use super::super::host::*;
        use super::*;
        use std::collections::HashMap;
        use tokio::sync::mpsc;

        async fn next(rx: &mut mpsc::Receiver<Event>) -> Event {
            tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .expect("event within 10 s")
                .expect("channel open")
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn serves_guests_and_survives_a_bad_one() {
            let p1 = tmp_sock("h1");
            let p2 = hybrid_vsock_path(&tmp_sock("h2"), 5515);
            let cfg = HostConfig {
                listens: vec![
                    Listen::Unix {
                        path: p1.clone(),
                        vm: "vm-a".into(),
                    },
                    Listen::Unix {
                        path: p2.clone(),
                        vm: "vm-b".into(),
                    },
                ],
                probe_interval: Duration::from_millis(20),
                ..HostConfig::default()
            };
            let (etx, mut rx) = mpsc::channel(64);
            let server = serve(cfg, etx).await.unwrap();

            // A bad client first: garbage after a valid hello.
            let bad = {
                let p = p1.clone();
                tokio::task::spawn_blocking(move || {
                    let mut s = UnixStream::connect(&p).unwrap();
                    write_message(&mut s, &Message::Hello(local_hello("bad", None))).unwrap();
                    let _ = read_message(&mut s);
                    // The host may already have closed after the bad header.
                    let _ = s.write_all(&u32::MAX.to_le_bytes());
                    let _ = s.write_all(&[1, 2, 3]);
                    let mut b = [0u8; 64];
                    // The host closes on us.
                    while matches!(s.read(&mut b), Ok(n) if n > 0) {}
                })
            };
            // Two good guests.
            let a = GuestSender::start(fast_cfg(Endpoint::Unix(p1.clone()))).unwrap();
            let b = GuestSender::start(fast_cfg(Endpoint::Unix(p2.clone()))).unwrap();
            for i in 0..3000 {
                a.send_rq(rq(i));
                b.send_rq(rq(i));
            }
            let mut recs: HashMap<String, usize> = HashMap::new();
            let mut guest_clock = 0;
            let mut host_clock = 0;
            let mut bad_dropped = false;
            let mut connected = 0;
            while recs.values().sum::<usize>() < 6000
                || guest_clock < 2
                || host_clock < 2
                || !bad_dropped
            {
                let e = next(&mut rx).await;
                match e.kind {
                    EventKind::Connected(h) if h.agent_version == "test" => connected += 1,
                    EventKind::GuestRqs(v) => *recs.entry(e.vm.clone()).or_default() += v.len(),
                    EventKind::Clock(ClockSample::GuestInitiated { t1, t2, t3, t4 }) => {
                        assert!(t4 >= t1 && t3 >= t2);
                        guest_clock += 1;
                    }
                    EventKind::Clock(ClockSample::HostInitiated { h1, g2, g3, h4 }) => {
                        assert!(h4 >= h1 && g3 >= g2);
                        host_clock += 1;
                    }
                    EventKind::Disconnected { reason, error } => {
                        assert!(error, "{reason}");
                        assert!(reason.contains("exceeds the maximum"), "{reason}");
                        assert_eq!(e.vm, "vm-a");
                        bad_dropped = true;
                    }
                    _ => {}
                }
            }
            bad.await.unwrap();
            assert_eq!(connected, 2);
            assert_eq!(recs["vm-a"], 3000);
            assert_eq!(recs["vm-b"], 3000);
            // Same-machine clocks: the offset is ~0 within the stated uncertainty.
            // (Covered by the clock estimator tests; here just the plumbing.)
            let st =
                tokio::task::spawn_blocking(move || a.shutdown("done", Duration::from_secs(5)))
                    .await
                    .unwrap();
            assert_eq!(st.dropped(), 0);
            loop {
                let e = next(&mut rx).await;
                if let EventKind::Disconnected { reason, error } = e.kind {
                    assert!(!error, "{reason}");
                    assert!(reason.contains("bye: done"), "{reason}");
                    break;
                }
            }
            // Host shutdown says bye to the remaining guest.
            server.shutdown(Duration::from_secs(5)).await;
            loop {
                let e = next(&mut rx).await;
                if let EventKind::Disconnected { reason, .. } = e.kind {
                    assert_eq!(reason, "host agent stopping");
                    break;
                }
            }
            drop(b);
            let _ = std::fs::remove_file(&p1);
            let _ = std::fs::remove_file(&p2);
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn handshake_errors_are_reported() {
            let p = tmp_sock("hs");
            let cfg = HostConfig {
                listens: vec![Listen::Unix {
                    path: p.clone(),
                    vm: "v".into(),
                }],
                handshake_timeout: Duration::from_millis(200),
                ..HostConfig::default()
            };
            let (etx, mut rx) = mpsc::channel(8);
            let _server = serve(cfg, etx).await.unwrap();
            let p2 = p.clone();
            tokio::task::spawn_blocking(move || {
                // Wrong first message.
                let mut s = UnixStream::connect(&p2).unwrap();
                write_message(&mut s, &Message::Bye { reason: "x".into() }).unwrap();
                // Wrong version.
                let mut s2 = UnixStream::connect(&p2).unwrap();
                let mut h = local_hello("v", None);
                h.protocol_version = 99;
                write_message(&mut s2, &Message::Hello(h)).unwrap();
                assert!(matches!(
                    read_message(&mut s2).unwrap(),
                    Some(Message::Bye { .. })
                ));
                // Silent client: times out.
                let s3 = UnixStream::connect(&p2).unwrap();
                std::thread::sleep(Duration::from_millis(400));
                drop((s, s2, s3));
            })
            .await
            .unwrap();
            let mut reasons = Vec::new();
            while reasons.len() < 3 {
                if let EventKind::Disconnected { reason, error } = next(&mut rx).await.kind {
                    assert!(error);
                    reasons.push(reason);
                }
            }
            reasons.sort();
            assert!(
                reasons
                    .iter()
                    .any(|r| r.contains("expected hello, got bye")),
                "{reasons:?}"
            );
            assert!(
                reasons
                    .iter()
                    .any(|r| r.contains("unsupported protocol version 99")),
                "{reasons:?}"
            );
            assert!(
                reasons.iter().any(|r| r.contains("handshake timeout")),
                "{reasons:?}"
            );
            let _ = std::fs::remove_file(&p);
        }
    }
}
