//! A guest syscall record in a capture as the guest's BPF object wrote it
//! (record tag 3, capture format 2): the ring buffer's bytes up to the last
//! request reference, copied, and what the BPF side does not know, the
//! guest's wall-clock offset and the referenced disks' names. The guest agent
//! then neither decodes the fields a capture holds nor encodes them (the
//! compact postcard form cost it about as much as the request record's did
//! before [`super::rq_bpf`]); `viotrace-guest decode` reads the record into
//! the same [`GuestIo`] the agent's own decoder makes.
//!
//! Only a record without off-CPU time and without a cause goes this way (the
//! agent adds both in user space, with `-t`): such a record is written in the
//! compact form ([`super::io_wire`]), tag 1.
//!
//! Layout of the body (little-endian; x86-64 guests, `struct vt_io_event` in
//! `bpf/guest/viotrace_guest.h`, whose offsets the guest agent asserts against
//! the type libbpf-cargo generates):
//!
//! | bytes | field |
//! |---|---|
//! | 0..104 | `struct vt_io_event` up to its request references ([`HEAD_LEN`]; offsets in [`off`]) |
//! | 104..104+16n | `refs[0..n]`, `n` = `nrefs` (at most [`MAX_REFS`]) |
//! | 8 bytes | the guest's `CLOCK_REALTIME − CLOCK_MONOTONIC`, ns, i64 |
//! | n names | each reference's disk name: a length byte (at most [`MAX_DISK`]), UTF-8 |
//!
//! Decoding is strict: a wrong length or kind, more references than the
//! layout holds, a flag byte other than 0 or 1, or a name that is not UTF-8
//! is an error ([`RqWireError`]); the task name is taken as the guest's
//! decoder takes it (up to its NUL, lossy UTF-8).

use super::rq::RqWireError;
use super::rq_bpf::{set_cstr, u32_at, u64_at, MAX_DISK};
use crate::record::{GuestIo, Name, Point, Points, RqRef};
use crate::varint;
use crate::walltime::WallTime;

/// `sizeof(struct vt_io_event)`.
pub const RECORD_LEN: usize = 400;
/// The bytes before the request references (`offsetof(refs)`).
pub const HEAD_LEN: usize = off::REFS;
/// `sizeof(struct vt_rq_ref)`.
pub const REF_LEN: usize = 16;
/// `VT_MAX_REFS`.
pub const MAX_REFS: usize = 16;
/// `K_IO`.
pub const KIND_IO: u32 = 2;
/// The record's tag in a batch (after the compact forms' 0 and 1 and
/// [`super::rq_bpf::TAG`]).
pub const TAG: u8 = 3;

/// Field offsets in `struct vt_io_event`.
pub mod off {
    pub const KIND: usize = 0;
    pub const NR: usize = 4;
    pub const ENTER_TS: usize = 8;
    pub const EXIT_TS: usize = 16;
    pub const RET: usize = 24;
    pub const BYTES: usize = 32;
    pub const INODE: usize = 40;
    pub const FILE_OFFSET: usize = 48;
    pub const CGROUP_ID: usize = 56;
    pub const PID: usize = 64;
    pub const TID: usize = 68;
    pub const NREFS: usize = 72;
    /// The requests beyond `refs` (`requests_unlisted`).
    pub const REFS_DROPPED: usize = 76;
    pub const HAS_FILE_OFFSET: usize = 80;
    pub const COMM: usize = 88;
    /// `VT_COMM`.
    pub const COMM_LEN: usize = 16;
    pub const REFS: usize = 104;
    /// In a `struct vt_rq_ref`.
    pub const REF_SECTOR: usize = 0;
    pub const REF_DEV: usize = 8;
    pub const REF_BYTES: usize = 12;
}

const _: () = assert!(off::COMM + off::COMM_LEN == off::REFS);
const _: () = assert!(HEAD_LEN + MAX_REFS * REF_LEN <= RECORD_LEN);

/// The syscall number of a record in this layout (None: too short to hold one).
pub fn syscall_nr(bpf: &[u8]) -> Option<u32> {
    (bpf.len() >= off::NR + 4).then(|| u32_at(bpf, off::NR))
}

/// x86-64 syscall number → name (the ones the guest's BPF side traces).
pub fn syscall_name(nr: u32) -> Name {
    match nr {
        0 => "read",
        1 => "write",
        17 => "pread64",
        18 => "pwrite64",
        19 => "readv",
        20 => "writev",
        74 => "fsync",
        75 => "fdatasync",
        209 => "io_submit",
        277 => "sync_file_range",
        295 => "preadv",
        296 => "pwritev",
        327 => "preadv2",
        328 => "pwritev2",
        426 => "io_uring_enter",
        n => return compact_str::format_compact!("syscall_{n}"),
    }
    .into()
}

/// Appends the record's whole batch entry (tag, length, body) to `out`.
/// `bpf` is the ring buffer's record, `disks` the names of its references'
/// disks, in order. `None` (nothing appended) when it is not a syscall record
/// of [`RECORD_LEN`] bytes, its references are more than the layout holds or
/// than the names given, or a name is too long.
pub fn encode_record<'a>(
    bpf: &[u8],
    wall_offset: i64,
    disks: impl ExactSizeIterator<Item = &'a str> + Clone,
    out: &mut Vec<u8>,
) -> Option<()> {
    if bpf.len() != RECORD_LEN || u32_at(bpf, off::KIND) != KIND_IO {
        return None;
    }
    let n = u32_at(bpf, off::NREFS) as usize;
    if n > MAX_REFS || disks.len() != n || disks.clone().any(|d| d.len() > MAX_DISK) {
        return None;
    }
    let fixed = HEAD_LEN + n * REF_LEN;
    let names: usize = disks.clone().map(|d| 1 + d.len()).sum();
    out.push(TAG);
    varint::push(out, (fixed + 8 + names) as u64);
    out.extend_from_slice(&bpf[..fixed]);
    out.extend_from_slice(&wall_offset.to_le_bytes());
    for d in disks {
        out.push(d.len() as u8);
        out.extend_from_slice(d.as_bytes());
    }
    Some(())
}

/// Reads a body written by [`encode_record`] (all of `b`) into `io`: every
/// field is written (the names only when their bytes differ; no off-CPU
/// time, no cause). On an error `io` holds part of the new record and part
/// of the old.
pub fn decode_into(b: &[u8], io: &mut GuestIo) -> Result<(), RqWireError> {
    if b.len() < HEAD_LEN + 8 {
        return Err(RqWireError::IoLength(b.len()));
    }
    let kind = u32_at(b, off::KIND);
    if kind != KIND_IO {
        return Err(RqWireError::Tag(kind));
    }
    let n = u32_at(b, off::NREFS) as usize;
    if n > MAX_REFS {
        return Err(RqWireError::Range("nrefs"));
    }
    let fixed = HEAD_LEN + n * REF_LEN;
    if b.len() < fixed + 8 {
        return Err(RqWireError::IoLength(b.len()));
    }
    let nr = u32_at(b, off::NR);
    let name = syscall_name(nr);
    if io.syscall != name {
        io.syscall = name;
    }
    let mut ts = Points::new();
    ts.set_nonzero(Point::SyscallEnter, u64_at(b, off::ENTER_TS));
    ts.set_nonzero(Point::SyscallExit, u64_at(b, off::EXIT_TS));
    let wall_offset = u64_at(b, fixed) as i64;
    io.time = ts
        .min_max()
        .map(|(first, _)| WallTime((first as i64).saturating_add(wall_offset)));
    io.ts = ts;
    io.ret = u64_at(b, off::RET) as i64;
    io.bytes = u64_at(b, off::BYTES);
    io.inode = u64_at(b, off::INODE);
    io.file_offset = match b[off::HAS_FILE_OFFSET] {
        0 => None,
        1 => Some(u64_at(b, off::FILE_OFFSET)),
        _ => return Err(RqWireError::Range("has_file_offset")),
    };
    io.cgroup_id = u64_at(b, off::CGROUP_ID);
    io.pid = u32_at(b, off::PID);
    io.tid = u32_at(b, off::TID);
    io.requests_unlisted = u32_at(b, off::REFS_DROPPED);
    set_cstr(&mut io.comm, &b[off::COMM..off::COMM + off::COMM_LEN]);
    let mut names = &b[fixed + 8..];
    io.requests.truncate(n);
    for i in 0..n {
        let (&len, rest) = names.split_first().ok_or(RqWireError::IoLength(b.len()))?;
        let len = usize::from(len);
        if len > MAX_DISK {
            return Err(RqWireError::Range("disk name"));
        }
        let (name, rest) = rest
            .split_at_checked(len)
            .ok_or(RqWireError::IoLength(b.len()))?;
        names = rest;
        let r = HEAD_LEN + i * REF_LEN;
        let sector = u64_at(b, r + off::REF_SECTOR);
        let bytes = u32_at(b, r + off::REF_BYTES);
        if i == io.requests.len() {
            io.requests.push(RqRef {
                disk: Name::default(),
                sector,
                bytes,
            });
        }
        let q = &mut io.requests[i];
        if q.disk.as_bytes() != name {
            q.disk = Name::new(std::str::from_utf8(name).map_err(|_| RqWireError::Utf8)?);
        }
        q.sector = sector;
        q.bytes = bytes;
    }
    if !names.is_empty() {
        return Err(RqWireError::IoLength(b.len()));
    }
    io.off_cpu = None;
    io.cause = None;
    Ok(())
}

/// The BPF record a guest's ring buffer would hold for `io` (tests and
/// benches), and its references' disk names. Its fields laid out as the BPF
/// side lays them out (a syscall name that is neither in the table above
/// nor `syscall_N` comes back as `read`).
#[cfg(any(test, feature = "testing"))]
pub fn bpf_of(io: &GuestIo) -> (Vec<u8>, Vec<String>) {
    let mut b = vec![0u8; RECORD_LEN];
    let mut put = |o: usize, v: &[u8]| b[o..o + v.len()].copy_from_slice(v);
    let nr = io
        .syscall
        .strip_prefix("syscall_")
        .and_then(|n| n.parse().ok())
        .or_else(|| (0..512).find(|&n| syscall_name(n) == io.syscall))
        .unwrap_or(0);
    put(off::KIND, &KIND_IO.to_le_bytes());
    put(off::NR, &nr.to_le_bytes());
    put(
        off::ENTER_TS,
        &io.ts.get(Point::SyscallEnter).unwrap_or(0).to_le_bytes(),
    );
    put(
        off::EXIT_TS,
        &io.ts.get(Point::SyscallExit).unwrap_or(0).to_le_bytes(),
    );
    put(off::RET, &io.ret.to_le_bytes());
    put(off::BYTES, &io.bytes.to_le_bytes());
    put(off::INODE, &io.inode.to_le_bytes());
    put(off::FILE_OFFSET, &io.file_offset.unwrap_or(0).to_le_bytes());
    put(off::CGROUP_ID, &io.cgroup_id.to_le_bytes());
    put(off::PID, &io.pid.to_le_bytes());
    put(off::TID, &io.tid.to_le_bytes());
    let n = io.requests.len().min(MAX_REFS);
    put(off::NREFS, &(n as u32).to_le_bytes());
    let unlisted = io
        .requests_unlisted
        .saturating_add(u32::try_from(io.requests.len() - n).unwrap_or(u32::MAX));
    put(off::REFS_DROPPED, &unlisted.to_le_bytes());
    put(off::HAS_FILE_OFFSET, &[u8::from(io.file_offset.is_some())]);
    let comm = io.comm.as_bytes();
    put(off::COMM, &comm[..comm.len().min(off::COMM_LEN - 1)]);
    for (i, r) in io.requests.iter().take(n).enumerate() {
        let at = HEAD_LEN + i * REF_LEN;
        put(at + off::REF_SECTOR, &r.sector.to_le_bytes());
        put(at + off::REF_BYTES, &r.bytes.to_le_bytes());
    }
    let disks = io.requests.iter().take(n).map(|r| r.disk.to_string());
    (b, disks.collect())
}

#[cfg(test)]
#[path = "io_bpf_tests.rs"]
mod tests;
