//! A hostile guest: attacks a host agent's guest socket the way any process
//! that speaks the wire protocol could (on a hybrid-vsock socket, or from a
//! compromised guest over vsock). Used by the hostile-guest lab test and by
//! `viotrace-vm attack`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;
use viotrace_shared::proto::{
    encode_frame, encode_record, read_message, write_message, GuestRecord, Message, FRAME_HEADER,
};
use viotrace_shared::record::{GuestRq, Op, Point, Points};
use viotrace_shared::transport::local_hello;

/// What one attack did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct AttackReport {
    pub attack: String,
    pub connections: u64,
    /// Connections the host closed or refused before the attack was done with them.
    pub refused: u64,
    pub frames: u64,
    pub records: u64,
    pub bytes: u64,
    /// Records with bad contents in batches the host acknowledged (the host
    /// agent must count each as malformed).
    pub bad_records: u64,
    pub secs: f64,
}

fn fake_rq(i: u64) -> GuestRq {
    let mut ts = Points::new();
    // Far-future, made-up times.
    ts.set(Point::RqIssue, (1 << 60) + i * 1000);
    ts.set(Point::RqComplete, (1 << 60) + i * 1000 + 500);
    GuestRq {
        time: None,
        disk: "vdb".into(),
        op: Op::Read,
        sector: i * 8,
        bytes: 4096,
        queue: Some(0),
        head: Some((i % 256) as u16),
        pid: 666,
        tid: 666,
        comm: "attacker".into(),
        cgroup_id: 0,
        inode: 0,
        file_offset: None,
        kicked: Some(true),
        bios: 1,
        error: 0,
        ts,
    }
}

/// An attacker's admitted connection. Dropping it shuts the socket down, so the
/// host sees the end at once although `drain`'s thread still holds a clone of it
/// (else the connection would linger, holding one of the VM's slots, until the
/// host's idle timeout).
struct Conn(UnixStream);

impl std::ops::Deref for Conn {
    type Target = UnixStream;
    fn deref(&self) -> &UnixStream {
        &self.0
    }
}

impl std::ops::DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut UnixStream {
        &mut self.0
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        let _ = self.0.shutdown(std::net::Shutdown::Both);
    }
}

/// Connects and completes the handshake; `None` if the host refused.
fn hello(path: &Path) -> Option<Conn> {
    let mut s = UnixStream::connect(path).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.set_write_timeout(Some(Duration::from_secs(2))).ok()?;
    write_message(&mut s, &Message::Hello(local_hello("attacker", None))).ok()?;
    let mut hdr = [0u8; FRAME_HEADER];
    s.read_exact(&mut hdr).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(hdr) as usize];
    s.read_exact(&mut body).ok()?;
    Some(Conn(s))
}

/// Reads and discards whatever the host sends (acks, pings), so the host's
/// writes never block: the flood runs at full speed.
fn drain(s: &UnixStream) {
    if let Ok(mut r) = s.try_clone() {
        std::thread::spawn(move || {
            let mut b = [0u8; 4096];
            while matches!(r.read(&mut b), Ok(n) if n > 0) {}
        });
    }
}

/// Well-formed record batches as fast as possible for `dur`, `per_frame`
/// records a frame (≈ 1 MiB frames with 14_000), reconnecting when dropped.
pub fn flood(path: &Path, dur: Duration, per_frame: usize) -> AttackReport {
    let mut rep = AttackReport {
        attack: format!("flood({per_frame} records/frame)"),
        ..Default::default()
    };
    let t = Instant::now();
    let recs: Vec<Vec<u8>> = (0..per_frame as u64)
        .map(|i| encode_record(&GuestRecord::Rq(fake_rq(i))).unwrap_or_default())
        .collect();
    let mut seq = 0u64;
    while t.elapsed() < dur {
        rep.connections += 1;
        let Some(mut s) = hello(path) else {
            rep.refused += 1;
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        drain(&s);
        while t.elapsed() < dur {
            let mut f = Vec::with_capacity(per_frame * 64);
            viotrace_shared::proto::batch_frame(
                seq,
                recs.len(),
                recs.iter().map(Vec::as_slice),
                &mut f,
            );
            if s.write_all(&f).is_err() {
                rep.refused += 1;
                break;
            }
            seq += per_frame as u64;
            rep.frames += 1;
            rep.records += per_frame as u64;
            rep.bytes += f.len() as u64;
        }
    }
    rep.secs = t.elapsed().as_secs_f64();
    rep
}

/// Clock samples with host timestamps the host never took, and pongs that
/// answer pings never sent or contradict causality: for `dur` of admitted
/// connection time, trying for up to 20 s more to be admitted (earlier attacks
/// may still hold the VM's connection slots).
pub fn forged_clock(path: &Path, dur: Duration) -> AttackReport {
    let mut rep = AttackReport {
        attack: "forged clock samples and pongs".into(),
        ..Default::default()
    };
    let t = Instant::now();
    let give_up = dur + Duration::from_secs(20);
    let mut forged = Duration::ZERO;
    while forged < dur && t.elapsed() < give_up {
        rep.connections += 1;
        let Some(mut s) = hello(path) else {
            rep.refused += 1;
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        drain(&s);
        let admitted = Instant::now();
        let mut i = 0u64;
        while forged + admitted.elapsed() < dur {
            i += 1;
            let msgs = [
                Message::ClockSample {
                    seq: i,
                    t1: 1000,
                    t2: i * 1_000_000_000_000,
                    t3: i * 1_000_000_000_000 + 1,
                    t4: 2000,
                },
                Message::ClockPong {
                    seq: 1_000_000 + i,
                    h1: 0,
                    g2: 5,
                    g3: 1,
                },
            ];
            let mut buf = Vec::new();
            for m in &msgs {
                buf.extend(encode_frame(m).unwrap_or_default());
            }
            if s.write_all(&buf).is_err() {
                rep.refused += 1;
                break;
            }
            rep.frames += 2;
            rep.bytes += buf.len() as u64;
            std::thread::sleep(Duration::from_micros(200));
        }
        if rep.frames > 0 {
            forged += admitted.elapsed();
        } else {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    rep.secs = t.elapsed().as_secs_f64();
    rep
}

/// `n` connections that each start a ~1 MiB frame and hold it for `hold`.
pub fn half_open(path: &Path, n: usize, hold: Duration) -> AttackReport {
    let mut rep = AttackReport {
        attack: format!("{n} half-open connections"),
        ..Default::default()
    };
    let t = Instant::now();
    let mut held = Vec::new();
    for _ in 0..n {
        rep.connections += 1;
        match UnixStream::connect(path) {
            Ok(mut s) => {
                let mut f = ((1u32 << 20) - 1).to_le_bytes().to_vec();
                f.extend(std::iter::repeat_n(0u8, 60 * 1024));
                let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
                match s.write_all(&f) {
                    Ok(()) => {
                        rep.bytes += f.len() as u64;
                        held.push(s);
                    }
                    Err(_) => rep.refused += 1,
                }
            }
            Err(_) => rep.refused += 1,
        }
    }
    std::thread::sleep(hold);
    // Which of them did the host keep open?
    for s in &held {
        let _ = s.set_nonblocking(true);
        let mut b = [0u8; 1];
        if matches!((&*s).read(&mut b), Ok(0)) {
            rep.refused += 1;
        }
    }
    rep.secs = t.elapsed().as_secs_f64();
    rep
}

/// `n` connect-and-close cycles as fast as possible.
pub fn reconnects(path: &Path, n: usize) -> AttackReport {
    let mut rep = AttackReport {
        attack: format!("{n} reconnects"),
        ..Default::default()
    };
    let t = Instant::now();
    for _ in 0..n {
        rep.connections += 1;
        match UnixStream::connect(path) {
            Ok(mut s) => {
                let _ = write_message(&mut s, &Message::Hello(local_hello("attacker", None)));
            }
            Err(_) => rep.refused += 1,
        }
    }
    rep.secs = t.elapsed().as_secs_f64();
    rep
}

/// `batches` frames of 10 request records, every other one with bad
/// contents (its points cut inside a number) in a sound frame, on one
/// admitted connection (tried for up to 20 s: earlier attacks may still hold
/// the VM's slots); waits for the host's acknowledgement of all of them.
pub fn malformed(path: &Path, batches: u64) -> AttackReport {
    let mut rep = AttackReport {
        attack: format!("malformed records ({batches} batches)"),
        ..Default::default()
    };
    let t = Instant::now();
    let mut conn = None;
    while conn.is_none() && t.elapsed() < Duration::from_secs(20) {
        rep.connections += 1;
        conn = hello(path);
        if conn.is_none() {
            rep.refused += 1;
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let Some(mut s) = conn else {
        rep.secs = t.elapsed().as_secs_f64();
        return rep;
    };
    let recs: Vec<Vec<u8>> = (0..10u64)
        .map(|i| {
            let mut r = encode_record(&GuestRecord::Rq(fake_rq(i))).unwrap_or_default();
            if i % 2 == 1 {
                // The last point's number never ends: the record's length
                // is right, its contents are not.
                if let Some(b) = r.last_mut() {
                    *b |= 0x80;
                }
            }
            r
        })
        .collect();
    let mut f = Vec::new();
    for b in 0..batches {
        let refs = recs.iter().map(Vec::as_slice);
        viotrace_shared::proto::batch_frame(b * 10, recs.len(), refs, &mut f);
    }
    if s.write_all(&f).is_err() {
        rep.refused += 1;
    } else {
        (rep.frames, rep.records, rep.bytes) = (batches, batches * 10, f.len() as u64);
    }
    // The host acknowledges what it delivered to the agent.
    let mut acked = 0;
    while acked < rep.records && t.elapsed() < Duration::from_secs(30) {
        match read_message(&mut *s) {
            Ok(Some(Message::Ack { next_seq })) => acked = acked.max(next_seq),
            Ok(Some(_)) => {}
            _ => break,
        }
    }
    rep.bad_records = acked / 2;
    rep.secs = t.elapsed().as_secs_f64();
    rep
}

/// Every attack in turn, as the hostile-guest test runs them.
pub fn all(path: &Path) -> Vec<AttackReport> {
    vec![
        flood(path, Duration::from_secs(6), 256),
        flood(path, Duration::from_secs(3), 14_000),
        forged_clock(path, Duration::from_secs(3)),
        half_open(path, 500, Duration::from_secs(3)),
        reconnects(path, 10_000),
        malformed(path, 20),
    ]
}
