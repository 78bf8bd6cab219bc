//! A host element as it waits in the join for its guest record: only what
//! the join and its output read, in a compact form.
//!
//! A [`HostElem`] is 336 bytes, most of them its [`Points`] (a slot for every
//! guest and host point). A host element arrives about 100 ms before its
//! guest record, so what it leaves in the pending set is written once and read
//! once by then from memory: a [`HostEntry`] keeps its host points as offsets
//! from its first one and leaves out what no output reads (its VM name, which
//! is its VM's, and its wall-clock time, which the output derives from the
//! points). Elements with other points, or whose points lie more than 4 s
//! apart, keep a full copy of their points.

use crate::interference::DeviceLoad;
use crate::record::{Backend, HostElem, Name, Op, Point, Points};

/// The host points' slots in a [`Points`] set: `h.notify` … `h.irq`, in a row.
const HOST_SLOT: usize = Points::slot(Point::HostNotify);
const HOST_N: usize = Points::slot(Point::HostIrq) - HOST_SLOT + 1;
/// The presence mask of the host points' slots.
const HOST_MASK: u32 = ((1 << HOST_N) - 1) << HOST_SLOT;

const _: () = assert!(HOST_N <= 16, "the packed mask has 16 bits");
const _: () = assert!(
    HOST_N == Point::HostIrq as usize - Point::HostNotify as usize + 1,
    "the host points have consecutive slots"
);

/// A host element's points.
#[derive(Clone, Debug, PartialEq)]
enum HostPoints {
    /// Host points only, within 4 s of the first: bit `i` of `mask` set when
    /// host point `i` is present, at `base + offs[i]`.
    Packed {
        base: u64,
        mask: u16,
        offs: [u32; HOST_N],
    },
    /// Any other set, as it came.
    Full(Box<Points>),
}

impl HostPoints {
    /// `lo`, `hi`: the earliest and the latest point (0, 0 for none).
    fn of(ts: &Points, (lo, hi): (u64, u64)) -> Self {
        if ts.mask() & !HOST_MASK != 0 || hi - lo > u32::MAX as u64 {
            return HostPoints::Full(Box::new(ts.clone()));
        }
        let (mask, offs) = ts.offsets(HOST_SLOT, lo);
        HostPoints::Packed {
            base: lo,
            mask: mask as u16,
            offs,
        }
    }

    /// Sets every point here in `ts` (replacing a point present in both).
    fn overlay_onto(&self, ts: &mut Points) {
        match self {
            HostPoints::Packed { base, mask, offs } => {
                ts.set_offsets(HOST_SLOT, *mask as u32, *base, offs)
            }
            HostPoints::Full(p) => ts.overlay(p),
        }
    }

    fn to_points(&self) -> Points {
        match self {
            HostPoints::Packed { .. } => {
                let mut ts = Points::new();
                self.overlay_onto(&mut ts);
                ts
            }
            HostPoints::Full(p) => (**p).clone(),
        }
    }
}

/// A pending host element (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct HostEntry {
    // What a partner search reads of every candidate.
    pub sector: u64,
    pub bytes: u32,
    pub queue: u16,
    pub head: u16,
    pub op: Op,
    pub backend: Backend,
    pub status: Option<u8>,
    pub qemu_pid: u32,
    pub merge_id: u64,
    pub device: Name,
    pts: HostPoints,
    pub interference: Option<Box<DeviceLoad>>,
}

impl HostEntry {
    /// `lo`, `hi`: the element's earliest and latest point (0, 0 for none).
    pub fn of(el: &HostElem, (lo, hi): (u64, u64)) -> Self {
        HostEntry {
            sector: el.sector,
            bytes: el.bytes,
            queue: el.queue,
            head: el.head,
            op: el.op,
            backend: el.backend,
            status: el.status,
            qemu_pid: el.qemu_pid,
            merge_id: el.merge_id,
            device: el.device.clone(),
            pts: HostPoints::of(&el.ts, (lo, hi)),
            interference: el.interference.clone().map(Box::new),
        }
    }

    /// The element's points.
    pub fn points(&self) -> Points {
        self.pts.to_points()
    }

    /// Sets the element's points in `ts` (replacing a point present in both).
    pub fn overlay_points(&self, ts: &mut Points) {
        self.pts.overlay_onto(ts);
    }

    /// The element again, with its VM's name and its wall-clock time (which
    /// the entry does not keep).
    #[cfg(test)]
    pub fn to_elem(&self, vm: &str, time: Option<crate::walltime::WallTime>) -> HostElem {
        HostElem {
            vm: vm.into(),
            time,
            qemu_pid: self.qemu_pid,
            device: self.device.clone(),
            queue: self.queue,
            head: self.head,
            op: self.op,
            sector: self.sector,
            bytes: self.bytes,
            backend: self.backend,
            merge_id: self.merge_id,
            status: self.status,
            ts: self.points(),
            interference: self.interference.as_deref().cloned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn elem(ts: Points) -> HostElem {
        HostElem {
            vm: "vm7".into(),
            time: crate::walltime::of_points(&ts),
            qemu_pid: 4242,
            device: "a-rather-long-device-label-on-the-heap".into(),
            queue: 3,
            head: 127,
            op: Op::Discard,
            sector: u64::MAX - 5,
            bytes: u32::MAX,
            backend: Backend::IoUring,
            merge_id: 1 << 60,
            status: Some(2),
            ts,
            interference: Some(DeviceLoad {
                host_disk: Some("nvme0n1 (259:0)".into()),
                neighbour_inflight: Some(3),
                neighbour_issued: None,
                neighbour_bytes: Some(1 << 40),
            }),
        }
    }

    fn packed(e: &HostEntry) -> bool {
        matches!(e.pts, HostPoints::Packed { .. })
    }

    #[test]
    fn an_entry_gives_back_its_element() {
        let every: Points = Point::ALL[HOST_SLOT..HOST_SLOT + HOST_N]
            .iter()
            .enumerate()
            .map(|(i, &p)| (p, 1_000_000_007 + 1000 * (9 - i as u64)))
            .collect();
        let mut odd = every.clone();
        odd.remove(Point::HostPop);
        odd.set(Point::HostIrq, 1_000_000_007 + u32::MAX as u64);
        let at_zero: Points = [(Point::HostPush, 0), (Point::HostNotify, 0)]
            .into_iter()
            .collect();
        let cases = [
            (every, true),
            (odd.clone(), true),
            (at_zero, true),
            (Points::new(), true),
            // Further apart than an offset holds.
            (
                [(Point::HostPop, 1), (Point::HostPush, u64::MAX)]
                    .into_iter()
                    .collect(),
                false,
            ),
            // A guest point on a host element.
            (
                [(Point::Kick, 5), (Point::HostPush, 9)]
                    .into_iter()
                    .collect(),
                false,
            ),
        ];
        for (ts, compact) in cases {
            let mut el = elem(ts.clone());
            for minimal in [false, true] {
                if minimal {
                    (el.device, el.status, el.interference) = ("d".into(), None, None);
                }
                let e = HostEntry::of(&el, el.ts.min_max().unwrap_or((0, 0)));
                assert_eq!(packed(&e), compact, "{ts:?}");
                assert_eq!(e.to_elem(&el.vm, el.time), el);
                let mut base: Points = [(Point::RqIssue, 77), (Point::HostPop, 3)]
                    .into_iter()
                    .collect();
                let mut want = base.clone();
                want.overlay(&el.ts);
                e.overlay_points(&mut base);
                assert_eq!(base, want);
            }
        }
    }

    /// A host element that waited and left unmatched comes out as it came:
    /// every field the output has, its points, its VM and wall-clock time.
    #[test]
    fn an_unmatched_element_keeps_every_field() {
        use crate::join::{JoinConfig, JoinEngine};
        let mut odd = Points::new();
        odd.set(Point::HostPop, 10);
        odd.set(Point::HostIrq, 10 + u32::MAX as u64 + 1);
        let mut guestly = odd.clone();
        guestly.set(Point::Irq, 12);
        let base = 1_700_000_000_000_000_000;
        let usual: Points = [(Point::HostPop, base), (Point::HostPush, base + 999)]
            .into_iter()
            .collect();
        let mut e = JoinEngine::new(JoinConfig::offline());
        let mut els = Vec::new();
        for ts in [usual, odd, guestly, Points::new()] {
            let mut el = elem(ts);
            el.head = els.len() as u16;
            e.push_host_ref(&el, &mut Vec::new());
            els.push(el.clone());
            (el.status, el.interference, el.head) = (None, None, el.head + 100);
            e.push_host(el.clone(), &mut Vec::new());
            els.push(el);
        }
        let mut out = Vec::new();
        e.flush(&mut out);
        assert_eq!(out.len(), els.len());
        for el in &els {
            let io = out.iter().find(|io| io.head == Some(el.head)).unwrap();
            assert_eq!(io.vm, el.vm);
            // (Mapped from the monotonic clock when the record is built.)
            let want = crate::walltime::of_points(&el.ts).map(|t| t.unix_ns());
            let got = io.time.map(|t| t.unix_ns());
            assert!(got.zip(want).is_none_or(|(a, b)| a.abs_diff(b) < 1_000_000));
            assert_eq!(got.is_some(), want.is_some());
            assert_eq!(io.device.as_ref(), Some(&el.device));
            assert_eq!((io.queue, io.op), (Some(el.queue), el.op));
            assert_eq!((io.sector, io.bytes), (el.sector, el.bytes));
            assert_eq!(io.qemu_pid, Some(el.qemu_pid));
            assert_eq!(io.backend, Some(el.backend));
            assert_eq!(io.merge_id, Some(el.merge_id));
            assert_eq!(io.status, el.status);
            assert_eq!(io.ts, el.ts);
            let load = io.interference.as_ref().map(|i| &i.device);
            assert_eq!(load, el.interference.as_ref());
        }
    }

    /// A joined record has its host element's fields and points.
    #[test]
    fn a_joined_record_has_every_field_of_its_element() {
        use crate::join::synth::{generate, SynthConfig};
        use crate::join::{JoinConfig, JoinEngine};
        let s = generate(&SynthConfig {
            requests: 64,
            ..SynthConfig::default()
        });
        let mut e = JoinEngine::new(JoinConfig::offline());
        let mut out = Vec::new();
        let mut els = Vec::new();
        for (i, h) in s.host.iter().enumerate() {
            let mut el = h.clone();
            // (One device: the join learns the guest disk's.)
            el.device = "a-rather-long-device-label-on-the-heap".into();
            if i % 2 == 0 {
                let x = elem(Points::new());
                (el.status, el.interference) = (x.status, x.interference);
                (el.qemu_pid, el.merge_id, el.backend) = (x.qemu_pid, x.merge_id, x.backend);
            }
            if i % 3 == 0 {
                // Further apart than an offset holds: a full copy.
                let pop = el.ts.get(Point::HostPop).unwrap();
                el.ts.set(Point::HostDiskComplete, pop + (1 << 33));
            }
            e.push_host_ref(&el, &mut out);
            els.push(el);
        }
        for g in &s.guest {
            e.push_guest_ref("vm0", g, &mut out);
        }
        e.flush(&mut out);
        assert_eq!(out.len(), els.len());
        for io in &out {
            assert!(io.joined, "{io:?}");
            let el = &els[io.pid.unwrap() as usize];
            assert_eq!(io.vm, el.vm);
            assert_eq!(io.device.as_ref(), Some(&el.device));
            assert_eq!((io.queue, io.head), (Some(el.queue), Some(el.head)));
            assert_eq!(io.qemu_pid, Some(el.qemu_pid));
            assert_eq!(io.backend, Some(el.backend));
            assert_eq!(io.merge_id, Some(el.merge_id));
            assert_eq!(io.status, el.status);
            let load = io.interference.as_ref().map(|i| &i.device);
            assert_eq!(load, el.interference.as_ref());
            // (The join drops notifications that did not carry the request.)
            let kept = |p: &(Point, u64)| !matches!(p.0, Point::HostIrq | Point::HostNotify);
            for (p, t) in el.ts.iter().filter(kept) {
                assert_eq!(io.ts.get(p), Some(t), "{p}");
            }
        }
    }

    #[test]
    fn an_entry_is_smaller_than_its_element() {
        let size = std::mem::size_of::<HostEntry>();
        assert!(size <= 128, "{size} bytes");
        assert!(size < std::mem::size_of::<HostElem>() / 2);
    }
}
