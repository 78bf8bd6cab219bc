//! Derived per-request durations ("stages") with stable names.
//!
//! The main path of a request is cut at a fixed list of *anchor* points; the
//! stages are the gaps between consecutive anchors, so they always add up to
//! `total_ns` (last anchor − first anchor). Stage names:
//!
//! | stage            | from              | to                |
//! |------------------|-------------------|-------------------|
//! | `guest_fs`       | `g.syscall_enter` | `g.bio_queue`     |
//! | `guest_queue`    | `g.bio_queue`     | `g.rq_issue` (¹)  |
//! | `guest_driver`   | `g.rq_issue`      | `g.kick`          |
//! | `kick_to_pop`    | `g.kick`          | `h.pop`           |
//! | `qemu_submit`    | `h.pop`           | `h.submit`        |
//! | `host_io`        | `h.submit`        | `h.complete_cb`   |
//! | `qemu_complete`  | `h.complete_cb`   | `h.push`          |
//! | `push_to_irq`    | `h.push`          | `g.irq`           |
//! | `guest_complete` | `g.irq`           | `g.rq_complete`   |
//! | `guest_return`   | `g.rq_complete`   | `g.syscall_exit`  |
//!
//! When an anchor is missing, a neighbouring point may stand in for it (first
//! present wins): `g.bio_queue` ← `g.rq_insert`; `g.kick` ← `g.vq_add`;
//! `h.pop` ← `h.notify`; `h.submit` ← `h.io_issue`;
//! `h.complete_cb` ← `h.io_complete`; `h.push` ← `h.irq`; `g.irq` ←
//! `g.driver_complete`; `g.rq_complete` ← `g.driver_complete`, `g.bio_complete`.
//! (¹) `g.rq_issue` fires inside the driver's `queue_rq` (which starts the
//! request), so `g.queue_rq` falls inside `guest_queue`.
//!
//! When an anchor has no stand-in, the two stages around it merge into one named
//! `a+b` (e.g. `guest_queue+guest_driver`); the merge of everything between
//! `g.kick` and `g.irq` (a guest-only record) is named `device`, so guest-only
//! and host-only records use the same names as joined ones.
//!
//! Sub-stages split some stages further; they are informative and are not part
//! of the partition: `kick_to_pop.exit` (`g.kick`→`h.notify`),
//! `kick_to_pop.notify` (`h.notify`→`h.pop`), `host_io.queue`
//! (`h.submit`→`h.io_issue`), `host_io.kernel` (`h.io_issue`→`h.io_complete`),
//! `host_io.disk` (`h.disk_issue`→`h.disk_complete`), `host_io.reap`
//! (`h.io_complete`→`h.complete_cb`), `push_to_irq.notify` (`h.push`→`h.irq`),
//! `push_to_irq.delivery` (`h.irq`→`g.irq`), `guest_queue.insert`
//! (`g.rq_insert`→`g.rq_issue`), `guest_driver.add` (`g.rq_issue`→`g.vq_add`).
//!
//! Values are signed: with clock uncertainty (or a device polling the ring
//! before the guest's kick) a cross-domain stage can be slightly negative.

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;
use std::sync::OnceLock;

use rustc_hash::FxHashMap;
use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use smallvec::SmallVec;

use crate::record::{Point, Points};

/// Anchor points of the partition with their stand-ins, in path order.
const ANCHORS: &[(Point, &[Point])] = &[
    (Point::SyscallEnter, &[]),
    (Point::BioQueue, &[Point::RqInsert]),
    (Point::RqIssue, &[]),
    (Point::Kick, &[Point::VqAdd]),
    (Point::HostPop, &[Point::HostNotify]),
    (Point::HostSubmit, &[Point::HostIoIssue]),
    (Point::HostCompleteCb, &[Point::HostIoComplete]),
    (Point::HostPush, &[Point::HostIrq]),
    (Point::Irq, &[Point::DriverComplete]),
    (
        Point::RqComplete,
        &[Point::DriverComplete, Point::BioComplete],
    ),
    (Point::SyscallExit, &[]),
];

/// Name of the stage from anchor `i` to anchor `i + 1`.
pub const STAGE_NAMES: &[&str] = &[
    "guest_fs",
    "guest_queue",
    "guest_driver",
    "kick_to_pop",
    "qemu_submit",
    "host_io",
    "qemu_complete",
    "push_to_irq",
    "guest_complete",
    "guest_return",
];

/// Name of the merged stage for the guest's view of the device.
pub const DEVICE_STAGE: &str = "device";

const _: () = assert!(STAGE_NAMES.len() <= INLINE_STAGES && SUBSTAGES.len() <= INLINE_STAGES);

const KICK: usize = 3;
const IRQ: usize = 8;

/// Informative sub-stages (not part of the partition).
pub const SUBSTAGES: &[(&str, Point, Point)] = &[
    ("guest_queue.insert", Point::RqInsert, Point::RqIssue),
    ("guest_driver.add", Point::RqIssue, Point::VqAdd),
    ("kick_to_pop.exit", Point::Kick, Point::HostNotify),
    ("kick_to_pop.notify", Point::HostNotify, Point::HostPop),
    ("host_io.queue", Point::HostSubmit, Point::HostIoIssue),
    ("host_io.kernel", Point::HostIoIssue, Point::HostIoComplete),
    (
        "host_io.disk",
        Point::HostDiskIssue,
        Point::HostDiskComplete,
    ),
    ("host_io.reap", Point::HostIoComplete, Point::HostCompleteCb),
    ("push_to_irq.notify", Point::HostPush, Point::HostIrq),
    ("push_to_irq.delivery", Point::HostIrq, Point::Irq),
];

/// Name of the whole request's duration (first to last anchor).
pub const TOTAL_STAGE: &str = "total";

/// Spans `i..j` (`i < j`) of the anchors: every stage or merge of stages.
const SPANS: usize = ANCHORS.len() * (ANCHORS.len() - 1) / 2;

/// Number of stage ids: every span of the anchors, the sub-stages, the total.
pub const STAGE_IDS: usize = SPANS + SUBSTAGES.len() + 1;

const _: () = assert!(STAGE_IDS <= u8::MAX as usize);

/// The id of the span `i..j`, by row: `SPAN_ID[i][j]` (`i < j`).
const SPAN_ID: [[u8; ANCHORS.len()]; ANCHORS.len()] = {
    let mut t = [[0u8; ANCHORS.len()]; ANCHORS.len()];
    let mut k = 0;
    let mut i = 0;
    while i < ANCHORS.len() {
        let mut j = i + 1;
        while j < ANCHORS.len() {
            t[i][j] = k;
            k += 1;
            j += 1;
        }
        i += 1;
    }
    t
};

/// A stage of the closed set this module derives (a stage, a merge of
/// stages, a sub-stage or the total), as a small number: the statistics'
/// per-record path carries ids, a name is looked up only to be shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StageId(u8);

impl StageId {
    pub const TOTAL: StageId = StageId((STAGE_IDS - 1) as u8);

    /// The stage spanning anchors `i..j` (`i < j`).
    fn span(i: usize, j: usize) -> StageId {
        StageId(SPAN_ID[i][j])
    }

    /// Sub-stage `k` of [`SUBSTAGES`].
    fn substage(k: usize) -> StageId {
        StageId((SPANS + k) as u8)
    }

    /// Its position in `0..STAGE_IDS`.
    pub fn index(self) -> usize {
        self.0 as usize
    }

    pub fn name(self) -> &'static str {
        id_names()[self.index()]
    }

    /// The id of a stage name (None: not a name of this module).
    pub fn of_name(name: &str) -> Option<StageId> {
        static IDS: OnceLock<FxHashMap<&'static str, StageId>> = OnceLock::new();
        IDS.get_or_init(|| {
            (0..STAGE_IDS as u8)
                .map(|k| (StageId(k).name(), StageId(k)))
                .collect()
        })
        .get(name)
        .copied()
    }
}

/// Every stage id's name, by id.
fn id_names() -> &'static [&'static str] {
    static NAMES: OnceLock<Vec<&'static str>> = OnceLock::new();
    NAMES.get_or_init(|| {
        let n = ANCHORS.len();
        let mut v = vec![""; STAGE_IDS];
        for (i, j) in (0..n).flat_map(|i| (i + 1..n).map(move |j| (i, j))) {
            v[StageId::span(i, j).index()] = if j == i + 1 {
                STAGE_NAMES[i]
            } else if i == KICK && j == IRQ {
                DEVICE_STAGE
            } else {
                // Made once, for the program's life.
                STAGE_NAMES[i..j].join("+").leak()
            };
        }
        for (k, (name, _, _)) in SUBSTAGES.iter().enumerate() {
            v[StageId::substage(k).index()] = name;
        }
        v[StageId::TOTAL.index()] = TOTAL_STAGE;
        v
    })
}

/// Room for every stage (or sub-stage) of one request without allocating.
const INLINE_STAGES: usize = 10;

/// An ordered list of named durations (ns). JSON: an object in path order.
/// Inline: deriving a request's stages does not allocate.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Stages(pub SmallVec<[(Cow<'static, str>, i64); INLINE_STAGES]>);

impl Stages {
    pub fn get(&self, name: &str) -> Option<i64> {
        self.0.iter().find(|(n, _)| n == name).map(|e| e.1)
    }
    pub fn iter(&self) -> impl Iterator<Item = (&str, i64)> {
        self.0.iter().map(|(n, v)| (n.as_ref(), *v))
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn sum(&self) -> i64 {
        self.0.iter().map(|e| e.1).sum()
    }
}

impl fmt::Debug for Stages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Serialize for Stages {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (n, v) in &self.0 {
            m.serialize_entry(n.as_ref(), v)?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for Stages {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Stages;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of stage name to ns")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Stages, A::Error> {
                let mut v = SmallVec::new();
                while let Some((k, n)) = a.next_entry::<String, i64>()? {
                    v.push((Cow::Owned(k), n));
                }
                Ok(Stages(v))
            }
        }
        d.deserialize_map(V)
    }
}

/// Stages, sub-stages and total of one request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Breakdown {
    pub stages: Stages,
    pub substages: Stages,
    /// Last anchor − first anchor; `None` with fewer than two anchors.
    pub total_ns: Option<i64>,
    /// Time of the first anchor (where the first stage starts).
    pub start_ns: Option<u64>,
}

pub(crate) fn diff(a: u64, b: u64) -> i64 {
    (b as i128 - a as i128).clamp(i64::MIN as i128, i64::MAX as i128) as i64
}

/// Derives the breakdown from a point set (joined, guest-only or host-only;
/// all points must be in one clock domain).
pub fn derive(ts: &Points) -> Breakdown {
    let mut b = Breakdown::default();
    (b.total_ns, b.start_ns) = derive_into(ts, &mut b.stages, &mut b.substages);
    b
}

/// [`derive`] into a record's own (empty) `stages` and `substages`, where
/// they stay (an output record is built in place); returns the total and the
/// time of the first anchor.
pub fn derive_into(
    ts: &Points,
    stages: &mut Stages,
    substages: &mut Stages,
) -> (Option<i64>, Option<u64>) {
    // Gathered first, then added at once (one capacity check per list).
    let mut found: [(StageId, i64); INLINE_STAGES] = [(StageId::TOTAL, 0); INLINE_STAGES];
    let mut n = 0;
    let total = visit_stages(ts, |id, ns| {
        found[n] = (id, ns);
        n += 1;
    });
    let named = |&(id, ns): &(StageId, i64)| (Cow::Borrowed(id.name()), ns);
    stages.0.extend(found[..n].iter().map(named));
    n = 0;
    for (k, (_, a, b)) in SUBSTAGES.iter().enumerate() {
        if let (Some(x), Some(y)) = (ts.get(*a), ts.get(*b)) {
            found[n] = (StageId::substage(k), diff(x, y));
            n += 1;
        }
    }
    substages.0.extend(found[..n].iter().map(named));
    total
}

/// The stages of [`derive`], handed to `stage` by id in path order as they
/// are found (nothing is built). Returns the total and the time of the
/// first anchor.
pub fn visit_stages(
    ts: &Points,
    mut stage: impl FnMut(StageId, i64),
) -> (Option<i64>, Option<u64>) {
    let at = |slot: u8| ts.at_slot(slot as usize);
    let Some(ends) = stage_slots(ts.mask(), |id, a, b| stage(id, diff(at(a), at(b)))) else {
        return (None, None);
    };
    let total_ns = ends.total.map(|(a, b)| diff(at(a), at(b)));
    (total_ns, Some(at(ends.first)))
}

/// At most this many stages in one set of points (one per pair of
/// consecutive anchors).
pub(crate) const MAX_SPANS: usize = ANCHORS.len() - 1;

/// Where a set of points starts, and what its total spans, as slots.
pub(crate) struct Ends {
    /// The first anchor's slot.
    pub first: u8,
    /// The first and the last anchor's slots (`None` with one anchor).
    pub total: Option<(u8, u8)>,
}

/// The stages of every point set whose presence mask is `mask` (see
/// [`crate::points::Points::mask`]): each stage's id and the slots of its
/// start and end point, handed to `stage` in path order; `None` without an
/// anchor. [`visit_stages`] subtracts as it goes; the statistics keep the
/// slots per mask and then only subtract.
pub(crate) fn stage_slots(mask: u32, mut stage: impl FnMut(StageId, u8, u8)) -> Option<Ends> {
    let plan = Plan::of(mask);
    let anchors = &plan.anchors[..plan.n as usize];
    for w in anchors.windows(2) {
        stage(
            StageId::span(w[0].0 as usize, w[1].0 as usize),
            w[0].1,
            w[1].1,
        );
    }
    match anchors {
        [] => None,
        [only] => Some(Ends {
            first: only.1,
            total: None,
        }),
        [first, .., last] => Some(Ends {
            first: first.1,
            total: Some((first.1, last.1)),
        }),
    }
}

/// The anchors present in a set of points, in path order, as
/// `(anchor, slot of the point standing for it)`: the same for every set
/// with the same presence mask, so it is resolved once per mask.
#[derive(Clone, Copy, Debug)]
struct Plan {
    mask: u32,
    n: u8,
    anchors: [(u8, u8); ANCHORS.len()],
}

/// Plans cached per thread (direct-mapped by mask): a stream's records
/// have a few masks (joined, host-only, guest-only).
const PLAN_CACHE: usize = 8;

thread_local! {
    static PLANS: [Cell<Option<Plan>>; PLAN_CACHE] = const { [const { Cell::new(None) }; PLAN_CACHE] };
}

impl Plan {
    fn of(mask: u32) -> Plan {
        let k = (mask.wrapping_mul(0x9E37_79B9) >> 29) as usize % PLAN_CACHE;
        PLANS.with(|c| match c[k].get() {
            Some(p) if p.mask == mask => p,
            _ => {
                let p = Plan::resolve(mask);
                c[k].set(Some(p));
                p
            }
        })
    }

    /// Resolves the anchors (with stand-ins, each point used at most once).
    fn resolve(mask: u32) -> Plan {
        let mut plan = Plan {
            mask,
            n: 0,
            anchors: [(0, 0); ANCHORS.len()],
        };
        let present = |p: Point| mask & (1 << Points::slot(p)) != 0;
        // Points already used as an anchor, by id (ids are < 64).
        let mut used = 0u64;
        for (i, (p, alts)) in ANCHORS.iter().enumerate() {
            // A point stands in at most once (g.driver_complete serves two anchors).
            let found = std::iter::once(p)
                .chain(alts.iter().filter(|a| used & (1 << (**a as u8)) == 0))
                .find(|p| present(**p));
            if let Some(p) = found {
                used |= 1 << (*p as u8);
                plan.anchors[plan.n as usize] = (i as u8, Points::slot(*p) as u8);
                plan.n += 1;
            }
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pts(v: &[(Point, u64)]) -> Points {
        v.iter().copied().collect()
    }

    #[test]
    fn full_path_partitions_total() {
        let ts = pts(&[
            (Point::SyscallEnter, 100),
            (Point::BioQueue, 110),
            (Point::RqInsert, 115),
            (Point::QueueRq, 118),
            (Point::RqIssue, 120),
            (Point::VqAdd, 125),
            (Point::Kick, 130),
            (Point::HostNotify, 140),
            (Point::HostPop, 150),
            (Point::HostSubmit, 160),
            (Point::HostIoIssue, 170),
            (Point::HostIoComplete, 270),
            (Point::HostCompleteCb, 280),
            (Point::HostPush, 290),
            (Point::HostIrq, 295),
            (Point::Irq, 310),
            (Point::DriverComplete, 315),
            (Point::RqComplete, 320),
            (Point::BioComplete, 322),
            (Point::SyscallExit, 330),
        ]);
        let b = derive(&ts);
        let names: Vec<&str> = b.stages.iter().map(|e| e.0).collect();
        assert_eq!(names, STAGE_NAMES);
        assert_eq!(b.total_ns, Some(230));
        assert_eq!(b.stages.sum(), 230);
        assert_eq!(b.stages.get("host_io"), Some(120));
        assert_eq!(b.stages.get("kick_to_pop"), Some(20));
        assert_eq!(b.substages.get("host_io.kernel"), Some(100));
        assert_eq!(b.substages.get("push_to_irq.delivery"), Some(15));
        let j = serde_json::to_string(&b.stages).unwrap();
        assert!(j.starts_with(r#"{"guest_fs":10,"guest_queue":10,"#), "{j}");
        let back: Stages = serde_json::from_str(&j).unwrap();
        assert_eq!(back, b.stages);
    }

    #[test]
    fn guest_only_has_device_stage() {
        let ts = pts(&[
            (Point::BioQueue, 10),
            (Point::RqIssue, 20),
            (Point::Kick, 25),
            (Point::Irq, 125),
            (Point::RqComplete, 130),
        ]);
        let b = derive(&ts);
        let names: Vec<&str> = b.stages.iter().map(|e| e.0).collect();
        assert_eq!(
            names,
            ["guest_queue", "guest_driver", "device", "guest_complete"]
        );
        assert_eq!(b.stages.sum(), b.total_ns.unwrap());
        assert_eq!(b.total_ns, Some(120));
    }

    #[test]
    fn host_only_and_standins_and_merges() {
        let ts = pts(&[
            (Point::HostPop, 1000),
            (Point::HostSubmit, 1010),
            (Point::HostIoIssue, 1020),
            (Point::HostIoComplete, 1500),
            (Point::HostPush, 1530),
        ]);
        let b = derive(&ts);
        let names: Vec<&str> = b.stages.iter().map(|e| e.0).collect();
        // complete_cb absent: io_complete stands in.
        assert_eq!(names, ["qemu_submit", "host_io", "qemu_complete"]);
        assert_eq!(b.stages.get("host_io"), Some(490));
        assert_eq!(b.total_ns, Some(530));
        // No rq_issue and no stand-in: merged name.
        let ts = pts(&[
            (Point::BioQueue, 0),
            (Point::Kick, 30),
            (Point::HostPop, 40),
        ]);
        let b = derive(&ts);
        assert_eq!(b.stages.get("guest_queue+guest_driver"), Some(30));
        assert_eq!(b.stages.get("kick_to_pop"), Some(10));
        // Single point: nothing.
        let b = derive(&pts(&[(Point::Irq, 5)]));
        assert!(b.stages.is_empty());
        assert_eq!(b.total_ns, None);
    }

    /// The ids map one to one onto the names of `stage_name(i, j)` over the
    /// anchors (the partition's names joined by `+`, `device` for
    /// `g.kick`→`g.irq`), the sub-stages and the total.
    #[test]
    fn stage_ids_map_exactly_onto_the_names() {
        let n = ANCHORS.len();
        let mut want: Vec<String> = Vec::new();
        for i in 0..n {
            for j in i + 1..n {
                want.push(if (i, j) == (KICK, IRQ) {
                    DEVICE_STAGE.to_string()
                } else {
                    STAGE_NAMES[i..j].join("+")
                });
                assert_eq!(StageId::span(i, j).index(), want.len() - 1);
            }
        }
        want.extend(SUBSTAGES.iter().map(|s| s.0.to_string()));
        want.push(TOTAL_STAGE.to_string());
        assert_eq!(want.len(), STAGE_IDS);
        let mut seen = std::collections::HashSet::new();
        for (k, w) in want.iter().enumerate() {
            let id = StageId(k as u8);
            assert_eq!(id.name(), w);
            assert_eq!(StageId::of_name(w), Some(id));
            assert!(seen.insert(w.clone()), "{w} twice");
        }
        for (k, s) in SUBSTAGES.iter().enumerate() {
            assert_eq!(StageId::substage(k).name(), s.0);
        }
        assert_eq!(StageId::of_name("guest_fs+nope"), None);
        assert_eq!(StageId::of_name(""), None);
    }

    /// The resolution of the anchors point by point, as it was before
    /// plans (the reference for [`Plan`]).
    fn reference(ts: &Points) -> (Vec<(&'static str, i64)>, Option<i64>, Option<u64>) {
        let mut present: [Option<u64>; 11] = [None; 11];
        let mut used = 0u64;
        for (i, (p, alts)) in ANCHORS.iter().enumerate() {
            if let Some(t) = ts.get(*p) {
                present[i] = Some(t);
                used |= 1 << (*p as u8);
                continue;
            }
            for a in alts.iter() {
                if used & (1 << (*a as u8)) != 0 {
                    continue;
                }
                if let Some(t) = ts.get(*a) {
                    present[i] = Some(t);
                    used |= 1 << (*a as u8);
                    break;
                }
            }
        }
        let found: Vec<(usize, u64)> = (present.iter().enumerate())
            .filter_map(|(i, t)| t.map(|t| (i, t)))
            .collect();
        let stages = (found.windows(2))
            .map(|w| (StageId::span(w[0].0, w[1].0).name(), diff(w[0].1, w[1].1)))
            .collect();
        let total = match (found.first(), found.last()) {
            (Some(a), Some(b)) if b.0 > a.0 => Some(diff(a.1, b.1)),
            _ => None,
        };
        (stages, total, found.first().map(|f| f.1))
    }

    /// The stages visited (by id) and derived (by name) are those of the
    /// point-by-point resolution, for subsets of every point that matters,
    /// each seen twice (the second time from the cached plan).
    #[test]
    fn visited_and_derived_stages_follow_the_reference() {
        let all = [
            Point::SyscallEnter,
            Point::BioQueue,
            Point::RqInsert,
            Point::QueueRq,
            Point::RqIssue,
            Point::VqAdd,
            Point::Kick,
            Point::HostNotify,
            Point::HostPop,
            Point::HostSubmit,
            Point::HostIoIssue,
            Point::HostIoComplete,
            Point::HostCompleteCb,
            Point::HostPush,
            Point::HostIrq,
            Point::Irq,
            Point::DriverComplete,
            Point::RqComplete,
            Point::BioComplete,
            Point::SyscallExit,
        ];
        for mask in (0u32..1 << all.len())
            .step_by(89)
            .chain([(1 << all.len()) - 1])
        {
            for round in 0..2u64 {
                let ts: Points = (all.iter().enumerate())
                    .filter(|(k, _)| mask & (1 << k) != 0)
                    .map(|(k, p)| (*p, 1000 + 37 * k as u64 + (mask as u64 + round) % 50))
                    .collect();
                let (want, total, start) = reference(&ts);
                let mut ids = Vec::new();
                let got = visit_stages(&ts, |id, ns| ids.push((id.name(), ns)));
                assert_eq!((&ids, got), (&want, (total, start)), "{mask:b}");
                let b = derive(&ts);
                assert_eq!(b.stages.iter().collect::<Vec<_>>(), want);
                assert_eq!((b.total_ns, b.start_ns), (total, start));
            }
        }
    }

    #[test]
    fn negative_stage_keeps_the_sum() {
        let ts = pts(&[
            (Point::Kick, 100),
            (Point::HostPop, 90),
            (Point::HostPush, 300),
        ]);
        let b = derive(&ts);
        assert_eq!(b.stages.get("kick_to_pop"), Some(-10));
        assert_eq!(b.stages.sum(), b.total_ns.unwrap());
    }
}
