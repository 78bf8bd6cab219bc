//! The sender thread's sessions: connect, hello, then a writer loop over the
//! send buffer and a reader thread for the host's acknowledgements and pings,
//! until the buffer is closed and drained or the connection fails (then a new
//! connection, after a back-off).

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::ring::Batch;
use super::super::stream::Conn;
use super::{GuestSenderConfig, Queue, Shared, BATCH_BYTES, CLOSING_DEAD_AFTER};
use crate::clock::monotonic_ns;
use crate::proto::{self, encode_frame_into, GuestStats, Message, ProtoError};

pub(super) fn sender_main(cfg: GuestSenderConfig, sh: Arc<Shared>) {
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
