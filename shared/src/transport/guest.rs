//! The guest agent's sender: one writer thread (plus a reader per connection).
//!
//! Accounting: a record offered with [`GuestSender::send`] either gets the
//! session's next sequence number and waits in the send buffer until the host
//! acknowledges it, or — when the buffer is full — is refused and counted in
//! `dropped_full` (records are never evicted once numbered, so what the host
//! has not acknowledged is always still here to resend). At every moment
//! `offered = acked + buffered + dropped_full`; at shutdown what is still
//! unacknowledged is counted as `unacked_at_exit`.

use std::collections::VecDeque;
use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::ring::{Batch, RecordRing};
use super::stream::Conn;
use super::Endpoint;
use crate::clock::monotonic_ns;
use crate::proto::{
    self, encode_frame_into, encode_record_into, GuestRecord, GuestRecordRef, GuestStats, Hello,
    Message, ProtoError, PROTOCOL_VERSION,
};
use crate::record::GuestRq;

pub use super::stream::WRITE_CHUNK;
/// Largest batch frame the guest builds (the host refuses batch frames above
/// its own, larger, limit).
pub const BATCH_BYTES: usize = 128 * 1024;

/// While closing, a connection on which the host has not pinged for this long
/// (it pings every second) is given up in favour of one last new connection.
const CLOSING_DEAD_AFTER: Duration = Duration::from_secs(2);

/// Guest sender settings.
#[derive(Clone, Debug)]
pub struct GuestSenderConfig {
    pub endpoint: Endpoint,
    pub hello: Hello,
    /// Records kept until acknowledged (sent or not); beyond this new records are refused.
    pub max_buffered: usize,
    /// Bytes (encoded) kept until acknowledged; beyond this new records are refused.
    pub max_buffered_bytes: usize,
    /// Records per batch frame (a batch also stays under [`BATCH_BYTES`]).
    pub batch_max: usize,
    /// Longest time a record waits before its batch is sent.
    pub flush_interval: Duration,
    /// Guest-initiated clock probe period (zero: never).
    pub probe_interval: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// How long to wait for the host's `HelloAck`.
    pub handshake_timeout: Duration,
    /// A connection on which nothing arrived for this long is given up (the host
    /// pings every second): some vsock backends keep a guest socket open after
    /// the host side closed it.
    pub dead_after: Duration,
}

impl GuestSenderConfig {
    pub fn new(endpoint: Endpoint, hello: Hello) -> Self {
        GuestSenderConfig {
            endpoint,
            hello,
            max_buffered: 32_768,
            max_buffered_bytes: 4 << 20,
            batch_max: 1024,
            flush_interval: Duration::from_millis(100),
            probe_interval: Duration::from_secs(1),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            dead_after: Duration::from_secs(5),
        }
    }
}

/// This guest's own vsock CID, when a vsock transport is loaded.
pub fn local_cid() -> Option<u32> {
    vsock::get_local_cid().ok()
}

/// A random session id (agent instance identity) from the kernel's RNG.
fn random_session() -> u64 {
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        // No urandom: time and pid still tell agent instances apart.
        let t = monotonic_ns() ^ u64::from(std::process::id()).rotate_left(40);
        b = t.to_le_bytes();
    }
    u64::from_le_bytes(b)
}

/// Builds a [`Hello`] from this machine's facts (`/proc`), with `agent_version`
/// and a fresh random session id.
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
        session: random_session(),
    }
}

/// Counters of the guest sender.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SenderStats {
    /// Records numbered (accepted into the send buffer).
    pub produced: u64,
    /// Records the host acknowledged (delivered or counted by the host).
    pub acked: u64,
    /// Records refused because the send buffer was full (never numbered).
    pub dropped_full: u64,
    /// Records still unacknowledged when the sender stopped.
    pub unacked_at_exit: u64,
    /// Records sent more than once (after a reconnection).
    pub resent: u64,
    pub sent_frames: u64,
    pub connects: u64,
    pub connect_failures: u64,
    pub probes_sent: u64,
    pub pongs_sent: u64,
    pub connected: bool,
}

impl SenderStats {
    /// Records lost for good on this side.
    pub fn lost(&self) -> u64 {
        self.dropped_full + self.unacked_at_exit
    }
    /// Records offered to the sender.
    pub fn offered(&self) -> u64 {
        self.produced + self.dropped_full
    }
}

/// The send buffer: records `base..next_seq`, oldest first; `sent()` is the
/// next one to write on the current connection (the ring's cursor).
#[derive(Default)]
struct Queue {
    ring: RecordRing,
    base: u64,
    /// Highest sequence number ever written (to count resends).
    sent_high: u64,
    unsent_since: Option<Instant>,
    control: VecDeque<Message>,
    stats: Option<GuestStats>,
    closing: Option<String>,
}

impl Queue {
    fn next_seq(&self) -> u64 {
        self.base + self.ring.len() as u64
    }
    /// The next record to write on the current connection.
    fn sent(&self) -> u64 {
        self.base + self.ring.sent() as u64
    }
    fn unsent(&self) -> usize {
        self.ring.unsent()
    }
    /// Forgets everything below `seq` (acknowledged by the host).
    fn ack(&mut self, seq: u64) -> u64 {
        let n = seq.min(self.next_seq()).saturating_sub(self.base);
        self.ring.pop_front(n as usize);
        self.base += n;
        n
    }
}

#[derive(Default)]
struct Counters {
    dropped_full: AtomicU64,
    acked: AtomicU64,
    unacked_at_exit: AtomicU64,
    resent: AtomicU64,
    sent_frames: AtomicU64,
    connects: AtomicU64,
    connect_failures: AtomicU64,
    probes: AtomicU64,
    pongs: AtomicU64,
    connected: AtomicBool,
    /// `CLOCK_MONOTONIC` time anything last arrived from the host.
    last_rx: AtomicU64,
}

struct Shared {
    q: Mutex<Queue>,
    cv: Condvar,
    max: usize,
    max_bytes: usize,
    batch_max: usize,
    c: Counters,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A poisoned lock only means another thread panicked mid-update of a
        // plain queue; the data is still usable.
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn count(&self, c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// Guest-side sender.
pub struct GuestSender {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl GuestSender {
    /// Starts the background sender; it connects (and reconnects) on its own.
    /// Records offered before the first connection wait in the buffer.
    pub fn start(cfg: GuestSenderConfig) -> io::Result<GuestSender> {
        let shared = Arc::new(Shared {
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            max: cfg.max_buffered.max(1),
            max_bytes: cfg.max_buffered_bytes.max(1),
            batch_max: cfg.batch_max.max(1),
            c: Counters::default(),
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

    /// Offers one record: numbered and buffered, or refused and counted.
    pub fn send(&self, rec: &GuestRecord) {
        self.send_ref(&rec.borrowed())
    }

    /// [`Self::send`] of a record the caller keeps (it is encoded at once).
    pub fn send_ref(&self, rec: &GuestRecordRef<'_>) {
        // (Larger than any frame: it can never be delivered.)
        self.offer(|buf| encode_record_into(rec, buf).is_ok());
    }

    /// Offers a request record in the guest BPF object's layout, as the ring
    /// buffer holds it ([`proto::rq_bpf`]): copied, not decoded or encoded.
    /// One that is not such a record is refused and counted like a full
    /// buffer's.
    pub fn send_rq_bpf(&self, bpf: &[u8], wall_offset: i64, disk: &str) {
        self.offer(|buf| {
            buf.clear();
            proto::rq_bpf::encode_record(bpf, wall_offset, disk, buf).is_some()
        });
    }

    /// Numbers and buffers the record `encode` writes into the scratch buffer
    /// (cleared by it), or counts it refused (`encode` false, or no room).
    fn offer(&self, encode: impl FnOnce(&mut Vec<u8>) -> bool) {
        let sh = &self.shared;
        thread_local! {
            /// Where this thread encodes its records (one allocation, reused).
            static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let unsent = SCRATCH.with_borrow_mut(|buf| {
            if !encode(buf) {
                return None;
            }
            let mut q = sh.lock();
            if q.ring.len() >= sh.max || q.ring.bytes() + buf.len() > sh.max_bytes {
                return None;
            }
            q.ring.push(buf);
            let unsent = q.unsent();
            if unsent == 1 {
                q.unsent_since = Some(Instant::now());
            }
            Some(unsent)
        });
        let Some(unsent) = unsent else {
            sh.count(&sh.c.dropped_full, 1);
            return;
        };
        // The writer sleeps at most a flush interval while records wait; wake
        // it only when the first record arrives or a batch is full (a wake-up
        // per record would cost a syscall each).
        if unsent == 1 || unsent == sh.batch_max {
            sh.cv.notify_one();
        }
    }

    pub fn send_rq(&self, rq: &GuestRq) {
        self.send_ref(&GuestRecordRef::Rq(rq));
    }

    /// Queues a statistics snapshot (replaces an unsent one), sent with the
    /// next write (at the latest the next clock probe); the sender's own
    /// accounting (`produced`, `dropped_full`) is filled in.
    pub fn send_stats(&self, mut st: GuestStats) {
        let sh = &self.shared;
        let mut q = sh.lock();
        st.produced = q.next_seq();
        st.dropped_full = sh.c.dropped_full.load(Ordering::Relaxed);
        // (Sent with the next write, see `next_work`.)
        q.stats = Some(st);
    }

    pub fn stats(&self) -> SenderStats {
        let s = &self.shared;
        let produced = s.lock().next_seq();
        let ld = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SenderStats {
            produced,
            acked: ld(&s.c.acked),
            dropped_full: ld(&s.c.dropped_full),
            unacked_at_exit: ld(&s.c.unacked_at_exit),
            resent: ld(&s.c.resent),
            sent_frames: ld(&s.c.sent_frames),
            connects: ld(&s.c.connects),
            connect_failures: ld(&s.c.connect_failures),
            probes_sent: ld(&s.c.probes),
            pongs_sent: ld(&s.c.pongs),
            connected: s.c.connected.load(Ordering::Relaxed),
        }
    }

    /// Sends what is buffered and waits for the host's acknowledgement within
    /// `timeout`, says `Bye`, and stops. What is still unacknowledged then is
    /// counted in `unacked_at_exit`.
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
            // Otherwise the thread is stuck connecting or writing; it is
            // detached and exits at its next check of `closing`.
        }
        let mut q = self.shared.lock();
        let left = q.ring.len() as u64;
        let next = q.next_seq();
        q.ring.clear();
        q.base = next;
        drop(q);
        self.shared.count(&self.shared.c.unacked_at_exit, left);
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
        let closing = sh.lock().closing.is_some();
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
                sh.count(&sh.c.connect_failures, 1);
                log::debug!(
                    "viotrace transport: connect to {} failed: {e}",
                    cfg.endpoint
                );
            }
        }
        sh.c.connected.store(false, Ordering::Relaxed);
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

/// One connection: handshake, resume where the host says, then stream until
/// failure or shutdown.
fn session(cfg: &GuestSenderConfig, sh: &Arc<Shared>) -> Result<Done, ProtoError> {
    let mut conn = Conn::connect(&cfg.endpoint)?;
    conn.set_write_timeout(Some(cfg.dead_after))?;
    conn.set_read_timeout(Some(cfg.handshake_timeout))?;
    let mut hello = Vec::new();
    encode_frame_into(&Message::Hello(cfg.hello.clone()), &mut hello)?;
    conn.write_chunked(&hello)?;
    let resume = match proto::read_message(&mut conn)? {
        Some(Message::HelloAck(ack)) => {
            proto::check_version(ack.protocol_version)?;
            log::info!(
                "viotrace transport: connected to {} (host agent {}, vm {:?}, resume at {:?})",
                cfg.endpoint,
                ack.agent_version,
                ack.vm,
                ack.resume
            );
            ack.resume
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
    };
    conn.set_read_timeout(None)?;
    {
        // Everything below `resume` reached the host; resend the rest.
        let mut q = sh.lock();
        let n = resume.map_or(0, |r| q.ack(r));
        sh.count(&sh.c.acked, n);
        q.ring.rewind();
        q.unsent_since = (q.unsent() > 0).then(Instant::now);
    }
    sh.count(&sh.c.connects, 1);
    sh.c.connected.store(true, Ordering::Relaxed);
    sh.c.last_rx.store(monotonic_ns(), Ordering::Relaxed);

    // Reader: acknowledgements, pings (answered via the control queue) and
    // replies to our probes.
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
    let mut dec = proto::FrameDecoder::with_max(64 * 1024);
    let mut buf = vec![0u8; 16 * 1024];
    let stop = |why: Option<String>| {
        if let Some(w) = why {
            log::warn!("viotrace transport: {w}");
        }
        alive.store(false, Ordering::Relaxed);
        sh.cv.notify_all();
    };
    loop {
        let n = match conn.read(&mut buf) {
            Ok(0) | Err(_) => return stop(None),
            Ok(n) => n,
        };
        let now = monotonic_ns();
        sh.c.last_rx.store(now, Ordering::Relaxed);
        dec.feed(&buf[..n]);
        loop {
            let ctl = match dec.next_message() {
                Ok(None) => break,
                Ok(Some(Message::Ack { next_seq })) => {
                    let n = sh.lock().ack(next_seq);
                    sh.count(&sh.c.acked, n);
                    sh.cv.notify_all();
                    continue;
                }
                // g3 is stamped by the writer right before sending.
                Ok(Some(Message::ClockPing { seq, h1 })) => Message::ClockPong {
                    seq,
                    h1,
                    g2: now,
                    g3: 0,
                },
                Ok(Some(Message::ClockReply { seq, t1, t2, t3 })) => Message::ClockSample {
                    seq,
                    t1,
                    t2,
                    t3,
                    t4: now,
                },
                Ok(Some(Message::Bye { reason })) => {
                    log::info!("viotrace transport: host said bye: {reason}");
                    return stop(None);
                }
                Ok(Some(other)) => {
                    log::debug!("viotrace transport: ignoring {} from host", other.name());
                    continue;
                }
                Err(e) => return stop(Some(format!("bad data from host: {e}"))),
            };
            sh.lock().control.push_back(ctl);
            sh.cv.notify_all();
        }
    }
}

/// What one pass of the writer takes out of the shared queue.
struct Work {
    /// Batch frames of records due, written first.
    batches: Vec<Batch>,
    control: Vec<Message>,
    stats: Option<GuestStats>,
    closing: Option<String>,
    probe: bool,
}

/// Waits until there is something to write (or the connection died), then
/// takes the batch frames of the records due and the control messages.
fn next_work(
    cfg: &GuestSenderConfig,
    sh: &Shared,
    alive: &AtomicBool,
    last_probe: Option<Instant>,
) -> Work {
    let probe_in = |lp: Option<Instant>| {
        if cfg.probe_interval.is_zero() {
            Duration::MAX
        } else {
            lp.map_or(Duration::ZERO, |t| {
                cfg.probe_interval.saturating_sub(t.elapsed())
            })
        }
    };
    let flush_in = |q: &Queue| {
        q.unsent_since.map_or(Duration::MAX, |t| {
            cfg.flush_interval.saturating_sub(t.elapsed())
        })
    };
    // A statistics snapshot waits for the next write (a probe, a pong, a
    // batch): it cost the host agent a wakeup of its own every second. Clock
    // messages go at once: the host takes a pong's round trip, and until a
    // VM's first sample the join defers ambiguous pairs, which then reach the
    // why-slow baselines late (a 1 s wait for the first sample left the first
    // burst of a why_slow test without verdicts).
    let ready = |q: &Queue| {
        !q.control.is_empty()
            || (q.stats.is_some() && cfg.probe_interval.is_zero())
            || q.closing.is_some()
            || q.unsent() >= sh.batch_max
            || (q.unsent() > 0 && flush_in(q).is_zero())
    };
    let mut q = sh.lock();
    if !ready(&q) && !probe_in(last_probe).is_zero() {
        let wait = flush_in(&q)
            .min(probe_in(last_probe))
            .min(Duration::from_secs(1))
            .max(Duration::from_millis(1));
        q = sh
            .cv
            .wait_timeout_while(q, wait, |q| !ready(q) && alive.load(Ordering::Relaxed))
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    let flush = q.unsent() > 0
        && (q.closing.is_some() || q.unsent() >= sh.batch_max || flush_in(&q).is_zero());
    let mut batches = Vec::new();
    if flush {
        // At most 16 full batches per pass, so control messages never wait long.
        let limit = if q.closing.is_some() { usize::MAX } else { 16 };
        while batches.len() < limit {
            let first = q.sent();
            let room = BATCH_BYTES - proto::BATCH_OVERHEAD;
            let Some(b) = q.ring.next_batch(first, sh.batch_max, room) else {
                break;
            };
            let n = q.sent() - first;
            let resent = q.sent_high.saturating_sub(first).min(n);
            sh.count(&sh.c.resent, resent);
            q.sent_high = q.sent_high.max(first + n);
            batches.push(b);
        }
        sh.count(&sh.c.sent_frames, batches.len() as u64);
        q.unsent_since = (q.unsent() > 0).then(Instant::now);
    }
    Work {
        batches,
        control: q.control.drain(..).collect(),
        stats: q.stats.take(),
        closing: q.closing.clone(),
        probe: probe_in(last_probe).is_zero(),
    }
}

/// The end of a connection on which nothing arrived from the host for longer
/// than `limit` (`when` completes the reason).
fn host_silent(sh: &Shared, limit: Duration, when: &str) -> Option<Done> {
    let silent = monotonic_ns().saturating_sub(sh.c.last_rx.load(Ordering::Relaxed));
    (silent > limit.as_nanos() as u64).then(|| {
        Done::Failed(ProtoError::Violation(format!(
            "nothing from the host for {:.1} s{when}",
            silent as f64 / 1e9
        )))
    })
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
    loop {
        if !alive.load(Ordering::Relaxed) {
            return Ok(Done::Failed(ProtoError::Violation(
                "connection closed by host".into(),
            )));
        }
        if let Some(dead) = host_silent(sh, cfg.dead_after, "") {
            return Ok(dead);
        }
        out.clear();
        let w = next_work(cfg, sh, alive, last_probe);
        for mut m in w.control {
            if let Message::ClockPong { g3, .. } = &mut m {
                *g3 = monotonic_ns();
                sh.count(&sh.c.pongs, 1);
            }
            encode_frame_into(&m, &mut out)?;
        }
        if w.probe && w.closing.is_none() {
            seq += 1;
            last_probe = Some(Instant::now());
            let t1 = monotonic_ns();
            encode_frame_into(&Message::ClockProbe { seq, t1 }, &mut out)?;
            sh.count(&sh.c.probes, 1);
        }
        if let Some(st) = w.stats {
            encode_frame_into(&Message::GuestStats(st), &mut out)?;
        }
        if let Some(reason) = &w.closing {
            let st = GuestStats {
                ts: monotonic_ns(),
                produced: sh.lock().next_seq(),
                dropped_full: sh.c.dropped_full.load(Ordering::Relaxed),
                counters: Vec::new(),
            };
            encode_frame_into(&Message::GuestStats(st), &mut out)?;
            encode_frame_into(
                &Message::Bye {
                    reason: reason.clone(),
                },
                &mut out,
            )?;
        }
        // The batches from the ring's blocks as they lie, then the rest.
        let bufs: Vec<&[u8]> = w
            .batches
            .iter()
            .flat_map(Batch::slices)
            .chain([out.as_slice()])
            .collect();
        if let Err(e) = conn.write_all_chunked(&bufs) {
            return Ok(Done::Failed(e.into()));
        }
        if w.closing.is_some() {
            // Wait for the host to acknowledge everything (the caller's
            // shutdown timeout bounds this), or for it to go away. A host that
            // has not pinged for `CLOSING_DEAD_AFTER` is taken as gone: the
            // connection may have died unnoticed, and one more attempt on a new
            // one can still deliver the rest within the shutdown timeout.
            let mut q = sh.lock();
            while q.base < q.next_seq() && alive.load(Ordering::Relaxed) {
                if let Some(dead) = host_silent(sh, CLOSING_DEAD_AFTER, " while closing") {
                    return Ok(dead);
                }
                q = sh
                    .cv
                    .wait_timeout(q, Duration::from_millis(100))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            return Ok(Done::Closed);
        }
    }
}

#[cfg(test)]
#[path = "guest_tests.rs"]
pub(crate) mod tests;
