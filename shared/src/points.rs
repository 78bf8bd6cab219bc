//! Named points on an I/O's path and a record's set of them.
//!
//! Timestamps are kept per named *point*. In JSON (human-readable formats) a
//! [`Points`] set is an object `{"g.rq_issue": 123, ...}` holding only the points
//! that were seen; in binary formats (postcard, the wire protocol) it is a byte
//! string: the present point ids' mask, then each value's difference to the
//! previous one (LEB128). A point that was not seen is absent, never 0.

use std::fmt;

use serde::de::{self, MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::varint;

macro_rules! points {
    ($($var:ident = $id:literal => $name:literal : $doc:literal,)*) => {
        /// A named point on the I/O path. Names are stable (they are the JSON keys).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        #[repr(u8)]
        pub enum Point { $( #[doc = $doc] $var = $id, )* }

        impl Point {
            /// All points, in path order.
            pub const ALL: &'static [Point] = &[$(Point::$var,)*];

            /// The stable name of this point (`g.*` guest, `h.*` host).
            pub const fn name(self) -> &'static str {
                match self { $(Point::$var => $name,)* }
            }

            /// Looks a point up by its stable name.
            pub fn from_name(name: &str) -> Option<Point> {
                match name { $($name => Some(Point::$var),)* _ => None }
            }

            /// Looks a point up by its numeric wire id.
            pub fn from_id(id: u8) -> Option<Point> {
                match id { $($id => Some(Point::$var),)* _ => None }
            }
        }
    };
}

points! {
    SyscallEnter = 0 => "g.syscall_enter": "Guest: the syscall (read/write/fsync/io_submit/io_uring_enter…) was entered.",
    BioQueue = 1 => "g.bio_queue": "Guest: the first bio of the request entered the block layer (block_bio_queue).",
    RqInsert = 2 => "g.rq_insert": "Guest: the request was inserted into the I/O scheduler / dispatch list.",
    QueueRq = 3 => "g.queue_rq": "Guest: virtio-blk's queue_rq / queue_rqs took the request (it then starts it: g.rq_issue).",
    RqIssue = 4 => "g.rq_issue": "Guest: the request was started and handed to the driver (block_rq_issue, from inside queue_rq).",
    VqAdd = 5 => "g.vq_add": "Guest: the descriptor chain was added to the virtqueue (virtqueue_add_sgs).",
    Kick = 6 => "g.kick": "Guest: the driver kicked the device (virtqueue_notify) after adding the request.",
    Irq = 7 => "g.irq": "Guest: the virtqueue interrupt that completed the request (vring_interrupt).",
    DriverComplete = 8 => "g.driver_complete": "Guest: virtio-blk completed the request (virtblk_done / blk_mq_complete_request).",
    RqComplete = 9 => "g.rq_complete": "Guest: the block layer completed the request (block_rq_complete).",
    BioComplete = 10 => "g.bio_complete": "Guest: the last bio of the request completed (bio_endio).",
    SyscallExit = 11 => "g.syscall_exit": "Guest: the syscall returned.",
    HostNotify = 32 => "h.notify": "Host: QEMU started handling the guest's kick for the queue (virtio_blk_handle_vq).",
    HostPop = 33 => "h.pop": "Host: QEMU popped the element from the virtqueue (virtqueue_pop returned).",
    HostSubmit = 34 => "h.submit": "Host: QEMU submitted the (possibly merged) request to its block backend.",
    HostIoIssue = 35 => "h.io_issue": "Host: the host kernel I/O started (pread/pwrite, io_submit, io_uring submit).",
    HostDiskIssue = 36 => "h.disk_issue": "Host: the host block layer issued the I/O to a host disk (block_rq_issue).",
    HostDiskComplete = 37 => "h.disk_complete": "Host: the host disk completed the I/O (block_rq_complete).",
    HostIoComplete = 38 => "h.io_complete": "Host: the host kernel I/O finished (syscall return, io_getevents, io_uring CQE).",
    HostCompleteCb = 39 => "h.complete_cb": "Host: QEMU's completion callback for the element ran.",
    HostPush = 40 => "h.push": "Host: QEMU pushed the element to the used ring (virtqueue_push / virtqueue_fill).",
    HostIrq = 41 => "h.irq": "Host: QEMU notified the guest (irqfd / MSI-X write) for the used element.",
}

impl fmt::Display for Point {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Number of points: the size of a [`Points`] set.
const SLOTS: usize = Point::ALL.len();

/// Each point id's slot in a [`Points`] set (`u8::MAX`: no such point).
/// Slots follow the ids, so iterating the slots in order is path order.
const SLOT_OF_ID: [u8; 64] = {
    let mut t = [u8::MAX; 64];
    let mut i = 0;
    while i < SLOTS {
        let id = Point::ALL[i] as usize;
        assert!(id < 64, "point ids must fit a u64 mask");
        assert!(
            i == 0 || (Point::ALL[i - 1] as usize) < id,
            "ALL must be in id order"
        );
        t[id] = i as u8;
        i += 1;
    }
    t
};

/// Runs of consecutive slots whose ids are consecutive too: (first slot,
/// first id, length), and how many there are. A slot mask's ids are then a
/// shift per run.
const ID_RUNS: ([(u32, u32, u32); SLOTS], usize) = {
    let mut runs = [(0u32, 0u32, 0u32); SLOTS];
    let mut n = 0;
    let mut i = 0;
    while i < SLOTS {
        let id = Point::ALL[i] as u32;
        let (s0, id0, len) = if n > 0 { runs[n - 1] } else { (0, 0, 0) };
        if n > 0 && s0 + len == i as u32 && id0 + len == id {
            runs[n - 1].2 += 1;
        } else {
            runs[n] = (i as u32, id, 1);
            n += 1;
        }
        i += 1;
    }
    (runs, n)
};

/// The id mask of the points whose slots are set in `mask`: a shift per run
/// of [`ID_RUNS`] (two today) instead of a step per point, which counts
/// under emulation (the guest encodes a mask per record it streams or
/// captures).
#[inline]
fn ids_of_slots(mask: u32) -> u64 {
    let (runs, n) = &ID_RUNS;
    runs[..*n].iter().fold(0u64, |ids, &(slot, id, len)| {
        ids | ((u64::from(mask) >> slot) & ((1u64 << len) - 1)) << id
    })
}

/// The mask of every point id.
const KNOWN_IDS: u64 = {
    let mut m = 0u64;
    let mut i = 0;
    while i < SLOTS {
        m |= 1 << (Point::ALL[i] as u64);
        i += 1;
    }
    m
};

/// A set of timestamps (ns) keyed by [`Point`]. Unset points are absent.
///
/// Inline (a presence mask and one slot per point): setting, reading and
/// copying a set never allocates.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Points {
    /// Bit `slot` set: the point is present. An absent point's slot is 0.
    mask: u32,
    vals: [u64; SLOTS],
}

const _: () = assert!(SLOTS <= 32, "Points::mask has 32 bits");

#[inline]
const fn slot(p: Point) -> usize {
    SLOT_OF_ID[p as usize & 63] as usize
}

/// Where each entry of a foreign array of timestamps goes in a [`Points`]
/// set (the guest BPF side's `ts[]`), resolved once: filling a set from
/// such an array is then a store per present entry
/// ([`Points::set_nonzero_from`]).
#[derive(Clone, Debug, Default)]
pub struct SlotMap {
    /// The set's slot of each entry, `u8::MAX` for one that is no point.
    slots: Vec<u8>,
    /// Entry `i` is slot `i` for every entry (the guest BPF side's `ts[]`,
    /// whose entries follow the guest points' ids): a set is filled by a
    /// copy and a mask, without a step per entry.
    prefix: bool,
}

impl SlotMap {
    /// `points[i]`: the point of entry `i`, if any.
    pub fn new(points: &[Option<Point>]) -> Self {
        let slots: Vec<u8> = points
            .iter()
            .map(|p| p.map_or(u8::MAX, |p| slot(p) as u8))
            .collect();
        let prefix =
            slots.len() <= SLOTS && slots.iter().enumerate().all(|(i, &s)| usize::from(s) == i);
        SlotMap { slots, prefix }
    }
}

impl Points {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets (or replaces) a point.
    #[inline]
    pub fn set(&mut self, p: Point, ns: u64) {
        self.set_slot(slot(p), ns);
    }

    /// Sets the point of slot `i` (< [`SLOTS`]).
    #[inline]
    fn set_slot(&mut self, i: usize, ns: u64) {
        self.mask |= 1 << i;
        self.vals[i] = ns;
    }

    /// Sets a point when `ns` is non-zero (BPF uses 0 for "not seen").
    #[inline]
    pub fn set_nonzero(&mut self, p: Point, ns: u64) {
        if ns != 0 {
            self.set(p, ns);
        }
    }

    /// Sets entry `i` of `ts` as `map`'s point `i`, for every non-zero
    /// entry with a point (BPF uses 0 for "not seen").
    #[inline]
    pub fn set_nonzero_from(&mut self, map: &SlotMap, ts: &[u64]) {
        for (&s, &t) in map.slots.iter().zip(ts) {
            if t != 0 && usize::from(s) < SLOTS {
                self.set_slot(usize::from(s), t);
            }
        }
    }

    /// Makes this the set of `ts`'s non-zero entries with a point (as
    /// [`Points::new`] then [`Points::set_nonzero_from`]). With a prefix
    /// map (entry `i` is slot `i`, as the guest's request records are)
    /// it is a copy and a mask, branch-free: always-on decodes one such
    /// set per request.
    #[inline]
    pub fn reset_nonzero_from<const N: usize>(&mut self, map: &SlotMap, ts: &[u64; N]) {
        if !(map.prefix && map.slots.len() == N && N <= SLOTS) {
            *self = Points::new();
            self.set_nonzero_from(map, ts);
            return;
        }
        let (head, tail) = self.vals.split_at_mut(N);
        head.copy_from_slice(ts);
        tail.fill(0);
        let mut mask = 0u32;
        for (i, &t) in ts.iter().enumerate() {
            mask |= u32::from(t != 0) << i;
        }
        self.mask = mask;
    }

    #[inline]
    pub fn get(&self, p: Point) -> Option<u64> {
        let i = slot(p);
        (self.mask & (1 << i) != 0).then(|| self.vals[i])
    }

    pub fn remove(&mut self, p: Point) -> Option<u64> {
        let i = slot(p);
        let v = self.get(p)?;
        self.mask &= !(1 << i);
        self.vals[i] = 0;
        Some(v)
    }

    pub fn is_empty(&self) -> bool {
        self.mask == 0
    }

    /// Which slots are present (bit [`Points::slot`]): sets with the same
    /// mask have the same points.
    #[inline]
    pub(crate) fn mask(&self) -> u32 {
        self.mask
    }

    /// The slot of a point in every set.
    #[inline]
    pub(crate) const fn slot(p: Point) -> usize {
        slot(p)
    }

    /// The value in `slot` (0 when absent).
    #[inline]
    pub(crate) fn at_slot(&self, slot: usize) -> u64 {
        self.vals[slot]
    }

    pub fn len(&self) -> usize {
        self.mask.count_ones() as usize
    }

    /// The values of the `N` slots from `first` as offsets from `base` (0
    /// for an absent point; a present one must lie in `base..=base +
    /// u32::MAX`), and their presence bits.
    #[inline]
    pub(crate) fn offsets<const N: usize>(&self, first: usize, base: u64) -> (u32, [u32; N]) {
        let mut offs = [0u32; N];
        let mask = (self.mask >> first) & ((1 << N) - 1);
        for (i, o) in offs.iter_mut().enumerate() {
            let v = self.vals[first + i].wrapping_sub(base) as u32;
            *o = if mask & (1 << i) != 0 { v } else { 0 };
        }
        (mask, offs)
    }

    /// Sets the slots from `first` whose bit is set in `mask` to `base +
    /// offs[i]` ([`Self::offsets`] the other way round).
    #[inline]
    pub(crate) fn set_offsets<const N: usize>(
        &mut self,
        first: usize,
        mask: u32,
        base: u64,
        offs: &[u32; N],
    ) {
        for (i, &o) in offs.iter().enumerate() {
            let v = &mut self.vals[first + i];
            *v = if mask & (1 << i) != 0 {
                base + o as u64
            } else {
                *v
            };
        }
        self.mask |= mask << first;
    }

    /// Iterates over the present points in path order.
    pub fn iter(&self) -> impl Iterator<Item = (Point, u64)> + '_ {
        present(self.mask).map(|i| (Point::ALL[i], self.vals[i]))
    }

    /// The value of the present point latest in path order (None for an
    /// empty set): one read, where any of a record's times will do.
    pub fn last_in_path(&self) -> Option<u64> {
        (self.mask != 0).then(|| self.vals[31 - self.mask.leading_zeros() as usize])
    }

    /// The earliest and the latest value (None for an empty set).
    pub fn min_max(&self) -> Option<(u64, u64)> {
        present(self.mask).map(|i| self.vals[i]).fold(None, |r, v| {
            Some(r.map_or((v, v), |(lo, hi): (u64, u64)| (lo.min(v), hi.max(v))))
        })
    }

    /// Sets every point of `other` here (replacing a point present in both).
    pub fn overlay(&mut self, other: &Points) {
        for i in present(other.mask) {
            self.vals[i] = other.vals[i];
        }
        self.mask |= other.mask;
    }

    /// Adds `delta` ns (possibly negative) to every point, saturating at 0.
    pub fn shift(&mut self, delta: i64) {
        for i in present(self.mask) {
            self.vals[i] = self.vals[i].saturating_add_signed(delta);
        }
    }
}

/// The slots whose bit is set in a presence mask, lowest first.
#[inline]
fn present(mut mask: u32) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        let i = (mask != 0).then(|| mask.trailing_zeros() as usize)?;
        mask &= mask - 1;
        Some(i)
    })
}

impl fmt::Debug for Points {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.iter().map(|(p, t)| (p.name(), t)))
            .finish()
    }
}

impl FromIterator<(Point, u64)> for Points {
    fn from_iter<I: IntoIterator<Item = (Point, u64)>>(iter: I) -> Self {
        let mut p = Points::new();
        for (k, v) in iter {
            p.set(k, v);
        }
        p
    }
}

impl Serialize for Points {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            let mut m = s.serialize_map(Some(self.len()))?;
            for (p, t) in self.iter() {
                m.serialize_entry(p.name(), &t)?;
            }
            m.end()
        } else {
            let mut buf = [0u8; WIRE_MAX];
            let n = self.encode_wire(&mut buf);
            s.serialize_bytes(&buf[..n])
        }
    }
}

/// The longest binary encoding of a set: its id mask and one difference per
/// point.
const WIRE_MAX: usize = varint::MAX_LEN * (1 + SLOTS);

impl Points {
    /// The binary form (the wire protocol's): a LEB128 mask of the present
    /// point ids, then each point's difference to the previous one's value
    /// (wrapping, zigzag LEB128) in id order. A request's points lie
    /// microseconds apart: 2–3 bytes each. Returns the length written.
    fn encode_wire(&self, buf: &mut [u8; WIRE_MAX]) -> usize {
        let mut n = varint::put(buf, 0, ids_of_slots(self.mask));
        let mut prev = 0u64;
        for i in present(self.mask) {
            let t = self.vals[i];
            let d = t.wrapping_sub(prev) as i64;
            n = varint::put(buf, n, varint::zigzag(d));
            prev = t;
        }
        n
    }

    /// Appends [`Self::encode_wire`]'s form to `out`.
    pub(crate) fn encode_wire_into(&self, out: &mut Vec<u8>) {
        let mut buf = [0u8; WIRE_MAX];
        let n = self.encode_wire(&mut buf);
        out.extend_from_slice(&buf[..n]);
    }

    /// Appends the form as a byte string (its length first): what serde's
    /// binary serialization of a set writes.
    pub(crate) fn encode_wire_bytes_into(&self, out: &mut Vec<u8>) {
        let mut buf = [0u8; WIRE_MAX];
        let n = self.encode_wire(&mut buf);
        varint::push(out, n as u64);
        out.extend_from_slice(&buf[..n]);
    }

    /// Reads [`Self::encode_wire`]'s form; None when malformed (an unknown
    /// point id, a truncated or overlong number, trailing bytes).
    pub(crate) fn decode_wire(b: &[u8]) -> Option<Points> {
        let mut p = Points::new();
        p.decode_wire_into(b).then_some(p)
    }

    /// [`Self::decode_wire`] into this set, which it replaces (no new set is
    /// built and copied); false when malformed, and then the set holds part
    /// of the new points.
    pub(crate) fn decode_wire_into(&mut self, mut b: &[u8]) -> bool {
        // An absent point's slot is 0: clear the old ones.
        let mut old = self.mask;
        while old != 0 {
            self.vals[old.trailing_zeros() as usize] = 0;
            old &= old - 1;
        }
        self.mask = 0;
        let Some(ids) = varint::take(&mut b) else {
            return false;
        };
        if ids & !KNOWN_IDS != 0 {
            return false;
        }
        let (mut m, mut prev) = (ids, 0u64);
        while m != 0 {
            let i = usize::from(SLOT_OF_ID[m.trailing_zeros() as usize]);
            m &= m - 1;
            let Some(d) = varint::take(&mut b) else {
                return false;
            };
            prev = prev.wrapping_add(varint::unzigzag(d) as u64);
            self.set_slot(i, prev);
        }
        b.is_empty()
    }
}

impl<'de> Deserialize<'de> for Points {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Points;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of point name to ns, or the binary form")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Points, A::Error> {
                let mut p = Points::new();
                while let Some((k, v)) = a.next_entry::<String, u64>()? {
                    let pt = Point::from_name(&k)
                        .ok_or_else(|| de::Error::custom(format!("unknown point {k:?}")))?;
                    p.set(pt, v);
                }
                Ok(p)
            }
            fn visit_bytes<E: de::Error>(self, b: &[u8]) -> Result<Points, E> {
                Points::decode_wire(b).ok_or_else(|| E::custom("malformed points"))
            }
        }
        if d.is_human_readable() {
            d.deserialize_map(V)
        } else {
            d.deserialize_bytes(V)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A set of the points whose bit is set in `bits`, values from `seed`.
    fn set_of(bits: u32, seed: u64) -> Points {
        (Point::ALL.iter().enumerate())
            .filter(|(k, _)| bits & (1 << k) != 0)
            .map(|(k, p)| (*p, seed.wrapping_mul(k as u64 + 7) % 1_000_003))
            .collect()
    }

    /// The guest's points in id order, as the BPF record's `ts[]` holds them.
    fn guest_points() -> Vec<Option<Point>> {
        Point::ALL[..12].iter().copied().map(Some).collect()
    }

    proptest::proptest! {
        /// A set reset from an array is the array's non-zero entries, as a
        /// new set filled entry by entry, whatever the set held before, for
        /// the guest's prefix map and for maps that are not one.
        #[test]
        fn a_reset_set_holds_the_arrays_nonzero_entries(
            ts in proptest::array::uniform12(
                proptest::prop_oneof![proptest::strategy::Just(0u64), 1u64..u64::MAX]),
            before in 0u32..(1 << SLOTS),
            shuffle in 0usize..5,
        ) {
            let guest = guest_points();
            let map = match shuffle {
                0 => guest,
                1 => guest.into_iter().rev().collect(),
                2 => guest.into_iter().chain([None]).collect(),
                3 => guest[..11].to_vec(),
                _ => Point::ALL.iter().rev().copied().map(Some).collect(),
            };
            let map = SlotMap::new(&map);
            let mut want = Points::new();
            want.set_nonzero_from(&map, &ts);
            let mut got = set_of(before, 11);
            got.reset_nonzero_from(&map, &ts);
            proptest::prop_assert_eq!(got, want);
        }
    }

    /// The last point in path order is the one `iter` gives last, for every
    /// set of points.
    #[test]
    fn the_last_in_path_is_the_last_iterated() {
        for bits in (0..1u32 << SLOTS.min(16)).chain([(1u32 << SLOTS) - 1, 1 << (SLOTS - 1)]) {
            let p = set_of(bits, 5 + u64::from(bits));
            assert_eq!(
                p.last_in_path(),
                p.iter().last().map(|(_, t)| t),
                "{bits:#x}"
            );
        }
    }

    #[test]
    fn the_guest_points_map_as_a_prefix() {
        let guest = guest_points();
        assert!(SlotMap::new(&guest).prefix);
        assert!(!SlotMap::new(&guest[1..]).prefix);
    }

    #[test]
    fn the_ids_of_a_slot_mask_are_those_of_its_points() {
        let fold = |m: u32| {
            (0..SLOTS)
                .filter(|i| m & (1 << i) != 0)
                .fold(0u64, |ids, i| ids | 1 << (Point::ALL[i] as u8))
        };
        let mut masks: Vec<u32> = (0..SLOTS).map(|i| 1 << i).collect();
        masks.extend([0, (1 << SLOTS) - 1]);
        let mut x = 0x9e37_79b9_u32;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            masks.push(x & ((1 << SLOTS) - 1));
        }
        for m in masks {
            assert_eq!(ids_of_slots(m), fold(m), "slot mask {m:#x}");
        }
    }

    #[test]
    fn a_slot_map_fills_what_set_nonzero_would() {
        let map = [
            Some(Point::Kick),
            None,
            Some(Point::BioQueue),
            Some(Point::Irq),
        ];
        let ts = [30u64, 99, 0, 70, 55];
        let mut got = Points::new();
        got.set_nonzero_from(&SlotMap::new(&map), &ts);
        let mut want = Points::new();
        for (p, &t) in map.iter().zip(&ts) {
            if let Some(p) = p {
                want.set_nonzero(*p, t);
            }
        }
        assert_eq!(got, want);
        assert_eq!(got.len(), 2);
        assert_eq!(
            (got.get(Point::Kick), got.get(Point::Irq)),
            (Some(30), Some(70))
        );
    }

    #[test]
    fn min_max_and_overlay_agree_with_the_point_by_point_forms() {
        for (a, b) in [
            (0, 0),
            (0b1011, 0),
            (0, 0b110),
            (0x5a5a5, 0x3c3c3),
            (!0, 0x101),
        ] {
            let (x, y) = (set_of(a, 11), set_of(b, 29));
            let lo = x.iter().map(|e| e.1).min();
            let hi = x.iter().map(|e| e.1).max();
            assert_eq!(x.min_max(), lo.zip(hi));
            let mut want = x.clone();
            for (p, t) in y.iter() {
                want.set(p, t);
            }
            let mut got = x.clone();
            got.overlay(&y);
            assert_eq!(got, want);
        }
    }
}
