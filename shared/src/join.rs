//! Guest↔host join engine.
//!
//! A guest [`GuestRq`] and a host [`HostElem`] describe the same request when
//! they share the VM, the virtqueue and the descriptor head, *overlap in time*
//! and agree on op, sector and length. Heads are reused all the time, so the
//! time check matters: with `θ = host − guest` (from the VM's
//! [`ClockEstimator`], as an interval `[lo, hi]`), a pair is possible only if
//! some `θ` in that interval (± `slack_ns`) also satisfies causality:
//! * the guest published the request before the host popped it:
//!   `θ ≤ h.pop − g.vq_add` (or the latest guest submission point present:
//!   `g.vq_add`, `g.rq_issue`, `g.queue_rq`, `g.rq_insert`, `g.bio_queue`;
//!   host start: `h.pop`, else `h.submit`, else `h.io_issue`);
//! * the host pushed it before the guest completed it:
//!   `θ ≥ h.push − g.rq_complete` (host end: `h.push`, `h.complete_cb`,
//!   `h.io_complete`; guest end: `g.rq_complete`, `g.bio_complete`,
//!   `g.driver_complete`).
//!
//! `g.kick` and `g.irq` are deliberately not used as causal bounds: a device
//! that polls the ring can pop an element before the guest's kick, and one
//! interrupt can complete elements pushed after it fired.
//!
//! Before a VM has any clock sample the interval is unbounded; the causal
//! checks alone still require the host's pop→push to fit inside the guest's
//! submit→complete, and among several candidates the oldest wins. Every joined
//! request with all four points that had a single candidate and agrees with
//! the current estimate is then fed back into the estimator as an NTP-like
//! sample ([`ClockEstimator::add_request`]), and its own causal bounds narrow
//! its own mapping ([`crate::clock::narrow`]).
//!
//! Guest requests without queue/head (tracepoint-only guests) are matched on
//! `(vm, sector)` plus op/length and time instead.
//!
//! QEMU multireq merges need no special handling: each merged element is still
//! one [`HostElem`] with its own head, sector and length; the elements share
//! `merge_id` and the backend timestamps, which the output keeps. Guest
//! batching (many adds, one kick) is handled because the causal bound uses
//! each request's own `g.vq_add`.
//!
//! Records may arrive in any order from both sides. A record that found no
//! partner is emitted with `joined: false` and a [`UnmatchedReason`] once it is
//! `timeout_ns` old on its own side *and* the other side has progressed by
//! `timeout_ns` since it arrived (or the other side never sent anything for
//! that VM), at [`JoinEngine::flush`], or when the pending set hits its hard cap
//! (`evicted`). Nothing is dropped silently.
//!
//! Note: the index hashes guest-supplied values with a fast non-keyed hash;
//! the hard cap bounds the damage a hostile guest could do.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use crate::clock::{narrow, CausalBounds, ClockConfig, ClockEstimator, OffsetEstimate};
use crate::record::{ClockDomain, GuestRq, HostElem, JoinedIo, Op, Point, Points, UnmatchedReason};
use crate::stages;

/// Fast hasher for small integer keys (FxHash).
#[derive(Default, Clone, Copy)]
pub struct FxHasher(u64);

const FX_K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.write_u64(i as u64)
    }
    fn write_u16(&mut self, i: u16) {
        self.write_u64(i as u64)
    }
    fn write_u32(&mut self, i: u32) {
        self.write_u64(i as u64)
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(5) ^ i).wrapping_mul(FX_K);
    }
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64)
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// Join tuning.
#[derive(Clone, Debug)]
pub struct JoinConfig {
    /// How long a record waits for its partner (in its own clock, and in the
    /// other side's progress).
    pub timeout_ns: u64,
    /// Hard cap on pending records per side (all VMs together).
    pub max_pending: usize,
    /// Extra tolerance on every time bound.
    pub slack_ns: u64,
    pub clock: ClockConfig,
}

impl Default for JoinConfig {
    fn default() -> Self {
        JoinConfig {
            timeout_ns: 3_000_000_000,
            max_pending: 1 << 18,
            slack_ns: 10_000,
            clock: ClockConfig::default(),
        }
    }
}

impl JoinConfig {
    /// For joining two finished recordings (e.g. `guest.jsonl` and
    /// `host.jsonl`) fed one after the other: nothing times out, everything
    /// unmatched is emitted by [`JoinEngine::flush`]. Without clock probes
    /// the clock is learned from unambiguous pairs (see the module docs).
    pub fn offline() -> Self {
        JoinConfig {
            timeout_ns: u64::MAX / 4,
            max_pending: 1 << 22,
            ..JoinConfig::default()
        }
    }
}

/// Counters of the join.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct JoinStats {
    pub guest_records: u64,
    pub host_records: u64,
    pub joined: u64,
    pub unmatched_guest: u64,
    pub unmatched_host: u64,
    /// Unmatched records whose reason is `mismatch_op_sector_len` (included above).
    pub mismatched: u64,
    /// Unmatched records evicted by the hard cap (included above).
    pub evicted: u64,
    /// Joins whose own causal bounds contradicted the clock estimate.
    pub clock_conflicts: u64,
    /// Joined requests not usable as clock samples (points inconsistent).
    pub clock_rejected: u64,
    /// Joined requests not used as clock samples (several candidates, or
    /// inconsistent with the estimate).
    pub clock_skipped: u64,
    pub pending_guest: u64,
    pub pending_host: u64,
}

struct Slot<T> {
    gen: u32,
    val: Option<T>,
}

struct Slab<T> {
    items: Vec<Slot<T>>,
    free: Vec<u32>,
    len: usize,
}

impl<T> Slab<T> {
    fn new() -> Self {
        Slab {
            items: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }
    fn insert(&mut self, v: T) -> (u32, u32) {
        self.len += 1;
        if let Some(id) = self.free.pop() {
            let s = &mut self.items[id as usize];
            s.gen = s.gen.wrapping_add(1);
            s.val = Some(v);
            (id, s.gen)
        } else {
            self.items.push(Slot {
                gen: 0,
                val: Some(v),
            });
            ((self.items.len() - 1) as u32, 0)
        }
    }
    fn get(&self, id: u32) -> Option<&T> {
        self.items.get(id as usize).and_then(|s| s.val.as_ref())
    }
    fn get_mut(&mut self, id: u32) -> Option<&mut T> {
        self.items.get_mut(id as usize).and_then(|s| s.val.as_mut())
    }
    fn live(&self, id: u32, gen: u32) -> bool {
        self.items
            .get(id as usize)
            .is_some_and(|s| s.gen == gen && s.val.is_some())
    }
    fn remove(&mut self, id: u32) -> Option<T> {
        let v = self.items.get_mut(id as usize)?.val.take()?;
        self.free.push(id);
        self.len -= 1;
        Some(v)
    }
}

struct GuestPending {
    vm: u32,
    rq: GuestRq,
    sub: Option<u64>,
    done: Option<u64>,
    last: u64,
    other_at_arrival: Option<u64>,
    mismatch: bool,
}

struct HostPending {
    vm: u32,
    el: HostElem,
    start: Option<u64>,
    end: Option<u64>,
    first: u64,
    last: u64,
    other_at_arrival: Option<u64>,
    mismatch: bool,
}

type Heap = BinaryHeap<Reverse<(u64, u32, u32)>>;

struct Vm {
    name: String,
    clock: ClockEstimator,
    host_now: Option<u64>,
    host_first: Option<u64>,
    guest_now: Option<u64>,
    guest_first: Option<u64>,
    guest_heap: Heap,
    host_heap: Heap,
    /// Learned guest disk ↔ host device pairs.
    bindings: Vec<(String, String)>,
    /// Whether headless guest records were seen (then hosts are indexed by sector).
    headless: bool,
    boot_id: Option<String>,
    host_by_sector: FxMap<u64, VecDeque<u32>>,
    guest_by_sector: FxMap<u64, VecDeque<u32>>,
}

/// Guest points that precede the avail-ring publication, latest first
/// (`g.rq_issue` fires inside `queue_rq`, after `g.queue_rq`).
const SUB_POINTS: &[Point] = &[
    Point::VqAdd,
    Point::RqIssue,
    Point::QueueRq,
    Point::RqInsert,
    Point::BioQueue,
];
const DONE_POINTS: &[Point] = &[Point::RqComplete, Point::BioComplete, Point::DriverComplete];
const HSTART_POINTS: &[Point] = &[Point::HostPop, Point::HostSubmit, Point::HostIoIssue];
const HEND_POINTS: &[Point] = &[
    Point::HostPush,
    Point::HostCompleteCb,
    Point::HostIoComplete,
];

fn first_of(ts: &Points, pts: &[Point]) -> Option<u64> {
    pts.iter().find_map(|p| ts.get(*p))
}

fn max_point(ts: &Points) -> Option<u64> {
    ts.iter().map(|e| e.1).max()
}

fn min_point(ts: &Points) -> Option<u64> {
    ts.iter().map(|e| e.1).min()
}

/// Removes `id` from an index list (matches are usually near the front).
fn remove_id(l: &mut VecDeque<u32>, id: u32) {
    if let Some(p) = l.iter().position(|&x| x == id) {
        l.remove(p);
    }
}

/// Index lists are kept sorted (guests by submission, hosts by end) so that a
/// scan can stop at the first candidate that is too late. Arrivals are nearly
/// in order, so the insertion point is found from the back in a few steps.
fn insert_sorted(l: &mut VecDeque<u32>, id: u32, key_of: impl Fn(u32) -> Option<u64>) {
    let Some(k) = key_of(id) else {
        l.push_back(id);
        return;
    };
    let mut pos = l.len();
    while pos > 0 && key_of(l[pos - 1]).is_some_and(|x| x > k) {
        pos -= 1;
    }
    l.insert(pos, id);
}

fn guest_sort_key(g: &GuestPending) -> u64 {
    g.sub.unwrap_or(g.last)
}

fn host_sort_key(h: &HostPending) -> u64 {
    h.end.unwrap_or(h.last)
}

fn key(vm: u32, queue: u16, head: u16) -> u64 {
    ((vm as u64) << 32) | ((queue as u64) << 16) | head as u64
}

fn ops_compatible(g: Op, h: Op) -> bool {
    g == h || (g == Op::Other && h == Op::GetId)
}

/// Op, sector and length agree (sector/length only for reads and writes:
/// virtio-blk carries discard/write-zeroes ranges in the payload and flushes
/// have none).
fn confirm(g: &GuestRq, h: &HostElem) -> bool {
    if !ops_compatible(g.op, h.op) {
        return false;
    }
    match g.op {
        Op::Read | Op::Write => g.sector == h.sector && g.bytes == h.bytes,
        _ => true,
    }
}

/// Is there a θ consistent with the estimate and with causality?
fn time_ok(
    sub: Option<u64>,
    done: Option<u64>,
    hs: Option<u64>,
    he: Option<u64>,
    est: Option<OffsetEstimate>,
    slack: u64,
) -> bool {
    let slack = slack as i128;
    let (mut lo, mut hi) = match est {
        Some(e) => (e.lo() as i128 - slack, e.hi() as i128 + slack),
        None => (i128::MIN, i128::MAX),
    };
    if let (Some(s), Some(p)) = (sub, hs) {
        hi = hi.min(p as i128 - s as i128 + slack);
    }
    if let (Some(d), Some(u)) = (done, he) {
        lo = lo.max(u as i128 - d as i128 - slack);
    }
    lo <= hi
}

/// Distance used to rank candidates that pass [`time_ok`]: how far the host
/// midpoint is from the mapped guest midpoint.
fn score(
    g_mid: Option<u64>,
    h_mid: Option<u64>,
    est: Option<OffsetEstimate>,
    fallback: u64,
) -> u128 {
    match (g_mid, h_mid, est) {
        (Some(g), Some(h), Some(e)) => (g as i128 + e.offset_ns as i128 - h as i128).unsigned_abs(),
        _ => fallback as u128,
    }
}

fn mid(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a / 2 + b / 2 + (a % 2 + b % 2) / 2),
        (x, None) | (None, x) => x,
    }
}

/// The join engine (single-threaded; one per host agent).
pub struct JoinEngine {
    cfg: JoinConfig,
    vms: Vec<Vm>,
    vm_ids: FxMap<String, u32>,
    guests: Slab<GuestPending>,
    hosts: Slab<HostPending>,
    guest_idx: FxMap<u64, VecDeque<u32>>,
    host_idx: FxMap<u64, VecDeque<u32>>,
    stats: JoinStats,
}

impl Default for JoinEngine {
    fn default() -> Self {
        Self::new(JoinConfig::default())
    }
}

impl JoinEngine {
    pub fn new(cfg: JoinConfig) -> Self {
        JoinEngine {
            cfg,
            vms: Vec::new(),
            vm_ids: FxMap::default(),
            guests: Slab::new(),
            hosts: Slab::new(),
            guest_idx: FxMap::default(),
            host_idx: FxMap::default(),
            stats: JoinStats::default(),
        }
    }

    pub fn config(&self) -> &JoinConfig {
        &self.cfg
    }

    pub fn stats(&self) -> JoinStats {
        let mut s = self.stats;
        s.pending_guest = self.guests.len as u64;
        s.pending_host = self.hosts.len as u64;
        s
    }

    fn vm_id(&mut self, vm: &str) -> u32 {
        if let Some(&id) = self.vm_ids.get(vm) {
            return id;
        }
        let id = self.vms.len() as u32;
        self.vms.push(Vm {
            name: vm.to_string(),
            clock: ClockEstimator::new(self.cfg.clock.clone()),
            host_now: None,
            host_first: None,
            guest_now: None,
            guest_first: None,
            guest_heap: Heap::new(),
            host_heap: Heap::new(),
            bindings: Vec::new(),
            headless: false,
            boot_id: None,
            host_by_sector: FxMap::default(),
            guest_by_sector: FxMap::default(),
        });
        self.vm_ids.insert(vm.to_string(), id);
        id
    }

    /// The clock estimator of a VM (feed it probe samples).
    pub fn clock(&mut self, vm: &str) -> &mut ClockEstimator {
        let id = self.vm_id(vm);
        &mut self.vms[id as usize].clock
    }

    /// Notes a guest (re)connection; a new boot id for the VM (the guest
    /// rebooted: its monotonic clock restarted) resets the VM's clock.
    /// Returns whether the clock was reset.
    pub fn guest_connected(&mut self, vm: &str, boot_id: &str) -> bool {
        let id = self.vm_id(vm);
        let v = &mut self.vms[id as usize];
        match &v.boot_id {
            Some(b) if b == boot_id => false,
            None => {
                v.boot_id = Some(boot_id.to_string());
                false
            }
            Some(_) => {
                v.boot_id = Some(boot_id.to_string());
                self.reset_clock(vm);
                true
            }
        }
    }

    /// Forgets a VM's clock (call when its guest rebooted: new boot id).
    pub fn reset_clock(&mut self, vm: &str) {
        let id = self.vm_id(vm);
        let v = &mut self.vms[id as usize];
        v.clock = ClockEstimator::new(self.cfg.clock.clone());
        v.guest_now = None;
        v.guest_first = None;
    }

    fn binding_ok(v: &Vm, disk: &str, device: &str) -> bool {
        v.bindings
            .iter()
            .all(|(d, dev)| (d == disk) == (dev == device))
    }

    fn bind(v: &mut Vm, disk: &str, device: &str) {
        if !v.bindings.iter().any(|(d, _)| d == disk) {
            v.bindings.push((disk.to_string(), device.to_string()));
        }
    }

    fn enable_headless(&mut self, vm: u32) {
        let v = &mut self.vms[vm as usize];
        if v.headless {
            return;
        }
        v.headless = true;
        for (id, s) in self.hosts.items.iter().enumerate() {
            if let Some(h) = &s.val {
                if h.vm == vm {
                    let hosts = &self.hosts;
                    insert_sorted(
                        v.host_by_sector.entry(h.el.sector).or_default(),
                        id as u32,
                        |x| hosts.get(x).map(host_sort_key),
                    );
                }
            }
        }
    }

    /// Adds a guest request from VM `vm`; joined or expired records go to `out`.
    pub fn push_guest(&mut self, vm: &str, rq: GuestRq, out: &mut Vec<JoinedIo>) {
        self.stats.guest_records += 1;
        let vid = self.vm_id(vm);
        let sub = first_of(&rq.ts, SUB_POINTS);
        let done = first_of(&rq.ts, DONE_POINTS);
        let first = min_point(&rq.ts).unwrap_or(0);
        let last = max_point(&rq.ts).unwrap_or(0);
        let keyed = match (rq.queue, rq.head) {
            (Some(q), Some(h)) => Some(key(vid, q, h)),
            _ => None,
        };
        if keyed.is_none() {
            self.enable_headless(vid);
        }
        {
            let v = &mut self.vms[vid as usize];
            v.guest_now = Some(v.guest_now.map_or(last, |n| n.max(last)));
            v.guest_first.get_or_insert(first);
        }
        let est = {
            let v = &mut self.vms[vid as usize];
            if v.clock.is_synced() {
                v.clock.offset_at(sub.or(done).unwrap_or(first))
            } else {
                None
            }
        };
        let g_mid = mid(sub, done);
        let slack = self.cfg.slack_ns;
        // Find the best host candidate.
        let mut best: Option<(u128, u32)> = None;
        let mut valid = 0usize;
        let mut mismatched: Vec<u32> = Vec::new();
        {
            let v = &self.vms[vid as usize];
            let cands = match keyed {
                Some(k) => self.host_idx.get(&k),
                None => v.host_by_sector.get(&rq.sector),
            };
            // Host lists are sorted by end time: once a host ended too late
            // for this request (θ ≥ end − done > hi), all later ones did too.
            for &id in cands.into_iter().flatten() {
                let Some(h) = self.hosts.get(id) else {
                    continue;
                };
                if let (Some(e), Some(d), Some(he)) = (est, done, h.end) {
                    let lo_needed = he as i128 - d as i128 - slack as i128;
                    if lo_needed > e.hi() as i128 + slack as i128 {
                        break;
                    }
                }
                if h.vm != vid || !Self::binding_ok(v, &rq.disk, &h.el.device) {
                    continue;
                }
                if keyed.is_none() && rq.queue.is_some_and(|q| q != h.el.queue) {
                    continue;
                }
                if !time_ok(sub, done, h.start, h.end, est, slack) {
                    continue;
                }
                if !confirm(&rq, &h.el) {
                    mismatched.push(id);
                    continue;
                }
                valid += 1;
                let sc = score(g_mid, mid(h.start, h.end), est, h.first);
                if best.is_none_or(|(b, _)| sc < b) {
                    best = Some((sc, id));
                }
            }
        }
        if let Some((_, id)) = best {
            let h = self.remove_host(id);
            self.make_joined(vid, rq, h.el, est, valid == 1, out);
        } else {
            let mismatch = !mismatched.is_empty();
            for id in mismatched {
                if let Some(h) = self.hosts.get_mut(id) {
                    h.mismatch = true;
                }
            }
            if self.guests.len >= self.cfg.max_pending {
                self.evict_guest(vid, out);
            }
            let other = self.vms[vid as usize].host_now;
            let (id, gen) = self.guests.insert(GuestPending {
                vm: vid,
                rq,
                sub,
                done,
                last,
                other_at_arrival: other,
                mismatch,
            });
            let g = self.guests.get(id).map(|g| (g.rq.sector, keyed));
            let guests = &self.guests;
            let key_of = |x: u32| guests.get(x).map(guest_sort_key);
            match g {
                Some((_, Some(k))) => {
                    insert_sorted(self.guest_idx.entry(k).or_default(), id, key_of)
                }
                Some((sector, None)) => insert_sorted(
                    self.vms[vid as usize]
                        .guest_by_sector
                        .entry(sector)
                        .or_default(),
                    id,
                    key_of,
                ),
                None => {}
            }
            let deadline = last.saturating_add(self.cfg.timeout_ns);
            self.vms[vid as usize]
                .guest_heap
                .push(Reverse((deadline, id, gen)));
            // Matched records leave stale heap entries until their deadline;
            // if time stalls, drop them so memory stays bounded by the cap.
            if self.vms[vid as usize].guest_heap.len() > 4 * self.guests.len + 4096 {
                let guests = &self.guests;
                self.vms[vid as usize]
                    .guest_heap
                    .retain(|Reverse((_, id, gen))| guests.live(*id, *gen));
            }
        }
        self.expire_vm(vid, out);
    }

    /// Adds a host element (its `vm` field names the VM).
    pub fn push_host(&mut self, el: HostElem, out: &mut Vec<JoinedIo>) {
        self.stats.host_records += 1;
        let vid = self.vm_id(&el.vm);
        let start = first_of(&el.ts, HSTART_POINTS);
        let end = first_of(&el.ts, HEND_POINTS);
        let first = min_point(&el.ts).unwrap_or(0);
        let last = max_point(&el.ts).unwrap_or(0);
        {
            let v = &mut self.vms[vid as usize];
            v.host_now = Some(v.host_now.map_or(last, |n| n.max(last)));
            v.host_first.get_or_insert(first);
        }
        let h_mid = mid(start, end);
        let slack = self.cfg.slack_ns;
        let k = key(vid, el.queue, el.head);
        let mut best: Option<(u128, u32, Option<OffsetEstimate>)> = None;
        let mut valid = 0usize;
        let mut mismatched: Vec<u32> = Vec::new();
        {
            let v = &mut self.vms[vid as usize];
            let synced = v.clock.is_synced();
            let keyed = self.guest_idx.get(&k);
            let headless = if v.headless {
                v.guest_by_sector.get(&el.sector)
            } else {
                None
            };
            for list in [keyed, headless].into_iter().flatten() {
                // Guest lists are sorted by submission time: once a guest was
                // submitted too late for this element (θ ≤ start − sub < lo),
                // all later ones were too.
                for &id in list {
                    let Some(g) = self.guests.get(id) else {
                        continue;
                    };
                    if g.vm != vid || !Self::binding_ok(v, &g.rq.disk, &el.device) {
                        continue;
                    }
                    if g.rq.queue.is_some_and(|q| q != el.queue) {
                        continue;
                    }
                    let est = if synced {
                        v.clock.offset_at(g.sub.or(g.done).unwrap_or(g.last))
                    } else {
                        None
                    };
                    if let (Some(e), Some(gs), Some(hs)) = (est, g.sub, start) {
                        let hi_allowed = hs as i128 - gs as i128 + slack as i128;
                        if hi_allowed < e.lo() as i128 - slack as i128 {
                            break;
                        }
                    }
                    if !time_ok(g.sub, g.done, start, end, est, slack) {
                        continue;
                    }
                    if !confirm(&g.rq, &el) {
                        mismatched.push(id);
                        continue;
                    }
                    valid += 1;
                    let sc = score(mid(g.sub, g.done), h_mid, est, g.sub.unwrap_or(g.last));
                    if best.as_ref().is_none_or(|(b, _, _)| sc < *b) {
                        best = Some((sc, id, est));
                    }
                }
            }
        }
        if let Some((_, id, est)) = best {
            let g = self.remove_guest(id);
            self.make_joined(vid, g.rq, el, est, valid == 1, out);
        } else {
            let mismatch = !mismatched.is_empty();
            for id in mismatched {
                if let Some(g) = self.guests.get_mut(id) {
                    g.mismatch = true;
                }
            }
            if self.hosts.len >= self.cfg.max_pending {
                self.evict_host(vid, out);
            }
            let other = self.vms[vid as usize].guest_now;
            let sector = el.sector;
            let (id, gen) = self.hosts.insert(HostPending {
                vm: vid,
                el,
                start,
                end,
                first,
                last,
                other_at_arrival: other,
                mismatch,
            });
            let hosts = &self.hosts;
            let key_of = |x: u32| hosts.get(x).map(host_sort_key);
            insert_sorted(self.host_idx.entry(k).or_default(), id, key_of);
            let v = &mut self.vms[vid as usize];
            if v.headless {
                insert_sorted(v.host_by_sector.entry(sector).or_default(), id, key_of);
            }
            let deadline = last.saturating_add(self.cfg.timeout_ns);
            v.host_heap.push(Reverse((deadline, id, gen)));
            if v.host_heap.len() > 4 * self.hosts.len + 4096 {
                let hosts = &self.hosts;
                v.host_heap
                    .retain(|Reverse((_, id, gen))| hosts.live(*id, *gen));
            }
        }
        self.expire_vm(vid, out);
    }

    /// Tells the engine the host's current time (live mode, when records are
    /// sparse) and emits what timed out.
    pub fn advance(&mut self, host_now: u64, out: &mut Vec<JoinedIo>) {
        for vid in 0..self.vms.len() as u32 {
            let v = &mut self.vms[vid as usize];
            v.host_now = Some(v.host_now.map_or(host_now, |n| n.max(host_now)));
            v.host_first.get_or_insert(host_now);
            if v.clock.is_synced() {
                let at = v.guest_now.unwrap_or(0);
                if let Some(e) = v.clock.offset_at(at) {
                    let g = host_now.saturating_add_signed(-e.offset_ns);
                    v.guest_now = Some(v.guest_now.map_or(g, |n| n.max(g)));
                }
            }
            self.expire_vm(vid, out);
        }
    }

    /// Emits every pending record as unmatched (end of input).
    pub fn flush(&mut self, out: &mut Vec<JoinedIo>) {
        let mut gs: Vec<u32> = (0..self.guests.items.len() as u32)
            .filter(|&i| self.guests.get(i).is_some())
            .collect();
        gs.sort_by_key(|&i| self.guests.get(i).map(|g| g.last));
        for id in gs {
            let g = self.remove_guest(id);
            let r = if g.mismatch {
                UnmatchedReason::MismatchOpSectorLen
            } else {
                UnmatchedReason::NoHostRecord
            };
            self.unmatched_guest(g, r, out);
        }
        let mut hs: Vec<u32> = (0..self.hosts.items.len() as u32)
            .filter(|&i| self.hosts.get(i).is_some())
            .collect();
        hs.sort_by_key(|&i| self.hosts.get(i).map(|h| h.last));
        for id in hs {
            let h = self.remove_host(id);
            let r = if h.mismatch {
                UnmatchedReason::MismatchOpSectorLen
            } else {
                UnmatchedReason::NoGuestRecord
            };
            self.unmatched_host(h, r, out);
        }
        for v in &mut self.vms {
            v.guest_heap.clear();
            v.host_heap.clear();
        }
    }

    fn remove_guest(&mut self, id: u32) -> GuestPending {
        let g = self
            .guests
            .remove(id)
            .expect("remove_guest is only called with live ids");
        let list = match (g.rq.queue, g.rq.head) {
            (Some(q), Some(h)) => self.guest_idx.get_mut(&key(g.vm, q, h)),
            _ => self.vms[g.vm as usize]
                .guest_by_sector
                .get_mut(&g.rq.sector),
        };
        if let Some(l) = list {
            remove_id(l, id);
        }
        if !matches!((g.rq.queue, g.rq.head), (Some(_), Some(_))) {
            let m = &mut self.vms[g.vm as usize].guest_by_sector;
            if m.get(&g.rq.sector).is_some_and(|l| l.is_empty()) {
                m.remove(&g.rq.sector);
            }
        }
        g
    }

    fn remove_host(&mut self, id: u32) -> HostPending {
        let h = self
            .hosts
            .remove(id)
            .expect("remove_host is only called with live ids");
        if let Some(l) = self.host_idx.get_mut(&key(h.vm, h.el.queue, h.el.head)) {
            remove_id(l, id);
        }
        let v = &mut self.vms[h.vm as usize];
        if v.headless {
            if let Some(l) = v.host_by_sector.get_mut(&h.el.sector) {
                remove_id(l, id);
                if l.is_empty() {
                    v.host_by_sector.remove(&h.el.sector);
                }
            }
        }
        h
    }

    fn expire_vm(&mut self, vid: u32, out: &mut Vec<JoinedIo>) {
        let t = self.cfg.timeout_ns;
        loop {
            let v = &self.vms[vid as usize];
            let Some(&Reverse((deadline, id, gen))) = v.guest_heap.peek() else {
                break;
            };
            if !self.guests.live(id, gen) {
                self.vms[vid as usize].guest_heap.pop();
                continue;
            }
            let own = v.guest_now.is_some_and(|n| n >= deadline);
            let other = match v.host_now {
                None => true,
                Some(hn) => {
                    let at = self
                        .guests
                        .get(id)
                        .and_then(|g| g.other_at_arrival)
                        .or(v.host_first)
                        .unwrap_or(0);
                    hn >= at.saturating_add(t)
                }
            };
            if !(own && other) {
                break;
            }
            self.vms[vid as usize].guest_heap.pop();
            let g = self.remove_guest(id);
            let r = if g.mismatch {
                UnmatchedReason::MismatchOpSectorLen
            } else {
                UnmatchedReason::NoHostRecord
            };
            self.unmatched_guest(g, r, out);
        }
        loop {
            let v = &self.vms[vid as usize];
            let Some(&Reverse((deadline, id, gen))) = v.host_heap.peek() else {
                break;
            };
            if !self.hosts.live(id, gen) {
                self.vms[vid as usize].host_heap.pop();
                continue;
            }
            let own = v.host_now.is_some_and(|n| n >= deadline);
            let other = match v.guest_now {
                None => true,
                Some(gn) => {
                    let at = self
                        .hosts
                        .get(id)
                        .and_then(|h| h.other_at_arrival)
                        .or(v.guest_first)
                        .unwrap_or(0);
                    gn >= at.saturating_add(t)
                }
            };
            if !(own && other) {
                break;
            }
            self.vms[vid as usize].host_heap.pop();
            let h = self.remove_host(id);
            let r = if h.mismatch {
                UnmatchedReason::MismatchOpSectorLen
            } else {
                UnmatchedReason::NoGuestRecord
            };
            self.unmatched_host(h, r, out);
        }
    }

    fn evict_guest(&mut self, prefer: u32, out: &mut Vec<JoinedIo>) {
        let order = std::iter::once(prefer).chain(0..self.vms.len() as u32);
        for vid in order {
            while let Some(Reverse((_, id, gen))) = self.vms[vid as usize].guest_heap.pop() {
                if self.guests.live(id, gen) {
                    let g = self.remove_guest(id);
                    self.stats.evicted += 1;
                    self.unmatched_guest(g, UnmatchedReason::Evicted, out);
                    return;
                }
            }
        }
    }

    fn evict_host(&mut self, prefer: u32, out: &mut Vec<JoinedIo>) {
        let order = std::iter::once(prefer).chain(0..self.vms.len() as u32);
        for vid in order {
            while let Some(Reverse((_, id, gen))) = self.vms[vid as usize].host_heap.pop() {
                if self.hosts.live(id, gen) {
                    let h = self.remove_host(id);
                    self.stats.evicted += 1;
                    self.unmatched_host(h, UnmatchedReason::Evicted, out);
                    return;
                }
            }
        }
    }

    fn make_joined(
        &mut self,
        vid: u32,
        rq: GuestRq,
        el: HostElem,
        est: Option<OffsetEstimate>,
        unambiguous: bool,
        out: &mut Vec<JoinedIo>,
    ) {
        self.stats.joined += 1;
        let sub = first_of(&rq.ts, SUB_POINTS);
        let done = first_of(&rq.ts, DONE_POINTS);
        let hs = first_of(&el.ts, HSTART_POINTS);
        let he = first_of(&el.ts, HEND_POINTS);
        let mut b = CausalBounds::default();
        if let (Some(s), Some(p)) = (sub, hs) {
            b = b.before(s, p);
        }
        if let (Some(d), Some(u)) = (done, he) {
            b = b.after(u, d);
        }
        let max_drift = self.cfg.clock.max_drift_ppm * 1e-6;
        let span = match (sub, done) {
            (Some(s), Some(d)) => d.saturating_sub(s),
            _ => 0,
        };
        let allow = (span as f64 * max_drift).ceil() as u64 + 1;
        let mut consistent = true;
        let offset: Option<(i64, Option<u64>)> = match est {
            Some(e) => match narrow(e, b, allow) {
                Some(n) => Some((n.offset_ns, Some(n.uncertainty_ns))),
                None => {
                    self.stats.clock_conflicts += 1;
                    consistent = false;
                    Some((e.offset_ns, Some(e.uncertainty_ns)))
                }
            },
            None => match (b.lo, b.hi) {
                (Some(lo), Some(hi)) if lo <= hi.saturating_add(allow as i64) => {
                    let lo = lo.saturating_sub(allow as i64) as f64;
                    let hi = hi.saturating_add(allow as i64) as f64;
                    let c = lo + (hi - lo) / 2.0;
                    Some((
                        c.round() as i64,
                        Some(((hi - lo) / 2.0 + 0.5).ceil() as u64),
                    ))
                }
                // One-sided or inconsistent: place it at the bound, uncertainty unknown.
                (Some(x), _) | (None, Some(x)) => Some((x, None)),
                (None, None) => None,
            },
        };
        // Only an unambiguous pair that agrees with the current estimate
        // becomes a clock sample: a mis-join must not steer the clock.
        if let (Some(s), Some(p), Some(u), Some(d)) = (sub, hs, he, done) {
            if !(unambiguous && consistent) {
                self.stats.clock_skipped += 1;
            } else if self.vms[vid as usize]
                .clock
                .add_request(s, p, u, d)
                .is_err()
            {
                self.stats.clock_rejected += 1;
            }
        }
        Self::bind(&mut self.vms[vid as usize], &rq.disk, &el.device);
        // Guest point ids sort before host ones: appending keeps the set sorted.
        // Without any time relation (no causal points at all) only the host
        // points are kept.
        let ts: Points = match offset {
            Some((off, _)) => {
                let mut ts = rq.ts;
                ts.shift(off);
                for (p, t) in el.ts.iter() {
                    ts.set(p, t);
                }
                ts
            }
            None => el.ts,
        };
        let mut ts = ts;
        if let Some((_, unc)) = offset {
            drop_unrelated_notifications(&mut ts, unc.unwrap_or(0));
        }
        let domain = ClockDomain::Host;
        let bd = stages::derive(&ts);
        out.push(JoinedIo {
            vm: el.vm,
            disk: Some(rq.disk),
            device: Some(el.device),
            queue: Some(el.queue),
            head: Some(el.head),
            op: rq.op,
            sector: rq.sector,
            bytes: rq.bytes,
            pid: Some(rq.pid),
            tid: Some(rq.tid),
            comm: Some(rq.comm),
            cgroup_id: Some(rq.cgroup_id),
            inode: Some(rq.inode),
            file_offset: rq.file_offset,
            kicked: rq.kicked,
            error: Some(rq.error),
            qemu_pid: Some(el.qemu_pid),
            backend: Some(el.backend),
            merge_id: Some(el.merge_id),
            status: el.status,
            ts,
            ts_domain: domain,
            stages: bd.stages,
            substages: bd.substages,
            total_ns: bd.total_ns,
            clock_uncertainty_ns: offset.and_then(|o| o.1),
            joined: true,
            reason: None,
        });
    }

    fn unmatched_guest(
        &mut self,
        g: GuestPending,
        reason: UnmatchedReason,
        out: &mut Vec<JoinedIo>,
    ) {
        self.stats.unmatched_guest += 1;
        if reason == UnmatchedReason::MismatchOpSectorLen {
            self.stats.mismatched += 1;
        }
        let v = &mut self.vms[g.vm as usize];
        let est = if v.clock.is_synced() {
            v.clock.offset_at(g.sub.or(g.done).unwrap_or(g.last))
        } else {
            None
        };
        let rq = g.rq;
        let mut ts = rq.ts;
        let domain = match est {
            Some(e) => {
                ts.shift(e.offset_ns);
                ClockDomain::Host
            }
            None => ClockDomain::Guest,
        };
        let bd = stages::derive(&ts);
        out.push(JoinedIo {
            vm: v.name.clone(),
            disk: Some(rq.disk),
            device: None,
            queue: rq.queue,
            head: rq.head,
            op: rq.op,
            sector: rq.sector,
            bytes: rq.bytes,
            pid: Some(rq.pid),
            tid: Some(rq.tid),
            comm: Some(rq.comm),
            cgroup_id: Some(rq.cgroup_id),
            inode: Some(rq.inode),
            file_offset: rq.file_offset,
            kicked: rq.kicked,
            error: Some(rq.error),
            qemu_pid: None,
            backend: None,
            merge_id: None,
            status: None,
            ts,
            ts_domain: domain,
            stages: bd.stages,
            substages: bd.substages,
            total_ns: bd.total_ns,
            clock_uncertainty_ns: est.map(|e| e.uncertainty_ns),
            joined: false,
            reason: Some(reason),
        });
    }

    fn unmatched_host(&mut self, h: HostPending, reason: UnmatchedReason, out: &mut Vec<JoinedIo>) {
        self.stats.unmatched_host += 1;
        if reason == UnmatchedReason::MismatchOpSectorLen {
            self.stats.mismatched += 1;
        }
        let el = h.el;
        let bd = stages::derive(&el.ts);
        out.push(JoinedIo {
            vm: el.vm,
            disk: None,
            device: Some(el.device),
            queue: Some(el.queue),
            head: Some(el.head),
            op: el.op,
            sector: el.sector,
            bytes: el.bytes,
            pid: None,
            tid: None,
            comm: None,
            cgroup_id: None,
            inode: None,
            file_offset: None,
            kicked: None,
            error: None,
            qemu_pid: Some(el.qemu_pid),
            backend: Some(el.backend),
            merge_id: Some(el.merge_id),
            status: el.status,
            ts: el.ts,
            ts_domain: ClockDomain::Host,
            stages: bd.stages,
            substages: bd.substages,
            total_ns: bd.total_ns,
            clock_uncertainty_ns: None,
            joined: false,
            reason: Some(reason),
        });
    }
}

/// Removes the guest's notification points that did not carry this request across.
///
/// * `g.kick` is the first kick after the request was added; when the host had
///   already popped the element before it (QEMU drains the ring with
///   notifications off, so a later add needs no kick), that kick was for other
///   requests.
/// * `g.irq` is the interrupt whose handler completed the request; when it fired
///   before the host pushed the element, the handler was already running and
///   found the element while draining the used ring.
///
/// `ts` holds both sides in the host clock; `unc` is the mapping's uncertainty.
/// The stage derivation then uses the next point (`g.vq_add`, `g.driver_complete`).
fn drop_unrelated_notifications(ts: &mut Points, unc: u64) {
    let host_start = ts.get(Point::HostPop).or(ts.get(Point::HostNotify));
    if let (Some(kick), Some(pop)) = (ts.get(Point::Kick), host_start) {
        if kick > pop.saturating_add(unc) {
            ts.remove(Point::Kick);
        }
    }
    let host_end = ts.get(Point::HostPush).or(ts.get(Point::HostIrq));
    if let (Some(irq), Some(push)) = (ts.get(Point::Irq), host_end) {
        if irq.saturating_add(unc) < push {
            ts.remove(Point::Irq);
        }
    }
}

/// The stage breakdown of a guest-only record (guest clock domain).
pub fn guest_breakdown(rq: &GuestRq) -> stages::Breakdown {
    stages::derive(&rq.ts)
}

/// The stage breakdown of a host-only record (host clock domain).
pub fn host_breakdown(el: &HostElem) -> stages::Breakdown {
    stages::derive(&el.ts)
}

/// Synthetic guest/host streams with a known truth, for tests and benchmarks.
pub mod synth {
    use crate::record::{Backend, GuestRq, HostElem, Op, Point, Points};

    /// SplitMix64.
    #[derive(Clone, Debug)]
    pub struct Rng(pub u64);
    impl Rng {
        pub fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        pub fn below(&mut self, n: u64) -> u64 {
            if n == 0 {
                0
            } else {
                self.next_u64() % n
            }
        }
    }

    #[derive(Clone, Debug)]
    pub struct SynthConfig {
        pub vm: String,
        pub requests: usize,
        pub queues: u16,
        /// Mean guest time between request starts.
        pub interval_ns: u64,
        /// Backend service time range.
        pub service_ns: (u64, u64),
        /// Requests per guest batch (one kick per batch), 1 = no batching.
        pub batch: usize,
        /// Whether each batch is one merged backend request (shared `merge_id`).
        pub merge: bool,
        /// Sectors are drawn from this many distinct 4 KiB blocks (small = many repeats).
        pub blocks: u64,
        /// `host − guest` at guest time 0 and the drift.
        pub theta_ns: i64,
        pub drift_ppm: f64,
        /// Guest-initiated probe every this many guest ns (0: none).
        pub probe_every_ns: u64,
        pub seed: u64,
        /// Guest time of the first request.
        pub start_ns: u64,
    }

    impl Default for SynthConfig {
        fn default() -> Self {
            SynthConfig {
                vm: "vm0".into(),
                requests: 1000,
                queues: 2,
                interval_ns: 100_000,
                service_ns: (50_000, 400_000),
                batch: 1,
                merge: false,
                blocks: 65_536,
                theta_ns: 5_000_000_000,
                drift_ppm: 40.0,
                probe_every_ns: 50_000_000,
                seed: 1,
                start_ns: 1_000_000_000,
            }
        }
    }

    /// A generated stream. `guest[i]` and `host[i]` are the same request (the
    /// truth); `guest[i].pid == i`.
    #[derive(Clone, Debug)]
    pub struct SynthStream {
        pub guest: Vec<GuestRq>,
        pub host: Vec<HostElem>,
        /// Guest-initiated probes `(t1, t2, t3, t4)`.
        pub probes: Vec<(u64, u64, u64, u64)>,
        pub theta_ns: i64,
        pub drift: f64,
    }

    impl SynthStream {
        /// The true `host − guest` at guest time `g`.
        pub fn theta(&self, g: u64) -> f64 {
            self.theta_ns as f64 + self.drift * g as f64
        }
        pub fn host_of(&self, g: u64) -> u64 {
            (g as f64 + self.theta(g)).round() as u64
        }
        pub fn guest_of(&self, h: u64) -> u64 {
            ((h as f64 - self.theta_ns as f64) / (1.0 + self.drift)).round() as u64
        }
    }

    /// One input event for the join.
    #[derive(Clone, Debug)]
    pub enum Event {
        Guest(GuestRq),
        Host(HostElem),
        Probe(u64, u64, u64, u64),
    }

    pub fn generate(cfg: &SynthConfig) -> SynthStream {
        let mut r = Rng(cfg.seed);
        let drift = cfg.drift_ppm * 1e-6;
        let mut s = SynthStream {
            guest: Vec::with_capacity(cfg.requests),
            host: Vec::with_capacity(cfg.requests),
            probes: Vec::new(),
            theta_ns: cfg.theta_ns,
            drift,
        };
        let queues = cfg.queues.max(1) as usize;
        // Per queue: busy-until (guest time) of each head.
        let mut heads: Vec<Vec<u64>> = vec![Vec::new(); queues];
        let start = cfg.start_ns.max(cfg.probe_every_ns);
        let mut t: u64 = start;
        let mut i = 0usize;
        let mut merge_id = 1u64;
        while i < cfg.requests {
            let n = cfg.batch.max(1).min(cfg.requests - i);
            let q = r.below(queues as u64) as usize;
            let kick = t + 4_000 + 1_000 * n as u64 + 1_000;
            let pop0 = s.host_of(kick) + 15_000 + r.below(20_000);
            let service = cfg.service_ns.0 + r.below(cfg.service_ns.1 - cfg.service_ns.0 + 1);
            let base_block = r.below(cfg.blocks.max(1));
            let mut group_submit = 0;
            for j in 0..n {
                let pop = pop0 + 2_000 * j as u64;
                let submit = if cfg.merge {
                    if j == 0 {
                        group_submit = pop0 + 2_000 * n as u64 + 3_000;
                    }
                    group_submit
                } else {
                    pop + 3_000
                };
                let own_service = if cfg.merge {
                    service
                } else {
                    service + r.below(50_000)
                };
                let io_issue = submit + 2_000;
                let io_complete = io_issue + own_service;
                let complete_cb = io_complete + 3_000;
                let push = complete_cb + 2_000 + 1_000 * j as u64;
                let hirq = push + 1_000;
                let girq = s.guest_of(hirq + 8_000 + r.below(10_000));
                let done = girq + 4_000;
                // Head: lowest head free at t on this queue.
                let hl = &mut heads[q];
                let head = match hl.iter().position(|&busy| busy < t) {
                    Some(h) => h,
                    None => {
                        hl.push(0);
                        hl.len() - 1
                    }
                };
                hl[head] = done + 1;
                let block = if cfg.merge {
                    (base_block + j as u64) % cfg.blocks.max(1)
                } else {
                    r.below(cfg.blocks.max(1))
                };
                let op = if r.below(3) == 0 { Op::Write } else { Op::Read };
                let sector = block * 8;
                let g_ts: Points = [
                    (Point::BioQueue, t),
                    (Point::RqIssue, t + 2_000),
                    (Point::VqAdd, t + 4_000 + 1_000 * j as u64),
                    (Point::Kick, kick),
                    (Point::Irq, girq),
                    (Point::DriverComplete, girq + 2_000),
                    (Point::RqComplete, done),
                ]
                .into_iter()
                .collect();
                let h_ts: Points = [
                    (Point::HostPop, pop),
                    (Point::HostSubmit, submit),
                    (Point::HostIoIssue, io_issue),
                    (Point::HostIoComplete, io_complete),
                    (Point::HostCompleteCb, complete_cb),
                    (Point::HostPush, push),
                    (Point::HostIrq, hirq),
                ]
                .into_iter()
                .collect();
                s.guest.push(GuestRq {
                    disk: "vda".into(),
                    op,
                    sector,
                    bytes: 4096,
                    queue: Some(q as u16),
                    head: Some(head as u16),
                    pid: (i + j) as u32,
                    tid: (i + j) as u32,
                    comm: "fio".into(),
                    cgroup_id: 1,
                    inode: 12,
                    file_offset: Some(sector * 512),
                    kicked: Some(j + 1 == n),
                    bios: 1,
                    error: 0,
                    ts: g_ts,
                });
                s.host.push(HostElem {
                    vm: cfg.vm.clone(),
                    qemu_pid: 100,
                    device: "virtio-disk0".into(),
                    queue: q as u16,
                    head: head as u16,
                    op,
                    sector,
                    bytes: 4096,
                    backend: Backend::Threads,
                    merge_id: if cfg.merge {
                        merge_id
                    } else {
                        merge_id + j as u64
                    },
                    status: Some(0),
                    ts: h_ts,
                });
            }
            merge_id += n as u64;
            i += n;
            t += cfg.interval_ns / 2 + r.below(cfg.interval_ns.max(1)) * n as u64;
        }
        if cfg.probe_every_ns > 0 {
            let end = t + 1_000_000_000;
            let mut g = start - cfg.probe_every_ns;
            while g < end {
                let t2 = s.host_of(g) + 30_000 + r.below(200_000);
                let t3 = t2 + 2_000;
                let t4 = s.guest_of(t3 + 40_000 + r.below(300_000));
                s.probes.push((g, t2, t3, t4));
                g += cfg.probe_every_ns;
            }
        }
        s
    }

    /// Interleaves the stream as a host would receive it: records in completion
    /// order, guest records (and probes) `guest_lag_ns` late, plus `shuffle`
    /// random swaps of nearby events.
    pub fn interleave(s: &SynthStream, guest_lag_ns: u64, shuffle: usize, seed: u64) -> Vec<Event> {
        let mut ev: Vec<(u64, Event)> = Vec::with_capacity(s.guest.len() * 2 + s.probes.len());
        for g in &s.guest {
            let done = g.ts.get(Point::RqComplete).unwrap_or(0);
            ev.push((s.host_of(done) + guest_lag_ns, Event::Guest(g.clone())));
        }
        for h in &s.host {
            let at = h.ts.iter().map(|e| e.1).max().unwrap_or(0);
            ev.push((at, Event::Host(h.clone())));
        }
        for &(t1, t2, t3, t4) in &s.probes {
            ev.push((s.host_of(t4) + guest_lag_ns, Event::Probe(t1, t2, t3, t4)));
        }
        ev.sort_by_key(|e| e.0);
        let mut r = Rng(seed);
        let n = ev.len();
        for _ in 0..shuffle {
            if n < 2 {
                break;
            }
            let a = r.below(n as u64) as usize;
            let b = (a + 1 + r.below(16) as usize).min(n - 1);
            ev.swap(a, b);
        }
        ev.into_iter().map(|e| e.1).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::synth::*;
    use super::*;

    fn run(engine: &mut JoinEngine, vm: &str, events: Vec<Event>) -> Vec<JoinedIo> {
        let mut out = Vec::new();
        for e in events {
            match e {
                Event::Guest(g) => engine.push_guest(vm, g, &mut out),
                Event::Host(h) => engine.push_host(h, &mut out),
                Event::Probe(t1, t2, t3, t4) => {
                    engine.clock(vm).add_guest_probe(t1, t2, t3, t4).unwrap();
                }
            }
        }
        engine.flush(&mut out);
        out
    }

    /// Every guest request joined with its own host element; timestamps mapped
    /// within the stated uncertainty.
    fn check_all_joined(s: &SynthStream, out: &[JoinedIo]) {
        let joined: Vec<&JoinedIo> = out.iter().filter(|j| j.joined).collect();
        let unmatched: Vec<_> = out
            .iter()
            .filter(|j| !j.joined)
            .map(|j| (j.pid, j.queue, j.head, j.sector, j.reason))
            .take(5)
            .collect();
        assert_eq!(joined.len(), s.guest.len(), "unmatched: {unmatched:?}");
        assert_eq!(out.len(), s.guest.len());
        for j in joined {
            let i = j.pid.unwrap() as usize;
            let h = &s.host[i];
            assert_eq!(j.head, Some(h.head), "pid {i}");
            assert_eq!(j.queue, Some(h.queue));
            assert_eq!(
                j.ts.get(Point::HostPop),
                h.ts.get(Point::HostPop),
                "pid {i}"
            );
            let g = s.guest[i].ts.get(Point::RqIssue).unwrap();
            let truth = s.host_of(g);
            let mapped = j.ts.get(Point::RqIssue).unwrap();
            let u = j.clock_uncertainty_ns.unwrap();
            assert!(
                mapped.abs_diff(truth) <= u + 2,
                "pid {i}: mapped {mapped} truth {truth} u {u}"
            );
            assert_eq!(j.stages.sum(), j.total_ns.unwrap());
            assert_eq!(j.ts_domain, ClockDomain::Host);
        }
    }

    #[test]
    fn joins_with_probes_in_order() {
        let s = generate(&SynthConfig::default());
        let mut e = JoinEngine::default();
        let out = run(&mut e, "vm0", interleave(&s, 2_000_000, 0, 1));
        check_all_joined(&s, &out);
        let st = e.stats();
        assert_eq!(st.joined, 1000);
        assert_eq!(st.pending_guest + st.pending_host, 0);
        // Request samples tightened the clock well below the probes' RTT.
        let u: Vec<u64> = out.iter().filter_map(|j| j.clock_uncertainty_ns).collect();
        let median = {
            let mut u = u.clone();
            u.sort();
            u[u.len() / 2]
        };
        assert!(median < 40_000, "median uncertainty {median}");
    }

    #[test]
    fn joins_without_any_clock_sample_and_heavy_head_reuse() {
        // Few sectors (many repeats), one queue, no probes, out-of-order arrival.
        let cfg = SynthConfig {
            queues: 1,
            blocks: 4,
            probe_every_ns: 0,
            requests: 2000,
            interval_ns: 300_000,
            seed: 9,
            ..SynthConfig::default()
        };
        let s = generate(&cfg);
        let heads: std::collections::HashSet<u16> = s.host.iter().map(|h| h.head).collect();
        assert!(heads.len() < 20, "heads are reused: {}", heads.len());
        let mut e = JoinEngine::default();
        let out = run(&mut e, "vm0", interleave(&s, 3_000_000, 500, 2));
        check_all_joined(&s, &out);
    }

    #[test]
    fn out_of_order_and_host_late() {
        let s = generate(&SynthConfig {
            seed: 4,
            ..SynthConfig::default()
        });
        // Guest records *early* relative to host ones (negative lag emulated by
        // delaying hosts): build events by hand.
        let mut ev: Vec<Event> = s.guest.iter().cloned().map(Event::Guest).collect();
        ev.extend(
            s.probes
                .iter()
                .map(|&(a, b, c, d)| Event::Probe(a, b, c, d)),
        );
        ev.extend(s.host.iter().cloned().map(Event::Host));
        let mut e = JoinEngine::default();
        let out = run(&mut e, "vm0", ev);
        check_all_joined(&s, &out);
    }

    #[test]
    fn merges_and_batches() {
        let cfg = SynthConfig {
            batch: 4,
            merge: true,
            seed: 5,
            ..SynthConfig::default()
        };
        let s = generate(&cfg);
        let mut e = JoinEngine::default();
        let out = run(&mut e, "vm0", interleave(&s, 1_000_000, 200, 3));
        check_all_joined(&s, &out);
        // Elements of one merge share merge_id and the backend stage.
        let mut by_merge: HashMap<u64, Vec<&JoinedIo>> = HashMap::new();
        for j in &out {
            by_merge.entry(j.merge_id.unwrap()).or_default().push(j);
        }
        assert!(by_merge.values().any(|v| v.len() == 4));
        for v in by_merge.values() {
            let hi: Vec<_> = v
                .iter()
                .map(|j| j.substages.get("host_io.kernel"))
                .collect();
            assert!(hi.windows(2).all(|w| w[0] == w[1]));
            // One kick per batch.
            let kicks: std::collections::HashSet<_> = v
                .iter()
                .map(|j| s.guest[j.pid.unwrap() as usize].ts.get(Point::Kick))
                .collect();
            assert_eq!(kicks.len(), 1);
        }
    }

    #[test]
    fn unmatched_are_emitted_with_reasons() {
        let cfg = SynthConfig {
            requests: 300,
            seed: 6,
            ..SynthConfig::default()
        };
        let mut s = generate(&cfg);
        // Drop host element 10, drop guest request 20, corrupt the sector of host 30.
        let lost_host = s.host[10].clone();
        let lost_guest = s.guest[20].clone();
        s.host[30].sector += 8;
        let mut ev = interleave(&s, 1_000_000, 0, 1);
        ev.retain(|e| match e {
            Event::Host(h) => h != &lost_host,
            Event::Guest(g) => g != &lost_guest,
            _ => true,
        });
        let mut e = JoinEngine::new(JoinConfig {
            timeout_ns: 5_000_000,
            ..JoinConfig::default()
        });
        let mut out = Vec::new();
        for ev in ev {
            match ev {
                Event::Guest(g) => e.push_guest("vm0", g, &mut out),
                Event::Host(h) => e.push_host(h, &mut out),
                Event::Probe(a, b, c, d) => e.clock("vm0").add_guest_probe(a, b, c, d).unwrap(),
            }
        }
        // Emitted by the timeout already, before any flush.
        let reasons: Vec<(Option<u32>, Option<u64>, UnmatchedReason)> = out
            .iter()
            .filter(|j| !j.joined)
            .map(|j| (j.pid, j.sector.into(), j.reason.unwrap()))
            .collect();
        assert!(
            reasons.contains(&(
                Some(10),
                Some(s.guest[10].sector),
                UnmatchedReason::NoHostRecord
            )),
            "{reasons:?}"
        );
        assert!(
            reasons.iter().any(|r| r.0.is_none()
                && r.1 == Some(s.host[20].sector)
                && r.2 == UnmatchedReason::NoGuestRecord),
            "{reasons:?}"
        );
        assert!(
            reasons.contains(&(
                Some(30),
                Some(s.guest[30].sector),
                UnmatchedReason::MismatchOpSectorLen
            )),
            "{reasons:?}"
        );
        assert!(
            reasons.iter().any(|r| r.0.is_none()
                && r.1 == Some(s.host[30].sector)
                && r.2 == UnmatchedReason::MismatchOpSectorLen),
            "{reasons:?}"
        );
        e.flush(&mut out);
        // Nothing lost: 297 joined + 2 unmatched guests + 2 unmatched hosts.
        assert_eq!(out.len(), 301);
        assert_eq!(out.iter().filter(|j| j.joined).count(), 297);
        let st = e.stats();
        assert_eq!(st.unmatched_guest, 2);
        assert_eq!(st.unmatched_host, 2);
        assert_eq!(st.mismatched, 2);
        // The unmatched guest was mapped to the host clock (the VM is synced).
        let ug = out.iter().find(|j| j.pid == Some(10)).unwrap();
        assert_eq!(ug.ts_domain, ClockDomain::Host);
        assert!(ug.clock_uncertainty_ns.is_some());
        assert!(ug.stages.get("device").is_some(), "{:?}", ug.stages);
        let uh = out
            .iter()
            .find(|j| j.pid.is_none() && j.sector == s.host[20].sector)
            .unwrap();
        assert!(uh.stages.get("host_io").is_some());
    }

    #[test]
    fn memory_is_bounded_with_counted_evictions() {
        let cfg = SynthConfig {
            requests: 1000,
            probe_every_ns: 0,
            ..SynthConfig::default()
        };
        let s = generate(&cfg);
        let mut e = JoinEngine::new(JoinConfig {
            max_pending: 100,
            timeout_ns: u64::MAX / 4,
            ..JoinConfig::default()
        });
        let mut out = Vec::new();
        for h in s.host.iter().cloned() {
            e.push_host(h, &mut out);
            assert!(e.stats().pending_host <= 100);
        }
        assert_eq!(out.len(), 900);
        assert!(out
            .iter()
            .all(|j| j.reason == Some(UnmatchedReason::Evicted)));
        assert_eq!(e.stats().evicted, 900);
        e.flush(&mut out);
        assert_eq!(out.len(), 1000);
    }

    #[test]
    fn guest_only_vm_expires_by_guest_time() {
        let s = generate(&SynthConfig {
            requests: 200,
            probe_every_ns: 0,
            ..SynthConfig::default()
        });
        let mut e = JoinEngine::new(JoinConfig {
            timeout_ns: 1_000_000,
            ..JoinConfig::default()
        });
        let mut out = Vec::new();
        for g in s.guest.iter().cloned() {
            e.push_guest("vm0", g, &mut out);
        }
        assert!(out.len() > 150, "{}", out.len());
        assert!(out
            .iter()
            .all(|j| j.reason == Some(UnmatchedReason::NoHostRecord)
                && j.ts_domain == ClockDomain::Guest));
    }

    #[test]
    fn advance_expires_in_live_mode() {
        let s = generate(&SynthConfig {
            requests: 50,
            ..SynthConfig::default()
        });
        let mut e = JoinEngine::new(JoinConfig {
            timeout_ns: 1_000_000_000,
            ..JoinConfig::default()
        });
        let mut out = Vec::new();
        for &(a, b, c, d) in &s.probes {
            e.clock("vm0").add_guest_probe(a, b, c, d).unwrap();
        }
        // The guest sent 10 requests; the host saw all 50.
        for g in s.guest.iter().take(10).cloned() {
            e.push_guest("vm0", g, &mut out);
        }
        for h in s.host.iter().cloned() {
            e.push_host(h, &mut out);
        }
        assert_eq!(out.len(), 10);
        let last = s
            .host
            .iter()
            .filter_map(|h| h.ts.get(Point::HostIrq))
            .max()
            .unwrap();
        e.advance(last + 500_000_000, &mut out);
        assert_eq!(out.len(), 10, "not yet");
        e.advance(last + 2_500_000_000, &mut out);
        assert_eq!(out.len(), 50);
        assert!(out[10..]
            .iter()
            .all(|j| j.reason == Some(UnmatchedReason::NoGuestRecord)));
        assert_eq!(e.stats().pending_host, 0);
    }

    #[test]
    fn learned_disk_device_binding_separates_disks() {
        let s = generate(&SynthConfig {
            requests: 3,
            ..SynthConfig::default()
        });
        let mut e = JoinEngine::default();
        let mut out = Vec::new();
        for &(a, b, c, d) in &s.probes {
            e.clock("vm0").add_guest_probe(a, b, c, d).unwrap();
        }
        // Learn vda ↔ d0 and vdb ↔ d1 from two distinct requests.
        let mut g0 = s.guest[0].clone();
        let mut h0 = s.host[0].clone();
        g0.disk = "vda".into();
        h0.device = "d0".into();
        let mut g1 = s.guest[1].clone();
        let mut h1 = s.host[1].clone();
        g1.disk = "vdb".into();
        h1.device = "d1".into();
        e.push_host(h0, &mut out);
        e.push_guest("vm0", g0, &mut out);
        e.push_host(h1, &mut out);
        e.push_guest("vm0", g1, &mut out);
        assert_eq!(out.iter().filter(|j| j.joined).count(), 2);
        // Now two identical host elements on both devices; the vdb request must
        // take the d1 one.
        let mut g2 = s.guest[2].clone();
        g2.disk = "vdb".into();
        let mut ha = s.host[2].clone();
        ha.device = "d0".into();
        let mut hb = s.host[2].clone();
        hb.device = "d1".into();
        e.push_host(ha, &mut out);
        e.push_host(hb, &mut out);
        e.push_guest("vm0", g2, &mut out);
        let j = out.last().unwrap();
        assert!(j.joined);
        assert_eq!(j.disk.as_deref(), Some("vdb"));
        assert_eq!(j.device.as_deref(), Some("d1"));
    }

    #[test]
    fn reboot_resets_the_clock() {
        let mut e = JoinEngine::default();
        assert!(!e.guest_connected("vm0", "boot-a"));
        e.clock("vm0")
            .add_guest_probe(10, 1_000_010, 1_000_011, 20)
            .unwrap();
        assert!(e.clock("vm0").is_synced());
        // Same boot (a reconnect): the clock is kept.
        assert!(!e.guest_connected("vm0", "boot-a"));
        assert!(e.clock("vm0").is_synced());
        // New boot: reset.
        assert!(e.guest_connected("vm0", "boot-b"));
        assert!(!e.clock("vm0").is_synced());
    }

    #[test]
    fn stale_heap_entries_are_compacted_when_time_stalls() {
        let s = generate(&SynthConfig {
            requests: 20_000,
            probe_every_ns: 0,
            ..SynthConfig::default()
        });
        let mut e = JoinEngine::new(JoinConfig {
            timeout_ns: u64::MAX / 4,
            ..JoinConfig::default()
        });
        let mut out = Vec::new();
        // Host first then guest, one request at a time: each host waits, then joins.
        for (g, h) in s.guest.iter().zip(&s.host) {
            e.push_host(h.clone(), &mut out);
            e.push_guest("vm0", g.clone(), &mut out);
        }
        assert_eq!(out.len(), 20_000);
        assert!(
            e.vms[0].host_heap.len() <= 4096 + 4,
            "{}",
            e.vms[0].host_heap.len()
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        /// Any mix of queues, batching, merges, sector reuse, drift, lag and
        /// reordering: every request joins its own element. (Without any clock
        /// probe and with a tiny set of sectors, candidates can be genuinely
        /// ambiguous; that case is only run with a large sector space.)
        #[test]
        fn random_streams_join_exactly(
            seed in proptest::prelude::any::<u64>(),
            queues in 1u16..5,
            batch in 1usize..5,
            merge in proptest::prelude::any::<bool>(),
            few_blocks in proptest::prelude::any::<bool>(),
            drift_ppm in -100.0f64..100.0,
            theta in -1_000_000_000_000i64..1_000_000_000_000,
            lag_us in 0u64..20_000,
            shuffle in 0usize..400,
            interval_us in 5u64..300,
            probes in proptest::prelude::any::<bool>(),
        ) {
            let cfg = SynthConfig {
                requests: 400,
                queues,
                batch,
                merge,
                blocks: if few_blocks && probes { 4 } else { 1 << 20 },
                drift_ppm,
                theta_ns: theta,
                interval_ns: interval_us * 1000,
                seed,
                start_ns: 2_000_000_000_000,
                probe_every_ns: if probes { 50_000_000 } else { 0 },
                ..SynthConfig::default()
            };
            let s = generate(&cfg);
            let mut e = JoinEngine::default();
            let out = run(&mut e, "vm0", interleave(&s, lag_us * 1000, shuffle, seed ^ 1));
            check_all_joined(&s, &out);
        }
    }

    #[test]
    fn offline_join_of_two_recordings_without_probes() {
        let s = generate(&SynthConfig {
            requests: 5000,
            queues: 2,
            probe_every_ns: 0,
            theta_ns: -123_456_789,
            seed: 21,
            ..SynthConfig::default()
        });
        for guest_first in [true, false] {
            let mut e = JoinEngine::new(JoinConfig::offline());
            let mut ev: Vec<Event> = Vec::new();
            let gs = s.guest.iter().cloned().map(Event::Guest);
            let hs = s.host.iter().cloned().map(Event::Host);
            if guest_first {
                ev.extend(gs);
                ev.extend(hs);
            } else {
                ev.extend(hs);
                ev.extend(gs);
            }
            let out = run(&mut e, "vm0", ev);
            check_all_joined(&s, &out);
        }
    }

    /// Scale check for offline joins: `cargo test --release -p viotrace-shared
    /// --lib offline_scale -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn offline_scale() {
        let s = generate(&SynthConfig {
            requests: 150_000,
            queues: 2,
            interval_ns: 200_000,
            probe_every_ns: 0,
            ..SynthConfig::default()
        });
        let t = std::time::Instant::now();
        let mut e = JoinEngine::new(JoinConfig::offline());
        let mut ev: Vec<Event> = s.guest.iter().cloned().map(Event::Guest).collect();
        ev.extend(s.host.iter().cloned().map(Event::Host));
        let out = run(&mut e, "vm0", ev);
        eprintln!("offline join of 2x150k records: {:?}", t.elapsed());
        check_all_joined(&s, &out);
    }

    #[test]
    fn headless_guest_records_join_on_sector() {
        let mut s = generate(&SynthConfig {
            requests: 500,
            seed: 8,
            ..SynthConfig::default()
        });
        for g in &mut s.guest {
            g.queue = None;
            g.head = None;
        }
        let mut e = JoinEngine::default();
        let out = run(&mut e, "vm0", interleave(&s, 1_500_000, 100, 5));
        check_all_joined(&s, &out);
    }

    #[test]
    fn vms_do_not_cross() {
        let a = generate(&SynthConfig {
            vm: "a".into(),
            requests: 300,
            seed: 10,
            ..SynthConfig::default()
        });
        let b = generate(&SynthConfig {
            vm: "b".into(),
            requests: 300,
            seed: 10,
            theta_ns: -2_000_000_000,
            ..SynthConfig::default()
        });
        let mut e = JoinEngine::default();
        let mut out = Vec::new();
        for (vm, s) in [("a", &a), ("b", &b)] {
            for &(t1, t2, t3, t4) in &s.probes {
                e.clock(vm).add_guest_probe(t1, t2, t3, t4).unwrap();
            }
        }
        for i in 0..300 {
            e.push_host(a.host[i].clone(), &mut out);
            e.push_host(b.host[i].clone(), &mut out);
            e.push_guest("b", b.guest[i].clone(), &mut out);
            e.push_guest("a", a.guest[i].clone(), &mut out);
        }
        e.flush(&mut out);
        assert_eq!(out.iter().filter(|j| j.joined).count(), 600);
        check_all_joined(
            &a,
            &out.iter()
                .filter(|j| j.vm == "a")
                .cloned()
                .collect::<Vec<_>>(),
        );
        check_all_joined(
            &b,
            &out.iter()
                .filter(|j| j.vm == "b")
                .cloned()
                .collect::<Vec<_>>(),
        );
    }

    #[test]
    fn json_line_has_kind_io() {
        let s = generate(&SynthConfig {
            requests: 3,
            ..SynthConfig::default()
        });
        let mut e = JoinEngine::default();
        let out = run(&mut e, "vm0", interleave(&s, 0, 0, 0));
        let line = serde_json::to_string(&crate::record::Record::Io(out[0].clone())).unwrap();
        assert!(line.starts_with(r#"{"kind":"io","vm":"vm0""#), "{line}");
        assert!(line.contains(r#""stages":{"guest_queue":"#), "{line}");
        let back: crate::record::Record = serde_json::from_str(&line).unwrap();
        assert_eq!(back, crate::record::Record::Io(out[0].clone()));
    }

    #[test]
    fn guest_and_host_only_breakdowns() {
        let s = generate(&SynthConfig {
            requests: 1,
            ..SynthConfig::default()
        });
        let g = guest_breakdown(&s.guest[0]);
        assert!(g.stages.get("device").is_some());
        let h = host_breakdown(&s.host[0]);
        assert_eq!(
            h.stages.iter().map(|e| e.0).collect::<Vec<_>>(),
            ["qemu_submit", "host_io", "qemu_complete"]
        );
    }
}

#[cfg(test)]
mod notification_tests {
    use super::*;

    #[test]
    fn kick_after_pop_and_irq_before_push_are_dropped() {
        let mut ts: Points = [
            (Point::VqAdd, 100),
            (Point::Kick, 500),
            (Point::HostPop, 300),
            (Point::HostPush, 900),
            (Point::Irq, 700),
            (Point::DriverComplete, 1000),
        ]
        .into_iter()
        .collect();
        drop_unrelated_notifications(&mut ts, 50);
        assert_eq!(ts.get(Point::Kick), None);
        assert_eq!(ts.get(Point::Irq), None);
        let bd = stages::derive(&ts);
        assert!(bd.stages.iter().all(|(_, ns)| ns >= 0), "{:?}", bd.stages);
    }

    #[test]
    fn causal_notifications_within_uncertainty_stay() {
        let mut ts: Points = [
            (Point::Kick, 320),
            (Point::HostPop, 300),
            (Point::HostPush, 900),
            (Point::Irq, 880),
        ]
        .into_iter()
        .collect();
        drop_unrelated_notifications(&mut ts, 50);
        assert_eq!(ts.get(Point::Kick), Some(320));
        assert_eq!(ts.get(Point::Irq), Some(880));
    }
}
