//! One guest connection: handshake, then records, clock samples and statistics
//! under the VM's budget, with acknowledgements back to the guest.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::mpsc;

use super::ledger::Admit;
use super::{Admission, ClockSample, Event, EventKind, Hub, Origin};
use crate::clock::monotonic_ns;
use crate::proto::{
    check_version, encode_frame, FrameDecoder, Hello, HelloAck, Inbound, Message, ProtoError,
    RawBatch, PROTOCOL_VERSION,
};

/// Largest frame before the handshake is done (a `Hello` is small).
const HANDSHAKE_MAX_FRAME: usize = 4096;
/// A guest that does not take our small writes within this is dropped.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Clock exchanges remembered per connection (to verify what comes back).
const CLOCK_MEMORY: usize = 16;
/// The least a frame costs against the VM's byte budget (so floods of tiny
/// frames are bounded in CPU as well).
const FRAME_COST: usize = 1024;
/// The least a record costs against it: a request record as the guest agent
/// sends it (the BPF layout, `rq_bpf::FIXED_LEN` bytes and the disk's name),
/// so that a guest sending smaller records (the compact form) gets no more
/// records decoded per second than an honest one.
pub(super) const RECORD_COST: usize = crate::proto::rq_bpf::FIXED_LEN;
/// Least room offered to one read (more when the frame being received needs it).
const READ_MIN: usize = 64 * 1024;
/// A clock exchange longer than this is useless and refused.
const MAX_RTT_NS: u64 = 5_000_000_000;

pub(super) struct Conn {
    pub hub: Hub,
    pub id: u64,
    pub origin: Origin,
    pub vm: String,
    pub tx: mpsc::Sender<Event>,
    pub _admission: Admission,
}

/// How a connection ends: the reason, and whether the guest misbehaved.
struct End(String, bool);

/// Prefix of the reason when the guest agent said it is stopping.
const BYE: &str = "guest said bye: ";

impl End {
    fn bad(r: impl Into<String>) -> End {
        End(r.into(), true)
    }
    fn ok(r: impl Into<String>) -> End {
        End(r.into(), false)
    }
    /// A failed write: misbehaviour only when the guest stopped reading; a
    /// guest that went away (maybe right after its bye) is not a bad one.
    fn write(e: ProtoError) -> End {
        match e {
            ProtoError::Violation(_) => End::bad(format!("write: {e}")),
            _ => End::ok(format!("write: {e}")),
        }
    }
}

/// Per-connection protocol state.
struct State {
    session: u64,
    batches: u64,
    ping_seq: u64,
    /// Our pings: (seq, h1).
    pings: VecDeque<(u64, u64)>,
    /// Our replies to guest probes: (seq, t1, t2, t3).
    replies: VecDeque<(u64, u64, u64, u64)>,
    /// Bytes read and records received in batches (delivered or not).
    read: usize,
    records: usize,
}

impl State {
    /// What the connection's reads cost so far: the larger of the bytes and
    /// the records at RECORD_COST (a read is charged what this grew by, so a
    /// frame read in several pieces is charged once).
    fn due(&self) -> usize {
        self.read.max(self.records.saturating_mul(RECORD_COST))
    }
}

impl Conn {
    fn ev(&self, kind: EventKind) -> Event {
        Event {
            conn: self.id,
            origin: self.origin.clone(),
            vm: self.vm.clone(),
            kind,
        }
    }

    async fn send_ev(&self, kind: EventKind) -> Result<(), End> {
        self.tx
            .send(self.ev(kind))
            .await
            .map_err(|_| End::ok("host agent stopped taking events"))
    }

    pub async fn run<S: AsyncRead + AsyncWrite + Send + 'static>(self, stream: S) {
        let (mut rd, mut wr) = tokio::io::split(stream);
        let end = match self.handshake(&mut rd, &mut wr).await {
            Ok((hello, dec)) => {
                let session = hello.session;
                match self.send_ev(EventKind::Connected(hello)).await {
                    Ok(()) => self.serve(session, dec, &mut rd, &mut wr).await,
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        let End(reason, error) = end;
        if error {
            self.hub
                .ledger(&self.vm, |l| l.counters.bad_connections += 1);
            log::warn!(
                "viotrace: dropping connection {} from {} (vm {}): {reason}",
                self.id,
                self.origin,
                self.vm
            );
        } else {
            log::info!(
                "viotrace: connection {} from {} (vm {}) ended: {reason}",
                self.id,
                self.origin,
                self.vm
            );
        }
        if error {
            // Tell the guest why, so it reconnects and resends at once instead of
            // waiting out its silence timeout (some vsock backends do not pass the
            // close on). Best effort, bounded: a guest that does not read loses it.
            let bye = Message::Bye {
                reason: format!("connection dropped: {reason}"),
            };
            let _ = tokio::time::timeout(WRITE_TIMEOUT, write_msg(&mut wr, &bye)).await;
        }
        let _ = tokio::time::timeout(WRITE_TIMEOUT, wr.shutdown()).await;
        let bye = reason.starts_with(BYE);
        let ev = self.ev(EventKind::Disconnected { reason, error, bye });
        let _ = tokio::time::timeout(WRITE_TIMEOUT, self.tx.send(ev)).await;
    }

    async fn handshake<S: AsyncRead + AsyncWrite>(
        &self,
        rd: &mut ReadHalf<S>,
        wr: &mut WriteHalf<S>,
    ) -> Result<(Hello, FrameDecoder), End> {
        let mut dec = FrameDecoder::with_max(HANDSHAKE_MAX_FRAME);
        let mut buf = [0u8; 1024];
        let hello = tokio::time::timeout(self.hub.cfg.handshake_timeout, async {
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
            Err(_) => {
                self.hub
                    .ledger(&self.vm, |l| l.counters.handshake_timeouts += 1);
                return Err(End::bad("no hello within the handshake timeout"));
            }
            Ok(Err(e)) => return Err(End::bad(format!("bad handshake: {e}"))),
            Ok(Ok(None)) => return Err(End::bad("closed before hello")),
            Ok(Ok(Some(Message::Hello(h)))) => h,
            Ok(Ok(Some(m))) => return Err(End::bad(format!("expected hello, got {}", m.name()))),
        };
        if let Err(e) = check_version(hello.protocol_version) {
            let bye = Message::Bye {
                reason: e.to_string(),
            };
            let _ = write_msg(wr, &bye).await;
            return Err(End::bad(e.to_string()));
        }
        let resume = self.hub.ledger(&self.vm, |l| l.resume(hello.session));
        let ack = Message::HelloAck(HelloAck {
            protocol_version: PROTOCOL_VERSION,
            agent_version: self.hub.cfg.agent_version.clone(),
            vm: self.vm.clone(),
            resume,
        });
        write_msg(wr, &ack).await.map_err(End::write)?;
        log::info!(
            "viotrace: guest {} ({}, kernel {}, agent {}, session {:016x}) connected from {} as vm {}",
            hello.hostname,
            hello.boot_id,
            hello.kernel_release,
            hello.agent_version,
            hello.session,
            self.origin,
            self.vm
        );
        // Frames after the handshake may be as large as the budget allows; what
        // was already read stays in the decoder.
        dec.set_max(self.hub.cfg.budget.max_frame);
        Ok((hello, dec))
    }

    async fn serve<S: AsyncRead + AsyncWrite>(
        &self,
        session: u64,
        mut dec: FrameDecoder,
        rd: &mut ReadHalf<S>,
        wr: &mut WriteHalf<S>,
    ) -> End {
        let cfg = &self.hub.cfg;
        let mut stop = self.hub.stop_rx.clone();
        let mut ping = tokio::time::interval(cfg.probe_interval.max(Duration::from_millis(1)));
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut st = State {
            session,
            batches: 0,
            ping_seq: 0,
            pings: VecDeque::new(),
            replies: VecDeque::new(),
            read: 0,
            records: 0,
        };
        // The idle timer is not re-armed by every read: when it fires, it is
        // set again to the idle timeout after the last read, if that is later.
        let mut last_rx = tokio::time::Instant::now();
        let idle = tokio::time::sleep_until(last_rx + cfg.idle_timeout);
        tokio::pin!(idle);
        // One wait for the stop signal, not a new one per pass.
        let stopping = stop.changed();
        tokio::pin!(stopping);
        // Frames decoded before the first read (sent together with the hello).
        if let Err(e) = self.decode_all(&mut st, &mut dec, wr, monotonic_ns()).await {
            return e;
        }
        loop {
            tokio::select! {
                biased;
                _ = &mut stopping => {
                    let bye = Message::Bye { reason: "host agent stopping".into() };
                    let _ = write_msg(wr, &bye).await;
                    return End::ok("host agent stopping");
                }
                _ = ping.tick() => {
                    st.ping_seq += 1;
                    let h1 = monotonic_ns();
                    st.pings.push_back((st.ping_seq, h1));
                    if st.pings.len() > CLOCK_MEMORY { st.pings.pop_front(); }
                    if let Err(e) = write_msg(wr, &Message::ClockPing { seq: st.ping_seq, h1 }).await {
                        return End::write(e);
                    }
                }
                _ = &mut idle => {
                    let due = last_rx + cfg.idle_timeout;
                    if due > tokio::time::Instant::now() {
                        idle.as_mut().reset(due);
                        continue;
                    }
                    self.hub.ledger(&self.vm, |l| l.counters.idle_timeouts += 1);
                    return End::bad(format!("nothing received for {:?}", cfg.idle_timeout));
                }
                r = rd.read_buf(dec.read_room(READ_MIN)) => {
                    let now = monotonic_ns();
                    let n = match r {
                        Ok(0) if dec.pending() > 0 => {
                            return End::bad(format!(
                                "connection closed inside a frame ({} bytes)",
                                dec.pending()
                            ))
                        }
                        Ok(0) => return End::ok("connection closed without bye"),
                        Err(e) => return End::bad(format!("read: {e}")),
                        Ok(n) => n,
                    };
                    last_rx = tokio::time::Instant::now();
                    let (frames, due) = (dec.frames(), st.due());
                    st.read = st.read.saturating_add(n);
                    if let Err(e) = self.decode_all(&mut st, &mut dec, wr, now).await {
                        return e;
                    }
                    // Over its byte budget (each frame costs at least FRAME_COST,
                    // each record RECORD_COST), the VM's socket is not read for a while.
                    let cost = st.due() - due + (dec.frames() - frames) as usize * FRAME_COST;
                    let wait = self.hub.charge_bytes(&self.vm, cost);
                    if !wait.is_zero() {
                        tokio::time::sleep(wait).await;
                    }
                }
            }
        }
    }

    /// Handles every complete frame in the decoder.
    async fn decode_all<W: AsyncWrite>(
        &self,
        st: &mut State,
        dec: &mut FrameDecoder,
        wr: &mut WriteHalf<W>,
        now: u64,
    ) -> Result<(), End> {
        loop {
            match dec.next_inbound() {
                Ok(Some(Inbound::Batch(b))) => self.batch(st, b, wr).await?,
                Ok(Some(Inbound::Message(m))) => self.message(st, m, wr, now).await?,
                Ok(None) => return Ok(()),
                Err(e) => return Err(End::bad(format!("bad frame: {e}"))),
            }
        }
    }

    async fn message<W: AsyncWrite>(
        &self,
        st: &mut State,
        m: Message,
        wr: &mut WriteHalf<W>,
        now: u64,
    ) -> Result<(), End> {
        match m {
            Message::ClockProbe { seq, t1 } => {
                let t3 = monotonic_ns();
                st.replies.push_back((seq, t1, now, t3));
                if st.replies.len() > CLOCK_MEMORY {
                    st.replies.pop_front();
                }
                let reply = Message::ClockReply {
                    seq,
                    t1,
                    t2: now,
                    t3,
                };
                write_msg(wr, &reply).await.map_err(End::write)?;
            }
            Message::ClockSample {
                seq,
                t1,
                t2,
                t3,
                t4,
            } => {
                let ours = st.replies.iter().position(|r| *r == (seq, t1, t2, t3));
                let ok = ours.is_some() && t4 >= t1 && t4 - t1 >= t3 - t2 && t4 - t1 <= MAX_RTT_NS;
                if let Some(i) = ours {
                    st.replies.remove(i);
                }
                let s = ClockSample::GuestInitiated { t1, t2, t3, t4 };
                self.clock(ok, s).await?;
            }
            Message::ClockPong { seq, h1: _, g2, g3 } => {
                // Only our own record of h1 counts, never the echo.
                let ours = st.pings.iter().position(|p| p.0 == seq);
                let h1 = ours.and_then(|i| st.pings.remove(i)).map(|p| p.1);
                let ok = h1.is_some_and(|h1| {
                    g3 >= g2 && now >= h1 && g3 - g2 <= now - h1 && now - h1 <= MAX_RTT_NS
                });
                let s = ClockSample::HostInitiated {
                    h1: h1.unwrap_or(0),
                    g2,
                    g3,
                    h4: now,
                };
                self.clock(ok, s).await?;
            }
            Message::GuestStats(s) => {
                self.hub.ledger(&self.vm, |l| {
                    l.session(st.session).on_stats(s.produced, s.dropped_full)
                });
                self.send_ev(EventKind::Stats(s)).await?;
            }
            Message::Bye { reason } => {
                return Err(End::ok(format!("{BYE}{reason}")));
            }
            other @ (Message::Hello(_)
            | Message::HelloAck(_)
            | Message::Batch { .. }
            | Message::ClockReply { .. }
            | Message::ClockPing { .. }
            | Message::Ack { .. }) => {
                return Err(End::bad(format!(
                    "protocol violation: unexpected {}",
                    other.name()
                )));
            }
        }
        Ok(())
    }

    async fn clock(&self, verified: bool, s: ClockSample) -> Result<(), End> {
        if !verified {
            self.hub
                .ledger(&self.vm, |l| l.counters.clock_rejected += 1);
            return Ok(());
        }
        if !self.hub.clock_allowed(&self.vm) {
            return Ok(());
        }
        self.hub.ledger(&self.vm, |l| l.counters.clock_samples += 1);
        self.send_ev(EventKind::Clock(s)).await
    }

    async fn batch<W: AsyncWrite>(
        &self,
        st: &mut State,
        mut batch: RawBatch,
        wr: &mut WriteHalf<W>,
    ) -> Result<(), End> {
        let first_seq = batch.first_seq;
        let max = self.hub.cfg.budget.max_batch_records;
        if batch.len() > max {
            return Err(End::bad(format!(
                "batch of {} records (at most {max})",
                batch.len()
            )));
        }
        let first_on_conn = st.batches == 0;
        st.batches += 1;
        st.records += batch.len();
        let admit = self.hub.ledger(&self.vm, |l| {
            l.session(st.session)
                .on_batch(first_seq, batch.len(), first_on_conn)
        });
        let skip = match admit {
            Admit::Deliver { skip } => skip,
            Admit::Resync { expected } => {
                let reason = format!(
                    "sequence gap: expected record {expected}, got {first_seq}; reconnect and resend"
                );
                let _ = write_msg(
                    wr,
                    &Message::Bye {
                        reason: reason.clone(),
                    },
                )
                .await;
                return Err(End::ok(reason));
            }
        };
        batch.skip(skip);
        if !batch.is_empty() {
            // The VM's budget of records waiting for the agent: wait
            // (and so stop reading this guest) until the agent catches up.
            let sem = self.hub.pending(&self.vm);
            let want = (batch.len() as u32).min(sem_max(&self.hub));
            let permit = match sem.clone().try_acquire_many_owned(want) {
                Ok(p) => {
                    if sem.available_permits() < (sem_max(&self.hub) / 2) as usize {
                        self.hub.wake.ring();
                    }
                    p
                }
                Err(_) => {
                    self.hub.wake.ring();
                    let t = std::time::Instant::now();
                    let p = sem
                        .acquire_many_owned(want)
                        .await
                        .map_err(|_| End::ok("budget closed"))?;
                    let ms = t.elapsed().as_millis() as u64;
                    self.hub
                        .ledger(&self.vm, |l| l.counters.backpressure_ms += ms);
                    p
                }
            };
            self.send_ev(EventKind::Records {
                batch,
                permit: Some(permit),
            })
            .await?;
        }
        let next_seq = self.hub.ledger(&self.vm, |l| l.session(st.session).next);
        write_msg(wr, &Message::Ack { next_seq })
            .await
            .map_err(End::write)
    }
}

fn sem_max(hub: &Hub) -> u32 {
    hub.cfg.budget.records_pending.min(u32::MAX as usize) as u32
}

async fn write_msg<W: AsyncWrite>(w: &mut WriteHalf<W>, m: &Message) -> Result<(), ProtoError> {
    let f = encode_frame(m)?;
    match tokio::time::timeout(WRITE_TIMEOUT, w.write_all(&f)).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(ProtoError::Violation("guest does not read".into())),
    }
}
