//! A guest request record on the wire as the guest's BPF object wrote it
//! (record tag 2, protocol 8): the ring buffer's bytes, copied, and the two
//! things the BPF side does not know, the disk's name and the guest's
//! wall-clock offset. The guest agent then neither decodes the fields the
//! host needs nor encodes them (in the compact form, [`super::rq`], that cost
//! the guest about 1 300 instructions per request); the host, which has the
//! CPU to spare and checks every byte anyway, decodes it into the same
//! [`GuestRq`] the guest's own decoder makes.
//!
//! Layout of the body (little-endian; x86-64 guests, whose BPF records are
//! little-endian and laid out as `struct vt_rq_event` in
//! `bpf/guest/viotrace_guest.h`; the guest agent asserts the offsets below
//! against the type libbpf-cargo generates from it):
//!
//! | bytes | field |
//! |---|---|
//! | 0..184 | `struct vt_rq_event` ([`RECORD_LEN`]; offsets in [`off`]) |
//! | 184..192 | the guest's `CLOCK_REALTIME − CLOCK_MONOTONIC`, ns, i64 |
//! | 192.. | the disk's name, UTF-8, at most [`MAX_DISK`] bytes |
//!
//! Decoding is strict: a wrong length, kind, flag byte, kick value or a name
//! that is not UTF-8 is an error ([`RqWireError`]); the task name is taken as
//! the guest's decoder takes it (up to its NUL, lossy UTF-8).

use super::rq::RqWireError;
use crate::record::{GuestRq, Name, Op, Point};
use crate::varint;
use crate::walltime::WallTime;

/// `sizeof(struct vt_rq_event)`.
pub const RECORD_LEN: usize = 184;
/// The body's fixed part: the record and the wall-clock offset.
pub const FIXED_LEN: usize = RECORD_LEN + 8;
/// Longest disk name accepted (Linux's are at most 32 bytes).
pub const MAX_DISK: usize = 64;
/// `K_RQ`: the record's `kind`.
pub const KIND_RQ: u32 = 1;
/// Entries of `ts[]` (`P_NR`); entry `i` is the point of id `i`.
pub const TS_LEN: usize = 12;
/// The record's tag in a batch.
pub const TAG: u8 = 2;

/// Byte offsets of `struct vt_rq_event`'s fields.
pub mod off {
    pub const KIND: usize = 0;
    pub const DEV: usize = 4;
    pub const TS: usize = 8;
    pub const SECTOR: usize = 104;
    pub const CGROUP_ID: usize = 112;
    pub const INODE: usize = 120;
    pub const FILE_OFFSET: usize = 128;
    pub const BYTES: usize = 136;
    pub const CMD_FLAGS: usize = 140;
    pub const PID: usize = 144;
    pub const TID: usize = 148;
    pub const BIOS: usize = 152;
    pub const STATUS: usize = 156;
    pub const QUEUE: usize = 160;
    pub const HEAD: usize = 162;
    pub const HAS_QUEUE: usize = 164;
    pub const HAS_HEAD: usize = 165;
    pub const KICKED: usize = 166;
    pub const HAS_FILE_OFFSET: usize = 167;
    pub const COMM: usize = 168;
    /// `VT_COMM`.
    pub const COMM_LEN: usize = 16;
}

const _: () = assert!(off::COMM + off::COMM_LEN == RECORD_LEN);
const _: () = assert!(off::TS + 8 * TS_LEN == off::SECTOR);

/// Appends the record's whole batch entry (tag, length, body) to `out`.
/// `bpf` is the ring buffer's record; `None` (nothing appended) when it is
/// not a request record of [`RECORD_LEN`] bytes or the name is too long.
pub fn encode_record(bpf: &[u8], wall_offset: i64, disk: &str, out: &mut Vec<u8>) -> Option<()> {
    if bpf.len() != RECORD_LEN || disk.len() > MAX_DISK || u32_at(bpf, off::KIND) != KIND_RQ {
        return None;
    }
    out.push(TAG);
    varint::push(out, (FIXED_LEN + disk.len()) as u64);
    out.extend_from_slice(bpf);
    out.extend_from_slice(&wall_offset.to_le_bytes());
    out.extend_from_slice(disk.as_bytes());
    Some(())
}

#[inline]
pub(super) fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

#[inline]
pub(super) fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}

#[inline]
fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes(b[o..o + 2].try_into().expect("2 bytes"))
}

/// A flag byte: 0 or 1.
fn flag(b: &[u8], o: usize, what: &'static str) -> Result<bool, RqWireError> {
    match b[o] {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(RqWireError::Range(what)),
    }
}

/// The kick outcome (`enum vt_kick`).
pub fn kicked(v: u8) -> Result<Option<bool>, RqWireError> {
    match v {
        0 => Ok(None),
        1 => Ok(Some(true)),
        2 => Ok(Some(false)),
        _ => Err(RqWireError::Range("kicked")),
    }
}

/// Linux `blk_status_t` → negative errno (`blk_status_to_errno`).
pub fn blk_status_errno(st: i32) -> i32 {
    match st {
        0 => 0,
        1 => -95,  // NOTSUPP: EOPNOTSUPP
        2 => -110, // TIMEOUT: ETIMEDOUT
        3 => -28,  // NOSPC
        4 => -67,  // TRANSPORT: ENOLINK
        5 => -121, // TARGET: EREMOTEIO
        6 => -52,  // NEXUS / RESV_CONFLICT: EBADE
        7 => -61,  // MEDIUM: ENODATA
        8 => -84,  // PROTECTION: EILSEQ
        9 => -12,  // RESOURCE: ENOMEM
        12 => -11, // AGAIN
        _ => -5,   // IOERR and the rest: EIO
    }
}

/// Sets `dst` to the NUL-terminated string in `f` (lossy UTF-8), unless it
/// already holds it: a task's records come in runs, and the comparison is
/// cheaper than building the name again.
pub fn set_cstr(dst: &mut Name, f: &[u8]) {
    let n = f.iter().position(|&c| c == 0).unwrap_or(f.len());
    let f = &f[..n];
    if dst.as_bytes() == f {
        return;
    }
    *dst = match std::str::from_utf8(f) {
        Ok(s) => Name::new(s),
        Err(_) => Name::from_utf8_lossy(f),
    };
}

/// Reads a body written by [`encode_record`] (all of `b`) into `rq`: every
/// field is written (the names only when their bytes differ). On an error
/// `rq` holds part of the new record and part of the old.
pub fn decode_into(b: &[u8], rq: &mut GuestRq) -> Result<(), RqWireError> {
    if b.len() < FIXED_LEN || b.len() > FIXED_LEN + MAX_DISK {
        return Err(RqWireError::Length(b.len()));
    }
    let kind = u32_at(b, off::KIND);
    if kind != KIND_RQ {
        return Err(RqWireError::Tag(kind));
    }
    let disk = &b[FIXED_LEN..];
    if rq.disk.as_bytes() != disk {
        rq.disk = Name::new(std::str::from_utf8(disk).map_err(|_| RqWireError::Utf8)?);
    }
    rq.ts = Default::default();
    let mut first = u64::MAX;
    for i in 0..TS_LEN {
        let t = u64_at(b, off::TS + 8 * i);
        if t != 0 {
            let p = Point::from_id(i as u8).ok_or(RqWireError::Points)?;
            rq.ts.set(p, t);
            first = first.min(t);
        }
    }
    let wall_offset = u64_at(b, RECORD_LEN) as i64;
    rq.time = (first != u64::MAX).then(|| WallTime((first as i64).saturating_add(wall_offset)));
    rq.op = Op::from_linux_req_op(u32_at(b, off::CMD_FLAGS));
    // A flush has no position (the kernel keeps -1); virtio sends 0.
    rq.sector = if rq.op == Op::Flush {
        0
    } else {
        u64_at(b, off::SECTOR)
    };
    rq.bytes = u32_at(b, off::BYTES);
    rq.queue = flag(b, off::HAS_QUEUE, "has_queue")?.then(|| u16_at(b, off::QUEUE));
    rq.head = flag(b, off::HAS_HEAD, "has_head")?.then(|| u16_at(b, off::HEAD));
    rq.pid = u32_at(b, off::PID);
    rq.tid = u32_at(b, off::TID);
    rq.cgroup_id = u64_at(b, off::CGROUP_ID);
    rq.inode = u64_at(b, off::INODE);
    rq.file_offset =
        flag(b, off::HAS_FILE_OFFSET, "has_file_offset")?.then(|| u64_at(b, off::FILE_OFFSET));
    rq.kicked = kicked(b[off::KICKED])?;
    rq.bios = u32_at(b, off::BIOS);
    rq.error = blk_status_errno(u32_at(b, off::STATUS) as i32);
    set_cstr(&mut rq.comm, &b[off::COMM..off::COMM + off::COMM_LEN]);
    Ok(())
}

/// The batch entry a guest agent would send for `rq` (tests and benches):
/// its fields laid out as the BPF side lays them out, its guest points in
/// `ts[]`, its time as the wall-clock offset from its first point. An op, an
/// error or a task name the layout cannot carry (`Op::Other`, an errno
/// without a `blk_status_t`, a name over 15 bytes) comes back otherwise.
#[cfg(any(test, feature = "testing"))]
pub fn entry_of(rq: &GuestRq, out: &mut Vec<u8>) {
    let mut b = [0u8; RECORD_LEN];
    let mut put = |o: usize, v: &[u8]| b[o..o + v.len()].copy_from_slice(v);
    put(off::KIND, &KIND_RQ.to_le_bytes());
    let mut first = None;
    for (p, t) in rq.ts.iter() {
        if (p as usize) < TS_LEN {
            put(off::TS + 8 * p as usize, &t.to_le_bytes());
            first = Some(first.map_or(t, |f: u64| f.min(t)));
        }
    }
    let op: u32 = match rq.op {
        Op::Read => 0,
        Op::Write => 1,
        Op::Flush => 2,
        Op::Discard => 3,
        Op::SecureErase => 5,
        Op::WriteZeroes => 9,
        _ => 0xff,
    };
    put(off::SECTOR, &rq.sector.to_le_bytes());
    put(off::CGROUP_ID, &rq.cgroup_id.to_le_bytes());
    put(off::INODE, &rq.inode.to_le_bytes());
    put(off::FILE_OFFSET, &rq.file_offset.unwrap_or(0).to_le_bytes());
    put(off::BYTES, &rq.bytes.to_le_bytes());
    put(off::CMD_FLAGS, &op.to_le_bytes());
    put(off::PID, &rq.pid.to_le_bytes());
    put(off::TID, &rq.tid.to_le_bytes());
    put(off::BIOS, &rq.bios.to_le_bytes());
    let status = (0..16)
        .find(|&s| blk_status_errno(s) == rq.error)
        .unwrap_or(10);
    put(off::STATUS, &status.to_le_bytes());
    put(off::QUEUE, &rq.queue.unwrap_or(0).to_le_bytes());
    put(off::HEAD, &rq.head.unwrap_or(0).to_le_bytes());
    put(off::HAS_QUEUE, &[u8::from(rq.queue.is_some())]);
    put(off::HAS_HEAD, &[u8::from(rq.head.is_some())]);
    put(
        off::KICKED,
        &[rq.kicked.map_or(0, |k| if k { 1 } else { 2 })],
    );
    put(off::HAS_FILE_OFFSET, &[u8::from(rq.file_offset.is_some())]);
    let comm = rq.comm.as_bytes();
    put(off::COMM, &comm[..comm.len().min(off::COMM_LEN - 1)]);
    let wall = match (rq.time, first) {
        (Some(t), Some(f)) => t.unix_ns().wrapping_sub(f as i64),
        _ => 0,
    };
    encode_record(&b, wall, &rq.disk, out).expect("a disk name the layout carries");
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::proto::rq::blank;

    fn put(b: &mut [u8], o: usize, v: &[u8]) {
        b[o..o + v.len()].copy_from_slice(v);
    }

    /// A record as the BPF side writes one: a write of 4 KiB at sector 80,
    /// three points, queue 0 head 7, kicked.
    pub(crate) fn bpf_record() -> Vec<u8> {
        let mut b = vec![0u8; RECORD_LEN];
        put(&mut b, off::KIND, &KIND_RQ.to_le_bytes());
        put(&mut b, off::DEV, &((253u32 << 20) | 16).to_le_bytes());
        put(&mut b, off::TS + 8 * 4, &1_000u64.to_le_bytes());
        put(&mut b, off::TS + 8 * 5, &1_200u64.to_le_bytes());
        put(&mut b, off::TS + 8 * 9, &9_000u64.to_le_bytes());
        put(&mut b, off::SECTOR, &80u64.to_le_bytes());
        put(&mut b, off::CGROUP_ID, &77u64.to_le_bytes());
        put(&mut b, off::INODE, &12u64.to_le_bytes());
        put(&mut b, off::FILE_OFFSET, &40_960u64.to_le_bytes());
        put(&mut b, off::BYTES, &4096u32.to_le_bytes());
        put(&mut b, off::CMD_FLAGS, &0x801u32.to_le_bytes());
        put(&mut b, off::PID, &42u32.to_le_bytes());
        put(&mut b, off::TID, &43u32.to_le_bytes());
        put(&mut b, off::BIOS, &1u32.to_le_bytes());
        put(&mut b, off::HEAD, &7u16.to_le_bytes());
        b[off::HAS_QUEUE] = 1;
        b[off::HAS_HEAD] = 1;
        b[off::KICKED] = 1;
        b[off::HAS_FILE_OFFSET] = 1;
        put(&mut b, off::COMM, b"fio\0");
        b
    }

    /// The body of a batch entry (tag and length taken off).
    fn body(bpf: &[u8], offset: i64, disk: &str) -> Vec<u8> {
        let mut v = Vec::new();
        encode_record(bpf, offset, disk, &mut v).unwrap();
        let mut rest = &v[1..];
        let len = varint::take(&mut rest).unwrap() as usize;
        assert_eq!(v[0], TAG);
        assert_eq!(rest.len(), len);
        rest.to_vec()
    }

    #[test]
    fn decodes_every_field() {
        let mut rq = blank();
        decode_into(&body(&bpf_record(), 5_000, "vdb"), &mut rq).unwrap();
        assert_eq!(&*rq.disk, "vdb");
        assert_eq!(rq.time, Some(WallTime(6_000)));
        assert_eq!(rq.op, Op::Write);
        assert_eq!((rq.sector, rq.bytes, rq.bios), (80, 4096, 1));
        assert_eq!((rq.queue, rq.head), (Some(0), Some(7)));
        assert_eq!((rq.pid, rq.tid, &*rq.comm), (42, 43, "fio"));
        assert_eq!(
            (rq.cgroup_id, rq.inode, rq.file_offset),
            (77, 12, Some(40_960))
        );
        assert_eq!((rq.kicked, rq.error), (Some(true), 0));
        let pts: Vec<_> = rq.ts.iter().collect();
        assert_eq!(
            pts,
            [
                (Point::RqIssue, 1_000),
                (Point::VqAdd, 1_200),
                (Point::RqComplete, 9_000)
            ]
        );
    }

    #[test]
    fn absent_fields_flush_and_errors() {
        let mut b = bpf_record();
        b[off::HAS_QUEUE] = 0;
        b[off::HAS_HEAD] = 0;
        b[off::HAS_FILE_OFFSET] = 0;
        b[off::KICKED] = 2;
        put(&mut b, off::CMD_FLAGS, &2u32.to_le_bytes());
        put(&mut b, off::STATUS, &10i32.to_le_bytes());
        put(&mut b, off::SECTOR, &u64::MAX.to_le_bytes());
        let mut rq = crate::proto::sample_rq(3);
        decode_into(&body(&b, 0, "vda"), &mut rq).unwrap();
        assert_eq!((rq.queue, rq.head, rq.file_offset), (None, None, None));
        assert_eq!((rq.op, rq.sector), (Op::Flush, 0));
        assert_eq!((rq.kicked, rq.error), (Some(false), -5));
        // No point: no time.
        for i in 0..TS_LEN {
            put(&mut b, off::TS + 8 * i, &0u64.to_le_bytes());
        }
        decode_into(&body(&b, 9, "vda"), &mut rq).unwrap();
        assert!(rq.ts.is_empty() && rq.time.is_none());
    }

    #[test]
    fn refuses_what_the_bpf_side_never_writes() {
        let good = body(&bpf_record(), 0, "vda");
        let mut rq = blank();
        let bad = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = good.clone();
            f(&mut b);
            decode_into(&b, &mut blank())
        };
        assert_eq!(
            bad(&|b| b.truncate(FIXED_LEN - 1)),
            Err(RqWireError::Length(191))
        );
        assert_eq!(
            bad(&|b| b.extend_from_slice(&[b'x'; MAX_DISK])),
            Err(RqWireError::Length(FIXED_LEN + 3 + MAX_DISK))
        );
        assert_eq!(bad(&|b| b[off::KIND] = 2), Err(RqWireError::Tag(2)));
        assert_eq!(
            bad(&|b| b[off::HAS_HEAD] = 2),
            Err(RqWireError::Range("has_head"))
        );
        assert_eq!(
            bad(&|b| b[off::KICKED] = 3),
            Err(RqWireError::Range("kicked"))
        );
        assert_eq!(bad(&|b| b[FIXED_LEN] = 0xff), Err(RqWireError::Utf8));
        // A task name that is not UTF-8 is taken lossily, as the guest does.
        let mut b = good.clone();
        b[off::COMM] = 0xff;
        decode_into(&b, &mut rq).unwrap();
        assert_eq!(&*rq.comm, "\u{fffd}io");
        // The encoder takes only a request record of the layout's size.
        let mut out = Vec::new();
        assert!(encode_record(&bpf_record()[..100], 0, "vda", &mut out).is_none());
        assert!(encode_record(&bpf_record(), 0, &"x".repeat(MAX_DISK + 1), &mut out).is_none());
        assert!(out.is_empty());
    }

    #[test]
    fn a_record_laid_out_for_tests_decodes_as_itself() {
        for i in 0..50 {
            let mut rq = crate::proto::sample_rq(i);
            rq.time = Some(WallTime(1_000_000 + i as i64));
            rq.error = if i % 3 == 0 { -5 } else { 0 };
            let mut e = Vec::new();
            entry_of(&rq, &mut e);
            let mut got = blank();
            decode_into(&body_of(&e), &mut got).unwrap();
            assert_eq!(got, rq);
        }
    }

    fn body_of(entry: &[u8]) -> Vec<u8> {
        let mut rest = &entry[1..];
        varint::take(&mut rest).unwrap();
        rest.to_vec()
    }

    #[test]
    fn names_are_replaced_only_when_they_change() {
        let mut rq = blank();
        decode_into(&body(&bpf_record(), 0, "vda"), &mut rq).unwrap();
        let mut b = bpf_record();
        put(&mut b, off::COMM, b"kworker/0:1\0");
        decode_into(&body(&b, 0, "vdc"), &mut rq).unwrap();
        assert_eq!((&*rq.disk, &*rq.comm), ("vdc", "kworker/0:1"));
    }
}
