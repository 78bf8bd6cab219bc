//! Decoding of the raw ring-buffer records written by `bpf/guest` (layouts in
//! `bpf/guest/viotrace_guest.h`) into [`GuestRq`] / [`GuestIo`].

use std::collections::HashMap;

use thiserror::Error;
use viotrace_shared::points::SlotMap;
use viotrace_shared::proto::{io_bpf, rq_bpf};
use viotrace_shared::record::{GuestIo, GuestRq, Name, OffCpu, Op, Point, Points, RqRef};

use crate::bpf::types::{vt_io_event, vt_rq_event};

/// `sizeof(struct vt_rq_event)`.
pub const RQ_SIZE: usize = std::mem::size_of::<vt_rq_event>();
/// `sizeof(struct vt_io_event)`.
pub const IO_SIZE: usize = std::mem::size_of::<vt_io_event>();
const MAX_REFS: usize = io_bpf::MAX_REFS;

// The sizes the C header asserts (`_Static_assert` in viotrace_guest.h).
const _: () = assert!(RQ_SIZE == 184 && IO_SIZE == 400);

// The request record goes to the host as it is (`rq_bpf`): the host reads it
// by the offsets the protocol names, which must be the generated struct's.
const _: () = {
    use rq_bpf::off;
    use std::mem::offset_of;
    type R = vt_rq_event;
    assert!(RQ_SIZE == rq_bpf::RECORD_LEN);
    assert!(offset_of!(R, kind) == off::KIND && offset_of!(R, dev) == off::DEV);
    assert!(offset_of!(R, ts) == off::TS && offset_of!(R, sector) == off::SECTOR);
    assert!(offset_of!(R, cgroup_id) == off::CGROUP_ID && offset_of!(R, inode) == off::INODE);
    assert!(offset_of!(R, file_offset) == off::FILE_OFFSET && offset_of!(R, bytes) == off::BYTES);
    assert!(offset_of!(R, cmd_flags) == off::CMD_FLAGS && offset_of!(R, pid) == off::PID);
    assert!(offset_of!(R, tid) == off::TID && offset_of!(R, bios) == off::BIOS);
    assert!(offset_of!(R, status) == off::STATUS && offset_of!(R, queue) == off::QUEUE);
    assert!(offset_of!(R, head) == off::HEAD && offset_of!(R, has_queue) == off::HAS_QUEUE);
    assert!(offset_of!(R, has_head) == off::HAS_HEAD && offset_of!(R, kicked) == off::KICKED);
    assert!(offset_of!(R, has_file_offset) == off::HAS_FILE_OFFSET);
    assert!(offset_of!(R, comm) == off::COMM);
    assert!(std::mem::size_of::<[u64; rq_bpf::TS_LEN]>() == off::SECTOR - off::TS);
};

// A syscall record goes to a capture as it is (`io_bpf`), read back by the
// offsets the protocol names.
const _: () = {
    use io_bpf::off;
    use std::mem::{offset_of, size_of};
    type R = vt_io_event;
    type F = crate::bpf::types::vt_rq_ref;
    assert!(IO_SIZE == io_bpf::RECORD_LEN);
    assert!(offset_of!(R, runq_ns) - offset_of!(R, refs) == MAX_REFS * io_bpf::REF_LEN);
    assert!(offset_of!(R, kind) == off::KIND && offset_of!(R, nr) == off::NR);
    assert!(offset_of!(R, enter_ts) == off::ENTER_TS && offset_of!(R, exit_ts) == off::EXIT_TS);
    assert!(offset_of!(R, ret) == off::RET && offset_of!(R, bytes) == off::BYTES);
    assert!(offset_of!(R, inode) == off::INODE && offset_of!(R, file_offset) == off::FILE_OFFSET);
    assert!(offset_of!(R, cgroup_id) == off::CGROUP_ID && offset_of!(R, pid) == off::PID);
    assert!(offset_of!(R, tid) == off::TID && offset_of!(R, nrefs) == off::NREFS);
    assert!(offset_of!(R, refs_dropped) == off::REFS_DROPPED);
    assert!(offset_of!(R, has_file_offset) == off::HAS_FILE_OFFSET);
    assert!(offset_of!(R, comm) == off::COMM && offset_of!(R, refs) == off::REFS);
    assert!(size_of::<F>() == io_bpf::REF_LEN && offset_of!(F, sector) == off::REF_SECTOR);
    assert!(offset_of!(F, dev) == off::REF_DEV && offset_of!(F, bytes) == off::REF_BYTES);
};

include!(concat!(env!("OUT_DIR"), "/guest_stats.rs"));

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("record too short: {got} bytes, need {need}")]
    Short { got: usize, need: usize },
    #[error("unknown record kind {0}")]
    Kind(u32),
}

/// Kick outcome recorded for a request (an unknown value: unknown).
fn kicked(v: u8) -> Option<bool> {
    rq_bpf::kicked(v).ok().flatten()
}

pub use rq_bpf::blk_status_errno;

pub use viotrace_shared::proto::io_bpf::syscall_name;

/// Record structs generated from the BPF object's BTF that may be read from
/// any byte pattern.
///
/// # Safety
/// Implementors are `#[repr(C)]` and hold only integers and arrays of them.
unsafe trait RawRecord: Copy {}
// SAFETY: generated `#[repr(C)]` structs of integer fields and integer arrays.
unsafe impl RawRecord for vt_rq_event {}
// SAFETY: as above (its `refs` are `vt_rq_ref`, integers only).
unsafe impl RawRecord for vt_io_event {}

/// The one checked cast of a ring-buffer record into its generated struct.
fn cast<T: RawRecord>(b: &[u8]) -> Result<T, DecodeError> {
    let need = std::mem::size_of::<T>();
    if b.len() < need {
        return Err(DecodeError::Short { got: b.len(), need });
    }
    // SAFETY: `b` holds at least `size_of::<T>()` bytes (checked above), any
    // bit pattern is a valid `T` (`RawRecord`), and `read_unaligned` needs no
    // alignment.
    Ok(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>()) })
}

/// `f` of the record in `b` as its generated struct: read in place when `b`
/// is aligned for it (the ring buffer's records are 8-byte aligned), else
/// copied out first.
fn with_cast<T: RawRecord, R>(b: &[u8], f: impl FnOnce(&T) -> R) -> Result<R, DecodeError> {
    let need = std::mem::size_of::<T>();
    if b.len() < need {
        return Err(DecodeError::Short { got: b.len(), need });
    }
    let p = b.as_ptr().cast::<T>();
    if p.is_aligned() {
        // SAFETY: `b` holds at least `size_of::<T>()` bytes (checked above),
        // `p` is aligned for `T`, any bit pattern is a valid `T`
        // (`RawRecord`), and the reference lives only as long as the borrow
        // of `b`.
        Ok(f(unsafe { &*p }))
    } else {
        Ok(f(&cast::<T>(b)?))
    }
}

/// NUL-terminated string in a fixed-size `char` field (lossy UTF-8).
fn cstr(f: &[i8]) -> Name {
    let mut n = Name::default();
    set_cstr(&mut n, f);
    n
}

/// Sets `dst` to the NUL-terminated string in `f` (lossy UTF-8), unless it
/// already holds it (as the host decodes a record sent in the BPF layout).
fn set_cstr(dst: &mut Name, f: &[i8]) {
    let mut b = [0u8; 64];
    let n = f.len().min(b.len());
    for (d, &c) in b.iter_mut().zip(f) {
        *d = c as u8;
    }
    rq_bpf::set_cstr(dst, &b[..n]);
}

/// A decoded record, borrowed from its [`Decoder`]: the next record decoded
/// overwrites it.
#[derive(Debug, PartialEq)]
pub enum Record<'a> {
    Rq(&'a GuestRq),
    Io(&'a mut GuestIo),
}

/// Decodes records; remembers `dev_t → disk name` to name syscall references.
pub struct Decoder {
    /// The off-CPU programs are loaded: syscall records carry their `off_cpu`.
    pub off_cpu: bool,
    /// Only the per-stage tables read the records (no JSON, no threshold; a
    /// capture and the uplink take the ring buffer's bytes): a request
    /// record's wall-clock time and task name, and of a syscall record all but
    /// its points, name and references, are not decoded (`time` stays `None`,
    /// the rest holds what an earlier record left).
    pub tables_only: bool,
    disks: HashMap<u32, Name>,
    /// The last disk named (records come in runs of one disk).
    last_disk: Option<(u32, Name)>,
    /// The point of each `ts[]` slot of a request record (from `C_POINTS`).
    slots: SlotMap,
    /// The last record of each kind: decoding fills it in place (no
    /// allocation, no move of the record per decode).
    rq: GuestRq,
    io: GuestIo,
    /// Whose names `rq.disk` and `io.syscall` hold (a disk's name, once
    /// found, does not change).
    rq_dev: Option<u32>,
    io_nr: Option<u32>,
}

/// The point of each slot of the C side's `ts[]` array, matched by name.
fn point_slots() -> Vec<Option<Point>> {
    let mut v = vec![None; C_POINTS.iter().map(|e| e.0 + 1).max().unwrap_or(0)];
    for &(slot, name) in &C_POINTS {
        v[slot] = Point::from_name(name);
    }
    v
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Decoder {
    pub fn new() -> Self {
        Decoder {
            off_cpu: false,
            tables_only: false,
            disks: HashMap::new(),
            last_disk: None,
            slots: SlotMap::new(&point_slots()),
            rq: viotrace_shared::proto::rq::blank(),
            io: GuestIo::default(),
            rq_dev: None,
            io_nr: None,
        }
    }

    /// Names a disk ahead of its records (tests; a name `/sys` does not have).
    #[cfg(test)]
    pub fn name_disk(&mut self, dev: u32, name: &str) {
        self.disks.insert(dev, name.into());
    }

    /// Names a kernel dev_t (`major << 20 | minor`) from `/sys/dev/block`, once
    /// per disk (the BPF side sends only the dev_t), else `major:minor`.
    fn disk_name(&mut self, dev: u32) -> Name {
        if let Some((d, n)) = &self.last_disk {
            if *d == dev {
                return n.clone();
            }
        }
        if let Some(n) = self.disks.get(&dev) {
            self.last_disk = Some((dev, n.clone()));
            return n.clone();
        }
        let (maj, min) = (dev >> 20, dev & 0xf_ffff);
        let name = std::fs::read_to_string(format!("/sys/dev/block/{maj}:{min}/uevent"))
            .ok()
            .and_then(|u| {
                u.lines()
                    .find_map(|l| l.strip_prefix("DEVNAME=").map(str::to_owned))
            })
            .unwrap_or_else(|| format!("{maj}:{min}"));
        let name = Name::from(name);
        self.disks.insert(dev, name.clone());
        name
    }

    /// Decodes one ring-buffer record into the decoder's record of its kind.
    pub fn decode(&mut self, b: &[u8]) -> Result<Record<'_>, DecodeError> {
        if b.len() < 4 {
            return Err(DecodeError::Short {
                got: b.len(),
                need: 4,
            });
        }
        match u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) {
            K_RQ => {
                with_cast(b, |r| self.decode_rq(r))?;
                Ok(Record::Rq(&self.rq))
            }
            K_IO => {
                with_cast(b, |r| self.decode_io(r))?;
                Ok(Record::Io(&mut self.io))
            }
            k => Err(DecodeError::Kind(k)),
        }
    }

    fn decode_rq(&mut self, r: &vt_rq_event) {
        // (filled where it stays: a set built aside is 176 bytes to copy)
        self.rq.ts.reset_nonzero_from(&self.slots, &r.ts);
        if self.rq_dev != Some(r.dev) {
            self.rq.disk = self.disk_name(r.dev);
            self.rq_dev = Some(r.dev);
        }
        if self.tables_only {
            // (the tables read the disk and the points, nothing else)
            return;
        }
        let op = Op::from_linux_req_op(r.cmd_flags);
        let q = &mut self.rq;
        q.time = viotrace_shared::walltime::of_points(&q.ts);
        set_cstr(&mut q.comm, &r.comm);
        q.op = op;
        // A flush has no position (the kernel keeps -1); virtio sends 0.
        q.sector = if op == Op::Flush { 0 } else { r.sector };
        q.bytes = r.bytes;
        q.queue = (r.has_queue != 0).then_some(r.queue);
        q.head = (r.has_head != 0).then_some(r.head);
        q.pid = r.pid;
        q.tid = r.tid;
        q.cgroup_id = r.cgroup_id;
        q.inode = r.inode;
        q.file_offset = (r.has_file_offset != 0).then_some(r.file_offset);
        q.kicked = kicked(r.kicked);
        q.bios = r.bios;
        q.error = blk_status_errno(r.status);
    }

    fn decode_io(&mut self, r: &vt_io_event) {
        let mut ts = Points::new();
        ts.set_nonzero(Point::SyscallEnter, r.enter_ts);
        ts.set_nonzero(Point::SyscallExit, r.exit_ts);
        let nrefs = (r.nrefs as usize).min(MAX_REFS);
        let mut requests = std::mem::take(&mut self.io.requests);
        requests.clear();
        for f in &r.refs[..nrefs] {
            requests.push(RqRef {
                disk: self.disk_name(f.dev),
                sector: f.sector,
                bytes: f.bytes,
            });
        }
        if self.io_nr != Some(r.nr) {
            self.io.syscall = syscall_name(r.nr);
            self.io_nr = Some(r.nr);
        }
        self.io.requests = requests;
        self.io.requests_unlisted = r.refs_dropped;
        self.io.ts = ts;
        if self.tables_only {
            // (the tables read the points and the name; a capture copies the
            // record and names its references' disks)
            return;
        }
        let off_cpu = self.off_cpu.then(|| OffCpu {
            runnable_ns: r.runq_ns,
            blocked_ns: r.blocked_ns,
            holder: (r.holder_pid != 0 || r.holder_comm[0] != 0)
                .then(|| format!("pid {} {}", r.holder_pid, cstr(&r.holder_comm))),
        });
        let io = &mut self.io;
        io.time = viotrace_shared::walltime::of_points(&io.ts);
        io.pid = r.pid;
        io.tid = r.tid;
        set_cstr(&mut io.comm, &r.comm);
        io.cgroup_id = r.cgroup_id;
        io.inode = r.inode;
        io.file_offset = (r.has_file_offset != 0).then_some(r.file_offset);
        io.bytes = r.bytes;
        io.ret = r.ret;
        io.off_cpu = off_cpu;
        io.cause = None;
    }
}

/// Raw ring-buffer records as the BPF side writes them, for tests.
#[cfg(test)]
pub(crate) mod samples {
    use super::*;

    pub(crate) fn put(b: &mut [u8], o: usize, v: &[u8]) {
        b[o..o + v.len()].copy_from_slice(v);
    }

    /// A request record: vdb (253:16), a sync write of 4 KiB at sector 2048.
    pub(crate) fn raw_rq() -> Vec<u8> {
        let mut b = vec![0u8; RQ_SIZE];
        put(&mut b, 0, &K_RQ.to_ne_bytes());
        put(&mut b, 4, &((253u32 << 20) | 16).to_ne_bytes());
        let ts_off = |p: Point| {
            let slot = C_POINTS.iter().find(|e| e.1 == p.name()).expect("C slot").0;
            8 + 8 * slot
        };
        put(&mut b, ts_off(Point::BioQueue), &1000u64.to_ne_bytes());
        put(&mut b, ts_off(Point::RqIssue), &2000u64.to_ne_bytes());
        put(&mut b, ts_off(Point::VqAdd), &2100u64.to_ne_bytes());
        put(&mut b, ts_off(Point::RqComplete), &9000u64.to_ne_bytes());
        put(&mut b, 104, &2048u64.to_ne_bytes());
        put(&mut b, 112, &77u64.to_ne_bytes());
        put(&mut b, 120, &12u64.to_ne_bytes());
        put(&mut b, 128, &8192u64.to_ne_bytes());
        put(&mut b, 136, &4096u32.to_ne_bytes());
        put(&mut b, 140, &(1u32 | 1 << 11).to_ne_bytes()); // write | sync flag
        put(&mut b, 144, &100u32.to_ne_bytes());
        put(&mut b, 148, &101u32.to_ne_bytes());
        put(&mut b, 152, &2u32.to_ne_bytes());
        put(&mut b, 160, &1u16.to_ne_bytes());
        put(&mut b, 162, &37u16.to_ne_bytes());
        b[164] = 1; // has_queue
        b[165] = 1; // has_head
        b[166] = 2; // suppressed
        b[167] = 1; // has_file_offset
        put(&mut b, 168, b"fio\0");
        b
    }

    /// A syscall record: fio's pwrite64 of 4 KiB, one request on vdb (253:16).
    pub(crate) fn raw_io() -> Vec<u8> {
        let mut b = vec![0u8; IO_SIZE];
        put(&mut b, 0, &K_IO.to_ne_bytes());
        put(&mut b, 4, &18u32.to_ne_bytes()); // pwrite64
        put(&mut b, 8, &500u64.to_ne_bytes());
        put(&mut b, 16, &9500u64.to_ne_bytes());
        put(&mut b, 24, &4096i64.to_ne_bytes());
        put(&mut b, 32, &4096u64.to_ne_bytes());
        put(&mut b, 40, &12u64.to_ne_bytes());
        put(&mut b, 48, &8192u64.to_ne_bytes());
        put(&mut b, 56, &77u64.to_ne_bytes());
        put(&mut b, 64, &100u32.to_ne_bytes());
        put(&mut b, 68, &101u32.to_ne_bytes());
        put(&mut b, 72, &1u32.to_ne_bytes());
        put(&mut b, 76, &3u32.to_ne_bytes());
        b[80] = 1;
        put(&mut b, 88, b"fio\0");
        put(&mut b, 104, &2048u64.to_ne_bytes());
        put(&mut b, 112, &((253u32 << 20) | 16).to_ne_bytes());
        put(&mut b, 116, &4096u32.to_ne_bytes());
        b
    }
}

#[cfg(test)]
#[path = "raw_tests.rs"]
mod tests;
