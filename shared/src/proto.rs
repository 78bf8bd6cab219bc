//! Versioned guest↔host wire protocol.
//!
//! A connection is a byte stream of *frames*. Each frame is a 4-byte
//! little-endian payload length followed by the payload, one [`Message`]
//! encoded with postcard. Frames are limited to [`MAX_FRAME`] bytes of payload;
//! anything larger is refused before it is buffered.
//!
//! The guest opens the conversation with [`Message::Hello`] and the host answers
//! [`Message::HelloAck`]. After that the guest streams record batches
//! ([`Message::GuestRqBatch`], [`Message::GuestIoBatch`]), statistics and clock
//! probes, and closes with [`Message::Bye`].
//!
//! Clock probes are NTP-style and come in two directions:
//! * guest-initiated: guest `ClockProbe{seq,t1}` → host `ClockReply{seq,t1,t2,t3}`
//!   → guest stamps `t4` and forwards `ClockSample{seq,t1,t2,t3,t4}` so the host
//!   (which runs the join) gets the full sample;
//! * host-initiated: host `ClockPing{seq,h1}` → guest `ClockPong{seq,h1,g2,g3}`,
//!   the host stamps `h4` on receipt.
//!
//! All timestamps are `CLOCK_MONOTONIC` nanoseconds of the side that took them.
//!
//! Decoding is strict: a malformed, truncated, oversized or unknown frame gives a
//! [`ProtoError`], never a panic.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

use crate::record::{GuestIo, GuestRq};

/// Wire protocol version carried in [`Hello`]/[`HelloAck`]. Bumped on any
/// incompatible change of [`Message`].
pub const PROTOCOL_VERSION: u16 = 1;
/// Hard maximum payload size of one frame (1 MiB).
pub const MAX_FRAME: usize = 1 << 20;
/// Size of the frame length prefix.
pub const FRAME_HEADER: usize = 4;
/// Well-known vsock CID of the host.
pub const HOST_CID: u32 = 2;
/// Default AF_VSOCK port the host agent listens on (and the guest connects to).
pub const DEFAULT_VSOCK_PORT: u32 = 5515;

/// Errors of the wire protocol.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    Oversized { len: usize, max: usize },
    #[error("empty frame")]
    EmptyFrame,
    #[error("unknown message tag {0}")]
    UnknownMessage(u64),
    #[error("malformed message: {0}")]
    Malformed(#[source] postcard::Error),
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(usize),
    #[error("stream ended inside a frame ({have} of {need} bytes)")]
    Truncated { have: usize, need: usize },
    #[error("cannot encode message: {0}")]
    Encode(#[source] postcard::Error),
    #[error("decoder is unusable after an earlier framing error")]
    Poisoned,
    #[error("unsupported protocol version {got} (this side speaks {want})")]
    Version { got: u16, want: u16 },
    #[error("protocol violation: {0}")]
    Violation(String),
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
}

/// First message of a connection (guest → host).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub protocol_version: u16,
    /// Version of the guest agent (`CARGO_PKG_VERSION`).
    pub agent_version: String,
    /// Guest kernel release (`uname -r`).
    pub kernel_release: String,
    /// `/proc/sys/kernel/random/boot_id`: distinguishes reboots of the same VM.
    pub boot_id: String,
    pub hostname: String,
    /// The guest's own vsock CID, when it knows it.
    pub cid: Option<u32>,
}

/// The host's answer to [`Hello`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloAck {
    pub protocol_version: u16,
    pub agent_version: String,
    /// The VM label the host attributes this connection to.
    pub vm: String,
}

/// A named guest counter (probe drops, full maps, transport losses…).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counter {
    pub name: String,
    pub value: u64,
}

/// Guest statistics snapshot (cumulative counters since the agent started).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestStats {
    /// Guest `CLOCK_MONOTONIC` time of the snapshot.
    pub ts: u64,
    /// Records lost by the transport while disconnected or over capacity.
    pub transport_dropped: u64,
    pub counters: Vec<Counter>,
}

/// One protocol message. The variant order is the wire tag: append only.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Message {
    Hello(Hello),
    HelloAck(HelloAck),
    GuestRqBatch(Vec<GuestRq>),
    GuestIoBatch(Vec<GuestIo>),
    /// Guest-initiated probe: guest send time `t1`.
    ClockProbe {
        seq: u64,
        t1: u64,
    },
    /// Host answer: host receive time `t2`, host send time `t3`.
    ClockReply {
        seq: u64,
        t1: u64,
        t2: u64,
        t3: u64,
    },
    /// The completed guest-initiated sample (guest receive time `t4`), for the host.
    ClockSample {
        seq: u64,
        t1: u64,
        t2: u64,
        t3: u64,
        t4: u64,
    },
    /// Host-initiated probe: host send time `h1`.
    ClockPing {
        seq: u64,
        h1: u64,
    },
    /// Guest answer: guest receive time `g2`, guest send time `g3`.
    ClockPong {
        seq: u64,
        h1: u64,
        g2: u64,
        g3: u64,
    },
    GuestStats(GuestStats),
    Bye {
        reason: String,
    },
}

/// Number of [`Message`] variants (tags `0..MESSAGE_TAGS` are known).
pub const MESSAGE_TAGS: u64 = 11;

impl Message {
    /// Short name of the variant, for logs and counters.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::HelloAck(_) => "hello_ack",
            Message::GuestRqBatch(_) => "guest_rq_batch",
            Message::GuestIoBatch(_) => "guest_io_batch",
            Message::ClockProbe { .. } => "clock_probe",
            Message::ClockReply { .. } => "clock_reply",
            Message::ClockSample { .. } => "clock_sample",
            Message::ClockPing { .. } => "clock_ping",
            Message::ClockPong { .. } => "clock_pong",
            Message::GuestStats(_) => "guest_stats",
            Message::Bye { .. } => "bye",
        }
    }
}

/// Encodes `msg` as one complete frame (length prefix + payload).
pub fn encode_frame(msg: &Message) -> Result<Vec<u8>, ProtoError> {
    let mut out = Vec::with_capacity(64);
    encode_frame_into(msg, &mut out)?;
    Ok(out)
}

/// Appends one complete frame for `msg` to `out`. On error `out` is unchanged.
pub fn encode_frame_into(msg: &Message, out: &mut Vec<u8>) -> Result<(), ProtoError> {
    struct Ext<'a>(&'a mut Vec<u8>);
    impl Extend<u8> for Ext<'_> {
        fn extend<I: IntoIterator<Item = u8>>(&mut self, iter: I) {
            self.0.extend(iter);
        }
    }
    let start = out.len();
    out.extend_from_slice(&[0; FRAME_HEADER]);
    if let Err(e) = postcard::to_extend(msg, Ext(out)) {
        out.truncate(start);
        return Err(ProtoError::Encode(e));
    }
    let len = out.len() - start - FRAME_HEADER;
    if len > MAX_FRAME {
        out.truncate(start);
        return Err(ProtoError::Oversized {
            len,
            max: MAX_FRAME,
        });
    }
    out[start..start + FRAME_HEADER].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(())
}

/// Decodes one frame payload (without the length prefix) strictly.
pub fn decode_payload(payload: &[u8]) -> Result<Message, ProtoError> {
    if payload.is_empty() {
        return Err(ProtoError::EmptyFrame);
    }
    if payload.len() > MAX_FRAME {
        return Err(ProtoError::Oversized {
            len: payload.len(),
            max: MAX_FRAME,
        });
    }
    // Peek at the variant tag (a varint) to tell "unknown" from "malformed".
    if let Some(tag) = read_varint(payload) {
        if tag >= MESSAGE_TAGS {
            return Err(ProtoError::UnknownMessage(tag));
        }
    }
    let (msg, rest) =
        postcard::take_from_bytes::<Message>(payload).map_err(ProtoError::Malformed)?;
    if !rest.is_empty() {
        return Err(ProtoError::TrailingBytes(rest.len()));
    }
    Ok(msg)
}

fn read_varint(b: &[u8]) -> Option<u64> {
    let mut v: u64 = 0;
    for (i, &byte) in b.iter().take(10).enumerate() {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// Incremental decoder: feed it bytes as they arrive, take complete messages out.
///
/// An oversized length prefix poisons the decoder (framing is lost); a frame
/// whose payload does not decode is consumed and reported, and decoding may
/// continue with the next frame (callers normally drop such a peer anyway).
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    pos: usize,
    max: usize,
    poisoned: bool,
    frames: u64,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self::with_max(MAX_FRAME)
    }

    /// A decoder with a smaller (or equal) frame limit.
    pub fn with_max(max: usize) -> Self {
        FrameDecoder {
            buf: Vec::new(),
            pos: 0,
            max: max.min(MAX_FRAME),
            poisoned: false,
            frames: 0,
        }
    }

    /// Appends received bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.poisoned {
            return;
        }
        if self.pos > 0 && self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
        } else if self.pos > 64 * 1024 && self.pos * 2 > self.buf.len() {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes buffered but not yet decoded.
    pub fn pending(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Frames decoded successfully so far.
    pub fn frames(&self) -> u64 {
        self.frames
    }

    /// Returns the next complete message, `Ok(None)` when more bytes are needed.
    pub fn next_message(&mut self) -> Result<Option<Message>, ProtoError> {
        match self.next_payload()? {
            None => Ok(None),
            Some((a, b)) => {
                let r = decode_payload(&self.buf[a..b]);
                self.pos = b;
                let m = r?;
                self.frames += 1;
                Ok(Some(m))
            }
        }
    }

    fn next_payload(&mut self) -> Result<Option<(usize, usize)>, ProtoError> {
        if self.poisoned {
            return Err(ProtoError::Poisoned);
        }
        let avail = &self.buf[self.pos..];
        if avail.len() < FRAME_HEADER {
            return Ok(None);
        }
        let len = u32::from_le_bytes([avail[0], avail[1], avail[2], avail[3]]) as usize;
        if len > self.max {
            self.poisoned = true;
            self.buf = Vec::new();
            self.pos = 0;
            return Err(ProtoError::Oversized { len, max: self.max });
        }
        if len == 0 {
            self.pos += FRAME_HEADER;
            return Err(ProtoError::EmptyFrame);
        }
        if avail.len() < FRAME_HEADER + len {
            return Ok(None);
        }
        let a = self.pos + FRAME_HEADER;
        Ok(Some((a, a + len)))
    }

    /// Call at end of stream: an error if a partial frame is left over.
    pub fn finish(&self) -> Result<(), ProtoError> {
        if self.poisoned {
            return Err(ProtoError::Poisoned);
        }
        let avail = &self.buf[self.pos..];
        if avail.is_empty() {
            return Ok(());
        }
        let need = if avail.len() >= FRAME_HEADER {
            FRAME_HEADER + u32::from_le_bytes([avail[0], avail[1], avail[2], avail[3]]) as usize
        } else {
            FRAME_HEADER
        };
        Err(ProtoError::Truncated {
            have: avail.len(),
            need,
        })
    }
}

/// Writes one frame to a blocking writer.
pub fn write_message<W: Write>(w: &mut W, msg: &Message) -> Result<(), ProtoError> {
    let f = encode_frame(msg)?;
    w.write_all(&f)?;
    Ok(())
}

/// Reads exactly one frame from a blocking reader. `Ok(None)` on a clean EOF at
/// a frame boundary.
pub fn read_message<R: Read>(r: &mut R) -> Result<Option<Message>, ProtoError> {
    let mut hdr = [0u8; FRAME_HEADER];
    let mut got = 0;
    while got < FRAME_HEADER {
        match r.read(&mut hdr[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => {
                return Err(ProtoError::Truncated {
                    have: got,
                    need: FRAME_HEADER,
                })
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_le_bytes(hdr) as usize;
    if len > MAX_FRAME {
        return Err(ProtoError::Oversized {
            len,
            max: MAX_FRAME,
        });
    }
    let mut payload = vec![0u8; len];
    let mut got = 0;
    while got < len {
        match r.read(&mut payload[got..]) {
            Ok(0) => {
                return Err(ProtoError::Truncated {
                    have: FRAME_HEADER + got,
                    need: FRAME_HEADER + len,
                })
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    decode_payload(&payload).map(Some)
}

/// Checks a peer's protocol version against ours.
pub fn check_version(got: u16) -> Result<(), ProtoError> {
    if got == PROTOCOL_VERSION {
        Ok(())
    } else {
        Err(ProtoError::Version {
            got,
            want: PROTOCOL_VERSION,
        })
    }
}

/// Splits a record batch into frames that each fit [`MAX_FRAME`], appending them
/// to `out`. `make` wraps a slice into a message (e.g. `Message::GuestRqBatch`).
/// Returns the number of frames written; a single record too large for a frame
/// is an error (and is not written).
pub fn encode_batches<T: Clone>(
    items: &[T],
    make: &dyn Fn(Vec<T>) -> Message,
    out: &mut Vec<u8>,
) -> Result<usize, ProtoError> {
    if items.is_empty() {
        return Ok(0);
    }
    match encode_frame_into(&make(items.to_vec()), out) {
        Ok(()) => Ok(1),
        Err(ProtoError::Oversized { len, max }) if items.len() == 1 => {
            Err(ProtoError::Oversized { len, max })
        }
        Err(ProtoError::Oversized { .. }) => {
            let mid = items.len() / 2;
            let a = encode_batches(&items[..mid], make, out)?;
            let b = encode_batches(&items[mid..], make, out)?;
            Ok(a + b)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Op, Point, Points, RqRef};

    fn rq(i: u64) -> GuestRq {
        GuestRq {
            disk: "vda".into(),
            op: Op::Write,
            sector: 8 * i,
            bytes: 4096,
            queue: Some(0),
            head: Some((i % 128) as u16),
            pid: 42,
            tid: 43,
            comm: "fio".into(),
            cgroup_id: 7,
            inode: 12,
            file_offset: Some(4096 * i),
            kicked: Some(true),
            bios: 1,
            error: 0,
            ts: [(Point::RqIssue, 1000 + i), (Point::RqComplete, 2000 + i)]
                .into_iter()
                .collect(),
        }
    }

    fn all_messages() -> Vec<Message> {
        vec![
            Message::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                agent_version: "0.1.0".into(),
                kernel_release: "6.1.0-28-cloud-amd64".into(),
                boot_id: "0b6c7f7e-1111-2222-3333-444455556666".into(),
                hostname: "guest".into(),
                cid: Some(3),
            }),
            Message::HelloAck(HelloAck {
                protocol_version: PROTOCOL_VERSION,
                agent_version: "0.1.0".into(),
                vm: "vm1".into(),
            }),
            Message::GuestRqBatch((0..10).map(rq).collect()),
            Message::GuestIoBatch(vec![GuestIo {
                syscall: "pwrite64".into(),
                pid: 1,
                tid: 1,
                comm: "dd".into(),
                cgroup_id: 0,
                inode: 5,
                file_offset: None,
                bytes: 4096,
                ret: 4096,
                requests: vec![RqRef {
                    disk: "vda".into(),
                    sector: 8,
                    bytes: 4096,
                }],
                ts: Points::new(),
            }]),
            Message::ClockProbe { seq: 1, t1: 10 },
            Message::ClockReply {
                seq: 1,
                t1: 10,
                t2: 20,
                t3: 21,
            },
            Message::ClockSample {
                seq: 1,
                t1: 10,
                t2: 20,
                t3: 21,
                t4: 30,
            },
            Message::ClockPing {
                seq: 9,
                h1: u64::MAX,
            },
            Message::ClockPong {
                seq: 9,
                h1: u64::MAX,
                g2: 1,
                g3: 2,
            },
            Message::GuestStats(GuestStats {
                ts: 5,
                transport_dropped: 3,
                counters: vec![Counter {
                    name: "ringbuf_drops".into(),
                    value: 2,
                }],
            }),
            Message::Bye {
                reason: "sigint".into(),
            },
        ]
    }

    #[test]
    fn every_message_roundtrips_and_tags_are_counted() {
        let msgs = all_messages();
        assert_eq!(msgs.len() as u64, MESSAGE_TAGS);
        for m in msgs {
            let f = encode_frame(&m).unwrap();
            let len = u32::from_le_bytes(f[..4].try_into().unwrap()) as usize;
            assert_eq!(len + 4, f.len());
            assert_eq!(decode_payload(&f[4..]).unwrap(), m);
        }
    }

    #[test]
    fn incremental_decoder_byte_by_byte() {
        let msgs = all_messages();
        let mut stream = Vec::new();
        for m in &msgs {
            encode_frame_into(m, &mut stream).unwrap();
        }
        let mut d = FrameDecoder::new();
        let mut got = Vec::new();
        for b in &stream {
            d.feed(std::slice::from_ref(b));
            while let Some(m) = d.next_message().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got, msgs);
        d.finish().unwrap();
        assert_eq!(d.frames(), msgs.len() as u64);
    }

    #[test]
    fn truncated_stream_is_reported() {
        let f = encode_frame(&Message::ClockProbe { seq: 1, t1: 2 }).unwrap();
        let mut d = FrameDecoder::new();
        d.feed(&f[..f.len() - 1]);
        assert!(d.next_message().unwrap().is_none());
        assert!(matches!(d.finish(), Err(ProtoError::Truncated { .. })));
        let mut d = FrameDecoder::new();
        d.feed(&f[..2]);
        assert!(matches!(
            d.finish(),
            Err(ProtoError::Truncated { have: 2, need: 4 })
        ));
        // Blocking reader.
        let mut r = &f[..f.len() - 1];
        assert!(matches!(
            read_message(&mut r),
            Err(ProtoError::Truncated { .. })
        ));
        let mut r = &f[..];
        assert!(read_message(&mut r).unwrap().is_some());
        assert!(read_message(&mut r).unwrap().is_none());
    }

    #[test]
    fn oversized_frame_is_refused_and_poisons() {
        let mut d = FrameDecoder::new();
        d.feed(&((MAX_FRAME as u32) + 1).to_le_bytes());
        assert!(matches!(
            d.next_message(),
            Err(ProtoError::Oversized { .. })
        ));
        assert!(matches!(d.next_message(), Err(ProtoError::Poisoned)));
        let hdr = u32::MAX.to_le_bytes();
        let mut r = &hdr[..];
        assert!(matches!(
            read_message(&mut r),
            Err(ProtoError::Oversized { .. })
        ));
    }

    #[test]
    fn unknown_and_malformed_and_trailing() {
        assert!(matches!(
            decode_payload(&[MESSAGE_TAGS as u8]),
            Err(ProtoError::UnknownMessage(t)) if t == MESSAGE_TAGS
        ));
        assert!(matches!(
            decode_payload(&[0xff, 0xff, 0x03]),
            Err(ProtoError::UnknownMessage(_))
        ));
        // Hello with a truncated body.
        assert!(matches!(
            decode_payload(&[0, 1]),
            Err(ProtoError::Malformed(_))
        ));
        // Varint that never ends.
        assert!(matches!(
            decode_payload(&[0x80; 12]),
            Err(ProtoError::Malformed(_)) | Err(ProtoError::UnknownMessage(_))
        ));
        let mut f = encode_frame(&Message::Bye { reason: "x".into() }).unwrap();
        f.push(0);
        assert!(matches!(
            decode_payload(&f[4..]),
            Err(ProtoError::TrailingBytes(1))
        ));
        assert!(matches!(decode_payload(&[]), Err(ProtoError::EmptyFrame)));
        // Bad point id inside a record is malformed, not a panic.
        let mut good = encode_frame(&Message::GuestRqBatch(vec![rq(1)])).unwrap();
        let n = good.len();
        // ts is last: [len=2][(id,varint)]...; corrupt the last point id.
        good[n - 3] = 200;
        let r = decode_payload(&good[4..]);
        assert!(r.is_err());
    }

    #[test]
    fn decoder_continues_after_a_bad_payload() {
        let mut s = Vec::new();
        s.extend_from_slice(&1u32.to_le_bytes());
        s.push(99);
        encode_frame_into(
            &Message::Bye {
                reason: "ok".into(),
            },
            &mut s,
        )
        .unwrap();
        let mut d = FrameDecoder::new();
        d.feed(&s);
        assert!(matches!(
            d.next_message(),
            Err(ProtoError::UnknownMessage(99))
        ));
        assert!(matches!(d.next_message(), Ok(Some(Message::Bye { .. }))));
    }

    #[test]
    fn batches_split_to_fit_max_frame() {
        let items: Vec<GuestRq> = (0..60_000).map(rq).collect();
        let mut out = Vec::new();
        let n = encode_batches(&items, &Message::GuestRqBatch, &mut out).unwrap();
        assert!(n > 1, "{n}");
        let mut d = FrameDecoder::new();
        d.feed(&out);
        let mut total = 0;
        while let Some(m) = d.next_message().unwrap() {
            match m {
                Message::GuestRqBatch(v) => total += v.len(),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(total, items.len());
        // A single record larger than a frame is refused.
        let mut big = rq(0);
        big.comm = "x".repeat(MAX_FRAME + 1);
        let mut out2 = Vec::new();
        assert!(matches!(
            encode_batches(&[big], &Message::GuestRqBatch, &mut out2),
            Err(ProtoError::Oversized { .. })
        ));
        assert!(out2.is_empty());
    }

    #[test]
    fn version_check() {
        check_version(PROTOCOL_VERSION).unwrap();
        assert!(matches!(
            check_version(PROTOCOL_VERSION + 1),
            Err(ProtoError::Version { .. })
        ));
    }

    proptest::proptest! {
        #[test]
        fn decoder_never_panics(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let mut d = FrameDecoder::new();
            d.feed(&data);
            for _ in 0..64 {
                match d.next_message() {
                    Ok(Some(_)) => {}
                    Ok(None) | Err(ProtoError::Poisoned) => break,
                    Err(_) => {}
                }
            }
            let _ = d.finish();
            let _ = decode_payload(&data);
        }
    }
}
