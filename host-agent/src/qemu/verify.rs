//! The runtime check of a layout on a VM's first requests. Until it passes, a
//! VM's records are held back; a failure names the field that is wrong, and the
//! VM is not traced further (the other VMs are not affected).

use std::time::{Duration, Instant};

/// Records checked before a VM's layout is trusted.
pub const PROBATION_RECORDS: usize = 16;
/// A VM with fewer requests is trusted this long after its first one passed.
pub const PROBATION_MAX_WAIT: Duration = Duration::from_secs(1);
/// blk_aio_* requests whose queue did not belong to their device, with none
/// that did, before the request offsets are refused.
pub const VDEV_MISMATCH_LIMIT: u32 = 64;
/// Pushes without one virtio-blk element before the push-only mode warns.
pub const PUSH_MISMATCH_WARN: u32 = 256;
/// The largest plausible data size of one virtio-blk element.
const MAX_ELEM_BYTES: u32 = 64 << 20;
/// Sectors of the largest plausible disk (1 PiB).
const MAX_SECTOR: u64 = 1 << 41;

/// A failed check: the field (C name) and what was seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub field: &'static str,
    pub why: String,
}

fn fail(field: &'static str, why: String) -> Result<(), Failure> {
    Err(Failure { field, why })
}

/// What one record must satisfy, from the VM's command line.
#[derive(Clone, Debug)]
pub struct Bounds {
    /// Queues per device (None: not known from the command line; 1024 applies).
    pub max_queues: Option<u16>,
    pub max_queue_size: u16,
}

/// The fields of a host record the check looks at (from `host_rec`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Seen {
    pub vq: u64,
    pub dev: u64,
    pub queue: u16,
    pub head: u16,
    pub vtype: u32,
    pub sector: u64,
    pub bytes: Option<u32>,
    pub in_len: u32,
    pub status: Option<u8>,
    pub header_fault: bool,
    pub pushed: bool,
}

/// virtio-blk request types (VIRTIO_BLK_T_*).
fn known_type(t: u32) -> bool {
    matches!(
        t,
        0 | 1 | 4 | 8 | 10 | 11 | 13 | 14 | 15 | 16 | 18 | 20 | 22 | 24 | 26
    )
}

/// The checks that need nothing but the record.
pub fn check_record(s: &Seen, b: &Bounds) -> Result<(), Failure> {
    if s.vq == 0 || s.dev == 0 {
        return fail(
            "VirtIOBlockReq.vq",
            format!("null queue {:#x} or device {:#x}", s.vq, s.dev),
        );
    }
    let max_q = b.max_queues.unwrap_or(1024);
    if s.queue >= max_q {
        return fail(
            "VirtQueue.queue_index",
            format!("queue index {} (the device has at most {max_q})", s.queue),
        );
    }
    if s.head >= b.max_queue_size {
        return fail(
            "VirtQueueElement.index",
            format!(
                "descriptor head {} (queue size {})",
                s.head, b.max_queue_size
            ),
        );
    }
    if s.header_fault {
        return fail(
            "VirtIOBlockReq.out",
            "the request header could not be read".into(),
        );
    }
    if !known_type(s.vtype) {
        return fail(
            "VirtIOBlockReq.out",
            format!("request type {:#x} is no virtio-blk type", s.vtype),
        );
    }
    let rw = s.vtype == 0 || s.vtype == 1;
    // 2^41 sectors = 1 PiB: beyond any virtio-blk disk; a pointer read as a
    // sector (0x55…, 0x7f…) is far above.
    if rw && s.sector >= MAX_SECTOR {
        return fail(
            "VirtIOBlockReq.out",
            format!("sector {:#x} is beyond any disk", s.sector),
        );
    }
    if let Some(st) = s.status {
        if st > 2 {
            return fail(
                "VirtIOBlockReq.in",
                format!("status byte {st} (not OK/IOERR/UNSUPP)"),
            );
        }
    }
    if let (true, Some(n)) = (rw, s.bytes) {
        if n == 0 || n % 512 != 0 || n > MAX_ELEM_BYTES {
            return fail(
                "VirtIOBlockReq.qiov.size",
                format!("{n} data bytes for a read/write"),
            );
        }
        // QEMU pushes a read with the bytes it wrote into the guest's buffers:
        // the data plus the status byte.
        if s.pushed && s.vtype == 0 && s.status == Some(0) && s.in_len != n + 1 {
            return fail(
                "VirtIOBlockReq.qiov.size",
                format!(
                    "{n} data bytes, but QEMU completed the read with {} bytes",
                    s.in_len
                ),
            );
        }
    }
    Ok(())
}

/// What the process's memory says about a record's queue and device: the fds
/// at the notifier offsets (None: unknown or not in use), the device pointer at
/// VirtQueue.vdev, and the drive name read through VirtIOBlock.blk.
#[derive(Clone, Debug, Default)]
pub struct ProcView {
    pub host_notifier_fd: Option<(i32, String)>,
    pub guest_notifier_fd: Option<(i32, String)>,
    pub vq_vdev: Option<u64>,
    pub drive_name: Option<String>,
}

/// The checks on the process's memory. `drives`: ids the command line defines
/// (empty: not checked).
pub fn check_view(s: &Seen, v: &ProcView, drives: &[String]) -> Result<(), Failure> {
    if let Some(d) = v.vq_vdev {
        if d != s.dev {
            return fail(
                "VirtQueue.vdev",
                format!("queue's device {d:#x}, request's {:#x}", s.dev),
            );
        }
    }
    for (field, fd) in [
        ("VirtQueue.host_notifier", &v.host_notifier_fd),
        ("VirtQueue.guest_notifier", &v.guest_notifier_fd),
    ] {
        if let Some((n, what)) = fd {
            if !what.contains("eventfd") {
                return fail(field, format!("fd {n} there is {what}, not an eventfd"));
            }
        }
    }
    if let Some(name) = &v.drive_name {
        if !drives.is_empty() && !drives.iter().any(|d| d == name) {
            return fail(
                "VirtIOBlock.blk",
                format!(
                    "the device's drive is {name:?}, the command line has {}",
                    drives.join(", ")
                ),
            );
        }
    }
    Ok(())
}

/// A VM's standing.
#[derive(Debug)]
pub enum Standing {
    Checking,
    Trusted,
    Refused,
}

/// Held records and the verdict of one VM.
#[derive(Debug)]
pub struct Probation<T> {
    pub standing: Standing,
    pub held: Vec<T>,
    pub passed: usize,
    first: Option<Instant>,
    pub dropped: u64,
}

impl<T> Default for Probation<T> {
    fn default() -> Self {
        Probation {
            standing: Standing::Checking,
            held: Vec::new(),
            passed: 0,
            first: None,
            dropped: 0,
        }
    }
}

impl<T> Probation<T> {
    /// A record that passed: held; returns the records to emit when the VM is
    /// now trusted.
    pub fn pass(&mut self, e: T, now: Instant) -> Vec<T> {
        self.passed += 1;
        self.first.get_or_insert(now);
        self.held.push(e);
        if self.passed >= PROBATION_RECORDS {
            self.standing = Standing::Trusted;
            return std::mem::take(&mut self.held);
        }
        Vec::new()
    }

    /// Releases a quiet VM's records once its first passed long enough ago.
    pub fn tick(&mut self, now: Instant) -> Vec<T> {
        match (&self.standing, self.first) {
            (Standing::Checking, Some(t)) if now.duration_since(t) >= PROBATION_MAX_WAIT => {
                self.standing = Standing::Trusted;
                std::mem::take(&mut self.held)
            }
            _ => Vec::new(),
        }
    }

    pub fn refuse(&mut self) {
        self.dropped += self.held.len() as u64;
        self.held.clear();
        self.standing = Standing::Refused;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> Seen {
        Seen {
            vq: 0x5000,
            dev: 0x4000,
            queue: 1,
            head: 17,
            vtype: 0,
            sector: 2048,
            bytes: Some(4096),
            in_len: 4097,
            status: Some(0),
            header_fault: false,
            pushed: true,
        }
    }

    fn b() -> Bounds {
        Bounds {
            max_queues: Some(2),
            max_queue_size: 256,
        }
    }

    fn field_of(s: Seen) -> &'static str {
        check_record(&s, &b()).unwrap_err().field
    }

    #[test]
    fn a_sane_request_passes() {
        assert_eq!(check_record(&good(), &b()), Ok(()));
        let w = Seen {
            vtype: 1,
            in_len: 1,
            ..good()
        };
        assert_eq!(check_record(&w, &b()), Ok(()));
        let f = Seen {
            vtype: 4,
            bytes: Some(0),
            ..good()
        };
        assert_eq!(check_record(&f, &b()), Ok(()));
    }

    #[test]
    fn each_wrong_field_is_named() {
        assert_eq!(
            field_of(Seen { queue: 2, ..good() }),
            "VirtQueue.queue_index"
        );
        assert_eq!(
            field_of(Seen {
                head: 300,
                ..good()
            }),
            "VirtQueueElement.index"
        );
        assert_eq!(
            field_of(Seen {
                vtype: 0x7fff_0000,
                ..good()
            }),
            "VirtIOBlockReq.out"
        );
        // A heap pointer read as the sector (the header read 8 bytes late).
        assert_eq!(
            field_of(Seen {
                sector: 0x5555_5678_9abc,
                ..good()
            }),
            "VirtIOBlockReq.out"
        );
        assert_eq!(
            field_of(Seen {
                status: Some(0x55),
                ..good()
            }),
            "VirtIOBlockReq.in"
        );
        assert_eq!(
            field_of(Seen {
                bytes: Some(4095),
                ..good()
            }),
            "VirtIOBlockReq.qiov.size"
        );
        assert_eq!(
            field_of(Seen {
                in_len: 8193,
                ..good()
            }),
            "VirtIOBlockReq.qiov.size"
        );
        assert_eq!(field_of(Seen { dev: 0, ..good() }), "VirtIOBlockReq.vq");
    }

    #[test]
    fn process_memory_checks() {
        let v = ProcView {
            host_notifier_fd: Some((12, "anon_inode:[eventfd]".into())),
            guest_notifier_fd: Some((13, "anon_inode:[eventfd]".into())),
            vq_vdev: Some(0x4000),
            drive_name: Some("data".into()),
        };
        let drives = vec!["data".to_string()];
        assert_eq!(check_view(&good(), &v, &drives), Ok(()));
        let bad = ProcView {
            host_notifier_fd: Some((3, "/dev/kvm".into())),
            ..v.clone()
        };
        assert_eq!(
            check_view(&good(), &bad, &drives).unwrap_err().field,
            "VirtQueue.host_notifier"
        );
        let bad = ProcView {
            vq_vdev: Some(0x1234),
            ..v.clone()
        };
        assert_eq!(
            check_view(&good(), &bad, &drives).unwrap_err().field,
            "VirtQueue.vdev"
        );
        let bad = ProcView {
            drive_name: Some("xyz".into()),
            ..v.clone()
        };
        assert_eq!(
            check_view(&good(), &bad, &drives).unwrap_err().field,
            "VirtIOBlock.blk"
        );
        // Unknown is not wrong.
        assert_eq!(check_view(&good(), &ProcView::default(), &drives), Ok(()));
    }

    fn elem() -> u32 {
        7
    }

    #[test]
    fn probation_holds_then_releases() {
        let t0 = Instant::now();
        let mut p: Probation<u32> = Probation::default();
        for _ in 0..PROBATION_RECORDS - 1 {
            assert!(p.pass(elem(), t0).is_empty());
        }
        assert_eq!(p.pass(elem(), t0).len(), PROBATION_RECORDS);
        assert!(matches!(p.standing, Standing::Trusted));
        // A quiet VM: released after the wait.
        let mut q: Probation<u32> = Probation::default();
        assert!(q.pass(elem(), t0).is_empty());
        assert!(q.tick(t0 + Duration::from_millis(10)).is_empty());
        assert_eq!(q.tick(t0 + PROBATION_MAX_WAIT).len(), 1);
        // Refused: held records are dropped and counted.
        let mut r: Probation<u32> = Probation::default();
        r.pass(elem(), t0);
        r.refuse();
        assert_eq!((r.held.len(), r.dropped), (0, 1));
        assert!(r.tick(t0 + PROBATION_MAX_WAIT).is_empty());
    }
}
