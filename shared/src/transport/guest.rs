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

use super::ring::RecordRing;
use super::Endpoint;
use crate::clock::monotonic_ns;
use crate::proto::{
    self, encode_record_into, GuestRecord, GuestRecordRef, GuestStats, Hello, Message,
    PROTOCOL_VERSION,
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

#[path = "guest_session.rs"]
mod session;
use session::sender_main;

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

#[cfg(test)]
#[path = "guest_tests.rs"]
pub(crate) mod tests;
