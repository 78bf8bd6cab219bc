//! The binary form of a guest request record ([`GuestRq`]) on the wire and in
//! capture files: written and read field by field, without serde's per-field
//! calls (the one record every I/O sends: the guest encodes it, the host
//! decodes it). Inside a postcard message it is one byte string, so every
//! other message, and the syscall records, stay plain postcard.
//!
//! Layout (LEB128 varints; `z` = zigzag varint):
//!
//! | field | form |
//! |---|---|
//! | flags | 1 byte: which optional fields follow ([`F_TIME`] …) and `kicked` |
//! | op | 1 byte: [`Op`]'s variant index |
//! | disk, comm | length varint + UTF-8 bytes |
//! | sector, bytes, pid, tid, cgroup_id, inode, bios | varint each |
//! | time | z, if [`F_TIME`] |
//! | queue, head | varint each, if [`F_QUEUE`] / [`F_HEAD`] |
//! | file_offset | varint, if [`F_OFFSET`] |
//! | error | z, if [`F_ERROR`] (0 otherwise) |
//! | ts | the rest: [`Points`]' binary form |
//!
//! Decoding is strict: unknown flag bits, an unknown op, a value out of its
//! field's range, invalid UTF-8, a truncated field or trailing bytes are errors.

use std::fmt;

use serde::de::{self, DeserializeSeed, EnumAccess, VariantAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{GuestRecord, GuestRecordRef};
use crate::points::Points;
use crate::record::{GuestIo, GuestRq, Name, Op};
use crate::varint::{self, unzigzag, zigzag};
use crate::walltime::WallTime;

const F_TIME: u8 = 1;
const F_QUEUE: u8 = 1 << 1;
const F_HEAD: u8 = 1 << 2;
const F_OFFSET: u8 = 1 << 3;
const F_KICKED: u8 = 1 << 4;
/// `kicked` is `Some(true)` (with [`F_KICKED`]).
const F_KICKED_TRUE: u8 = 1 << 5;
const F_ERROR: u8 = 1 << 6;
const F_KNOWN: u8 = (1 << 7) - 1;

/// Why a request record's bytes do not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RqWireError {
    #[error("truncated or overlong number in field {0}")]
    Number(&'static str),
    #[error("field {0} out of range")]
    Range(&'static str),
    #[error("unknown flags {0:#04x}")]
    Flags(u8),
    #[error("unknown op {0}")]
    Op(u8),
    #[error("name not UTF-8")]
    Utf8,
    #[error("malformed points")]
    Points,
    #[error("unknown record tag {0}")]
    Tag(u32),
    #[error("request record in the BPF layout of {0} bytes")]
    Length(usize),
    #[error("syscall record in the BPF layout of {0} bytes, not what its references need")]
    IoLength(usize),
}

/// A string as postcard writes one: its length, then its bytes.
pub(super) fn push_str(out: &mut Vec<u8>, s: &str) {
    varint::push(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// Appends `rq`'s binary form to `out`.
pub fn encode(rq: &GuestRq, out: &mut Vec<u8>) {
    let mut flags = 0;
    let mut set = |on: bool, f: u8| {
        if on {
            flags |= f;
        }
    };
    set(rq.time.is_some(), F_TIME);
    set(rq.queue.is_some(), F_QUEUE);
    set(rq.head.is_some(), F_HEAD);
    set(rq.file_offset.is_some(), F_OFFSET);
    set(rq.kicked.is_some(), F_KICKED);
    set(rq.kicked == Some(true), F_KICKED_TRUE);
    set(rq.error != 0, F_ERROR);
    out.push(flags);
    out.push(rq.op as u8);
    push_str(out, &rq.disk);
    push_str(out, &rq.comm);
    for v in [
        rq.sector,
        u64::from(rq.bytes),
        u64::from(rq.pid),
        u64::from(rq.tid),
        rq.cgroup_id,
        rq.inode,
        u64::from(rq.bios),
    ] {
        varint::push(out, v);
    }
    if let Some(t) = rq.time {
        varint::push(out, zigzag(t.0));
    }
    for v in [rq.queue, rq.head].into_iter().flatten() {
        varint::push(out, u64::from(v));
    }
    if let Some(o) = rq.file_offset {
        varint::push(out, o);
    }
    if rq.error != 0 {
        varint::push(out, zigzag(i64::from(rq.error)));
    }
    rq.ts.encode_wire_into(out);
}

/// A reader over a record's bytes.
struct Rd<'a>(&'a [u8]);

impl<'a> Rd<'a> {
    #[inline]
    fn byte(&mut self, what: &'static str) -> Result<u8, RqWireError> {
        let (&b, rest) = self.0.split_first().ok_or(RqWireError::Number(what))?;
        self.0 = rest;
        Ok(b)
    }

    #[inline]
    fn u64(&mut self, what: &'static str) -> Result<u64, RqWireError> {
        varint::take(&mut self.0).ok_or(RqWireError::Number(what))
    }

    #[inline]
    fn num<T: TryFrom<u64>>(&mut self, what: &'static str) -> Result<T, RqWireError> {
        T::try_from(self.u64(what)?).map_err(|_| RqWireError::Range(what))
    }

    /// A name into `slot`, which is replaced only when its bytes differ (a
    /// batch's records mostly repeat their disk and task: checked and copied
    /// once).
    #[inline]
    fn name_into(&mut self, what: &'static str, slot: &mut Name) -> Result<(), RqWireError> {
        let n: usize = self.num(what)?;
        if n > self.0.len() {
            return Err(RqWireError::Number(what));
        }
        let (s, rest) = self.0.split_at(n);
        self.0 = rest;
        if s != slot.as_bytes() {
            *slot = Name::new(std::str::from_utf8(s).map_err(|_| RqWireError::Utf8)?);
        }
        Ok(())
    }
}

/// A request record whose every field is overwritten by [`decode_into`].
pub fn blank() -> GuestRq {
    GuestRq {
        disk: Name::default(),
        time: None,
        op: Op::Read,
        sector: 0,
        bytes: 0,
        queue: None,
        head: None,
        pid: 0,
        tid: 0,
        comm: Name::default(),
        cgroup_id: 0,
        inode: 0,
        file_offset: None,
        kicked: None,
        bios: 0,
        error: 0,
        ts: Points::new(),
    }
}

/// Reads a record written by [`encode`] (all of `b`).
pub fn decode(b: &[u8]) -> Result<GuestRq, RqWireError> {
    let mut rq = blank();
    decode_into(b, &mut rq)?;
    Ok(rq)
}

/// [`decode`] into a record kept by the caller: every field is written (the
/// names only when their bytes differ from the ones there). On an error the
/// record holds part of the new one and part of the old.
#[inline(always)]
pub fn decode_into(b: &[u8], rq: &mut GuestRq) -> Result<(), RqWireError> {
    let mut r = Rd(b);
    let flags = r.byte("flags")?;
    if flags & !F_KNOWN != 0 || (flags & F_KICKED == 0 && flags & F_KICKED_TRUE != 0) {
        return Err(RqWireError::Flags(flags));
    }
    let op = r.byte("op")?;
    rq.op = *Op::ALL.get(usize::from(op)).ok_or(RqWireError::Op(op))?;
    r.name_into("disk", &mut rq.disk)?;
    r.name_into("comm", &mut rq.comm)?;
    rq.sector = r.u64("sector")?;
    rq.bytes = r.num("bytes")?;
    rq.pid = r.num("pid")?;
    rq.tid = r.num("tid")?;
    rq.cgroup_id = r.u64("cgroup_id")?;
    rq.inode = r.u64("inode")?;
    rq.bios = r.num("bios")?;
    let has = |f: u8| flags & f != 0;
    rq.time = match has(F_TIME) {
        true => Some(WallTime(unzigzag(r.u64("time")?))),
        false => None,
    };
    rq.queue = has(F_QUEUE).then(|| r.num("queue")).transpose()?;
    rq.head = has(F_HEAD).then(|| r.num("head")).transpose()?;
    rq.file_offset = has(F_OFFSET).then(|| r.u64("file_offset")).transpose()?;
    rq.kicked = has(F_KICKED).then_some(has(F_KICKED_TRUE));
    rq.error = match has(F_ERROR) {
        true => {
            i32::try_from(unzigzag(r.u64("error")?)).map_err(|_| RqWireError::Range("error"))?
        }
        false => 0,
    };
    match rq.ts.decode_wire_into(r.0) {
        true => Ok(()),
        false => Err(RqWireError::Points),
    }
}

/// A request record as serde sees it: its binary form as one byte string in
/// binary formats, its fields in human-readable ones.
struct Bin<'a>(&'a GuestRq);

impl Serialize for Bin<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            return self.0.serialize(s);
        }
        let mut b = Vec::with_capacity(super::ENCODED_GUESS);
        encode(self.0, &mut b);
        s.serialize_bytes(&b)
    }
}

impl Serialize for GuestRecordRef<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            GuestRecordRef::Rq(r) => s.serialize_newtype_variant(NAME, 0, VARIANTS[0], &Bin(r)),
            GuestRecordRef::Io(r) => {
                s.serialize_newtype_variant(NAME, super::IO_TAG.into(), VARIANTS[1], r)
            }
        }
    }
}

impl Serialize for GuestRecord {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.borrowed().serialize(s)
    }
}

const NAME: &str = "GuestRecord";
const VARIANTS: &[&str] = &["Rq", "Io"];

/// The human-readable form: serde's usual one.
#[derive(Deserialize)]
#[serde(rename = "GuestRecord")]
enum Readable {
    Rq(GuestRq),
    Io(GuestIo),
}

impl<'de> Deserialize<'de> for GuestRecord {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            return Ok(match Readable::deserialize(d)? {
                Readable::Rq(r) => GuestRecord::Rq(r),
                Readable::Io(r) => GuestRecord::Io(r),
            });
        }
        d.deserialize_enum(NAME, VARIANTS, RecordVisitor)
    }
}

struct RecordVisitor;

impl<'de> Visitor<'de> for RecordVisitor {
    type Value = GuestRecord;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a guest record")
    }

    fn visit_enum<A: EnumAccess<'de>>(self, a: A) -> Result<GuestRecord, A::Error> {
        let (tag, v) = a.variant::<u32>()?;
        match tag {
            0 => v
                .newtype_variant_seed(BinSeed { bpf: false })
                .map(GuestRecord::Rq),
            1 => v
                .newtype_variant::<super::io_wire::IoV1>()
                .map(|io| GuestRecord::Io(io.into())),
            4 => v.newtype_variant::<GuestIo>().map(GuestRecord::Io),
            2 => v
                .newtype_variant_seed(BinSeed { bpf: true })
                .map(GuestRecord::Rq),
            3 => v.newtype_variant_seed(IoBpfSeed).map(GuestRecord::Io),
            t => Err(de::Error::invalid_value(
                de::Unexpected::Unsigned(u64::from(t)),
                &"record tag 0 to 4",
            )),
        }
    }
}

/// Reads a syscall record's byte string in the guest BPF layout
/// ([`super::io_bpf`]).
struct IoBpfSeed;

impl<'de> DeserializeSeed<'de> for IoBpfSeed {
    type Value = GuestIo;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<GuestIo, D::Error> {
        d.deserialize_bytes(self)
    }
}

impl Visitor<'_> for IoBpfSeed {
    type Value = GuestIo;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a syscall record in the guest BPF layout")
    }

    fn visit_bytes<E: de::Error>(self, b: &[u8]) -> Result<GuestIo, E> {
        let mut io = GuestIo::default();
        super::io_bpf::decode_into(b, &mut io).map_err(E::custom)?;
        Ok(io)
    }
}

/// Reads a request record's byte string: its compact form ([`encode`]) or,
/// with `bpf`, the guest BPF layout ([`super::rq_bpf`]).
struct BinSeed {
    bpf: bool,
}

impl<'de> DeserializeSeed<'de> for BinSeed {
    type Value = GuestRq;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<GuestRq, D::Error> {
        d.deserialize_bytes(self)
    }
}

impl Visitor<'_> for BinSeed {
    type Value = GuestRq;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.bpf {
            "a request record in the guest BPF layout"
        } else {
            "a request record's binary form"
        })
    }

    fn visit_bytes<E: de::Error>(self, b: &[u8]) -> Result<GuestRq, E> {
        let mut rq = blank();
        if self.bpf {
            super::rq_bpf::decode_into(b, &mut rq)
        } else {
            decode_into(b, &mut rq)
        }
        .map_err(E::custom)?;
        Ok(rq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Point;

    fn full(i: u64) -> GuestRq {
        let mut r = crate::proto::sample_rq(i);
        r.time = Some(WallTime(-5 + i as i64));
        r.error = -5;
        r.kicked = Some(false);
        r.ts.set(Point::Irq, 1500 + i);
        r
    }

    #[test]
    fn an_ops_wire_byte_is_its_index() {
        for (i, op) in Op::ALL.into_iter().enumerate() {
            assert_eq!(op as usize, i);
            let b = postcard::to_stdvec(&op).unwrap();
            assert_eq!(b, [i as u8], "{op}");
        }
    }

    #[test]
    fn round_trips_every_field_and_absence() {
        let mut bare = crate::proto::sample_rq(3);
        (bare.queue, bare.head, bare.file_offset, bare.kicked) = (None, None, None, None);
        bare.ts = Points::new();
        bare.comm = Name::new("a-task-name-longer-than-24-bytes");
        for op in Op::ALL {
            for rq in [full(7), crate::proto::sample_rq(u64::MAX / 8), bare.clone()] {
                let rq = GuestRq { op, ..rq };
                let mut b = Vec::new();
                encode(&rq, &mut b);
                assert_eq!(decode(&b), Ok(rq));
            }
        }
    }

    /// Written after other bytes, and at its longest (every field at its widest,
    /// every point, points far apart): the room made once is enough, and what
    /// comes before is kept.
    #[test]
    fn appends_in_place_even_at_its_longest() {
        let mut widest = full(u64::MAX / 2);
        (widest.sector, widest.cgroup_id, widest.inode) = (u64::MAX, u64::MAX, u64::MAX);
        (widest.bytes, widest.pid, widest.tid, widest.bios) =
            (u32::MAX, u32::MAX, u32::MAX, u32::MAX);
        (widest.time, widest.error) = (Some(WallTime(i64::MIN)), i32::MIN);
        widest.file_offset = Some(u64::MAX);
        widest.disk = Name::new("d".repeat(300));
        for (k, p) in Point::ALL.iter().enumerate() {
            widest.ts.set(*p, if k % 2 == 0 { u64::MAX } else { 1 });
        }
        let (mut a, mut b) = (Vec::new(), Vec::new());
        encode(&full(1), &mut a);
        encode(&widest, &mut b);
        let mut both = a.clone();
        encode(&widest, &mut both);
        assert_eq!(both, [a.as_slice(), b.as_slice()].concat());
        assert_eq!(decode(&b), Ok(widest));
    }

    /// Decoding into a kept record: every field is the new record's, after
    /// any record before it (every field set, none set, long names) and
    /// after a record that failed halfway.
    #[test]
    fn decoding_in_place_leaves_nothing_of_the_record_before() {
        let mut bare = crate::proto::sample_rq(3);
        (bare.queue, bare.head, bare.file_offset, bare.kicked) = (None, None, None, None);
        (bare.ts, bare.disk) = (Points::new(), Name::new("nvme0n1"));
        bare.comm = Name::new("a-task-name-longer-than-24-bytes");
        let mut many = full(9);
        for (k, p) in Point::ALL.iter().enumerate() {
            many.ts.set(*p, 100 * k as u64);
        }
        let all = [full(7), crate::proto::sample_rq(u64::MAX / 8), bare, many];
        let bytes: Vec<Vec<u8>> = all
            .iter()
            .map(|r| {
                let mut b = Vec::new();
                encode(r, &mut b);
                b
            })
            .collect();
        for (a, ab) in all.iter().zip(&bytes) {
            for (b, bb) in all.iter().zip(&bytes) {
                let mut kept = blank();
                decode_into(ab, &mut kept).unwrap();
                assert_eq!(&kept, a);
                // A failure inside the points, after every other field.
                let cut = &bb[..bb.len() - 1];
                if decode_into(cut, &mut kept).is_ok() {
                    assert!(b.ts.is_empty());
                }
                decode_into(bb, &mut kept).unwrap();
                assert_eq!(&kept, b);
            }
        }
    }

    #[test]
    fn refuses_what_it_did_not_write() {
        let mut b = Vec::new();
        encode(&full(1), &mut b);
        // Every truncation fails (points last: a cut inside them too).
        for n in 0..b.len() {
            assert!(decode(&b[..n]).is_err(), "{n} of {} bytes", b.len());
        }
        let mut extra = b.clone();
        extra.push(0);
        assert_eq!(decode(&extra), Err(RqWireError::Points));
        let mut bad = b.clone();
        bad[0] |= 0x80;
        assert!(matches!(decode(&bad), Err(RqWireError::Flags(_))));
        let mut bad = b.clone();
        bad[1] = 8;
        assert_eq!(decode(&bad), Err(RqWireError::Op(8)));
        let mut bad = b.clone();
        bad[3] = 0xff; // inside the disk name "vda"
        assert_eq!(decode(&bad), Err(RqWireError::Utf8));
        // A head beyond u16.
        let mut rq = crate::proto::sample_rq(1);
        (rq.time, rq.queue, rq.file_offset, rq.kicked) = (None, None, None, None);
        let mut b = Vec::new();
        encode(&rq, &mut b);
        let mut pts = Vec::new();
        rq.ts.encode_wire_into(&mut pts);
        let at = b.len() - pts.len() - 1;
        assert_eq!(b[at], 1, "the head");
        let mut big = b[..at].to_vec();
        varint::push(&mut big, 1 << 16);
        big.extend_from_slice(&b[at + 1..]);
        assert_eq!(decode(&big), Err(RqWireError::Range("head")));
    }
}
