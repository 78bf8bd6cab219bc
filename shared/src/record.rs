//! Record types produced by the agents and by the join. Their timestamps are
//! [`Points`] (see [`crate::points`]).

use std::fmt;

use serde::{Deserialize, Serialize};

pub use crate::points::{Point, Points};

/// Block operation of a request (virtio-blk request type / Linux REQ_OP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    Read,
    Write,
    Flush,
    Discard,
    WriteZeroes,
    SecureErase,
    GetId,
    Other,
}

impl Op {
    /// Every op, in declaration order: `Op::ALL[op as usize] == op` (postcard's
    /// variant index, and the request record's wire byte).
    pub const ALL: [Op; 8] = [
        Op::Read,
        Op::Write,
        Op::Flush,
        Op::Discard,
        Op::WriteZeroes,
        Op::SecureErase,
        Op::GetId,
        Op::Other,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Discard => "discard",
            Op::WriteZeroes => "write_zeroes",
            Op::SecureErase => "secure_erase",
            Op::GetId => "get_id",
            Op::Other => "other",
        }
    }

    /// From a virtio-blk request header type (`VIRTIO_BLK_T_*`).
    pub const fn from_virtio_type(t: u32) -> Op {
        match t & !0x8000_0000 {
            // bit 31 was VIRTIO_BLK_T_BARRIER on legacy devices
            0 => Op::Read,
            1 => Op::Write,
            4 => Op::Flush,
            8 => Op::GetId,
            11 => Op::Discard,
            13 => Op::WriteZeroes,
            14 => Op::SecureErase,
            _ => Op::Other,
        }
    }

    /// From Linux's `REQ_OP_*` (the low 8 bits of `cmd_flags`).
    pub const fn from_linux_req_op(op: u32) -> Op {
        match op & 0xff {
            0 => Op::Read,
            1 => Op::Write,
            2 => Op::Flush,
            3 => Op::Discard,
            5 => Op::SecureErase,
            9 => Op::WriteZeroes,
            _ => Op::Other,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

use smallvec::SmallVec;

/// A short label: VM, disk, device or task name. Inline up to 24 bytes, so a
/// record's labels cost no allocation on the per-I/O path.
pub type Name = compact_str::CompactString;

/// One finished block request in the guest (`"kind":"guest_rq"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GuestRq {
    /// Disk name, e.g. `vdb`.
    pub disk: Name,
    /// Wall-clock time (RFC 3339 UTC) of the record's first point: the host's
    /// `CLOCK_REALTIME` for host and joined records, the guest's for guest records
    /// (see `walltime`). Absent when no point could be mapped.
    #[serde(default)]
    pub time: Option<crate::walltime::WallTime>,
    pub op: Op,
    /// Start sector (512-byte units).
    pub sector: u64,
    pub bytes: u32,
    /// virtqueue index (hardware queue), if seen.
    pub queue: Option<u16>,
    /// Descriptor head id (split ring) or buffer id (packed ring), if seen.
    pub head: Option<u16>,
    /// Task that caused the I/O (the submitter; for write-back, the dirtier when known).
    pub pid: u32,
    pub tid: u32,
    pub comm: Name,
    pub cgroup_id: u64,
    /// Inode of the file the I/O belongs to (0 when unknown, e.g. metadata).
    pub inode: u64,
    /// Byte offset within that file, when known.
    pub file_offset: Option<u64>,
    /// Whether the kick after this request really notified the device (false: suppressed).
    pub kicked: Option<bool>,
    /// Number of bios merged into this request.
    pub bios: u32,
    /// Block layer status (0 = OK, else negative errno).
    pub error: i32,
    pub ts: Points,
}

/// One finished syscall-level I/O in the guest (`"kind":"guest_io"`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GuestIo {
    /// Syscall name (`read`, `pwrite64`, `fsync`, `io_submit`, `io_uring_enter`, …).
    pub syscall: Name,
    /// Wall-clock time (RFC 3339 UTC) of the record's first point: the host's
    /// `CLOCK_REALTIME` for host and joined records, the guest's for guest records
    /// (see `walltime`). Absent when no point could be mapped.
    #[serde(default)]
    pub time: Option<crate::walltime::WallTime>,
    pub pid: u32,
    pub tid: u32,
    pub comm: Name,
    pub cgroup_id: u64,
    pub inode: u64,
    pub file_offset: Option<u64>,
    /// Bytes requested.
    pub bytes: u64,
    /// Return value of the syscall.
    pub ret: i64,
    /// Block requests this syscall caused, as `(disk, sector)` pairs matching `guest_rq` records.
    pub requests: SmallVec<[RqRef; 1]>,
    /// Requests it caused beyond those listed (the guest's BPF side lists 16;
    /// also counted in `io_refs_truncated`). 0 in records of older agents.
    #[serde(default)]
    pub requests_unlisted: u32,
    pub ts: Points,
    /// Where its time off the CPU went (guest agent with `-t`; absent otherwise).
    #[serde(default)]
    pub off_cpu: Option<OffCpu>,
    /// Why it was slow (guest agent with `-t`: syscalls above the threshold and
    /// 3× their class's baseline; see `cause::syscall`).
    #[serde(default)]
    pub cause: Option<Box<crate::cause::Cause>>,
}

/// A syscall's time off the CPU: runnable (preempted or woken, waiting for a CPU)
/// and blocked (sleeping: its I/O, a lock), and the task that kept it off the CPU
/// longest in one wait (`pid 77 stress`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffCpu {
    pub runnable_ns: u64,
    pub blocked_ns: u64,
    pub holder: Option<String>,
}

/// A reference from a syscall-level record to a block request it caused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RqRef {
    pub disk: Name,
    pub sector: u64,
    pub bytes: u32,
}

/// QEMU block backend mode for a drive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    Threads,
    Native,
    IoUring,
    Unknown,
}

/// One virtqueue element handled by the hypervisor (`"kind":"host_elem"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostElem {
    /// VM label (QEMU `-name`, else `qemu-<pid>`).
    pub vm: Name,
    /// Wall-clock time (RFC 3339 UTC) of the record's first point: the host's
    /// `CLOCK_REALTIME` for host and joined records, the guest's for guest records
    /// (see `walltime`). Absent when no point could be mapped.
    #[serde(default)]
    pub time: Option<crate::walltime::WallTime>,
    pub qemu_pid: u32,
    /// virtio-blk device label (QEMU drive/device id when known).
    pub device: Name,
    pub queue: u16,
    pub head: u16,
    pub op: Op,
    pub sector: u64,
    pub bytes: u32,
    pub backend: Backend,
    /// Identifies the backend I/O; elements merged into one backend request share it.
    pub merge_id: u64,
    /// virtio-blk status byte written back to the guest (0 = OK).
    pub status: Option<u8>,
    pub ts: Points,
    /// What else used the request's host device meanwhile (see `interference`;
    /// the joined record's `interference` starts from it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interference: Option<crate::interference::DeviceLoad>,
}

/// Why a record could not be joined with the other side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnmatchedReason {
    /// No host element matched this guest request within the timeout.
    NoHostRecord,
    /// No guest request matched this host element within the timeout.
    NoGuestRecord,
    /// A record with the same queue/head overlapped in time, but op, sector or length differed.
    MismatchOpSectorLen,
    /// Dropped from the join's pending set because it hit its hard memory cap.
    Evicted,
}

impl UnmatchedReason {
    pub const fn name(self) -> &'static str {
        match self {
            UnmatchedReason::NoHostRecord => "no_host_record",
            UnmatchedReason::NoGuestRecord => "no_guest_record",
            UnmatchedReason::MismatchOpSectorLen => "mismatch_op_sector_len",
            UnmatchedReason::Evicted => "evicted",
        }
    }
}

/// Clock domain of a record's timestamps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClockDomain {
    Host,
    Guest,
}

/// One request as seen end to end (`"kind":"io"`): a guest request joined with
/// its host element, or an unmatched one of either side (`joined: false`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JoinedIo {
    pub vm: Name,
    /// Wall-clock time (RFC 3339 UTC) of the record's first point: the host's
    /// `CLOCK_REALTIME` for host and joined records, the guest's for guest records
    /// (see `walltime`). Absent when no point could be mapped.
    #[serde(default)]
    pub time: Option<crate::walltime::WallTime>,
    /// Guest disk name (`vda`), when the guest side is present.
    pub disk: Option<Name>,
    /// Host virtio-blk device label, when the host side is present.
    pub device: Option<Name>,
    pub queue: Option<u16>,
    pub head: Option<u16>,
    pub op: Op,
    pub sector: u64,
    pub bytes: u32,
    // Guest attribution (absent for host-only records).
    pub pid: Option<u32>,
    pub tid: Option<u32>,
    pub comm: Option<Name>,
    pub cgroup_id: Option<u64>,
    pub inode: Option<u64>,
    pub file_offset: Option<u64>,
    pub kicked: Option<bool>,
    pub error: Option<i32>,
    // Host side.
    pub qemu_pid: Option<u32>,
    pub backend: Option<Backend>,
    pub merge_id: Option<u64>,
    pub status: Option<u8>,
    /// Every guest and host point; guest points mapped onto the host clock
    /// unless `ts_domain` says `guest` (no clock estimate for that VM yet).
    pub ts: Points,
    pub ts_domain: ClockDomain,
    /// Derived durations (see `stages`): they add up to `total_ns`.
    pub stages: crate::stages::Stages,
    /// Finer informative durations (not part of the partition).
    pub substages: crate::stages::Stages,
    pub total_ns: Option<i64>,
    /// Uncertainty (±ns) of the guest→host mapping used for the guest points.
    pub clock_uncertainty_ns: Option<u64>,
    pub joined: bool,
    pub reason: Option<UnmatchedReason>,
    /// Why this request was slow (joined records the host agent judged slow:
    /// see `cause`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<Box<crate::cause::Cause>>,
    /// Interference measured while the request was in flight (host device
    /// load; for requests above the threshold also QEMU's and the vCPUs' waits
    /// for a CPU): the verdict's evidence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interference: Option<Box<crate::interference::Interference>>,
}

/// One stage's summary in a stats line (`label`: the disk or VM/device).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageSummary {
    pub label: String,
    pub stage: String,
    #[serde(flatten)]
    pub summary: crate::stats::Summary,
}

/// An agent's `"kind":"stats"` line (at exit). The guest agent's has `final`,
/// `mode`, its record counts, its BPF `counters` and what it could not see; the
/// host agent's has its counters at the top level (`values`) and, in joined
/// mode, one `transport` account per VM. Both have the per-stage summaries.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    #[serde(rename = "final", default, skip_serializing_if = "Option::is_none")]
    pub is_final: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elapsed_ns: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_rq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_io: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_errors: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<std::collections::BTreeMap<String, u64>>,
    /// What the run could not see, and why (guest agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blind: Option<Vec<String>>,
    /// Points no record of the run carries (guest agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blind_points: Option<Vec<String>>,
    #[serde(default)]
    pub stages: Vec<StageSummary>,
    /// Per-VM delivery accounts (host agent, joined mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<Vec<serde_json::Value>>,
    /// Counters at the top level of the line (host agent).
    #[serde(flatten)]
    pub values: std::collections::BTreeMap<String, u64>,
}

/// Any JSON-lines record, tagged with `"kind"` (written by [`crate::jsonl::JsonLines`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
// Records are inline (points and stages too): one is read or written at a
// time, and boxing the large variants would add an allocation per record.
#[allow(clippy::large_enum_variant)]
pub enum Record {
    GuestRq(GuestRq),
    GuestIo(GuestIo),
    HostElem(HostElem),
    Io(JoinedIo),
    Stats(Stats),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn point_names_and_ids_are_unique_and_roundtrip() {
        let mut names = std::collections::HashSet::new();
        let mut ids = std::collections::HashSet::new();
        for &p in Point::ALL {
            assert!(names.insert(p.name()));
            assert!(ids.insert(p as u8));
            assert_eq!(Point::from_name(p.name()), Some(p));
            assert_eq!(Point::from_id(p as u8), Some(p));
        }
        assert_eq!(Point::from_name("g.nope"), None);
    }

    #[test]
    fn points_json_holds_only_present_points() {
        let mut p = Points::new();
        p.set(Point::RqIssue, 20);
        p.set(Point::BioQueue, 10);
        let j = serde_json::to_string(&p).unwrap();
        assert_eq!(j, r#"{"g.bio_queue":10,"g.rq_issue":20}"#);
        let back: Points = serde_json::from_str(&j).unwrap();
        assert_eq!(back, p);
        assert!(serde_json::from_str::<Points>(r#"{"g.bogus":1}"#).is_err());
    }

    #[test]
    fn points_postcard_roundtrip_and_rejects_unknown_ids() {
        let p: Points = [(Point::HostPop, 5), (Point::Kick, 3)]
            .into_iter()
            .collect();
        let bytes = postcard::to_stdvec(&p).unwrap();
        assert_eq!(postcard::from_bytes::<Points>(&bytes).unwrap(), p);
        // Malformed: an unknown point id (20) in the mask, a difference
        // missing, one too many, a number longer than 64 bits.
        for bad in [
            &[4, 0x80, 0x80, 0x40, 0][..],
            &[1, 1][..],
            &[3, 1, 2, 2][..],
            &[
                11, 1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,
            ][..],
        ] {
            assert!(postcard::from_bytes::<Points>(bad).is_err(), "{bad:?}");
        }
        // Differences: any values, in any order, come back.
        let odd: Points = [
            (Point::SyscallEnter, u64::MAX),
            (Point::BioQueue, 0),
            (Point::RqInsert, 1 << 63),
            (Point::Irq, 7),
        ]
        .into_iter()
        .collect();
        let bytes = postcard::to_stdvec(&odd).unwrap();
        assert_eq!(postcard::from_bytes::<Points>(&bytes).unwrap(), odd);
    }

    #[test]
    fn a_requests_points_take_a_few_bytes_each_on_the_wire() {
        // A guest request of the lab (times since boot, µs apart).
        let base = 56_288_575_084_331u64;
        let p: Points = [
            (Point::SyscallEnter, 0),
            (Point::BioQueue, 54_756),
            (Point::RqInsert, 67_852),
            (Point::QueueRq, 74_618),
            (Point::RqIssue, 76_625),
            (Point::VqAdd, 79_366),
            (Point::Kick, 83_534),
            (Point::Irq, 184_525),
            (Point::DriverComplete, 186_564),
            (Point::RqComplete, 188_847),
            (Point::BioComplete, 194_786),
        ]
        .into_iter()
        .map(|(pt, d)| (pt, base + d))
        .collect();
        let bytes = postcard::to_stdvec(&p).unwrap();
        // 1 (length) + 2 (id mask) + the first time (7 bytes) + 10 differences of ≤ 3.
        assert!(bytes.len() <= 1 + 2 + 7 + 30, "{} bytes", bytes.len());
        assert_eq!(postcard::from_bytes::<Points>(&bytes).unwrap(), p);
    }

    #[test]
    fn set_nonzero_skips_unseen() {
        let mut p = Points::new();
        p.set_nonzero(Point::Irq, 0);
        assert!(p.is_empty());
        p.set_nonzero(Point::Irq, 7);
        assert_eq!(p.get(Point::Irq), Some(7));
    }

    #[test]
    fn ops_decode() {
        assert_eq!(Op::from_virtio_type(1), Op::Write);
        assert_eq!(Op::from_virtio_type(0x8000_0000), Op::Read);
        assert_eq!(Op::from_linux_req_op(0x801), Op::Write);
        assert_eq!(Op::from_linux_req_op(2), Op::Flush);
    }
}
