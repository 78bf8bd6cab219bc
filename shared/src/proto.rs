//! Versioned guest↔host wire protocol.
//!
//! A connection is a byte stream of *frames*. Each frame is a 4-byte
//! little-endian payload length followed by the payload, one [`Message`]
//! encoded with postcard. Frames are limited to [`MAX_FRAME`] bytes of payload;
//! anything larger is refused before it is buffered.
//!
//! The guest opens the conversation with [`Message::Hello`] and the host answers
//! [`Message::HelloAck`]. After that the guest streams record batches
//! ([`Message::Batch`]), statistics and clock probes, and closes with [`Message::Bye`].
//!
//! Delivery is accounted end to end. Every record a guest agent instance
//! (`Hello::session`) accepts for sending gets the next sequence number of that
//! session; a batch carries the number of its first record. The host
//! acknowledges cumulatively ([`Message::Ack`]: every record below `next_seq` was
//! delivered or counted), and on (re)connection tells the guest where to resume
//! ([`HelloAck::resume`]). The guest keeps every unacknowledged record (bounded;
//! records refused because the buffer is full never get a number and are counted
//! by the guest), so a lost connection or a backend that lost bytes costs a
//! retransmission, not records. Sequence gaps the guest cannot fill are counted
//! by the host as lost in transit.
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
use crate::varint;

mod batch;
pub mod io_bpf;
mod io_wire;
pub mod rq;
pub mod rq_bpf;

pub use batch::{BatchReader, RawBatch};

/// Wire protocol version carried in [`Hello`]/[`HelloAck`]. Bumped on any
/// incompatible change of [`Message`].
/// (3: records carry their wall-clock `time`; 5: points as differences;
/// 7: request records in their own compact form, [`rq`]; 8: or in the guest
/// BPF object's layout, [`rq_bpf`].)
pub const PROTOCOL_VERSION: u16 = 8;
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
    #[error("record {index} of the batch: {source}")]
    BadRecord {
        index: usize,
        #[source]
        source: rq::RqWireError,
    },
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
    /// Random identity of this guest agent instance: record sequence numbers
    /// are per session and survive reconnections.
    pub session: u64,
}

/// The host's answer to [`Hello`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloAck {
    pub protocol_version: u16,
    pub agent_version: String,
    /// The VM label the host attributes this connection to.
    pub vm: String,
    /// The next record sequence number the host expects from this session
    /// (everything below was delivered or counted); `None` when the host knows
    /// nothing of the session (resend everything unacknowledged).
    pub resume: Option<u64>,
}

/// One guest record on the wire. In binary formats a request record is its
/// own compact form ([`rq`]); serde sees it as one byte string.
#[derive(Clone, Debug, PartialEq)]
pub enum GuestRecord {
    Rq(GuestRq),
    Io(GuestIo),
}

/// A [`GuestRecord`] by reference: the same encoding, without moving the
/// record into one (the guest's uplink encodes what its statistics just read).
pub enum GuestRecordRef<'a> {
    Rq(&'a GuestRq),
    Io(&'a GuestIo),
}

impl GuestRecord {
    /// This record by reference (the same encoding).
    pub fn borrowed(&self) -> GuestRecordRef<'_> {
        match self {
            GuestRecord::Rq(x) => GuestRecordRef::Rq(x),
            GuestRecord::Io(x) => GuestRecordRef::Io(x),
        }
    }
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
    /// Records that got a sequence number so far (the session's next number).
    pub produced: u64,
    /// Records refused by the guest's full send buffer (they never got a number).
    pub dropped_full: u64,
    pub counters: Vec<Counter>,
}

/// One protocol message. The variant order is the wire tag: append only.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Message {
    Hello(Hello),
    HelloAck(HelloAck),
    /// Records numbered `first_seq`, `first_seq + 1`, … of the session.
    Batch {
        first_seq: u64,
        records: Vec<GuestRecord>,
    },
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
    /// Host → guest: every record below `next_seq` was delivered or counted.
    Ack {
        next_seq: u64,
    },
}

/// Number of [`Message`] variants (tags `0..MESSAGE_TAGS` are known).
pub const MESSAGE_TAGS: u64 = 11;
/// A guest record's tag for a syscall record in its postcard form with
/// `requests_unlisted` (tag 1: without it; 0, 2, 3: [`rq`], [`rq_bpf`],
/// [`io_bpf`]).
pub const IO_TAG: u8 = 4;
/// Wire tag of [`Message::Batch`] (batch frames are assembled from records
/// encoded once, see [`encode_record`] and [`batch_frame`]).
const BATCH_TAG: u8 = 2;

impl Message {
    /// Short name of the variant, for logs and counters.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::HelloAck(_) => "hello_ack",
            Message::Batch { .. } => "batch",
            Message::ClockProbe { .. } => "clock_probe",
            Message::ClockReply { .. } => "clock_reply",
            Message::ClockSample { .. } => "clock_sample",
            Message::ClockPing { .. } => "clock_ping",
            Message::ClockPong { .. } => "clock_pong",
            Message::GuestStats(_) => "guest_stats",
            Message::Bye { .. } => "bye",
            Message::Ack { .. } => "ack",
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
    if let Some(tag) = varint::take(&mut &payload[..]) {
        if tag >= MESSAGE_TAGS {
            return Err(ProtoError::UnknownMessage(tag));
        }
    }
    if payload[0] == BATCH_TAG {
        return batch::decode(&payload[1..]);
    }
    let (msg, rest) =
        postcard::take_from_bytes::<Message>(payload).map_err(ProtoError::Malformed)?;
    if !rest.is_empty() {
        return Err(ProtoError::TrailingBytes(rest.len()));
    }
    Ok(msg)
}

/// The payload length a frame's header announces, once the header is there.
fn announced_len(frame: &[u8]) -> Option<usize> {
    let h: [u8; FRAME_HEADER] = frame.get(..FRAME_HEADER)?.try_into().ok()?;
    Some(u32::from_le_bytes(h) as usize)
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

    /// Changes the frame limit (at most [`MAX_FRAME`]); bytes already buffered stay.
    pub fn set_max(&mut self, max: usize) {
        self.max = max.min(MAX_FRAME);
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

    /// Room for the next read, at the end of the buffer, which the caller may
    /// only append to (e.g. with tokio's `read_buf`): at least `min` bytes, or
    /// all that the frame being received still lacks (at most the frame limit),
    /// so a large frame is read in one go rather than through a small buffer
    /// and a copy.
    pub fn read_room(&mut self, min: usize) -> &mut Vec<u8> {
        let want = min.max(self.missing());
        if self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
        } else if self.pos > 0 && self.buf.capacity() - self.buf.len() < want {
            // Only a partial frame is left: move it to the front.
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.reserve(want);
        &mut self.buf
    }

    /// Bytes the frame being received still lacks (its header first); frames
    /// above the limit count as the limit (they are refused when decoded).
    fn missing(&self) -> usize {
        let avail = &self.buf[self.pos..];
        match announced_len(avail) {
            None => FRAME_HEADER - avail.len(),
            Some(len) => (FRAME_HEADER + len.min(self.max)).saturating_sub(avail.len()),
        }
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
        self.next_decoded(decode_payload)
    }

    /// [`next_message`](Self::next_message), but a batch comes as a
    /// [`RawBatch`]: checked for structure, its records left to a
    /// [`BatchReader`] (the host agent reads them on its main thread).
    pub fn next_inbound(&mut self) -> Result<Option<Inbound>, ProtoError> {
        self.next_decoded(|p| match p[0] {
            BATCH_TAG => RawBatch::skim(&p[1..]).map(Inbound::Batch),
            _ => decode_payload(p).map(Inbound::Message),
        })
    }

    /// The next complete frame's payload (never empty) through `decode`; the
    /// frame is consumed whether it decodes or not, and counted if it does.
    fn next_decoded<T>(
        &mut self,
        decode: impl FnOnce(&[u8]) -> Result<T, ProtoError>,
    ) -> Result<Option<T>, ProtoError> {
        let Some((a, b)) = self.next_payload()? else {
            return Ok(None);
        };
        let r = decode(&self.buf[a..b]);
        self.pos = b;
        let m = r?;
        self.frames += 1;
        Ok(Some(m))
    }

    fn next_payload(&mut self) -> Result<Option<(usize, usize)>, ProtoError> {
        if self.poisoned {
            return Err(ProtoError::Poisoned);
        }
        let avail = &self.buf[self.pos..];
        let Some(len) = announced_len(avail) else {
            return Ok(None);
        };
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
        let need = FRAME_HEADER + announced_len(avail).unwrap_or(0);
        Err(ProtoError::Truncated {
            have: avail.len(),
            need,
        })
    }
}

/// A frame as [`FrameDecoder::next_inbound`] returns it.
#[derive(Debug)]
pub enum Inbound {
    Batch(RawBatch),
    /// Any other message (never a batch).
    Message(Message),
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

/// Encodes one record once, as it appears inside a [`Message::Batch`].
pub fn encode_record(rec: &GuestRecord) -> Result<Vec<u8>, ProtoError> {
    let mut v = Vec::new();
    encode_record_into(&rec.borrowed(), &mut v)?;
    Ok(v)
}

/// [`encode_record`] of a record the caller keeps, into `buf` (cleared first;
/// its allocation is reused).
pub fn encode_record_into(rec: &GuestRecordRef<'_>, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
    buf.clear();
    encode_record_append(rec, buf)
}

/// [`encode_record_into`]'s bytes appended to `buf` (a capture's open chunk:
/// no copy from a scratch buffer); on an error `buf` is as it was.
pub fn encode_record_append(rec: &GuestRecordRef<'_>, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
    let start = buf.len();
    // Room for a usual record from the start: growing the vector while
    // encoding reallocated it several times per record.
    buf.reserve(ENCODED_GUESS);
    match rec {
        // As postcard writes the variant: its tag, then the byte string
        // (length, bytes), encoded in place.
        GuestRecordRef::Rq(r) => {
            buf.extend_from_slice(&[0, 0]);
            rq::encode(r, buf);
            let n = buf.len() - start - 2;
            if n < 0x80 {
                buf[start + 1] = n as u8;
            } else {
                let mut len = [0u8; varint::MAX_LEN];
                let k = varint::put(&mut len, 0, n as u64);
                buf.splice(start + 1..start + 2, len[..k].iter().copied());
            }
        }
        // (postcard's variant tag, then the record as postcard writes it)
        GuestRecordRef::Io(io) => {
            buf.push(IO_TAG);
            if let Err(e) = io_wire::encode(io, buf) {
                buf.truncate(start);
                return Err(ProtoError::Encode(e));
            }
        }
    }
    let len = buf.len() - start;
    if len + BATCH_OVERHEAD > MAX_FRAME {
        buf.truncate(start);
        return Err(ProtoError::Oversized {
            len,
            max: MAX_FRAME - BATCH_OVERHEAD,
        });
    }
    Ok(())
}

/// A usual encoded request record's size, with room (task and disk names vary).
const ENCODED_GUESS: usize = 160;

/// Most bytes a batch frame adds around its encoded records (length prefix,
/// tag, two varints).
pub const BATCH_OVERHEAD: usize = FRAME_HEADER + 1 + 2 * varint::MAX_LEN;

/// Appends the head of a [`Message::Batch`] frame of `count` records already
/// encoded with [`encode_record`] that take `records_len` bytes: the frame is
/// this head, then the records (as [`batch_frame`] appends them), so a writer
/// can send the records from where they are.
pub fn batch_header(first_seq: u64, count: usize, records_len: usize, out: &mut Vec<u8>) {
    let mut head = [0u8; 1 + 2 * varint::MAX_LEN];
    head[0] = BATCH_TAG;
    let at = varint::put(&mut head, 1, first_seq);
    let at = varint::put(&mut head, at, count as u64);
    out.extend_from_slice(&((at + records_len) as u32).to_le_bytes());
    out.extend_from_slice(&head[..at]);
}

/// Appends one complete [`Message::Batch`] frame of `count` records already
/// encoded with [`encode_record`], whose bytes are `records` concatenated (in
/// any number of pieces); byte-identical to postcard's encoding of the message.
/// The caller keeps the total under [`MAX_FRAME`] (see [`BATCH_OVERHEAD`]).
pub fn batch_frame<'a, I>(first_seq: u64, count: usize, records: I, out: &mut Vec<u8>)
where
    I: IntoIterator<Item = &'a [u8]>,
    I::IntoIter: Clone,
{
    let records = records.into_iter();
    let len = records.clone().map(<[u8]>::len).sum();
    batch_header(first_seq, count, len, out);
    for r in records {
        out.extend_from_slice(r);
    }
}

/// A typical guest request record, varied by `i` (sector, head, offset, points): for
/// tests and benches.
#[cfg(any(test, feature = "testing"))]
pub fn sample_rq(i: u64) -> GuestRq {
    use crate::record::{Op, Point};
    GuestRq {
        time: None,
        disk: "vda".into(),
        op: Op::Write,
        sector: 8u64.wrapping_mul(i),
        bytes: 4096,
        queue: Some(0),
        head: Some((i % 128) as u16),
        pid: 42,
        tid: 43,
        comm: "fio".into(),
        cgroup_id: 7,
        inode: 12,
        // (wrapping: the tests also take i up to u64::MAX / 2, the longest varints)
        file_offset: Some(4096u64.wrapping_mul(i)),
        kicked: Some(true),
        bios: 1,
        error: 0,
        ts: [(Point::RqIssue, 1000 + i), (Point::RqComplete, 2000 + i)]
            .into_iter()
            .collect(),
    }
}

#[cfg(test)]
#[path = "proto_tests.rs"]
pub(crate) mod tests;
